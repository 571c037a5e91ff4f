"""Issue #48, items 5 and 6: faults that heal by themselves are waited for, never poison
and never a halt. A topic the rows route to that does not exist yet (create_topics =
false) and a grant revoked from the relay's role used to halt the part under the default
`halt` until someone ran `subscribers resume`, even once the topic was made or the grant
restored; /readyz stayed at 200 for the revoked grant. Now the part waits, and says so in
`status`, /readyz and `outbox_relay_part_waiting`; the fix deploy/README.md gives, run as
written, is all it takes: every event then arrives once, in order, with no `resume`."""

from __future__ import annotations

import json
import re
import shlex
from contextlib import suppress
from typing import Any

import psycopg
from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]
from psycopg import sql

from relay.core.model import ConsumedRecord, PartId
from relay.daemon import Relay
from tests.support import (
    RELAY_ROLE,
    REPO,
    consume,
    http_get,
    part_status,
    run_cli,
    sub,
    wait_until,
)

PART = PartId("s", 0)


def fix(what: str) -> list[str]:
    """The command deploy/README.md's "Waiting, not halting" recipe gives for ``what``
    ("a topic", "a privilege"), as written: its capitals are what the part's wait names."""
    text = (REPO / "deploy" / "README.md").read_text()
    block = text.split("**Waiting, not halting.**", 1)[1].split("```sh\n", 1)[1]
    lines = block.split("```", 1)[0].splitlines()
    [line] = [line for line in lines if line.split("#", 1)[-1].strip().startswith(what)]
    return shlex.split(line, comments=True)[1:]


def insert(conn: psycopg.Connection[Any], aggregate_type: str, n: int) -> None:
    """One event of one aggregate (``a``: one key, so one partition holds its order), in
    its own transaction, as an application may write it in plain SQL."""
    conn.execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)"
        " VALUES (%s, 'a', 'Noted', %s)",
        (aggregate_type, json.dumps({"n": n})),
    )


def numbers(records: list[ConsumedRecord]) -> list[int]:
    return [json.loads(r.value or b"")["n"] for r in records]


def pre_create(bootstrap: str, *topics: str) -> None:
    """What deploy/README.md says to create with create_topics = false: the topics the
    operator knows of, and the checkpoint topic (the session's broker may have it)."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    wanted = [NewTopic("outbox-relay.checkpoints", 2, 1, config={"cleanup.policy": "compact"})]
    wanted += [NewTopic(topic, 1, 1) for topic in topics]
    for future in admin.create_topics(wanted).values():
        with suppress(KafkaException):  # the checkpoint topic exists already
            future.result(30)


def readyz(relay: Relay) -> tuple[int, str]:
    assert relay.http is not None
    return http_get(f"http://127.0.0.1:{relay.http.port}/readyz")


def waiting_metric(relay: Relay, service: str) -> bool:
    assert relay.http is not None
    _, body = http_get(f"http://127.0.0.1:{relay.http.port}/metrics")
    line = f'outbox_relay_part_waiting{{part="0",service="{service}",subscriber="s"}} 1.0'
    return line in body.splitlines()


def halts(db: psycopg.Connection[Any]) -> list[tuple[Any, ...]]:
    return db.execute(
        "SELECT halted_error FROM outbox_checkpoints WHERE subscriber = 's'"
    ).fetchall()


def test_a_missing_topic_waits_without_halting_and_publishes_once_the_operator_creates_it(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    relay_url: str,
    kafka_bootstrap: str,
    topic_prefix: str,
    start_relay: Any,
) -> None:
    existing, missing = topic_prefix + "outbox.event.order", topic_prefix + "outbox.event.invoice"
    pre_create(kafka_bootstrap, existing)
    for n, aggregate_type in enumerate(("order", "invoice", "order", "invoice"), 1):
        insert(writer_db, aggregate_type, n)
    relay = start_relay(
        create_topics=False,
        # The operator's topics are named, as deploy/README.md says (issue #47).
        topic_allow=re.escape(topic_prefix) + ".*",
        subscribers=[sub("s", topic_prefix, value_format="json")],  # on_poison: halt
    )
    wait_until(lambda: relay.part_waits().get(PART) == "topic", what="the part to wait")
    status, body = readyz(relay)
    # Every replica waits alike: ready, the reply names the part and the topic.
    assert status == 200 and "waiting for topic: s/0" in body and repr(missing) in body, body
    assert waiting_metric(relay, "topic")
    wait_until(lambda: part_status(relay_url, PART)["waiting_on"] == "topic", what="status to say")
    part = part_status(relay_url, PART)  # as the relay role, as deploy/README.md runs it
    assert part["halted"] is None and repr(missing) in part["waiting_error"]
    assert "create_topics is false" in part["waiting_error"]
    table = run_cli("status", env={"RELAY_DATABASE_URL": relay_url})
    assert "WAITING" in table.stdout and "waiting since" in table.stdout, table.stdout
    # The fix the wait names is deploy/README.md's recipe, with the topic it names.
    named = re.search(r"`outbox-relay (topics create [^`]+)`", part["waiting_error"])
    assert named is not None and named[1].split() == [
        missing if word == "TOPIC" else word for word in fix("a topic")
    ]
    created = run_cli(*named[1].split(), env={"RELAY_BOOTSTRAP_SERVERS": kafka_bootstrap})
    assert created.returncode == 0, created.stderr
    # Every event once, in order, and nothing resumed: the part went on by itself.
    assert numbers(consume(kafka_bootstrap, [existing], 2, quiet=2.0)) == [1, 3]
    assert numbers(consume(kafka_bootstrap, [missing], 2, quiet=2.0)) == [2, 4]
    assert halts(db) == [(None,)]
    wait_until(lambda: part_status(relay_url, PART)["waiting_on"] is None, what="the wait cleared")
    assert relay.part_waits() == {} and readyz(relay)[0] == 200


def test_under_dead_letter_a_row_for_a_missing_topic_is_dead_lettered_and_redriven_later(
    writer_db: psycopg.Connection[Any],
    relay_url: str,
    kafka_bootstrap: str,
    topic_prefix: str,
    start_relay: Any,
) -> None:
    """'dead-letter' keeps its promise that one row cannot hold back the rest: the row
    goes to the dead-letter topic, its error naming the topic and how to create it, and
    `dead-letters redrive` publishes it once the topic exists."""
    existing, missing = topic_prefix + "outbox.event.order", topic_prefix + "outbox.event.invoice"
    dead = topic_prefix + "dead"
    pre_create(kafka_bootstrap, existing, dead)
    for n, aggregate_type in enumerate(("order", "invoice", "order"), 1):
        insert(writer_db, aggregate_type, n)
    allow = re.escape(topic_prefix) + ".*"
    start_relay(
        create_topics=False,
        topic_allow=allow,
        subscribers=[sub("s", topic_prefix, value_format="json", on_poison="dead-letter",
                         dead_letter_topic=dead)],
    )  # fmt: skip
    assert numbers(consume(kafka_bootstrap, [existing], 2)) == [1, 3]
    [letter] = consume(kafka_bootstrap, [dead], 1)
    error = letter.header_text("outbox.error") or ""
    assert "does not exist and create_topics is false" in error
    assert f"`outbox-relay topics create {missing} --if-not-exists`" in error
    env = {
        "RELAY_DATABASE_URL": relay_url,
        "RELAY_BOOTSTRAP_SERVERS": kafka_bootstrap,
        "RELAY_CREATE_TOPICS": "false",
        "RELAY_TOPIC_ALLOW": allow,
    }
    created = run_cli(*[missing if w == "TOPIC" else w for w in fix("a topic")], env=env)
    assert created.returncode == 0, created.stderr
    redriven = run_cli("dead-letters", "redrive", "s", "--yes", env=env, timeout=300)
    assert redriven.returncode == 0, redriven.stdout + redriven.stderr
    assert numbers(consume(kafka_bootstrap, [missing], 1, quiet=2.0)) == [2]


def test_a_revoked_grant_makes_the_part_wait_unready_and_the_documented_grant_heals_it(
    db: psycopg.Connection[Any],
    database_url: str,
    writer_db: psycopg.Connection[Any],
    relay_url: str,
    kafka_bootstrap: str,
    topic_prefix: str,
    start_relay: Any,
) -> None:
    topic = topic_prefix + "outbox.event.order"
    relay = start_relay(subscribers=[sub("s", topic_prefix, value_format="json")])
    insert(writer_db, "order", 1)
    assert numbers(consume(kafka_bootstrap, [topic], 1)) == [1]
    assert readyz(relay)[0] == 200
    revoke = sql.SQL("REVOKE SELECT ON outbox FROM {}").format(sql.Identifier(RELAY_ROLE))
    db.execute(revoke)  # while the relay runs
    insert(writer_db, "order", 2)
    insert(writer_db, "order", 3)
    wait_until(lambda: relay.part_waits().get(PART) == "postgres_privilege", what="a wait")
    status, body = readyz(relay)
    assert status == 503, body
    assert (
        "permission denied for table outbox" in body and "outbox-relay grant --relay-role" in body
    )
    assert waiting_metric(relay, "postgres_privilege")
    # The relay role cannot read the outbox now: its own `status` ends, naming the grant.
    mine = run_cli("status", env={"RELAY_DATABASE_URL": relay_url})
    assert mine.returncode == 1 and "permission denied for table outbox" in mine.stderr
    assert "outbox-relay grant --relay-role" in mine.stderr
    # The owner's shows the part waiting, and why.
    wait_until(lambda: part_status(database_url, PART)["waiting_on"] == "postgres_privilege",
               what="status to say")  # fmt: skip
    part = part_status(database_url, PART)
    assert part["halted"] is None and "permission denied for table outbox" in part["waiting_error"]
    # deploy/README.md's fix, as the owner, ROLE being the relay's role.
    granted = run_cli(
        *[RELAY_ROLE if w == "ROLE" else w for w in fix("a privilege")],
        env={"RELAY_DATABASE_URL": database_url},
    )
    assert granted.returncode == 0, granted.stderr
    assert numbers(consume(kafka_bootstrap, [topic], 3, quiet=2.0)) == [1, 2, 3]
    assert halts(db) == [(None,)]
    wait_until(lambda: readyz(relay)[0] == 200, what="ready again")
    wait_until(lambda: part_status(relay_url, PART)["waiting_on"] is None, what="the wait cleared")
