"""A new user's first run: only a database URL and bootstrap servers, no Avro schemas,
rows written with the README's plain SQL."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest

from relay.core.settings import load_settings
from relay.errors import ConfigError
from tests.support import REPO, consume, fenced_blocks, run_cli, wait_caught_up


def _relay_process(
    relay_url: str, kafka_bootstrap: str, cwd: Path, *options: str, **env: str
) -> subprocess.Popen[str]:
    """``python -m relay [options] run`` in ``cwd``, as the relay role, its stderr piped."""
    environment = {
        **os.environ,
        "RELAY_DATABASE_URL": relay_url,
        "RELAY_BOOTSTRAP_SERVERS": kafka_bootstrap,
        "RELAY_METRICS_PORT": "0",
        "PYTHONPATH": str(REPO),
        **env,
    }
    environment.pop("RELAY_SCHEMAS_DIR", None)
    return subprocess.Popen(
        [sys.executable, "-m", "relay", *options, "run"],
        cwd=cwd,
        env=environment,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_plain_sql_rows_of_any_event_type_are_published_without_schemas(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    relay_url: str,
    kafka_bootstrap: str,
    tmp_path: Path,
) -> None:
    aggregate = f"shop{uuid.uuid4().hex[:8]}"
    # From a folder without schemas/, as a user's own project would be.
    relay = _relay_process(relay_url, kafka_bootstrap, tmp_path)
    try:
        for event_type in ("OrderPlaced", "SomethingNobodyDeclared"):
            writer_db.execute(
                "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                'VALUES (%s, \'42\', %s, \'{"order_id": "42", "amount_cents": 1250}\')',
                (aggregate, event_type),
            )
        seen = consume(kafka_bootstrap, [f"outbox.event.{aggregate}"], 2, timeout=60)
        wait_caught_up(db, "default")
    finally:
        relay.terminate()
        _, stderr = relay.communicate(timeout=60)
    assert relay.returncode == 0, stderr
    assert [json.loads(s.value)["amount_cents"] for s in seen] == [1250, 1250]
    assert "created 'default' routing every event as json" in stderr


def test_a_configured_schemas_folder_that_is_missing_is_an_error_at_start(
    db: psycopg.Connection[Any], relay_url: str, kafka_bootstrap: str, tmp_path: Path
) -> None:
    result = run_cli(
        "run",
        env={
            "RELAY_DATABASE_URL": relay_url,
            "RELAY_BOOTSTRAP_SERVERS": kafka_bootstrap,
            "RELAY_METRICS_PORT": "0",
            "RELAY_SCHEMAS_DIR": str(tmp_path / "no-such-folder"),
        },
    )
    assert result.returncode == 2
    assert "schemas_dir" in result.stderr and "no-such-folder" in result.stderr


def test_avro_subscribers_without_schemas_are_an_error_at_start(
    db: psycopg.Connection[Any], relay_url: str, kafka_bootstrap: str
) -> None:
    from relay.daemon import Relay

    # Added where schemas are configured (the CLI's settings), run where they are not.
    schemas = str(Path(__file__).resolve().parents[2] / "schemas")
    added = run_cli(
        "subscribers", "add", "typed", "--format", "avro",
        env={"RELAY_DATABASE_URL": relay_url, "RELAY_SCHEMAS_DIR": schemas},
    )  # fmt: skip
    assert added.returncode == 0, added.stderr
    settings = load_settings(
        database_url=relay_url, bootstrap_servers=kafka_bootstrap, metrics_enabled=False
    )
    relay = Relay(settings)
    with pytest.raises(ConfigError, match=r"subscriber 'typed' publishes avro(?s:.*)pause it"):
        relay.start()
    relay.stop()


def test_a_subscriber_declared_in_the_config_file_is_created_and_published(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    relay_url: str,
    kafka_bootstrap: str,
    tmp_path: Path,
) -> None:
    # As deploy/relay.example.toml declares one, with the CLI's INFO logging: the line
    # saying the subscriber was created once crashed the relay at start.
    aggregate = f"cfg{uuid.uuid4().hex[:8]}"
    config = tmp_path / "relay.toml"
    config.write_text(
        "[relay]\n"
        "[[relay.subscribers]]\n"
        'name = "from-config"\n'
        'value_format = "json"\n'
        f'aggregate_types = ["{aggregate}"]\n'
    )
    relay = _relay_process(
        relay_url, kafka_bootstrap, tmp_path, "--config", str(config), RELAY_LOG_LEVEL="INFO"
    )
    try:
        writer_db.execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
            "VALUES (%s, '7', 'Configured', '{\"n\": 7}')",
            (aggregate,),
        )
        seen = consume(kafka_bootstrap, [f"outbox.event.{aggregate}"], 1, timeout=60)
    finally:
        relay.terminate()
        _, stderr = relay.communicate(timeout=60)
    assert relay.returncode == 0, stderr
    assert [json.loads(s.value) for s in seen] == [{"n": 7}], stderr
    assert "created subscriber from-config from config" in stderr


def _readme_block(language: str, containing: str) -> str:
    """README.md's one ``language`` block that contains ``containing``."""
    [block] = [b for b in fenced_blocks(REPO / "README.md", language) if containing in b]
    return block


def test_the_readmes_first_event_is_seen_in_kafka_as_it_says(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    relay_url: str,
    kafka_bootstrap: str,
    tmp_path: Path,
) -> None:
    """README.md's first event, end to end as written: its SQL, as the writer role, to a
    relay with its defaults; its consumer prints what the README says it prints. Only the
    aggregate type (hence the topic) and the servers are this test's own."""
    aggregate = f"first{uuid.uuid4().hex[:8]}"
    insert = _readme_block("sql", "INSERT INTO outbox")
    assert "VALUES ('order', '42', 'OrderPlaced'," in insert
    consumer = _readme_block("python", "Consumer(")
    for written, here in (
        ('"127.0.0.1:9092"', f'"{kafka_bootstrap}"'),
        ('"outbox.event.order"', f'"outbox.event.{aggregate}"'),
    ):
        assert written in consumer
        consumer = consumer.replace(written, here)
    relay = _relay_process(relay_url, kafka_bootstrap, tmp_path)
    try:
        writer_db.execute(insert.replace("'order'", f"'{aggregate}'", 1))
        # Published first (the README's consumer stops after 10 s without a record).
        consume(kafka_bootstrap, [f"outbox.event.{aggregate}"], 1, timeout=120)
        ran = subprocess.run(
            [sys.executable, "-c", consumer],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
    finally:
        relay.terminate()
        _, stderr = relay.communicate(timeout=60)
    assert ran.returncode == 0, ran.stderr
    _tail_as_the_readme_says(kafka_bootstrap, aggregate)
    printed = ran.stdout.splitlines()
    said = "b'42' b'OrderPlaced' {'order_id': '42', 'customer_id': 'c-7', 'amount_cents': 1250}"
    assert printed == [said], (printed, stderr)
    readme = " ".join((REPO / "README.md").read_text().split())
    assert f"It prints `{said}`" in readme


def _tail_as_the_readme_says(kafka_bootstrap: str, aggregate: str) -> None:
    """README.md's `topics tail` line, its topic this test's, prints the event."""
    [line] = [
        line
        for line in _readme_block("bash", "topics tail").splitlines()
        if line.startswith("outbox-relay topics tail")
    ]
    args = shlex.split(line.replace("outbox.event.order", f"outbox.event.{aggregate}"))[1:]
    done = run_cli(*args, env={"RELAY_BOOTSTRAP_SERVERS": kafka_bootstrap})
    assert done.returncode == 0, done.stderr
    assert "  header event_type: OrderPlaced" in done.stdout.splitlines()
    assert '  value: (json) {"order_id": "42", "customer_id": "c-7", "amount_cents": 1250}' in (
        done.stdout.splitlines()
    )
