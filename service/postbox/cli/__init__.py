"""The ``postbox`` command: one package, one module per group of commands."""

from postbox.cli.root import main

__all__ = ["main"]
