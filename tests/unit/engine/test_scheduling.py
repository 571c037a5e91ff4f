"""Bounded threads and producers (issue #30): the part scheduler and the producer pool on
their own, and part workers sharing them over the in-memory store and publisher of
``relay.adapters.memory``. Counts, never timings."""

from __future__ import annotations

import dataclasses
import functools
import threading
import uuid
from collections.abc import Callable
from datetime import UTC, datetime

import pytest

from relay.adapters.memory import InMemoryPublisher, InMemoryStore
from relay.core.model import OutboxEvent, PartId, Position
from relay.core.ports import Batch, Fetched, Meanwhile, Owned, PartState, Selection
from relay.core.subscribers import Subscriber, ValueFormat
from relay.core.worker_stats import WorkerState
from relay.engine import worker as worker_module
from relay.engine.encoding import RecordEncoder
from relay.engine.scheduling import PartScheduler, ProducerPool
from relay.engine.sessions import RelaySession
from relay.engine.worker import PartWorker
from tests.support import wait_until

OWNER = uuid.uuid4()


class Recording(InMemoryPublisher):
    """An in-memory publisher that logs what its part does with it, in order."""

    def __init__(self, name: str, log: list[tuple[str, str]]) -> None:
        super().__init__()
        self.name, self._log = name, log

    def recover(self, generation: str, key_space: uuid.UUID | None = None) -> None:
        self._log.append(("recover", self.name))
        return None

    def publish(
        self, batch: Batch, meanwhile: Meanwhile | None = None, owned: Owned | None = None
    ) -> None:
        self._log.append(("publish", self.name))
        super().publish(batch, meanwhile, owned)

    def close(self) -> None:
        self._log.append(("close", self.name))
        super().close()


class Opener:
    """The pool's ``open_publisher``: a new recording publisher per call."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str]] = []
        self.opened: list[Recording] = []
        self.lock = threading.Lock()

    def __call__(self, state: PartState) -> Recording:
        with self.lock:
            publisher = Recording(state.name, self.log)
            self.opened.append(publisher)
            return publisher

    def committed(self) -> int:
        return sum(len(t) for p in self.opened for t in p.transactions)


def event(n: int, aggregate_type: str = "order") -> OutboxEvent:
    return OutboxEvent(
        transaction_id=0,
        position=0,
        message_id=uuid.uuid4(),
        aggregate_type=aggregate_type,
        aggregate_id=f"k{n}",
        aggregate_version=None,
        event_type="OrderPlaced",
        payload={"n": n},
        headers={},
        occurred_at=datetime.now(UTC),
    )


def state_of(name: str) -> PartState:
    store = InMemoryStore()
    store.open_session("test", 1, timeout=3600, session_id=OWNER)  # claims need one
    store.add(Subscriber(name, topic="t"))
    return store.get_part(name, 0)


def subscriber(name: str, aggregate_type: str | None = None) -> Subscriber:
    types = None if aggregate_type is None else frozenset({aggregate_type})
    return Subscriber(name, topic=f"t-{name}", value_format=ValueFormat.JSON, aggregate_types=types)


def worker(
    name: str, store: InMemoryStore, scheduler: PartScheduler, pool: ProducerPool
) -> PartWorker:
    return PartWorker(
        PartId(name, 0),
        session=RelaySession(OWNER, timeout=60, heartbeat_interval=1),
        open_store=lambda: store,
        open_publisher=lambda state: InMemoryPublisher(),  # unused: the pool lends
        encoder=RecordEncoder(None),
        batch_size=100,
        poll_interval=0.05,
        scheduler=scheduler,
        producers=pool,
    )


def stop(workers: list[PartWorker], scheduler: PartScheduler) -> None:
    for w in workers:
        w.stop()
    for w in workers:
        w.join(10)
        assert not w.is_alive()
    scheduler.close()


# -- the producer pool -------------------------------------------------------------------


def test_the_pool_keeps_at_most_its_size_open_and_closes_the_least_recently_used() -> None:
    opener = Opener()
    pool = ProducerPool(opener, 2)
    a, b, c = object(), object(), object()
    first, fresh = pool.acquire(a, state_of("a"))
    assert fresh
    pool.release(a)
    pool.acquire(b, state_of("b"))
    pool.release(b)
    assert pool.acquire(a, state_of("a")) == (first, False)  # kept while there is room
    pool.release(a)
    pool.acquire(c, state_of("c"))  # full: b, the least recently used, makes room
    assert pool.open == 2
    assert [entry for entry in opener.log if entry[0] == "close"] == [("close", "b")]


def test_a_held_publisher_is_never_closed_to_make_room() -> None:
    opener = Opener()
    pool = ProducerPool(opener, 1)
    a, b = object(), object()
    held, _ = pool.acquire(a, state_of("a"))
    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire(b, state_of("b"))[0]))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and not got and not held.closed  # b waits for a's release
    pool.release(a)
    waiter.join(10)
    assert held.closed and got and got[0] is not held and pool.open == 1


def test_a_discarded_publisher_is_closed_and_the_next_acquire_opens_a_new_one() -> None:
    opener = Opener()
    pool = ProducerPool(opener, 4)
    a = object()
    first, _ = pool.acquire(a, state_of("a"))
    pool.discard(a)
    assert first.closed and pool.open == 0
    second, fresh = pool.acquire(a, state_of("a"))
    assert second is not first and fresh


# -- the scheduler -----------------------------------------------------------------------


class Counting:
    """A task that counts its turns and the most threads that ran it at once."""

    def __init__(self, turns: int, record: Callable[[int], None]) -> None:
        self.turns, self.left, self._record = 0, turns, record
        self._inside = 0
        self.overlapped = False
        self.lock = threading.Lock()

    def turn(self, woken: bool) -> float | None:
        with self.lock:
            self._inside += 1
            self.overlapped |= self._inside > 1
        self._record(threading.active_count())
        with self.lock:
            self._inside -= 1
            self.turns += 1
            self.left -= 1
            return None if self.left == 0 else 0.0


def test_many_tasks_run_on_at_most_the_schedulers_threads() -> None:
    scheduler = PartScheduler(4)
    before = threading.active_count()
    seen: list[int] = []
    tasks = [Counting(3, seen.append) for _ in range(300)]
    for task in tasks:
        scheduler.submit(task)
    wait_until(lambda: all(t.left == 0 for t in tasks), what="every task's turns")
    scheduler.close()
    assert max(seen) <= before + 4 and scheduler.threads <= 4
    assert all(t.turns == 3 and not t.overlapped for t in tasks)


def test_a_woken_task_runs_before_its_timer_and_a_task_woken_while_running_again() -> None:
    scheduler = PartScheduler(1)
    turns: list[bool] = []
    release = threading.Event()

    class Sleepy:
        def turn(self, woken: bool) -> float | None:
            turns.append(woken)
            if len(turns) == 1:
                release.wait(10)  # woken while it runs (below)
            return None if len(turns) == 3 else 3600.0

    task = Sleepy()
    scheduler.submit(task)
    wait_until(lambda: len(turns) == 1, what="the first turn")
    scheduler.wake(task)
    release.set()
    wait_until(lambda: len(turns) == 2, what="a second turn, at once, not in an hour")
    scheduler.wake(task)
    wait_until(lambda: len(turns) == 3, what="a third turn, woken from the timer queue")
    scheduler.close()
    assert turns == [False, True, True]


# -- part workers on shared threads and producers ----------------------------------------


def test_idle_parts_hold_no_producer_and_share_the_schedulers_threads() -> None:
    store = InMemoryStore()
    store.open_session("test", 1, timeout=3600, session_id=OWNER)  # claims need one
    opener = Opener()
    scheduler, pool = PartScheduler(2), ProducerPool(opener, 2)
    workers = []
    for n in range(50):
        store.add(subscriber(f"s{n}", aggregate_type=f"type{n}"))
        assert store.claim(f"s{n}", 0, OWNER)
        workers.append(worker(f"s{n}", store, scheduler, pool))
    before = threading.active_count()
    for w in workers:
        w.start()
    wait_until(lambda: all(w.stats.state is WorkerState.RUNNING for w in workers), what="50 polls")
    # Each part recovered once as it started (fencing earlier owners), on 2 producers.
    assert len(opener.opened) == 50 and pool.open <= 2
    # Rows of a type no part takes: every checkpoint moves past them, without a producer.
    for n in range(3):
        store.append(event(n, aggregate_type="nobody's"))
    last = store.events[-1].key
    wait_until(
        lambda: all(store.get_part(f"s{n}", 0).checkpoint == last for n in range(50)),
        what="every checkpoint past the rows no one takes",
    )
    assert len(opener.opened) == 50 and pool.open <= 2
    assert scheduler.threads <= 2 and threading.active_count() <= before + 2
    pool.close_idle(older_than=3600)  # idle for less: kept
    assert pool.open > 0
    pool.close_idle()  # the supervisor's, once they have idled long enough
    assert pool.open == 0
    stop(workers, scheduler)


def test_busy_parts_share_a_pool_smaller_than_them_and_recover_on_each_new_producer() -> None:
    store = InMemoryStore()
    store.open_session("test", 1, timeout=3600, session_id=OWNER)  # claims need one
    opener = Opener()
    scheduler, pool = PartScheduler(2), ProducerPool(opener, 2)
    names = [f"s{n}" for n in range(6)]
    for name in names:
        store.add(subscriber(name))
        assert store.claim(name, 0, OWNER)
    workers = [worker(name, store, scheduler, pool) for name in names]
    for w in workers:
        w.start()
    for round_ in range(3):  # each round: every part has rows again
        for n in range(10):
            store.append(event(round_ * 10 + n))
        for w in workers:
            w.wake()
        last = store.events[-1].key
        wait_until(
            lambda last=last: all(store.get_part(n, 0).checkpoint == last for n in names),
            what="every part caught up",
        )
        assert pool.open <= 2
    stop(workers, scheduler)
    assert opener.committed() == 6 * 30  # every event once per subscriber
    assert len(opener.opened) > 2  # the parts took turns on the pool's two producers
    # Each opening is counted on its part (outbox_relay_producers_opened).
    assert sum(w.stats.producers_opened for w in workers) == len(opener.opened)
    # A part never publishes on a producer it has not recovered with (init_transactions
    # is the fence): each of its publishes follows a recovery, with no close between.
    for name in names:
        recovered = False
        for kind, part in opener.log:
            if part == name:
                assert kind != "publish" or recovered, opener.log
                recovered = kind == "recover" or (recovered and kind == "publish")


def test_a_part_moved_away_while_its_producer_was_lent_elsewhere_never_recovers_again() -> None:
    """The slot-switch case of zombie fencing: this relay's producer of part a was
    closed to make room; meanwhile a peer took a over. When rows for a come, the worker
    reads its ownership before any new producer of a is initialised, and stops."""
    store = InMemoryStore()
    store.open_session("test", 1, timeout=3600, session_id=OWNER)  # claims need one
    opener = Opener()
    scheduler, pool = PartScheduler(1), ProducerPool(opener, 1)
    for name in ("a", "b"):
        store.add(subscriber(name))
        assert store.claim(name, 0, OWNER)
    a, b = worker("a", store, scheduler, pool), worker("b", store, scheduler, pool)
    a.start()
    store.append(event(1, "order"))
    last = store.events[-1].key
    wait_until(lambda: store.get_part("a", 0).checkpoint == last, what="a published")
    b.start()
    wait_until(lambda: store.get_part("b", 0).checkpoint == last, what="b published")
    assert ("close", "a") in opener.log  # b's producer took a's slot
    state = store.get_part("a", 0)
    store.parts["a", 0] = dataclasses.replace(state, owner=uuid.uuid4())  # a peer took a
    seen = len(opener.log)
    store.append(event(2, "order"))
    a.wake()
    a.join(10)
    assert not a.is_alive()  # ClaimLost: stopped
    # No producer of a recovered (fencing the peer) or published since.
    assert ("recover", "a") not in opener.log[seen:] and ("publish", "a") not in opener.log[seen:]
    stop([b], scheduler)


class Reads(InMemoryStore):
    """An in-memory store that remembers the furthest event a fetch returned."""

    def __init__(self) -> None:
        super().__init__()
        self.furthest: Position | None = None

    def fetch(self, after: Position, selection: Selection) -> Fetched:
        fetched = super().fetch(after, selection)
        if fetched.events and (self.furthest is None or fetched.events[-1].key > self.furthest):
            self.furthest = fetched.events[-1].key
        return fetched


class Watching(InMemoryPublisher):
    """An in-memory publisher that calls ``before`` as each transaction starts."""

    def __init__(self, before: Callable[[], None]) -> None:
        super().__init__()
        self._before = before

    def publish(
        self, batch: Batch, meanwhile: Meanwhile | None = None, owned: Owned | None = None
    ) -> None:
        self._before()
        super().publish(batch, meanwhile, owned)


def test_a_part_that_yields_its_thread_to_waiting_parts_holds_no_batch_read_ahead(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Hundreds of busy parts take turns on a few threads: a batch each waiting part
    read ahead and kept until its next turn is memory held by all of them at once."""
    monkeypatch.setattr(worker_module, "_TURN_S", 0.0)  # every turn ends after a batch
    scheduler = PartScheduler(1)
    stores = {"a": Reads(), "b": Reads()}
    held: list[tuple[Position, Position]] = []  # the waiting part's (read to, published to)
    opened: list[Watching] = []

    def watch_the_other(name: str) -> None:  # on the one thread: the other part waits
        other = "b" if name == "a" else "a"
        read, published = stores[other].furthest, stores[other].get_part(other, 0).checkpoint
        if read is not None and read > published:
            held.append((read, published))

    def opener(state: PartState) -> Watching:
        opened.append(Watching(functools.partial(watch_the_other, state.name)))
        return opened[-1]

    workers = []
    for name, store in stores.items():
        store.open_session("test", 1, timeout=3600, session_id=OWNER)  # claims need one
        store.add(subscriber(name))
        assert store.claim(name, 0, OWNER)
        for n in range(500):  # 5 batches each
            store.append(event(n))
        workers.append(worker(name, store, scheduler, ProducerPool(opener, 1)))
    for w in workers:
        w.start()
    wait_until(
        lambda: all(s.get_part(n, 0).checkpoint == s.events[-1].key for n, s in stores.items()),
        what="both parts published",
    )
    stop(workers, scheduler)
    assert sum(len(t) for p in opened for t in p.transactions) == 1000  # each event once
    assert held == []  # while one part published, the other held nothing it had not
