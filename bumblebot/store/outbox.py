"""The outbox: every message the engine asked to deliver, the ``outbox`` table.

Each row holds the text (or a file), the ``say`` call it answers (``tool_call_id``), its
status (``pending``, ``sent`` or ``failed``), the platform ids of the chunks delivered so far
and the last error. Delivery (``bumblebot/delivery/outbox.py``) queues out-of-turn messages
and records each attempt here (a row sent marks its conversation active,
``conversations.last_active_at``), and a resumed turn reads back what it had queued. A turn
queues its own rows, and its streaming rows, through the turn writers (``turns.py``, with
:func:`insert_outbox`); housekeeping expires the rows nobody could send
(``housekeeping.py``, with :func:`outbox_entry_from_row`).
"""

from __future__ import annotations

import json
import time
from typing import Any

import aiosqlite

from bumblebot.core.events import ChatRef, Platform
from bumblebot.store.connection import Database, Writes, unfenced
from bumblebot.store.records import OutboxEntry
from bumblebot.store.schema import to_json


class OutboxTables(Database):
    """The ``outbox`` table as delivery sees it (part of :class:`bumblebot.store.Store`)."""

    async def outbox_add(self, conversation_id: int, turn_id: int | None, chat: ChatRef, text: str) -> OutboxEntry:
        """Queue an out-of-turn message (a command's answer, a refusal) for delivery."""
        row_id = await self.insert(*outbox_insert(conversation_id, turn_id, chat, text, None))
        return OutboxEntry(row_id, conversation_id, turn_id, chat, text, "pending", [], 0, None)

    async def outbox_progress(
        self, outbox_id: int, *, status: str, message_ids: list[str], error: str | None = None
    ) -> None:
        """Record a delivery attempt: status ``pending`` (retry later), ``sent`` or ``failed``
        (``sent`` also marks the conversation active, in the same transaction). A row once
        ``sent`` stays so. ``sent`` is recorded under no fence: a worker that lost the
        conversation during the send still records what reached the chat, so that its next
        worker does not send it again."""
        now = time.time()
        update = (
            (
                "UPDATE outbox SET status=?, platform_message_ids=?, attempts=attempts+1, last_error=?,"
                " sent_at=CASE WHEN ?='sent' THEN ? ELSE sent_at END WHERE id=? AND (status<>'sent' OR ?='sent')"
            ),
            (status, json.dumps(message_ids), error, status, now, outbox_id, status),
        )
        if status != "sent":
            await write_status(self, update, outbox_id, status, now)
            return
        with unfenced():
            await write_status(self, update, outbox_id, status, now)

    async def outbox_chunks_sent(self, outbox_id: int, message_ids: list[str]) -> None:
        """Record the chunks of a message delivered so far (a retry resumes after them); under
        no fence, like a row's ``sent``."""
        with unfenced():
            await self.write("UPDATE outbox SET platform_message_ids=? WHERE id=?", (json.dumps(message_ids), outbox_id))

    async def outbox_set_attachment(self, outbox_id: int, attachment: dict[str, Any]) -> None:
        """Record the file made for a row's attachment (a reply's speech, once synthesised)."""
        await self.write("UPDATE outbox SET attachment=? WHERE id=?", (to_json(attachment), outbox_id))

    async def outbox_entry(self, outbox_id: int) -> OutboxEntry | None:
        row = await self._one("SELECT * FROM outbox WHERE id=?", (outbox_id,))
        return None if row is None else outbox_entry_from_row(row)

    async def outbox_pending(self, chat: ChatRef | None = None) -> list[OutboxEntry]:
        """The rows waiting to be sent, oldest first (those of ``chat`` alone, if given)."""
        if chat is None:
            rows = await self._all("SELECT * FROM outbox WHERE status='pending' AND streaming=0 ORDER BY id")
        else:
            rows = await self._all(
                "SELECT * FROM outbox WHERE status='pending' AND streaming=0 AND platform=? AND chat_id=? AND thread_id=?"
                " ORDER BY id", (chat.platform.value, chat.chat_id, chat.thread_id),
            )
        return [outbox_entry_from_row(r) for r in rows]

    async def outbox_for_turn(self, turn_id: int) -> list[OutboxEntry]:
        """Every message a turn queued, oldest first (used to resume it after a crash)."""
        rows = await self._all("SELECT * FROM outbox WHERE turn_id=? ORDER BY id", (turn_id,))
        return [outbox_entry_from_row(r) for r in rows]


async def write_status(db: Database, update: tuple[str, tuple[Any, ...]], outbox_id: int, status: str, at: float) -> None:
    """Run ``update`` on outbox row ``outbox_id``; when it makes the row ``sent``, mark its
    conversation active at ``at`` in the same transaction."""
    if status != "sent":
        await db.write(*update)
        return
    async with db.transaction() as conn:
        await conn.execute(*update)
        await conn.execute(*touch_sent(outbox_id, at))


def touch_sent(outbox_id: int, at: float) -> tuple[str, tuple[Any, ...]]:
    """The statement that marks the conversation of outbox row ``outbox_id`` active at ``at``
    (a row of it was sent; the console lists conversations by ``last_active_at``)."""
    return (
        (
            "UPDATE conversations SET last_active_at = MAX(COALESCE(last_active_at, 0), ?)"
            " WHERE id = (SELECT conversation_id FROM outbox WHERE id = ?)"
        ),
        (at, outbox_id),
    )


def outbox_entry_from_row(r: aiosqlite.Row) -> OutboxEntry:
    """The outbox entry of an ``outbox`` row (``SELECT *``)."""
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


async def insert_outbox(
    db: Writes, conversation_id: int, turn_id: int | None, chat: ChatRef, text: str,
    tool_call_id: str | None, attachment: dict[str, Any] | None = None,
) -> int:
    """Queue a message inside the caller's transaction ``db``; returns the row id."""
    row_id = await db.insert(*outbox_insert(conversation_id, turn_id, chat, text, tool_call_id, attachment))
    assert row_id is not None
    return row_id


def outbox_insert(
    conversation_id: int, turn_id: int | None, chat: ChatRef, text: str, tool_call_id: str | None,
    attachment: dict[str, Any] | None = None,
) -> tuple[str, tuple[Any, ...]]:
    """The statement that queues a message, and its parameters."""
    return (
        "INSERT INTO outbox (conversation_id, turn_id, platform, chat_id, thread_id, text, tool_call_id,"
        " created_at, attachment) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (conversation_id, turn_id, chat.platform.value, chat.chat_id, chat.thread_id, text, tool_call_id, time.time(),
         to_json(attachment) if attachment else None),
    )
