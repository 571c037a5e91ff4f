"""Issue #47, low: deploy/k8s/ and the compose stack give the relay its secrets as files
(RELAY_DATABASE_URL_FILE, RELAY_KAFKA_FILE), never as variables. The relay, run as users
run it, reads them from read-only files as the kubelet mounts them, and a file that
does not hold a working secret is named, never quoted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest

from tests.support import REPO, consume, run_cli, sub


def _secret(folder: Path, name: str, value: str) -> Path:
    """A file as a Secret volume holds it: read-only, for its owner and group."""
    path = folder / name
    path.write_text(value + "\n")
    path.chmod(0o440)
    return path


def test_the_relay_reads_its_database_url_and_kafka_settings_from_files(
    relay_url: str,
    writer_url: str,
    kafka_bootstrap: str,
    topic_prefix: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for variable in ("RELAY_DATABASE_URL", "RELAY_KAFKA"):
        monkeypatch.delenv(variable, raising=False)
    env = {
        "RELAY_DATABASE_URL_FILE": str(_secret(tmp_path, "database-url", relay_url)),
        "RELAY_KAFKA_FILE": str(_secret(tmp_path, "kafka", json.dumps({"client.id": "files"}))),
        "RELAY_BOOTSTRAP_SERVERS": kafka_bootstrap,
        "RELAY_SUBSCRIBERS": json.dumps([sub("s", topic_prefix, value_format="json")]),
        "RELAY_METRICS_PORT": "0",
    }
    relay = subprocess.Popen(
        [sys.executable, "-m", "relay", "run"],
        cwd=REPO,
        env={**os.environ, **env},
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        with psycopg.connect(writer_url, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)"
                " VALUES ('order', 'k', 'OrderPlaced', '{}')"
            )
        [record] = consume(kafka_bootstrap, [topic_prefix + "outbox.event.order"], 1)
        assert record.key == b"k"
    finally:
        relay.send_signal(signal.SIGTERM)
        _, stderr = relay.communicate(timeout=60)
    assert relay.returncode == 0, stderr
    status = run_cli("status", "--json", env=env)
    assert status.returncode == 0, status.stderr
    assert [p["part"] for p in json.loads(status.stdout)["parts"]] == ["s/0"]


def test_a_wrong_password_in_the_file_is_refused_and_never_echoed(
    relay_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RELAY_DATABASE_URL", raising=False)
    parts = urlsplit(relay_url)
    wrong = "Wrong-Secret-1f3a"
    login = f"{parts.username}:{wrong}@{parts.hostname}:{parts.port}"
    url = urlunsplit(parts._replace(netloc=login))
    env = {"RELAY_DATABASE_URL_FILE": str(_secret(tmp_path, "database-url", url))}
    for command in (("status",), ("subscribers", "list")):
        result = run_cli(*command, env=env, timeout=60)
        assert result.returncode == 1, result.stderr
        assert "permanent" in result.stderr and "fix the user or password" in result.stderr
        assert wrong not in result.stdout + result.stderr
