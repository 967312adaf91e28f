"""SQLite state through aiosqlite: conversations, history, compaction state, journal, outbox.

One file, ``<data_dir>/bumblebot.db``, in WAL mode with a 10 s busy timeout. Schema versions
are applied in order from :data:`MIGRATIONS` and recorded in ``PRAGMA user_version``.

Tables:

* ``conversations``: one row per (platform, chat_id, thread_id); ``session`` grows on ``/reset``
  (older sessions stay for audit and are never sent to the model).
* ``messages``: the full history in OpenAI chat form. ``pruned`` marks tool results that
  compaction replaced by a placeholder in prompts; ``covered_by`` marks messages folded into a
  compaction summary. Neither is deleted.
* ``compaction``: per (conversation, session): the current summary, counters, failure backoff.
* ``journal``: every accepted inbound message, unique per (platform, chat_id, message_id);
  ``status`` is ``pending`` until the turn that answered it commits, then ``done``.
* ``turns``: one row per turn with its trace (JSON).
* ``outbox``: every message the engine asked to deliver, with status and the platform ids.
* ``kv``: small durable values: ``telegram.offset`` (next update id), ``llm.tool_choice:<base
  url>`` (an endpoint that needs ``"auto"``), ``telegram.refused:<user>`` /
  ``discord.refused:<user>`` (the one refusal was sent).

All writes go through :meth:`Store.transaction`, which serialises writers on the single
connection, so one turn's rows land in one transaction and never interleave with another's.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiosqlite

from bumblebot.errors import StoreError
from bumblebot.events import ChatKind, ChatRef, Inbound, Platform
from bumblebot.messages import Message

PRUNED_PLACEHOLDER = "[Old tool output cleared to save context space]"

MIGRATIONS: tuple[str, ...] = (
    # 1: initial schema
    """
    CREATE TABLE conversations (
        id INTEGER PRIMARY KEY,
        platform TEXT NOT NULL,
        chat_id TEXT NOT NULL,
        thread_id TEXT NOT NULL DEFAULT '',
        session INTEGER NOT NULL DEFAULT 1,
        created_at REAL NOT NULL,
        UNIQUE (platform, chat_id, thread_id)
    );
    CREATE TABLE messages (
        id INTEGER PRIMARY KEY,
        conversation_id INTEGER NOT NULL REFERENCES conversations(id),
        session INTEGER NOT NULL,
        turn_id INTEGER,
        role TEXT NOT NULL CHECK (role IN ('user', 'assistant', 'tool')),
        content TEXT NOT NULL DEFAULT '',
        tool_calls TEXT,
        tool_call_id TEXT,
        name TEXT,
        pruned INTEGER NOT NULL DEFAULT 0,
        covered_by INTEGER,
        created_at REAL NOT NULL
    );
    CREATE INDEX messages_by_conversation ON messages (conversation_id, session, id);
    CREATE TABLE compaction (
        conversation_id INTEGER NOT NULL REFERENCES conversations(id),
        session INTEGER NOT NULL,
        summary TEXT,
        compactions INTEGER NOT NULL DEFAULT 0,
        passes INTEGER NOT NULL DEFAULT 0,
        failures INTEGER NOT NULL DEFAULT 0,
        next_retry_at REAL NOT NULL DEFAULT 0,
        updated_at REAL NOT NULL,
        PRIMARY KEY (conversation_id, session)
    );
    CREATE TABLE journal (
        id INTEGER PRIMARY KEY,
        platform TEXT NOT NULL,
        chat_id TEXT NOT NULL,
        thread_id TEXT NOT NULL DEFAULT '',
        message_id TEXT NOT NULL,
        update_id INTEGER,
        sender_id TEXT NOT NULL,
        sender_name TEXT NOT NULL,
        chat_kind TEXT NOT NULL,
        source TEXT NOT NULL DEFAULT 'chat',
        text TEXT NOT NULL,
        status TEXT NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'done', 'ignored')),
        turn_id INTEGER,
        received_at REAL NOT NULL,
        done_at REAL,
        UNIQUE (platform, chat_id, message_id)
    );
    CREATE INDEX journal_pending ON journal (status, id);
    CREATE TABLE turns (
        id INTEGER PRIMARY KEY,
        conversation_id INTEGER NOT NULL REFERENCES conversations(id),
        status TEXT NOT NULL CHECK (status IN ('running', 'done', 'failed', 'interrupted')),
        started_at REAL NOT NULL,
        ended_at REAL,
        trace TEXT
    );
    CREATE TABLE outbox (
        id INTEGER PRIMARY KEY,
        conversation_id INTEGER NOT NULL REFERENCES conversations(id),
        turn_id INTEGER,
        platform TEXT NOT NULL,
        chat_id TEXT NOT NULL,
        thread_id TEXT NOT NULL DEFAULT '',
        text TEXT NOT NULL,
        status TEXT NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'sent', 'failed')),
        platform_message_ids TEXT NOT NULL DEFAULT '[]',
        attempts INTEGER NOT NULL DEFAULT 0,
        last_error TEXT,
        created_at REAL NOT NULL,
        sent_at REAL
    );
    CREATE INDEX outbox_pending ON outbox (status, id);
    CREATE TABLE kv (key TEXT PRIMARY KEY, value TEXT NOT NULL);
    """,
)


@dataclass(frozen=True, slots=True)
class Conversation:
    id: int
    chat: ChatRef
    session: int


@dataclass(frozen=True, slots=True)
class JournalEntry:
    id: int
    inbound: Inbound
    status: str
    turn_id: int | None = None


@dataclass(frozen=True, slots=True)
class OutboxEntry:
    id: int
    conversation_id: int
    turn_id: int | None
    chat: ChatRef
    text: str
    status: str
    platform_message_ids: list[str]
    attempts: int
    last_error: str | None


@dataclass(frozen=True, slots=True)
class CompactionState:
    summary: str | None
    compactions: int
    passes: int
    failures: int
    next_retry_at: float


class Store:
    """The daemon's database. Use ``async with Store(path) as store``.

    Raises:
        StoreError: the file cannot be opened or its schema is newer than this code.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._db: aiosqlite.Connection | None = None
        self._write_lock = asyncio.Lock()

    async def __aenter__(self) -> Store:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def open(self) -> None:
        if self._db is not None:
            raise RuntimeError("store is already open")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = await aiosqlite.connect(self.path, isolation_level=None)
            self._db.row_factory = aiosqlite.Row
            await self._db.execute("PRAGMA journal_mode=WAL")
            await self._db.execute("PRAGMA busy_timeout=10000")
            await self._db.execute("PRAGMA foreign_keys=ON")
            await self._db.execute("PRAGMA synchronous=NORMAL")
            await self._migrate()
        except (OSError, aiosqlite.Error) as exc:
            await self.close()
            raise StoreError(f"cannot open database {self.path}: {exc}") from exc

    async def close(self) -> None:
        if self._db is not None:
            db, self._db = self._db, None
            await db.close()

    @property
    def db(self) -> aiosqlite.Connection:
        if self._db is None:
            raise RuntimeError("store is not open")
        return self._db

    async def _migrate(self) -> None:
        async with self.db.execute("PRAGMA user_version") as cur:
            row = await cur.fetchone()
        version = int(row[0]) if row else 0
        if version > len(MIGRATIONS):
            raise StoreError(
                f"database schema version {version} is newer than this Bumblebot "
                f"(knows {len(MIGRATIONS)}); upgrade Bumblebot"
            )
        for number, script in enumerate(MIGRATIONS[version:], start=version + 1):
            await self.db.executescript(f"BEGIN;\n{script}\nPRAGMA user_version={number};\nCOMMIT;")

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[aiosqlite.Connection]:
        """Serialise a write transaction; commits on success, rolls back on error."""
        async with self._write_lock:
            await self.db.execute("BEGIN IMMEDIATE")
            try:
                yield self.db
            except BaseException:
                await self.db.execute("ROLLBACK")
                raise
            else:
                await self.db.execute("COMMIT")

    async def _one(self, sql: str, params: tuple[Any, ...] = ()) -> aiosqlite.Row | None:
        async with self.db.execute(sql, params) as cur:
            return await cur.fetchone()

    async def _all(self, sql: str, params: tuple[Any, ...] = ()) -> list[aiosqlite.Row]:
        async with self.db.execute(sql, params) as cur:
            return list(await cur.fetchall())

    # -- kv -----------------------------------------------------------------------------------

    async def get_kv(self, key: str) -> str | None:
        row = await self._one("SELECT value FROM kv WHERE key = ?", (key,))
        return None if row is None else str(row[0])

    async def set_kv(self, key: str, value: str) -> None:
        async with self.transaction() as db:
            await db.execute("INSERT OR REPLACE INTO kv (key, value) VALUES (?, ?)", (key, value))

    # -- conversations ------------------------------------------------------------------------

    async def conversation(self, chat: ChatRef) -> Conversation:
        """Get or create the conversation of ``chat``."""
        sql = "SELECT id, session FROM conversations WHERE platform=? AND chat_id=? AND thread_id=?"
        params = (chat.platform.value, chat.chat_id, chat.thread_id)
        row = await self._one(sql, params)
        if row is None:
            async with self.transaction() as db:
                await db.execute(
                    "INSERT OR IGNORE INTO conversations (platform, chat_id, thread_id, created_at)"
                    " VALUES (?, ?, ?, ?)",
                    (*params, time.time()),
                )
            row = await self._one(sql, params)
        assert row is not None
        return Conversation(id=int(row["id"]), chat=chat, session=int(row["session"]))

    async def reset(self, conversation_id: int) -> int:
        """Start a fresh session; old rows stay but are no longer loaded. Returns the new session."""
        async with self.transaction() as db:
            await db.execute("UPDATE conversations SET session = session + 1 WHERE id = ?", (conversation_id,))
            async with db.execute("SELECT session FROM conversations WHERE id = ?", (conversation_id,)) as cur:
                row = await cur.fetchone()
        assert row is not None
        return int(row[0])

    # -- history ------------------------------------------------------------------------------

    async def history(self, conversation_id: int, session: int) -> list[Message]:
        """The active history: messages not covered by a summary, pruned ones as the placeholder."""
        rows = await self._all(
            "SELECT id, role, content, tool_calls, tool_call_id, name, pruned FROM messages"
            " WHERE conversation_id=? AND session=? AND covered_by IS NULL ORDER BY id",
            (conversation_id, session),
        )
        return [
            Message(
                role=r["role"],
                content=PRUNED_PLACEHOLDER if r["pruned"] else r["content"],
                tool_calls=json.loads(r["tool_calls"]) if r["tool_calls"] else None,
                tool_call_id=r["tool_call_id"],
                name=r["name"],
                id=int(r["id"]),
                pruned=bool(r["pruned"]),
            )
            for r in rows
        ]

    # -- journal ------------------------------------------------------------------------------

    async def journal(self, inbound: Inbound, *, kv: dict[str, str] | None = None) -> int | None:
        """Record an accepted inbound message (and optional kv values) in one transaction.

        Returns:
            the journal id, or ``None`` when this (platform, chat, message id) was seen before.
        """
        c = inbound.chat
        inbound = inbound.storable()
        async with self.transaction() as db:
            cur = await db.execute(
                "INSERT OR IGNORE INTO journal (platform, chat_id, thread_id, message_id, update_id,"
                " sender_id, sender_name, chat_kind, source, text, received_at)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    c.platform.value, c.chat_id, c.thread_id, inbound.message_id, inbound.update_id,
                    inbound.sender_id, inbound.sender_name, inbound.chat_kind.value, inbound.source,
                    inbound.text, time.time(),
                ),
            )
            new_id = cur.lastrowid if cur.rowcount == 1 else None
            for key, value in (kv or {}).items():
                await db.execute("INSERT OR REPLACE INTO kv (key, value) VALUES (?, ?)", (key, value))
        return new_id

    async def pending_inbound(self) -> list[JournalEntry]:
        """Journaled messages whose turn has not committed, oldest first."""
        rows = await self._all("SELECT * FROM journal WHERE status = 'pending' ORDER BY id")
        return [self._journal_entry(r) for r in rows]

    async def journal_entry(self, journal_id: int) -> JournalEntry | None:
        row = await self._one("SELECT * FROM journal WHERE id = ?", (journal_id,))
        return None if row is None else self._journal_entry(row)

    @staticmethod
    def _journal_entry(r: aiosqlite.Row) -> JournalEntry:
        inbound = Inbound(
            chat=ChatRef(Platform(r["platform"]), r["chat_id"], r["thread_id"]),
            message_id=r["message_id"],
            sender_id=r["sender_id"],
            sender_name=r["sender_name"],
            text=r["text"],
            chat_kind=ChatKind(r["chat_kind"]),
            source=r["source"],
            update_id=r["update_id"],
        )
        return JournalEntry(id=int(r["id"]), inbound=inbound, status=r["status"], turn_id=r["turn_id"])

    async def settle_journal(self, journal_ids: list[int], status: str = "done") -> None:
        """Mark journal entries finished without a turn (commands, refusals)."""
        async with self.transaction() as db:
            await db.executemany(
                "UPDATE journal SET status=?, done_at=? WHERE id=?",
                [(status, time.time(), j) for j in journal_ids],
            )

    # -- turns --------------------------------------------------------------------------------

    async def begin_turn(self, conversation_id: int, journal_ids: list[int]) -> int:
        """Open a turn for these journal entries (they stay ``pending`` until it commits)."""
        async with self.transaction() as db:
            cur = await db.execute(
                "INSERT INTO turns (conversation_id, status, started_at) VALUES (?, 'running', ?)",
                (conversation_id, time.time()),
            )
            turn_id = cur.lastrowid
            await db.executemany("UPDATE journal SET turn_id=? WHERE id=?", [(turn_id, j) for j in journal_ids])
        assert turn_id is not None
        return turn_id

    async def interrupted_turns(self, platforms: set[str] | None = None) -> list[int]:
        """Turns left ``running`` by a crash; marks them ``interrupted`` and returns their ids.

        Args:
            platforms: only turns of conversations on these platforms (``None``: all), so that
                ``bumblebot chat`` never touches the turns of a daemon serving Telegram.
        """
        rows = await self._all(
            "SELECT t.id, c.platform FROM turns t JOIN conversations c ON c.id = t.conversation_id"
            " WHERE t.status = 'running'"
        )
        rows = [r for r in rows if platforms is None or r["platform"] in platforms]
        ids = [int(r[0]) for r in rows]
        if ids:
            async with self.transaction() as db:
                await db.executemany(
                    "UPDATE turns SET status='interrupted', ended_at=? WHERE id=?",
                    [(time.time(), i) for i in ids],
                )
        return ids

    async def commit_turn(
        self,
        *,
        turn_id: int,
        conversation: Conversation,
        messages: list[Message],
        journal_ids: list[int],
        trace: dict[str, Any],
        status: str = "done",
    ) -> None:
        """Write a turn's messages, settle its journal entries and store its trace, atomically.

        Assigns ``Message.id`` to each stored message. An assistant message with tool calls and
        its tool results are always written together, because the whole turn is one transaction.
        """
        now = time.time()
        async with self.transaction() as db:
            for m in messages:
                cur = await db.execute(
                    "INSERT INTO messages (conversation_id, session, turn_id, role, content, tool_calls,"
                    " tool_call_id, name, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        conversation.id, conversation.session, turn_id, m.role, m.content,
                        json.dumps(m.tool_calls) if m.tool_calls else None, m.tool_call_id, m.name, now,
                    ),
                )
                m.id = cur.lastrowid
            await db.executemany(
                "UPDATE journal SET status='done', turn_id=?, done_at=? WHERE id=?",
                [(turn_id, now, j) for j in journal_ids],
            )
            await db.execute(
                "UPDATE turns SET status=?, ended_at=?, trace=? WHERE id=?",
                (status, now, json.dumps(trace, ensure_ascii=False, default=str), turn_id),
            )

    async def recent_turns(self, conversation_id: int | None = None, limit: int = 10) -> list[dict[str, Any]]:
        """The last ``limit`` finished turns (newest first) with their traces."""
        where = "WHERE t.conversation_id = ?" if conversation_id is not None else ""
        params: tuple[Any, ...] = (conversation_id, limit) if conversation_id is not None else (limit,)
        rows = await self._all(
            "SELECT t.id, t.status, t.started_at, t.ended_at, t.trace, c.platform, c.chat_id, c.thread_id"
            f" FROM turns t JOIN conversations c ON c.id = t.conversation_id {where}"
            " ORDER BY t.id DESC LIMIT ?",
            params,
        )
        return [
            {
                "turn_id": r["id"], "status": r["status"], "started_at": r["started_at"],
                "ended_at": r["ended_at"], "chat": f"{r['platform']}:{r['chat_id']}"
                + (f":{r['thread_id']}" if r["thread_id"] else ""),
                "trace": json.loads(r["trace"]) if r["trace"] else {},
            }
            for r in rows
        ]

    # -- outbox -------------------------------------------------------------------------------

    async def outbox_add(self, conversation_id: int, turn_id: int | None, chat: ChatRef, text: str) -> int:
        async with self.transaction() as db:
            cur = await db.execute(
                "INSERT INTO outbox (conversation_id, turn_id, platform, chat_id, thread_id, text, created_at)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                (conversation_id, turn_id, chat.platform.value, chat.chat_id, chat.thread_id, text, time.time()),
            )
        assert cur.lastrowid is not None
        return cur.lastrowid

    async def outbox_progress(
        self, outbox_id: int, *, status: str, message_ids: list[str], error: str | None = None
    ) -> None:
        """Record a delivery attempt: status ``pending`` (retry later), ``sent`` or ``failed``."""
        async with self.transaction() as db:
            await db.execute(
                "UPDATE outbox SET status=?, platform_message_ids=?, attempts=attempts+1, last_error=?,"
                " sent_at=CASE WHEN ?='sent' THEN ? ELSE sent_at END WHERE id=?",
                (status, json.dumps(message_ids), error, status, time.time(), outbox_id),
            )

    async def outbox_chunks_sent(self, outbox_id: int, message_ids: list[str]) -> None:
        """Record the chunks of a message delivered so far (a retry resumes after them)."""
        async with self.transaction() as db:
            await db.execute(
                "UPDATE outbox SET platform_message_ids=? WHERE id=?", (json.dumps(message_ids), outbox_id)
            )

    async def outbox_entry(self, outbox_id: int) -> OutboxEntry | None:
        row = await self._one("SELECT * FROM outbox WHERE id=?", (outbox_id,))
        return None if row is None else self._outbox_entry(row)

    async def outbox_pending(self) -> list[OutboxEntry]:
        rows = await self._all("SELECT * FROM outbox WHERE status='pending' ORDER BY id")
        return [self._outbox_entry(r) for r in rows]

    async def outbox_sent_for_turns(self, turn_ids: list[int]) -> list[OutboxEntry]:
        """Messages already delivered by these turns (used after a crash mid-turn)."""
        if not turn_ids:
            return []
        marks = ",".join("?" * len(turn_ids))
        rows = await self._all(
            f"SELECT * FROM outbox WHERE turn_id IN ({marks}) AND status='sent' ORDER BY id", tuple(turn_ids)
        )
        return [self._outbox_entry(r) for r in rows]

    @staticmethod
    def _outbox_entry(r: aiosqlite.Row) -> OutboxEntry:
        return OutboxEntry(
            id=int(r["id"]),
            conversation_id=int(r["conversation_id"]),
            turn_id=r["turn_id"],
            chat=ChatRef(Platform(r["platform"]), r["chat_id"], r["thread_id"]),
            text=r["text"],
            status=r["status"],
            platform_message_ids=json.loads(r["platform_message_ids"]),
            attempts=int(r["attempts"]),
            last_error=r["last_error"],
        )

    # -- compaction ---------------------------------------------------------------------------

    async def compaction_state(self, conversation_id: int, session: int) -> CompactionState:
        row = await self._one(
            "SELECT * FROM compaction WHERE conversation_id=? AND session=?", (conversation_id, session)
        )
        if row is None:
            return CompactionState(None, 0, 0, 0, 0.0)
        return CompactionState(
            row["summary"], int(row["compactions"]), int(row["passes"]), int(row["failures"]),
            float(row["next_retry_at"]),
        )

    async def mark_pruned(self, message_ids: list[int]) -> None:
        """Show these tool results as the placeholder in prompts from now on (content is kept)."""
        if message_ids:
            async with self.transaction() as db:
                await db.executemany("UPDATE messages SET pruned=1 WHERE id=?", [(i,) for i in message_ids])

    async def save_compaction(
        self,
        conversation: Conversation,
        *,
        summary: str | None,
        covered_ids: list[int],
        pruned_ids: list[int],
        passes: int,
        failed: bool,
        next_retry_at: float = 0.0,
    ) -> None:
        """Persist one compaction: the summary, the messages it covers and those pruned."""
        now = time.time()
        async with self.transaction() as db:
            await db.execute(
                "INSERT OR IGNORE INTO compaction (conversation_id, session, updated_at) VALUES (?, ?, ?)",
                (conversation.id, conversation.session, now),
            )
            if failed:
                await db.execute(
                    "UPDATE compaction SET failures=failures+1, next_retry_at=?, updated_at=?"
                    " WHERE conversation_id=? AND session=?",
                    (next_retry_at, now, conversation.id, conversation.session),
                )
            else:
                await db.execute(
                    "UPDATE compaction SET summary=?, compactions=compactions+?, passes=passes+?,"
                    " failures=0, next_retry_at=0, updated_at=? WHERE conversation_id=? AND session=?",
                    (summary, 1 if covered_ids else 0, passes, now, conversation.id, conversation.session),
                )
            async with db.execute(
                "SELECT compactions FROM compaction WHERE conversation_id=? AND session=?",
                (conversation.id, conversation.session),
            ) as cur:
                row = await cur.fetchone()
            number = int(row[0]) if row else 0
            if covered_ids:
                await db.executemany(
                    "UPDATE messages SET covered_by=? WHERE id=?", [(number, i) for i in covered_ids]
                )
            if pruned_ids:
                await db.executemany("UPDATE messages SET pruned=1 WHERE id=?", [(i,) for i in pruned_ids])
