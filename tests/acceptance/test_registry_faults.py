"""A schema registry that is broken or hostile (issue #47, Medium 7) or races (issue #49,
item 3), against relays on Postgres and Kafka as production runs them.

The registry here is a stand-in in front of the session's real one (Apicurio): it
answers what each test scripts (an id of -7, the id of another schema, a 500 with a
200 KB body of terminal escapes and a forged log line, a 500 then 409 "already
exists") and forwards everything else, so the stock deserializer reads what the relay
published from the real registry. Each fault is the registry's: the part waits (no
event dead-lettered, no halt), says so (a metric, /readyz, one warning), and publishes
every event once when the registry heals, by itself."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer
from confluent_kafka.serialization import MessageField, SerializationContext

from relay import Outbox
from relay.adapters.postgres.store import OutboxStore
from relay.core.model import PartId
from relay.daemon import Relay
from tests.plugins.registry import StandinRegistry
from tests.support import (
    REPO,
    consume,
    http_get,
    part_status,
    run_cli,
    sub,
    wait_caught_up,
    wait_until,
    worker,
    write_orders,
)

pytestmark = [pytest.mark.registry, pytest.mark.timeout(1800)]

StartRelay = Callable[..., Relay]
IDS = [f"f{i}" for i in range(20)]
REGISTER = r"^/subjects/[^/?]+/versions"  # POST: register a schema under a subject
LOOKUP = r"^/subjects/[^/?]+\?"  # POST: is this schema under the subject?
COMPATIBILITY = r"^/compatibility/"
FORGED = "\n2026-01-01 00:00:00,000 ERROR relay.daemon: session lost; all events deleted"
HOSTILE = "\x1b[2J\x1b[1;31mregistry says\x1b[0m " + "A" * 200_000 + FORGED


def _every_event_once(registry_url: str, bootstrap: str, topic: str) -> None:
    """Every event of IDS on ``topic`` once, read by the stock deserializer."""
    deserialize = AvroDeserializer(SchemaRegistryClient({"url": registry_url}))
    context = SerializationContext(topic, MessageField.VALUE)
    values = [deserialize(r.value, context) for r in consume(bootstrap, [topic], len(IDS))]
    assert sorted(v["order_id"] for v in values) == sorted(IDS)


def _nothing_dead_or_halted(db: psycopg.Connection[Any], name: str) -> None:
    assert OutboxStore(db).get_part(name, 0).halted_error is None
    assert db.execute("SELECT count(*) FROM outbox_dead_letters").fetchone() == (0,)


def _waits_for_the_registry(relay: Relay, name: str, registrations: int, standin: Any) -> None:
    """The part retries, waiting for the registry, and asked it ``registrations`` times:
    nothing it answered was kept. Shown on /metrics and /readyz."""
    part = worker(relay, name)
    wait_until(lambda: part.stats.waiting_on == "schema_registry", 120, "the part to wait")
    wait_until(lambda: standin.count("POST", REGISTER) >= registrations, 300, "retries")
    assert (part.stats.poisoned, part.stats.dead_lettered, part.stats.published) == (0, 0, 0)
    assert relay.http is not None
    base = f"http://127.0.0.1:{relay.http.port}"
    waiting = (
        f'outbox_relay_part_waiting{{part="0",service="schema_registry",subscriber="{name}"}} 1.0'
    )
    assert waiting in http_get(base + "/metrics")[1].splitlines()
    status, ready = http_get(base + "/readyz")
    assert status == 200 and ready.rstrip().endswith(f": {name}/0"), ready


def _warnings(caplog: pytest.LogCaptureFixture, event: str) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if getattr(r, "event", None) == event and r.levelno >= logging.WARNING
    ]


def test_an_id_that_is_no_id_stalls_the_part_never_poisons_and_heals(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    outbox: Outbox,
    kafka_bootstrap: str,
    topic_prefix: str,
    start_relay: StartRelay,
    schema_registry: str,
    standin_registry: StandinRegistry,
    caplog: pytest.LogCaptureFixture,
    relay_url: str,
) -> None:
    """An id of -7 used to dead-letter every valid event (and was cached). `status`
    shows the part waiting for the registry, and why, until it heals (issue #48)."""
    standin_registry.script("POST", REGISTER, (200, {"id": -7}))
    definition = [sub("minus", topic_prefix, value_format="avro-registry", on_poison="dead-letter")]
    write_orders(writer_db, outbox, IDS)
    relay = start_relay(schema_registry_url=standin_registry.url, subscribers=definition)

    _waits_for_the_registry(relay, "minus", 3, standin_registry)
    _nothing_dead_or_halted(db, "minus")
    [said] = _warnings(caplog, "registry.unreachable")  # once, not once per retry
    assert "answered -7 as the id of demo.orders.OrderPlaced" in said.getMessage()
    assert len(_warnings(caplog, "part_retrying")) == 1  # the part's retries are counted
    part = PartId("minus", 0)
    wait_until(
        lambda: part_status(relay_url, part)["waiting_on"] == "schema_registry", 60, "status"
    )
    assert "answered -7" in part_status(relay_url, part)["waiting_error"]

    standin_registry.heal()
    wait_caught_up(db, "minus", timeout=300)
    wait_until(lambda: part_status(relay_url, part)["waiting_on"] is None, 60, "the wait cleared")
    _every_event_once(schema_registry, kafka_bootstrap, topic_prefix + "outbox.event.order")
    _nothing_dead_or_halted(db, "minus")


def test_an_id_of_another_schema_is_never_framed_and_the_part_heals(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    outbox: Outbox,
    kafka_bootstrap: str,
    topic_prefix: str,
    start_relay: StartRelay,
    schema_registry: str,
    standin_registry: StandinRegistry,
) -> None:
    """A wrong but valid id used to be framed into every record without a check."""
    other = SchemaRegistryClient({"url": schema_registry}).register_schema(
        f"{topic_prefix}other-value", Schema('{"type":"record","name":"X","fields":[]}', "AVRO")
    )
    standin_registry.script("POST", REGISTER, (200, {"id": other}))
    definition = [sub("wrong", topic_prefix, value_format="avro-registry", on_poison="dead-letter")]
    write_orders(writer_db, outbox, IDS)
    relay = start_relay(schema_registry_url=standin_registry.url, subscribers=definition)

    _waits_for_the_registry(relay, "wrong", 3, standin_registry)
    _nothing_dead_or_halted(db, "wrong")
    assert "holds a schema of fingerprint" in (worker(relay, "wrong").stats.last_error or "")

    standin_registry.heal()
    wait_caught_up(db, "wrong", timeout=300)
    _every_event_once(schema_registry, kafka_bootstrap, topic_prefix + "outbox.event.order")


def test_parts_that_race_on_a_subjects_first_schema_publish_without_a_halt(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    outbox: Outbox,
    kafka_bootstrap: str,
    topic_prefix: str,
    start_relay: StartRelay,
    schema_registry: str,
    standin_registry: StandinRegistry,
) -> None:
    """Issue #49: on a fresh deployment Apicurio answered a part 500 (its storage race),
    then, to the client's retry, 409 "already exists": another part had registered the
    subject meanwhile. The part halted as a configuration error until `resume`.
    (tests/integration/test_registry_answers.py provokes the race on Apicurio itself.)"""

    def another_part_won(method: str, path: str, body: bytes) -> tuple[int, bytes]:
        standin_registry.forward(method, path, body)  # the other part's registration
        subject = path.split("/")[2]
        already = f"An artifact with ID '{subject}' in group 'null' already exists."
        return 409, json.dumps({"error_code": 409, "message": already}).encode()

    standin_registry.script(
        "POST",
        REGISTER,
        (500, {"error_code": 50001, "message": "RuntimeSqlException: JdbcSQLTimeoutException"}),
        another_part_won,
        until_healed=False,
    )
    definition = [sub("race", topic_prefix, value_format="avro-registry")]  # on_poison: halt
    write_orders(writer_db, outbox, IDS)
    start_relay(schema_registry_url=standin_registry.url, subscribers=definition)

    wait_caught_up(db, "race", timeout=300)
    assert standin_registry.count("POST", LOOKUP) >= 1  # the 409 was answered, and looked into
    _every_event_once(schema_registry, kafka_bootstrap, topic_prefix + "outbox.event.order")
    _nothing_dead_or_halted(db, "race")


def _safe(text: str) -> None:
    """No escape sequence, no forged line, nothing near 200 KB."""
    assert "\x1b" not in text
    assert "2026-01-01 00:00:00,000 ERROR" not in [line[:29] for line in text.splitlines()]
    assert max((len(line) for line in text.splitlines()), default=0) < 8_000


def test_a_hostile_error_text_reaches_the_log_only_capped_and_escaped(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    outbox: Outbox,
    relay_url: str,
    kafka_bootstrap: str,
    topic_prefix: str,
    schema_registry: str,
    standin_registry: StandinRegistry,
    tmp_path: Path,
) -> None:
    """``outbox-relay run`` as a process, its stderr what an operator's terminal and log
    collector get, while the registry answers 500 with a hostile body; then it heals."""
    standin_registry.script("POST", REGISTER, (500, {"error_code": 50001, "message": HOSTILE}))
    config = tmp_path / "relay.toml"
    config.write_text(
        f'schemas_dir = "{REPO / "schemas"}"\n'
        "[[subscribers]]\n"
        'name = "hostile"\n'
        f'topic = "{topic_prefix}outbox.event.{{aggregate_type}}"\n'
        'value_format = "avro-registry"\n'
        'on_poison = "dead-letter"\n'
    )
    write_orders(writer_db, outbox, IDS)
    env = {
        **os.environ,
        "RELAY_DATABASE_URL": relay_url,
        "RELAY_BOOTSTRAP_SERVERS": kafka_bootstrap,
        "RELAY_SCHEMA_REGISTRY_URL": standin_registry.url,
        "RELAY_METRICS_PORT": "0",
    }
    log = tmp_path / "stderr"
    with log.open("w") as stderr:
        relay = subprocess.Popen(
            [sys.executable, "-m", "relay", "--config", str(config), "run"],
            cwd=REPO,
            env=env,
            stderr=stderr,
        )
        try:
            wait_until(lambda: standin_registry.count("POST", REGISTER) >= 8, 300, "retries")
            _nothing_dead_or_halted(db, "hostile")
            standin_registry.heal()
            wait_caught_up(db, "hostile", timeout=300)
        finally:
            relay.terminate()
            relay.wait(timeout=60)
    said = log.read_text()
    assert "registry says" in said  # the registry's text is there, made safe
    _safe(said)
    assert "\\x1b[2J" in said
    _every_event_once(schema_registry, kafka_bootstrap, topic_prefix + "outbox.event.order")
    _nothing_dead_or_halted(db, "hostile")


def test_a_hostile_refusal_is_stored_and_shown_by_status_capped_and_escaped(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    outbox: Outbox,
    relay_url: str,
    topic_prefix: str,
    start_relay: StartRelay,
    standin_registry: StandinRegistry,
) -> None:
    """A 409 the registry's compatibility test confirms halts the part (a refusal is the
    operator's to fix); its reason, from the registry, is stored and shown safe."""
    conflict = (409, {"error_code": 409, "message": HOSTILE})
    standin_registry.script("POST", REGISTER, conflict)
    standin_registry.script(
        "POST", COMPATIBILITY, (200, {"is_compatible": False, "messages": [HOSTILE]})
    )
    write_orders(writer_db, outbox, IDS[:1])
    start_relay(
        schema_registry_url=standin_registry.url,
        subscribers=[sub("refused", topic_prefix, value_format="avro-registry")],
    )

    store = OutboxStore(db)
    wait_until(lambda: store.get_part("refused", 0).halted_error is not None, 300, "a halt")
    halted = store.get_part("refused", 0).halted_error or ""
    assert "registry says" in halted and "(compatibility" in halted
    _safe(halted)
    assert len(halted) < 4_000 and "\n" not in halted
    shown = run_cli("status", "--database-url", relay_url)
    assert shown.returncode == 0, shown.stderr
    assert "registry says" in shown.stdout
    _safe(shown.stdout + shown.stderr)


def test_credentials_are_not_sent_to_a_plain_http_registry(
    relay_url: str, topic_prefix: str, standin_registry: StandinRegistry
) -> None:
    """Basic auth over http:// crossed the network in clear: refused, naming the setting
    that allows it where the network is trusted."""
    add = ["subscribers", "add", "clear", "--format", "avro-registry",
           "--topic", f"{topic_prefix}orders", "--schema-registry-url", standin_registry.url,
           "--database-url", relay_url, "--schemas-dir", str(REPO / "schemas")]  # fmt: skip
    credentials = {
        "RELAY_SCHEMA_REGISTRY_USER": "relay",
        "RELAY_SCHEMA_REGISTRY_PASSWORD": "pw-in-clear",
    }

    refused = run_cli(*add, env=credentials)

    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "schema_registry_allow_http_credentials" in refused.stderr
    assert standin_registry.seen == []  # nothing sent at all
    allowed = run_cli(
        *add, env={**credentials, "RELAY_SCHEMA_REGISTRY_ALLOW_HTTP_CREDENTIALS": "true"}
    )
    assert allowed.returncode == 0, allowed.stderr
    assert standin_registry.seen != []  # checked against the registry, as asked
