"""Issue #47, low: what writers put in rows reached the operator's terminal raw through
`dead-letters list` and `status` (rich passes ESC), so a row could clear the screen,
write the operator's clipboard (OSC 52) or hide a link (OSC 8). Every command that shows
writer data must print its control characters escaped, and rich markup in it literally.
Real Postgres and Apache Kafka; the writer is hostile, the CLI runs as the relay role."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from relay.adapters.postgres.store import OutboxStore
from relay.daemon import Relay
from tests.support import run_cli, sub, wait_caught_up, wait_until

# Each of these, printed raw, makes a terminal do something.
CLIPBOARD = "\x1b]52;c;aGFja2Vk\x07"  # OSC 52: write the clipboard
CLEAR = "\x1b[2J\x1b[H"  # clear the screen, cursor home
LINK = "\x1b]8;;https://evil.example/\x1b\\click here\x1b]8;;\x1b\\"  # OSC 8: a hidden link
OVERWRITE = "\rok\x08\x08"  # carriage return and backspaces: print over the line
C1 = "\x9b31m\u202e"  # an 8-bit CSI, a right-to-left override
MARKUP = "[red]red[/red][link=https://evil.example/]link[/link]"
HOSTILE = CLIPBOARD + CLEAR + LINK + "\x07" + OVERWRITE + C1 + MARKUP

# Any C0 or C1 control character or DEL but the line breaks the output is made of, and
# the bidirectional and other format characters (Unicode category Cf) that matter here.
_RAW = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")

StartRelay = Callable[..., Relay]


def raw_controls(text: str) -> list[str]:
    return sorted({repr(c) for c in _RAW.findall(text)})


def test_writer_data_reaches_the_terminal_escaped(
    db: psycopg.Connection[Any],
    writer_db: psycopg.Connection[Any],
    relay_url: str,
    kafka_bootstrap: str,
    topic_prefix: str,
    start_relay: StartRelay,
) -> None:
    # The hostile writer's row: its aggregate type routes to an illegal topic (poison),
    # every column it chooses carries the escapes.
    writer_db.execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)"
        " VALUES (%s, %s, %s, %s)",
        ("evil" + HOSTILE, "id" + HOSTILE, "Ev" + HOSTILE, Jsonb({"note": HOSTILE})),
    )
    subscribers = [
        sub("dl", topic_prefix, value_format="json", on_poison="dead-letter",
            dead_letter_topic=topic_prefix + "dead"),
        sub("halts", topic_prefix + "h.", value_format="json"),
    ]  # fmt: skip
    relay = start_relay(subscribers=subscribers)
    wait_caught_up(db, "dl", timeout=60)
    store = OutboxStore(db)
    wait_until(lambda: store.get_part("halts", 0).halted_error is not None, timeout=60)
    relay.stop()
    # Error texts quote what others sent (a registry's answer, issue #47, medium 7): the
    # owner stands in for one, in the texts `status` and `dead-letters list` show.
    db.execute("UPDATE outbox_checkpoints SET halted_error = halted_error || %s", (HOSTILE,))
    db.execute("UPDATE outbox_dead_letters SET error = error || %s", (HOSTILE,))

    env = {"RELAY_DATABASE_URL": relay_url, "RELAY_BOOTSTRAP_SERVERS": kafka_bootstrap}
    commands = [
        ("dead-letters", "list", "dl"),
        ("dead-letters", "list", "dl", "--json"),
        ("dead-letters", "redrive", "dl", "--yes"),
        ("status",),
        ("status", "--json"),
        ("subscribers", "list"),
        ("subscribers", "list", "--json"),
        ("verify", "--timeout", "60"),
    ]
    shown: dict[str, str] = {}
    for command in commands:
        done = run_cli(*command, env={**env, "COLUMNS": "1000"}, timeout=180)
        assert "Traceback" not in done.stderr, done.stderr
        name = " ".join(command)
        shown[name] = done.stdout + done.stderr
        assert not raw_controls(shown[name]), f"{name} printed {raw_controls(shown[name])}"

    # The data is there, escaped and with its markup literal, not dropped.
    table = shown["dead-letters list dl"]
    assert "evil\\x1b]52;c;aGFja2Vk\\x07\\x1b[2J" in table
    assert "Ev\\x1b]52;c;aGFja2Vk\\x07" in table
    assert MARKUP in table
    assert "\\u202e" in shown["status"] and MARKUP in shown["status"]
    assert "\\x1b]8;;https://evil.example/" in shown["subscribers list"]
    # JSON output stays JSON, its strings the writer's exactly.
    [letter] = json.loads(shown["dead-letters list dl --json"])
    assert letter["event_type"] == "Ev" + HOSTILE
    assert letter["error"].endswith(HOSTILE)
