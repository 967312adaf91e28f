"""Conversations: one row per (platform, chat_id, thread_id) and its current session.

``conversation`` gets or creates a chat's row; ``reset`` starts a fresh session (older sessions
stay for audit and are never sent to the model) and settles, in the same transaction, the
journal entries sent before it that no turn took; ``move_chat`` re-keys a chat whose id
changed (Telegram's group → supergroup migration), with the journal and outbox rows that
still have to follow it.
"""

from __future__ import annotations

import time

from bumblebot.core.events import ChatRef
from bumblebot.store.connection import Database
from bumblebot.store.records import ConversationRecord


class ConversationTables(Database):
    """The ``conversations`` table (part of :class:`bumblebot.store.Store`)."""

    async def conversation(self, chat: ChatRef) -> ConversationRecord:
        """Get or create the conversation of ``chat``."""
        sql = "SELECT id, session FROM conversations WHERE platform=? AND chat_id=? AND thread_id=?"
        params = (chat.platform.value, chat.chat_id, chat.thread_id)
        row = await self._one(sql, params)
        if row is None:
            async with self.transaction() as db:
                now = time.time()
                await db.execute(
                    "INSERT INTO conversations (platform, chat_id, thread_id, created_at, last_active_at)"
                    " VALUES (?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                    (*params, now, now),
                )
            row = await self._one(sql, params)
        assert row is not None
        return ConversationRecord(id=int(row["id"]), chat=chat, session=int(row["session"]))

    async def chat_of(self, key: str) -> ChatRef | None:
        """The chat of the conversation ``key``; ``None`` when there is no such conversation
        (or ``key`` is not a conversation key)."""
        try:
            chat = ChatRef.from_key(key)
        except ValueError:
            return None
        row = await self._one(
            "SELECT 1 FROM conversations WHERE platform=? AND chat_id=? AND thread_id=?",
            (chat.platform.value, chat.chat_id, chat.thread_id),
        )
        return None if row is None else chat

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
