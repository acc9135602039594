"""The operator console: a web page over the same audited SQL operations as the CLI (``postbox console``)."""
