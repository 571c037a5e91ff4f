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
* Fencing. :meth:`recover` fences both transactional ids, then reads the checkpoint
  once: no earlier owner's transaction on either can commit after its fence, and both
  commit to the same group, so that one read (of stable offsets) is the last checkpoint
  there will be. A read per producer was a consumer client per producer at every
  opening (#53). With one producer per part
  (``transaction_producers = 1``) the second id is fenced all the same, then its client
  closed: a relay that still takes turns cannot commit behind the new owner's back, so
  going from two to one is a rolling change.
* An id the broker refuses. A deployment whose ACL names each part's id literally has
  none for the second: the part then publishes on its own id alone, and says so. Nobody
  without ``Write`` on an id can commit under it, so there is nothing to fence.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Protocol
from uuid import UUID

from relay.core.log_fields import log_extra
from relay.core.model import KafkaCheckpoint
from relay.core.ports import Batch, Meanwhile, Owned, Publisher
from relay.errors import TransactionalIdRefused

logger = logging.getLogger(__name__)

# A part recovers each time its publisher is opened again (the producer pool closes idle
# ones), so the refusal of its second id is said at WARNING once per id and process,
# then at INFO: an unchanged ACL is not news at every reopen.
_REFUSALS_SAID: set[str] = set()
_REFUSALS_LOCK = threading.Lock()
_MAX_REFUSALS_SAID = 10_000


class PartProducer(Publisher, Protocol):
    """One of a part's transactional producers, as two taking turns need it: fenced
    each, the checkpoint read once for both."""

    def fence(self, key_space: UUID | None = None) -> None:
        """Fence every earlier producer of this one's transactional id."""

    def start_fence(
        self, key_space: UUID | None = None, *, own_thread: bool = False
    ) -> Callable[[], None]:
        """Start :meth:`fence` without waiting (with ``own_thread``, on a thread of its
        own, not the one the part's producers share); the function returned waits."""

    def checkpoint(self, generation: str) -> KafkaCheckpoint | None:
        """The part's checkpoint, as the last transaction of either id committed it."""


def second_transactional_id(transactional_id: str) -> str:
    """The second producer's transactional id: the first's with ``.2``. The first keeps
    the id one producer per part always had, so an upgrade fences an older relay's."""
    return f"{transactional_id}.2"


def part_publisher(
    open_producer: Callable[[str], PartProducer],
    transactional_id: str,
    producers: int,
) -> Publisher:
    """A part's transactional publisher over ``open_producer(id)`` for the part's id and
    the second id: the two taking turns with ``producers=2``; with ``producers=1`` the
    second is opened only to be fenced at recovery."""
    ids = (transactional_id, second_transactional_id(transactional_id))
    return TurnTakingPublisher([open_producer(one) for one in ids], take_turns=producers == 2)


class TurnTakingPublisher:
    """A :class:`~relay.core.ports.Publisher` over two transactional publishers of one
    part, each transaction on the one that did not take the last (``take_turns``), or
    all on the first, the second fenced at recovery and closed."""

    def __init__(
        self,
        publishers: Sequence[PartProducer],
        *,
        take_turns: bool = True,
    ) -> None:
        assert len(publishers) == 2, "a part's two transactional ids"
        self._first, self._second = publishers
        self._take_turns = take_turns
        self._second_open = True
        self._turn = 0

    def recover(self, generation: str, key_space: UUID | None = None) -> KafkaCheckpoint | None:
        # Both fenced at once (a part's start pays one fence, not two in a row), the
        # second on a thread for that alone; then one read of the checkpoint (see the
        # module).
        second = self._second.start_fence(key_space, own_thread=True)
        try:
            self._first.fence(key_space)
        except BaseException:
            with contextlib.suppress(Exception):  # the first's failure is the part's
                second()  # the second's calls end before the part lets both go
            raise
        self._second_fenced(second)
        return self._first.checkpoint(generation)

    def _second_fenced(self, fenced: Callable[[], None]) -> None:
        """Once the second is fenced: closed if it does not take turns, or when the
        broker refuses its id (it cannot hold a transaction then)."""
        try:
            fenced()
        except TransactionalIdRefused as exc:
            logger.log(
                _refusal_level(exc.transactional_id),
                "%s; this part publishes on its first transactional id alone (one "
                "producer, as with transaction_producers = 1)",
                exc,
                extra=log_extra(
                    "kafka_second_producer_refused", transactional_id=exc.transactional_id
                ),
            )
            self._close_second()
            return
        if not self._take_turns:
            self._close_second()  # fenced: its work is done

    def publish(
        self, batch: Batch, meanwhile: Meanwhile | None = None, owned: Owned | None = None
    ) -> None:
        publisher = self._second if self._turn and self._second_open else self._first
        # Turned before publishing: after a failed transaction (aborted, its markers on
        # the way) the other producer takes the next one too.
        self._turn ^= 1
        publisher.publish(batch, meanwhile, owned)

    def close(self) -> None:
        try:
            self._first.close()
        finally:
            self._close_second()

    def _close_second(self) -> None:
        if self._second_open:
            self._second_open = False
            self._second.close()


def _refusal_level(transactional_id: str) -> int:
    """WARNING the first time this process hears ``transactional_id`` refused, else INFO."""
    with _REFUSALS_LOCK:
        if transactional_id in _REFUSALS_SAID:
            return logging.INFO
        if len(_REFUSALS_SAID) >= _MAX_REFUSALS_SAID:  # bounded: at worst, said again
            _REFUSALS_SAID.clear()
        _REFUSALS_SAID.add(transactional_id)
        return logging.WARNING
