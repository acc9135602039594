"""Fault-injection harness (after Jepsen's method): record every operation, inject faults, heal,
drain, then check. ``python -m tests.chaos`` (``make chaos``) runs every fault for
``CHAOS_ITERATIONS`` cycles and prints a table; ``tests/test_chaos.py`` runs each fault briefly
inside ``make test``."""
