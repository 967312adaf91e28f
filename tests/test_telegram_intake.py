"""Telegram intake (adapters/telegram/intake.py): edits of a waiting message, and the message a reply quotes."""

from __future__ import annotations

import asyncio

from conftest import running, write_config
from fakes.openai_server import is_loop
from fakes.telegram_server import BOT_USER
from support import (
    FRESH,
    Gate,
    contents,
    handled,
    journal_texts,
    judges_say_done,
    loop_requests,
    say,
    user_text,
)


async def test_telegram_edit_of_a_queued_message_is_what_the_model_sees(tmp_path, llm, tg):
    """The message waits behind a running turn (``mid_turn_messages: queue``); the person edits
    it meanwhile. The next turn answers the edited text; the first text never reaches the model."""
    judges_say_done(llm)
    first = Gate(say("one moment"))
    llm.push(first, when=lambda r: is_loop(r) and "hello" in user_text(r))
    llm.push(say("Paris"), when=lambda r: is_loop(r) and "capital" in user_text(r))
    config = write_config(tmp_path, llm, tg, cognition={"mid_turn_messages": "queue", "classifier": False})
    async with running(config) as d:
        tg.push_text("hello", chat_id=5)
        await asyncio.wait_for(first.entered.wait(), 5)
        queued = tg.push_text("what is the capital of Spain?", chat_id=5)
        edit = tg.push_edit(5, queued["message"]["message_id"], "what is the capital of France?")
        await handled(tg, edit)
        first.release.set()
        await d.engine.wait_for_turns(2)
    assert tg.sent(5) == ["one moment", "Paris"]
    second = loop_requests(llm)[-1]
    assert "what is the capital of France?" in user_text(second)
    assert all("Spain" not in contents(r) for r in loop_requests(llm))
    assert ("what is the capital of France?", "done") in journal_texts(tmp_path)


async def test_telegram_a_later_edit_is_ignored_and_answered_once(tmp_path, llm, tg):
    """An edit after the turn took the message (and an edit of a command) changes nothing: no
    second answer, no new turn, the command is not run again."""
    judges_say_done(llm)
    llm.push(say("Madrid"), when=lambda r: is_loop(r) and "Spain" in user_text(r))
    async with running(write_config(tmp_path, llm, tg)) as d:
        asked = tg.push_text("what is the capital of Spain?", chat_id=6)
        await d.engine.wait_for_turns(1)
        tg.push_edit(6, asked["message"]["message_id"], "what is the capital of France?")
        status = tg.push_text("/status", chat_id=6)
        await tg.wait_for("sendMessage", n=2)
        tg.push_edit(6, status["message"]["message_id"], "/reset")  # after it ran
        later = tg.push_text("/status", chat_id=6)  # updates are handled in order: the edits first
        await handled(tg, later)
        await tg.wait_for("sendMessage", n=3)
        finished = d.engine.progress.turns_finished
    sent = tg.sent(6)
    assert sent[0] == "Madrid" and len(sent) == 3 and not any(t.startswith(FRESH) for t in sent)
    assert finished == 1 and len(loop_requests(llm)) == 1
    assert all("France" not in contents(r) for r in llm.requests)


async def test_telegram_a_reply_in_a_private_chat_shows_what_it_replies_to(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(say("The meeting is at noon."), when=lambda r: is_loop(r) and "meeting" in user_text(r))
    llm.push(say("Room 4."), when=lambda r: is_loop(r) and "where" in user_text(r))
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("when is the meeting?", chat_id=21)
        await d.engine.wait_for_turns(1)
        ours = max(m for (c, m), msg in tg.messages.items() if c == 21 and msg["from"]["id"] == BOT_USER["id"])
        tg.push_text("and where?", chat_id=21, reply_to=ours)
        await d.engine.wait_for_turns(2)
    assert user_text(loop_requests(llm)[1]).endswith("[Replying to you: The meeting is at noon.]\nand where?")
