"""The one validated settings model: flags > ``RELAY_*`` environment > TOML file > defaults."""

from __future__ import annotations

import contextvars
import difflib
import importlib.util
import json
import os
import re
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict
from pydantic_settings.exceptions import SettingsError

from relay.core.database_url import parse_url
from relay.core.formats import format_of
from relay.core.redact import mask_url, redact, remember
from relay.core.routing import (
    DEFAULT_KEY,
    MAX_PARTITION_COUNT,
    Routing,
    RowField,
    check_partition_count,
)
from relay.core.subscribers import (
    DEFAULT_TOPIC,
    MAX_PARTS,
    KeyFormat,
    PoisonPolicy,
    StartFrom,
    SubjectStrategy,
    ValueFormat,
    validate_name,
    validate_topic_template,
)
from relay.errors import ConfigError, SubscriberError

KafkaValue = str | int | float | bool
# librdkafka properties whose values are secrets: passwords and passphrases
# (sasl.password, ssl.key.password, ...private.key.passphrase), keys inline (ssl.key.pem,
# and any *.pem: certificates are public, but telling them apart by name is not worth a
# leak), client secrets, OAuth and JAAS configs, tokens. Not file locations.
_SECRET_KAFKA_KEY = re.compile(
    r"password|passphrase|secret|token|oauthbearer\.config|jaas|\.pem$", re.IGNORECASE
)
_T = TypeVar("_T")
_config_file: contextvars.ContextVar[Path | None] = contextvars.ContextVar(
    "relay_config_file", default=None
)


class SubscriberSettings(BaseModel):
    """A subscriber declared in the config file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    topic: str = DEFAULT_TOPIC
    # None: Avro when a schemas folder is configured, JSON otherwise.
    value_format: ValueFormat | None = None
    aggregate_types: list[str] | None = None
    event_types: list[str] | None = None
    start_from: StartFrom = StartFrom.BEGINNING
    # Shard the subscriber over relays by a hash of aggregate_id (fixed at creation).
    parts: int = Field(default=1, ge=1, le=MAX_PARTS)
    on_poison: PoisonPolicy = PoisonPolicy.HALT
    dead_letter_topic: str | None = None
    # avro-registry: the subject a schema is registered under (topic: <topic>-value).
    subject_strategy: SubjectStrategy = SubjectStrategy.TOPIC
    # Routing control (relay/core/routing.py): the key template, the partition field, and
    # "field:header|envelope[:alias]" placements.
    key: str = DEFAULT_KEY
    partition_by: str | None = None
    # With partition_by: its values are 0 to N-1; the subscriber's topics need N partitions.
    partition_count: int | None = Field(default=None, ge=1, le=MAX_PARTITION_COUNT)
    placements: list[str] = Field(default_factory=list)
    # avro-registry: the record key as text (string) or registry-encoded (avro-registry).
    key_format: KeyFormat = KeyFormat.STRING

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        return _as_value_error(validate_name, value)

    @field_validator("topic")
    @classmethod
    def _topic(cls, value: str) -> str:
        return _as_value_error(validate_topic_template, value)

    @field_validator("dead_letter_topic")
    @classmethod
    def _dead_letter_policy(cls, value: str | None, info: ValidationInfo) -> str | None:
        # As `subscribers add` refuses --dead-letter-topic without --on-poison
        # dead-letter: the topic would be ignored, and poison halt the part.
        if value is not None and info.data.get("on_poison") is not PoisonPolicy.DEAD_LETTER:
            raise ValueError(
                'used only with on_poison = "dead-letter"; add it, or drop dead_letter_topic'
            )
        return value

    @field_validator("key")
    @classmethod
    def _key(cls, value: str) -> str:
        return _as_value_error(lambda key: Routing.parse(key, None, None), value)

    @field_validator("partition_by")
    @classmethod
    def _partition_by(cls, value: str | None) -> str | None:
        if value is not None:
            _as_value_error(lambda field: RowField.parse(field, "partition_by"), value)
        return value

    @field_validator("placements")
    @classmethod
    def _placements(cls, value: list[str]) -> list[str]:
        _as_value_error(lambda items: Routing.parse(None, None, items), value)
        return value

    @field_validator("key_format")
    @classmethod
    def _key_needs_registry(cls, value: KeyFormat, info: ValidationInfo) -> KeyFormat:
        value_format = info.data.get("value_format")
        registered = value_format is not None and format_of(value_format).registry
        if value is KeyFormat.AVRO_REGISTRY and not registered:
            raise ValueError(
                'avro-registry keys need value_format = "avro-registry"; use key_format = '
                '"string", or that value format'
            )
        return value

    @model_validator(mode="after")
    def _partition_count(self) -> SubscriberSettings:
        try:
            check_partition_count(self.partition_by, self.partition_count)
        except SubscriberError as exc:
            raise ValueError(str(exc)) from exc
        return self


class Settings(BaseSettings):
    """Everything the relay can be told. Keys are the same in the file, as ``RELAY_<KEY>``
    environment variables (``RELAY_KAFKA__SECURITY_PROTOCOL`` for nested keys) and as flags."""

    model_config = SettingsConfigDict(
        env_prefix="RELAY_",
        env_nested_delimiter="__",
        extra="forbid",
        # pydantic's own error text quotes the input, the database URL's password with it.
        hide_input_in_errors=True,
    )

    database_url: SecretStr | None = None
    database_schema: str = Field(default="public", min_length=1, max_length=63)
    bootstrap_servers: str | None = None
    # Passed verbatim to librdkafka (TLS, SASL, compression...), e.g. {"security.protocol": "SSL"}.
    kafka: dict[str, KafkaValue] = Field(default_factory=dict)
    # Writer schemas for Avro subscribers. None (the default): no Avro; subscribers that
    # do not name a format publish JSON, so plain-SQL rows of any event type go out.
    schemas_dir: Path | None = None
    # The schema registry of avro-registry subscribers (Confluent's REST API: Confluent,
    # Apicurio's ccompat, Karapace, Redpanda), with basic auth and a CA file for TLS.
    schema_registry_url: str | None = Field(default=None, pattern=r"^https?://")
    schema_registry_user: str | None = None
    schema_registry_password: SecretStr | None = None
    schema_registry_ca: Path | None = None
    # Basic-auth credentials (a user, a password, or both in the URL) over plain http://
    # cross the network in clear: refused unless this says the network is trusted.
    schema_registry_allow_http_credentials: bool = Field(default=False, validate_default=True)
    # 5000: per-batch costs (a transaction, a checkpoint write) amortized; see bench/.
    batch_size: int = Field(default=5000, ge=1, le=100_000)
    # And at most this many bytes of payloads and headers, as Postgres stores them
    # (compressed), per batch; at least one row. Bounds memory under large rows.
    batch_max_bytes: int = Field(default=4 * 1024 * 1024, ge=1024, le=2**40)
    poll_interval: float = Field(default=1.0, gt=0, le=300)
    # The commit probe (relay/adapters/postgres/probe.py): how often to look for newly decided rows, and
    # how often once nothing has changed for 10 s.
    probe_interval: float = Field(default=0.005, gt=0, le=10)
    probe_idle_interval: float = Field(default=0.05, gt=0, le=60)
    # At most 300 s. Transactional producers use at most their transaction timeout
    # (session_timeout, at least 10 s: librdkafka refuses more; relay/adapters/kafka/kafka.py).
    delivery_timeout: float = Field(default=30.0, gt=0, le=300)
    create_topics: bool = True
    # Rows choose topic names through a template field no filter lists: at most this
    # many topics are created for rows (counted in Postgres, outbox_topics: across
    # restarts, workers and replicas; -1: no cap). The operator's topics (fixed, or named
    # by a filter) never count. Beyond it, a row's new topic waits (never poison).
    max_created_topics: int = Field(default=100, ge=-1)
    # A regular expression every topic a row chooses must match in full (None: any but
    # the reserved ones: _*, connect-*, the checkpoint and dead-letter topics, other
    # subscribers' topics). Topics it matches may be reached though the outbox did not
    # create them; without it only those it created or a filter names (issue #47).
    topic_allow: str | None = None
    topic_partitions: int = Field(default=3, ge=1)
    topic_replication_factor: int = Field(default=-1, ge=-1)
    subscribers: list[SubscriberSettings] = Field(default_factory=list)
    # "transactional": exactly once (Kafka transactions; the default). "idempotent": for
    # brokers without transactions; at-least-once across relay restarts.
    delivery: Literal["transactional", "idempotent"] = "transactional"
    # Prefix of transactional.id and of the checkpoint consumer groups; make it unique
    # per outbox when several share one Kafka cluster.
    kafka_id_prefix: str = Field(default="outbox-relay", pattern=r"^[A-Za-z0-9._-]{1,100}$")
    # Topic whose committed group offsets hold the Kafka-side checkpoints.
    checkpoint_topic: str = Field(
        default="outbox-relay.checkpoints", pattern=r"^[A-Za-z0-9._-]{1,249}$"
    )
    # Member processes of this relay, each with its own session (relay/daemon/processes.py):
    # one process publishes on about one core, so a relay with parts to spread over
    # several cores runs several. 1: the relay is one process.
    workers: int = Field(default=1, ge=1, le=64)
    # Postgres connections a relay process holds at most, shared by all its parts, its
    # session, its commit probe, upkeep and /metrics (relay/adapters/postgres/pool.py): a deployment takes
    # replicas x workers x this many backends, however many subscribers it serves.
    max_db_connections: int = Field(default=4, ge=1, le=1000)
    # Kafka producers a relay process holds at most, lent to the parts that publish
    # (relay/engine/scheduling.py), and as many threads running the parts' turns: an
    # idle part holds none. A part that gets a producer another part held
    # pays for init_transactions and recovery (hundreds of ms), so more busy parts than
    # this take turns (docs/design.md, "Bounded producers").
    max_producers: int = Field(default=8, ge=1, le=256)
    # Transactional producers per part that publishes, taking turns a transaction each:
    # with 2, a part that commits back to back does not wait for its last transaction's
    # markers (relay/adapters/kafka/turns.py). 1 halves the clients (threads, sockets) a
    # publishing part holds; its recovery still fences the second id, then closes it.
    transaction_producers: int = Field(default=2, ge=1, le=2)
    # A relay opens no connection that would leave fewer free slots than this to others
    # (applications): it waits and retries instead.
    keep_free_connections: int = Field(default=5, ge=0, le=10_000)
    # HA: a relay that misses heartbeats for session_timeout loses its parts to peers.
    session_timeout: float = Field(default=10.0, ge=1.0, le=3600)
    heartbeat_interval: float = Field(default=2.0, gt=0, le=600)
    # /metrics, /healthz and /readyz on one port (0: any free port). Loopback unless
    # told otherwise: the endpoints have no authentication. The container image sets
    # RELAY_METRICS_HOST=0.0.0.0 so that probes and Prometheus reach the pod or container.
    metrics_enabled: bool = True
    metrics_port: int = Field(default=9187, ge=0, le=65535)
    metrics_host: str = Field(default="127.0.0.1", min_length=1)
    # /healthz and /readyz alone, on a port of their own on metrics_host, which scrapes
    # cannot use up (relay/daemon/metrics.py); point the probes at it. None: the
    # metrics port + 1 (9188), or any free port when metrics_port is 0.
    probe_port: int | None = Field(default=None, ge=0, le=65535)
    # Scrapes within this many seconds share one read of the Postgres-derived figures
    # (read in the background; a scrape waits for it 5 s at most, then serves the last).
    metrics_cache_ttl: float = Field(default=5.0, ge=0, le=300)
    # Session limits on every connection the relay daemon opens, in seconds (0: none,
    # or what the role or database sets): a locked table or a stuck query fails and is
    # retried instead of holding a thread (a metrics read, a heartbeat) indefinitely.
    # The CLI's connections (migrate builds indexes) do not get them.
    database_statement_timeout: float = Field(default=60.0, ge=0, le=86_400)
    database_lock_timeout: float = Field(default=10.0, ge=0, le=86_400)
    database_idle_in_transaction_timeout: float = Field(default=60.0, ge=0, le=86_400)
    # Retention: every prune_every seconds (0: never) one relay deletes rows every
    # subscriber has published and that are older than retention seconds.
    prune_every: float = Field(default=3600.0, ge=0)
    retention: float = Field(default=7 * 86_400.0, ge=0)
    # Dead letters not yet redriven are kept (and their rows, which redrive reads) until
    # redriven or pruned by hand; with this (seconds), retention deletes those decided
    # longer ago. Redriven ones go with their rows. None: never (docs/design.md §7).
    dead_letter_retention: float | None = Field(default=None, ge=0)
    # Log the backends that hold the publication horizon back for longer than this.
    horizon_warn_after: float = Field(default=60.0, gt=0)
    # SIGTERM: how long to let batches in flight finish before exiting anyway.
    shutdown_timeout: float = Field(default=30.0, gt=0, le=3600)
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    log_format: Literal["text", "json"] = "text"
    # OpenTelemetry (relay/observability/tracing.py; the `tracing` extra): a span per published batch
    # or per event (tracing_spans), exported over OTLP/HTTP to tracing_endpoint
    # (None: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT, else
    # http://localhost:4318/v1/traces). Traces the writer sampled are always recorded;
    # tracing_sample_ratio samples those of rows without a traceparent.
    tracing: bool = False
    tracing_endpoint: str | None = Field(default=None, pattern=r"^https?://[^\s]+$")
    tracing_service_name: str = Field(default="outbox-relay", min_length=1, max_length=255)
    tracing_sample_ratio: float = Field(default=1.0, ge=0, le=1)
    # "batch": a span per published batch, linking each traced event's writer span (the
    # records carry the batch span's context); "event": a span per event, a child of
    # its writer's (several times the cost: docs/tracing.md, "Cost").
    tracing_spans: Literal["batch", "event"] = "batch"
    # "batch": at most this many events of a batch are traced (linked, and given the
    # batch span's context); the rest keep their writer's traceparent. A link costs
    # about 10 µs: small batches (a caught-up relay) are traced whole.
    tracing_batch_links: int = Field(default=128, ge=1, le=100_000)

    @field_validator("kafka", mode="before")
    @classmethod
    def _kafka_keys(cls, value: Any) -> Any:
        # RELAY_KAFKA__SECURITY_PROTOCOL arrives as "security_protocol": librdkafka
        # property names use dots only, so an undotted key is an environment spelling.
        if isinstance(value, dict):
            return {(k if "." in k else k.replace("_", ".")).lower(): v for k, v in value.items()}
        return value

    @field_validator("database_url")
    @classmethod
    def _libpq_url(cls, value: SecretStr | None) -> SecretStr | None:
        # Fail at start-up naming the key, not at the first connection; libpq quotes
        # the whole string in its error, so the password is masked.
        if value is not None:
            _as_value_error(parse_url, value.get_secret_value())
        return value

    @field_validator("tracing")
    @classmethod
    def _tracing_installed(cls, value: bool) -> bool:
        wanted = ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http")
        if value and not all(_installed(name) for name in wanted):
            raise ValueError(
                "needs the OpenTelemetry SDK and OTLP exporter: pip install 'outbox-relay[tracing]'"
            )
        return value

    @field_validator("topic_allow")
    @classmethod
    def _topic_allow(cls, value: str | None) -> str | None:
        return value if value is None else _as_value_error(_regular_expression, value)

    @model_validator(mode="after")
    def _heartbeat_fits(self) -> Settings:
        if self.heartbeat_interval * 2 > self.session_timeout:
            raise ValueError(
                "heartbeat_interval must be at most half of session_timeout "
                f"(got {self.heartbeat_interval}s and {self.session_timeout}s)"
            )
        return self

    @model_validator(mode="after")
    def _probe_port_apart(self) -> Settings:
        port = self.probe_listen_port
        if port > 65535 or (port and port == self.metrics_port):
            raise ValueError(
                f"probe_port must be a port other than metrics_port (got {port}); "
                "set RELAY_PROBE_PORT"
            )
        return self

    @property
    def probe_listen_port(self) -> int:
        """The probe port: probe_port, or the metrics port + 1 (0 for 0)."""
        if self.probe_port is not None:
            return self.probe_port
        return self.metrics_port + 1 if self.metrics_port else 0

    @field_validator("schema_registry_allow_http_credentials")
    @classmethod
    def _registry_credentials_over_tls(cls, allowed: bool, info: ValidationInfo) -> bool:
        given = info.data
        configured = any(given.get(k) is not None for k in _REGISTRY_CREDENTIALS)
        if allowed or not _plain_http_credentials(given.get("schema_registry_url"), configured):
            return allowed
        raise ValueError(
            "schema_registry_url is plain http://, so the registry's credentials "
            "(schema_registry_user, schema_registry_password or a password in the URL) would "
            "cross the network in clear: use https://, or set this to true if the network "
            "is trusted"
        )

    @field_validator("subscribers")
    @classmethod
    def _unique_names(cls, value: list[SubscriberSettings]) -> list[SubscriberSettings]:
        names = [s.name for s in value]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"subscriber names must be unique, repeated: {duplicates}")
        return value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, env_settings, _TomlFile(settings_cls)

    def __repr_args__(self) -> Any:
        # Kafka secrets (SASL passwords, key passwords, OAuth configs) stay out of reprs
        # and so out of logs and tracebacks, like database_url (a SecretStr).
        for name, value in super().__repr_args__():
            if name == "kafka" and isinstance(value, dict):
                yield name, {k: _mask(k, v) for k, v in value.items()}
            elif name == "schema_registry_url" and isinstance(value, str):
                yield name, mask_url(value)
            else:
                yield name, value

    def kafka_secrets(self) -> list[str]:
        """The values of the Kafka client properties that are secrets."""
        return [str(v) for k, v in self.kafka.items() if _SECRET_KAFKA_KEY.search(k)]

    def registry_secrets(self) -> list[str]:
        """The schema registry's password, which its client's errors may quote."""
        password = self.schema_registry_password
        return [] if password is None else [password.get_secret_value()]

    def require_database_url(self) -> str:
        if self.database_url is None:
            raise ConfigError("database_url: required (flag --database-url or RELAY_DATABASE_URL)")
        return self.database_url.get_secret_value()

    def require_bootstrap_servers(self) -> str:
        if not self.bootstrap_servers:
            raise ConfigError(
                "bootstrap_servers: required (flag --bootstrap-servers or RELAY_BOOTSTRAP_SERVERS)"
            )
        return self.bootstrap_servers


class _TomlFile(PydanticBaseSettingsSource):
    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # unused: __call__ returns the whole document

    def __call__(self) -> dict[str, Any]:
        path = _config_file.get()
        if path is None:
            return {}
        try:
            with path.open("rb") as handle:
                document = tomllib.load(handle)
        except OSError as exc:
            raise ConfigError(f"config file {path}: cannot read it: {exc.strerror}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path}: not valid TOML: {exc}") from exc
        # Accept a [relay] table or top-level keys.
        relay = document.get("relay", document)
        return dict(relay) if isinstance(relay, dict) else {}


# Secrets may come from files (Docker and Kubernetes secrets): RELAY_<KEY>_FILE.
SECRET_FILE_KEYS = ("database_url", "kafka", "schema_registry_password")


def secret_from_environment(key: str) -> str | None:
    """A secret setting as the environment gives it: ``RELAY_<KEY>``, else the contents
    of the file ``RELAY_<KEY>_FILE`` names, else None. Keeps secrets out of argv (``ps``,
    pod specs); the Spark jobs use it for their database URL."""
    variable = f"RELAY_{key.upper()}"
    if variable in os.environ:
        return os.environ[variable]
    return _secret_file(key)


def _secret_file(key: str) -> str | None:
    variable = f"RELAY_{key.upper()}_FILE"
    path = os.environ.get(variable)
    if path is None:
        return None
    # Never quote the file's contents: they are the secret.
    try:
        text = Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ConfigError(f"{key} ({variable}): cannot read {path}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{key} ({variable}): {path} is not UTF-8 text") from exc
    if not text:
        raise ConfigError(f"{key} ({variable}): {path} is empty")
    return text


def _secret_files(flags: dict[str, Any]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for key in SECRET_FILE_KEYS:
        if key in flags or f"RELAY_{key.upper()}" in os.environ:
            continue
        text = _secret_file(key)
        if text is None:
            continue
        if key == "kafka":
            try:
                found[key] = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ConfigError(
                    f"{key} (RELAY_KAFKA_FILE): {os.environ['RELAY_KAFKA_FILE']} is not a JSON object"
                ) from exc
        else:
            found[key] = text
    return found


# The relay's own variables that are no settings: the CLI's config file, the cache and
# the Maven mirror of its fetched artifacts (relay/artifacts/maven.py), and the sink
# `verify --through` checks (relay/cli/verify.py).
_OTHER_VARIABLES = frozenset(
    {"RELAY_CONFIG", "RELAY_CACHE_DIR", "RELAY_MAVEN_REPOSITORY", "RELAY_SINK_URL",
     "RELAY_SINK_URL_FILE"}
)  # fmt: skip


def unknown_variables(environ: Mapping[str, str]) -> list[tuple[str, str | None]]:
    """The ``RELAY_*`` variables of ``environ`` that nothing reads, each with the known
    name nearest to it (None: none is close): a mistyped one is otherwise ignored
    without a word, and the relay runs on a default."""
    known = (
        {f"RELAY_{name.upper()}" for name in Settings.model_fields}
        | {f"RELAY_{key.upper()}_FILE" for key in SECRET_FILE_KEYS}
        | _OTHER_VARIABLES
    )
    unknown = []
    for variable in sorted(environ):
        # RELAY_KAFKA__SECURITY_PROTOCOL: a key of a nested setting.
        if not variable.startswith("RELAY_") or variable.split("__")[0] in known:
            continue
        nearest = difflib.get_close_matches(variable, sorted(known), n=1, cutoff=0.75)
        unknown.append((variable, nearest[0] if nearest else None))
    return unknown


def load_settings(config_file: Path | None = None, **flags: Any) -> Settings:
    """Build settings; a :class:`ConfigError` names every offending key."""
    token = _config_file.set(config_file)
    try:
        given = {k: v for k, v in flags.items() if v is not None}
        settings = Settings(**_secret_files(given), **given)
        # Kafka errors and client logs may quote them: mask them there too.
        remember(settings.kafka_secrets() + settings.registry_secrets())
        return settings
    except ValidationError as exc:
        raise ConfigError(_describe(exc)) from exc
    except SettingsError as exc:  # a RELAY_* variable that should hold JSON does not
        raise ConfigError(redact(f"{exc}: {exc.__cause__}")) from exc
    finally:
        _config_file.reset(token)


def _describe(exc: ValidationError) -> str:
    lines = []
    for error in exc.errors():
        key = ".".join(str(part) for part in error["loc"]) or "settings"
        env = f" (RELAY_{key.upper()})" if "." not in key else ""
        lines.append(f"{key}{env}: {error['msg']}")
    return "invalid settings:\n  " + "\n  ".join(lines)


_REGISTRY_CREDENTIALS = ("schema_registry_user", "schema_registry_password")


def _plain_http_credentials(url: str | None, configured: bool) -> bool:
    """Whether the registry ``url`` (a comma-separated list, as the client takes it)
    would get basic-auth credentials over plain HTTP (``configured``: a user or a
    password is set besides the URL)."""
    urls = [] if url is None else [u.strip() for u in url.split(",")]
    plain = [u for u in urls if u.lower().startswith("http://")]
    return bool(plain) and (configured or any("@" in urlsplit(u).netloc for u in urls))


def _mask(key: str, value: Any) -> Any:
    return "**********" if _SECRET_KAFKA_KEY.search(key) else value


def _as_value_error(check: Callable[[_T], object], value: _T) -> _T:
    """``value`` once ``check`` accepts it; its refusal as the ValueError pydantic
    reports under the key (so the key is not named twice)."""
    try:
        check(value)
    except (SubscriberError, ConfigError) as exc:
        raise ValueError(str(exc).removeprefix("database_url: ")) from exc
    return value


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False


def _regular_expression(value: str) -> None:
    try:
        re.compile(value)
    except re.error as exc:
        raise ConfigError(f"not a regular expression: {exc}") from exc
