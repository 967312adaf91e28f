"""Housekeeping: retention (:meth:`~HousekeepingTables.prune`) and outbox expiry.

Run by the engine's housekeeping. Settled journal rows, settled outbox rows and finished
turns' traces older than ``engine.retention_days`` go, in batches of
:data:`HOUSEKEEPING_BATCH`; the history never does. Outbox rows still pending after
``engine.outbox_expiry_s`` are marked failed (:meth:`~HousekeepingTables.expire_outbox`), so
no sweep or resume ever sends them.
"""

from __future__ import annotations

import asyncio

from bumblebot.store.connection import Database
from bumblebot.store.outbox import outbox_entry_from_row
from bumblebot.store.records import OutboxEntry, Pruned

#: Rows changed per transaction by :meth:`Store.prune` and :meth:`Store.expire_outbox`: each
#: holds the write lock for a few milliseconds, so turns are never held up behind housekeeping.
HOUSEKEEPING_BATCH = 500


class HousekeepingTables(Database):
    """Pruning and expiry across ``journal``, ``outbox`` and ``turns`` (part of
    :class:`bumblebot.store.Store`)."""

    async def expire_outbox(
        self, created_before: float, *, error: str, batch: int = HOUSEKEEPING_BATCH
    ) -> list[tuple[OutboxEntry, float]]:
        """Mark every row still ``pending`` that was queued before ``created_before`` as
        ``failed``, so no sweep or resume ever sends it.

        Args:
            created_before: epoch seconds; older pending rows expire.
            error: their ``last_error``; the previous error, if any, is appended in brackets.
            batch: rows per transaction.

        Returns:
            ``(entry, created_at)`` of each row expired now (the entry as it was before,
            ``created_at`` in epoch seconds), oldest first.
        """
        expired: list[tuple[OutboxEntry, float]] = []
        probe = "SELECT 1 FROM outbox WHERE status='pending' AND created_at < ? LIMIT 1"
        while await self._one(probe, (created_before,)) is not None:  # no write lock when idle
            async with self.transaction() as db:
                async with db.execute(
                    "SELECT * FROM outbox WHERE status='pending' AND created_at < ? ORDER BY id LIMIT ?",
                    (created_before, batch),
                ) as cur:
                    rows = list(await cur.fetchall())
                await db.executemany(
                    "UPDATE outbox SET status='failed', last_error=? || COALESCE(' (last error: ' || last_error"
                    " || ')', '') WHERE id=? AND status='pending'",
                    [(error, r["id"]) for r in rows],
                )
            expired += [(outbox_entry_from_row(r), float(r["created_at"])) for r in rows]
            if len(rows) < batch:
                break
        return expired

    async def prune(self, before: float, *, batch: int = HOUSEKEEPING_BATCH) -> Pruned:
        """Retention: drop what is older than ``before`` and no longer needed; history stays.

        * ``journal``: settled rows (``done``, ``ignored``, ``failed``) received and settled
          before ``before`` are deleted. ``pending`` rows are never touched: they are the
          messages still waiting for an answer, and the settled ones that remain are the
          dedupe keys of recent platform redeliveries.
        * ``outbox``: ``sent`` and ``failed`` rows queued (and sent) before ``before`` are
          deleted, except those of a turn still ``running`` (its resume reads them).
          ``pending`` rows are never touched (they expire first: :meth:`expire_outbox`).
        * ``turns``: a finished turn (not ``running``) that started and ended before
          ``before`` keeps its row (id, status, times: ``messages.turn_id`` keeps pointing
          at it) and loses its ``trace`` and ``state``, the bulk of it.
        * ``messages``, ``conversations``, ``compaction`` and ``kv`` are never pruned.

        Each batch of ``batch`` rows is one short transaction, so other writers get in between.

        Args:
            before: epoch seconds.
            batch: rows per transaction.

        Returns:
            how many rows of each kind went.
        """
        journal = await self._prune_batches(
            "DELETE FROM journal WHERE id IN ({rows})",
            "SELECT id FROM journal"
            " WHERE received_at < ?1 AND status != 'pending' AND COALESCE(done_at, received_at) < ?1",
            before, batch,
        )
        outbox = await self._prune_batches(
            "DELETE FROM outbox WHERE id IN ({rows})",
            "SELECT id FROM outbox o"
            " WHERE created_at < ?1 AND status != 'pending' AND COALESCE(sent_at, created_at) < ?1"
            " AND NOT EXISTS (SELECT 1 FROM turns t WHERE t.id = o.turn_id AND t.status = 'running')",
            before, batch,
        )
        traces = await self._prune_batches(
            "UPDATE turns SET trace=NULL, state=NULL WHERE id IN ({rows})",
            "SELECT id FROM turns"
            " WHERE trace IS NOT NULL AND started_at < ?1 AND status != 'running'"
            " AND COALESCE(ended_at, started_at) < ?1",
            before, batch,
        )
        return Pruned(journal=journal, outbox=outbox, traces=traces)

    async def _prune_batches(self, action: str, rows: str, before: float, batch: int) -> int:
        """Apply ``action`` (with ``{rows}``) to the rows ``rows`` selects (parameter ``?1`` =
        ``before``), ``batch`` at a time, each batch its own transaction, until none is left.
        Nothing is written, and the write lock not taken, when nothing matches. Returns the
        rows changed."""
        total = 0
        sql = action.format(rows=f"{rows} LIMIT ?2")
        while True:
            if await self._one(f"{rows} LIMIT 1", (before,)) is None:
                return total
            async with self.transaction() as db:
                cur = await db.execute(sql, (before, batch))
                changed = cur.rowcount
            total += changed
            if changed < batch:
                return total
            await asyncio.sleep(0)  # let waiting writers (turns) take the lock in between
