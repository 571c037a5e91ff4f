"""The Spark jobs' plumbing that needs no Spark: the relay's Kafka settings as Spark and
confluent-kafka options, and a job failure's one-line reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relay.errors import ConfigError
from spark_jobs.kafka_clients import KafkaClients, connection_settings, java_properties

SCRAM = {
    "security.protocol": "SASL_SSL",
    "sasl.mechanisms": "SCRAM-SHA-512",
    "sasl.username": "spark",
    "sasl.password": 'pa"ss\\word',
    "ssl.ca.location": "/etc/ca.pem",
    "enable.ssl.certificate.verification": True,
    "linger.ms": 20,  # the relay's producer tuning: not a reader's business
}


def test_librdkafka_settings_become_the_java_clients_for_spark() -> None:
    options = KafkaClients("k:9093", connection_settings(SCRAM)).spark_options()
    assert options == {
        "kafka.bootstrap.servers": "k:9093",
        "kafka.isolation.level": "read_committed",
        "kafka.security.protocol": "SASL_SSL",
        "kafka.sasl.mechanism": "SCRAM-SHA-512",
        "kafka.sasl.jaas.config": "org.apache.kafka.common.security.scram.ScramLoginModule "
        'required username="spark" password="pa\\"ss\\\\word";',
        "kafka.ssl.truststore.location": "/etc/ca.pem",
        "kafka.ssl.truststore.type": "PEM",
    }


def test_plain_and_keystores_map_and_pem_client_keys_are_refused_by_name() -> None:
    plain = java_properties({"sasl.mechanism": "PLAIN", "sasl.username": "u", "sasl.password": "p"})
    assert plain["sasl.jaas.config"].startswith(
        "org.apache.kafka.common.security.plain.PlainLoginModule required"
    )
    keystore = java_properties({"ssl.keystore.location": "/k.p12", "ssl.keystore.password": "x"})
    assert keystore["ssl.keystore.type"] == "PKCS12"
    with pytest.raises(ConfigError, match=r"kafka\.ssl\.key\.location: .*PKCS#12"):
        java_properties({"ssl.key.location": "/key.pem"})
    with pytest.raises(ConfigError, match="always verifies"):
        java_properties({"enable.ssl.certificate.verification": False})
    with pytest.raises(ConfigError, match="GSSAPI"):
        java_properties({"sasl.username": "u", "sasl.password": "p"})


def test_the_jobs_read_the_relays_kafka_settings_and_mask_secrets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("RELAY_KAFKA", "RELAY_KAFKA_FILE", "RELAY_DATABASE_URL_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RELAY_KAFKA", json.dumps(SCRAM))
    clients = KafkaClients.from_relay_settings("k:9093")
    assert clients.librdkafka({"group.id": "g"}) == {
        **{k: v for k, v in SCRAM.items() if k != "linger.ms"},
        "bootstrap.servers": "k:9093",
        "group.id": "g",
    }
    assert 'pa"ss' not in clients.described() and "sasl.password=**********" in clients.described()

    secret = tmp_path / "kafka.json"
    secret.write_text(json.dumps({"sasl.username": "from-file", "sasl.password": "p"}))
    monkeypatch.delenv("RELAY_KAFKA")
    monkeypatch.setenv("RELAY_KAFKA_FILE", str(secret))
    assert KafkaClients.from_relay_settings("k").settings["sasl.username"] == "from-file"

    config = tmp_path / "relay.toml"
    config.write_text('[relay.kafka]\n"security.protocol" = "SSL"\n')
    monkeypatch.delenv("RELAY_KAFKA_FILE")
    assert KafkaClients.from_relay_settings("k", config).settings == {"security.protocol": "SSL"}


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        (
            "An error occurred while calling o71.awaitTermination.\n"
            ": org.apache.spark.sql.streaming.StreamingQueryException: [STREAM_FAILED] Query "
            "[id = 1] terminated with exception: Job aborted.\n"
            "\tat org.apache.spark.sql...\n"
            "Caused by: org.apache.spark.SparkException: Job aborted due to stage failure\n"
            "Caused by: org.apache.kafka.common.errors.TopicAuthorizationException: Not "
            "authorized to access topics: [orders]\n\tat org.apache.kafka...",
            "TopicAuthorizationException: Not authorized to access topics: [orders]",
        ),
        (
            "[STREAM_FAILED] Query terminated with exception: An exception was raised by the "
            "Python Proxy. Return Message: Traceback (most recent call last):\n"
            '  File "x.py", line 1, in call\n'
            "spark_jobs.postgres_sink.SinkOwnedError: sink s holds the batches of streaming "
            "query a, but this query is b\n",
            "SinkOwnedError: sink s holds the batches of streaming query a, but this query is b",
        ),
        (  # issue #48: the line stopped just before the cause, whose name ends in neither
            "[STREAM_FAILED] Query [id = 1, runId = 2] terminated with exception: "
            "[FOREACH_BATCH_USER_FUNCTION_ERROR] An error occurred in the user provided "
            "function in foreach batch sink. Reason: An exception was raised by the Python "
            "Proxy. Return Message: Traceback (most recent call last):\n"
            '  File "py4j/clientserver.py", line 644, in _call_proxy\n'
            "    return_value = getattr(self.pool[obj_id], method)(*params)\n"
            "                   ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n"
            '  File "spark_jobs/order_projection.py", line 99, in write\n'
            'psycopg.errors.NotNullViolation: null value in column "order_id" of relation '
            '"orders" violates not-null constraint\n'
            "DETAIL:  Failing row contains (null).\n SQLSTATE: 39000 SQLSTATE: XXKST\n"
            "=== Streaming Query ===\nIdentifier: [id = 1, runId = 2]\n"
            "\tat org.apache.spark.sql.execution.streaming.sources.ForeachBatchSink...",
            'NotNullViolation: null value in column "order_id" of relation "orders" violates '
            "not-null constraint",
        ),
        (  # a chained Python exception: its root is printed first
            "Return Message: Traceback (most recent call last):\n"
            '  File "spark_jobs/kafka_sink.py", line 120, in commit\n'
            "cimpl.KafkaException: KafkaError{code=_FENCED,val=-144}\n\n"
            "The above exception was the direct cause of the following exception:\n\n"
            "Traceback (most recent call last):\n"
            '  File "spark_jobs/kafka_sink.py", line 125, in commit\n'
            "spark_jobs.kafka_sink.KafkaSinkError: sink s: batch 3 not committed\n",
            "KafkaException: KafkaError{code=_FENCED,val=-144}",
        ),
    ],
)
def test_a_failure_is_shown_by_its_innermost_cause(text: str, reason: str) -> None:
    pytest.importorskip("pyspark")
    from spark_jobs.job import failure_reason

    assert failure_reason(RuntimeError(text)) == reason
    assert failure_reason(ConfigError("kafka: bad")) == "kafka: bad"
    assert failure_reason(ValueError("no")) == "ValueError: no"


def test_a_python_failure_is_shown_by_its_root_cause_and_a_config_error_in_one_line() -> None:
    pytest.importorskip("pyspark")
    from relay.errors import RelayError
    from spark_jobs.job import failure_reason

    try:
        try:
            raise ConnectionRefusedError("connection refused")
        except OSError as exc:
            raise RelayError("cannot reach the registry") from exc
    except RelayError as wrapped:
        assert failure_reason(wrapped) == "ConnectionRefusedError: connection refused"
    settings = ConfigError("invalid settings:\n  kafka: bad\n  batch_size: too big")
    assert failure_reason(settings) == "invalid settings: kafka: bad batch_size: too big"
