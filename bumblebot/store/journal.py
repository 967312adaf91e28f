"""The journal: every accepted inbound message, the ``journal`` table.

One row per message, unique per (platform, chat_id, message_id), so a platform's redelivery
is recognised. ``status`` is ``pending`` until the turn that answers it finishes, then ``done``
or ``failed``; ``ignored`` for messages handled without a turn. Journaling a message marks its
conversation active (``conversations.last_active_at``, :func:`touch_chat`). An unaddressed group message
is kept as ``background`` for the next turn there; ``attachments`` are the files to fetch and
``media`` what fetching them gave.

Other writers touch journal rows inside their own transactions: the turn writers
(``turns.py``) attach entries to turns and settle them, ``reset`` and ``move_chat``
(``conversations.py``) set aside or re-key a chat's entries, and ``fire_task`` (``tasks.py``)
journals a scheduled run. :func:`journal_entry_from_row` makes a row a :class:`JournalEntry`
(here and for ``running_turns``).
"""

from __future__ import annotations

import json
import time
from typing import Any

import aiosqlite

from bumblebot.core.events import Attachment, ChatKind, ChatRef, Inbound, Platform
from bumblebot.store.connection import SET_KV, Database
from bumblebot.store.records import JournalEntry
from bumblebot.store.schema import to_json


class JournalTables(Database):
    """The ``journal`` table (part of :class:`bumblebot.store.Store`)."""

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
            new_id = await db.insert(
                "INSERT INTO journal (platform, chat_id, thread_id, message_id, update_id,"
                " sender_id, sender_name, chat_kind, source, text, quote, background, context_limit, status,"
                " received_at, done_at, attachments, paste_part) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
                " ON CONFLICT DO NOTHING",
                (
                    c.platform.value, c.chat_id, c.thread_id, inbound.message_id, inbound.update_id,
                    inbound.sender_id, inbound.sender_name, inbound.chat_kind.value, inbound.source,
                    inbound.text, inbound.quote, int(background), inbound.background, status, now, None if status == "pending" else now,
                    to_json([a.to_json() for a in inbound.attachments]) if inbound.attachments else None,
                    int(inbound.paste_part),
                ),
            )
            if new_id is not None:
                await db.execute(*touch_chat(c, now))
            for key, value in (kv or {}).items():
                await db.execute(SET_KV, (key, value))
        return new_id

    async def pending_inbound(self, chat: ChatRef | None = None) -> list[JournalEntry]:
        """Journaled messages whose turn has not finished, oldest first (only ``chat``'s, if given)."""
        if chat is not None:
            rows = await self._all(
                "SELECT * FROM journal WHERE status = 'pending' AND platform = ? AND chat_id = ? AND thread_id = ?"
                " ORDER BY id", (chat.platform.value, chat.chat_id, chat.thread_id),
            )
            return [journal_entry_from_row(r) for r in rows]
        rows = await self._all("SELECT * FROM journal WHERE status = 'pending' ORDER BY id")
        return [journal_entry_from_row(r) for r in rows]

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
        return [journal_entry_from_row(r).inbound for r in reversed(rows)]

    async def journal_entry(self, journal_id: int) -> JournalEntry | None:
        row = await self._one("SELECT * FROM journal WHERE id = ?", (journal_id,))
        return None if row is None else journal_entry_from_row(row)

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
                f"UPDATE journal SET text=?, quote=?, attachments=?, paste_part=?, media={media}"
                " WHERE id=? AND status='pending' AND turn_id IS NULL",
                (
                    inbound.text, inbound.quote,
                    to_json([a.to_json() for a in inbound.attachments]) if inbound.attachments else None,
                    int(inbound.paste_part), journal_id,
                ),
            )
            return cur.rowcount == 1

    async def save_media(self, journal_id: int, media: dict[str, Any]) -> None:
        """Record what fetching a message's attachments gave (``JournalEntry.media``)."""
        await self.write("UPDATE journal SET media=? WHERE id=?", (to_json(media), journal_id))


def touch_chat(chat: ChatRef, at: float) -> tuple[str, tuple[Any, ...]]:
    """The statement that marks ``chat``'s conversation (if it has one yet) active at ``at``:
    a message journaled there (the console lists conversations by ``last_active_at``)."""
    return (
        (
            "UPDATE conversations SET last_active_at = MAX(COALESCE(last_active_at, 0), ?)"
            " WHERE platform = ? AND chat_id = ? AND thread_id = ?"
        ),
        (at, chat.platform.value, chat.chat_id, chat.thread_id),
    )


def journal_entry_from_row(r: aiosqlite.Row) -> JournalEntry:
    """The journal entry of a ``journal`` row (``SELECT *``)."""
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
        paste_part=bool(r["paste_part"]),
    )
    media = json.loads(r["media"]) if r["media"] else None
    return JournalEntry(id=int(r["id"]), inbound=inbound, status=r["status"], turn_id=r["turn_id"], media=media)
