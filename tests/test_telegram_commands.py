"""Telegram commands (adapters/telegram/commands.py): another bot's command is not run; commands move the offset."""

from __future__ import annotations

import pytest
from conftest import running, write_config
from fakes.openai_server import is_loop
from support import FRESH, contents, db, handled, judges_say_done, loop_requests, say, user_text

GROUP = -500


@pytest.mark.parametrize(("chat_id", "chat_type", "prefix"), [(11, "private", ""), (GROUP, "group", "@fake_bot ")])
async def test_telegram_reset_for_another_bot_resets_nothing_and_ours_still_does(
    tmp_path, llm, tg, chat_id, chat_type, prefix
):
    """``/reset@other_bot`` (Telegram, a private chat and a group): no reset, no reply; the
    history is still there. ``/reset@Fake_Bot`` (getMe's username, any case) resets."""
    judges_say_done(llm)
    tg.member_status[(GROUP, 7)] = "administrator"  # in a group only admins may reset
    sender = {"chat_id": chat_id, "user_id": 7, "chat_type": chat_type}
    llm.push(say("noted"), when=is_loop)
    llm.push(say("pineapple"), when=lambda r: is_loop(r) and "which word" in user_text(r))
    llm.push(say("no idea"), when=lambda r: is_loop(r) and "and now" in user_text(r))
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text(f"{prefix}remember the word pineapple", **sender)
        await d.engine.wait_for_turns(1)
        other = tg.push_text("/reset@other_bot", **sender)
        await handled(tg, other)
        assert tg.sent(chat_id) == ["noted"]  # no "Fresh start", no "Unknown command"
        tg.push_text(f"{prefix}which word?", **sender)
        await d.engine.wait_for_turns(2)
        tg.push_text("/reset@Fake_Bot", **sender)
        await tg.wait_for("sendMessage", n=3)
        tg.push_text(f"{prefix}and now?", **sender)
        await d.engine.wait_for_turns(3)
    assert tg.sent(chat_id)[:2] == ["noted", "pineapple"] and tg.sent(chat_id)[2].startswith(FRESH)
    which, now = loop_requests(llm)[1:]
    assert "remember the word pineapple" in contents(which)  # the history survived the other bot's /reset
    assert "pineapple" not in contents(now)


async def test_reset_for_another_bot_followed_by_punctuation_resets_nothing(tmp_path, llm, tg):
    """``/reset@other_bot.`` (and ``,``, ``!``, ``-bot``) is for other_bot (a username ends at the
    first character it cannot hold): this bot's conversation is not reset."""
    judges_say_done(llm)
    llm.push(say("Noted."), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as daemon:
        tg.push_text("remember 42", chat_id=184)
        await daemon.engine.wait_for_turns(1)
        for command in ("/reset@other_bot.", "/reset@other_bot, please", "/reset@other_bot!", "/reset@other-bot"):
            tg.push_text(command, chat_id=184)
        tg.push_text("/status", chat_id=184)  # answered after the four: they were handled by then
        await tg.wait_for("sendMessage", n=2, predicate=lambda p: p.get("chat_id") == 184)
    assert not any("Fresh start" in t for t in tg.sent(184))
    assert db(tmp_path).execute("SELECT session FROM conversations").fetchone() == (1,)


async def test_command_moves_the_stored_telegram_offset(tmp_path, llm, tg):
    async with running(write_config(tmp_path, llm, tg)) as d:
        update = tg.push_text("/help", chat_id=6)
        await tg.wait_for("sendMessage")
        offset = await d.store.get_kv("telegram.offset")
    assert offset == str(update["update_id"] + 1)
