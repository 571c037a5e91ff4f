"""This relay's membership among its peers: a session held only while Kafka answers."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient

from relay.adapters.kafka.broker_watch import BrokerWatch
from relay.adapters.kafka.replication_check import check_replication, relay_topics
from relay.core.log_fields import log_extra
from relay.core.ports import RelaySession
from relay.daemon.context import DaemonContext
from relay.engine.sessions import SessionKeeper
from relay.errors import RelayError

logger = logging.getLogger(__name__)

# How long the broker watch's request may take before Kafka counts as unreachable.
_BROKER_TIMEOUT_S = 5.0


class Membership:
    """Opens the relay's session once Kafka answers, and gives it (with every part) up
    when Kafka stays unreachable for a session timeout (docs/design.md §4)."""

    def __init__(
        self,
        context: DaemonContext,
        admin: Callable[[], AdminClient],
        *,
        on_lost: Callable[[], None],
        stop_workers: Callable[[float], None],
        written_topics: Callable[[], Collection[str]] = frozenset,
        on_peer_expired: Callable[[], None] = lambda: None,
    ) -> None:
        self._ctx = context
        self._admin = admin  # the relay's admin client, shared (kafka/admin.py)
        self._on_peer_expired = on_peer_expired
        self._written_topics = written_topics
        self._on_lost = on_lost
        self._stop_workers = stop_workers
        self.broker: BrokerWatch | None = None
        self.keeper: SessionKeeper | None = None
        self._replication_checked = False

    @property
    def session(self) -> RelaySession | None:
        """The live session, or None while this relay holds none (and so no part)."""
        return None if self.keeper is None else self.keeper.session

    def start(self) -> None:
        """Watch the broker; open the session if Kafka answers in time."""
        s = self._ctx.settings
        self.broker = BrokerWatch(
            {**s.kafka, "bootstrap.servers": s.require_bootstrap_servers()},
            interval=max(1.0, min(s.heartbeat_interval, 5.0)),
            timeout=_BROKER_TIMEOUT_S,
            written_topics=self._written_topics,
            admin=self._admin,
        )
        self.broker.start()
        if self.broker.wait_first(_BROKER_TIMEOUT_S + 2.0):
            self._open_session()
        # Otherwise no session yet: peers keep every part; the supervisor opens one once
        # Kafka answers.

    def mind_broker(self) -> None:
        """Hold a session (and so parts) only while Kafka answers."""
        broker = self.broker
        if broker is None or self._ctx.stopping.is_set():
            return
        if self.keeper is None:
            if broker.reachable:
                logger.info(
                    "Kafka answers: this relay takes its share of the parts",
                    extra=log_extra("kafka_reachable_taking_parts"),
                )
                self._open_session()
            return
        down = broker.silent_for()
        if down >= self._ctx.settings.session_timeout:
            logger.error(
                "%s (%.0fs): giving this relay's parts to its peers",
                broker.describe_silence(),
                down,
                extra=log_extra("kafka_unreachable_giving_parts", unreachable_s=down),
            )
            keeper, self.keeper = self.keeper, None
            keeper.session.lost.set()  # workers stop before publishing anything more
            # The session goes first, so peers claim its parts at once rather than after
            # the workers stop, which a black-holed broker holds up to the deadline (#49).
            # Safe: a worker still inside a batch cannot move the part's Postgres
            # checkpoint (a compare-and-set on the owner, now another), and its Kafka
            # transaction cannot commit after the new owner's init_transactions fenced
            # its transactional ids; a commit that lands before the fence is adopted by
            # the new owner's recovery (docs/design.md §4, "A relay cut off from Kafka").
            keeper.close(timeout=5.0)  # deletes the session: every claim is free at once
            self._stop_workers(time.monotonic() + 5.0)

    def until_giving_up(self) -> float:
        """Seconds until Kafka's silence reaches the session timeout, when this relay
        gives its parts up (inf without a session): the supervisor wakes for it, not a
        heartbeat interval later."""
        if self.broker is None or self.keeper is None:
            return float("inf")
        return self._ctx.settings.session_timeout - self.broker.silent_for()

    def stop(self, deadline: float) -> None:
        """Stop watching the broker and delete the session: peers may claim at once."""
        if self.broker is not None:
            self.broker.stop()
        if self.keeper is not None:
            self.keeper.close(timeout=max(1.0, deadline - time.monotonic()))

    def abandon(self) -> None:
        """A start that failed: stop and forget the broker watch and the session."""
        if self.broker is not None:
            self.broker.stop()
            self.broker = None
        if self.keeper is not None:
            self.keeper.close(timeout=5.0)
            self.keeper = None

    def _open_session(self) -> None:
        s = self._ctx.settings
        if not self._replication_checked:
            self._replication_checked = True
            threading.Thread(
                target=self._check_replication, name="relay-replication-check", daemon=True
            ).start()
        self.keeper = SessionKeeper(
            self._ctx.open_store,
            timeout=s.session_timeout,
            heartbeat_interval=s.heartbeat_interval,
            on_lost=self._on_lost,
            on_peer_expired=self._on_peer_expired,
        )
        self.keeper.start()

    def _check_replication(self) -> None:
        """Warn once about topics that would not survive a broker lost (advice only)."""
        s = self._ctx.settings
        try:
            store = self._ctx.open_store()
            try:
                templates = [state.subscriber.topic for state in store.list()]
            finally:
                store.close()
            relevant = relay_topics(templates, s.checkpoint_topic)
            check_replication(self._admin(), relevant, s.topic_replication_factor)
        except (KafkaException, RelayError) as exc:
            logger.info(
                "could not check the topics' replication: %s",
                exc,
                extra=log_extra("kafka_replication_check_failed", error=exc),
            )
