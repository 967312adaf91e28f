"""SQLite state through aiosqlite: :class:`Store`, made of one class per group of tables.

One file, ``<data_dir>/bumblebot.db``, in WAL mode with a 10 s busy timeout, opened by
``connection.py``; its schema versions are in ``schema.py`` (:data:`MIGRATIONS`, recorded in
``PRAGMA user_version``). :class:`Store` puts together the classes that own the tables, and
holds the key-value memory itself:

* ``conversations.py``: ``conversations``, one row per (platform, chat_id, thread_id);
  ``session`` grows on ``/reset``.
* ``history.py``: ``messages``, the full history in OpenAI chat form (nothing is deleted,
  ever), and ``compaction``, per (conversation, session) the summary, counters and backoff.
* ``journal.py``: ``journal``, every accepted inbound message, ``pending`` until the turn that
  answers it finishes.
* ``turns.py``: ``turns``, and a turn's checkpoints across the tables (``begin_turn``,
  ``record``, ``speak``, ``finish_turn``, its streaming outbox rows, resume).
* ``outbox.py``: ``outbox``, every message the engine asked to deliver, as delivery sees it.
* ``tasks.py``: ``tasks``, scheduled tasks, and the scheduler's reads.
* ``usage.py``: ``usage``, what model requests used per day, chat, sender, kind and model.
* ``operator.py``: conversations' titles and pauses, and ``blocked_senders``: the operator's decisions.
* ``leases.py``: ``leases`` and ``workers``, what workers sharing a PostgreSQL store hold.
* ``console.py``: the operator's web console's reads (paged, each on an index).
* ``housekeeping.py``: retention (:meth:`Store.prune`) and outbox expiry
  (:meth:`Store.expire_outbox`), run by the engine's housekeeping.
* here: ``kv``, small durable values (``docs/architecture.md`` lists them and their owners;
  :meth:`Store.journal` may write some in the transaction that journals a message).

The record types they return are in ``records.py``. All writes go through
:meth:`Store.transaction`, which serialises writers on the single connection. The turn
writers and the compaction writers are called only by ``bumblebot/runtime/conversation.py``,
the one home of a conversation's state.
"""

from __future__ import annotations

import secrets

from bumblebot.store.connection import SET_KV
from bumblebot.store.console import ConsoleTables
from bumblebot.store.conversations import ConversationTables
from bumblebot.store.history import HistoryTables
from bumblebot.store.housekeeping import HousekeepingTables
from bumblebot.store.journal import JournalTables
from bumblebot.store.leases import LeaseTables
from bumblebot.store.operator import OperatorTables
from bumblebot.store.outbox import OutboxTables
from bumblebot.store.tasks import TaskTables
from bumblebot.store.turns import TurnTables
from bumblebot.store.usage import UsageTables

INSTANCE_KEY = "store.instance"


class Store(
    ConversationTables, HistoryTables, JournalTables, TurnTables, OutboxTables, TaskTables,
    HousekeepingTables, UsageTables, OperatorTables, ConsoleTables, LeaseTables,
):
    """The daemon's database. Use ``async with Store(path) as store``.

    Args:
        path: the SQLite file (created with its directory when missing, unless ``readonly``).
        readonly: open for reading only (``bumblebot trace``): no migration, no write, so it
            is safe next to a running daemon of any version this code can read.
        redactor: the secrets the file never holds: every text a statement is given is
            redacted first (default: none).

    Raises:
        StoreError: the file cannot be opened or its schema is newer than this code.
    """

    # -- kv -----------------------------------------------------------------------------------

    async def get_kv(self, key: str) -> str | None:
        row = await self._one("SELECT value FROM kv WHERE key = ?", (key,))
        return None if row is None else str(row[0])

    async def set_kv(self, key: str, value: str) -> None:
        await self.write(SET_KV, (key, value))

    async def delete_kv(self, key: str) -> None:
        """Forget ``key`` (nothing happens when it is absent)."""
        await self.write("DELETE FROM kv WHERE key = ?", (key,))

    async def instance_id(self) -> str:
        """A random id of this database, made on first use (idempotency keys of sends)."""
        value = await self.get_kv(INSTANCE_KEY)
        if value is None:
            await self.write("INSERT INTO kv (key, value) VALUES (?, ?) ON CONFLICT DO NOTHING", (INSTANCE_KEY, secrets.token_hex(4)))
            value = await self.get_kv(INSTANCE_KEY)
        assert value is not None
        return value
