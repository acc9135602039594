"""The outbox side: the relay, the bridge, and one module per broker (its transport and its bridge source)."""
