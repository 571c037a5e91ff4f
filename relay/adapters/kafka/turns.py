"""Two transactional producers of one part, taking turns a transaction each.

librdkafka speaks the transaction protocol from before KIP-890. A producer that begins a
transaction right after committing one is answered CONCURRENT_TRANSACTIONS until the
broker has written the last one's commit markers, and librdkafka asks again only after
a fixed 20 ms (AddPartitionsToTxn; AddOffsetsToTxn after ``retry.backoff.ms``). A part
that commits back to back (a backlog, or a steady stream) paid that on most
transactions: its records waited in the client until the broker let them in. With two
producers taking turns, each one's markers have the other's whole transaction to be
written (docs/design.md §5, bench/README.md).

Why order and exactly-once still hold:

* One transaction at a time. A turn's ``publish`` returns only once its commit
  returned, so the next turn's records are appended after every record of the last.
* The checkpoint. Both producers commit it to the same group; the group coordinator
  keeps the offset commit written last (the higher record offset in
  ``__consumer_offsets``), whichever transaction's markers land first.
* Fencing. :meth:`recover` fences both transactional ids, and trusts the later
  checkpoint of the two reads, each made after its producer's fence: no earlier owner's
  transaction on either can commit after it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from uuid import UUID

from relay.core.model import KafkaCheckpoint, Position
from relay.core.ports import Batch, Meanwhile, Publisher


def second_transactional_id(transactional_id: str) -> str:
    """The second producer's transactional id: the first's with ``.2``. The first keeps
    the id one producer per part always had, so an upgrade fences an older relay's."""
    return f"{transactional_id}.2"


def part_publisher(
    open_producer: Callable[[str], Publisher], transactional_id: str, producers: int
) -> Publisher:
    """A part's transactional publisher: ``open_producer(id)`` for the part's id, and with
    ``producers=2`` for the second id too, the two taking turns."""
    if producers == 1:
        return open_producer(transactional_id)
    ids = (transactional_id, second_transactional_id(transactional_id))
    return TurnTakingPublisher([open_producer(one) for one in ids])


class TurnTakingPublisher:
    """A :class:`~relay.core.ports.Publisher` over two transactional publishers of one
    part, each transaction on the one that did not take the last."""

    def __init__(self, publishers: Sequence[Publisher]) -> None:
        assert len(publishers) == 2, "two producers take turns"
        self._publishers = tuple(publishers)
        self._turn = 0

    def recover(self, generation: str, key_space: UUID | None = None) -> KafkaCheckpoint | None:
        # Both at once (a part's start pays one fence, not two in a row), the second on
        # a helper thread. Each producer's read of the checkpoint follows its own fence,
        # so an earlier owner's commit on either is in that producer's read, and the
        # later checkpoint of the two covers both.
        with ThreadPoolExecutor(1, thread_name_prefix="kafka-recover") as helper:
            second = helper.submit(self._publishers[1].recover, generation, key_space)
            first = self._publishers[0].recover(generation, key_space)
            found = [c for c in (first, second.result()) if c is not None]
        return max(found, key=_position, default=None)

    def publish(self, batch: Batch, meanwhile: Meanwhile | None = None) -> None:
        publisher = self._publishers[self._turn]
        # Turned before publishing: after a failed transaction (aborted, its markers on
        # the way) the other producer takes the next one too.
        self._turn ^= 1
        publisher.publish(batch, meanwhile)

    def close(self) -> None:
        try:
            self._publishers[0].close()
        finally:
            self._publishers[1].close()


def _position(checkpoint: KafkaCheckpoint) -> Position:
    return checkpoint.position
