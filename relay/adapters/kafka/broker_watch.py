"""Whether this relay can reach Kafka: only a relay that can takes (and keeps) parts.

Sessions spread the parts over every live relay. A relay with a wrong broker address
that opened a session would take parts away from healthy peers and then fail to
publish them. So the relay holds a session only while Kafka answers
(relay/daemon/membership.py), and this thread asks every few seconds.

"Kafka answers" is judged the way a producer depends on Kafka: some broker, any of
them, answers a metadata request and names the cluster's brokers. A metadata request
is served by whichever broker the client reaches, so one node down, or the controller
moving, changes nothing here; the producers themselves find the new partition leaders
and transaction coordinators. An earlier version asked DescribeCluster, which librdkafka
sends to the one broker it believes is the controller: killing that broker made every
relay give up its session for a minute (issue #29).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection
from datetime import UTC, datetime
from typing import Any

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient

from relay.adapters.kafka.admin import connection_config
from relay.adapters.kafka.kafka_errors import classify
from relay.core.log_fields import log_extra

logger = logging.getLogger(__name__)

_REMIND_EVERY_S = 60.0


class BrokerWatch(threading.Thread):
    """Asks Kafka for metadata every ``interval`` seconds, each answer within ``timeout``."""

    def __init__(
        self,
        config: dict[str, Any],
        *,
        interval: float,
        timeout: float,
        written_topics: Callable[[], Collection[str]] = frozenset,
        clock: Callable[[], float] = time.monotonic,
        admin: Callable[[], AdminClient] | None = None,
    ) -> None:
        """``admin``: the relay's admin client (relay/adapters/kafka/admin.py); None:
        one of the watch's own, for ``config``."""
        super().__init__(name="relay-broker-watch", daemon=True)
        self._admin = admin() if admin is not None else AdminClient(connection_config(config))
        self._servers = config.get("bootstrap.servers", "?")
        self._interval = interval
        self._timeout = timeout
        self._stopping = threading.Event()
        self._answered = threading.Event()
        self.reachable: bool | None = None  # None until the first answer or failure
        self.error: str | None = None
        self._clock = clock
        # When Kafka last answered (or the watch started): its silence counts from
        # there, not from when the requests that found it out gave up (issue #49).
        self._answered_at = clock()
        self._answered_at_wall = datetime.now(UTC)
        self._reminded: float | None = None
        self._written_topics = written_topics
        #: Partitions of the topics the relay writes with no live leader, as "topic[p]".
        self.leaderless: tuple[str, ...] = ()
        self._leaderless_since = datetime.now(UTC)
        self._leaderless_reminded: float | None = None

    def stop(self) -> None:
        self._stopping.set()

    def wait_first(self, timeout: float) -> bool | None:
        """The first verdict, waiting at most ``timeout`` seconds for it."""
        self._answered.wait(timeout)
        return self.reachable

    def silent_for(self) -> float:
        """Seconds since Kafka last answered (or the watch started), whatever the verdict.

        Not held back until the verdict: behind a black hole (packets dropped, sockets
        open) each request hangs for its timeout, twice, before Kafka is judged
        unreachable, and those 10 s would be added to the session timeout (issue #49).
        While Kafka answers, an answer comes every interval, so only a silence that
        outlasts the requests' timeouts grows past them.
        """
        return self._clock() - self._answered_at

    def describe_silence(self) -> str:
        """Why Kafka is silent: the verdict's error, or the request still waiting."""
        if self.reachable is False:
            return self.describe()
        return (
            f"Kafka at {self._servers} has not answered since "
            f"{self._answered_at_wall.isoformat(timespec='seconds')} (a request still waits)"
        )

    def describe(self) -> str:
        if self.reachable is False:
            return (
                f"Kafka at {self._servers} unreachable since "
                f"{self._answered_at_wall.isoformat(timespec='seconds')}: {self.error}"
            )
        if not self.reachable:
            return "Kafka not asked yet"
        if self.leaderless:
            shown = ", ".join(self.leaderless[:5]) + (", ..." if len(self.leaderless) > 5 else "")
            return (
                f"Kafka at {self._servers} answers, but {len(self.leaderless)} partitions "
                f"this relay writes have had no leader since "
                f"{self._leaderless_since.isoformat(timespec='seconds')}: {shown}"
            )
        return f"Kafka at {self._servers} answers"

    def run(self) -> None:
        while not self._stopping.is_set():
            self._ask()
            self._stopping.wait(self._interval)

    def _ask(self) -> None:
        answer = self._ask_once()
        if isinstance(answer, str) and self.reachable is True:
            # Once more before judging: right after a broker dies, the client may still
            # send the request to it, and that one times out (seen on three nodes).
            answer = self._ask_once()
        if isinstance(answer, str):
            self._failed(answer)
        else:
            self._answered_ok()
            self._note_leaders(self._leaderless(answer))
        self._answered.set()

    def _ask_once(self) -> Any:
        """The metadata when some broker answered, naming the cluster's brokers; else
        what failed (a ``str``)."""
        try:
            # Served by any broker the client is connected to (librdkafka picks one
            # that is up), unlike DescribeCluster, which waits for the controller. The
            # answer lists every topic the relay may describe: on a cluster of
            # thousands of topics that is some hundreds of kB every few seconds per
            # relay, the price of not depending on one node. (Naming one topic instead
            # would let a broker with auto.create.topics.enable create it.)
            metadata = self._admin.list_topics(timeout=self._timeout)
        except KafkaException as exc:
            return str(classify(exc, "asking for metadata"))
        if not metadata.brokers:  # a broker that knows no live broker cannot take writes
            return "the cluster's metadata names no live broker"
        return metadata

    def _leaderless(self, metadata: Any) -> tuple[str, ...]:
        """The partitions of the topics the relay writes that have no live leader."""
        written = self._written_topics()
        return tuple(
            f"{name}[{p.id}]"
            for name in sorted(written)
            if (topic := metadata.topics.get(name)) is not None and topic.error is None
            for p in sorted(topic.partitions.values(), key=lambda p: p.id)
            if p.error is not None or p.leader < 0 or p.leader not in metadata.brokers
        )

    def _note_leaders(self, leaderless: tuple[str, ...]) -> None:
        """Logged on change and reminded every minute: they stall their parts only."""
        now = self._clock()
        if leaderless and not self.leaderless:
            self._leaderless_since, self._leaderless_reminded = datetime.now(UTC), None
        elif self.leaderless and not leaderless:
            logger.info(
                "every partition this relay writes has a leader again",
                extra=log_extra("kafka_partitions_led"),
            )
        self.leaderless = leaderless
        if leaderless and (
            self._leaderless_reminded is None or now - self._leaderless_reminded >= _REMIND_EVERY_S
        ):
            self._leaderless_reminded = now
            logger.warning(
                "%s; the parts writing to them wait for a new leader (the relay keeps its parts)",
                self.describe(),
                extra=log_extra("kafka_partitions_leaderless", partitions=list(leaderless)),
            )

    def _answered_ok(self) -> None:
        if self.reachable is False:
            logger.info(
                "Kafka at %s answers again",
                self._servers,
                extra=log_extra("kafka_reachable", bootstrap_servers=self._servers),
            )
        self._answered_at, self._answered_at_wall = self._clock(), datetime.now(UTC)
        self.reachable, self.error = True, None

    def _failed(self, error: str) -> None:
        now = self._clock()
        self.reachable, self.error = False, error
        if self._reminded is None or now - self._reminded >= _REMIND_EVERY_S:
            self._reminded = now
            logger.error(
                "%s; this relay takes no parts until it answers",
                self.describe(),
                extra=log_extra("kafka_unreachable", bootstrap_servers=self._servers, error=error),
            )
