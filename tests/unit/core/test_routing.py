"""Routing control (issue #33): the key template, the partition field and placements,
as a subscriber declares them and as the encoder applies them (no servers)."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from relay.core.model import OutboxEvent
from relay.core.settings import load_settings
from relay.core.subscribers import Subscriber, ValueFormat, partition_shortfall
from relay.engine.encoding import RecordEncoder
from relay.errors import ConfigError, EncodingError, SubscriberError

AT = datetime(2026, 11, 25, 4, 30, tzinfo=UTC)


def event(payload: Any = None, headers: dict[str, Any] | None = None) -> OutboxEvent:
    return OutboxEvent(
        7,
        2,
        uuid.UUID(int=5),
        "order",
        "o-1",
        3,
        "OrderPlaced",
        {"tenant": "acme", "shard": 2} if payload is None else payload,
        headers if headers is not None else {"region": "eu"},
        AT,
    )


def routed(**routing: Any) -> Subscriber:
    return Subscriber.from_dict(
        {"name": "s", "topic": "t", "value_format": ValueFormat.JSON, **routing}
    )


def encode(subscriber: Subscriber, e: OutboxEvent | None = None) -> Any:
    return RecordEncoder(None).encode(e or event(), subscriber)


def test_the_default_is_the_aggregate_id_and_the_producers_partitioner() -> None:
    record = encode(routed())
    assert (record.key, record.partition) == (b"o-1", None)


@pytest.mark.parametrize(
    ("template", "key"),
    [
        ("{payload.tenant}", b"acme"),
        ("{payload.tenant}:{aggregate_id}", b"acme:o-1"),
        ("{aggregate_type}/{aggregate_id}/{event_type}", b"order/o-1/OrderPlaced"),
        ("{headers.region}-{aggregate_version}", b"eu-3"),
        ("{payload.shard}", b"2"),  # not a string: its JSON
        ("{message_id}", str(uuid.UUID(int=5)).encode()),
    ],
)
def test_a_key_template_renders_the_rows_fields(template: str, key: bytes) -> None:
    assert encode(routed(key=template)).key == key


def test_a_row_without_a_field_its_key_needs_is_that_rows_poison() -> None:
    with pytest.raises(EncodingError, match=r"its key needs payload\.tenant"):
        encode(routed(key="{payload.tenant}"), event({"other": 1}))
    with pytest.raises(EncodingError, match="its key needs"):
        encode(routed(key="{payload.tenant}"), event({"tenant": None}))
    with pytest.raises(EncodingError, match="its key needs"):
        encode(routed(key="{payload.tenant}"), event(["not", "an", "object"]))


@pytest.mark.parametrize(
    ("key", "message"),
    [
        ("tenant", "names no field"),
        ("{tenant}", "not a field"),
        ("{payload.}", "not a field"),
        ("{payload.a}}", "unbalanced"),
        ("{{payload.a}", "unbalanced"),
        ("", "1-512"),
    ],
)
def test_a_malformed_key_is_refused_with_the_reason(key: str, message: str) -> None:
    with pytest.raises(SubscriberError, match=message):
        routed(key=key)


@pytest.mark.parametrize(("value", "partition"), [(0, 0), (5, 5), ("3", 3)])
def test_the_partition_field_chooses_the_partition(value: Any, partition: int) -> None:
    record = encode(routed(partition_by="payload.p", partition_count=6), event({"p": value}))
    assert record.partition == partition


@pytest.mark.parametrize("value", [-1, 1.5, "x", True, 2**40, {"a": 1}])
def test_a_partition_that_is_not_a_partition_number_is_the_rows_poison(value: Any) -> None:
    with pytest.raises(EncodingError, match="not a partition number"):
        encode(routed(partition_by="payload.p", partition_count=3), event({"p": value}))
    with pytest.raises(EncodingError, match="its partition needs"):
        encode(routed(partition_by="payload.p", partition_count=3), event({}))


def test_a_partition_beyond_the_partition_count_is_the_rows_poison() -> None:
    subscriber = routed(partition_by="payload.p", partition_count=3)
    assert encode(subscriber, event({"p": 2})).partition == 2
    with pytest.raises(EncodingError, match=r"out of range.*partition_count is 3"):
        encode(subscriber, event({"p": 3}))


@pytest.mark.parametrize(
    ("routing", "message"),
    [
        ({"partition_by": "payload.p"}, "needs partition_count"),
        ({"partition_count": 3}, "only with partition_by"),
        ({"partition_by": "payload.p", "partition_count": 0}, "1 to"),
    ],
)
def test_a_partition_field_comes_with_its_partition_count(
    routing: dict[str, Any], message: str
) -> None:
    with pytest.raises(SubscriberError, match=message):
        routed(**routing)


def shortfall(
    topic: str,
    existing: dict[str, int],
    *,
    create_topics: bool = True,
    topic_partitions: int = 3,
    count: int = 4,
) -> str | None:
    subscriber = Subscriber(
        "s", topic=topic, value_format=ValueFormat.JSON, partition_by="payload.p",
        partition_count=count,
    )  # fmt: skip
    return partition_shortfall(
        subscriber, existing, create_topics=create_topics, topic_partitions=topic_partitions
    )


def test_a_partition_count_the_topics_cannot_hold_is_refused() -> None:
    # A fixed topic that exists: its own count, whatever topic_partitions says.
    assert shortfall("t", {"t": 4}) is None
    assert "its topic 't' has 3 partitions" in (shortfall("t", {"t": 3}, topic_partitions=9) or "")
    # One the relay is to create gets topic_partitions.
    assert "topic_partitions (3)" in (shortfall("t", {}) or "")
    assert shortfall("t", {}, topic_partitions=4) is None
    assert "create_topics is false" in (shortfall("t", {}, create_topics=False) or "")
    # A template: every topic of it that exists, and those to create.
    assert "'t.order' has 2" in (shortfall("t.{aggregate_type}", {"t.order": 2, "u": 1}) or "")
    assert shortfall("t.{aggregate_type}", {"t.order": 5, "u": 1}, topic_partitions=4) is None
    assert shortfall("t.{aggregate_type}", {"t.order": 5}, create_topics=False) is None


def test_header_placements_add_headers_and_a_missing_field_has_no_value() -> None:
    record = encode(
        routed(
            placements=["payload.tenant:header:tenant", "occurred_at:header", "payload.x:header"]
        )
    )
    headers = dict(record.headers)
    assert headers["tenant"] == b"acme"
    assert headers["occurred_at"] == AT.isoformat().encode()
    assert headers["x"] is None
    assert headers["id"] == str(uuid.UUID(int=5)).encode()  # the relay's own stay
    assert record.byte_size() == len(record.key) + len(record.value) + sum(
        len(n) + len(v or b"") for n, v in record.headers
    )


def test_a_placement_replaces_the_rows_header_of_that_name() -> None:
    record = encode(routed(placements=["payload.tenant:header:region"]))
    assert [v for n, v in record.headers if n == "region"] == [b"acme"]


def test_envelope_placements_wrap_the_json_payload() -> None:
    record = encode(
        routed(placements=["aggregate_version:envelope:version", "event_type:envelope"])
    )
    assert json.loads(record.value) == {
        "payload": {"tenant": "acme", "shard": 2},
        "version": 3,
        "event_type": "OrderPlaced",
    }


@pytest.mark.parametrize(
    ("placements", "message"),
    [
        (["payload.a:body"], "header or envelope"),
        (["payload.a"], "expected field"),
        (["payload.a:header:id"], "the relay's own"),
        (["payload.a:header:outbox.error"], "the relay's own"),
        (["payload.a:envelope:payload"], "envelope's own"),
        (["payload.a:header:x", "payload.b:header:x"], "same header"),
        (["nope:header"], "not a field"),
    ],
)
def test_malformed_placements_are_refused(placements: list[str], message: str) -> None:
    with pytest.raises(SubscriberError, match=message):
        routed(placements=placements)


def test_an_envelope_is_refused_for_formats_whose_schema_fixes_the_value() -> None:
    with pytest.raises(SubscriberError, match="envelope placement changes the value"):
        Subscriber("s", value_format=ValueFormat.AVRO, placements=("event_type:envelope",))
    # A header is fine in Avro.
    Subscriber("s", value_format=ValueFormat.AVRO, placements=("event_type:header:kind",))


def test_the_debezium_format_takes_its_routing_from_attach() -> None:
    with pytest.raises(SubscriberError, match="debezium attach"):
        Subscriber("s", value_format=ValueFormat.DEBEZIUM, key="{payload.tenant}")


def test_routing_survives_the_stores_round_trip() -> None:
    subscriber = routed(
        key="{payload.tenant}",
        partition_by="headers.p",
        partition_count=8,
        placements=["event_type:header:kind"],
    )
    stored = {**subscriber.as_dict()}
    routing = {k: stored.pop(k) for k in ("key", "partition_by", "partition_count", "placements")}
    assert Subscriber.from_dict({**stored, "routing": routing}) == subscriber


def test_settings_name_the_key_that_is_wrong(tmp_path: Path) -> None:
    config = tmp_path / "relay.toml"
    config.write_text('[[subscribers]]\nname = "s"\nkey = "{tenant}"\n')
    with pytest.raises(ConfigError, match=r"subscribers\.0\.key.*not a field"):
        load_settings(config_file=config)
    config.write_text('[[subscribers]]\nname = "s"\nplacements = ["a:b"]\n')
    with pytest.raises(ConfigError, match=r"subscribers\.0\.placements.*not a field"):
        load_settings(config_file=config)
    config.write_text('[[subscribers]]\nname = "s"\npartition_by = "payload.p"\n')
    with pytest.raises(ConfigError, match=r"subscribers\.0.*needs partition_count"):
        load_settings(config_file=config)
