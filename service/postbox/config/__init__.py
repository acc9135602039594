"""Settings (environment, TOML file, flags) and per-consumer policies."""
