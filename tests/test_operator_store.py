"""The operator's tables (``bumblebot/store/operator.py``) on a real SQLite file: titles,
pauses and blocked senders survive reopening; ``Store.chat_of``."""

from __future__ import annotations

from pathlib import Path

from bumblebot.core.events import ChatRef, Platform
from bumblebot.store import Store


async def test_titles_pauses_and_blocks_survive_reopening(tmp_path: Path, store_location):
    path = store_location
    group = ChatRef(Platform.TELEGRAM, "-100", "7")
    async with Store(path) as store:
        await store.conversation(ChatRef(Platform.TELEGRAM, "5"))
        await store.set_title(group.key, "Climbing club")  # no row yet: made
        await store.set_title(group.key, "Climbing club!")
        assert await store.set_paused(group.key, True)
        first = (await store._one("SELECT paused_at FROM conversations WHERE chat_id='-100'"))[0]  # type: ignore[index]
        assert await store.set_paused(group.key, True)  # pausing again keeps when it began
        assert not await store.set_paused("discord:42", True)  # no such conversation
        assert await store.block_sender("telegram", "99") and not await store.block_sender("telegram", "99")
        assert await store.block_sender("discord", "1")
    async with Store(path) as store:
        row = await store._one("SELECT title, paused_at FROM conversations WHERE chat_id='-100'")
        assert row is not None and (row[0], row[1]) == ("Climbing club!", first)
        assert await store.paused_conversations() == {group.key}
        assert await store.blocked_senders() == {("telegram", "99"), ("discord", "1")}
        assert await store.unblock_sender("telegram", "99") and not await store.unblock_sender("telegram", "99")
        assert await store.set_paused(group.key, False)
        assert await store.paused_conversations() == set()
        assert await store.blocked_senders() == {("discord", "1")}
        assert await store.chat_of(group.key) == group
        assert await store.chat_of("telegram:5") == ChatRef(Platform.TELEGRAM, "5")
        assert await store.chat_of("telegram:6") is None and await store.chat_of("nonsense") is None
