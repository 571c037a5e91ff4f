"""The jobs' database URL: a flag, or (better: argv shows in ``ps`` and in pod specs) the
environment, with the relay's convention for secrets."""

from __future__ import annotations

import argparse

from relay.core.settings import load_settings, secret_from_environment
from relay.errors import ConfigError

DATABASE_URL_HELP = (
    "libpq URL of the database written to; default: $RELAY_DATABASE_URL, or the contents "
    "of the file $RELAY_DATABASE_URL_FILE names (a mounted secret): keeps the password "
    "out of argv"
)


def resolve_database_url(parser: argparse.ArgumentParser, given: str | None) -> str:
    """``--database-url`` if given, else the environment's; exits with a usage error
    (code 2) naming all three ways when there is none, or saying why libpq cannot take
    it (its password masked), before Spark starts."""
    try:
        url = given or secret_from_environment("database_url")
    except ConfigError as exc:
        parser.error(str(exc))
    if not url:
        parser.error(
            "a database URL is required: --database-url, RELAY_DATABASE_URL or RELAY_DATABASE_URL_FILE"
        )
    try:
        load_settings(database_url=url)  # libpq's parser, as the relay checks its own
    except ConfigError as exc:
        why = str(exc).partition("Value error, ")[2].strip() or str(exc)
        parser.error(f"the database URL cannot be used: {why}")
    return url
