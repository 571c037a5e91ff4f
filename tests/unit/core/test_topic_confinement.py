"""The topic creator's confinement of the topics rows choose (issue #47), over a fake
admin client and the in-memory topic record: the operator's topics are created whatever
the count and never counted; a row's existing topic must be the outbox's or allowed; a
row's new topic is counted, and waits (never poison) once the budget is used up."""

from __future__ import annotations

from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

from relay.adapters.kafka.kafka import TopicCreator
from relay.adapters.memory import InMemoryTopicRecord
from relay.core.ports import TopicOrigin
from relay.errors import RetryableError, TopicBudgetFull, TopicMissing, TopicRefused


class _Future:
    def __init__(self, error: KafkaError | None) -> None:
        self._error = error

    def exception(self) -> KafkaException | None:
        return None if self._error is None else KafkaException(self._error)


class FakeAdmin:
    """The cluster's topics; ``refuse`` names topics whose creation a policy refuses."""

    def __init__(self, *topics: str) -> None:
        self.topics: dict[str, object] = dict.fromkeys(topics, object())
        self.refuse: set[str] = set()
        self.created: list[str] = []

    def list_topics(self, timeout: float) -> Any:
        return self

    def create_topics(self, new: list[Any], **_: Any) -> dict[str, _Future]:
        futures = {}
        for topic in new:
            name = topic.topic
            if name in self.refuse:
                futures[name] = _Future(KafkaError(KafkaError.POLICY_VIOLATION, "no"))
                continue
            self.created.append(name)
            self.topics[name] = object()
            futures[name] = _Future(None)
        return futures


def creator(admin: FakeAdmin, record: InMemoryTopicRecord | None, **options: Any) -> TopicCreator:
    made = TopicCreator({}, record=record, relay_owned=lambda t: t == "cp", **options)
    made._admin = lambda: admin  # type: ignore[method-assign,assignment,return-value]
    return made


def test_the_operators_topics_are_created_whatever_rows_made_and_never_counted() -> None:
    admin, record = FakeAdmin(), InMemoryTopicRecord()
    record.record(["row.1"], TopicOrigin.ROW)
    topics = creator(admin, record, max_created=1)  # used up by rows
    topics.ensure({"cp"})  # the relay's own: created, not recorded
    topics.ensure_for_records({"many.svc000", "billing.Invoice"}, set())
    assert sorted(admin.created) == ["billing.Invoice", "cp", "many.svc000"]
    assert record.origins == {
        "row.1": TopicOrigin.ROW,
        "many.svc000": TopicOrigin.DECLARED,
        "billing.Invoice": TopicOrigin.DECLARED,
    }


def test_a_rows_existing_topic_must_be_the_outboxs_or_allowed() -> None:
    admin = FakeAdmin("outbox.event.order", "outbox.event.Payment", "allowed.x")
    record = InMemoryTopicRecord()
    record.record(["outbox.event.order"], TopicOrigin.ROW)
    topics = creator(admin, record, allow_listed=lambda t: t.startswith("allowed."))
    topics.ensure_for_records(
        {"outbox.event.order", "allowed.x"}, {"outbox.event.order", "allowed.x"}
    )
    with pytest.raises(TopicRefused) as refused:
        topics.ensure_for_records({"outbox.event.Payment"}, {"outbox.event.Payment"})
    assert refused.value.topic == "outbox.event.Payment"
    assert "this outbox did not create it" in refused.value.reason
    assert "topic_allow" in refused.value.reason
    assert admin.created == []


def test_a_rows_new_topic_is_counted_and_waits_once_the_budget_is_used_up() -> None:
    admin, record = FakeAdmin(), InMemoryTopicRecord()
    topics = creator(admin, record, max_created=2)
    wanted = {"junk.0", "junk.1", "junk.2"}
    with pytest.raises(TopicBudgetFull) as full:
        topics.ensure_for_records(wanted, wanted)
    assert isinstance(full.value, RetryableError) and full.value.waits_on == "topic_budget"
    assert "max_created_topics (2)" in str(full.value)
    assert admin.created == ["junk.0", "junk.1"]  # what fits is created meanwhile
    assert record.row_topics() == 2
    # A row's topic recorded but deleted since is the outbox's: made again, uncounted.
    del admin.topics["junk.0"]
    fresh = creator(admin, record, max_created=2)
    fresh.ensure_for_records({"junk.0"}, {"junk.0"})
    assert admin.created[-1] == "junk.0" and record.row_topics() == 2


def test_a_name_the_broker_refuses_is_the_rows_poison_and_takes_no_room() -> None:
    admin, record = FakeAdmin(), InMemoryTopicRecord()
    admin.refuse.add("bad")
    topics = creator(admin, record, max_created=1)
    with pytest.raises(TopicRefused):
        topics.ensure_for_records({"bad"}, {"bad"})
    assert record.row_topics() == 0
    topics.ensure_for_records({"good"}, {"good"})
    assert admin.created == ["good"]


def test_without_creation_a_missing_topic_waits_for_the_operator_rows_or_not() -> None:
    """Issue #48: a row's missing topic was poison, so a 'halt' part halted for good even
    once the topic was made. Now every missing topic waits, named, with the command
    that creates it; a row's not yet named also says to name it."""
    admin = FakeAdmin()
    topics = creator(admin, InMemoryTopicRecord(), enabled=False)
    for routed in (set(), {"nowhere"}):
        with pytest.raises(TopicMissing) as missing:
            topics.ensure_for_records({"nowhere"}, routed)
        assert missing.value.waits_on == "topic" and missing.value.topic == "nowhere"
        assert "does not exist and create_topics is false" in missing.value.reason
        assert "`outbox-relay topics create nowhere --if-not-exists`" in missing.value.reason
        assert ("topic_allow" in missing.value.reason) is bool(routed)
    admin.topics["nowhere"] = object()  # the operator made it
    topics.ensure_for_records({"nowhere"}, set())
    assert admin.created == []


def test_a_schema_without_the_record_keeps_existing_topics_and_waits_for_new_ones() -> None:
    """A rolling deploy (migration 0017 not applied yet): as before for topics that
    exist; a new one waits for the migration rather than being made uncounted."""

    class NoRecord(InMemoryTopicRecord):
        def recorded(self) -> frozenset[str] | None:
            return None

        def reserve(self, topic: str, cap: int | None) -> bool | None:
            return None

    admin = FakeAdmin("outbox.event.order")
    topics = creator(admin, NoRecord(), max_created=100)
    topics.ensure_for_records({"outbox.event.order"}, {"outbox.event.order"})
    with pytest.raises(TopicBudgetFull) as waiting:
        topics.ensure_for_records({"outbox.event.new"}, {"outbox.event.new"})
    assert "migration 0017" in str(waiting.value)


def test_one_admin_client_serves_every_topic_made_sure_of(monkeypatch: pytest.MonkeyPatch) -> None:
    # A client per call outlived it (a cycle through the future's exception when the
    # topic existed): 1,000 parts ran hundreds of clients at once (issue #53).
    opened: list[FakeAdmin] = []

    def open_admin(config: dict[str, Any]) -> FakeAdmin:
        opened.append(FakeAdmin())
        return opened[-1]

    monkeypatch.setattr("relay.adapters.kafka.kafka.AdminClient", open_admin)
    topics = TopicCreator({})
    for i in range(5):
        topics.ensure({f"t{i}"})
    topics.ensure_for_records({"t9"}, set())
    assert len(opened) == 1
    assert opened[0].created == ["t0", "t1", "t2", "t3", "t4", "t9"]
