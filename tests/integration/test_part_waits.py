"""What a waiting part records for `status` (issue #48, migration 0020), in Postgres, as
the relay role: only the part's owner writes it, the checkpoint's version does not move,
the wait keeps the time it began while what it waits for changes, and a schema before
0020 records nothing and shows nothing (a rolling deploy)."""

from __future__ import annotations

import uuid
from typing import Any

import psycopg

from relay.adapters.postgres import migrations
from relay.adapters.postgres.store import OutboxStore
from relay.core.model import PartId
from relay.core.subscribers import Subscriber
from relay.errors import DatabaseError

PART = PartId("s", 0)


def claimed(store: OutboxStore) -> uuid.UUID:
    store.add(Subscriber("s", topic="t"))
    owner = store.open_session("host", 1, 60)
    assert store.claim("s", 0, owner)
    return owner


def test_only_the_owner_records_a_wait_and_the_checkpoint_stays(
    relay_db: psycopg.Connection[Any],
) -> None:
    store = OutboxStore(relay_db)
    owner = claimed(store)
    version = store.get_part("s", 0).version
    store.record_wait(PART, uuid.uuid4(), "topic", "not the owner's")
    assert store.part_waits() == {}
    store.record_wait(PART, owner, "topic", "waiting for topic 't'")
    first = store.part_waits()[PART]
    assert (first.waits_on, first.error) == ("topic", "waiting for topic 't'")
    store.record_wait(PART, owner, "kafka_acl", "refused")  # what for changed: since stays
    assert store.part_waits()[PART] == first._replace(waits_on="kafka_acl", error="refused")
    assert store.get_part("s", 0).version == version
    store.close_session(owner)  # a part no live relay owns shows no wait
    assert store.part_waits() == {}
    owner = store.open_session("host", 2, 60)
    assert store.claim("s", 0, owner)
    store.record_wait(PART, owner, None, None)
    assert store.part_waits() == {}


def test_a_schema_before_0020_records_and_shows_no_wait(database_url: str) -> None:
    with psycopg.connect(database_url, autocommit=True) as conn:
        migrations.migrate(conn, up_to=19)  # the relay as the owner: grant needs them all
        store = OutboxStore(conn)
        owner = claimed(store)
        assert store.part_waits() == {}
        try:
            store.record_wait(PART, owner, "topic", "waiting")
        except DatabaseError as exc:
            assert exc.sqlstate == "42703"  # undefined column: the worker skips it
        else:
            raise AssertionError("a schema before 0020 took a wait")
