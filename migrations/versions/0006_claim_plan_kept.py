"""A claim is planned once per session, not at every call: inbox_claim_v1 and outbox_claim_v1 keep
their signatures, bodies and results, and run with ``plan_cache_mode = force_generic_plan``. With
the server's default, the planner judged the claim's generic plan dearer than the plans made for
each call's values and so planned it again at every call: about half of a claim's server time for
a batch of 10. The generic plan reads the same index (the claim's plan test checks both).

Expand only; no table changes, the functions' grants and other settings unchanged.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-03
"""

from postbox.schema.apply_sql import apply_frozen

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

FUNCTIONS: list[str] = []  # no sql/ file: the revision's SQL is below
_CLAIMS = (
    "postbox.inbox_claim_v1(text, text, integer, interval, timestamptz)",
    "postbox.outbox_claim_v1(text, text, integer, interval, timestamptz)",
)
UPGRADE = "".join(f"ALTER FUNCTION {f} SET plan_cache_mode = force_generic_plan;\n" for f in _CLAIMS)
DOWNGRADE = "".join(f"ALTER FUNCTION {f} RESET plan_cache_mode;\n" for f in _CLAIMS)

RELEASED_SHA256 = "5c2befa96c1a1b29591fccf3460a79f9fb039c68baed0bb52e4496d2d42c40ed"


def statements() -> list[str]:
    """Every SQL text this revision applies, in order."""
    return [UPGRADE]


def downgrade_statements() -> list[str]:
    return [DOWNGRADE]


def frozen() -> list[str]:
    """All the SQL of this revision, both ways: what RELEASED_SHA256 pins."""
    return [*statements(), *downgrade_statements()]


def upgrade() -> None:
    apply_frozen(revision, RELEASED_SHA256, frozen(), run=statements())


def downgrade() -> None:
    apply_frozen(revision, RELEASED_SHA256, frozen(), run=downgrade_statements())
