"""The jobs' Python decoder, run as Spark's Python workers run it (a batch of Arrow
arrays in, a struct array out), with no Spark session."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark")
pa = pytest.importorskip("pyarrow")

from relay.core.schemas import SchemaFolder  # noqa: E402
from spark_jobs import decoding  # noqa: E402

SCHEMAS = Path(__file__).resolve().parents[3] / "schemas"


def test_a_batch_costs_python_work_only_for_the_rows_from_avro_did_not_decode(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Spark sends every row of a batch to the Python decoder, the ones from_avro decoded
    as skipped nulls: those must not cost a Python call each (they were most of the
    read + decode time, issue #31). The others decode, or are error rows, as before."""
    good = SchemaFolder.from_dir(SCHEMAS).encode(
        "OrderPlaced", {"order_id": "o-1", "customer_id": "c", "amount_cents": 5}
    )
    skipped = 10_000
    values = pa.array([None] * skipped + [good, b"\xc3\x01unknown!", None], pa.binary())
    skip = pa.array([True] * skipped + [False] * 3)
    calls: list[Any] = []
    one = decoding._payload

    def counted(value: bytes | None, *args: Any) -> Any:
        calls.append(value)
        return one(value, *args)

    monkeypatch.setattr(decoding, "_payload", counted)
    udf = decoding._python_decoder("avro", str(SCHEMAS), None, None)
    result = udf.func(values, skip).to_pylist()

    assert calls == [good, b"\xc3\x01unknown!", None]
    assert len(result) == skipped + 3
    assert all(r == {"payload": None, "error": None} for r in result[:skipped])
    decoded, unknown, tombstone = result[skipped:]
    assert decoded["error"] is None and '"order_id":"o-1"' in decoded["payload"]
    assert unknown["payload"] is None and "fingerprint" in unknown["error"]
    assert tombstone["payload"] is None and "no value" in tombstone["error"]


def test_a_batch_from_avro_decoded_entirely_makes_no_python_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refuse(*args: Any) -> None:
        raise AssertionError("a record from_avro decoded reached the Python decoder")

    monkeypatch.setattr(decoding, "_payload", refuse)
    udf = decoding._python_decoder("avro", str(SCHEMAS), None, None)
    result = udf.func(pa.array([None] * 5, pa.binary()), pa.array([True] * 5))
    assert len(result) == 5 and result.type.names == ["payload", "error"]
