"""The version of this Postbox release (one place; the root module and the CLI re-export it)."""

__version__ = "0.1.0"
