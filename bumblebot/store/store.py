"""SQLite state through aiosqlite: conversations, history, compaction state, journal, turns, outbox.

One file, ``<data_dir>/bumblebot.db``, in WAL mode with a 10 s busy timeout. Schema versions
are applied in order from :data:`MIGRATIONS` and recorded in ``PRAGMA user_version`` (7 now).

Tables:

* ``conversations``: one row per (platform, chat_id, thread_id); ``session`` grows on ``/reset``
  (older sessions stay for audit and are never sent to the model).
* ``messages``: the full history in OpenAI chat form, written step by step while a turn runs.
  ``ok`` is a tool result's success, ``note`` marks the daemon's own messages, ``pruned``
  marks tool results that compaction replaced by a placeholder in prompts, ``covered_by``
  marks messages folded into a compaction summary. Nothing is deleted, ever.
* ``compaction``: per (conversation, session): the current summary, counters, failure backoff.
* ``journal``: every accepted inbound message, unique per (platform, chat_id, message_id);
  ``status`` is ``pending`` until the turn that answers it finishes, then ``done`` or
  ``failed``; ``ignored`` for messages handled without a turn.
* ``turns``: one row per turn: its session, status, resumable ``state`` and ``trace`` (JSON).
* ``outbox``: every message the engine asked to deliver, with the ``say`` call it answers,
  its status and the platform ids.
* ``tasks``: scheduled tasks (``schedule_task``): schedule, text, next due time, status.
* ``kv``: small durable values (``docs/architecture.md`` lists them and their owners).

Retention (:meth:`Store.prune`, run by the engine's housekeeping): settled journal rows,
settled outbox rows and finished turns' traces older than ``engine.retention_days`` go, in
batches of :data:`HOUSEKEEPING_BATCH`; the history never does. Outbox rows still pending
after ``engine.outbox_expiry_s`` are marked failed (:meth:`Store.expire_outbox`).

All writes go through :meth:`Store.transaction`, which serialises writers on the single
connection. The turn writers (``begin_turn``, ``record``, ``speak``, ``finish_turn``) and the
compaction writers are called only by ``bumblebot/runtime/conversation.py``, the one home of a
conversation's state.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import sqlite3
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiosqlite

from bumblebot.core.errors import StoreError
from bumblebot.core.events import Attachment, ChatKind, ChatRef, Inbound, Platform
from bumblebot.core.messages import Message, json_text, sound_call

log = logging.getLogger(__name__)

PRUNED_PLACEHOLDER = "[Old tool output cleared to save context space]"
INSTANCE_KEY = "store.instance"

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
    # 2: step checkpoints (issue 8). Tool results keep their ok flag, daemon notes are marked,
    # outbox rows name the say call that made them, turns keep their session and resumable
    # state, and a journal entry can end as failed.
    """
    ALTER TABLE messages ADD COLUMN ok INTEGER;
    ALTER TABLE messages ADD COLUMN note INTEGER NOT NULL DEFAULT 0;
    CREATE INDEX messages_by_turn ON messages (turn_id);
    ALTER TABLE outbox ADD COLUMN tool_call_id TEXT;
    CREATE INDEX outbox_by_turn ON outbox (turn_id);
    ALTER TABLE turns ADD COLUMN session INTEGER;
    ALTER TABLE turns ADD COLUMN state TEXT;
    CREATE TABLE journal_v2 (
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
        status TEXT NOT NULL DEFAULT 'pending'
            CHECK (status IN ('pending', 'done', 'ignored', 'failed')),
        turn_id INTEGER,
        received_at REAL NOT NULL,
        done_at REAL,
        UNIQUE (platform, chat_id, message_id)
    );
    INSERT INTO journal_v2 SELECT * FROM journal;
    DROP TABLE journal;
    ALTER TABLE journal_v2 RENAME TO journal;
    CREATE INDEX journal_pending ON journal (status, id);
    CREATE INDEX journal_by_turn ON journal (turn_id);
    """,
    # 3: retention (issue 9). Pruning walks rows by age, oldest first, a batch at a time; these
    # indexes keep each batch a short range scan (turns: only those that still have a trace).
    """
    CREATE INDEX journal_by_age ON journal (received_at);
    CREATE INDEX outbox_by_age ON outbox (created_at);
    CREATE INDEX turns_with_trace ON turns (started_at) WHERE trace IS NOT NULL;
    """,
    # 4: groups (issue 10). A message can quote the one it replies to; an unaddressed group
    # message is kept as background for the next turn there.
    """
    ALTER TABLE journal ADD COLUMN quote TEXT NOT NULL DEFAULT '';
    ALTER TABLE journal ADD COLUMN background INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE journal ADD COLUMN context_limit INTEGER NOT NULL DEFAULT 0;
    CREATE INDEX journal_by_chat ON journal (platform, chat_id, thread_id, id);
    """,
    # 5: streaming (issue 11). A row is ``streaming`` while the model is still writing its
    # text (no sweep sends it); ``preview_id`` is the platform message showing it meanwhile,
    # which the final text replaces by an edit.
    """
    ALTER TABLE outbox ADD COLUMN streaming INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE outbox ADD COLUMN preview_id TEXT;
    """,
    # 6: media (issue 12). An inbound message's files (``attachments``: what to fetch) and
    # what fetching them gave (``media``: transcripts, saved paths, image references), so a
    # restart never downloads or transcribes twice; a message's images (references to files
    # under <data_dir>/media, never the bytes); a file or voice message to send.
    """
    ALTER TABLE journal ADD COLUMN attachments TEXT;
    ALTER TABLE journal ADD COLUMN media TEXT;
    ALTER TABLE messages ADD COLUMN images TEXT;
    ALTER TABLE outbox ADD COLUMN attachment TEXT;
    """,
    # 7: scheduled tasks (issue 13). One row per task; ``next_due`` is advanced in the same
    # transaction that journals the run (message id ``task:<id>:<due>``), so a due time fires
    # exactly once, whatever crashes.
    """
    CREATE TABLE tasks (
        id INTEGER PRIMARY KEY,
        conversation_id INTEGER NOT NULL REFERENCES conversations(id),
        kind TEXT NOT NULL,
        spec TEXT NOT NULL,
        tz TEXT NOT NULL,
        text TEXT NOT NULL,
        created_at REAL NOT NULL,
        turn_id INTEGER,
        next_due REAL,
        status TEXT NOT NULL DEFAULT 'active',
        runs INTEGER NOT NULL DEFAULT 0,
        last_due REAL,
        ended_at REAL
    );
    CREATE INDEX tasks_due ON tasks (status, next_due);
    CREATE INDEX tasks_by_conversation ON tasks (conversation_id, status);
    """,
)

#: Rows changed per transaction by :meth:`Store.prune` and :meth:`Store.expire_outbox`: each
#: holds the write lock for a few milliseconds, so turns are never held up behind housekeeping.
HOUSEKEEPING_BATCH = 500


@dataclass(frozen=True, slots=True)
class ConversationRecord:
    """A conversation's row: its id, where it lives, and its current session number."""

    id: int
    chat: ChatRef
    session: int


@dataclass(frozen=True, slots=True)
class JournalEntry:
    """One journaled inbound message. ``media`` is what fetching its attachments gave
    (``bumblebot.media.intake.Prepared`` as JSON), ``None`` until they were fetched."""

    id: int
    inbound: Inbound
    status: str
    turn_id: int | None = None
    media: dict[str, Any] | None = None


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
    tool_call_id: str | None = None
    #: the platform message showing this row's text while it was streamed (edited into the
    #: first chunk when the row is delivered), ``None`` if none was shown
    preview_id: str | None = None
    #: the model is still writing the text: not to be sent by any sweep
    streaming: bool = False
    #: a file to send with (or, for a ``document``/``photo``, as) this message:
    #: ``{"kind": "photo"|"document"|"voice", "path": str|None, "name": str}``; a ``voice`` of
    #: a reply has no path until its speech is made (``bumblebot.delivery.outbox``)
    attachment: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class TaskRecord:
    """A scheduled task (``tasks`` row): ``kind`` ``once``/``every``/``cron`` with its ``spec``
    and time zone, the text to do, when it was made (epoch s), when it is due next (``None``
    once it has run for good), ``status`` ``active``/``done``/``cancelled``, how many times it
    ran, and the chat of its conversation."""

    id: int
    conversation_id: int
    chat: ChatRef
    kind: str
    spec: str
    tz: str
    text: str
    created_at: float
    next_due: float | None
    status: str
    runs: int
    last_due: float | None


class TooManyTasks(Exception):
    """A conversation already has the most active tasks it may (``automation.max_tasks``)."""


@dataclass(frozen=True, slots=True)
class Pruned:
    """What one :meth:`Store.prune` removed: rows deleted (``journal``, ``outbox``) and turns
    whose ``trace`` and ``state`` were cleared (``traces``)."""

    journal: int = 0
    outbox: int = 0
    traces: int = 0

    @property
    def total(self) -> int:
        return self.journal + self.outbox + self.traces


@dataclass(frozen=True, slots=True)
class CompactionState:
    summary: str | None
    compactions: int
    passes: int
    failures: int
    next_retry_at: float


@dataclass(frozen=True, slots=True)
class RunningTurn:
    """A turn left ``running`` by a crash or a stop past the grace period: resumable.

    Args:
        id: the turn id.
        conversation: the conversation it belongs to (``session`` is the current one).
        session: the session the turn started in.
        state: the turn's resumable state (JSON object written by the engine).
        trace: the trace saved with its last checkpoint.
        entries: the journal entries it answers, oldest first (steered ones included).
        legacy: written by a version without step checkpoints (schema 1): it has no messages
            and no state yet.
    """

    id: int
    conversation: ConversationRecord
    session: int
    state: dict[str, Any]
    trace: dict[str, Any]
    entries: list[JournalEntry]
    legacy: bool = False


class Store:
    """The daemon's database. Use ``async with Store(path) as store``.

    Args:
        path: the SQLite file (created with its directory when missing, unless ``readonly``).
        readonly: open for reading only (``bumblebot trace``): no migration, no write, so it
            is safe next to a running daemon of any version this code can read.

    Raises:
        StoreError: the file cannot be opened or its schema is newer than this code.
    """

    def __init__(self, path: Path, *, readonly: bool = False) -> None:
        self.path = path
        self.readonly = readonly
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
            if self.readonly:
                self._db = await aiosqlite.connect(f"file:{self.path}?mode=ro", uri=True, isolation_level=None)
            else:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._db = await aiosqlite.connect(self.path, isolation_level=None)
            self._db.row_factory = aiosqlite.Row
            await self._db.execute("PRAGMA busy_timeout=10000")
            if not self.readonly:
                await self._db.execute("PRAGMA journal_mode=WAL")
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
        if self.readonly:
            return
        for number, script in enumerate(MIGRATIONS[version:], start=version + 1):
            await self.db.executescript(f"BEGIN;\n{script}\nPRAGMA user_version={number};\nCOMMIT;")

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[aiosqlite.Connection]:
        """Serialise a write transaction; commits on success, rolls back on error."""
        async with self._write_lock:
            try:
                await self.db.execute("BEGIN IMMEDIATE")
            except sqlite3.OperationalError as exc:
                if "within a transaction" not in str(exc):
                    raise
                # a write cancelled while its BEGIN ran (the statement still ran in aiosqlite's
                # thread, its ROLLBACK never did) left one open: end it, or no write works again
                log.warning("a transaction was left open by a cancelled write; rolling it back")
                await self.db.execute("ROLLBACK")
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

    async def delete_kv(self, key: str) -> None:
        """Forget ``key`` (nothing happens when it is absent)."""
        async with self.transaction() as db:
            await db.execute("DELETE FROM kv WHERE key = ?", (key,))

    async def instance_id(self) -> str:
        """A random id of this database, made on first use (idempotency keys of sends)."""
        value = await self.get_kv(INSTANCE_KEY)
        if value is None:
            async with self.transaction() as db:
                await db.execute(
                    "INSERT OR IGNORE INTO kv (key, value) VALUES (?, ?)", (INSTANCE_KEY, secrets.token_hex(4))
                )
            value = await self.get_kv(INSTANCE_KEY)
        assert value is not None
        return value

    # -- conversations ------------------------------------------------------------------------

    async def conversation(self, chat: ChatRef) -> ConversationRecord:
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
        return ConversationRecord(id=int(row["id"]), chat=chat, session=int(row["session"]))

    async def reset(self, conversation_id: int, *, set_aside: list[int] | None = None) -> int:
        """Start a fresh session; old rows stay but are no longer loaded. ``set_aside``:
        journal ids of messages sent before the reset that no turn took; they are settled
        ``ignored`` in the same transaction. Returns the new session."""
        async with self.transaction() as db:
            await db.execute("UPDATE conversations SET session = session + 1 WHERE id = ?", (conversation_id,))
            now = time.time()
            await db.executemany(
                "UPDATE journal SET status='ignored', done_at=? WHERE id=? AND status='pending' AND turn_id IS NULL",
                [(now, i) for i in set_aside or ()],
            )
            async with db.execute("SELECT session FROM conversations WHERE id = ?", (conversation_id,)) as cur:
                row = await cur.fetchone()
        assert row is not None
        return int(row[0])

    # -- history ------------------------------------------------------------------------------

    async def history(self, conversation_id: int, session: int) -> list[Message]:
        """The active history of a session: messages not covered by a summary (pruned tool
        results as the placeholder), oldest first. Messages of a turn still ``running`` are
        left out: they are that turn's transcript until it finishes."""
        rows = await self._all(
            f"SELECT {_MESSAGE_COLUMNS} FROM messages WHERE conversation_id=? AND session=?"
            " AND covered_by IS NULL AND (turn_id IS NULL OR turn_id NOT IN"
            " (SELECT id FROM turns WHERE conversation_id=? AND status='running')) ORDER BY id",
            (conversation_id, session, conversation_id),
        )
        return _in_call_order([_message(r) for r in rows])

    async def turn_messages(self, turn_id: int) -> list[Message]:
        """Every message a turn has recorded so far, oldest first (tool results in call order)."""
        rows = await self._all(f"SELECT {_MESSAGE_COLUMNS} FROM messages WHERE turn_id=? ORDER BY id", (turn_id,))
        return _in_call_order([_message(r) for r in rows])

    async def import_history(self, conversation: ConversationRecord, messages: list[Message]) -> int:
        """Write ``messages`` into the current session as one finished turn (seeding, imports).

        Returns the turn id.
        """
        now = time.time()
        async with self.transaction() as db:
            cur = await db.execute(
                "INSERT INTO turns (conversation_id, session, status, started_at, ended_at, trace)"
                " VALUES (?, ?, 'done', ?, ?, '{}')",
                (conversation.id, conversation.session, now, now),
            )
            turn_id = cur.lastrowid
            assert turn_id is not None
            await _insert_messages(db, conversation.id, conversation.session, turn_id, messages)
        return turn_id

    # -- journal ------------------------------------------------------------------------------

    async def journal(
        self, inbound: Inbound, *, kv: dict[str, str] | None = None, status: str = "pending", background: bool = False
    ) -> int | None:
        """Record an accepted inbound message (and optional kv values) in one transaction.

        Args:
            status: ``pending`` (a turn will answer it) or ``ignored`` (handled without a turn:
                a command, a refusal, a group message not addressed to the bot).
            background: an ``ignored`` group message that later turns there may see as
                background (:meth:`background`).

        Returns:
            the journal id, or ``None`` when this (platform, chat, message id) was seen before.
        """
        c = inbound.chat
        inbound = inbound.storable()
        now = time.time()
        async with self.transaction() as db:
            cur = await db.execute(
                "INSERT OR IGNORE INTO journal (platform, chat_id, thread_id, message_id, update_id,"
                " sender_id, sender_name, chat_kind, source, text, quote, background, context_limit, status,"
                " received_at, done_at, attachments) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    c.platform.value, c.chat_id, c.thread_id, inbound.message_id, inbound.update_id,
                    inbound.sender_id, inbound.sender_name, inbound.chat_kind.value, inbound.source,
                    inbound.text, inbound.quote, int(background), inbound.background, status, now, None if status == "pending" else now,
                    _json([a.to_json() for a in inbound.attachments]) if inbound.attachments else None,
                ),
            )
            new_id = cur.lastrowid if cur.rowcount == 1 else None
            for key, value in (kv or {}).items():
                await db.execute("INSERT OR REPLACE INTO kv (key, value) VALUES (?, ?)", (key, value))
        return new_id

    async def pending_inbound(self) -> list[JournalEntry]:
        """Journaled messages whose turn has not finished, oldest first."""
        rows = await self._all("SELECT * FROM journal WHERE status = 'pending' ORDER BY id")
        return [self._journal_entry(r) for r in rows]

    async def background(self, chat: ChatRef, before: int, limit: int) -> list[Inbound]:
        """The last ``limit`` background messages of ``chat`` (journal ids below ``before``)
        since the last message there that a turn took, oldest first."""
        if limit <= 0:
            return []
        key = (chat.platform.value, chat.chat_id, chat.thread_id)
        rows = await self._all(
            "SELECT * FROM journal WHERE platform = ? AND chat_id = ? AND thread_id = ? AND background = 1"
            " AND id < ? AND id > COALESCE((SELECT MAX(id) FROM journal WHERE platform = ? AND chat_id = ?"
            " AND thread_id = ? AND turn_id IS NOT NULL AND id < ?), 0) ORDER BY id DESC LIMIT ?",
            (*key, before, *key, before, limit),
        )
        return [self._journal_entry(r).inbound for r in reversed(rows)]

    async def move_chat(self, old: ChatRef, new: ChatRef) -> bool:
        """Re-key ``old``'s conversations to ``new``'s chat id (Telegram's group → supergroup
        migration): history, summary and sessions continue there, and so do the journal
        entries still to answer or to show as background, and pending outbox rows.

        Moved journal entries get the message id ``<old chat id>:<message id>``: a supergroup
        numbers its messages afresh, and a new message must never look like a duplicate of an
        old one. Settled entries stay with the old id (the history is in ``messages``).

        Returns ``False`` (changing nothing) when ``new`` already has a conversation of its own
        while ``old`` has one too, or when there was nothing to move.
        """
        platform = old.platform.value
        async with self.transaction() as db:
            async def exists(chat_id: str) -> bool:
                async with db.execute(
                    "SELECT 1 FROM conversations WHERE platform = ? AND chat_id = ?", (platform, chat_id)
                ) as cur:
                    return await cur.fetchone() is not None

            has_old = await exists(old.chat_id)
            if has_old and await exists(new.chat_id):
                return False
            changed = 0
            if has_old:
                cur = await db.execute(
                    "UPDATE conversations SET chat_id = ? WHERE platform = ? AND chat_id = ?",
                    (new.chat_id, platform, old.chat_id),
                )
                changed += cur.rowcount
            # background already shown to a turn stays behind: only what came after the last
            # entry a turn took (per thread) moves, with the pending entries
            cur = await db.execute(
                "UPDATE journal SET chat_id = ?, message_id = ? || ':' || message_id"
                " WHERE platform = ? AND chat_id = ? AND (status = 'pending' OR (background = 1 AND id > COALESCE("
                "(SELECT MAX(j.id) FROM journal j WHERE j.platform = journal.platform AND j.chat_id = journal.chat_id"
                " AND j.thread_id = journal.thread_id AND j.turn_id IS NOT NULL), 0)))",
                (new.chat_id, old.chat_id, platform, old.chat_id),
            )
            changed += cur.rowcount
            cur = await db.execute(
                "UPDATE outbox SET chat_id = ? WHERE platform = ? AND chat_id = ? AND status = 'pending'",
                (new.chat_id, platform, old.chat_id),
            )
            changed += cur.rowcount
            return changed > 0

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
            quote=r["quote"],
            background=r["context_limit"],
            chat_kind=ChatKind(r["chat_kind"]),
            source=r["source"],
            update_id=r["update_id"],
            attachments=tuple(Attachment.from_json(a) for a in json.loads(r["attachments"] or "[]")),
        )
        media = json.loads(r["media"]) if r["media"] else None
        return JournalEntry(id=int(r["id"]), inbound=inbound, status=r["status"], turn_id=r["turn_id"], media=media)

    async def settle_journal(self, journal_ids: list[int], status: str) -> None:
        """Settle pending entries without a turn (``/stop`` while they waited)."""
        async with self.transaction() as db:
            await db.executemany(
                "UPDATE journal SET status=?, done_at=? WHERE id=? AND status='pending'",
                [(status, time.time(), i) for i in journal_ids],
            )

    async def replace_pending(self, journal_id: int, inbound: Inbound, *, keep_media: bool = False) -> bool:
        """An edit of a message no turn has taken yet: its text, quote and attachments become
        ``inbound``'s; what was fetched of its files is forgotten unless ``keep_media`` (the
        files did not change). ``False`` when the entry is no longer pending or a turn has it
        (the edit came too late)."""
        inbound = inbound.storable()
        media = "media" if keep_media else "NULL"
        async with self.transaction() as db:
            cur = await db.execute(
                f"UPDATE journal SET text=?, quote=?, attachments=?, media={media}"
                " WHERE id=? AND status='pending' AND turn_id IS NULL",
                (
                    inbound.text, inbound.quote,
                    _json([a.to_json() for a in inbound.attachments]) if inbound.attachments else None, journal_id,
                ),
            )
            return cur.rowcount == 1

    async def save_media(self, journal_id: int, media: dict[str, Any]) -> None:
        """Record what fetching a message's attachments gave (``JournalEntry.media``)."""
        async with self.transaction() as db:
            await db.execute("UPDATE journal SET media=? WHERE id=?", (_json(media), journal_id))

    # -- turns: step checkpoints ---------------------------------------------------------------
    #
    # A turn is written as it happens: ``begin_turn`` (the turn row and the user message),
    # ``record`` (each assistant message before its tools run, each tool result when it
    # completes, each message taken mid-turn), ``speak`` (an outbox row, with the assistant
    # message it shows when there is one, in one transaction), ``finish_turn`` (status, trace,
    # journal settlement). Only ``bumblebot/runtime/conversation.py`` calls these.

    async def begin_turn(
        self,
        conversation_id: int,
        session: int,
        journal_ids: list[int],
        user_message: Message,
        state: dict[str, Any],
    ) -> int:
        """Open a turn: its row (``running``), its user message, and the journal entries' turn id
        (they stay ``pending`` until it finishes), in one transaction. Returns the turn id."""
        async with self.transaction() as db:
            cur = await db.execute(
                "INSERT INTO turns (conversation_id, session, status, started_at, state)"
                " VALUES (?, ?, 'running', ?, ?)",
                (conversation_id, session, time.time(), _json(state)),
            )
            turn_id = cur.lastrowid
            assert turn_id is not None
            await _insert_messages(db, conversation_id, session, turn_id, [user_message])
            await db.executemany("UPDATE journal SET turn_id=? WHERE id=?", [(turn_id, j) for j in journal_ids])
        return turn_id

    async def record(
        self,
        conversation_id: int,
        session: int,
        turn_id: int,
        messages: list[Message],
        *,
        journal_ids: list[int] = (),  # type: ignore[assignment]
        state: dict[str, Any] | None = None,
        trace: dict[str, Any] | None = None,
    ) -> None:
        """Checkpoint: append ``messages`` to a running turn (setting their ``id``), attach
        ``journal_ids`` to it (messages taken mid-turn), and save its state and trace."""
        async with self.transaction() as db:
            await _insert_messages(db, conversation_id, session, turn_id, messages)
            if journal_ids:
                await db.executemany("UPDATE journal SET turn_id=? WHERE id=?", [(turn_id, j) for j in journal_ids])
            if state is not None:
                await db.execute("UPDATE turns SET state=? WHERE id=?", (_json(state), turn_id))
            if trace is not None:
                await db.execute("UPDATE turns SET trace=? WHERE id=?", (_json(trace), turn_id))

    async def speak(
        self,
        conversation_id: int,
        session: int,
        turn_id: int,
        chat: ChatRef,
        text: str,
        *,
        tool_call_id: str | None = None,
        message: Message | None = None,
        state: dict[str, Any] | None = None,
        stream: OutboxEntry | None = None,
        attachment: dict[str, Any] | None = None,
    ) -> OutboxEntry:
        """Queue ``text`` for delivery in the outbox and, when it shows as an assistant message
        of its own (a plain-text reply, a daemon note), record ``message`` in the same
        transaction: what the user will see and what the entity remembers are one fact. The
        turn's ``state`` is saved with it (a note that ends the turn says so there).

        ``stream`` is the turn's streaming row (:meth:`open_stream`) that showed this text as
        it was written: it becomes the message (its preview is edited into the final text)
        instead of a new row. ``attachment`` is a file to send with it (:attr:`OutboxEntry.attachment`)."""
        async with self.transaction() as db:
            if stream is None:
                outbox_id = await _insert_outbox(db, conversation_id, turn_id, chat, text, tool_call_id, attachment)
                preview_id = None
            else:
                outbox_id, preview_id = stream.id, stream.preview_id
                await db.execute(
                    "UPDATE outbox SET text=?, tool_call_id=?, streaming=0, attachment=? WHERE id=?",
                    (text, tool_call_id, _json(attachment) if attachment else None, outbox_id),
                )
            if message is not None:
                await _insert_messages(db, conversation_id, session, turn_id, [message])
            if state is not None:
                await db.execute("UPDATE turns SET state=? WHERE id=?", (_json(state), turn_id))
        return OutboxEntry(
            outbox_id, conversation_id, turn_id, chat, text, "pending", [], 0, None, tool_call_id, preview_id,
            attachment=attachment,
        )

    async def open_stream(self, conversation_id: int, turn_id: int, chat: ChatRef) -> OutboxEntry:
        """A row for a ``say`` whose text is still being streamed (``streaming``, no text yet);
        :meth:`speak` with ``stream=`` turns it into the message."""
        async with self.transaction() as db:
            cur = await db.execute(
                "INSERT INTO outbox (conversation_id, turn_id, platform, chat_id, thread_id, text, streaming,"
                " created_at) VALUES (?, ?, ?, ?, ?, '', 1, ?)",
                (conversation_id, turn_id, chat.platform.value, chat.chat_id, chat.thread_id, time.time()),
            )
            assert cur.lastrowid is not None
        return OutboxEntry(cur.lastrowid, conversation_id, turn_id, chat, "", "pending", [], 0, None, streaming=True)

    async def stream_previewed(self, outbox_id: int, preview_id: str, shown: str) -> None:
        """The platform message ``preview_id`` now shows the streaming row ``outbox_id``, with
        the text ``shown``."""
        async with self.transaction() as db:
            await db.execute("UPDATE outbox SET preview_id=?, text=? WHERE id=?", (preview_id, shown, outbox_id))

    async def settle_stream(self, outbox_id: int, *, status: str, text: str | None = None, error: str | None = None) -> None:
        """Close a streaming row without a ``say`` to show: ``failed`` (its preview was taken
        down, or never shown) or ``sent`` (``/stop``: the ``text`` shown so far stays, as
        the row's message)."""
        async with self.transaction() as db:
            await db.execute(
                "UPDATE outbox SET status=?, streaming=0, text=COALESCE(?, text), last_error=?,"
                " platform_message_ids=CASE WHEN ?='sent' AND preview_id IS NOT NULL"
                " THEN json_array(preview_id) ELSE platform_message_ids END,"
                " sent_at=CASE WHEN ?='sent' THEN ? ELSE sent_at END WHERE id=?",
                (status, text, error, status, status, time.time(), outbox_id),
            )

    async def upgrade_turn(self, conversation_id: int, session: int, turn_id: int, messages: list[Message], state: dict[str, Any]) -> None:
        """Give a legacy turn (see :meth:`running_turns`) its session, state and first messages."""
        async with self.transaction() as db:
            await db.execute("UPDATE turns SET session=?, state=? WHERE id=?", (session, _json(state), turn_id))
            await _insert_messages(db, conversation_id, session, turn_id, messages)

    async def finish_turn(
        self,
        turn_id: int,
        *,
        status: str,
        trace: dict[str, Any],
        journal_ids: list[int],
        journal_status: str = "done",
        state: dict[str, Any] | None = None,
    ) -> None:
        """Close a turn: its status (``done`` or ``failed``) and trace, and its journal entries
        (``done`` or ``failed``), in one transaction."""
        now = time.time()
        async with self.transaction() as db:
            await db.executemany(
                "UPDATE journal SET status=?, turn_id=?, done_at=? WHERE id=?",
                [(journal_status, turn_id, now, j) for j in journal_ids],
            )
            await db.execute(
                "UPDATE turns SET status=?, ended_at=?, trace=?, state=COALESCE(?, state) WHERE id=?",
                (status, now, _json(trace), None if state is None else _json(state), turn_id),
            )

    async def running_turns(self, platforms: set[str] | None = None) -> list[RunningTurn]:
        """Turns left ``running`` (a crash, or a stop past the grace period), oldest first.

        A turn written by a version without step checkpoints (no state, no messages) comes back
        with ``legacy`` set, so it can be rebuilt from its journal entries and the messages it
        had delivered; one that no longer answers any pending entry is marked ``interrupted``.

        Args:
            platforms: only conversations on these platforms (``None``: all), so that
                ``bumblebot chat`` never touches the turns of a daemon serving Telegram.
        """
        rows = await self._all(
            "SELECT t.id, t.session, t.state, t.trace, c.id AS cid, c.platform, c.chat_id, c.thread_id,"
            " c.session AS current, (SELECT COUNT(*) FROM messages m WHERE m.turn_id = t.id) AS n"
            " FROM turns t JOIN conversations c ON c.id = t.conversation_id"
            " WHERE t.status = 'running' ORDER BY t.id"
        )
        out: list[RunningTurn] = []
        stale: list[int] = []
        for r in rows:
            if platforms is not None and r["platform"] not in platforms:
                continue
            entries = [
                self._journal_entry(j)
                for j in await self._all(
                    "SELECT * FROM journal WHERE turn_id=? AND status='pending' ORDER BY id", (r["id"],)
                )
            ]
            legacy = not r["state"] or not r["n"] or r["session"] is None
            if legacy and not entries:
                stale.append(int(r["id"]))
                continue
            chat = ChatRef(Platform(r["platform"]), r["chat_id"], r["thread_id"])
            out.append(
                RunningTurn(
                    id=int(r["id"]),
                    conversation=ConversationRecord(int(r["cid"]), chat, int(r["current"])),
                    session=int(r["current"] if r["session"] is None else r["session"]),
                    state={} if legacy else json.loads(r["state"]),
                    trace=json.loads(r["trace"]) if r["trace"] else {},
                    entries=entries,
                    legacy=legacy,
                )
            )
        if stale:
            async with self.transaction() as db:
                await db.executemany(
                    "UPDATE turns SET status='interrupted', ended_at=? WHERE id=?", [(time.time(), i) for i in stale]
                )
        return out

    async def recent_turns(self, conversation_id: int | None = None, limit: int = 10) -> list[dict[str, Any]]:
        """The last ``limit`` turns (newest first) with their traces."""
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

    async def outbox_add(self, conversation_id: int, turn_id: int | None, chat: ChatRef, text: str) -> OutboxEntry:
        """Queue an out-of-turn message (a command's answer, a refusal) for delivery."""
        async with self.transaction() as db:
            outbox_id = await _insert_outbox(db, conversation_id, turn_id, chat, text, None)
        return OutboxEntry(outbox_id, conversation_id, turn_id, chat, text, "pending", [], 0, None)

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

    async def outbox_set_attachment(self, outbox_id: int, attachment: dict[str, Any]) -> None:
        """Record the file made for a row's attachment (a reply's speech, once synthesised)."""
        async with self.transaction() as db:
            await db.execute("UPDATE outbox SET attachment=? WHERE id=?", (_json(attachment), outbox_id))

    async def outbox_entry(self, outbox_id: int) -> OutboxEntry | None:
        row = await self._one("SELECT * FROM outbox WHERE id=?", (outbox_id,))
        return None if row is None else self._outbox_entry(row)

    async def outbox_pending(self) -> list[OutboxEntry]:
        rows = await self._all("SELECT * FROM outbox WHERE status='pending' AND streaming=0 ORDER BY id")
        return [self._outbox_entry(r) for r in rows]

    async def outbox_for_turn(self, turn_id: int) -> list[OutboxEntry]:
        """Every message a turn queued, oldest first (used to resume it after a crash)."""
        rows = await self._all("SELECT * FROM outbox WHERE turn_id=? ORDER BY id", (turn_id,))
        return [self._outbox_entry(r) for r in rows]

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
            expired += [(self._outbox_entry(r), float(r["created_at"])) for r in rows]
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
            tool_call_id=r["tool_call_id"],
            preview_id=r["preview_id"],
            streaming=bool(r["streaming"]),
            attachment=json.loads(r["attachment"]) if r["attachment"] else None,
        )

    # -- scheduled tasks ----------------------------------------------------------------------
    #
    # Written only by ``bumblebot/runtime/scheduler.py``.

    async def add_task(
        self, conversation_id: int, *, kind: str, spec: str, tz: str, text: str, due: float,
        turn_id: int | None, max_active: int,
    ) -> int:
        """A new active task; returns its id.

        Raises:
            TooManyTasks: the conversation has ``max_active`` active tasks already (checked in
                the same transaction).
        """
        async with self.transaction() as db:
            async with db.execute(
                "SELECT COUNT(*) FROM tasks WHERE conversation_id=? AND status='active'", (conversation_id,)
            ) as cur:
                row = await cur.fetchone()
            if row is not None and int(row[0]) >= max_active:
                raise TooManyTasks(f"this chat has {row[0]} scheduled tasks, the most it may have ({max_active})")
            cur = await db.execute(
                "INSERT INTO tasks (conversation_id, kind, spec, tz, text, created_at, turn_id, next_due)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (conversation_id, kind, spec, tz, text, time.time(), turn_id, due),
            )
            assert cur.lastrowid is not None
            return cur.lastrowid

    async def tasks(self, conversation_id: int | None = None, *, active: bool = True) -> list[TaskRecord]:
        """Tasks of a conversation (every conversation's when ``None``), by next due time."""
        where = ["t.status='active'"] if active else []
        params: list[Any] = []
        if conversation_id is not None:
            where.append("t.conversation_id=?")
            params.append(conversation_id)
        clause = f"WHERE {' AND '.join(where)}" if where else ""
        rows = await self._all(
            "SELECT t.*, c.platform, c.chat_id, c.thread_id FROM tasks t JOIN conversations c ON c.id = t.conversation_id"
            f" {clause} ORDER BY t.next_due IS NULL, t.next_due, t.id",
            tuple(params),
        )
        return [_task(r) for r in rows]

    async def cancel_task(self, conversation_id: int, task_id: int) -> bool:
        """Cancel an active task of this conversation; ``False`` when there is none by that id."""
        async with self.transaction() as db:
            cur = await db.execute(
                "UPDATE tasks SET status='cancelled', next_due=NULL, ended_at=? WHERE id=? AND conversation_id=?"
                " AND status='active'",
                (time.time(), task_id, conversation_id),
            )
            return cur.rowcount == 1

    async def due_tasks(self, now: float) -> list[TaskRecord]:
        """Active tasks due at or before ``now``, oldest due first."""
        rows = await self._all(
            "SELECT t.*, c.platform, c.chat_id, c.thread_id FROM tasks t JOIN conversations c ON c.id = t.conversation_id"
            " WHERE t.status='active' AND t.next_due <= ? ORDER BY t.next_due, t.id",
            (now,),
        )
        return [_task(r) for r in rows]

    async def next_task_due(self, platforms: set[str] | None = None) -> float | None:
        """The earliest due time of any active task (of ``platforms`` only, when given)."""
        if platforms is None:
            row = await self._one("SELECT MIN(next_due) FROM tasks WHERE status='active'")
        else:
            marks = ",".join("?" * len(platforms)) or "''"
            row = await self._one(
                "SELECT MIN(t.next_due) FROM tasks t JOIN conversations c ON c.id = t.conversation_id"
                f" WHERE t.status='active' AND c.platform IN ({marks})",
                tuple(platforms),
            )
        return None if row is None or row[0] is None else float(row[0])

    async def pending_run(self, chat: ChatRef, prefix: str) -> bool:
        """Whether a journal entry of ``chat`` whose message id starts with ``prefix`` is still
        pending (a scheduled run or an autonomous turn not answered yet)."""
        row = await self._one(_PENDING_RUN, (chat.platform.value, chat.chat_id, chat.thread_id, len(prefix), prefix))
        return row is not None

    async def task(self, task_id: int) -> TaskRecord | None:
        rows = await self._all(
            "SELECT t.*, c.platform, c.chat_id, c.thread_id FROM tasks t JOIN conversations c ON c.id = t.conversation_id"
            " WHERE t.id=?",
            (task_id,),
        )
        return _task(rows[0]) if rows else None

    async def fire_task(self, task: TaskRecord, inbound: Inbound, next_due: float | None) -> int | None:
        """Journal the run of ``task`` at its due time and move the task on (``next_due``, or
        ``done``), in one transaction; returns the journal id. ``None`` when this due time
        was journaled before, the task changed meanwhile (cancelled, fired), or its previous run
        is still waiting to be answered (then this due time is skipped, so runs never pile up)."""
        c = inbound.chat
        now = time.time()
        async with self.transaction() as db:
            cur = await db.execute(
                "UPDATE tasks SET next_due=?, status=?, runs=runs+1, last_due=?, ended_at=? WHERE id=? AND"
                " status='active' AND next_due=?",
                (next_due, "active" if next_due is not None else "done", task.next_due,
                 None if next_due is not None else now, task.id, task.next_due),
            )
            if cur.rowcount != 1:
                return None
            prefix = f"task:{task.id}:"
            async with db.execute(_PENDING_RUN, (c.platform.value, c.chat_id, c.thread_id, len(prefix), prefix)) as pending:
                if await pending.fetchone() is not None:
                    return None  # its last run is still waiting (an outage, a long turn): no pile-up
            cur = await db.execute(
                "INSERT OR IGNORE INTO journal (platform, chat_id, thread_id, message_id, update_id, sender_id,"
                " sender_name, chat_kind, source, text, quote, background, context_limit, status, received_at)"
                " VALUES (?, ?, ?, ?, NULL, ?, ?, ?, ?, ?, '', 0, 0, 'pending', ?)",
                (c.platform.value, c.chat_id, c.thread_id, inbound.message_id, inbound.sender_id, inbound.sender_name,
                 inbound.chat_kind.value, inbound.source, inbound.text, now),
            )
            return cur.lastrowid if cur.rowcount == 1 else None

    async def active_chats(self, since: float) -> list[tuple[ChatRef, str]]:
        """Conversations whose last message from a person that a turn answered (not a refused
        one, a command or background) came after ``since`` (epoch s), with its chat kind."""
        rows = await self._all(
            "SELECT platform, chat_id, thread_id, chat_kind, MAX(received_at) AS last FROM journal"
            " WHERE source='chat' AND background=0 AND turn_id IS NOT NULL"  # answered: not refused, not a command
            " GROUP BY platform, chat_id, thread_id HAVING last >= ?",
            (since,),
        )
        return [(ChatRef(Platform(r["platform"]), r["chat_id"], r["thread_id"]), r["chat_kind"]) for r in rows]

    async def chat_kind(self, chat: ChatRef) -> ChatKind:
        """Whether ``chat`` is private or a group, by the last message journaled there
        (private when none was)."""
        row = await self._one(
            "SELECT chat_kind FROM journal WHERE platform=? AND chat_id=? AND thread_id=? AND source='chat'"
            " ORDER BY id DESC LIMIT 1",
            (chat.platform.value, chat.chat_id, chat.thread_id),
        )
        return ChatKind(row["chat_kind"]) if row is not None else ChatKind.PRIVATE

    async def unprompted_sent(self, chat: ChatRef, since: float) -> int:
        """Messages autonomous turns queued to ``chat`` since ``since`` (epoch s), failed ones not counted."""
        row = await self._one(
            "SELECT COUNT(*) FROM outbox o WHERE o.platform=? AND o.chat_id=? AND o.thread_id=? AND o.created_at >= ?"
            " AND o.status != 'failed' AND o.turn_id IN (SELECT j.turn_id FROM journal j WHERE j.source='autonomous'"
            " AND j.platform=o.platform AND j.chat_id=o.chat_id AND j.thread_id=o.thread_id AND j.turn_id IS NOT NULL)",
            (chat.platform.value, chat.chat_id, chat.thread_id, since),
        )
        return int(row[0]) if row is not None else 0

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
        conversation_id: int,
        session: int,
        *,
        summary: str | None,
        covered_ids: list[int],
        pruned_ids: list[int],
        passes: int,
        failed: bool,
        next_retry_at: float = 0.0,
    ) -> CompactionState:
        """Persist one compaction: the summary, the messages it covers and those pruned.

        Returns the session's compaction state afterwards.
        """
        now = time.time()
        async with self.transaction() as db:
            await db.execute(
                "INSERT OR IGNORE INTO compaction (conversation_id, session, updated_at) VALUES (?, ?, ?)",
                (conversation_id, session, now),
            )
            if failed:
                await db.execute(
                    "UPDATE compaction SET failures=failures+1, next_retry_at=?, updated_at=?"
                    " WHERE conversation_id=? AND session=?",
                    (next_retry_at, now, conversation_id, session),
                )
            else:
                await db.execute(
                    "UPDATE compaction SET summary=?, compactions=compactions+?, passes=passes+?,"
                    " failures=0, next_retry_at=0, updated_at=? WHERE conversation_id=? AND session=?",
                    (summary, 1 if covered_ids else 0, passes, now, conversation_id, session),
                )
            async with db.execute(
                "SELECT * FROM compaction WHERE conversation_id=? AND session=?", (conversation_id, session)
            ) as cur:
                row = await cur.fetchone()
            assert row is not None
            number = int(row["compactions"])
            if covered_ids:
                await db.executemany(
                    "UPDATE messages SET covered_by=? WHERE id=?", [(number, i) for i in covered_ids]
                )
            if pruned_ids:
                await db.executemany("UPDATE messages SET pruned=1 WHERE id=?", [(i,) for i in pruned_ids])
        return CompactionState(
            row["summary"], number, int(row["passes"]), int(row["failures"]), float(row["next_retry_at"])
        )


#: A journal entry of a chat, still pending, whose message id starts with a prefix.
_PENDING_RUN = (
    "SELECT 1 FROM journal WHERE platform=? AND chat_id=? AND thread_id=? AND status='pending'"
    " AND substr(message_id, 1, ?) = ? LIMIT 1"
)
_MESSAGE_COLUMNS = "id, role, content, tool_calls, tool_call_id, name, pruned, ok, note, images"


def _task(r: aiosqlite.Row) -> TaskRecord:
    return TaskRecord(
        id=int(r["id"]), conversation_id=int(r["conversation_id"]),
        chat=ChatRef(Platform(r["platform"]), r["chat_id"], r["thread_id"]), kind=r["kind"], spec=r["spec"],
        tz=r["tz"], text=r["text"], created_at=float(r["created_at"]),
        next_due=None if r["next_due"] is None else float(r["next_due"]), status=r["status"], runs=int(r["runs"]),
        last_due=None if r["last_due"] is None else float(r["last_due"]),
    )


def _json(value: Any) -> str:
    return json_text(value, default=str)


def _tool_calls(r: aiosqlite.Row) -> list[dict[str, Any]] | None:
    """A row's tool calls, healed once as they are read (``messages.sound_call``)."""
    return [sound_call(c) for c in json.loads(r["tool_calls"])] if r["tool_calls"] else None


def _message(r: aiosqlite.Row) -> Message:
    if r["pruned"] and r["role"] == "assistant":  # an old step of a turn that outgrew the window
        full = Message(role="assistant", content=r["content"], tool_calls=_tool_calls(r), id=int(r["id"]), note=bool(r["note"]))
        return full.with_clipped_calls()
    return Message(
        role=r["role"],
        content=PRUNED_PLACEHOLDER if r["pruned"] else r["content"],
        tool_calls=_tool_calls(r),
        tool_call_id=r["tool_call_id"],
        name=r["name"],
        id=int(r["id"]),
        pruned=bool(r["pruned"]),
        ok=None if r["ok"] is None else bool(r["ok"]),
        note=bool(r["note"]),
        images=json.loads(r["images"]) if r["images"] else None,
    )


def _in_call_order(messages: list[Message]) -> list[Message]:
    """Each block of tool results sorted into the order of the calls that precede it.

    Results are written as each call completes, so parallel calls land in completion order;
    some chat templates pair results with calls by position.
    """
    out: list[Message] = []
    order: dict[str, int] = {}
    block: list[Message] = []

    def flush() -> None:
        block.sort(key=lambda m: order.get(m.tool_call_id or "", len(order)))
        out.extend(block)
        block.clear()

    for m in messages:
        if m.role == "tool":
            block.append(m)
            continue
        flush()
        out.append(m)
        if m.role == "assistant" and m.tool_calls:
            order = {cid: i for i, cid in enumerate(m.tool_call_ids)}
    flush()
    return out


async def _insert_messages(
    db: aiosqlite.Connection, conversation_id: int, session: int, turn_id: int, messages: list[Message]
) -> None:
    now = time.time()
    for m in messages:
        cur = await db.execute(
            "INSERT INTO messages (conversation_id, session, turn_id, role, content, tool_calls,"
            " tool_call_id, name, ok, note, created_at, images) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                conversation_id, session, turn_id, m.role, m.content,
                json.dumps(m.tool_calls) if m.tool_calls else None, m.tool_call_id, m.name,
                None if m.ok is None else int(m.ok), int(m.note), now,
                json.dumps(m.images) if m.images else None,
            ),
        )
        m.id = cur.lastrowid


async def _insert_outbox(
    db: aiosqlite.Connection, conversation_id: int, turn_id: int | None, chat: ChatRef, text: str,
    tool_call_id: str | None, attachment: dict[str, Any] | None = None,
) -> int:
    cur = await db.execute(
        "INSERT INTO outbox (conversation_id, turn_id, platform, chat_id, thread_id, text, tool_call_id,"
        " created_at, attachment) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (conversation_id, turn_id, chat.platform.value, chat.chat_id, chat.thread_id, text, tool_call_id, time.time(),
         _json(attachment) if attachment else None),
    )
    assert cur.lastrowid is not None
    return cur.lastrowid
