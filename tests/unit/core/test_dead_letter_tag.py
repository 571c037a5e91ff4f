"""The Kafka-side checkpoint's dead letters, named compactly (relay/core/dead_letter_tag.py,
issue #47): what a tag can name within the broker's offset.metadata.max.bytes, and that
it reads back exactly, or refuses to."""

from __future__ import annotations

import base64
import json
import random
import zlib

import pytest

from relay.core import dead_letter_tag
from relay.core.model import Position

DLQ = "outbox.dead-letter.orders"


def size(letters: list[tuple[Position, str]]) -> int:
    return len(json.dumps(dead_letter_tag.fields(letters), separators=(",", ":")))


def spread(count: int, parts: int, seed: int = 7) -> list[tuple[Position, str]]:
    """The keys one part of ``parts`` gets from one INSERT of many rows: one transaction,
    positions a random few apart."""
    rng = random.Random(seed)
    position, keys = 1_000_000, []
    for _ in range(count):
        position += rng.randint(1, 2 * parts - 1)
        keys.append((Position(5_000_000, position), DLQ))
    return keys


def test_a_batch_of_poison_rows_is_named_in_one_tag() -> None:
    """A batch_size (5,000) of poison rows of one INSERT: one part, or one of four, fits
    one tag; by message id, 32 did."""
    for parts in (1, 4):
        letters = spread(5000, parts)
        assert dead_letter_tag.fitting(letters) == 5000
        assert size(letters) <= dead_letter_tag.MAX_TAG_BYTES
        assert dead_letter_tag.read(dead_letter_tag.fields(letters)) == tuple(letters)


def test_what_does_not_fit_is_cut_to_the_longest_prefix_that_does() -> None:
    rng = random.Random(3)
    letters = [(Position(rng.randrange(2**40), rng.randrange(2**40)), DLQ) for _ in range(3000)]
    fit = dead_letter_tag.fitting(letters)
    assert 100 < fit < 3000
    assert size(letters[:fit]) <= dead_letter_tag.MAX_TAG_BYTES < size(letters[: fit + 1])
    assert dead_letter_tag.read(dead_letter_tag.fields(letters[:fit])) == tuple(letters[:fit])


def test_keys_read_back_exactly_in_any_order_and_per_topic() -> None:
    letters = [
        (Position(9, 1), "a"),
        (Position(9, 2), "b"),
        (Position(3, 7), "a"),  # keys need not ascend
        (Position(2**62, 0), "a"),
        (Position(0, 0), "b"),
    ]
    named = dead_letter_tag.read(dead_letter_tag.fields(letters))
    assert sorted(named) == sorted(letters)
    assert [key for key, topic in named if topic == "a"] == [
        key for key, topic in letters if topic == "a"
    ]
    assert dead_letter_tag.fields([]) == {} and dead_letter_tag.read({}) == ()


@pytest.mark.parametrize(
    "tag",
    [
        {"dead_letter_topics": ["a"], "dead_letter_keys": []},
        {"dead_letter_topics": ["a"], "dead_letter_keys": ["not base64!"]},
        {"dead_letter_topics": ["a"], "dead_letter_keys": [base64.b64encode(b"xx").decode()]},
        {"dead_letter_topics": ["a"], "dead_letter_keys": [7]},
        {"dead_letter_topics": "a", "dead_letter_keys": ["eJwDAAAAAAE="]},
        # a number cut short, and 64 MiB of zeros (past what a tag may inflate to)
        {"dead_letter_topics": ["a"],
         "dead_letter_keys": [base64.b64encode(zlib.compress(b"\x81")).decode()]},
        {"dead_letter_topics": ["a"],
         "dead_letter_keys": [base64.b64encode(zlib.compress(bytes(64 * 2**20))).decode()]},
    ],
)  # fmt: skip
def test_a_tag_that_cannot_be_read_is_refused_not_misread(tag: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        dead_letter_tag.read(tag)


def test_a_tag_an_older_relay_wrote_names_no_keys() -> None:
    older = {
        "dead_letter_topics": ["a"],
        "dead_letters": [["6f1d8a7e-0000-4000-8000-000000000000", 0]],
    }
    assert dead_letter_tag.read(older) == ()
