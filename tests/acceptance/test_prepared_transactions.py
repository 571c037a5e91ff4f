"""A forgotten prepared transaction holds publication back like an open session, but no
session shows it: `status` and the relay's warning name it (gid, age, owner)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import psycopg
import pytest

from relay import Outbox
from relay.adapters.postgres import migrations
from relay.adapters.postgres.store import OutboxStore
from relay.core.settings import load_settings
from relay.daemon.upkeep import HorizonWatch
from relay.localstack import LocalPostgres
from tests.plugins.postgres import _new_local_postgres, _started
from tests.support import run_cli, write_orders


@pytest.fixture
def prepared_postgres(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalPostgres]:
    """A server of the test's own that allows prepared transactions (the shared one has
    max_prepared_transactions = 0, PostgreSQL's default)."""
    server = _new_local_postgres(
        tmp_path_factory, fsync=False, settings={"max_prepared_transactions": "4"}
    )
    yield from _started(*server)


def test_status_and_the_stall_warning_name_a_prepared_transaction(
    prepared_postgres: LocalPostgres, outbox: Outbox, caplog: pytest.LogCaptureFixture
) -> None:
    with psycopg.connect(prepared_postgres.url, autocommit=True) as admin:
        admin.execute("CREATE DATABASE outbox")
    url = prepared_postgres.url_for("outbox")
    with psycopg.connect(url, autocommit=True) as db:
        migrations.migrate(db)
        with psycopg.connect(url) as app:
            write_orders(app, outbox, ["o-1"])
            app.execute("PREPARE TRANSACTION 'forgotten-1'")
        try:
            [holder] = OutboxStore(db).horizon_holders()
            assert (holder.gid, holder.owner, holder.state, holder.pid) == (
                "forgotten-1", "postgres", "prepared", None,
            )  # fmt: skip
            assert holder.age_s is not None and holder.age_s >= 0

            settings = load_settings(database_url=url, horizon_warn_after=1e-6)
            with caplog.at_level(logging.WARNING):
                HorizonWatch(settings).check(OutboxStore(db))
            [warning] = [r.getMessage() for r in caplog.records if "held back" in r.getMessage()]
            assert "prepared transaction 'forgotten-1' (owner postgres" in warning

            env = {"RELAY_DATABASE_URL": url, "COLUMNS": "300"}
            status = run_cli("status", env=env)
            assert status.returncode == 0, status.stderr
            assert "gid 'forgotten-1', owner postgres" in status.stdout
            as_json = json.loads(run_cli("status", "--json", env=env).stdout)
            [named] = as_json["horizon_holders"]
            assert (named["gid"], named["owner"], named["database"]) == (
                "forgotten-1", "postgres", "outbox",
            )  # fmt: skip
        finally:
            db.execute("ROLLBACK PREPARED 'forgotten-1'")
