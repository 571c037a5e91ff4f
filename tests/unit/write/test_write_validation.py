"""Issue #28: the write API names every problem of an event at once, and refuses a
payload JSON cannot hold with PayloadValidationError (it raised a bare TypeError).
Both are refused before the database is asked, so no connection is needed here."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from relay import Outbox, PayloadValidationError
from relay.core.schemas import SchemaFolder

SCHEMAS = Path(__file__).resolve().parents[3] / "schemas"


def _append(outbox: Outbox, **fields: Any) -> None:
    outbox.append(
        None,  # type: ignore[arg-type]  # refused before any statement
        **{"aggregate_type": "order", "aggregate_id": "1", "event_type": "OrderPlaced", **fields},
    )


def test_every_problem_of_a_payload_is_listed() -> None:
    outbox = Outbox(SchemaFolder.from_dir(SCHEMAS))
    with pytest.raises(PayloadValidationError) as caught:
        _append(outbox, payload={"order_id": 1, "amount_cents": "12"})
    problems = caught.value.problems
    assert len(problems) == 3, problems
    assert [any(f in p for p in problems) for f in ("order_id", "customer_id", "amount_cents")] == [
        True,
        True,
        True,
    ]


def test_argument_and_payload_problems_are_listed_together() -> None:
    outbox = Outbox(SchemaFolder.from_dir(SCHEMAS))
    with pytest.raises(PayloadValidationError) as caught:
        _append(outbox, aggregate_id="", payload={"order_id": "1", "customer_id": "c"})
    assert "aggregate_id must be a non-empty string" in caught.value.problems
    assert any("amount_cents" in p for p in caught.value.problems)


@pytest.mark.parametrize(
    "payload",
    [{"at": datetime.now(UTC)}, {"tags": {"a", "b"}}, {"ratio": float("nan")}],
    ids=["datetime", "set", "nan"],
)
def test_a_payload_json_cannot_hold_is_a_validation_error(payload: dict[str, Any]) -> None:
    with pytest.raises(PayloadValidationError, match="cannot be written as JSON"):
        _append(Outbox(None), payload=payload)
