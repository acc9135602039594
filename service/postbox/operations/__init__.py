"""Running Postbox: process runtime, status, maintenance jobs, metrics, logs and tracing."""
