"""Issue #51: every job reads a backlog in bounded micro-batches, by default
``maxOffsetsPerTrigger`` 100,000, which ``--max-offsets-per-trigger`` changes (0 or
``none``: no limit); a backfill, one batch read, refuses it."""

from __future__ import annotations

import argparse
from pathlib import Path
from types import SimpleNamespace

import pytest

from spark_jobs import archive
from spark_jobs.job import max_offsets_per_trigger
from spark_jobs.sink_job_args import sink_job_options, sink_job_parser
from spark_jobs.spark_session import MAX_OFFSETS_PER_TRIGGER, kafka_stream


class _KafkaReader:
    """``spark.readStream`` as :func:`kafka_stream` uses it: keeps what it is given."""

    def __init__(self) -> None:
        self.given: dict[str, str] = {}

    def format(self, name: str) -> _KafkaReader:
        self.given["format"] = name
        return self

    def option(self, key: str, value: str) -> _KafkaReader:
        self.given[key] = value
        return self

    def options(self, **options: str) -> _KafkaReader:
        self.given.update(options)
        return self

    def load(self) -> dict[str, str]:
        return self.given


def _source_options(limit: int | None) -> dict[str, str]:
    spark = SimpleNamespace(readStream=_KafkaReader())
    return kafka_stream(spark, {"subscribe": "t"}, limit)  # type: ignore[return-value]


def test_the_kafka_source_gets_the_limit_and_none_without_one() -> None:
    assert _source_options(60) == {
        "format": "kafka",
        "subscribe": "t",
        "maxOffsetsPerTrigger": "60",
        "startingOffsets": "earliest",
    }
    assert "maxOffsetsPerTrigger" not in _source_options(None)


def _sink_job_limit(tmp_path: Path, *given: str) -> int | None:
    parser = sink_job_parser("a sink job")
    argv = ["--bootstrap-servers", "k:9092", "--checkpoint", str(tmp_path / "ckpt"),
            "--database-url", "postgresql://spark@db/app", *given]  # fmt: skip
    return sink_job_options(parser, parser.parse_args(argv))["max_offsets_per_trigger"]


@pytest.fixture
def no_relay_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RELAY_KAFKA", "RELAY_KAFKA_FILE", "RELAY_DATABASE_URL_FILE"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.usefixtures("no_relay_settings")
@pytest.mark.parametrize(
    ("given", "limit"),
    [((), MAX_OFFSETS_PER_TRIGGER), (("--max-offsets-per-trigger", "40"), 40),
     (("--max-offsets-per-trigger", "0"), None), (("--max-offsets-per-trigger", "none"), None)],
)  # fmt: skip
def test_sink_jobs_limit_their_batches_by_default(
    tmp_path: Path, given: tuple[str, ...], limit: int | None
) -> None:
    assert MAX_OFFSETS_PER_TRIGGER == 100_000
    assert _sink_job_limit(tmp_path, *given) == limit


@pytest.mark.usefixtures("no_relay_settings")
def test_a_negative_limit_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exited:
        _sink_job_limit(tmp_path, "--max-offsets-per-trigger", "-1")
    assert exited.value.code == 2


def _archive_args(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> argparse.Namespace:
    """The archive's arguments as its ``main`` parses and checks them (Spark not started)."""
    parsed: list[argparse.Namespace] = []
    monkeypatch.setattr(archive, "run", lambda *args, **kwargs: None)
    original = archive.check_locations

    def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
        original(parser, args)
        parsed.append(args)

    monkeypatch.setattr(archive, "check_locations", check)
    archive.main(["--bootstrap-servers", "k:9092", "--format", "json", *argv])
    return parsed[0]


@pytest.mark.usefixtures("no_relay_settings")
def test_the_archive_takes_the_limit_and_its_backfill_refuses_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    streaming = ["--path", str(tmp_path / "a"), "--checkpoint", str(tmp_path / "c")]
    assert max_offsets_per_trigger(_archive_args(streaming, monkeypatch)) == 100_000
    limited = [*streaming, "--max-offsets-per-trigger", "500"]
    assert max_offsets_per_trigger(_archive_args(limited, monkeypatch)) == 500
    backfill = ["--path", str(tmp_path / "b"), "--backfill"]
    assert _archive_args(backfill, monkeypatch).backfill  # no limit given: none refused
    with pytest.raises(SystemExit) as exited:
        _archive_args([*backfill, "--max-offsets-per-trigger", "500"], monkeypatch)
    assert exited.value.code == 2
    assert "a backfill reads its offset range in one batch" in capsys.readouterr().err
