"""The relay on a broker that authorizes: a SCRAM principal with the ACLs deploy/README.md
lists, and no more. Every other test's broker lets anyone do anything, which is how the
second transactional id of a part (``.2``) shipped without a test of what a deployment
whose ACLs name each part's id literally then sees."""

from __future__ import annotations

import contextlib
import logging
import re
import shlex
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import psycopg
import pytest
from confluent_kafka import KafkaException
from confluent_kafka.admin import (
    AclBinding,
    AclBindingFilter,
    AclOperation,
    AclPermissionType,
    AdminClient,
    NewTopic,
    ResourcePatternType,
    ResourceType,
)

from relay import Outbox
from relay.daemon import Relay
from relay.localstack.kafka import LocalKafka
from tests.support import consume, http_get, keys, part_status, wait_until, write_orders

REPO = Path(__file__).resolve().parents[2]
USER, PASSWORD = "outbox-relay", f"scram-{uuid.uuid4().hex}"
PRINCIPAL = f"User:{USER}"
RESOURCES = {
    "--topic": ResourceType.TOPIC,
    "--group": ResourceType.GROUP,
    "--transactional-id": ResourceType.TRANSACTIONAL_ID,
}


@pytest.fixture(scope="module")
def authorizing_kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalKafka]:
    """A broker whose SASL listener authorizes by ACL; its plain listener is the admin's
    (a super user) and the tests' consumers'."""
    broker = LocalKafka(
        tmp_path_factory.mktemp("acl-kafka"),
        scram_users={USER: PASSWORD},
        config={
            "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
            "super.users": "User:ANONYMOUS",
        },
    )
    with broker:
        yield broker


def readme_acls() -> list[AclBinding]:
    """The ``kafka-acls.sh --add`` commands of deploy/README.md's ACL block, as bindings."""
    text = (REPO / "deploy" / "README.md").read_text()
    block = text.split("**ACLs** for the relay's principal", 1)[1].split("```sh", 1)[1]
    block = block.split("```", 1)[0].replace("\\\n", " ")
    commands = [shlex.split(line) for line in block.splitlines() if line.startswith("kafka-acls")]
    assert len(commands) >= 6, block
    return [binding for command in commands for binding in _bindings(command)]


def _bindings(argv: list[str]) -> list[AclBinding]:
    options = list(zip(argv[1:], [*argv[2:], ""], strict=True))
    operations = [_operation(value) for flag, value in options if flag == "--operation"]
    if "--cluster" in argv:
        resource, name, pattern = ResourceType.BROKER, "kafka-cluster", ResourcePatternType.LITERAL
    else:
        ((flag, name),) = [(f, v) for f, v in options if f in RESOURCES]
        resource = RESOURCES[flag]
        prefixed = ("--resource-pattern-type", "prefixed") in options
        pattern = ResourcePatternType.PREFIXED if prefixed else ResourcePatternType.LITERAL
    assert "$P" in argv and operations, argv
    return [
        AclBinding(resource, name, pattern, PRINCIPAL, "*", op, AclPermissionType.ALLOW)
        for op in operations
    ]


def _operation(name: str) -> AclOperation:
    """``IdempotentWrite`` (kafka-acls.sh) is ``AclOperation.IDEMPOTENT_WRITE``."""
    return AclOperation[re.sub(r"(?<!^)(?=[A-Z])", "_", name).upper()]


def grant(broker: LocalKafka, bindings: list[AclBinding]) -> None:
    """Grant ``bindings``, and return once the broker shows them (a relay asking at once
    was refused a topic's creation on a loaded host)."""
    admin = AdminClient({"bootstrap.servers": broker.bootstrap_servers})
    for created in admin.create_acls(bindings).values():
        created.result(30)
    wait_until(lambda: set(bindings) <= set(admin.describe_acls(_every_acl()).result(30)),
               what="the ACLs granted")  # fmt: skip


class Deployment(NamedTuple):
    """What a test of this module works with: the broker, a way to start a relay as the
    SASL principal (it returns the topic of orders), the app writing orders, and the
    relays started."""

    broker: LocalKafka
    start_relay: Callable[..., str]  # settings as keywords
    write: Callable[[str], None]
    relays: list[Relay]


@pytest.fixture
def deployment(
    authorizing_kafka: LocalKafka,
    start_relay: Callable[..., Relay],
    writer_db: psycopg.Connection[Any],
    outbox: Outbox,
) -> Iterator[Deployment]:
    """At teardown every ACL is deleted (and the relays stop): each test grants its own."""
    relays: list[Relay] = []

    def start_one(suffix: str = "", **settings: Any) -> str:
        """A relay as the SASL principal, its subscriber's topic one the README's ACLs
        cover (the default template's, made this test's own); returns the orders' topic."""
        suffix = suffix or uuid.uuid4().hex[:6]
        relay = start_relay(
            bootstrap_servers=authorizing_kafka.sasl_bootstrap_servers,
            kafka={
                "security.protocol": "SASL_PLAINTEXT",
                "sasl.mechanism": "SCRAM-SHA-256",
                "sasl.username": USER,
                "sasl.password": PASSWORD,
            },
            subscribers=[
                {"name": f"acl{suffix}", "topic": f"outbox.event.{{aggregate_type}}-{suffix}"}
            ],
            # A refused group shows only once reading its offsets times out: sooner.
            delivery_timeout=10.0,
            **settings,
        )
        relays.append(relay)
        return f"outbox.event.order-{suffix}"

    def write(order_id: str) -> None:  # one app transaction
        write_orders(writer_db, outbox, [order_id])

    yield Deployment(authorizing_kafka, start_one, write, relays)
    admin = AdminClient({"bootstrap.servers": authorizing_kafka.bootstrap_servers})
    for deleted in admin.delete_acls([_every_acl()]).values():
        deleted.result(30)


def _every_acl() -> AclBindingFilter:
    return AclBindingFilter(
        ResourceType.ANY, None, ResourcePatternType.ANY, None, None,
        AclOperation.ANY, AclPermissionType.ANY,
    )  # fmt: skip


def test_the_readme_acls_let_the_relay_publish_exactly_once(
    deployment: Deployment, caplog: pytest.LogCaptureFixture
) -> None:
    """deploy/README.md's ACLs, as written, are all a transactional relay needs: its part's
    two producers (a prefixed ACL covers both ids), topics, the checkpoint group."""
    grant(deployment.broker, readme_acls())
    caplog.set_level(logging.INFO)
    topic = deployment.start_relay()
    ids = [f"o-{n}" for n in range(6)]
    for i in ids:  # one transaction each: the part's producers take turns
        deployment.write(i)
    seen = consume(deployment.broker.bootstrap_servers, [topic], len(ids), quiet=2.0)
    assert keys(seen) == sorted(ids)
    assert not [r for r in caplog.records if "authoriz" in r.getMessage().lower()]


def test_idempotent_mode_needs_none_of_the_transactional_acls(
    deployment: Deployment, caplog: pytest.LogCaptureFixture
) -> None:
    """The README's grants without its transactional ones (ids, groups, the checkpoint
    topic) are enough for ``delivery = "idempotent"``."""
    transactional = {ResourceType.TRANSACTIONAL_ID, ResourceType.GROUP}
    grant(deployment.broker, [
        b for b in readme_acls()
        if b.restype not in transactional and b.name != "outbox-relay.checkpoints"
    ])  # fmt: skip
    caplog.set_level(logging.INFO)
    topic = deployment.start_relay(delivery="idempotent")
    for i in ("o-1", "o-2"):
        deployment.write(i)
    seen = consume(deployment.broker.bootstrap_servers, [topic], 2, quiet=2.0)
    assert keys(seen) == ["o-1", "o-2"]
    assert not [r for r in caplog.records if "authoriz" in r.getMessage().lower()]


def test_a_literal_acl_on_the_parts_own_id_publishes_with_one_producer(
    deployment: Deployment, caplog: pytest.LogCaptureFixture
) -> None:
    """ACLs that name each part's transactional id literally, as one producer per part
    needed: the broker refuses the second id, and the part goes on with its own alone,
    saying so. (It was "producer fenced (a newer owner ...)", retried for ever: every
    part of such a deployment stopped at the upgrade.) Until the part's own id is granted
    the relay says which id and which ACL, and retries."""
    readme = readme_acls()
    grant(deployment.broker, [b for b in readme if b.restype != ResourceType.TRANSACTIONAL_ID])
    caplog.set_level(logging.INFO)
    topic = deployment.start_relay()
    deployment.write("o-1")
    first_id = _refused_id(caplog)
    assert not first_id.endswith(".2")  # the part's own id is tried first, and named
    grant(deployment.broker, [
        AclBinding(ResourceType.TRANSACTIONAL_ID, first_id, ResourcePatternType.LITERAL,
                   PRINCIPAL, "*", op, AclPermissionType.ALLOW)
        for op in (AclOperation.WRITE, AclOperation.DESCRIBE)
    ])  # fmt: skip
    deployment.write("o-2")
    deployment.write("o-3")
    seen = consume(deployment.broker.bootstrap_servers, [topic], 3, timeout=60, quiet=2.0)
    assert keys(seen) == ["o-1", "o-2", "o-3"]
    alone = [
        r for r in caplog.records if getattr(r, "event", "") == "kafka_second_producer_refused"
    ]
    assert alone and {r.transactional_id for r in alone} == {f"{first_id}.2"}


def _refused_id(caplog: pytest.LogCaptureFixture, timeout: float = 30.0) -> str:
    """The transactional id the relay's first refusal names."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for record in list(caplog.records):
            found = re.search(
                r"(\S+): the broker refuses this transactional id", record.getMessage()
            )
            if found:
                return found.group(1)
        time.sleep(0.2)
    raise AssertionError("the relay never said the broker refused its transactional id")


# Each of the README's grants a relay needs as it publishes, withheld in turn.
WITHHELD: dict[str, Callable[[AclBinding], bool]] = {
    "Write on the output topics": lambda b: (
        b.restype == ResourceType.TOPIC and b.name == "outbox.event."
        and b.operation == AclOperation.WRITE
    ),
    "Read on the checkpoint groups": lambda b: b.restype == ResourceType.GROUP,
    "Read on the checkpoint topic": lambda b: (
        b.restype == ResourceType.TOPIC and b.name == "outbox-relay.checkpoints"
        and b.operation == AclOperation.READ
    ),
}  # fmt: skip


@pytest.mark.parametrize("missing", list(WITHHELD))
def test_a_missing_acl_is_reported_retried_and_loses_nothing(
    deployment: Deployment, caplog: pytest.LogCaptureFixture, missing: str
) -> None:
    """Without one of the ACLs the relay says the broker refused it and keeps retrying,
    never exits and never publishes what it cannot commit; once the ACL is granted,
    every event written meanwhile arrives exactly once."""
    withheld = WITHHELD[missing]
    readme = readme_acls()
    grant(deployment.broker, [b for b in readme if not withheld(b)])
    caplog.set_level(logging.INFO)
    topic = deployment.start_relay()
    deployment.write("o-1")
    deployment.write("o-2")
    refusal = _logged(caplog, "authoriz", timeout=60.0)
    assert refusal.levelno >= logging.WARNING, refusal.getMessage()
    grant(deployment.broker, [b for b in readme if withheld(b)])
    deployment.write("o-3")
    seen = consume(deployment.broker.bootstrap_servers, [topic], 3, timeout=90, quiet=2.0)
    assert keys(seen) == ["o-1", "o-2", "o-3"]


def _logged(
    caplog: pytest.LogCaptureFixture, text: str, timeout: float = 30.0
) -> logging.LogRecord:
    """The first log record whose message holds ``text`` (any case), once there is one."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for record in list(caplog.records):
            if text in record.getMessage().lower():
                return record
        time.sleep(0.2)
    raise AssertionError(f"nothing logged with {text!r} within {timeout}s")


def test_without_create_acls_the_operator_creates_the_topics(
    deployment: Deployment, caplog: pytest.LogCaptureFixture
) -> None:
    """``create_topics = false`` and none of the README's Create grants: the topics the
    README tells the operator to create first are all the relay needs."""
    grant(deployment.broker, [b for b in readme_acls() if b.operation != AclOperation.CREATE])
    suffix = uuid.uuid4().hex[:6]
    admin = AdminClient({"bootstrap.servers": deployment.broker.bootstrap_servers})
    created = admin.create_topics([
        NewTopic(f"outbox.event.order-{suffix}", 3),
        NewTopic("outbox-relay.checkpoints", 2, config={"cleanup.policy": "compact"}),
    ])  # fmt: skip
    for future in created.values():
        with contextlib.suppress(KafkaException):  # the checkpoint topic may exist already
            future.result(30)
    caplog.set_level(logging.INFO)
    # The operator made the topic, so names it: rows reach it (issue #47).
    allow = rf"outbox\.event\.[A-Za-z0-9_-]+-{suffix}"
    topic = deployment.start_relay(create_topics=False, suffix=suffix, topic_allow=allow)
    for i in ("o-1", "o-2"):
        deployment.write(i)
    seen = consume(deployment.broker.bootstrap_servers, [topic], 2, quiet=2.0)
    assert keys(seen) == ["o-1", "o-2"]
    assert not [r for r in caplog.records if "authoriz" in r.getMessage().lower()]


# The ACLs issue #48 found halting a part, or waited for unnamed: each removed in turn.
REVOKED: dict[str, Callable[[AclBinding], bool]] = {
    # create_topics = true and a new topic: the refused creation halted the part.
    "Create on the output topics": lambda b: (
        b.restype == ResourceType.TOPIC and b.name == "outbox.event."
        and b.operation == AclOperation.CREATE
    ),
    # Removed while the relay publishes: retried, but shown as Kafka being unreachable.
    "Write on the output topics": WITHHELD["Write on the output topics"],
}  # fmt: skip


@pytest.mark.parametrize("revoked", list(REVOKED))
def test_an_acl_removed_makes_the_part_wait_unready_and_it_heals_once_granted(
    deployment: Deployment, relay_url: str, revoked: str
) -> None:
    """Issue #48: a part the broker refuses an ACL waits (never halts), says so in
    `status`, /readyz (503: this relay's principal cannot do its work) and
    `outbox_relay_part_waiting{service="kafka_acl"}`, and publishes every event once, in
    order, as soon as the ACL is granted again, with no `resume`."""
    readme = readme_acls()
    grant(deployment.broker, readme)
    topic = deployment.start_relay()
    [relay] = deployment.relays
    (part,) = relay.workers
    if revoked.startswith("Write"):  # the topic exists, the relay publishes to it
        deployment.write("o-1")
        assert keys(consume(deployment.broker.bootstrap_servers, [topic], 1)) == ["o-1"]
    admin = AdminClient({"bootstrap.servers": deployment.broker.bootstrap_servers})
    removed = [b for b in readme if REVOKED[revoked](b)]
    filters = [
        AclBindingFilter(b.restype, b.name, b.resource_pattern_type, b.principal, b.host,
                         b.operation, b.permission_type)
        for b in removed
    ]  # fmt: skip
    for deleted in admin.delete_acls(filters).values():
        deleted.result(30)
    wait_until(lambda: not set(removed) & set(admin.describe_acls(_every_acl()).result(30)),
               what="the ACL gone")  # fmt: skip
    deployment.write("o-2")
    deployment.write("o-3")
    wait_until(lambda: relay.part_waits().get(part) == "kafka_acl", 90, "the part to wait")
    assert relay.http is not None
    status, body = http_get(f"http://127.0.0.1:{relay.http.port}/readyz")
    assert status == 503 and "waiting for kafka_acl" in body, body
    assert "deploy/README.md, ACLs" in body
    _, metrics = http_get(f"http://127.0.0.1:{relay.http.port}/metrics")
    waiting = f'part="0",service="kafka_acl",subscriber="{part.subscriber}"'
    assert f"outbox_relay_part_waiting{{{waiting}}} 1.0" in metrics.splitlines()
    wait_until(lambda: part_status(relay_url, part)["waiting_on"] == "kafka_acl", 90, "status")
    line = part_status(relay_url, part)
    assert line["halted"] is None and "deploy/README.md, ACLs" in line["waiting_error"]
    grant(deployment.broker, removed)
    expected = ["o-1", "o-2", "o-3"] if revoked.startswith("Write") else ["o-2", "o-3"]
    seen = consume(deployment.broker.bootstrap_servers, [topic], len(expected), timeout=90,
                   quiet=2.0)  # fmt: skip
    assert keys(seen) == expected  # each once (one event per key: in order)
    wait_until(lambda: part_status(relay_url, part)["waiting_on"] is None, 60, "the wait cleared")
    assert part_status(relay_url, part)["halted"] is None
