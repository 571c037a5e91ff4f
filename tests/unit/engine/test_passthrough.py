"""A json subscriber whose routing reads nothing of the payload publishes the payload's
JSON text as Postgres returns it, unloaded (issue #53); the rows today's path would
change or refuse are loaded still, so what was poison stays poison (no servers)."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest

from relay.adapters.postgres.fetch_plan import raw_payloads
from relay.core.formats import json_text
from relay.core.model import OutboxEvent, Unreadable
from relay.core.ports import DeadLetterDecision
from relay.core.subscribers import Subscriber, ValueFormat
from relay.engine.encoding import RecordEncoder
from relay.engine.poison import dead_letter_record
from relay.errors import EncodingError

PASSED = Subscriber("s", topic="t", value_format=ValueFormat.JSON)
# jsonb's text output: a space after each colon and comma, numbers as numeric writes them.
TEXT = b'{"n": 1.50, "f": 0.0000001, "s": "caf\xc3\xa9", "l": [1, 2]}'


def event(payload: Any) -> OutboxEvent:
    return OutboxEvent(
        1, 1, uuid.uuid4(), "order", "k", None, "OrderPlaced", payload, {}, datetime.now(UTC)
    )


def deep(levels: int) -> bytes:
    return b"[" * levels + b"]" * levels


@pytest.mark.parametrize(
    ("subscriber", "passes"),
    [
        (PASSED, True),
        (Subscriber("s", topic="{aggregate_type}.{event_type}", value_format="json"), True),
        (Subscriber("s", aggregate_types=frozenset({"order"}), value_format="json"), True),
        (Subscriber("s", key="{payload.tenant}", value_format="json"), False),
        (Subscriber("s", partition_by="payload.p", partition_count=3, value_format="json"), False),
        (Subscriber("s", placements=("payload.t:header",), value_format="json"), False),
        (Subscriber("s", placements=("occurred_at:envelope",), value_format="json"), False),
        (Subscriber("s", value_format="avro"), False),
        (Subscriber("s", value_format="debezium"), False),
    ],
)
def test_only_json_with_routing_that_reads_no_payload_field_passes_through(
    subscriber: Subscriber, passes: bool
) -> None:
    assert subscriber.publishing.raw_payloads is passes
    assert (subscriber.publishing is json_text.FORMAT) is passes


def test_a_passed_through_value_is_the_fetched_text_byte_for_byte() -> None:
    """Spacing, exact numbers and raw UTF-8 as Postgres wrote them: no reload, no rewrite."""
    [payload] = raw_payloads([TEXT])
    assert payload is TEXT
    record = RecordEncoder(None).encode(event(payload), PASSED)
    assert record.value is TEXT
    assert record.size == record._replace(size=-1).byte_size()
    # The compact path, for a subscriber whose key reads the payload: the same JSON value.
    routed = Subscriber("s", topic="t", key="{payload.s}", value_format="json")
    compact = RecordEncoder(None).encode(event(json.loads(TEXT)), routed).value
    assert compact == b'{"n":1.5,"f":1e-7,"s":"caf\xc3\xa9","l":[1,2]}'
    assert json.loads(TEXT) == json.loads(compact or b"")


def test_a_batch_of_plain_rows_is_left_as_it_came() -> None:
    texts: list[bytes | None] = [b'{"a": %d}' % n for n in range(100)]
    assert raw_payloads(texts) is texts


def test_long_numbers_pass_through_exactly_where_they_went_through_a_double() -> None:
    """Up to 303 digits a number is passed through as Postgres wrote it: an integer beyond
    64 bits as exact as before, a fraction now exact where a double cut it short."""
    texts: list[bytes | None] = [
        b'{"i": 12345678901234567890123}',
        b'{"f": 0.1000000000000000000001}',
        b'{"i": 1' + b"0" * 302 + b"}",
    ]
    got = raw_payloads(texts)
    assert all(a is b for a, b in zip(got, texts, strict=True))
    before = RecordEncoder(None).encode(event(json.loads(texts[1] or b"")), PASSED).value
    assert before == b'{"f":0.1}'


@pytest.mark.parametrize("at", range(16))
def test_a_number_of_304_digits_is_found_wherever_it_lies_in_the_batch(at: int) -> None:
    """The batch is looked at every 16th byte: a run of 304 digits shows whatever its
    offset."""
    huge = b'{"n": 1' + b"0" * 303 + b"}"
    got = raw_payloads([b"x" * at, huge])
    assert got[0] == b"x" * at and got[1] == {"n": 10**303}


def test_rows_python_may_not_load_or_write_are_loaded_as_before() -> None:
    """A number of 304 digits or more, nesting beyond orjson's 255 levels, a row not read:
    the row goes today's way (exact integers written compact, poison for what Python
    cannot load), its neighbours stay bytes."""
    long_int = b'{"n": 1' + b"0" * 400 + b"}"
    beyond_double = b'{"n": 1' + b"0" * 400 + b".5}"
    too_many_digits = b'{"n": 1' + b"0" * 5000 + b"}"
    plain, padded = b'{"a": 1}', b'{"pad": "' + b"x" * 600 + b'"}'
    got = raw_payloads([plain, long_int, beyond_double, too_many_digits, None, padded])
    assert got[0] is plain and got[5] is padded and got[4] is None
    assert got[1] == {"n": 10**400}
    assert RecordEncoder(None).encode(event(got[1]), PASSED).value == b'{"n":1' + b"0" * 400 + b"}"
    assert isinstance(got[2], Unreadable) and "beyond a double" in str(got[2])
    assert isinstance(got[3], Unreadable) and "digits" in str(got[3])
    for poison in got[2:4]:
        with pytest.raises(EncodingError):
            RecordEncoder(None).encode(event(poison), PASSED)


@pytest.mark.parametrize("levels", [300, 1020, 5000])
def test_nesting_beyond_orjsons_levels_is_loaded_so_what_python_refuses_stays_poison(
    levels: int,
) -> None:
    text = deep(levels)
    [alone] = raw_payloads([text])
    [among] = raw_payloads([b"[1]", text])[1:]
    for loaded in (alone, among):
        assert type(loaded) is not bytes
        try:
            value = RecordEncoder(None).encode(event(loaded), PASSED).value
        except EncodingError as exc:
            assert "Recursion" in str(exc) or "RecursionError" in str(loaded)
        else:
            assert value == text  # 300 levels: loaded, and written compact as before


def test_a_dead_letter_carries_a_passed_through_payload_as_it_is() -> None:
    letter = dead_letter_record(event(TEXT), PASSED, DeadLetterDecision("dlq", "refused"))
    document = json.loads(letter.value or b"")
    assert document["payload"] == json.loads(TEXT)
    assert TEXT in (letter.value or b"")
