"""Text as the store keeps it: a session's history (``bumblebot/store/history.py``) holds no
blank user text and no lone surrogate, and one an older version left there is healed as it is
read; no other write fails on a lone surrogate either (``bumblebot/store/connection.py``)."""

from __future__ import annotations

import sqlite3
import time

from conftest import running, write_config
from fakes.openai_server import is_loop
from support import contents, judges_say_done, loop_requests, say

from bumblebot.core.events import Attachment, AttachmentKind, ChatKind, ChatRef, Inbound, Platform
from bumblebot.core.messages import NOTHING_READABLE, Message
from bumblebot.store import Store


async def _older_version_left(path, chat: ChatRef, user_text: str) -> None:
    """What an older version left: a finished turn whose user message is ``user_text`` (it
    stored a voice note that could not be transcribed as ``''``), answered by a daemon note."""
    async with Store(path) as store:
        conversation = await store.conversation(chat)
    db = sqlite3.connect(path)
    with db:
        now = time.time()
        turn = db.execute(
            "INSERT INTO turns (conversation_id, session, status, started_at, ended_at, trace) VALUES (?, ?, 'done', ?, ?, '{}')",
            (conversation.id, conversation.session, now, now),
        ).lastrowid
        for role, content, note in (("user", user_text, 0), ("assistant", "I couldn't use your voice message.", 1)):
            db.execute(
                "INSERT INTO messages (conversation_id, session, turn_id, role, content, note, created_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (conversation.id, conversation.session, turn, role, content, note, now),
            )
    db.close()


async def test_a_blank_user_message_an_older_version_stored_is_read_as_a_placeholder(tmp_path, llm, tg):
    """A user message stored with content '' made an endpoint that refuses blank text (the fake,
    like Anthropic through OpenRouter) refuse every later turn of the chat with 400."""
    judges_say_done(llm)
    llm.push(say("here again"), when=lambda r: is_loop(r) and "hello again" in contents(r))
    await _older_version_left(tmp_path / "data" / "bumblebot.db", ChatRef(Platform.TELEGRAM, "31"), "")
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("hello again", chat_id=31)
        await tg.wait_for("sendMessage")
        await d.engine.wait_for_turns(1)
    assert tg.sent(31) == ["here again"] and not llm.violations
    users = [m["content"] for m in loop_requests(llm)[0]["messages"] if m["role"] == "user"]
    assert users[0] == NOTHING_READABLE


async def test_no_blank_user_text_and_no_lone_surrogate_is_ever_stored(tmp_path):
    """Written through the store, a blank user text becomes the placeholder and a lone surrogate
    U+FFFD, in the row and in the message the caller holds (memory and disk agree)."""
    chat = ChatRef(Platform.TELEGRAM, "32")
    blank = Message(role="user", content=" \u200b ")
    broken = Message(role="user", content="half \udc80 a character")
    call = Message(role="assistant", tool_calls=[
        {"id": "c1", "type": "function", "function": {"name": "remember", "arguments": '{"fact": "x\\ud800y"}'}},
    ])
    async with Store(tmp_path / "db.sqlite") as store:
        conversation = await store.conversation(chat)
        await store.import_history(conversation, [blank, broken, call])
        history = await store.history(conversation.id, conversation.session)
    assert [m.content for m in history[:2]] == [NOTHING_READABLE, "half \ufffd a character"]
    assert (blank.content, broken.content) == (NOTHING_READABLE, "half \ufffd a character")
    assert history[2].tool_calls[0]["function"]["arguments"] == '{"fact": "x\ufffdy"}'
    rows = sqlite3.connect(tmp_path / "db.sqlite").execute("SELECT content, tool_calls FROM messages ORDER BY id").fetchall()
    assert rows[0][0] == NOTHING_READABLE and "\\ud800" not in rows[2][1]


async def test_every_write_takes_a_lone_surrogate_as_u_fffd(tmp_path, store_location):
    """SQLite takes text as UTF-8, which has no lone surrogate: a write holding one raised
    UnicodeEncodeError, and JSON columns kept it as an escape that read back raw (a transcript
    in ``journal.media`` then failed ``begin_turn`` for ever)."""
    chat = ChatRef(Platform.TELEGRAM, "33")
    document = Attachment(AttachmentKind.DOCUMENT, "file-1", name="notes\udc80.txt", mime="text/plain")
    inbound = Inbound(chat, "1", "33", "Ada", "see \ud83d this", ChatKind.PRIVATE, attachments=(document,))
    async with Store(store_location) as store:
        journal_id = await store.journal(inbound)
        assert journal_id is not None
        await store.save_media(journal_id, {"text": "[Voice message, transcribed]: hi \ud83d", "usable": 1})
        await store.set_kv("note", "odd \udfff")
        entry = await store.journal_entry(journal_id)
        kept = await store.get_kv("note")
    assert entry is not None and entry.media is not None
    assert entry.media["text"] == "[Voice message, transcribed]: hi \ufffd" and kept == "odd \ufffd"
    assert entry.inbound.text == "see \ufffd this" and entry.inbound.attachments[0].name == "notes\ufffd.txt"
