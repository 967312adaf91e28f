"""The database schema: :data:`MIGRATIONS`, applying them, and how JSON columns are written.

Schema versions are applied in order from :data:`MIGRATIONS` and recorded in
``PRAGMA user_version`` (13 now; on PostgreSQL, the ``schema_version`` table); each runs in one transaction with its version number, so a
crash leaves the database at the version before or after, never between. A database newer
than this code is refused. The tables are described in the module that writes each and in
``docs/architecture.md``.
"""

from __future__ import annotations

from typing import Any

import aiosqlite

from bumblebot.core.errors import StoreError
from bumblebot.core.messages import json_text
from bumblebot.core.store_settings import shown_url as postgres_shown
from bumblebot.store import dialect

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
    # 2: step checkpoints, so that a turn cut short by a crash can be resumed where it stopped.
    # Tool results keep their ok flag, daemon notes are marked, outbox rows name the say call
    # that made them, turns keep their session and resumable state, and a journal entry can
    # end as failed.
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
    # 3: retention. Pruning walks rows by age, oldest first, a batch at a time; these
    # indexes keep each batch a short range scan (turns: only those that still have a trace).
    """
    CREATE INDEX journal_by_age ON journal (received_at);
    CREATE INDEX outbox_by_age ON outbox (created_at);
    CREATE INDEX turns_with_trace ON turns (started_at) WHERE trace IS NOT NULL;
    """,
    # 4: groups. A message can quote the one it replies to; an unaddressed group
    # message is kept as background for the next turn there.
    """
    ALTER TABLE journal ADD COLUMN quote TEXT NOT NULL DEFAULT '';
    ALTER TABLE journal ADD COLUMN background INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE journal ADD COLUMN context_limit INTEGER NOT NULL DEFAULT 0;
    CREATE INDEX journal_by_chat ON journal (platform, chat_id, thread_id, id);
    """,
    # 5: streaming. A row is ``streaming`` while the model is still writing its
    # text (no sweep sends it); ``preview_id`` is the platform message showing it meanwhile,
    # which the final text replaces by an edit.
    """
    ALTER TABLE outbox ADD COLUMN streaming INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE outbox ADD COLUMN preview_id TEXT;
    """,
    # 6: media. An inbound message's files (``attachments``: what to fetch) and
    # what fetching them gave (``media``: transcripts, saved paths, image references), so a
    # restart never downloads or transcribes twice; a message's images (references to files
    # under <data_dir>/media, never the bytes); a file or voice message to send.
    """
    ALTER TABLE journal ADD COLUMN attachments TEXT;
    ALTER TABLE journal ADD COLUMN media TEXT;
    ALTER TABLE messages ADD COLUMN images TEXT;
    ALTER TABLE outbox ADD COLUMN attachment TEXT;
    """,
    # 7: scheduled tasks. One row per task; ``next_due`` is advanced in the same
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
    # 8: a message the platform's client cut from a long paste (``Inbound.paste_part``, which
    # its adapter decides): after a restart its turn still waits for the next part.
    """
    ALTER TABLE journal ADD COLUMN paste_part INTEGER NOT NULL DEFAULT 0;
    """,
    # 9: what model requests used, per UTC day, conversation, sender, kind, background or not,
    # endpoint and model (``usage.py``).
    """
    CREATE TABLE usage (
        day TEXT NOT NULL,
        conversation TEXT NOT NULL DEFAULT '',
        sender TEXT NOT NULL DEFAULT '',
        kind TEXT NOT NULL,
        background INTEGER NOT NULL DEFAULT 0,
        endpoint TEXT NOT NULL,
        model TEXT NOT NULL,
        requests INTEGER NOT NULL DEFAULT 0,
        prompt_tokens INTEGER NOT NULL DEFAULT 0,
        cached_tokens INTEGER NOT NULL DEFAULT 0,
        completion_tokens INTEGER NOT NULL DEFAULT 0,
        reasoning_tokens INTEGER NOT NULL DEFAULT 0,
        estimated INTEGER NOT NULL DEFAULT 0,
        audio_seconds REAL NOT NULL DEFAULT 0,
        cost REAL NOT NULL DEFAULT 0,
        priced INTEGER NOT NULL DEFAULT 0,
        PRIMARY KEY (day, conversation, sender, kind, background, endpoint, model)
    );
    CREATE INDEX usage_by_conversation ON usage (conversation, day);
    CREATE INDEX usage_by_sender ON usage (sender, day);
    """,
    # 10: the [Turn context] a turn's first user message was sent with (JSON, ``TurnContext``),
    # sent again with it in later requests so that each repeats the one before as a prefix.
    """
    ALTER TABLE messages ADD COLUMN context TEXT;
    """,
    # 11: the operator's hand (``operator.py``): a conversation's title as its platform names
    # it, whether the operator paused it (and since when), and the senders the operator blocked.
    """
    ALTER TABLE conversations ADD COLUMN title TEXT NOT NULL DEFAULT '';
    ALTER TABLE conversations ADD COLUMN paused_at REAL;
    CREATE INDEX conversations_paused ON conversations (id) WHERE paused_at IS NOT NULL;
    CREATE TABLE blocked_senders (
        platform TEXT NOT NULL,
        sender_id TEXT NOT NULL,
        blocked_at REAL NOT NULL,
        PRIMARY KEY (platform, sender_id)
    );
    """,
    # 12: the operator's console reads (``console.py``), each a short range of an index.
    # ``last_active_at`` (epoch s) is when a message was last journaled in the conversation or
    # an outbox row of it sent (set where the store writes those), its list's order; it starts
    # as the newest message journaled or recorded there. A session's history is read a page at
    # a time from the messages a summary does not cover, with a probe of those it covers for
    # the compaction boundaries between them. The overview's sums per day and its reply latency
    # (messages from people that a turn took; when each turn's first row was sent) read covering
    # indexes only.
    """
    ALTER TABLE conversations ADD COLUMN last_active_at REAL;
    UPDATE conversations SET last_active_at = MAX(
        created_at,
        COALESCE((SELECT MAX(j.received_at) FROM journal j WHERE j.platform = conversations.platform
            AND j.chat_id = conversations.chat_id AND j.thread_id = conversations.thread_id), 0),
        COALESCE((SELECT MAX(m.created_at) FROM messages m WHERE m.conversation_id = conversations.id), 0)
    );
    CREATE INDEX conversations_by_activity ON conversations (last_active_at, id);
    CREATE INDEX turns_by_conversation ON turns (conversation_id, id);
    CREATE INDEX turns_by_status ON turns (status, id);
    CREATE INDEX turns_by_start ON turns (started_at);
    CREATE INDEX messages_active ON messages (conversation_id, session, id) WHERE covered_by IS NULL;
    CREATE INDEX messages_covered ON messages (conversation_id, session, id) WHERE covered_by IS NOT NULL;
    CREATE INDEX usage_day_sums ON usage (day, requests, prompt_tokens, completion_tokens, cached_tokens, cost);
    CREATE INDEX journal_answered ON journal (received_at, turn_id, source, background)
        WHERE source = 'chat' AND background = 0 AND turn_id IS NOT NULL;
    CREATE INDEX outbox_sent_by_turn ON outbox (turn_id, sent_at, status) WHERE status = 'sent';
    """,
    # 13: workers sharing one PostgreSQL (``leases.py``): who holds what, until when, under which
    # fencing token (it grows by one at each change of holder and never goes back), the workers
    # seen, and what one worker passes to the worker of a conversation (a command, an edit).
    # SQLite has one process and never writes them.
    """
    CREATE TABLE leases (
        name TEXT PRIMARY KEY,
        owner TEXT NOT NULL,
        token INTEGER NOT NULL,
        expires_at REAL NOT NULL,
        acquired_at REAL NOT NULL
    );
    CREATE INDEX leases_by_owner ON leases (owner, name);
    CREATE TABLE workers (
        name TEXT PRIMARY KEY,
        host TEXT NOT NULL,
        pid INTEGER NOT NULL,
        started_at REAL NOT NULL,
        seen_at REAL NOT NULL
    );
    CREATE TABLE relayed (
        id INTEGER PRIMARY KEY,
        conversation TEXT NOT NULL,
        kind TEXT NOT NULL,
        payload TEXT NOT NULL,
        created_at REAL NOT NULL
    );
    CREATE INDEX relayed_by_conversation ON relayed (conversation, id);
    """,
)


#: PostgreSQL's record of the schema version (SQLite's is ``PRAGMA user_version``)
_PG_VERSION = "CREATE TABLE IF NOT EXISTS schema_version (version BIGINT NOT NULL)"
#: the advisory lock that lets one process of several migrate at a time (any fixed number)
_PG_MIGRATION_LOCK = 0x62756D62


async def migrate(db: Any, *, readonly: bool) -> None:
    """Bring ``db`` (an aiosqlite connection, or :class:`bumblebot.store.postgres.Connection`)
    up to the newest schema (only check it when ``readonly``).

    On PostgreSQL each migration is :func:`bumblebot.store.dialect.schema` of the same script,
    run holding an advisory lock, so that of several workers starting at once one migrates and
    the others find the version done.

    Raises:
        StoreError: the database's schema is newer than this code.
    """
    if isinstance(db, aiosqlite.Connection):
        async with db.execute("PRAGMA user_version") as cur:
            row = await cur.fetchone()
        version = _checked(int(row[0]) if row else 0)
        if readonly:
            return
        for number, script in enumerate(MIGRATIONS[version:], start=version + 1):
            await db.executescript(f"BEGIN;\n{script}\nPRAGMA user_version={number};\nCOMMIT;")
        return
    if readonly:
        exists = (await db.execute_fetchall("SELECT to_regclass('schema_version') IS NOT NULL"))[0][0]
        if not exists:
            raise StoreError(f"no Bumblebot database in {postgres_shown(db.url)} yet (nothing has run there)")
        _checked(int((await db.execute_fetchall("SELECT COALESCE(MAX(version), 0) FROM schema_version"))[0][0]))
        return
    await db.executescript(
        f"BEGIN; SELECT pg_advisory_xact_lock({_PG_MIGRATION_LOCK}); {_PG_VERSION};"
        " INSERT INTO schema_version SELECT 0 WHERE NOT EXISTS (SELECT 1 FROM schema_version); COMMIT;"
    )
    while True:
        await db.execute("BEGIN")
        try:
            await db.execute(f"SELECT pg_advisory_xact_lock({_PG_MIGRATION_LOCK})")
            version = _checked(int((await db.execute_fetchall("SELECT version FROM schema_version"))[0][0]))
            if version == len(MIGRATIONS):
                await db.execute("COMMIT")
                return
            await db.executescript(f"{dialect.schema(MIGRATIONS[version])}\nUPDATE schema_version SET version = {version + 1};")
            await db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                await db.execute("ROLLBACK")
            raise


def _checked(version: int) -> int:
    if version > len(MIGRATIONS):
        raise StoreError(
            f"database schema version {version} is newer than this Bumblebot "
            f"(knows {len(MIGRATIONS)}); upgrade Bumblebot"
        )
    return version


def to_json(value: Any) -> str:
    """A value as the text of a JSON column (anything JSON cannot hold written as its ``str``)."""
    return json_text(value, default=str)
