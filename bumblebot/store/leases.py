"""Leases: which worker holds a conversation (or a cluster-wide job) until when, and the
fencing token of its hold.

Only workers sharing a PostgreSQL store take leases (``bumblebot/cluster/``). A lease is one
row of ``leases``, named ``conversation:<chat key>``, ``telegram.poller``,
``discord.shard:<n>`` or ``housekeeping``. Taking one that is free, expired, or the worker's
own from before a restart gives it a new **token**, one more than the last; renewing keeps it.
Every write of a turn checks, in its own transaction, that its worker still holds the
conversation's lease with the token it was given (:meth:`bumblebot.store.connection.Database.fenced`),
and locks that row while it commits: a worker whose lease was taken over cannot write, and a
takeover waits for a write under way to commit.

Times are the database server's clock (``clock_timestamp()``), so that workers on machines
whose clocks differ agree on when a lease expires. ``workers`` holds each worker's last
heartbeat, for ``bumblebot cluster``; ``relayed``, what a worker passes to the worker holding a
conversation (a command or an edit that arrived elsewhere), taken once by that worker.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from bumblebot.core.errors import DatabaseError
from bumblebot.core.events import ChatRef, Platform
from bumblebot.core.messages import json_text
from bumblebot.store.connection import DB_NOW as NOW
from bumblebot.store.connection import Database, unfenced

#: the longest a worker waits for a lease row another worker's write has locked, ms
LOCK_WAIT_MS = 1000


@dataclass(frozen=True, slots=True)
class Lease:
    name: str
    owner: str
    token: int
    expires_in: float  # seconds left (negative: expired)


@dataclass(frozen=True, slots=True)
class Worker:
    name: str
    host: str
    pid: int
    started_at: float
    seen_ago: float  # seconds since its last heartbeat


class LeaseTables(Database):
    """``leases`` and ``workers`` (part of :class:`bumblebot.store.Store`); PostgreSQL only."""

    async def acquire(self, name: str, owner: str, ttl_s: float) -> int | None:
        """Take lease ``name`` for ``ttl_s`` seconds if it is free, expired, or ``owner``'s own
        (a worker started again under its name); its new token, else ``None``: held by another,
        or locked by a write of its last holder still under way (waited for at most
        :data:`LOCK_WAIT_MS`: a holder frozen mid-transaction must not freeze the taker too)."""
        try:
            with unfenced():  # a lease is taken for the worker, never under a conversation's
                async with self.transaction() as db:
                    await db.execute(f"SET LOCAL lock_timeout = {LOCK_WAIT_MS}")
                    rows = await db.execute_fetchall(
                        f"INSERT INTO leases (name, owner, token, expires_at, acquired_at) VALUES (?, ?, 1, {NOW} + ?, {NOW})"
                        " ON CONFLICT (name) DO UPDATE SET owner = excluded.owner, token = leases.token + 1,"
                        " expires_at = excluded.expires_at, acquired_at = excluded.acquired_at"
                        f" WHERE leases.expires_at < {NOW} OR leases.owner = excluded.owner RETURNING token",
                        (name, owner, ttl_s),
                    )
        except DatabaseError as exc:
            if "lock timeout" not in str(exc):
                raise
            return None
        return int(rows[0][0]) if rows else None

    async def unheld_work(self) -> list[ChatRef]:
        """The conversations with work waiting (a message, a cut-off turn, a reply not sent
        yet, a command relayed to a worker that died) whose lease nobody holds now."""
        rows = await self._all(
            "SELECT DISTINCT platform, chat_id, thread_id FROM ("
            " SELECT platform, chat_id, thread_id FROM journal WHERE status = 'pending'"
            " UNION SELECT c.platform, c.chat_id, c.thread_id FROM turns t JOIN conversations c"
            "  ON c.id = t.conversation_id WHERE t.status = 'running'"
            " UNION SELECT platform, chat_id, thread_id FROM outbox WHERE status = 'pending') w"
            " WHERE NOT EXISTS (SELECT 1 FROM leases l WHERE l.name = 'conversation:' || w.platform || ':' || w.chat_id"
            f" || CASE WHEN w.thread_id = '' THEN '' ELSE ':' || w.thread_id END AND l.expires_at > {NOW})",
        )
        relayed = await self._all(
            "SELECT DISTINCT conversation FROM relayed r WHERE NOT EXISTS (SELECT 1 FROM leases l"
            f" WHERE l.name = 'conversation:' || r.conversation AND l.expires_at > {NOW})"
        )
        chats = {c.key: c for c in (ChatRef(Platform(r[0]), str(r[1]), str(r[2])) for r in rows)}
        for r in relayed:
            chats.setdefault(str(r[0]), ChatRef.from_key(str(r[0])))
        return list(chats.values())

    async def renew(self, names: list[str], owner: str, ttl_s: float) -> list[tuple[str, int]]:
        """Extend ``owner``'s leases ``names`` by ``ttl_s`` from now; the ``(name, token)`` of
        those still held (a lease missing from the answer was taken over)."""
        if not names:
            return []
        marks = ", ".join("?" for _ in names)
        rows = await self.write_rows(
            f"UPDATE leases SET expires_at = {NOW} + ? WHERE owner = ? AND name IN ({marks}) RETURNING name, token",
            (ttl_s, owner, *names),
        )
        return [(str(r[0]), int(r[1])) for r in rows]

    async def release(self, name: str, owner: str, token: int) -> None:
        """Give lease ``name`` up at once (another worker may take it; the token stays). It
        lapses now, and counts among the recent ones of the fair share a while yet."""
        await self.write(f"UPDATE leases SET expires_at = {NOW} WHERE name = ? AND owner = ? AND token = ?", (name, owner, token))

    async def leases(self, prefix: str = "") -> list[Lease]:
        rows = await self._all(
            f"SELECT name, owner, token, expires_at - {NOW} FROM leases WHERE substr(name, 1, ?) = ? ORDER BY name",
            (len(prefix), prefix),
        )
        return [Lease(str(r[0]), str(r[1]), int(r[2]), float(r[3])) for r in rows]

    async def live_leases(self, prefix: str, lapsed_s: float = 0.0) -> int:
        """How many leases named ``prefix…`` are held now, or lapsed less than ``lapsed_s``
        seconds ago (a dead worker's, for the others to share)."""
        row = await self._one(
            f"SELECT COUNT(*) FROM leases WHERE substr(name, 1, ?) = ? AND expires_at > {NOW} - ?",
            (len(prefix), prefix, lapsed_s),
        )
        return int(row[0]) if row else 0

    async def heartbeat(self, name: str, host: str, pid: int, started_at: float) -> None:
        """Record that worker ``name`` is alive now."""
        await self.write(
            f"INSERT INTO workers (name, host, pid, started_at, seen_at) VALUES (?, ?, ?, ?, {NOW})"
            " ON CONFLICT (name) DO UPDATE SET host = excluded.host, pid = excluded.pid,"
            " started_at = excluded.started_at, seen_at = excluded.seen_at",
            (name, host, pid, started_at),
        )

    async def workers(self) -> list[Worker]:
        rows = await self._all(f"SELECT name, host, pid, started_at, {NOW} - seen_at FROM workers ORDER BY name")
        return [Worker(str(r[0]), str(r[1]), int(r[2]), float(r[3]), float(r[4])) for r in rows]

    async def backlog(self) -> list[tuple[str | None, int, float]]:
        """Messages waiting for a turn, by the worker holding their conversation (``None``:
        nobody): ``(worker, how many, seconds the oldest has waited)``."""
        rows = await self._all(
            f"SELECT l.owner, COUNT(j.id), {NOW} - MIN(j.received_at) FROM journal j"
            " LEFT JOIN leases l ON l.name = 'conversation:' || j.platform || ':' || j.chat_id"
            f" || CASE WHEN j.thread_id = '' THEN '' ELSE ':' || j.thread_id END AND l.expires_at > {NOW}"
            " WHERE j.status = 'pending' GROUP BY l.owner ORDER BY l.owner",
        )
        return [(None if r[0] is None else str(r[0]), int(r[1]), float(r[2])) for r in rows]

    async def prune_cluster(self, before: float) -> int:
        """Forget workers not seen since ``before`` (epoch s) and what was relayed before it to
        a conversation nobody took since; leases stay (their tokens only grow). Returns how many
        rows went."""
        gone = 0
        for sql in ("DELETE FROM workers WHERE seen_at < ?", "DELETE FROM relayed WHERE created_at < ?"):
            gone += (await self.write(sql, (before,))).rowcount
        return gone

    async def relay(self, conversation: str, kind: str, payload: dict[str, Any]) -> None:
        """Pass ``kind`` (``command``, ``edit``) with ``payload`` to conversation's worker."""
        await self.write(
            "INSERT INTO relayed (conversation, kind, payload, created_at) VALUES (?, ?, ?, ?)",
            (conversation, kind, json_text(payload), time.time()),
        )

    async def take_relayed(self, conversations: list[str]) -> list[tuple[str, str, dict[str, Any]]]:
        """What was relayed to ``conversations``, oldest first, as ``(conversation, kind,
        payload)``; taken: removed in the same statement, so a relayed thing is done once."""
        if not conversations:
            return []
        marks = ", ".join("?" for _ in conversations)
        rows = await self.write_rows(
            f"DELETE FROM relayed WHERE conversation IN ({marks}) RETURNING id, conversation, kind, payload",
            tuple(conversations),
        )
        return [(str(r[1]), str(r[2]), json.loads(r[3])) for r in sorted(rows, key=lambda r: int(r[0]))]
