"""Which Kafka-side checkpoint recovery may adopt after the database moved (pure logic;
tests/acceptance/test_restore.py runs the moves on real clusters)."""

from __future__ import annotations

import uuid

from relay.core.key_space import KeySpace, adoptable
from relay.core.model import KafkaCheckpoint, Position

SPACE, OLD = uuid.uuid4(), uuid.uuid4()
HERE, GONE = uuid.uuid4(), uuid.uuid4()
KEYS = {HERE: Position(90, 3)}


def judge(kafka: KafkaCheckpoint, space: KeySpace) -> Position | None:
    def translate(from_space: uuid.UUID, key: Position) -> Position:
        assert from_space == OLD
        return Position(1, key.position * 10)

    return adoptable(kafka, space, KEYS.get, translate)[0]


def test_adopted_when_its_last_event_is_in_this_database() -> None:
    assert judge(KafkaCheckpoint(Position(100, 7), SPACE, HERE), KeySpace(SPACE, None, None)) == (
        Position(100, 7)
    )


def test_refused_when_its_last_event_is_missing_and_nothing_moved() -> None:
    assert (
        judge(KafkaCheckpoint(Position(100, 7), SPACE, GONE), KeySpace(SPACE, None, None)) is None
    )


def test_refused_when_the_event_sorts_after_the_checkpoint() -> None:
    """Same message id, another key: not the history the checkpoint was written in."""
    assert judge(KafkaCheckpoint(Position(80, 1), SPACE, HERE), KeySpace(SPACE, None, None)) is None


def test_an_older_restore_on_a_higher_cluster_adopts_up_to_the_move() -> None:
    """Rows written since the move sort above moved_high: never covered by the adoption."""
    adopted = judge(KafkaCheckpoint(Position(100, 7), SPACE, GONE), KeySpace(SPACE, None, 95))
    assert adopted == Position(95, 2**63 - 1)
    assert judge(KafkaCheckpoint(Position(50, 7), SPACE, GONE), KeySpace(SPACE, None, 95)) == (
        Position(50, 7)
    )


def test_a_checkpoint_of_the_previous_key_space_is_translated() -> None:
    assert judge(KafkaCheckpoint(Position(100, 7), OLD, GONE), KeySpace(SPACE, OLD, None)) == (
        Position(1, 70)
    )


def test_a_checkpoint_of_an_unknown_key_space_is_refused() -> None:
    other = uuid.uuid4()
    assert judge(KafkaCheckpoint(Position(100, 7), other, HERE), KeySpace(SPACE, OLD, None)) is None


def test_an_untagged_checkpoint_from_an_older_relay() -> None:
    untagged = KafkaCheckpoint(Position(100, 7))
    assert judge(untagged, KeySpace(SPACE, None, None)) == Position(100, 7)
    assert judge(untagged, KeySpace(SPACE, OLD, None)) == Position(1, 70)
