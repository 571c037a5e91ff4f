"""`outbox-relay subscribers add` refuses a subscriber that would publish events another
one publishes to the same topic, and says how to fix it (tests/unit/ has the rule)."""

from __future__ import annotations

from typing import Any

import psycopg

from tests.support import run_cli


def test_adding_a_colliding_subscriber_is_refused_with_the_fix(
    db: psycopg.Connection[Any], relay_url: str
) -> None:
    env = {"RELAY_DATABASE_URL": relay_url}
    assert run_cli("subscribers", "add", "default", env=env).returncode == 0
    refused = run_cli(
        "subscribers", "add", "billing", "--aggregate-type", "order", "--from", "now", env=env
    )
    assert refused.returncode == 1
    assert "collides with 'default'" in refused.stderr
    assert "topic of its own" in refused.stderr
    fixed = run_cli(
        "subscribers",
        "add",
        "billing",
        "--aggregate-type",
        "order",
        "--topic",
        "billing.{aggregate_type}",
        "--from",
        "now",
        env=env,
    )
    assert fixed.returncode == 0, fixed.stderr
