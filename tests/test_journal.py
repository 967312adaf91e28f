"""The journal (``bumblebot/store/journal.py``): every accepted message, as it came."""

from __future__ import annotations

import dataclasses

from bumblebot.core.events import ChatKind, ChatRef, Inbound, Platform
from bumblebot.store import Store


async def test_a_paste_part_is_still_one_after_a_restart(tmp_path, store_location):
    """The adapter marks a message its client cut from a long paste; read back after a restart
    (and after an edit) the journal still says so, so the turn still waits for the next part."""
    chat = ChatRef(Platform.TELEGRAM, "5")
    part = Inbound(chat, "1", "7", "Ada", "x" * 3950, ChatKind.PRIVATE, paste_part=True)
    plain = Inbound(chat, "2", "7", "Ada", "and a question", ChatKind.PRIVATE)
    async with Store(store_location) as store:
        first = await store.journal(part)
        await store.journal(plain)
    async with Store(store_location) as store:
        entries = await store.pending_inbound()
        assert [e.inbound.paste_part for e in entries] == [True, False]
        assert await store.replace_pending(first, dataclasses.replace(part, text="short now", paste_part=False))
        assert [e.inbound.paste_part for e in await store.pending_inbound()] == [False, False]
