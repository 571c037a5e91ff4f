"""A log line's structured fields, built in one place (after procrastinate's
``_log_extra(action=...)``): every log call of relay/ and spark_jobs/ passes
``extra=log_extra("stable_event_name", ...)``, or a helper of its context that adds the
context's fields (a part, a session, a producer) and calls this. A core module, so the
adapters and the Spark jobs may log through it too."""

from __future__ import annotations


def log_extra(event: str, **fields: object) -> dict[str, object]:
    """A log line's structured fields (its ``extra``): the stable event name operators
    filter on, then its context. Numbers, booleans and None stay as they are, a list
    stays a list (a JSON array) of such values; anything else (a part, a position, a
    message id: tuples among them) is logged as its text."""
    return {"event": event, **{k: _plain(v) for k, v in fields.items()}}


def _plain(value: object) -> object:
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value if value is None or isinstance(value, int | float) else str(value)
