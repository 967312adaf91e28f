"""Discord replies (adapters/discord/replies.py): the model sees what a reply quotes; a forward is no reply."""

from __future__ import annotations

from fakes.openai_server import is_loop
from support import (
    CHANNEL_ID,
    GUILD_ID,
    discord_bot,
    discord_config,
    judges_say_done,
    loop_requests,
    say,
    user_text,
)

from adapters.discord.replies import DELETED_QUOTE, QUOTE_CHARS


async def test_discord_a_reply_shows_the_model_what_it_replies_to(tmp_path, llm, dc):
    """A reply in a guild to someone else's message, in a DM to the bot's own message, to a
    deleted message, and to one the client must fetch (once); a forward is no reply."""
    judges_say_done(llm)
    dc.add_guild(GUILD_ID, [CHANNEL_ID], name="Hive")
    bob = dc.human("2000000000000000009", "bob")
    for n in range(1, 6):
        llm.push(say(f"answer {n}"), when=lambda r, n=n: is_loop(r) and f"question {n}" in user_text(r))
    long = "the build is red because of the cache\n\n  " + "and the flaky test " * 20
    async with discord_bot(dc, discord_config(tmp_path, llm, dc)) as d:
        dm = dc.dm_channel_id()
        told = await dc.send_guild_message(long, GUILD_ID, CHANNEL_ID, author=bob)  # not for the bot
        await dc.send_guild_message("question 1: is he right?", GUILD_ID, CHANNEL_ID, mention_bot=True,
                                    referenced_message=told)
        await d.engine.wait_for_turns(1)
        await dc.send_dm("question 2")
        await d.engine.wait_for_turns(2)
        ours = dc.created_messages(dm)[-1]
        await dc.send_dm("question 3: why?", referenced_message=ours)
        await d.engine.wait_for_turns(3)
        gone = dc.message_payload("question 4: and this?", dm, referenced_message=told)
        gone["referenced_message"] = None  # Discord: the replied-to message was deleted
        await dc.dispatch("MESSAGE_CREATE", gone)
        await d.engine.wait_for_turns(4)
        old = dc.message_payload("an old note about the roadmap", dm)  # never seen by the client
        fetch = dc.message_payload("question 5: still true?", dm, referenced_message=old)
        del fetch["referenced_message"]  # Discord did not resolve it: the client looks it up
        await dc.dispatch("MESSAGE_CREATE", fetch)
        await d.engine.wait_for_turns(5)
    q1, q2, q3, q4, q5 = (user_text(r) for r in loop_requests(llm))
    shown = " ".join(long.split())[: QUOTE_CHARS - 1] + "…"
    assert f"[alice]: [Replying to bob: {shown}]\nquestion 1: is he right?" in q1
    assert "Replying to" not in q2
    assert q3.endswith("[Replying to you: answer 2]\nquestion 3: why?")
    assert q4.endswith(f"[Replying to {DELETED_QUOTE}]\nquestion 4: and this?")
    assert q5.endswith("[Replying to alice: an old note about the roadmap]\nquestion 5: still true?")
    assert len(dc.matching_calls("GET", f"/channels/{dm}/messages/{old['id']}")) == 1


async def test_discord_a_forward_is_not_a_reply(tmp_path, llm, dc):
    judges_say_done(llm)
    llm.push(say("got it"), when=is_loop)
    async with discord_bot(dc, discord_config(tmp_path, llm, dc)) as d:
        dm = dc.dm_channel_id()
        original = dc.message_payload("the original words", dm, author=dc.human("2000000000000000009", "bob"))
        forward = dc.message_payload("", dm, referenced_message=original)
        forward.update(type=0, referenced_message=None, content="look at this")
        forward["message_reference"]["type"] = 1  # FORWARD
        await dc.dispatch("MESSAGE_CREATE", forward)
        await d.engine.wait_for_turns(1)
    [request] = loop_requests(llm)
    assert "Replying to" not in user_text(request) and user_text(request).endswith("look at this")
    assert dc.matching_calls("GET", rf"/channels/{dm}/messages/\d+") == []
