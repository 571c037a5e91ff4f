"""``outbox-relay topics list|create`` against the real broker, as users run it."""

from __future__ import annotations

import json

from confluent_kafka.admin import AdminClient, ConfigResource  # type: ignore[attr-defined]

from tests.support import run_cli


def _describe(bootstrap: str, topic: str) -> tuple[int, dict[str, str]]:
    """(partitions, the topic's non-default settings), read back from the broker."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    partitions = len(admin.list_topics(topic, timeout=10).topics[topic].partitions)
    resource = ConfigResource(ConfigResource.Type.TOPIC, topic)
    configs = admin.describe_configs([resource])[resource].result(timeout=10)
    return partitions, {k: v.value for k, v in configs.items() if not v.is_default}


def test_topics_create_then_list(kafka_bootstrap: str, topic_prefix: str) -> None:
    compacted, plain = topic_prefix + "compacted", topic_prefix + "plain"
    env = {"RELAY_BOOTSTRAP_SERVERS": kafka_bootstrap}
    created = run_cli(
        "topics", "create", compacted, plain, "--partitions", "2",
        "--config", "cleanup.policy=compact", env=env, timeout=60,
    )  # fmt: skip
    assert created.returncode == 0, created.stderr
    assert f"created: {compacted}" in created.stdout and f"created: {plain}" in created.stdout
    partitions, settings = _describe(kafka_bootstrap, compacted)
    assert partitions == 2 and settings.get("cleanup.policy") == "compact"

    # Again: an existing topic is an error, unless --if-not-exists.
    again = run_cli("topics", "create", plain, env=env, timeout=60)
    assert again.returncode == 1 and f"exists: {plain}" in again.stdout, again.stdout
    tolerated = run_cli("topics", "create", plain, "--if-not-exists", env=env, timeout=60)
    assert tolerated.returncode == 0, tolerated.stderr

    listed = run_cli("topics", "list", "--json", "--bootstrap-servers", kafka_bootstrap, timeout=60)
    assert listed.returncode == 0, listed.stderr
    topics = {t["name"]: t for t in json.loads(listed.stdout)}
    assert topics[compacted] == {"name": compacted, "partitions": 2, "replication_factor": 1}
    assert plain in topics
    assert not any(name.startswith("__") for name in topics), "internal topics only on request"
    hidden = "__" + topic_prefix + "internal"  # named like Kafka's own (__consumer_offsets)
    assert run_cli("topics", "create", hidden, env=env, timeout=60).returncode == 0
    visible = run_cli("topics", "list", "--json", env=env, timeout=60)
    assert hidden not in {t["name"] for t in json.loads(visible.stdout)}
    internal = run_cli("topics", "list", "--internal", "--json", env=env, timeout=60)
    assert hidden in {t["name"] for t in json.loads(internal.stdout)}

    table = run_cli("topics", "list", env=env, timeout=60)
    assert table.returncode == 0 and compacted in table.stdout


def test_topics_create_refuses_bad_input(kafka_bootstrap: str, topic_prefix: str) -> None:
    env = {"RELAY_BOOTSTRAP_SERVERS": kafka_bootstrap}
    bad_config = run_cli("topics", "create", topic_prefix + "x", "--config", "oops", env=env)
    assert bad_config.returncode == 2 and "KEY=VALUE" in bad_config.stderr, bad_config.stderr
    bad_name = run_cli("topics", "create", "no/slashes", env=env, timeout=60)
    assert bad_name.returncode == 1, bad_name.stdout
    assert "no/slashes" in bad_name.stderr and "Traceback" not in bad_name.stderr
    no_broker = run_cli("topics", "list", env={"RELAY_BOOTSTRAP_SERVERS": ""})
    assert no_broker.returncode == 2, no_broker.stderr
