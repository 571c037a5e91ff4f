"""Moving the outbox database: a restore into another cluster (whose transaction ids are
lower than the stored keys), an older backup restored while Kafka holds later events,
writes that go on on the new cluster, and a promoted streaming replica (no false alarm).

Each ends with `outbox-relay verify` clean and an independent read_committed consumer
seeing every committed event once, in its key's order."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from relay import Outbox
from relay.adapters.postgres import migrations
from relay.core.schemas import SchemaFolder
from relay.core.settings import load_settings
from relay.daemon import Relay
from relay.localstack import LocalPostgres
from relay.localstack.postgres import find_pg_binary
from tests.support import (
    by_key,
    consume,
    create_test_roles,
    grant_test_roles,
    ids_of,
    run_cli,
    streaming_standby,
    sub,
    wait_caught_up,
    write_orders,
)

KEYS = ["k0", "k1", "k2"]
NewCluster = Callable[[], LocalPostgres]


class Writer:
    """Appends orders round-robin over KEYS and remembers each key's message ids."""

    def __init__(self, outbox: Outbox) -> None:
        self.outbox = outbox
        self.by_key: dict[str, list[str]] = {k: [] for k in KEYS}
        self.written = 0

    def write(self, conn: psycopg.Connection[Any], count: int) -> None:
        for _ in range(count):
            key = KEYS[self.written % len(KEYS)]
            message_id = self.outbox.append(
                conn,
                aggregate_type="order",
                aggregate_id=key,
                event_type="OrderPlaced",
                payload={"order_id": str(self.written), "customer_id": "c", "amount_cents": 1},
            )
            self.by_key[key].append(str(message_id))
            self.written += 1

    def forget(self, ids: set[str]) -> None:
        """Events a restore lost: they are on Kafka, no longer in the database."""
        self.by_key = {k: [i for i in v if i not in ids] for k, v in self.by_key.items()}

    @property
    def ids(self) -> set[str]:
        return {i for ids in self.by_key.values() for i in ids}


@pytest.fixture
def relays(kafka_bootstrap: str, registry: SchemaFolder) -> Iterator[Callable[..., Relay]]:
    started: list[Relay] = []

    def start(url: str, prefix: str) -> Relay:
        """A relay on the outbox at the owner's ``url``, as the relay role (granted
        there first, as an operator does after a restore)."""
        relay = Relay(
            load_settings(
                database_url=grant_test_roles(url).relay_url,
                bootstrap_servers=kafka_bootstrap,
                subscribers=[sub("s", prefix, value_format="json")],
                poll_interval=0.2,
                heartbeat_interval=0.3,
                session_timeout=3.0,
                metrics_port=0,
            ),
            registry=registry,
        )
        relay.start()
        started.append(relay)
        return relay

    yield start
    for relay in started:
        relay.stop()


def burn_xids(conn: psycopg.Connection[Any], count: int) -> None:
    """Advance the cluster's transaction ids: one subtransaction with a write each."""
    conn.execute("CREATE TEMP TABLE IF NOT EXISTS burn (i int)")
    conn.execute(
        f"DO $$ BEGIN FOR i IN 1..{count} LOOP BEGIN INSERT INTO burn VALUES (i); "
        "EXCEPTION WHEN others THEN NULL; END; END LOOP; END $$"
    )


def next_xid(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint"
        ).fetchone()
    assert row is not None
    return int(row[0])


def dump(url: str, path: Path) -> None:
    subprocess.run([find_pg_binary("pg_dump"), "-Fc", "-f", str(path), url], check=True)


def restore(
    path: Path, cluster: LocalPostgres, name: str = "outbox", *, privileges: bool = True
) -> str:
    """Restore the dump at ``path`` into a new database ``name`` of ``cluster``. With
    ``privileges``, the roles it grants are created on the new cluster first; without,
    the grants are left out (``--no-privileges``), to be given afresh."""
    with psycopg.connect(cluster.url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    url = cluster.url_for(name)
    # --no-owner: the same as a restore by the new cluster's own admin.
    command = [find_pg_binary("pg_restore"), "--no-owner", "-d", url, str(path)]
    if privileges:
        create_test_roles(cluster.url)
    else:
        command.insert(1, "--no-privileges")
    subprocess.run(command, check=True)
    return url


def outbox_database(cluster: LocalPostgres) -> str:
    with psycopg.connect(cluster.url, autocommit=True) as conn:
        conn.execute("CREATE DATABASE outbox")
    url = cluster.url_for("outbox")
    with psycopg.connect(url, autocommit=True) as conn:
        migrations.migrate(conn)
    return url


def publish_then_write(
    url: str, writer: Writer, start: Callable[[], Relay], published: int, pending: int
) -> None:
    """``published`` events the relay publishes, then ``pending`` it has not yet."""
    with psycopg.connect(url, autocommit=True) as conn, app(url) as app_conn:
        relay = start()
        writer.write(app_conn, published)
        wait_caught_up(conn, "s")
        relay.stop()
        writer.write(app_conn, pending)


def app(url: str) -> psycopg.Connection[Any]:
    """A connection as the writer role to the outbox at the owner's ``url``."""
    return psycopg.connect(grant_test_roles(url).writer_url, autocommit=True)


def assert_published_once_in_order(
    bootstrap: str, topic: str, writer: Writer, *, also_on_kafka: int = 0
) -> None:
    """An independent read_committed consumer sees every event of the database once, in
    its key's write order (plus ``also_on_kafka`` events a restore lost)."""
    expected = writer.ids
    seen = consume(bootstrap, [topic], len(expected) + also_on_kafka, timeout=60)
    counts: dict[str, int] = {}
    for message_id in ids_of(seen):
        counts[message_id] = counts.get(message_id, 0) + 1
    assert {i for i, n in counts.items() if n > 1} == set(), "published twice"
    assert expected - set(counts) == set(), "never published"
    assert len(counts) == len(expected) + also_on_kafka
    for key, records in by_key(seen).items():
        in_db = [i for i in ids_of(records) if i in expected]
        assert in_db == writer.by_key[key], f"key {key} out of order"


def assert_verify_clean(url: str, bootstrap: str) -> dict[str, Any]:
    relay_url = grant_test_roles(url).relay_url
    result = run_cli(
        "verify",
        "--json",
        env={"RELAY_DATABASE_URL": relay_url, "RELAY_BOOTSTRAP_SERVERS": bootstrap},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    [report] = json.loads(result.stdout)
    assert report["clean"] and report["pending"] == 0, report
    return dict(report)


def key_space_changes(relay: Relay) -> dict[str, int]:
    return dict(relay.key_space_changes())


def test_a_restore_into_a_younger_cluster_publishes_each_event_once_in_order(
    db: psycopg.Connection[Any],
    database_url: str,
    outbox: Outbox,
    kafka_bootstrap: str,
    topic_prefix: str,
    relays: Callable[..., Relay],
    new_cluster: NewCluster,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    target = new_cluster()
    burn_xids(db, next_xid(target.url) + 5_000 - next_xid(database_url))
    writer, topic = Writer(outbox), topic_prefix + "outbox.event.order"
    # 30 committed, not yet published when the backup is taken
    publish_then_write(database_url, writer, lambda: relays(database_url, topic_prefix), 20, 30)
    dump(database_url, tmp_path / "outbox.dump")

    url = restore(tmp_path / "outbox.dump", target)
    stored = db.execute("SELECT max(transaction_id)::text::bigint FROM outbox").fetchone()
    assert stored is not None and next_xid(url) < stored[0]  # the move this test is about
    with psycopg.connect(url, autocommit=True) as conn, app(url) as app_conn:
        writer.write(app_conn, 10)  # the app is back before the relay
        moved = relays(url, topic_prefix)
        writer.write(app_conn, 10)  # ... and goes on
        wait_caught_up(conn, "s", timeout=60)

    assert key_space_changes(moved)["rebased"] == 1
    # What an operator reads: one line saying what happened and what the relay did.
    [line] = [r.getMessage() for r in caplog.records if "transaction-id space" in r.getMessage()]
    assert "rebased 50 unpublished and retained rows" in line
    moved.stop()
    assert_published_once_in_order(kafka_bootstrap, topic, writer)
    report = assert_verify_clean(url, kafka_bootstrap)
    assert report["found"] == 70


def test_an_older_backup_restored_while_kafka_holds_later_events(
    db: psycopg.Connection[Any],
    database_url: str,
    outbox: Outbox,
    kafka_bootstrap: str,
    topic_prefix: str,
    relays: Callable[..., Relay],
    new_cluster: NewCluster,
    tmp_path: Path,
) -> None:
    target = new_cluster()
    burn_xids(db, next_xid(target.url) + 5_000 - next_xid(database_url))
    writer, topic = Writer(outbox), topic_prefix + "outbox.event.order"
    start = lambda: relays(database_url, topic_prefix)  # noqa: E731
    # 5 in the backup, unpublished there, published afterwards; 15 lost with the database
    publish_then_write(database_url, writer, start, 20, 5)
    dump(database_url, tmp_path / "older.dump")
    before = writer.ids
    publish_then_write(database_url, writer, start, 15, 0)
    lost = writer.ids - before

    url = restore(tmp_path / "older.dump", target)
    writer.forget(lost)
    # A restore procedure that migrates first: the rebase happens there, before writers.
    migrated = run_cli("migrate", env={"RELAY_DATABASE_URL": url})
    assert migrated.returncode == 0, migrated.stderr
    assert "key space rebased: stored keys reach" in migrated.stdout
    with psycopg.connect(url, autocommit=True) as conn, app(url) as app_conn:
        moved = relays(url, topic_prefix)
        writer.write(app_conn, 10)
        wait_caught_up(conn, "s", timeout=60)

    assert key_space_changes(moved)["rebased"] == 0  # already done by migrate
    totals = moved.part_totals()
    moved.stop()
    # The 5 events the older backup has as unpublished were on Kafka already: the
    # Kafka-side checkpoint, written in the old key space, is translated, not ignored.
    assert sum(t["recovered"] for t in totals.values()) == 1
    assert_published_once_in_order(kafka_bootstrap, topic, writer, also_on_kafka=len(lost))
    report = assert_verify_clean(url, kafka_bootstrap)
    # Published, then lost with the database: on Kafka, no longer in the outbox.
    assert (report["found"], report["not_in_outbox"], report["ahead"]) == (35, len(lost), 0)


def test_an_older_backup_restored_into_a_cluster_with_higher_ids(
    outbox: Outbox,
    kafka_bootstrap: str,
    topic_prefix: str,
    relays: Callable[..., Relay],
    new_cluster: NewCluster,
    tmp_path: Path,
) -> None:
    """No rebase (the new ids carry on above the stored keys), but the Kafka-side
    checkpoint names an event the backup lacks: adopted up to the move, not beyond."""
    url, target = outbox_database(new_cluster()), new_cluster()
    writer, topic = Writer(outbox), topic_prefix + "outbox.event.order"
    start = lambda: relays(url, topic_prefix)  # noqa: E731
    publish_then_write(url, writer, start, 20, 5)
    dump(url, tmp_path / "older.dump")
    before = writer.ids
    publish_then_write(url, writer, start, 15, 0)
    lost = writer.ids - before
    with psycopg.connect(target.url, autocommit=True) as conn:
        burn_xids(conn, next_xid(url) + 1_000)

    restored = restore(tmp_path / "older.dump", target)
    writer.forget(lost)
    with psycopg.connect(restored, autocommit=True) as conn, app(restored) as app_conn:
        moved = relays(restored, topic_prefix)
        writer.write(app_conn, 10)
        wait_caught_up(conn, "s", timeout=60)
    assert key_space_changes(moved) == {"rebased": 0, "continued": 1}
    totals = moved.part_totals()
    moved.stop()
    assert sum(t["recovered"] for t in totals.values()) == 1
    assert_published_once_in_order(kafka_bootstrap, topic, writer, also_on_kafka=len(lost))
    assert assert_verify_clean(restored, kafka_bootstrap)["found"] == 35


def test_writers_write_after_a_restore_without_privileges_then_migrate_and_grant(
    writer_db: psycopg.Connection[Any],
    database_url: str,
    outbox: Outbox,
    new_cluster: NewCluster,
    tmp_path: Path,
) -> None:
    """A restore into a cluster without the source's roles (``--no-privileges``), then
    what deploy/README.md says: `migrate`, then `grant` for the roles."""
    write_orders(writer_db, outbox, ["before"])
    dump(database_url, tmp_path / "outbox.dump")
    url = restore(tmp_path / "outbox.dump", new_cluster(), privileges=False)
    migrated = run_cli("migrate", env={"RELAY_DATABASE_URL": url})
    assert migrated.returncode == 0, migrated.stderr
    with app(url) as conn:  # granted afresh, as `outbox-relay grant --create` does
        write_orders(conn, outbox, ["after"])
        assert conn.execute("SELECT count(*) FROM outbox").fetchone() == (2,)


def test_a_promoted_streaming_replica_is_no_move(
    outbox: Outbox,
    kafka_bootstrap: str,
    topic_prefix: str,
    relays: Callable[..., Relay],
    new_cluster: NewCluster,
    tmp_path: Path,
) -> None:
    primary = new_cluster()
    url = outbox_database(primary)
    writer, topic = Writer(outbox), topic_prefix + "outbox.event.order"
    # 10 unpublished when the primary dies
    publish_then_write(url, writer, lambda: relays(url, topic_prefix), 20, 10)

    standby = streaming_standby(primary, tmp_path / "standby.log")
    try:
        _wait_replayed(standby.url_for("outbox"), writer.written)
        primary.stop()
        with psycopg.connect(standby.url, autocommit=True) as conn:
            conn.execute("SELECT pg_promote()")
        promoted = standby.url_for("outbox")
        with psycopg.connect(promoted, autocommit=True) as conn, app(promoted) as app_conn:
            relay = relays(promoted, topic_prefix)
            writer.write(app_conn, 10)
            wait_caught_up(conn, "s", timeout=60)
        assert key_space_changes(relay) == {"rebased": 0, "continued": 0}
        totals = relay.part_totals()
        relay.stop()
        assert sum(t["recoveries_refused"] for t in totals.values()) == 0
        assert_published_once_in_order(kafka_bootstrap, topic, writer)
        assert assert_verify_clean(promoted, kafka_bootstrap)["found"] == 40
    finally:
        standby.stop()
        shutil.rmtree(standby.data_dir, ignore_errors=True)


def _wait_replayed(url: str, rows: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with psycopg.connect(url, autocommit=True) as conn:
            row = conn.execute("SELECT count(*) FROM outbox").fetchone()
        if row is not None and row[0] >= rows:
            return
        assert time.monotonic() < deadline, "the standby never replayed the primary's rows"
        time.sleep(0.1)
