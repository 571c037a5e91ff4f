"""Dead-letter redrive on real Postgres and Kafka: poison events dead-lettered, the cause
fixed (a schema added), then `outbox-relay dead-letters redrive` publishes each exactly
once, in order per key, without moving the live checkpoint; crashes in the middle of a
redrive publish nothing twice."""

from __future__ import annotations

import json
import shutil
import uuid
from collections.abc import Iterator
from contextlib import closing, contextmanager, nullcontext
from pathlib import Path
from typing import Any
from uuid import UUID

import psycopg
import pytest
from psycopg import sql

from relay.adapters.postgres.dead_letters import DeadLetterStore
from relay.adapters.postgres.topic_record import PostgresTopicRecord
from relay.core.model import ConsumedRecord
from relay.core.ports import Batch
from relay.core.schemas import SchemaFolder
from relay.core.settings import Settings, load_settings
from relay.core.subscribers import TopicGuard
from relay.daemon import Relay
from relay.engine.encoding import RecordEncoder
from relay.errors import BrokerUnavailable
from relay.ops.redrive import Redrive, group_prefix
from relay.wiring import exactly_once_publisher
from tests.support import (
    REPO,
    by_key,
    consume,
    login_url,
    run_cli,
    sub,
    wait_caught_up,
    wait_until,
)

REFUNDED = {
    "type": "record",
    "name": "OrderRefunded",
    "namespace": "demo.orders",
    "fields": [{"name": "order_id", "type": "string"}, {"name": "amount_cents", "type": "int"}],
}


@pytest.fixture
def schemas(tmp_path: Path) -> Path:
    """The demo schemas, without one for OrderRefunded (whose events are then poison)."""
    folder = tmp_path / "schemas"
    shutil.copytree(REPO / "schemas", folder)
    return folder


def add_schema(folder: Path, amount_type: Any = "int") -> None:
    fields = [REFUNDED["fields"][0], {"name": "amount_cents", "type": amount_type}]
    (folder / "OrderRefunded.avsc").write_text(json.dumps({**REFUNDED, "fields": fields}))


def insert(db: psycopg.Connection[Any], key: str, event_type: str, payload: dict[str, Any]) -> UUID:
    row = db.execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
        "VALUES ('order', %s, %s, %s) RETURNING message_id",
        (key, event_type, json.dumps(payload)),
    ).fetchone()
    assert row is not None
    mid: UUID = row[0]
    return mid


def settings_for(
    database_url: str, bootstrap: str, prefix: str, schemas: Path, **more: Any
) -> Settings:
    return load_settings(
        database_url=database_url,
        bootstrap_servers=bootstrap,
        schemas_dir=schemas,
        subscribers=[sub("s", prefix, on_poison="dead-letter", dead_letter_topic=prefix + "dead")],
        poll_interval=0.2,
        heartbeat_interval=0.3,
        session_timeout=3.0,
        metrics_port=0,
        **more,
    )


@contextmanager
def running(settings: Settings) -> Iterator[Relay]:
    relay = Relay(settings)
    relay.start()
    try:
        yield relay
    finally:
        relay.stop()


def dead_lettered(db: psycopg.Connection[Any], count: int) -> None:
    def recorded() -> bool:
        row = db.execute("SELECT count(*) FROM outbox_dead_letters").fetchone()
        return row is not None and row[0] == count

    wait_until(recorded, timeout=60, what=f"{count} dead letters")
    wait_caught_up(db, "s")


def checkpoints(db: psycopg.Connection[Any]) -> list[tuple[Any, ...]]:
    return db.execute(
        "SELECT part, transaction_id::text, position, generation FROM outbox_checkpoints "
        "WHERE subscriber = 's' ORDER BY part"
    ).fetchall()


def ids_by_key(seen: list[ConsumedRecord]) -> dict[str, list[str]]:
    return {k: [r.message_id or "" for r in rs] for k, rs in by_key(seen).items()}


def verified(env: dict[str, str]) -> dict[str, Any]:
    """`outbox-relay verify` of subscriber s: clean, nothing ahead."""
    result = run_cli("verify", "--subscriber", "s", "--json", "--timeout", "60", env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    (report,) = json.loads(result.stdout)
    assert (report["missing"], report["duplicated"], report["out_of_order"]) == (0, 0, 0)
    assert report["ahead"] == 0, report
    checked: dict[str, Any] = report
    return checked


def exactly_once(seen: list[ConsumedRecord]) -> None:
    ids = [r.message_id for r in seen]
    assert len(ids) == len(set(ids)), f"duplicates: {ids}"


@contextmanager
def relay_role(db: psycopg.Connection[Any], database_url: str) -> Iterator[str]:
    role = f"relay_{uuid.uuid4().hex[:6]}"
    granted = run_cli(
        "grant", "--relay-role", role, "--create", env={"RELAY_DATABASE_URL": database_url}
    )
    assert granted.returncode == 0, granted.stderr
    try:
        yield login_url(database_url, role)
    finally:
        name = sql.Identifier(role)
        db.execute(sql.SQL("DROP OWNED BY {}; DROP ROLE IF EXISTS {}").format(name, name))


def test_redrive_publishes_dead_letters_once_in_order_per_key(
    db: psycopg.Connection[Any],
    database_url: str,
    kafka_bootstrap: str,
    topic_prefix: str,
    schemas: Path,
) -> None:
    refund = {"order_id": "o", "amount_cents": 5}
    with db.transaction():
        k1_placed = insert(
            db, "k1", "OrderPlaced", {"order_id": "k1", "customer_id": "c", "amount_cents": 1}
        )
        k1_a = insert(db, "k1", "OrderRefunded", refund)
    with db.transaction():
        k2_a = insert(db, "k2", "OrderRefunded", refund)
        k1_b = insert(db, "k1", "OrderRefunded", {**refund, "amount_cents": 6})
    with db.transaction():
        # Poison even once the schema is added (a string where it says int) ...
        k3_a = insert(db, "k3", "OrderRefunded", {**refund, "amount_cents": "five"})
        # ... and this one, fine by itself, must not overtake it.
        k3_b = insert(db, "k3", "OrderRefunded", refund)
        k2_placed = insert(
            db, "k2", "OrderPlaced", {"order_id": "k2", "customer_id": "c", "amount_cents": 2}
        )
    topic = topic_prefix + "outbox.event.order"
    # As the relay's least-privilege role: what `outbox-relay grant` gives it suffices.
    with (
        relay_role(db, database_url) as url,
        running(settings_for(database_url, kafka_bootstrap, topic_prefix, schemas)),
    ):
        env = {"RELAY_DATABASE_URL": url, "RELAY_BOOTSTRAP_SERVERS": kafka_bootstrap}
        dead_lettered(db, 5)
        live = consume(kafka_bootstrap, [topic], 2)
        assert sorted(r.message_id or "" for r in live) == sorted(map(str, [k1_placed, k2_placed]))
        before = checkpoints(db)

        listed = run_cli("dead-letters", "list", "s", "--json", env=env)
        assert listed.returncode == 0, listed.stderr
        pending = json.loads(listed.stdout)
        assert [d["message_id"] for d in pending] == list(map(str, [k1_a, k2_a, k1_b, k3_a, k3_b]))
        assert all("OrderRefunded" in d["error"] for d in pending)

        add_schema(schemas)  # the fix
        redrive = ("dead-letters", "redrive", "s", "--schemas-dir", str(schemas), "--yes")
        first = run_cli(*redrive, "--json", env=env)
        assert first.returncode == 1, first.stderr  # some stay dead-lettered
        report = json.loads(first.stdout)
        assert report["redriven"] == 3
        assert list(report["still_poison"]) == [str(k3_a)]
        assert report["held_back"] == [str(k3_b)]

        seen = consume(kafka_bootstrap, [topic], 5, quiet=2.0)
        exactly_once(seen)
        order = ids_by_key(seen)
        assert order["k1"] == list(map(str, [k1_placed, k1_a, k1_b]))
        assert order["k2"] == list(map(str, [k2_placed, k2_a]))  # the live one went first
        assert "k3" not in order
        assert {r.header_text("event_type") for r in seen if r.message_id != str(k1_placed)} >= {
            "OrderRefunded"
        }
        assert checkpoints(db) == before, "the live checkpoint moved"
        checked = verified(env)
        assert (checked["redriven"], checked["dead_lettered"], checked["found"]) == (3, 2, 5)

        # Again: nothing is published twice.
        again = run_cli(*redrive, "--json", env=env)
        assert json.loads(again.stdout)["redriven"] == 0, again.stderr
        remaining = json.loads(run_cli("dead-letters", "list", "s", "--json", env=env).stdout)
        assert [d["message_id"] for d in remaining] == [str(k3_a), str(k3_b)]
        assert (
            "int" in remaining[0]["redrive_error"] and "held back" in remaining[1]["redrive_error"]
        )

        # Fixed for good: the held-back event follows the one it waited for.
        add_schema(schemas, ["int", "string"])
        last = run_cli(*redrive, env=env)
        assert last.returncode == 0, last.stdout + last.stderr
        assert "redriven 2" in last.stdout
        seen = consume(kafka_bootstrap, [topic], 7, quiet=2.0)
        exactly_once(seen)
        assert len(seen) == 7
        assert ids_by_key(seen)["k3"] == [str(k3_a), str(k3_b)]
        assert checkpoints(db) == before, "the live checkpoint moved"
        checked = verified(env)
        assert (checked["redriven"], checked["dead_lettered"], checked["found"]) == (5, 0, 7)
        everything = json.loads(
            run_cli("dead-letters", "list", "s", "--all", "--json", env=env).stdout
        )
        assert len(everything) == 5 and all(d["redriven_at"] for d in everything)
        assert json.loads(run_cli("dead-letters", "list", "s", "--json", env=env).stdout) == []
        table = run_cli("dead-letters", "list", "s", "--all", env=env)
        assert table.returncode == 0 and table.stdout.count("redriven 20") == 5, table.stdout


class Crash(Exception):
    """Stands for the redrive process dying at this point."""


class StopsBeforeRecording(DeadLetterStore):
    """Dies after the Kafka transaction committed, before Postgres records it."""

    def done(self, name: str, batch: int) -> None:
        raise Crash(f"batch {batch} committed, not recorded")


class StopsBeforeCommitting:
    """Dies with the batch marked in Postgres, before its Kafka transaction commits."""

    def __init__(self, publisher: Any) -> None:
        self._publisher = publisher

    def recover(self, generation: str, key_space: UUID | None = None) -> Any:
        return self._publisher.recover(generation, key_space)

    def publish(self, batch: Batch) -> None:
        raise BrokerUnavailable("the process died before committing")

    def close(self) -> None:
        self._publisher.close()


def test_a_crash_mid_redrive_publishes_nothing_twice(
    db: psycopg.Connection[Any],
    database_url: str,
    kafka_bootstrap: str,
    topic_prefix: str,
    schemas: Path,
) -> None:
    with db.transaction():
        poison = [
            insert(db, f"k{i % 2}", "OrderRefunded", {"order_id": str(i), "amount_cents": i})
            for i in range(4)
        ]
    # The redrive creates the topic (the live relay only dead-lettered): a cap of one
    # topic counts the topics rows made for this outbox, not every topic of the broker.
    settings = settings_for(
        database_url, kafka_bootstrap, topic_prefix, schemas, max_created_topics=1
    )
    with running(settings):
        dead_lettered(db, 4)
    before = checkpoints(db)
    add_schema(schemas)
    guard = TopicGuard(settings.checkpoint_topic)
    guard.update(s.subscriber for s in DeadLetterStore(db).outbox.list())
    encoder = RecordEncoder(SchemaFolder.from_dir(schemas), guard)

    def redrive(store: DeadLetterStore, wrap: Any = None) -> Any:
        state = store.subscriber("s")
        record = PostgresTopicRecord(lambda: nullcontext(db))
        prefix = group_prefix(settings.kafka_id_prefix, state.subscriber_id)
        publisher = exactly_once_publisher(settings, prefix, guard, record, "redrive")
        with closing(publisher):
            chosen = wrap(publisher) if wrap is not None else publisher
            return Redrive(store, chosen, encoder, state, batch_size=3).run()

    with pytest.raises(BrokerUnavailable):
        redrive(DeadLetterStore(db), StopsBeforeCommitting)
    with pytest.raises(Crash):
        redrive(StopsBeforeRecording(db))  # the first batch of 3 commits in Kafka
    in_flight = db.execute(
        "SELECT count(*) FROM outbox_dead_letters WHERE redrive_batch IS NOT NULL AND redriven_at IS NULL"
    ).fetchone()
    assert in_flight == (3,)

    report = redrive(DeadLetterStore(db))
    assert (report.recovered, report.redriven) == (3, 1), report
    assert redrive(DeadLetterStore(db)).redriven == 0

    seen = consume(kafka_bootstrap, [topic_prefix + "outbox.event.order"], 4, quiet=2.0)
    exactly_once(seen)
    assert sorted(r.message_id or "" for r in seen) == sorted(map(str, poison))
    order = ids_by_key(seen)
    assert order["k0"] == [str(poison[0]), str(poison[2])]
    assert order["k1"] == [str(poison[1]), str(poison[3])]
    assert checkpoints(db) == before

    # A reset replays redriven events as events, not as dead letters again.
    reset = run_cli(
        *("subscribers", "reset", "s", "--to", "beginning", "--yes"),
        env={"RELAY_DATABASE_URL": database_url},
    )
    assert reset.returncode == 0, reset.stderr
    with running(settings):  # now with the schema it lacked
        replayed = consume(kafka_bootstrap, [topic_prefix + "outbox.event.order"], 8, quiet=2.0)
        assert sorted(r.message_id or "" for r in replayed) == sorted(2 * list(map(str, poison)))
        dead = consume(kafka_bootstrap, [topic_prefix + "dead"], 4, quiet=2.0)
        assert len(dead) == 4, "redriven events were dead-lettered again"


def test_retention_keeps_dead_letters_until_redriven_and_prune_is_the_operators(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    relay_url: str,
    kafka_bootstrap: str,
    topic_prefix: str,
    schemas: Path,
) -> None:
    """Issue #47: retention kept no dead letter's row from redrive (it was pruned with
    the published rows, and redrive then reported it gone), and never pruned
    outbox_dead_letters. Now a dead letter not yet redriven keeps its row; redriven,
    both go with the outbox's retention; not redriven, only when the operator says so.
    The relay, redrive and prune run as the relay's role; the writer writes."""
    refund = {"order_id": "o", "amount_cents": 5}
    poison = [insert(writer_db, f"k{i}", "OrderRefunded", refund) for i in range(2)]
    good = insert(writer_db, "g", "OrderPlaced", {"order_id": "g", "customer_id": "c",
                                                   "amount_cents": 1})  # fmt: skip
    env = {"RELAY_DATABASE_URL": relay_url, "RELAY_BOOTSTRAP_SERVERS": kafka_bootstrap}

    def rows() -> set[UUID]:
        return {m for (m,) in db.execute("SELECT message_id FROM outbox")}

    def letters() -> int:
        return int((db.execute("SELECT count(*) FROM outbox_dead_letters").fetchone() or [0])[0])

    settings = settings_for(relay_url, kafka_bootstrap, topic_prefix, schemas,
                            prune_every=0.5, retention=0)  # fmt: skip
    with running(settings):
        dead_lettered(db, 2)
        wait_until(lambda: good not in rows(), timeout=60, what="retention to prune")
        assert rows() == set(poison), "a dead letter's row is kept for redrive"
        pruned = run_cli("dead-letters", "prune", "s", "--json", env=env)
        assert pruned.returncode == 0, pruned.stderr
        assert json.loads(pruned.stdout) == {"subscriber": "s", "redriven": 0, "pending": 0}
        assert letters() == 2

        add_schema(schemas)  # the fix: redrive still finds both events after the prunes
        redriven = run_cli(
            "dead-letters",
            "redrive",
            "s",
            "--schemas-dir",
            str(schemas),
            "--json",
            "--yes",
            env=env,
        )
        assert redriven.returncode == 0, redriven.stdout + redriven.stderr
        assert json.loads(redriven.stdout)["redriven"] == 2
        seen = consume(kafka_bootstrap, [topic_prefix + "outbox.event.order"], 3, quiet=2.0)
        exactly_once(seen)
        assert {r.message_id for r in seen} == {str(m) for m in [*poison, good]}
        # Redriven: the rows go with the outbox's retention, then their dead letters.
        wait_until(lambda: not rows() and letters() == 0, timeout=60, what="both pruned")

        late = insert(writer_db, "k9", "OrderRefunded", {**refund, "amount_cents": "five"})
        dead_lettered(db, 1)
        prune = ("dead-letters", "prune", "s", "--pending-older-than")
        kept = run_cli(*prune, "3600", "--yes", env=env)
        assert kept.returncode == 0 and "pruned 0 dead letters not redriven" in kept.stdout
        assert letters() == 1 and rows() == {late}
        # Issue #48: deleting what can never be redriven is previewed, confirmed, and
        # stays on the record: verify names it skipped by the operator, never missing.
        preview = run_cli(*prune, "0", "--dry-run", env=env)
        assert preview.returncode == 0, preview.stderr
        assert "deletes 1 dead letter(s)" in preview.stdout and str(late) in preview.stdout
        refused = run_cli(*prune, "0", env=env)  # no terminal, no --yes
        assert refused.returncode == 2 and letters() == 1
        gone = run_cli(*prune, "0", "--yes", env=env)
        assert gone.returncode == 0, gone.stderr
        assert "pruned 1 dead letters not redriven" in gone.stdout
        assert "can no longer be redriven" in gone.stdout
        assert letters() == 0
        history = run_cli("subscribers", "history", "s", env=env)
        assert "prune" in history.stdout, history.stdout
        wait_until(lambda: not rows(), timeout=60, what="its row pruned")
    verdict = run_cli("verify", "--json", env=env)
    [mine] = [r for r in json.loads(verdict.stdout) if r["subscriber"] == "s"]
    assert mine["skipped_by_skip"] == 1 and not mine.get("missing"), mine
    assert verdict.returncode == 4, verdict.stdout + verdict.stderr


def test_dead_letter_retention_prunes_those_not_redriven_when_the_operator_sets_it(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    relay_url: str,
    kafka_bootstrap: str,
    topic_prefix: str,
    schemas: Path,
) -> None:
    insert(writer_db, "k1", "OrderRefunded", {"order_id": "o", "amount_cents": 5})
    settings = settings_for(relay_url, kafka_bootstrap, topic_prefix, schemas,
                            prune_every=0.5, retention=0, dead_letter_retention=0)  # fmt: skip
    with running(settings) as relay:
        consume(kafka_bootstrap, [topic_prefix + "dead"], 1)
        wait_until(
            lambda: db.execute("SELECT count(*) FROM outbox").fetchone() == (0,),
            timeout=60,
            what="the dead letter, then its row, pruned",
        )
        assert db.execute("SELECT count(*) FROM outbox_dead_letters").fetchone() == (0,)
        assert relay.retention_totals()["dead_letters_pruned"] == 1
