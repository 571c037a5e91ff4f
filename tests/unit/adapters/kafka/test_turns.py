"""Two transactional producers of a part taking turns (relay/adapters/kafka/turns.py),
over publishers that record what they were asked."""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Callable
from uuid import UUID, uuid4

import pytest

from relay.adapters.kafka import turns as turns_module
from relay.adapters.kafka.turns import (
    TurnTakingPublisher,
    part_publisher,
    second_transactional_id,
)
from relay.core.model import KafkaCheckpoint, Position
from relay.core.ports import Batch, Meanwhile, Owned
from relay.errors import BrokerUnavailable, TransactionalIdRefused
from tests.support import without_cyclic_collector

CALLS: list[str] = []


class Recording:
    def __init__(self, name: str, found: KafkaCheckpoint | None = None) -> None:
        self.name = name
        self.found = found
        self.fail_publish = False
        self.fail_close = False
        self.fenced_alone: bool | None = None  # how its fence was started, if it was

    def recover(self, generation: str, key_space: UUID | None = None) -> KafkaCheckpoint | None:
        self.fence(key_space)
        return self.checkpoint(generation)

    def fence(self, key_space: UUID | None = None) -> None:
        CALLS.append(f"{self.name} fence")

    def start_fence(
        self, key_space: UUID | None = None, *, own_thread: bool = False
    ) -> Callable[[], None]:
        """The fence on a thread of its own, as a producer runs it with ``own_thread``."""
        self.fenced_alone = own_thread
        failed: list[BaseException] = []

        def run() -> None:
            try:
                self.fence(key_space)
            except BaseException as exc:
                failed.append(exc)

        thread = threading.Thread(target=run, name=f"{self.name}-calls")
        thread.start()

        def fenced() -> None:
            thread.join()
            if failed:
                raise failed.pop()

        return fenced

    def checkpoint(self, generation: str) -> KafkaCheckpoint | None:
        CALLS.append(f"{self.name} read")
        return self.found

    def publish(
        self, batch: Batch, meanwhile: Meanwhile | None = None, owned: Owned | None = None
    ) -> None:
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
    turns_module._REFUSALS_SAID.clear()  # once per id and process: each test is a new process


def batch(n: int) -> Batch:
    return Batch([], Position(n, 1), "g")


def test_both_are_fenced_then_the_checkpoint_is_read_once() -> None:
    """Both ids commit to one group: read after both fences, one read is the last
    checkpoint there will be. A read per producer cost a consumer client each (#53)."""
    found = KafkaCheckpoint(Position(9, 1))
    first, second = Recording("a", found), Recording("b")
    turns = TurnTakingPublisher([first, second])
    assert turns.recover("g", uuid4()) == found
    assert sorted(CALLS[:2]) == ["a fence", "b fence"] and CALLS[2:] == ["a read"]
    # The second beside the first: on a thread for that fence alone, as the two share
    # the thread their calls run on (publishers.py).
    assert second.fenced_alone is True and first.fenced_alone is None
    none = TurnTakingPublisher([Recording("a"), Recording("b")])
    assert none.recover("g") is None


def test_the_checkpoint_is_read_only_once_the_second_is_fenced() -> None:
    # Read before the second's fence returned, an earlier owner's transaction on the
    # second id could still commit a later checkpoint after the read.
    class Slow(Recording):
        def fence(self, key_space: UUID | None = None) -> None:
            time.sleep(0.2)
            CALLS.append(f"{self.name} fenced")

    TurnTakingPublisher([Recording("a"), Slow("b")]).recover("g")
    assert CALLS.index("a read") > CALLS.index("b fenced")


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


def test_a_part_publisher_opens_both_ids_and_takes_turns_only_with_two() -> None:
    opened: list[str] = []

    def open_producer(transactional_id: str) -> Recording:
        opened.append(transactional_id)
        return Recording(transactional_id)

    for producers in (1, 2):
        publisher = part_publisher(open_producer, "p", producers)
        publisher.recover("g")
        for n in range(3):
            publisher.publish(batch(n))
    assert opened == ["p", "p.2", "p", "p.2"]
    one, two = CALLS[:7], CALLS[7:]
    assert sorted(one[:2]) == sorted(two[:2]) == ["p fence", "p.2 fence"]
    assert one[2:] == ["p.2 close", "p read", "p publish 0", "p publish 1", "p publish 2"]
    assert two[2:] == ["p read", "p publish 0", "p.2 publish 1", "p publish 2"]


def test_with_one_producer_the_second_is_fenced_before_the_checkpoint_is_read() -> None:
    """Going from two producers to one: the new owner's recovery fences the second id
    too before it reads the checkpoint (both ids commit to one group), so a relay still
    taking turns cannot commit behind it. Then the second's client is closed, and never
    publishes."""
    found = KafkaCheckpoint(Position(9, 1))
    one = TurnTakingPublisher([Recording("a", found), Recording("b")],
                              take_turns=False)  # fmt: skip
    assert one.recover("g") == found
    one.publish(batch(1))
    one.publish(batch(2))
    one.close()
    assert sorted(CALLS[:2]) == ["a fence", "b fence"]
    assert CALLS[2:] == ["b close", "a read", "a publish 1", "a publish 2", "a close"]


class Refused(Recording):
    def fence(self, key_space: UUID | None = None) -> None:
        CALLS.append(f"{self.name} fence")
        raise TransactionalIdRefused(self.name, "Transactional Id authorization failed")


def test_a_second_id_the_broker_refuses_leaves_the_first_alone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An ACL naming each part's id literally has none for the second: the part goes on
    with one producer (nobody can have committed under a refused id), and says why."""
    first = Recording("a", KafkaCheckpoint(Position(5, 1)))
    turns = TurnTakingPublisher([first, Refused("a.2")])
    assert turns.recover("g") == KafkaCheckpoint(Position(5, 1))
    turns.publish(batch(1))
    turns.publish(batch(2))
    turns.close()
    assert CALLS[2:] == ["a.2 close", "a read", "a publish 1", "a publish 2", "a close"]
    (warning,) = [r for r in caplog.records if r.event == "kafka_second_producer_refused"]
    assert warning.transactional_id == "a.2" and "first transactional id alone" in warning.message


def test_a_refused_second_id_is_warned_of_once_then_said_at_info(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A part recovers at every reopen of its publisher: an unchanged ACL is a warning
    the first time only (per id: another part's refusal is news)."""
    caplog.set_level("INFO")
    for name in ("b", "b", "b", "c"):
        TurnTakingPublisher([Recording(name), Refused(f"{name}.2")]).recover("g")
    said = [
        (r.transactional_id, r.levelname)
        for r in caplog.records
        if r.event == "kafka_second_producer_refused"
    ]
    assert said == [("b.2", "WARNING"), ("b.2", "INFO"), ("b.2", "INFO"), ("c.2", "WARNING")]


def test_a_first_id_the_broker_refuses_fails_the_recovery() -> None:
    # The part's own id is the one that fences older relays: without it, no publishing.
    turns = TurnTakingPublisher([Refused("a"), Recording("a.2")])
    with pytest.raises(TransactionalIdRefused):
        turns.recover("g")


class Unreachable(Recording):
    def fence(self, key_space: UUID | None = None) -> None:
        raise BrokerUnavailable("the coordinator is away")


@pytest.mark.parametrize("second", [Refused, Unreachable], ids=["refused", "failed"])
def test_a_failed_second_recovery_leaves_no_cycle_holding_the_part_s_producers(
    second: type[Recording], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The second's failure, raised from its future in recover, held recover's frame,
    # which held the future: the part's producers and their threads lived until the
    # cyclic collector, rare in a relay (tune_gc; issue #53).
    monkeypatch.setattr(turns_module.logger, "disabled", True)  # pytest keeps the records
    with without_cyclic_collector():
        turns = TurnTakingPublisher([Recording("a"), second("a.2")])
        with contextlib.suppress(BrokerUnavailable):
            turns.recover("g")
        turns.close()
        gone = weakref.ref(turns)
        del turns
        assert gone() is None  # freed by reference counting alone


def test_the_second_is_fenced_beside_the_first_and_waited_for_if_the_first_fails() -> None:
    """The second's fence runs on its own call thread while the first's runs. When the
    first's fence fails, the part lets both go only once the second's calls ended."""
    ran_on: list[str] = []

    class Slow(Recording):
        def fence(self, key_space: UUID | None = None) -> None:
            time.sleep(0.2)  # still running when the first fails
            ran_on.append(threading.current_thread().name)
            CALLS.append(f"{self.name} recovered")

    turns = TurnTakingPublisher([Unreachable("a"), Slow("a.2")])
    with pytest.raises(BrokerUnavailable):
        turns.recover("g")
    assert CALLS[-1] == "a.2 recovered"
    assert ran_on == ["a.2-calls"]
