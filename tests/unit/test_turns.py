"""Two transactional producers of a part taking turns (relay/adapters/kafka/turns.py),
over publishers that record what they were asked."""

from __future__ import annotations

from uuid import UUID, uuid4

import pytest

from relay.adapters.kafka.turns import (
    TurnTakingPublisher,
    part_publisher,
    second_transactional_id,
)
from relay.core.model import KafkaCheckpoint, Position
from relay.core.ports import Batch, Meanwhile
from relay.errors import BrokerUnavailable

CALLS: list[str] = []


class Recording:
    def __init__(self, name: str, checkpoint: KafkaCheckpoint | None = None) -> None:
        self.name = name
        self.checkpoint = checkpoint
        self.fail_publish = False
        self.fail_close = False

    def recover(self, generation: str, key_space: UUID | None = None) -> KafkaCheckpoint | None:
        CALLS.append(f"{self.name} recover")
        return self.checkpoint

    def publish(self, batch: Batch, meanwhile: Meanwhile | None = None) -> None:
        CALLS.append(f"{self.name} publish {batch.end.transaction_id}")
        if self.fail_publish:
            raise BrokerUnavailable("transaction aborted")

    def close(self) -> None:
        CALLS.append(f"{self.name} close")
        if self.fail_close:
            raise RuntimeError("close failed")


@pytest.fixture(autouse=True)
def _calls() -> None:
    CALLS.clear()


def batch(n: int) -> Batch:
    return Batch([], Position(n, 1), "g")


@pytest.mark.parametrize("later", [0, 1])
def test_both_are_fenced_and_the_later_checkpoint_is_trusted(later: int) -> None:
    # Each read follows its own producer's fence: the later one covers both.
    found = [KafkaCheckpoint(Position(5, 1)), KafkaCheckpoint(Position(9, 1))]
    if later == 0:
        found.reverse()
    turns = TurnTakingPublisher([Recording("a", found[0]), Recording("b", found[1])])
    assert turns.recover("g", uuid4()) == KafkaCheckpoint(Position(9, 1))
    assert sorted(CALLS) == ["a recover", "b recover"]


def test_a_checkpoint_one_read_found_is_trusted_and_none_is_none() -> None:
    turns = TurnTakingPublisher([Recording("a"), Recording("b", KafkaCheckpoint(Position(3, 1)))])
    assert turns.recover("g") == KafkaCheckpoint(Position(3, 1))
    assert TurnTakingPublisher([Recording("a"), Recording("b")]).recover("g") is None


def test_transactions_take_turns() -> None:
    turns = TurnTakingPublisher([Recording("a"), Recording("b")])
    for n in range(4):
        turns.publish(batch(n))
    assert CALLS == ["a publish 0", "b publish 1", "a publish 2", "b publish 3"]


def test_after_a_failed_transaction_the_other_producer_takes_the_next() -> None:
    first = Recording("a")
    first.fail_publish = True
    turns = TurnTakingPublisher([first, Recording("b")])
    with pytest.raises(BrokerUnavailable):
        turns.publish(batch(1))
    turns.publish(batch(1))
    assert CALLS == ["a publish 1", "b publish 1"]


def test_closing_closes_both_even_if_the_first_fails() -> None:
    first = Recording("a")
    first.fail_close = True
    turns = TurnTakingPublisher([first, Recording("b")])
    with pytest.raises(RuntimeError):
        turns.close()
    assert CALLS == ["a close", "b close"]


def test_the_second_id_is_the_first_with_a_suffix_no_other_part_ends_with() -> None:
    # A part's id ends with its subscriber's UUID, which has no dot.
    first = f"outbox-relay.orders.0.{uuid4()}"
    assert second_transactional_id(first) == f"{first}.2"


def test_a_part_publisher_is_one_producer_or_two_taking_turns() -> None:
    opened: list[str] = []

    def open_producer(transactional_id: str) -> Recording:
        opened.append(transactional_id)
        return Recording(transactional_id)

    assert isinstance(part_publisher(open_producer, "p.s.0.u", 1), Recording)
    assert isinstance(part_publisher(open_producer, "p.s.0.u", 2), TurnTakingPublisher)
    assert opened == ["p.s.0.u", "p.s.0.u", "p.s.0.u.2"]
