"""What one writer can do to another's events (issue #47, "idempotency-key squatting";
deploy/README.md, "Threat model"): a hostile writer role (`writer_url`, `grant
--writer-role`) against an honest one (`second_writer_url`, another `grant
--writer-role`), published by a relay as the relay role."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from relay import Event, Outbox
from relay.daemon import Relay
from relay.errors import DatabaseError
from tests.support import SECOND_WRITER_ROLE, WRITER_ROLE, Roles, consume, run_cli, sub

TRANSFER: dict[str, Any] = dict(
    aggregate_type="account", aggregate_id="a-1", event_type="TransferRequested"
)


def test_a_key_taken_by_another_writer_holds_back_no_event(
    writer_url: str,
    second_writer_url: str,
    start_relay: Callable[..., Relay],
    kafka_bootstrap: str,
    topic_prefix: str,
) -> None:
    """The squatter uses the honest writer's next key first. The honest append still
    writes its own event, and both events reach Kafka, each under its own message id."""
    outbox = Outbox(None)
    with psycopg.connect(writer_url, autocommit=True) as hostile:
        squatted = outbox.append(
            hostile, payload={"to": "attacker-account"}, idempotency_key="req-7", **TRANSFER
        )
    with psycopg.connect(second_writer_url, autocommit=True) as honest:
        honest_event = {"to": "a-2", "amount_cents": 500}
        own = outbox.append(honest, payload=honest_event, idempotency_key="req-7", **TRANSFER)
        retried = outbox.append(honest, payload=honest_event, idempotency_key="req-7", **TRANSFER)
    assert own != squatted and retried == own
    start_relay(subscribers=[sub("s", topic_prefix, value_format="json")])
    seen = consume(kafka_bootstrap, [topic_prefix + "outbox.event.account"], 2)
    published = {r.message_id: json.loads(r.value or b"") for r in seen}
    assert published == {str(squatted): {"to": "attacker-account"}, str(own): honest_event}
    assert len(seen) == 2


def test_a_writer_kept_to_its_aggregate_types_writes_no_other_stream(
    writer_url: str,
    second_writer_url: str,
    database_url: str,
    start_relay: Callable[..., Relay],
    kafka_bootstrap: str,
    topic_prefix: str,
) -> None:
    """`grant --aggregate-types`: the hostile writer may write payments only, the honest
    one orders only. The hostile one can no longer write version 1 of an order stream
    (through the API or plain SQL), the honest one's stream starts at its own version 1,
    and the relay still reads and publishes every row."""
    owner = {"RELAY_DATABASE_URL": database_url}
    for role, types in ((WRITER_ROLE, "payment"), (SECOND_WRITER_ROLE, "order, invoice")):
        granted = run_cli("grant", "--writer-role", role, "--aggregate-types", types, env=owner)
        assert granted.returncode == 0, granted.stderr
        assert f"(only) to {role}" in granted.stdout
    outbox = Outbox(None)
    placed = [Event("OrderPlaced", {"order_id": "o-1"})]
    stream = dict(aggregate_type="order", aggregate_id="o-1", expected_version=0)
    with psycopg.connect(writer_url, autocommit=True) as hostile:
        with pytest.raises(DatabaseError, match=f"aggregate types of {WRITER_ROLE}"):
            outbox.append_to_stream(hostile, events=placed, **stream)
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match="row-level security"):
            hostile.execute(
                "INSERT INTO outbox (aggregate_type, aggregate_id, aggregate_version, event_type,"
                " payload) VALUES ('order', 'o-1', 1, 'OrderPlaced', '{}')"
            )
        outbox.append(
            hostile, aggregate_type="payment", aggregate_id="p-1", event_type="PaymentTaken",
            payload={"amount_cents": 1},
        )  # fmt: skip
        # `grant` again without the flag (as after an upgrade) keeps the restriction.
        regranted = run_cli("grant", "--writer-role", WRITER_ROLE, env=owner)
        assert regranted.returncode == 0, regranted.stderr
        with pytest.raises(DatabaseError, match="row-level security"):
            outbox.append_to_stream(hostile, events=placed, **stream)
    with psycopg.connect(second_writer_url, autocommit=True) as honest:
        assert outbox.append_to_stream(honest, events=placed, **stream).version == 1
    start_relay(subscribers=[sub("s", topic_prefix, value_format="json")])
    topics = [topic_prefix + "outbox.event.order", topic_prefix + "outbox.event.payment"]
    seen = consume(kafka_bootstrap, topics, 2)
    assert sorted((r.topic, r.header_text("aggregate_version")) for r in seen) == [
        (topics[0], "1"),
        (topics[1], None),
    ]
    lifted = run_cli("grant", "--writer-role", WRITER_ROLE, "--aggregate-types", "*", env=owner)
    assert lifted.returncode == 0 and f"any aggregate type to {WRITER_ROLE}" in lifted.stdout
    with psycopg.connect(writer_url, autocommit=True) as hostile:
        outbox.append(
            hostile, aggregate_type="order", aggregate_id="o-2", event_type="OrderPlaced",
            payload={},
        )  # fmt: skip


def test_grant_refuses_an_empty_aggregate_type(database_url: str) -> None:
    refused = run_cli(
        "grant", "--writer-role", WRITER_ROLE, "--aggregate-types", "order,,payment",
        env={"RELAY_DATABASE_URL": database_url},
    )  # fmt: skip
    assert refused.returncode == 2 and "empty type" in refused.stderr


def test_grant_leaves_row_security_of_the_operators_own_alone(
    db: psycopg.Connection[Any], database_url: str, roles: Roles
) -> None:
    """Row-level security the owner set up on the outbox itself (deliberately, as the
    owner) is not widened by `grant`'s permissive policy: the restriction is refused."""
    db.execute("CREATE POLICY own ON outbox FOR SELECT USING (aggregate_type <> 'secret')")
    db.execute("ALTER TABLE outbox ENABLE ROW LEVEL SECURITY")
    refused = run_cli(
        "grant", "--writer-role", WRITER_ROLE, "--aggregate-types", "order",
        env={"RELAY_DATABASE_URL": database_url},
    )  # fmt: skip
    assert refused.returncode != 0 and "policies of your own" in refused.stderr
    assert db.execute("SELECT polname FROM pg_policy").fetchall() == [("own",)]
