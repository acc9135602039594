"""Dead letters: operator actions on the dead-letter table and controlled, audited replay."""
