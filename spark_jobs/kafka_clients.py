"""The Kafka client settings of the Spark jobs: the relay's own, for a TLS/SASL cluster.

The relay takes librdkafka properties from ``kafka`` in its settings (``RELAY_KAFKA``
as a JSON object, ``RELAY_KAFKA__SASL_USERNAME`` and such, ``RELAY_KAFKA_FILE`` naming a
JSON file, or the ``kafka`` table of its config file). The jobs read the same ones.
Their connection and security properties (``security.*``, ``sasl.*``, ``ssl.*``, a few
connection timeouts) go, as they are, to the jobs' own confluent-kafka clients (the
Kafka sink, the admin client), and, as Java client properties, to Spark's Kafka source
(``kafka.*`` options). The others (producer tuning for the relay, say) mean nothing to a
reader and are left out.

librdkafka and the Java client name most of these alike; where they differ:
``sasl.mechanisms`` is ``sasl.mechanism``; ``sasl.username``/``sasl.password`` become a
``sasl.jaas.config`` for the mechanism (PLAIN or SCRAM); ``ssl.ca.location`` (a PEM file)
is a PEM trust store; ``ssl.keystore.location`` is a PKCS#12 key store for both. The
Java client always verifies the broker's certificate
(``enable.ssl.certificate.verification=false`` is refused).
A PEM client certificate and key (``ssl.certificate.location``, ``ssl.key.location``) have
no Java counterpart by file: use a PKCS#12 key store, which both clients read.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relay.core.settings import KafkaValue, load_settings
from relay.errors import ConfigError

# Passed to every client; the rest of the relay's properties are its producer's business.
_CONNECTION_PREFIXES = ("security.", "sasl.", "ssl.")
_CONNECTION_KEYS = frozenset(
    {
        "client.dns.lookup",
        "client.id",
        "connections.max.idle.ms",
        "enable.ssl.certificate.verification",
        "metadata.max.age.ms",
        "reconnect.backoff.max.ms",
        "reconnect.backoff.ms",
        "request.timeout.ms",
        "socket.connection.setup.timeout.ms",
    }
)
_SECRET = re.compile(r"password|secret|token|jaas|oauthbearer\.config", re.IGNORECASE)
MASK = "**********"
_LOGIN_MODULES = {
    "PLAIN": "org.apache.kafka.common.security.plain.PlainLoginModule",
    "SCRAM-SHA-256": "org.apache.kafka.common.security.scram.ScramLoginModule",
    "SCRAM-SHA-512": "org.apache.kafka.common.security.scram.ScramLoginModule",
}
# Same meaning, another name.
_RENAMED = {"sasl.mechanisms": "sasl.mechanism"}
# Handled together below.
_COMBINED = frozenset(
    {"sasl.username", "sasl.password", "ssl.ca.location", "enable.ssl.certificate.verification"}
)
_NO_JAVA_FILE = ("ssl.certificate.location", "ssl.key.location")


@dataclass(frozen=True)
class KafkaClients:
    """Where the cluster is, and how to connect to it (librdkafka property names)."""

    bootstrap_servers: str
    settings: Mapping[str, KafkaValue] = field(default_factory=dict)

    @classmethod
    def from_relay_settings(
        cls, bootstrap_servers: str, config_file: Path | None = None
    ) -> KafkaClients:
        """The relay's Kafka settings (environment, ``RELAY_KAFKA_FILE``, the config
        file's ``kafka`` table), limited to connection and security properties."""
        kafka = load_settings(config_file).kafka
        return cls(bootstrap_servers, connection_settings(kafka))

    def librdkafka(self, overrides: Mapping[str, KafkaValue] | None = None) -> dict[str, Any]:
        """A confluent-kafka client's configuration, with the job's own ``overrides``."""
        return {**self.settings, "bootstrap.servers": self.bootstrap_servers, **(overrides or {})}

    def spark_options(self) -> dict[str, str]:
        """Spark Kafka source (and batch reader) options: ``kafka.``-prefixed Java client
        properties. Always ``read_committed``: the connector's default
        (``read_uncommitted``) would hand a job the transactions the relay aborted."""
        java = java_properties(self.settings)
        java["bootstrap.servers"] = self.bootstrap_servers
        java["isolation.level"] = "read_committed"
        return {f"kafka.{k}": v for k, v in java.items()}

    def described(self) -> str:
        """For logs: the settings with every secret masked."""
        shown = ", ".join(f"{k}={masked(k, v)}" for k, v in sorted(self.settings.items()))
        return f"bootstrap.servers={self.bootstrap_servers}" + (f", {shown}" if shown else "")


def connection_settings(kafka: Mapping[str, KafkaValue]) -> dict[str, KafkaValue]:
    """The properties of ``kafka`` every client needs to reach the cluster."""
    return {
        k: v
        for k, v in kafka.items()
        if k.startswith(_CONNECTION_PREFIXES) or k in _CONNECTION_KEYS
    }


def java_properties(settings: Mapping[str, KafkaValue]) -> dict[str, str]:
    """librdkafka connection properties → the Java client's (see the module doc)."""
    found = [k for k in _NO_JAVA_FILE if k in settings]
    if found:
        raise ConfigError(
            f"kafka.{found[0]}: Spark's Kafka source (a Java client) cannot read a PEM "
            "certificate or key by file; put them in a PKCS#12 key store and set "
            "ssl.keystore.location and ssl.keystore.password instead (both clients read it)"
        )
    if str(settings.get("enable.ssl.certificate.verification", True)).lower() == "false":
        raise ConfigError(
            "kafka.enable.ssl.certificate.verification: Spark's Kafka source (a Java client) "
            "always verifies the broker's certificate; give it the CA instead (ssl.ca.location)"
        )
    java = {_RENAMED.get(k, k): _java_value(v) for k, v in settings.items() if k not in _COMBINED}
    if "ssl.keystore.location" in java:
        java.setdefault("ssl.keystore.type", "PKCS12")  # librdkafka's only key store kind
    if "ssl.ca.location" in settings:
        java["ssl.truststore.location"] = str(settings["ssl.ca.location"])
        java["ssl.truststore.type"] = "PEM"
    if "ssl.endpoint.identification.algorithm" in java:
        algorithm = java["ssl.endpoint.identification.algorithm"]
        java["ssl.endpoint.identification.algorithm"] = "" if algorithm == "none" else algorithm
    if "sasl.username" in settings or "sasl.password" in settings:
        java["sasl.jaas.config"] = _jaas(java.get("sasl.mechanism", "GSSAPI"), settings)
    return java


def masked(key: str, value: object) -> object:
    return MASK if _SECRET.search(key) else value


def _jaas(mechanism: str, settings: Mapping[str, KafkaValue]) -> str:
    module = _LOGIN_MODULES.get(mechanism.upper())
    if module is None:
        raise ConfigError(
            f"kafka.sasl.username: SASL mechanism {mechanism!r} takes no user name and "
            f"password; the jobs map them for {', '.join(_LOGIN_MODULES)} (kafka.sasl.mechanism)"
        )
    user, password = (_jaas_quoted(settings.get(k, "")) for k in ("sasl.username", "sasl.password"))
    return f"{module} required username={user} password={password};"


def _jaas_quoted(value: KafkaValue) -> str:
    text = str(value).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{text}"'


def _java_value(value: KafkaValue) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)
