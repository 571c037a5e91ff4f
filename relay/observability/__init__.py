"""Observability: metrics, tracing and logging."""
