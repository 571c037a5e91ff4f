"""Readers of the consumers' sinks (``outbox-relay verify --through``), one module each,
registered by name in ``relay.wiring``: what a sink holds, as its readers see it."""
