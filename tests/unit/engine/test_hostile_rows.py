"""Issue #17, the parts that need no server: a worker that meets an exception no one
foresaw lives on, and the rules that keep hostile rows off topics they may not reach
(tests/acceptance/test_hostile_rows.py writes such rows for a running relay)."""

from __future__ import annotations

import re

import pytest

from relay.adapters.memory import InMemoryPublisher, InMemoryStore
from relay.core.model import Position
from relay.core.ports import Fetched, Selection
from relay.core.subscribers import Subscriber, TopicGuard, legal_topic
from tests.support import wait_until
from tests.unit.engine.test_worker_logic import claimed
from tests.unit.engine.test_worker_logic import event as logic_event
from tests.unit.engine.test_worker_logic import worker as logic_worker


class _FailingStore(InMemoryStore):
    """A store whose fetch fails the way no one foresaw, once."""

    def __init__(self) -> None:
        super().__init__()
        self.failures = 1

    def fetch(self, after: Position, selection: Selection) -> Fetched:
        if self.failures:
            self.failures -= 1
            raise RuntimeError("nobody saw this coming")
        return super().fetch(after, selection)


def test_an_unexpected_exception_is_counted_logged_and_the_worker_lives_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = claimed(store=_FailingStore())
    store.append(logic_event(1))
    kafka = InMemoryPublisher()
    w = logic_worker(store, kafka)
    w.start()
    try:
        wait_until(lambda: kafka.transactions != [], what="the event, after the failure")
        assert w.is_alive()
        assert w.stats.unexpected == 1 and w.stats.errors == 1
        assert w.stats.last_error == "nobody saw this coming"
    finally:
        w.stop()
        w.join(10)
    [logged] = [r for r in caplog.records if "unexpected RuntimeError" in r.getMessage()]
    assert logged.exc_info is not None  # with its traceback


def test_topic_names_follow_kafkas_rules() -> None:
    assert legal_topic("outbox.event.order") and legal_topic("a" * 249)
    for name in (".", "..", "", "a" * 250, "order!", "ordre été"):
        assert not legal_topic(name), name


def test_the_guard_keeps_rows_off_reserved_topics_and_outside_the_allow_list() -> None:
    wild = Subscriber("wild", topic="{aggregate_type}")
    fixed = Subscriber("fixed", topic="payments", dead_letter_topic="payments.dead")
    guard = TopicGuard("outbox-relay.checkpoints")
    guard.update(s for s in (wild, fixed))  # any iterable, read once
    for topic, reason in (
        ("__consumer_offsets", "internal"),
        ("__transaction_state", "internal"),
        ("outbox-relay.checkpoints", "checkpoint topic"),
        ("payments.dead", "dead-letter topic"),
        ("outbox.dead-letter.future", "dead-letter topics"),
        ("payments", "subscriber 'fixed'"),
    ):
        refusal = guard.refusal(topic, wild)
        assert refusal is not None and reason in refusal, (topic, refusal)
    assert guard.refusal("payments", fixed) is None  # its own topic
    assert guard.refusal("order", wild) is None
    assert guard.relay_owned("payments.dead") and not guard.relay_owned("payments")

    allowing = TopicGuard("cp", re.compile(r"outbox\.event\.(order|payment)"))
    assert allowing.refusal("outbox.event.order", wild) is None
    refusal = allowing.refusal("outbox.event.orders", wild)
    assert refusal is not None and "topic_allow" in refusal
