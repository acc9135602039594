"""Failures: handler outcomes, classification of exceptions, retry policy, circuit breaker."""
