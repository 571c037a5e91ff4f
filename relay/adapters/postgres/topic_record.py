"""The topics this outbox created, in Postgres (``outbox_topics``, migration 0017): the
Postgres adapter of :class:`relay.core.ports.TopicRecord` (docs/design.md §7, "Rows name
topics"). Every call borrows a connection (the relay's pool, or a command's own) for as
long as it runs: topic creation is rare, and the relay's connections are few."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import Any

import psycopg

from relay.adapters.postgres.db import wrap_errors
from relay.adapters.postgres.queries import parse_named, read_sql, with_schema
from relay.core.ports import TopicOrigin
from relay.errors import UndefinedTableError

Connect = Callable[[], AbstractContextManager[psycopg.Connection[Any]]]

_QUERIES = parse_named(read_sql("topics.sql"))


class PostgresTopicRecord:
    """The record of ``schema``'s topics, on connections from ``connect`` (autocommit).
    On a schema before migration 0017 (a rolling deploy), it keeps none: it says so with
    None, and adopts nothing."""

    def __init__(self, connect: Connect, schema: str = "public") -> None:
        self._connect = connect
        self._schema = schema
        self._q = {name: with_schema(text, schema) for name, text in _QUERIES.items()}

    def recorded(self) -> frozenset[str] | None:
        try:
            with self._connect() as conn, wrap_errors():
                return frozenset(t for (t,) in conn.execute(self._q["recorded"]))
        except UndefinedTableError:
            return None

    def record(self, topics: Iterable[str], origin: TopicOrigin) -> None:
        names = sorted(set(topics))
        if not names:
            return
        try:
            with self._connect() as conn, wrap_errors():
                conn.execute(self._q["record"], {"topics": names, "origin": origin.value})
        except UndefinedTableError:
            return  # before migration 0017: nothing to record in

    def reserve(self, topic: str, cap: int | None) -> bool | None:
        try:
            with self._connect() as conn, wrap_errors(), conn.transaction():
                conn.execute(self._q["lock"], {"schema": self._schema})
                found = conn.execute(self._q["reserve"], {"topic": topic, "cap": cap}).fetchone()
        except UndefinedTableError:
            return None
        return found is not None

    def release(self, topic: str) -> None:
        with self._connect() as conn, wrap_errors():
            conn.execute(self._q["release"], {"topic": topic})

    def row_topics(self) -> int | None:
        try:
            with self._connect() as conn, wrap_errors():
                row = conn.execute(self._q["row_topics"]).fetchone()
        except UndefinedTableError:
            return None
        return int(row[0]) if row else 0

    def adoption_pending(self) -> bool:
        try:
            with self._connect() as conn, wrap_errors():
                row = conn.execute(self._q["adoption_pending"]).fetchone()
        except UndefinedTableError:
            return False
        return bool(row and row[0])

    def adopt(self, topics: Iterable[str]) -> bool:
        names = sorted(set(topics))
        with self._connect() as conn, wrap_errors(), conn.transaction():
            if conn.execute(self._q["adoption_claim"]).fetchone() is None:
                return False  # another relay adopted them first
            params = {"topics": names, "origin": TopicOrigin.ADOPTED.value}
            conn.execute(self._q["record"], params)
        return True
