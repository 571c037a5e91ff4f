"""The write path: plain SQL, the Python append API, event-sourced appends."""

from __future__ import annotations

import threading
from typing import Any
from uuid import UUID

import psycopg
import pytest

from relay import ConcurrencyError, Event, IdempotencyKeyReused, Outbox, PayloadValidationError
from relay.adapters.postgres import migrations

ORDER = {"order_id": "o-1", "customer_id": "c-1", "amount_cents": 1250}


def count(db: psycopg.Connection[Any]) -> int:
    row = db.execute("SELECT count(*) FROM outbox").fetchone()
    assert row is not None
    return int(row[0])


def test_plain_sql_insert_fills_every_default(
    writer_db: psycopg.Connection[Any], db: psycopg.Connection[Any]
) -> None:
    with writer_db.transaction():
        writer_db.execute(
            """INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
               VALUES ('order', '42', 'OrderPlaced', '{"order_id": "42"}')"""
        )
        xid = writer_db.execute("SELECT pg_current_xact_id()::text::bigint").fetchone()
    row = db.execute(  # the owner reads back: writers read no payloads or keys
        "SELECT transaction_id::text::bigint, position, message_id, headers, occurred_at FROM outbox"
    ).fetchone()
    assert row is not None
    assert (row[0],) == xid
    assert row[1] >= 1 and isinstance(row[2], UUID) and row[3] == {} and row[4] is not None


def test_append_writes_inside_the_callers_transaction(
    writer_db: psycopg.Connection[Any], db: psycopg.Connection[Any], outbox: Outbox
) -> None:
    with writer_db.transaction() as tx:  # the API takes a Transaction as well as a Connection
        message_id = outbox.append(
            tx, aggregate_type="order", aggregate_id="o-1", event_type="OrderPlaced", payload=ORDER
        )
        raise psycopg.Rollback(tx)
    assert isinstance(message_id, UUID)
    assert count(writer_db) == 0  # rolled back with the caller's transaction

    with writer_db.transaction():
        message_id = outbox.append(
            writer_db,
            aggregate_type="order",
            aggregate_id="o-1",
            event_type="OrderPlaced",
            payload=ORDER,
            headers={"traceparent": "00-abc-def-01"},
        )
    row = db.execute(
        "SELECT event_type, payload, headers FROM outbox WHERE message_id = %s", (message_id,)
    ).fetchone()
    assert row == ("OrderPlaced", ORDER, {"traceparent": "00-abc-def-01"})


@pytest.mark.parametrize(
    ("event_type", "payload", "problem"),
    [
        ("OrderPlaced", {"order_id": "o-1", "customer_id": "c-1"}, "amount_cents"),
        ("OrderPlaced", {**ORDER, "amount_cents": "lots"}, "amount_cents"),
        ("NoSuchEvent", ORDER, "no schema for event type"),
    ],
)
def test_invalid_payload_is_rejected_and_nothing_is_written(
    writer_db: psycopg.Connection[Any],
    db: psycopg.Connection[Any],
    outbox: Outbox,
    event_type: str,
    payload: dict[str, Any],
    problem: str,
) -> None:
    with writer_db.transaction():
        outbox.append(
            writer_db,
            aggregate_type="order",
            aggregate_id="o-0",
            event_type="OrderPlaced",
            payload=ORDER,
        )
        with pytest.raises(PayloadValidationError, match=problem):
            outbox.append(
                writer_db,
                aggregate_type="order",
                aggregate_id="o-1",
                event_type=event_type,
                payload=payload,
            )
        # The caller's transaction is still usable and commits its valid event.
        outbox.append(
            writer_db,
            aggregate_type="order",
            aggregate_id="o-2",
            event_type="OrderPlaced",
            payload=ORDER,
        )
    ids = [r[0] for r in db.execute("SELECT aggregate_id FROM outbox ORDER BY position")]
    assert ids == ["o-0", "o-2"]


def test_bad_arguments_are_clear_errors(writer_db: psycopg.Connection[Any], outbox: Outbox) -> None:
    with pytest.raises(PayloadValidationError, match="aggregate_id must be a non-empty string"):
        outbox.append(
            writer_db,
            aggregate_type="order",
            aggregate_id="",
            event_type="OrderPlaced",
            payload=ORDER,
        )
    with pytest.raises(PayloadValidationError, match="headers must map strings to strings"):
        outbox.append(
            writer_db,
            aggregate_type="order",
            aggregate_id="1",
            event_type="OrderPlaced",
            payload=ORDER,
            headers={"n": 1},
        )  # type: ignore[dict-item]
    assert count(writer_db) == 0


def test_idempotency_key_makes_retries_safe(
    writer_db: psycopg.Connection[Any], outbox: Outbox
) -> None:
    kwargs: dict[str, Any] = dict(
        aggregate_type="order", aggregate_id="o-1", event_type="OrderPlaced", payload=ORDER
    )
    with writer_db.transaction():
        first = outbox.append(writer_db, idempotency_key="req-1", **kwargs)
    with writer_db.transaction():
        again = outbox.append(writer_db, idempotency_key="req-1", **kwargs)
        other_aggregate = outbox.append(
            writer_db, idempotency_key="req-1", **{**kwargs, "aggregate_id": "o-2"}
        )
    assert again == first
    assert other_aggregate != first  # keys are unique per aggregate
    assert count(writer_db) == 2


def test_idempotency_key_under_a_concurrent_duplicate(
    writer_url: str, writer_db: psycopg.Connection[Any], outbox: Outbox
) -> None:
    kwargs: dict[str, Any] = dict(
        aggregate_type="order",
        aggregate_id="o-1",
        event_type="OrderPlaced",
        payload=ORDER,
        idempotency_key="k",
    )
    with psycopg.connect(writer_url) as first, psycopg.connect(writer_url) as second:
        first_id = outbox.append(first, **kwargs)  # uncommitted
        result: list[UUID] = []
        waiter = threading.Thread(target=lambda: result.append(outbox.append(second, **kwargs)))
        waiter.start()  # blocks on the unique index until `first` commits
        waiter.join(0.5)
        first.commit()
        waiter.join(10)
        second.commit()
    assert result == [first_id]
    assert count(writer_db) == 1


# -- idempotency keys are per writer role (issue #47, "idempotency-key squatting") --------

TRANSFER: dict[str, Any] = dict(
    aggregate_type="account", aggregate_id="a-1", event_type="TransferRequested"
)


def test_another_writers_key_holds_no_event_back(
    writer_db: psycopg.Connection[Any],
    second_writer_url: str,
    db: psycopg.Connection[Any],
) -> None:
    """Writer A takes the key writer B is about to use: B's append writes B's event and
    returns B's own message id, not A's; each keeps its own key."""
    outbox = Outbox(None)
    squatted = outbox.append(
        writer_db, payload={"to": "attacker-account"}, idempotency_key="req-7", **TRANSFER
    )
    with psycopg.connect(second_writer_url, autocommit=True) as honest:
        own = outbox.append(honest, payload={"to": "a-2"}, idempotency_key="req-7", **TRANSFER)
        assert own != squatted
        assert (
            outbox.append(honest, payload={"to": "a-2"}, idempotency_key="req-7", **TRANSFER) == own
        )
    assert (
        outbox.append(
            writer_db, payload={"to": "attacker-account"}, idempotency_key="req-7", **TRANSFER
        )
        == squatted
    )
    rows = db.execute("SELECT message_id, payload FROM outbox ORDER BY position").fetchall()
    assert rows == [(squatted, {"to": "attacker-account"}), (own, {"to": "a-2"})]


def test_a_key_used_for_another_event_is_refused_and_the_transaction_goes_on(
    writer_db: psycopg.Connection[Any], db: psycopg.Connection[Any]
) -> None:
    outbox = Outbox(None)
    first = outbox.append(writer_db, payload={"to": "a-2"}, idempotency_key="req-8", **TRANSFER)
    with writer_db.transaction():
        for changed in ({"payload": {"to": "a-3"}}, {"event_type": "TransferCancelled"}):
            event = {**TRANSFER, "payload": {"to": "a-2"}, **changed}
            with pytest.raises(IdempotencyKeyReused) as refused:
                outbox.append(writer_db, idempotency_key="req-8", **event)
            assert refused.value.message_id == str(first)
            assert "req-8" in str(refused.value) and "account/a-1" in str(refused.value)
        # Nothing was written, and the transaction is still usable.
        again = outbox.append(
            writer_db,
            payload={"to": "a-2"},
            headers={"traceparent": "00-retry"},  # a retry's new trace: still the same event
            idempotency_key="req-8",
            **TRANSFER,
        )
    assert again == first
    assert count(db) == 1


def test_the_writer_is_the_inserting_role_whatever_a_row_says(
    writer_db: psycopg.Connection[Any], second_writer_url: str, db: psycopg.Connection[Any]
) -> None:
    insert = (
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, idempotency_key{})"
        " VALUES ('account', 'a-1', 'TransferRequested', '{{\"to\": \"x\"}}', 'req-9'{})"
    )
    with pytest.raises(psycopg.errors.InsufficientPrivilege):  # grant leaves the column out
        writer_db.execute(insert.format(", writer", ", 'outbox_test_writer_b'"))
    # The owner may name it (deliberate tampering, as a role granted the whole table
    # could): the outbox records the inserting role all the same.
    db.execute(insert.format(", writer", ", 'outbox_test_writer_b'"))
    owner = db.execute("SELECT current_user").fetchone()
    assert db.execute("SELECT writer FROM outbox").fetchall() == [owner]
    # The docs' idempotent SQL: the second writer's row goes in beside the owner's key.
    idempotent = insert.format("", "") + " ON CONFLICT DO NOTHING RETURNING message_id"
    with psycopg.connect(second_writer_url, autocommit=True) as honest:
        assert honest.execute(idempotent).fetchone() is not None
        assert honest.execute(idempotent).fetchone() is None  # its own retry
        own = honest.execute(
            "SELECT count(*) FROM outbox_own_keys WHERE idempotency_key = 'req-9'"
        ).fetchone()
    assert own == (1,)  # only its own row, of the two with that key
    assert count(db) == 2


def test_the_write_api_runs_before_migration_15_and_after(
    database_url: str, outbox: Outbox
) -> None:
    """Writers upgrade first (deploy/README.md, "Upgrading: migration 0015"): this write
    API on the schema before 0015, then on 0015 applied under it. As the owner: `grant`
    refuses a schema with migrations pending. The old API's conflict target is refused
    from 0015 on, which is why the writers go first."""
    kwargs: dict[str, Any] = dict(
        aggregate_type="order", aggregate_id="o-1", event_type="OrderPlaced", payload=ORDER
    )
    with psycopg.connect(database_url, autocommit=True) as conn:
        migrations.migrate(conn, up_to=14)
        before = outbox.append(conn, idempotency_key="req-1", **kwargs)
        assert outbox.append(conn, idempotency_key="req-1", **kwargs) == before
        assert migrations.migrate(conn, up_to=15)[-1].version == 15
        after = outbox.append(conn, idempotency_key="req-2", **kwargs)
        assert outbox.append(conn, idempotency_key="req-2", **kwargs) == after
        # A key written before 0015 has no writer: it holds no one's append back.
        assert outbox.append(conn, idempotency_key="req-1", **kwargs) not in (before, after)
        with pytest.raises(psycopg.errors.InvalidColumnReference):
            conn.execute(
                "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload,"
                " idempotency_key) VALUES ('order', 'o-1', 'OrderPlaced', '{}', 'req-3')"
                " ON CONFLICT (aggregate_type, aggregate_id, idempotency_key)"
                " WHERE idempotency_key IS NOT NULL DO NOTHING"
            )


def test_stream_append_assigns_versions(
    writer_db: psycopg.Connection[Any], db: psycopg.Connection[Any], outbox: Outbox
) -> None:
    with writer_db.transaction():
        first = outbox.append_to_stream(
            writer_db,
            aggregate_type="order",
            aggregate_id="o-1",
            expected_version=0,
            events=[Event("OrderPlaced", ORDER)],
        )
    with writer_db.transaction():
        second = outbox.append_to_stream(
            writer_db,
            aggregate_type="order",
            aggregate_id="o-1",
            expected_version=1,
            events=[
                Event("OrderShipped", {"order_id": "o-1", "carrier": "dhl"}),
                Event("OrderShipped", {"order_id": "o-1", "carrier": "ups"}),
            ],
        )
    assert (first.version, second.version) == (1, 3)
    rows = db.execute(
        "SELECT aggregate_version, event_type FROM outbox ORDER BY transaction_id, position"
    ).fetchall()
    assert rows == [(1, "OrderPlaced"), (2, "OrderShipped"), (3, "OrderShipped")]


def test_stale_expected_version_fails_and_writes_nothing(
    writer_db: psycopg.Connection[Any], outbox: Outbox
) -> None:
    with writer_db.transaction():
        outbox.append_to_stream(
            writer_db,
            aggregate_type="order",
            aggregate_id="o-1",
            expected_version=0,
            events=[Event("OrderPlaced", ORDER)],
        )
    ship = Event("OrderShipped", {"order_id": "o-1", "carrier": "dhl"})
    for stale in (0, 5):
        with pytest.raises(ConcurrencyError), writer_db.transaction():
            outbox.append_to_stream(
                writer_db,
                aggregate_type="order",
                aggregate_id="o-1",
                expected_version=stale,
                events=[ship, ship],
            )
    assert writer_db.execute("SELECT max(aggregate_version), count(*) FROM outbox").fetchone() == (
        1,
        1,
    )


def test_concurrent_appends_one_wins(
    writer_url: str, writer_db: psycopg.Connection[Any], outbox: Outbox
) -> None:
    ship = Event("OrderShipped", {"order_id": "o-1", "carrier": "dhl"})
    with writer_db.transaction():
        outbox.append_to_stream(
            writer_db,
            aggregate_type="order",
            aggregate_id="o-1",
            expected_version=0,
            events=[Event("OrderPlaced", ORDER)],
        )
    with psycopg.connect(writer_url) as a, psycopg.connect(writer_url) as b:
        outbox.append_to_stream(
            a, aggregate_type="order", aggregate_id="o-1", expected_version=1, events=[ship]
        )
        failures: list[BaseException] = []

        def loser() -> None:
            try:
                outbox.append_to_stream(
                    b, aggregate_type="order", aggregate_id="o-1", expected_version=1, events=[ship]
                )
            except ConcurrencyError as exc:
                failures.append(exc)

        thread = threading.Thread(target=loser)
        thread.start()
        thread.join(0.3)
        a.commit()
        thread.join(10)
        b.rollback()
    assert len(failures) == 1 and "stale" in str(failures[0])
    assert writer_db.execute("SELECT count(*) FROM outbox").fetchone() == (2,)


def test_an_early_xid_appends_its_later_version_and_sorts_after_the_earlier_one(
    writer_url: str, db: psycopg.Connection[Any], outbox: Outbox
) -> None:
    """T1 takes its xid first; T2 (younger xid) commits version 1; T1 then appends
    version 2. It succeeds, and version 2 sorts after version 1 in the relay's order."""
    ship = Event("OrderShipped", {"order_id": "o-1", "carrier": "dhl"})
    with psycopg.connect(writer_url) as t1, psycopg.connect(writer_url) as t2:
        t1.execute("SELECT pg_current_xact_id()")  # T1 takes its xid early
        outbox.append_to_stream(
            t2,
            aggregate_type="order",
            aggregate_id="o-1",
            expected_version=0,
            events=[Event("OrderPlaced", ORDER)],
        )
        t2.commit()
        outbox.append_to_stream(
            t1, aggregate_type="order", aggregate_id="o-1", expected_version=1, events=[ship]
        )
        t1.commit()
    rows = db.execute(
        "SELECT aggregate_version FROM outbox ORDER BY transaction_id, position"
    ).fetchall()
    assert rows == [(1,), (2,)]


def test_plain_sql_gets_the_same_stream_guard(
    writer_url: str, writer_db: psycopg.Connection[Any]
) -> None:
    insert = """INSERT INTO outbox (aggregate_type, aggregate_id, aggregate_version, event_type, payload)
                VALUES ('order', 'o-1', %s, 'OrderPlaced', '{}')"""
    writer_db.execute(insert, (1,))
    with pytest.raises(psycopg.Error) as gap:
        writer_db.execute(insert, (3,))
    assert gap.value.sqlstate == "RLY01"
