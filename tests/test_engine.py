"""The engine (bumblebot/runtime/engine.py): what it accepts and journals, and what it keeps for the next start."""

from __future__ import annotations

from conftest import running, write_config
from fakes.openai_server import is_loop
from support import ZERO_WIDTH, FlakyConsole, contents, db, judges_say_done, loop_requests, say

from bumblebot.core.events import ChatKind, ChatRef, Inbound, Platform
from bumblebot.store import Store

# -- messages that show nothing or cannot be stored as they came -------------------------------


async def test_a_message_of_only_zero_width_characters_never_becomes_a_message(tmp_path, llm, tg):
    """The failing input: a message of only zero-width characters was stored as a user message,
    and an endpoint that refuses blank text (Anthropic through OpenRouter) then failed on every
    later turn."""
    judges_say_done(llm)
    llm.push(say("Hello!"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as daemon:
        tg.push_text(ZERO_WIDTH, chat_id=166)
        tg.push_text("\u3164 \u2800", chat_id=166)  # a Hangul filler and a blank Braille pattern
        tg.push_text("hi", chat_id=166)
        await daemon.engine.wait_for_turns(1)
        await daemon.engine.wait_until(lambda: daemon.engine.idle)
    assert tg.sent(166) == ["Hello!"]
    assert llm.violations == []
    [request] = loop_requests(llm)
    users = [m["content"] for m in request["messages"] if m["role"] == "user"]
    assert len(users) == 1 and "\u200b" not in users[0] and users[0].rstrip().endswith("hi")
    conn = db(tmp_path)
    assert conn.execute("SELECT status FROM journal ORDER BY id").fetchall() == [("ignored",), ("ignored",), ("done",)]
    assert conn.execute("SELECT COUNT(*) FROM messages WHERE role='user'").fetchone() == (1,)


async def test_a_lone_surrogate_in_a_message_neither_blocks_intake_nor_is_lost(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(say("got the odd one"), when=lambda r: is_loop(r) and "bad" in contents(r))
    llm.push(say("hello other"), when=lambda r: is_loop(r) and "normal" in contents(r))
    async with running(write_config(tmp_path, llm, tg)):
        tg.push_text("bad \ud83d text", chat_id=25)
        tg.push_text("normal message", chat_id=26)
        await tg.wait_for("sendMessage", n=2)
    assert tg.sent(25) == ["got the odd one"] and tg.sent(26) == ["hello other"]


# -- what waits for the next start -------------------------------------------------------------


async def test_chat_mode_does_not_answer_pending_telegram_messages(tmp_path, llm, tg):
    """A Telegram message left pending must wait for `bumblebot run`, not be answered by `chat`."""
    from bumblebot.app.cli import Daemon
    from bumblebot.core.config import Secrets, load_settings
    from bumblebot.core.entity import load_entity

    config = write_config(tmp_path, llm, tg)
    async with Store(tmp_path / "data" / "bumblebot.db") as store:
        await store.journal(Inbound(ChatRef(Platform.TELEGRAM, "7"), "1", "7", "Al", "hello?", ChatKind.PRIVATE))
    daemon = Daemon(load_settings(config), Secrets(OPENAI_API_KEY="sk-x"), load_entity("default"))
    await daemon.start(adapters=[FlakyConsole(fail_on_call=set())])
    try:
        assert daemon.engine is not None and daemon.engine.loaded_conversations == 0
    finally:
        await daemon.stop()
    assert llm.requests == []
    async with Store(tmp_path / "data" / "bumblebot.db") as store:
        assert len(await store.pending_inbound()) == 1


async def test_message_arriving_while_stopping_is_kept_for_the_next_start(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(say("answered after restart"), when=is_loop)
    config = write_config(tmp_path, llm, tg)
    late = Inbound(ChatRef(Platform.TELEGRAM, "8"), "77", "8", "Late", "am I lost?", ChatKind.PRIVATE)
    async with running(config) as d:
        assert d.engine is not None
        d.engine._accepting = False  # what stop() does first
        d.engine._stopped = True
        assert await d.engine.submit(late)  # e.g. a Discord message during shutdown
        assert llm.requests == []
    async with running(config) as d:
        await tg.wait_for("sendMessage")
    assert tg.sent(8) == ["answered after restart"]
    assert "am I lost?" in contents(loop_requests(llm)[0])
