"""What the operator decides about conversations and people: titles, pauses, blocked senders.

* ``conversations.title``: the chat's name as its platform gives it (a group's title, a
  private chat's person, ``#channel in guild``), written by the engine when it changes.
* ``conversations.paused_at``: set while the operator has paused the conversation (no turn
  runs there, its tasks wait); ``NULL`` otherwise.
* ``blocked_senders``: the people (platform and sender id) whose messages are journaled and
  never answered, in any chat.

Each survives a restart; the engine reads them at start and keeps them in memory
(``bumblebot/runtime/operations.py``). Written only by the engine.
"""

from __future__ import annotations

import time

from bumblebot.core.events import ChatRef, Platform
from bumblebot.store.connection import Database

_WHERE_CHAT = "platform = ? AND chat_id = ? AND thread_id = ?"


def _chat(key: str) -> tuple[str, str, str]:
    chat = ChatRef.from_key(key)
    return chat.platform.value, chat.chat_id, chat.thread_id


class OperatorTables(Database):
    """Titles, pauses and blocked senders (part of :class:`bumblebot.store.Store`)."""

    async def set_title(self, key: str, title: str) -> None:
        """The title of the conversation ``key`` (its row is made when it has none yet)."""
        await self.write(
            "INSERT INTO conversations (platform, chat_id, thread_id, created_at, title) VALUES (?, ?, ?, ?, ?)"
            " ON CONFLICT (platform, chat_id, thread_id) DO UPDATE SET title = excluded.title"
            " WHERE conversations.title != excluded.title",
            (*_chat(key), time.time(), title),
        )

    async def set_paused(self, key: str, paused: bool) -> bool:
        """Pause (keeping the time it was first paused) or resume the conversation ``key``;
        ``False`` when it has no row."""
        cur = await self.write(
            "UPDATE conversations SET paused_at = CASE WHEN ? = 1 THEN COALESCE(paused_at, ?) ELSE NULL END"
            f" WHERE {_WHERE_CHAT}",
            (int(paused), time.time(), *_chat(key)),
        )
        return cur.rowcount == 1

    async def paused_conversations(self) -> set[str]:
        """The keys of the conversations paused now."""
        rows = await self._all(
            "SELECT platform, chat_id, thread_id FROM conversations WHERE paused_at IS NOT NULL"
        )
        return {ChatRef(Platform(r["platform"]), r["chat_id"], r["thread_id"]).key for r in rows}

    async def block_sender(self, platform: str, sender_id: str) -> bool:
        """Block ``sender_id`` on ``platform``; ``False`` when already blocked."""
        cur = await self.write(
            "INSERT INTO blocked_senders (platform, sender_id, blocked_at) VALUES (?, ?, ?) ON CONFLICT DO NOTHING",
            (platform, sender_id, time.time()),
        )
        return cur.rowcount == 1

    async def unblock_sender(self, platform: str, sender_id: str) -> bool:
        """Unblock ``sender_id`` on ``platform``; ``False`` when they were not blocked."""
        cur = await self.write("DELETE FROM blocked_senders WHERE platform = ? AND sender_id = ?", (platform, sender_id))
        return cur.rowcount == 1

    async def blocked_senders(self) -> set[tuple[str, str]]:
        """Every blocked ``(platform, sender_id)``."""
        rows = await self._all("SELECT platform, sender_id FROM blocked_senders")
        return {(str(r["platform"]), str(r["sender_id"])) for r in rows}
