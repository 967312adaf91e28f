"""A session's history and its compaction state: the ``messages`` and ``compaction`` tables.

``messages`` holds the full history in OpenAI chat form, written step by step while a turn
runs (:func:`insert_messages`, also used by the turn writers in ``turns.py``). ``ok`` is a
tool result's success, ``note`` marks the daemon's own messages, ``context`` is the
``[Turn context]`` a turn's first user message was sent with, ``pruned`` marks tool
results that compaction replaced by a placeholder in prompts, ``covered_by`` marks messages
folded into a compaction summary. Nothing is deleted, ever. ``compaction`` holds, per
(conversation, session), the current summary, counters and failure backoff.
"""

from __future__ import annotations

import json
import time
from typing import Any

import aiosqlite

from bumblebot.core.events import blank
from bumblebot.core.messages import NOTHING_READABLE, Message, TurnContext, json_text, sound_call
from bumblebot.store.connection import Database, Writes
from bumblebot.store.records import CompactionState, ConversationRecord

PRUNED_PLACEHOLDER = "[Old tool output cleared to save context space]"
_MESSAGE_COLUMNS = "id, role, content, tool_calls, tool_call_id, name, pruned, ok, note, images, context"


class HistoryTables(Database):
    """The ``messages`` and ``compaction`` tables (part of :class:`bumblebot.store.Store`)."""

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
            turn_id = await db.insert(
                "INSERT INTO turns (conversation_id, session, status, started_at, ended_at, trace)"
                " VALUES (?, ?, 'done', ?, ?, '{}')",
                (conversation.id, conversation.session, now, now),
            )
            assert turn_id is not None
            await insert_messages(db, conversation.id, conversation.session, turn_id, messages)
        return turn_id

    async def set_context(self, message_id: int, context: TurnContext | None) -> None:
        """Record the ``[Turn context]`` a turn's first user message is sent with."""
        await self.write(
            "UPDATE messages SET context=? WHERE id=?",
            (json_text(context.to_json()) if context is not None else None, message_id),
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
                "INSERT INTO compaction (conversation_id, session, updated_at) VALUES (?, ?, ?) ON CONFLICT DO NOTHING",
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


def _tool_calls(r: aiosqlite.Row) -> list[dict[str, Any]] | None:
    """A row's tool calls, healed once as they are read (``messages.sound_call``)."""
    return [sound_call(c) for c in json.loads(r["tool_calls"])] if r["tool_calls"] else None


def _content(r: aiosqlite.Row) -> str:
    """A row's text as requests carry it: a pruned tool result as the placeholder, and a user
    text that shows nothing (an older version stored some) as :data:`NOTHING_READABLE`."""
    if r["pruned"]:
        return PRUNED_PLACEHOLDER
    if r["role"] == "user" and blank(r["content"]):
        return NOTHING_READABLE
    return str(r["content"])


def _message(r: aiosqlite.Row) -> Message:
    if r["pruned"] and r["role"] == "assistant":  # an old step of a turn that outgrew the window
        full = Message(role="assistant", content=r["content"], tool_calls=_tool_calls(r), id=int(r["id"]), note=bool(r["note"]))
        return full.with_clipped_calls()
    return Message(
        role=r["role"],
        content=_content(r),
        tool_calls=_tool_calls(r),
        tool_call_id=r["tool_call_id"],
        name=r["name"],
        id=int(r["id"]),
        pruned=bool(r["pruned"]),
        ok=None if r["ok"] is None else bool(r["ok"]),
        note=bool(r["note"]),
        images=json.loads(r["images"]) if r["images"] else None,
        context=TurnContext.from_json(json.loads(r["context"])) if r["context"] else None,
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


async def insert_messages(
    db: Writes, conversation_id: int, session: int, turn_id: int, messages: list[Message]
) -> None:
    """Append ``messages`` to a turn of a session inside the caller's transaction ``db``,
    setting each one's ``id``; each is made storable first (``Message.make_storable``: what is
    in memory is what is on disk, and no blank user text is ever stored)."""
    now = time.time()
    for m in messages:
        m.make_storable()
        m.id = await db.insert(
            "INSERT INTO messages (conversation_id, session, turn_id, role, content, tool_calls,"
            " tool_call_id, name, ok, note, created_at, images, context)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                conversation_id, session, turn_id, m.role, m.content,
                json_text(m.tool_calls) if m.tool_calls else None, m.tool_call_id, m.name,
                None if m.ok is None else int(m.ok), int(m.note), now,
                json_text(m.images) if m.images else None,
                json_text(m.context.to_json()) if m.context is not None else None,
            ),
        )
