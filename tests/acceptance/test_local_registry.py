"""`outbox-relay local --registry`: the local stack with a schema registry, whose URL it
prints to export beside the others; an avro-registry subscriber is then added against
it as docs/configuration.md says, with nothing but the printed exports, and the page's
TOML block runs as written."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from tests.support import REPO, fenced_blocks, local_workdir, run_cli

pytestmark = [pytest.mark.registry, pytest.mark.timeout(1800)]


@pytest.fixture
def workdir() -> Iterator[Path]:
    with local_workdir("outbox-local-registry-", "local") as folder:
        yield folder


def exports(local: subprocess.Popen[str], deadline: float) -> dict[str, str]:
    """The variables ``local`` prints to export, once it printed all of them."""
    found: dict[str, str] = {}
    assert local.stdout is not None
    for line in local.stdout:
        assert time.monotonic() < deadline, f"no exports yet: {found}"
        if line.startswith("export "):
            name, _, value = line.removeprefix("export ").strip().partition("=")
            found[name] = shlex.split(value)[0]
        elif line.startswith("The URL's password"):
            return found
    raise AssertionError(f"local ended first (exit {local.wait()}): {found}")


def start_local(workdir: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "relay", "local", "--registry", "--workdir", str(workdir)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
        text=True, cwd=REPO,
    )  # fmt: skip


def stop(process: subprocess.Popen[str], log: Path | None = None) -> None:
    """Ctrl-C, as at a terminal; it ends cleanly (its stderr: piped, or in ``log``)."""
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, (stderr or log.read_text() if log else stderr)[-3000:]


def test_local_with_a_registry_prints_its_url_and_serves_avro_registry(workdir: Path) -> None:
    local = start_local(workdir)
    try:
        env = exports(local, time.monotonic() + 900)
        assert set(env) == {
            "RELAY_DATABASE_URL",
            "RELAY_BOOTSTRAP_SERVERS",
            "RELAY_SCHEMA_REGISTRY_URL",
        }
        with urllib.request.urlopen(
            f"{env['RELAY_SCHEMA_REGISTRY_URL']}/subjects", timeout=30
        ) as r:
            assert json.load(r) == []  # a registry, answering, empty
        added = run_cli(
            "subscribers", "add", "orders", "--format", "avro-registry",
            "--schemas-dir", str(REPO / "schemas" / "demo"),
            env={**os.environ, **env}, timeout=300,
        )  # fmt: skip
        assert added.returncode == 0, added.stderr
    finally:
        stop(local)


def _configuration_toml() -> str:
    """docs/configuration.md's TOML block of an avro-registry subscriber."""
    blocks = fenced_blocks(REPO / "docs" / "configuration.md", "toml")
    [block] = [b for b in blocks if 'value_format = "avro-registry"' in b]
    return block


FIRST_EVENT = (
    "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
    "VALUES ('order', %s, 'OrderPlaced', "
    "json_build_object('order_id', %s::text, 'customer_id', 'c-7', 'amount_cents', 1250))"
)


def test_the_configuration_pages_toml_publishes_through_the_registry(
    workdir: Path, tmp_path: Path
) -> None:
    """The block, saved as relay.toml, run from the repository's folder with `local
    --registry`'s exports: each event reaches orders.order in the registry's format,
    under the subject orders.order-value, and `topics tail` decodes it."""
    config = tmp_path / "relay.toml"
    config.write_text(_configuration_toml())
    local = start_local(workdir)
    try:
        env = {**os.environ, **exports(local, time.monotonic() + 900), "RELAY_METRICS_PORT": "0"}
        log = tmp_path / "relay.log"
        with log.open("w") as stderr:
            relay = subprocess.Popen(
                [sys.executable, "-m", "relay", "--config", str(config), "run"],
                stdout=subprocess.DEVNULL, stderr=stderr, stdin=subprocess.DEVNULL,
                text=True, cwd=REPO, env=env,
            )  # fmt: skip
        try:
            with psycopg.connect(env["RELAY_DATABASE_URL"], autocommit=True) as conn:
                for i in range(5):
                    conn.execute(FIRST_EVENT, (str(i), str(i)))
            tailed = run_cli(
                "--config", str(config), "topics", "tail", "orders.order",
                "--from-beginning", "--max", "5", "--timeout", "120", "--json",
                env=env, timeout=300,
            )  # fmt: skip
        finally:
            stop(relay, log)
        with urllib.request.urlopen(
            f"{env['RELAY_SCHEMA_REGISTRY_URL']}/subjects", timeout=30
        ) as r:
            assert json.load(r) == ["orders.order-value"]
    finally:
        stop(local)
    assert tailed.returncode == 0, tailed.stderr
    shown = [json.loads(line)["value"] for line in tailed.stdout.splitlines()]
    assert sorted((v["encoding"], v["content"]["order_id"]) for v in shown) == [
        ("avro-registry", str(i)) for i in range(5)
    ]  # five keys, so partitions: each event once, in no set order
