"""What every job's command line shares: its common options, logging, a failure shown
as one line (the trace with ``--debug``), a quiet Ctrl-C, and an alarm when most of
the records of a batch cannot be decoded."""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pyspark.sql.streaming.listener import StreamingQueryListener

from relay.core.log_fields import log_extra
from relay.errors import ConfigError
from spark_jobs.kafka_clients import KafkaClients
from spark_jobs.preflight import offsets_limit
from spark_jobs.registry_schemas import RegistryAccess
from spark_jobs.run_summary import RunSummary
from spark_jobs.spark_session import MAX_OFFSETS_PER_TRIGGER, local_spark_session, submitted

logger = logging.getLogger(__name__)

EXIT_FAILED = 1
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report it
_KAFKA_SETTINGS_HELP = (
    "the relay's config file (TOML), for its kafka table: the Kafka client settings "
    "(TLS, SASL) the jobs use too. Without it: RELAY_KAFKA (a JSON object), "
    "RELAY_KAFKA__<PROPERTY> or RELAY_KAFKA_FILE, as the relay reads them"
)


def add_common_options(parser: argparse.ArgumentParser) -> None:
    """Options every job has: where Kafka is and how to reach it, and ``--debug``."""
    parser.add_argument("--bootstrap-servers", required=True)
    parser.add_argument("--config", type=Path, help=_KAFKA_SETTINGS_HELP)
    parser.add_argument(
        "--debug", action="store_true", help="Spark's log, and a failure's whole trace."
    )


def add_batch_limit_option(parser: argparse.ArgumentParser) -> None:
    """``--max-offsets-per-trigger``; not given, it is None, and
    :func:`max_offsets_per_trigger` makes that the default limit."""
    parser.add_argument(
        "--max-offsets-per-trigger",
        type=offsets_limit,
        default=None,
        metavar="N",
        help=f"The records a micro-batch reads at most (default {MAX_OFFSETS_PER_TRIGGER:,}; "
        "0 or none: no limit), so a backlog is read in batches of that size.",
    )


def max_offsets_per_trigger(args: argparse.Namespace) -> int | None:
    """The batch limit of the command line: the default when not given, None for none."""
    given: int | None = args.max_offsets_per_trigger
    if given is None:
        return MAX_OFFSETS_PER_TRIGGER
    return given or None


def kafka_clients(parser: argparse.ArgumentParser, args: argparse.Namespace) -> KafkaClients:
    """The jobs' Kafka clients from the options and the relay's settings; bad settings
    are a usage error (exit 2) naming the key. Logs them, secrets masked."""
    configure_logging(args.debug)  # the first thing a job logs: set up before run()
    try:
        clients = KafkaClients.from_relay_settings(args.bootstrap_servers, args.config)
        clients.spark_options()  # refuses what a Java client cannot take, before Spark starts
    except ConfigError as exc:
        parser.error(str(exc))
    logger.info(
        "Kafka clients: %s", clients.described(), extra=log_extra("spark_job_kafka_clients")
    )
    return clients


def registry_access(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> RegistryAccess | None:
    """The schema registry of the relay's settings (``RELAY_SCHEMA_REGISTRY_*`` or the
    config file), for the ``avro-registry`` format; required when ``--format`` names it.
    Logged with its credentials masked."""
    configure_logging(args.debug)
    try:
        access = RegistryAccess.from_relay_settings(args.config)
    except ConfigError as exc:
        parser.error(str(exc))
    if access is None and args.value_format == "avro-registry":
        parser.error(
            "--format avro-registry needs the schema registry: schema_registry_url "
            "(RELAY_SCHEMA_REGISTRY_URL, or the config file), as the relay has it"
        )
    if access is not None:
        logger.info(
            "schema registry: %s", access.described(), extra=log_extra("spark_job_registry")
        )
    return access


class _CtrlC:
    """SIGINT while a streaming query runs asks :func:`await_query` to stop it; anywhere
    else (the session starting, a batch backfill), or a second time, it exits at once.
    Never a KeyboardInterrupt: raised inside a py4j call, it leaves the gateway
    mid-command, and what runs next (query.stop, exit handlers) logs tracebacks."""

    def __init__(self) -> None:
        self.waiting = False
        self.pressed = threading.Event()

    def __call__(self, signum: int, frame: Any) -> None:
        if self.pressed.is_set() or not self.waiting:
            os._exit(EXIT_INTERRUPTED)  # nothing to stop cleanly: Spark recovers from this
        self.pressed.set()


_ctrl_c = _CtrlC()


def await_query(query: Any, summary: RunSummary | None = None) -> None:
    """Wait for a streaming query to end (re-raising its failure), telling ``summary``
    of its batches as they go; Ctrl-C stops it and raises KeyboardInterrupt (the
    checkpoint replays a batch it interrupted)."""
    _ctrl_c.waiting = True
    try:
        while not query.awaitTermination(1):
            if summary is not None:
                summary.progressed(query.recentProgress)
            if _ctrl_c.pressed.is_set():
                query.stop()
                raise KeyboardInterrupt
    finally:
        _ctrl_c.waiting = False
        if summary is not None:
            summary.progressed(query.recentProgress)


def run(
    name: str, debug: bool, body: Callable[[], None], summary: RunSummary | None = None
) -> None:
    """Run a job's ``body``; returns when it ends, with the ``summary`` of its run on
    stdout (after Ctrl-C too). Ctrl-C exits 130, quietly; a failure exits 1, shown as
    one line on stderr: its root cause, not 150 lines of py4j trace (that one is logged
    at DEBUG, which ``--debug`` shows)."""
    configure_logging(debug)
    previous = signal.signal(signal.SIGINT, _ctrl_c)
    try:
        body()
    except KeyboardInterrupt:
        _say_summary(summary)
        sys.exit(EXIT_INTERRUPTED)
    except Exception as exc:
        logger.debug(
            "%s failed", name, exc_info=True, extra=log_extra("spark_job_failed", job=name)
        )
        hint = "" if debug else " (--debug shows the trace)"
        sys.stderr.write(f"{name}: {failure_reason(exc)}{hint}\n")
        sys.exit(EXIT_FAILED)
    finally:
        signal.signal(signal.SIGINT, previous)
    _say_summary(summary)


def _say_summary(summary: RunSummary | None) -> None:
    if summary is not None:
        sys.stdout.write(summary.line() + "\n")
        sys.stdout.flush()


def job_session(name: str, debug: bool, *, delta: bool = False) -> Any:
    """The job's Spark session (with Delta Lake if ``delta``), and the
    :class:`DecodingAlarm` listening to its queries.
    Embedded, Spark's own log is quiet unless ``--debug``; under ``spark-submit`` it is
    the cluster's, at the level its log4j2 configuration sets."""
    spark = local_spark_session(name, delta=delta)
    # pyspark's SparkContext installs a SIGINT handler of its own (cancel the jobs, raise
    # KeyboardInterrupt inside whatever py4j call runs): ours again, see _CtrlC.
    signal.signal(signal.SIGINT, _ctrl_c)
    if not submitted():
        quiet_spark(spark, debug)
    spark.streams.addListener(DecodingAlarm(name))
    return spark


def configure_logging(debug: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if debug else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not debug:  # py4j logs every call, and a failing foreachBatch's whole trace
        logging.getLogger("py4j").setLevel(logging.CRITICAL)


def quiet_spark(spark: Any, debug: bool) -> None:
    """Spark logs a failing query's whole trace (and each task's) itself, before the
    job can say what went wrong in one line; those stay for ``--debug``."""
    spark.sparkContext.setLogLevel("WARN" if debug else "OFF")


# "org.apache.kafka.common.errors.TopicAuthorizationException: Not authorized ...": a JVM
# cause's first line.
_CAUSE = re.compile(r"^(?:[\w$]+\.)*([A-Z][\w$]*(?:Error|Exception|Failure)): (.+)$")
_WRAPPERS = frozenset(
    {
        "Py4JJavaError",
        "PythonException",
        "SparkException",
        "StreamingQueryException",
        "ExecutionException",
        "UncheckedExecutionException",
        "RuntimeException",
    }
)
_TRACEBACK = "Traceback (most recent call last):"
# A Python traceback's last line: "psycopg.errors.NotNullViolation: null value in ...".
_RAISED = re.compile(r"^(?:[A-Za-z_]\w*\.)*([A-Za-z_]\w*)(?:: (.*))?$")


def failure_reason(exc: BaseException) -> str:
    """The root cause of a job failure, on one line. py4j and Spark wrap a cause in
    layers (the query failed, because a task failed, because of a Python exception in
    foreachBatch...), each repeating the message in a longer trace; a Python exception
    names its own cause. The innermost is the one that says what to fix."""
    if isinstance(exc, ConfigError):  # says what to fix, by key: no type, one line
        return " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    root = _innermost(exc)
    text = str(root)
    found = _python_raised(text) or _jvm_cause(text)
    if found:
        return found
    first = text.strip().splitlines()[0] if text.strip() else ""
    if _jvm_causes(text):
        return first  # "[STREAM_FAILED] Query ... terminated with exception: ..."
    return f"{type(root).__name__}: {first}" if first else type(root).__name__


def _innermost(exc: BaseException) -> BaseException:
    while True:
        inner = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
        if inner is None:
            return exc
        exc = inner


def _python_raised(text: str) -> str | None:
    """The exception a Python traceback in ``text`` (a foreachBatch's, a UDF's) starts
    from: Python prints a chain's root cause first."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if _TRACEBACK in line), None)
    if start is None:
        return None
    for line in lines[start + 1 :]:
        if not line.strip() or line[0].isspace():
            continue  # the frames, their code, the carets
        raised = _RAISED.match(line.strip())
        if raised is None:
            return None
        kind, message = raised.groups()
        return f"{kind}: {message.strip()}" if message else kind
    return None


def _jvm_causes(text: str) -> list[tuple[str, str]]:
    return [
        (m.group(1), m.group(2).strip())
        for line in text.splitlines()
        if (m := _CAUSE.match(line.strip().removeprefix("Caused by: ")))
    ]


def _jvm_cause(text: str) -> str | None:
    """The innermost JVM cause that is not a wrapper (the last ``Caused by``)."""
    inner = [c for c in _jvm_causes(text) if c[0] not in _WRAPPERS]
    return f"{inner[-1][0]}: {inner[-1][1]}" if inner else None


class DecodingAlarm(StreamingQueryListener):
    """Logs an ERROR when most of a query's records so far cannot be decoded, once per
    query, at its first batch with records: a job reading the wrong format would
    otherwise run on, archiving nulls or counting nothing, without a word. Reads the
    metrics :func:`spark_jobs.decoding.observe_decoding` records."""

    def __init__(self, job: str) -> None:
        self.job = job
        self._checked: set[str] = set()

    def onQueryStarted(self, event: Any) -> None:
        pass

    def onQueryIdle(self, event: Any) -> None:
        pass

    def onQueryTerminated(self, event: Any) -> None:
        pass

    def onQueryProgress(self, event: Any) -> None:
        progress = event.progress
        metrics: Mapping[str, Any] = progress.observedMetrics
        seen = metrics.get("decoding")
        if seen is None or str(progress.id) in self._checked or not seen["records"]:
            return
        self._checked.add(str(progress.id))
        report_decoding(self.job, seen["records"], seen["undecodable"] or 0, seen["first_error"])


def report_decoding(job: str, records: int, undecodable: int, first_error: str | None) -> None:
    """One line with the counts: an ERROR when most records are undecodable."""
    if undecodable * 2 > records:
        logger.error(
            "%s: %s of the first %s records cannot be decoded (%s). Is the job reading the "
            "format the relay publishes? They are kept, not lost",
            job,
            undecodable,
            records,
            first_error,
            extra=log_extra("spark_job_undecodable", job=job, records=records, bad=undecodable),
        )
    elif undecodable:
        logger.warning(
            "%s: %s of the first %s records cannot be decoded (%s)",
            job,
            undecodable,
            records,
            first_error,
            extra=log_extra("spark_job_undecodable", job=job, records=records, bad=undecodable),
        )
