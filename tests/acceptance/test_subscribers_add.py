"""Issue #28: `subscribers add` refuses what would fail every event or be ignored, and
picks the value format the README promises."""

from __future__ import annotations

import json
from typing import Any

import psycopg

from tests.support import REPO, run_cli


def _formats(env: dict[str, str]) -> dict[str, str]:
    listed = run_cli("subscribers", "list", "--json", env=env)
    assert listed.returncode == 0, listed.stderr
    return {s["name"]: s["format"] for s in json.loads(listed.stdout)}


def test_avro_without_schemas_is_refused_naming_the_key(
    db: psycopg.Connection[Any], database_url: str
) -> None:
    env = {"RELAY_DATABASE_URL": database_url}
    refused = run_cli("subscribers", "add", "a", "--format", "avro", env=env)
    assert refused.returncode == 2, refused.stderr
    assert "schemas_dir" in refused.stderr and "'a'" in refused.stderr
    assert _formats(env) == {}
    schemas = ["--schemas-dir", str(REPO / "schemas")]
    added = run_cli("subscribers", "add", "a", "--format", "avro", *schemas, env=env)
    assert added.returncode == 0, added.stderr


def test_avro_registry_needs_a_registry_and_schemas_and_keeps_its_subject_strategy_and_key(
    db: psycopg.Connection[Any], database_url: str
) -> None:
    env = {"RELAY_DATABASE_URL": database_url}
    strategy = ["--format", "avro-registry", "--subject-strategy", "topic-record"]
    refused = run_cli("subscribers", "add", "r", *strategy, env=env)
    assert refused.returncode == 2, refused.stderr
    assert "schema_registry_url" in refused.stderr and "schemas_dir" in refused.stderr
    assert _formats(env) == {}
    configured = {
        **env,
        "RELAY_SCHEMAS_DIR": str(REPO / "schemas"),
        "RELAY_SCHEMA_REGISTRY_URL": "http://registry.invalid:8081",
    }
    nonsense = run_cli("subscribers", "add", "r", "--key-format", "avro-registry", env=configured)
    assert nonsense.returncode != 0
    assert "key format avro-registry needs value format avro-registry" in nonsense.stderr
    assert _formats(env) == {}
    keyed = [*strategy, "--key-format", "avro-registry", "--topic", "orders"]
    added = run_cli("subscribers", "add", "r", *keyed, env=configured)
    assert added.returncode == 0, added.stderr
    # The registry cannot be reached: the compatibility check is skipped, and says so.
    assert "schemas not checked against the registry" in added.stderr
    [listed] = json.loads(run_cli("subscribers", "list", "--json", env=env).stdout)
    assert (listed["format"], listed["subject_strategy"], listed["key_format"]) == (
        "avro-registry",
        "topic-record",
        "avro-registry",
    )


def test_the_default_format_is_avro_when_schemas_are_configured(
    db: psycopg.Connection[Any], database_url: str
) -> None:
    env = {"RELAY_DATABASE_URL": database_url}
    assert run_cli("subscribers", "add", "plain", "--topic", "p", env=env).returncode == 0
    with_schemas = {**env, "RELAY_SCHEMAS_DIR": str(REPO / "schemas")}
    assert run_cli("subscribers", "add", "typed", "--topic", "t", env=with_schemas).returncode == 0
    assert _formats(env) == {"plain": "json", "typed": "avro"}


def test_a_dead_letter_topic_without_the_dead_letter_policy_is_refused(
    db: psycopg.Connection[Any], database_url: str
) -> None:
    env = {"RELAY_DATABASE_URL": database_url}
    refused = run_cli("subscribers", "add", "d", "--dead-letter-topic", "d.dlq", env=env)
    assert refused.returncode == 2 and "--on-poison dead-letter" in refused.stderr
    assert _formats(env) == {}
    added = run_cli(
        "subscribers", "add", "d", "--dead-letter-topic", "d.dlq",
        "--on-poison", "dead-letter", env=env,
    )  # fmt: skip
    assert added.returncode == 0, added.stderr
