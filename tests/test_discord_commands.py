"""Discord text commands (adapters/discord/commands.py): a command for another bot is ignored."""

from __future__ import annotations

from fakes.openai_server import is_loop
from support import (
    CHANNEL_ID,
    FRESH,
    GUILD_ID,
    contents,
    discord_barrier,
    discord_bot,
    discord_config,
    journal_texts,
    judges_say_done,
    loop_requests,
    say,
    user_text,
)


async def test_discord_reset_for_another_bot_is_ignored_and_ours_still_resets(tmp_path, llm, dc):
    """``/reset@other_bot`` used to reset this bot's conversation on Discord (``/Reset@anything``
    was taken as ours). Now: in a DM and with a mention in a guild, nothing is run, journaled or
    answered; ``/Reset@FakeBot`` (the bot's username, any case) still resets."""
    judges_say_done(llm)
    dc.add_guild(GUILD_ID, [CHANNEL_ID], name="Hive")
    llm.push(say("noted"), when=lambda r: is_loop(r) and "remember" in user_text(r))
    llm.push(say("pineapple"), when=lambda r: is_loop(r) and "which word" in user_text(r))
    llm.push(say("no idea"), when=lambda r: is_loop(r) and "and now" in user_text(r))
    async with discord_bot(dc, discord_config(tmp_path, llm, dc)) as d:
        dm = dc.dm_channel_id()
        await dc.send_dm("remember the word pineapple")
        await d.engine.wait_for_turns(1)
        dm_other = await dc.send_dm("/reset@other_bot")
        guild_other = await dc.send_guild_message("/reset@other_bot", GUILD_ID, CHANNEL_ID, mention_bot=True)
        await discord_barrier(dc, 1)
        assert dc.messages_sent(dm) == ["noted"] and dc.messages_sent(CHANNEL_ID) == []
        await dc.send_dm("which word?")
        await d.engine.wait_for_turns(2)
        await dc.send_dm("/Reset@FakeBot")
        await dc.wait_for_call("POST", f"/channels/{dm}/messages", n=3, status=200)
        await dc.send_dm("and now?")
        await d.engine.wait_for_turns(3)
    sent = dc.messages_sent(dm)
    assert sent[:2] == ["noted", "pineapple"] and sent[2].startswith(FRESH) and sent[3] == "no idea"
    which, now = loop_requests(llm)[1:]
    assert "remember the word pineapple" in contents(which)
    assert "pineapple" not in contents(now)
    journaled = [t for t, _ in journal_texts(tmp_path)]
    assert "/reset@other_bot" not in journaled and dm_other["id"] != guild_other["id"]
