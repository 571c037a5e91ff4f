"""What the relay checks and sets up before it publishes: the schema's migrations, the
writer schemas, the declared subscribers, and whether the database moved."""

from __future__ import annotations

import logging
from collections import Counter
from typing import TYPE_CHECKING, Any

import psycopg

from relay.adapters.postgres import migrations
from relay.core.key_space import KeySpaceAction, report
from relay.core.log_fields import log_extra
from relay.core.ports import DaemonStore, PartStore, TopicRecord
from relay.core.schemas import SchemaFolder
from relay.core.settings import Settings
from relay.core.subscribers import (
    DEFAULT_SUBSCRIBER,
    StartFrom,
    Subscriber,
    TopicGuard,
    ValueFormat,
)
from relay.errors import (
    BrokerUnavailable,
    ConfigError,
    NotMigratedError,
    SchemaIncompatible,
    SchemaRegistryUnavailable,
)

if TYPE_CHECKING:
    from relay.adapters.registry.registry_format import RegistryValueEncoder

logger = logging.getLogger(__name__)


def check_schema(conn: psycopg.Connection[Any], schema: str) -> None:
    """Refuse a schema without the migrations the relay needs; warn about newer ones."""
    pending = migrations.pending(conn, schema)
    names = [f"{m.version:04d}_{m.name}" for m in pending]
    if any(m.version <= migrations.RELAY_NEEDS for m in pending):
        raise NotMigratedError(
            f"schema {schema!r} lacks migrations {names}; run `outbox-relay migrate`"
        )
    if pending:
        # A rolling deploy: the relay runs on the older schema; the migration brings
        # per-key database order and an untaxed write path.
        logger.warning(
            "schema %r lacks migrations %s; the relay runs on it, but apply them "
            "(`outbox-relay migrate`)",
            schema,
            names,
            extra=log_extra("schema_migrations_pending", schema=schema, missing=names),
        )


def adopt_topics(
    settings: Settings, guard: TopicGuard, record: TopicRecord, subscribers: list[Subscriber]
) -> None:
    """On an outbox that published before migration 0017, record as its own the existing
    topics its subscribers' templates let rows reach: its relays created them (or
    published there) before the record existed, and its rows must keep reaching them.
    Once, by whichever relay starts first; a new outbox adopts nothing (issue #47).
    Trust on first use: a topic of another outbox that a template already reached is
    adopted too, so the log names every one adopted, for the operator to review."""
    if not record.adoption_pending():
        return
    from relay.adapters.kafka.topics import admin_client, list_topics

    guard.update(subscribers)
    client = {**settings.kafka, "bootstrap.servers": settings.require_bootstrap_servers()}
    found = sorted(t.name for t in list_topics(admin_client(client)) if guard.row_chosen(t.name))
    if record.adopt(found) and found:
        shown = ", ".join(found[:_ADOPTED_SHOWN]) + (" ..." if len(found) > _ADOPTED_SHOWN else "")
        logger.warning(
            "adopted %d existing topics the subscribers' templates reach, created before "
            "the outbox recorded its topics (migration 0017): %s. Review them (SELECT topic "
            "FROM outbox_topics WHERE origin = 'adopted'); DELETE the row of any that is "
            "not this outbox's, and rows will no longer publish there",
            len(found),
            shown,
            extra=log_extra("topics_adopted", count=len(found), topics=found[:_ADOPTED_SHOWN]),
        )


_ADOPTED_SHOWN = 50


class KeySpaceChecks:
    """Checks whether the database moved to another xid space (docs/design.md §6), and
    counts what was done about each move found."""

    def __init__(self) -> None:
        self.changes: Counter[str] = Counter(rebased=0, continued=0)

    def check(self, store: PartStore, where: str) -> None:
        found = store.check_key_space()
        if found is not None and found.action is not KeySpaceAction.UNCHANGED:
            report(found, where)
            self.changes[found.action.value] += 1


def load_schemas(settings: Settings) -> SchemaFolder | None:
    """The configured writer schemas; a configured folder that is missing is an error
    now, not a halt at the first event."""
    folder = settings.schemas_dir
    if folder is None:
        return None
    if not folder.is_dir():
        raise ConfigError(
            f"schemas_dir: {str(folder)!r} is not a folder (from the config file, "
            "RELAY_SCHEMAS_DIR or --schemas-dir); point it at your .avsc files, or unset it "
            "to publish JSON"
        )
    return SchemaFolder.from_dir(folder)


class SubscriberSync:
    """Writes the subscribers the config declares into the store."""

    def __init__(
        self,
        settings: Settings,
        schemas: SchemaFolder | None,
        schema_registry: RegistryValueEncoder | None = None,
    ) -> None:
        self._settings = settings
        self._schemas = schemas
        self._schema_registry = schema_registry

    @property
    def default_format(self) -> ValueFormat:
        """Subscribers that name no format: Avro only when there are writer schemas."""
        return ValueFormat.AVRO if self._schemas is not None else ValueFormat.JSON

    def sync(self, store: DaemonStore) -> None:
        """Upsert the subscribers the config declares; with none anywhere, add the default."""
        for declared in self._settings.subscribers:
            subscriber = declared.to_subscriber(self.default_format)
            created = store.add(subscriber, declared.start_from, replace=True)
            logger.info(
                "%s subscriber %s from config",
                "created" if created else "updated",
                declared.name,
                extra=log_extra("subscriber_from_config", subscriber=declared.name, new=created),
            )
        if not store.list():
            default = Subscriber(DEFAULT_SUBSCRIBER, value_format=self.default_format)
            store.add(default, StartFrom.BEGINNING)
            logger.info(
                "no subscriber configured: created %r routing every event as %s",
                DEFAULT_SUBSCRIBER,
                default.value_format,
                extra=log_extra("subscriber_default_created", subscriber=DEFAULT_SUBSCRIBER),
            )
        self._refuse_avro_without_schemas(store)
        self._refuse_registry_without_settings(store)
        self._refuse_incompatible_schemas(store)
        self._refuse_partitions_out_of_range(store)

    def _refuse_partitions_out_of_range(self, store: DaemonStore) -> None:
        """Refuse to start when an active subscriber's partition field ranges over more
        partitions than its topics have (as `subscribers add` refuses it): every row
        naming one beyond would be poison. A broker that cannot answer is no reason not
        to start: each record's partition is checked when it is published."""
        from relay.adapters.kafka.topics import partition_room_refusal

        active = [s.subscriber for s in store.list() if not s.subscriber.paused]
        try:
            refusal = partition_room_refusal(self._settings, active)
        except BrokerUnavailable as exc:
            logger.warning(
                "the partitions of the subscribers' topics not checked: %s",
                exc,
                extra=log_extra("partitions_check_skipped", error=exc),
            )
            return
        if refusal is not None:
            name, problem = refusal
            raise ConfigError(
                f"subscriber {name!r}: {problem}\nor pause the subscriber to start without "
                f"it: outbox-relay subscribers pause {name}"
            )

    def _refuse_incompatible_schemas(self, store: DaemonStore) -> None:
        """Refuse to start when the registry's compatibility rules refuse an active
        avro-registry subscriber's schemas (docs/design.md, "Schema registry"): in a
        rolling deploy the relays still running keep publishing with the schemas the
        registry accepts, where a halt would be recorded in Postgres and stop them too.
        A registry that cannot answer is no reason not to start: the parts retry."""
        if self._schema_registry is None or self._schemas is None:
            return
        from relay.adapters.registry.registry_compat import check_subscriber

        for status in store.list():
            subscriber = status.subscriber
            if subscriber.value_format is not ValueFormat.AVRO_REGISTRY or subscriber.paused:
                continue
            try:
                report = check_subscriber(self._schema_registry.client, self._schemas, subscriber)
            except SchemaRegistryUnavailable as exc:
                # Not once per subscriber: each would wait for the client's timeouts.
                logger.warning(
                    "schemas not checked against the registry (from subscriber %s on): %s",
                    subscriber.name,
                    exc,
                    extra=log_extra("registry_check_skipped", subscriber=subscriber.name),
                )
                return
            except SchemaIncompatible as exc:
                raise SchemaIncompatible(
                    f"{exc}\nfix the schemas or the subject's compatibility rule, or pause "
                    f"the subscriber to start without it: outbox-relay subscribers pause "
                    f"{subscriber.name}"
                ) from exc
            logger.info(
                "subscriber %s: schemas checked against the registry: %s",
                subscriber.name,
                "; ".join(report.checked) or "nothing known before a row names the topic",
                extra=log_extra("registry_checked", subscriber=subscriber.name),
            )

    def _refuse_registry_without_settings(self, store: DaemonStore) -> None:
        missing = self._settings.registry_format_missing(has_schemas=self._schemas is not None)
        if missing is None:
            return
        names = [
            s.subscriber.name
            for s in store.list()
            if s.subscriber.value_format is ValueFormat.AVRO_REGISTRY and not s.subscriber.paused
        ]
        if names:
            raise ConfigError(
                f"subscribers {names} publish avro-registry, which needs {missing}; "
                "configure them, or switch the subscribers to another format: "
                "outbox-relay subscribers add NAME --format json --replace"
            )

    def _refuse_avro_without_schemas(self, store: DaemonStore) -> None:
        if self._schemas is not None:
            return
        avro = [
            s.subscriber.name
            for s in store.list()
            if s.subscriber.value_format is ValueFormat.AVRO and not s.subscriber.paused
        ]
        if avro:
            raise ConfigError(
                f"subscribers {avro} publish Avro, but no schemas folder is configured "
                "(schemas_dir, RELAY_SCHEMAS_DIR or --schemas-dir); configure it, or switch "
                "them to JSON: outbox-relay subscribers add NAME --format json --replace"
            )


def registry_encoder(
    settings: Settings, schemas: SchemaFolder | None
) -> RegistryValueEncoder | None:
    """The avro-registry encoder, when configured (only then is its client imported)."""
    if settings.schema_registry_url is None:
        return None
    from relay.adapters.registry.registry_format import encoder_for

    return encoder_for(settings, schemas)
