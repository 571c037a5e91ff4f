"""The test layers and the fixtures every layer may use (tests/README.md).

Each test gets the marker of its layer from the folder it lives in: ``unit`` (no
servers), ``integration`` (one adapter against a real server) or ``acceptance`` (the
product as users run it). The fixtures live in ``tests/plugins/``, one module per
server or concern; none starts a server unless a test asks for it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

# The contracts' test methods run from tests/unit and tests/integration: their asserts
# deserve pytest's failure messages too.
pytest.register_assert_rewrite("tests.contracts")

pytest_plugins = [
    "tests.plugins.postgres",
    "tests.plugins.kafka",
    "tests.plugins.relay",
    "tests.plugins.spark",
    "tests.plugins.registry",
    "tests.plugins.promtool",
    "tests.plugins.helm",
]

LAYERS = ("unit", "integration", "acceptance")
TESTS = Path(__file__).resolve().parent
# The plugins' fixtures that start or need a server: no unit test may ask for one.
SERVER_FIXTURES = frozenset(
    {"pg_server", "database_url", "db", "local_postgres", "logical_postgres", "new_cluster"}
    | {"roles", "relay_url", "writer_url", "stranger_url", "writer_db", "relay_db"}
    | {"relay_reads_all_stats", "kafka_cluster"}
    | {"kafka", "kafka_bootstrap", "local_kafka", "start_relay", "spark", "schema_registry"}
    | {"standin_registry", "spark_standalone"}
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark each test with its layer, the first folder under tests/ it lives in."""
    for item in items:
        path = item.path.resolve()
        if not path.is_relative_to(TESTS):
            continue
        layer = path.relative_to(TESTS).parts[0]
        if layer not in LAYERS:
            # A test outside the layers would silently escape `-m unit` and its kin.
            raise pytest.UsageError(f"{item.nodeid}: move it into tests/{'|'.join(LAYERS)}/")
        servers = SERVER_FIXTURES.intersection(getattr(item, "fixturenames", ()))
        if layer == "unit" and servers:
            raise pytest.UsageError(f"{item.nodeid}: a unit test uses {sorted(servers)}")
        item.add_marker(layer)
