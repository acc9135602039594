"""The inbox side: handlers, the connection they get, and the worker that claims and completes messages."""
