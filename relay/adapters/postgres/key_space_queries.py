"""The outbox store's key space (restore safety): the stored keys checked against this
cluster's transaction ids, and keys of a key space read or translated (a piece of
:class:`~relay.adapters.postgres.store.OutboxStore`)."""

from __future__ import annotations

from collections.abc import Sequence
from uuid import UUID

from relay.adapters.postgres.db import wrap_errors
from relay.adapters.postgres.store_base import StoreBase
from relay.core.key_space import KeySpace, KeySpaceAction, KeySpaceCheck
from relay.core.model import Position
from relay.errors import UndefinedFunctionError


class KeySpaceQueries(StoreBase):
    """The key space of the outbox, and the keys and message ids in it."""

    # -- the key space (restore safety) -----------------------------------------------

    def check_key_space(self) -> KeySpaceCheck | None:
        """Check (and repair) that the stored keys fit this cluster's transaction ids;
        None on a schema from before migration 0004 (a rolling deploy)."""
        try:
            with wrap_errors():
                row = self.conn.execute(self._q["check_key_space"]).fetchone()
        except UndefinedFunctionError:
            return None
        assert row is not None
        return KeySpaceCheck(KeySpaceAction(row[0]), row[1], row[2], row[3])

    def key_space(self) -> KeySpace:
        with wrap_errors():
            row = self.conn.execute(self._q["key_space"]).fetchone()
        assert row is not None, "outbox_key_space has its one row from migration 0004"
        return KeySpace(row[0], row[1], row[2])

    def key_of(self, message_id: UUID) -> Position | None:
        with wrap_errors():
            row = self.conn.execute(
                self._q["key_of_message"], {"message_id": message_id}
            ).fetchone()
        return Position(*row) if row is not None else None

    def messages_at(self, keys: Sequence[Position]) -> dict[Position, UUID]:
        """The message id of the event at each of ``keys`` the outbox holds."""
        params = {
            "transaction_ids": [key.transaction_id for key in keys],
            "positions": [key.position for key in keys],
        }
        with wrap_errors():
            rows = self.conn.execute(self._q["messages_at_keys"], params).fetchall()
        return {Position(tx, pos): message_id for tx, pos, message_id in rows}

    def translate(self, key_space: UUID, key: Position) -> Position:
        """A key of ``key_space`` as a key of the space rebased from it."""
        params = {"key_space": key_space, **key._asdict()}
        with wrap_errors():
            row = self.conn.execute(self._q["translate_key"], params).fetchone()
        assert row is not None
        return Position(*row)
