"""Issue #28, item 3: the relay's own configuration is never a row's fault. An Avro
subscriber on a relay without writer schemas used to dead-letter every valid event
while showing `active`; now its part halts with a configuration error naming the key
and the subscriber, whatever its poison policy."""

from __future__ import annotations

from relay.adapters.memory import InMemoryPublisher
from relay.core.subscribers import PoisonPolicy, Subscriber, ValueFormat
from tests.unit.engine.test_worker_logic import claimed, event, run_until_halted, worker


def test_avro_without_schemas_halts_the_part_and_dead_letters_nothing() -> None:
    subscriber = Subscriber(
        "s", topic="t", value_format=ValueFormat.AVRO, on_poison=PoisonPolicy.DEAD_LETTER
    )
    store = claimed(subscriber)
    store.append(event(1))
    kafka = InMemoryPublisher()
    w = run_until_halted(worker(store, kafka), store)  # the encoder has no schemas
    halted = store.get_part("s", 0).halted_error
    assert halted is not None and halted.startswith("configuration error")
    assert "schemas_dir" in halted and "'s'" in halted
    assert kafka.published() == []
    assert (w.stats.poisoned, w.stats.dead_lettered) == (0, 0)
