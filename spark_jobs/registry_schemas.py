"""Writer schemas of the ``avro-registry`` value format, from the schema registry.

A job reaches the registry with the relay's own settings (``schema_registry_url``,
``_user``, ``_password``, ``_ca``: ``RELAY_SCHEMA_REGISTRY_*`` or the relay's config
file), through the Confluent client the relay uses (:mod:`relay.adapters.registry.registry_format`).

Two uses. The driver asks, once at start, for the latest schema of each subject of the
job's topics (TopicNameStrategy: ``<topic>-value``): Spark's ``from_avro`` decodes those
(:mod:`spark_jobs.decoding`). A Python worker asks for any other id it meets (a topic
with several schemas, a newer version registered while the job runs), once per id and
worker: ids are immutable in a registry, so an answer is kept for the worker's life.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from relay.core.redact import mask_url, redact
from relay.core.settings import load_settings
from relay.errors import SchemaError, SchemaRegistryUnavailable

__all__ = ["RegistryAccess", "RegistrySchema", "planned_schemas"]


@dataclass(frozen=True)
class RegistrySchema:
    """One registered schema: its id and its Avro text."""

    schema_id: int
    text: str


@dataclass(frozen=True)
class RegistryAccess:
    """Where the registry is and how to log in: plain data, so a Spark task can carry it
    to the Python workers. The password never shows in a repr."""

    url: str
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    ca_location: str | None = None

    @classmethod
    def from_relay_settings(cls, config_file: Path | None = None) -> RegistryAccess | None:
        """The relay's registry settings; None when it names no registry."""
        settings = load_settings(config_file)
        if settings.schema_registry_url is None:
            return None
        password = settings.schema_registry_password
        return cls(
            settings.schema_registry_url,
            settings.schema_registry_user,
            None if password is None else password.get_secret_value(),
            None if settings.schema_registry_ca is None else str(settings.schema_registry_ca),
        )

    def described(self) -> str:
        """For logs: the URL with any credentials in it masked, and the user."""
        user = f" as {self.user}" if self.user else ""
        return f"{mask_url(self.url)}{user}"

    def client(self) -> Any:
        from relay.adapters.registry.registry_format import registry_client

        return registry_client(
            self.url, user=self.user, password=self.password, ca_location=self.ca_location
        )

    def schema_by_id(self, schema_id: int) -> str:
        """The Avro text of registry id ``schema_id`` (cached per process)."""
        return _schema_text(self, schema_id)

    def latest_for_topics(self, topics: str, *, pattern: bool = False) -> list[RegistrySchema]:
        """The latest value schema of each topic's subject (``<topic>-value``): the
        topics a comma-separated list, or with ``pattern`` a regular expression that
        subjects' topics must match. Topics without a subject are left out."""
        client = self.client()
        try:
            subjects = list(client.get_subjects())
            if pattern:
                wanted = re.compile(topics)
                topic_names = [s.removesuffix("-value") for s in subjects if s.endswith("-value")]
                names = [t for t in topic_names if wanted.fullmatch(t)]
            else:
                names = [t.strip() for t in topics.split(",") if f"{t.strip()}-value" in subjects]
            found = [client.get_latest_version(f"{t}-value") for t in names]
        except Exception as exc:  # the client raises its own and its transport's errors
            raise SchemaRegistryUnavailable(
                redact(f"schema registry {self.described()}: {type(exc).__name__}: {exc}")
            ) from exc
        unique = {int(v.schema_id): v.schema.schema_str for v in found}
        return [RegistrySchema(i, text) for i, text in sorted(unique.items())]


def planned_schemas(
    registry: RegistryAccess | None, value_format: str, topics: str, *, pattern: bool = False
) -> list[RegistrySchema]:
    """The registry schemas a job's query decodes with ``from_avro``: the latest of each
    of its topics' subjects, when it reads the registry format (or tells formats apart)."""
    if registry is None or value_format not in ("auto", "avro-registry"):
        return []
    return registry.latest_for_topics(topics, pattern=pattern)


@cache
def _schema_text(access: RegistryAccess, schema_id: int) -> str:
    try:
        return str(access.client().get_schema(schema_id).schema_str)
    except Exception as exc:
        status = getattr(exc, "http_status_code", None)
        if status == 404:
            raise SchemaError(
                f"schema id {schema_id} is not in the registry {access.described()}"
            ) from exc
        raise SchemaRegistryUnavailable(
            redact(f"schema registry {access.described()}: {type(exc).__name__}: {exc}")
        ) from exc
