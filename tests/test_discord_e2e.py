"""End to end on Discord: the real daemon, discord.py and openai clients against the fakes.

Every test runs ``bumblebot run``'s daemon in-process with the Discord adapter connected to
`FakeDiscord` (REST + gateway on 127.0.0.1) and the scripted `FakeOpenAI`, and waits on
recorded requests, never on sleeps. "Ignored" is proven by order: the adapter takes messages
one at a time in arrival order, so once a later DM is answered, every earlier message was
decided, and an ignored one left no journal row and no model request.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from conftest import TOKEN, running, write_config
from fakes.discord_server import BOT_ID, HUMAN_ID, FakeDiscord
from fakes.openai_server import FakeOpenAI, is_loop, tool_calls
from support import contents, judges_say_done, loop_requests, say, user_text

from bumblebot.core.errors import AdapterError

GUILD_ID = "500000000000000050"
CHANNEL_ID = "500000000000000051"
OTHER_CHANNEL_ID = "500000000000000052"
THREAD_ID = "500000000000000053"
ROLE_ID = "500000000000000054"
MESSAGES = r"/channels/\d+/messages"


def config(tmp_path: Path, llm: FakeOpenAI, dc: FakeDiscord, **discord: Any) -> Path:
    section = {"enabled": True, "api_base_url": dc.api_base, "gateway_url": dc.gateway_url, **discord}
    return write_config(tmp_path, llm, None, discord=section)


def bot(dc: FakeDiscord, config_path: Path) -> Any:
    """The daemon serving Discord only, as ``bumblebot run`` with DISCORD_BOT_TOKEN set."""
    return running(config_path, telegram_token=None, discord_token=dc.token)


async def journal(daemon: Any) -> list[tuple[str, str, str]]:
    """``(chat_id, message_id, status)`` of every journaled message, oldest first.

    An answered message may still be ``pending`` when its reply arrives (the turn commits
    after delivery), so tests compare statuses only for refusals (settled before replying).
    """
    rows = await daemon.store._all("SELECT chat_id, message_id, status FROM journal ORDER BY id")
    return [tuple(r) for r in rows]


async def test_dm_say_reaches_create_message_and_typing_was_sent(tmp_path, llm, dc):
    judges_say_done(llm)
    llm.push(say("hey you"), when=is_loop)
    async with bot(dc, config(tmp_path, llm, dc)) as d:
        assert [a.platform.value for a in d.adapters] == ["discord"]
        await dc.send_dm("hi there")
        dm = dc.dm_channel_id()
        await dc.wait_for_call("POST", f"/channels/{dm}/messages", status=200)
    assert dc.messages_sent(dm) == ["hey you"]
    typing = dc.matching_calls("POST", f"/channels/{dm}/typing", status=204)
    send = dc.matching_calls("POST", f"/channels/{dm}/messages")
    assert typing and typing[0].time <= send[0].time
    [request] = loop_requests(llm)
    assert user_text(request).endswith("hi there")
    assert "Platform: discord, private chat" in user_text(request)
    assert not llm.violations and not llm.unscripted


def add_guild(dc: FakeDiscord) -> dict[str, Any]:
    """The test guild: #general and #channel-1, a "moderators" role, a thread under #general."""
    guild = dc.add_guild(GUILD_ID, [CHANNEL_ID, OTHER_CHANNEL_ID], name="Hive")
    guild["roles"].append(
        {"id": ROLE_ID, "name": "moderators", "permissions": "0", "position": 1, "color": 0,
         "hoist": False, "managed": False, "mentionable": True, "flags": 0}
    )
    guild["threads"].append(
        {"id": THREAD_ID, "type": 11, "guild_id": GUILD_ID, "parent_id": CHANNEL_ID,
         "owner_id": HUMAN_ID, "name": "planning", "message_count": 0, "member_count": 1,
         "rate_limit_per_user": 0, "flags": 0,
         "thread_metadata": {"archived": False, "auto_archive_duration": 1440,
                             "archive_timestamp": "2025-01-01T00:00:00+00:00", "locked": False}}
    )
    return guild


async def test_guild_message_needs_a_mention_and_the_model_reads_names_not_tokens(tmp_path, llm, dc):
    judges_say_done(llm)
    add_guild(dc)
    bob = dc.human("2000000000000000009", "bob")
    llm.push(say("Bob knows the mods."), when=is_loop)
    async with bot(dc, config(tmp_path, llm, dc)) as d:
        await dc.send_guild_message("just chatting among us", GUILD_ID, CHANNEL_ID)
        payload = dc.message_payload(
            f"<@{BOT_ID}> ask <@{bob['id']}> about <#{OTHER_CHANNEL_ID}> and ping <@&{ROLE_ID}>",
            CHANNEL_ID, guild_id=GUILD_ID, mentions=[dc.bot_user, bob],
        )
        payload["mention_roles"] = [ROLE_ID]
        await dc.dispatch("MESSAGE_CREATE", payload)
        await dc.wait_for_call("POST", f"/channels/{CHANNEL_ID}/messages", status=200)
        rows = await journal(d)
    assert dc.messages_sent(CHANNEL_ID) == ["Bob knows the mods."]
    assert [r[:2] for r in rows] == [(CHANNEL_ID, payload["id"])]  # the unmentioned one left no trace
    [request] = loop_requests(llm)
    said = user_text(request)
    assert said.endswith("[alice]: ask @bob about #channel-1 and ping @moderators")
    assert "Platform: discord, group chat" in said
    assert "<@" not in contents(request) and "<#" not in contents(request)
    assert "just chatting" not in contents(request)


async def test_bot_authors_are_ignored(tmp_path, llm, dc):
    judges_say_done(llm)
    add_guild(dc)
    llm.push(say("hello human"), when=is_loop)
    async with bot(dc, config(tmp_path, llm, dc)) as d:
        await dc.send_guild_message(
            "hi fellow bot", GUILD_ID, CHANNEL_ID, mention_bot=True, author=dc.other_bot
        )
        await dc.send_dm("hello from a bot", author=dc.other_bot)
        await dc.send_dm("hello from a human")
        await dc.wait_for_call("POST", MESSAGES, status=200)
        rows = await journal(d)
    assert dc.messages_sent() == ["hello human"]
    assert [r[0] for r in rows] == [dc.dm_channel_id()] and len(loop_requests(llm)) == 1
    assert "bot" not in user_text(loop_requests(llm)[0]).split("---")[-1]


async def test_allow_bots_needs_a_typed_mention(tmp_path, llm, dc):
    judges_say_done(llm)
    add_guild(dc)
    llm.push(say("hello bot"), when=is_loop)
    async with bot(dc, config(tmp_path, llm, dc, allow_bots=True)) as d:
        earlier = dc.message_payload(
            "an old message of ours", CHANNEL_ID, author=dc.bot_user, guild_id=GUILD_ID
        )
        # a reply from another bot pings us without a typed mention: not enough for a bot
        await dc.send_guild_message("auto-ping reply", GUILD_ID, CHANNEL_ID, author=dc.other_bot,
                                    referenced_message=earlier)
        typed = await dc.send_guild_message("typed mention", GUILD_ID, CHANNEL_ID, mention_bot=True,
                                            author=dc.other_bot)
        await dc.wait_for_call("POST", f"/channels/{CHANNEL_ID}/messages", status=200)
        rows = await journal(d)
    assert [r[1] for r in rows] == [typed["id"]]
    assert user_text(loop_requests(llm)[0]).endswith("[otherbot]: typed mention")


async def test_reply_over_the_limit_is_split_with_fences_balanced_and_text_intact(tmp_path, llm, dc):
    judges_say_done(llm)
    code = "\n".join(f"print('line {i:03d}', {'x' * 40!r})" for i in range(40))
    reply = f"Here is the script:\n\n```python\n{code}\n```\n\nRun it with python3."
    assert 2400 <= len(reply) <= 2700
    llm.push(say(reply), when=is_loop)
    async with bot(dc, config(tmp_path, llm, dc)):
        await dc.send_dm("write me a script")
        await dc.wait_for_call("POST", MESSAGES, n=2, status=200)
    chunks = dc.messages_sent()
    assert len(chunks) == 2
    assert all(len(c) <= 2000 for c in chunks)
    for chunk in chunks:
        fences = [line for line in chunk.splitlines() if line.startswith("```")]
        assert len(fences) % 2 == 0, chunk
    first, second = chunks
    assert first.endswith("\n```") and second.startswith("```python\n")
    assert first[: -len("\n```")] + "\n" + second[len("```python\n"):] == reply


async def test_same_message_create_twice_and_after_a_resume_makes_one_turn(tmp_path, llm, dc):
    judges_say_done(llm)
    llm.push(say("once"), when=lambda r: is_loop(r) and "hello" in user_text(r))
    llm.push(say("twice"), when=lambda r: is_loop(r) and "next" in user_text(r))
    async with bot(dc, config(tmp_path, llm, dc)) as d:
        payload = await dc.send_dm("hello")
        await dc.dispatch("MESSAGE_CREATE", payload)  # the same event again
        await dc.wait_for_call("POST", MESSAGES, status=200)
        await dc.force_reconnect("close")
        await dc.wait_resumed()
        await dc.dispatch("MESSAGE_CREATE", payload)  # and once more after the RESUME
        await dc.send_dm("next")
        await dc.wait_for_call("POST", MESSAGES, n=2, status=200)
        turns = await d.store.recent_turns()
        rows = await journal(d)
    assert dc.messages_sent() == ["once", "twice"]
    assert len(turns) == 2 and len(loop_requests(llm)) == 2
    assert [r[1] for r in rows] == [payload["id"], rows[1][1]] and len(rows) == 2
    assert dc.identify_count == 1 and dc.resume_count == 1


async def test_restart_keeps_the_channel_history_and_drops_a_replayed_message(tmp_path, llm, dc):
    judges_say_done(llm)
    add_guild(dc)
    path = config(tmp_path, llm, dc)
    llm.push(say("nice to meet you, Ada"), when=is_loop)
    async with bot(dc, path) as d:
        first = await dc.send_guild_message("my name is Ada", GUILD_ID, CHANNEL_ID, mention_bot=True)
        await dc.wait_for_call("POST", MESSAGES, status=200)
        await d.engine.wait_for_turns(1)  # finished before the stop
    llm.push(say("you are Ada"), when=is_loop)
    async with bot(dc, path) as d:
        await dc.dispatch("MESSAGE_CREATE", first)  # replayed by Discord after the restart
        await dc.send_guild_message("what's my name?", GUILD_ID, CHANNEL_ID, mention_bot=True)
        await dc.wait_for_call("POST", MESSAGES, n=2, status=200)
        turns = await d.store.recent_turns()
    assert dc.messages_sent(CHANNEL_ID) == ["nice to meet you, Ada", "you are Ada"]
    assert dc.identify_count == 2 and len(turns) == 2
    assert len(dc.matching_calls("PUT", rf"/applications/{BOT_ID}/commands")) == 1  # synced once
    second = loop_requests(llm)[1]
    assert "what's my name?" in user_text(second)
    seen = contents(second)
    assert "[alice]: my name is Ada" in seen and "nice to meet you, Ada" in seen


async def test_allowlists_refuse_dms_once_and_ignore_guild_messages(tmp_path, llm, dc):
    judges_say_done(llm)
    add_guild(dc)
    stranger = dc.human("2000000000000000077", "mallory")
    path = config(tmp_path, llm, dc, allowed_user_ids=[int(HUMAN_ID)], allowed_channel_ids=[int(CHANNEL_ID)])
    llm.push(say("welcome in the thread"), when=lambda r: is_loop(r) and "thread" in user_text(r))
    llm.push(say("hi alice"), when=lambda r: is_loop(r) and "allowed" in user_text(r))
    async with bot(dc, path) as d:
        await dc.send_dm("let me in", author=stranger)
        await dc.send_dm("please?", author=stranger)
        await dc.send_guild_message("me too", GUILD_ID, CHANNEL_ID, mention_bot=True, author=stranger)
        await dc.send_guild_message("wrong channel", GUILD_ID, OTHER_CHANNEL_ID, mention_bot=True)
        await dc.send_guild_message("in the thread", GUILD_ID, THREAD_ID, mention_bot=True)
        await dc.wait_for_call("POST", f"/channels/{THREAD_ID}/messages", status=200)
        await dc.send_guild_message("allowed here", GUILD_ID, CHANNEL_ID, mention_bot=True)
        await dc.wait_for_call("POST", f"/channels/{CHANNEL_ID}/messages", status=200)
        rows = await journal(d)
    refused_dm = dc.dm_channel_id(stranger)
    assert dc.messages_sent(refused_dm) == ["Sorry, this bot is private."]
    assert dc.messages_sent(OTHER_CHANNEL_ID) == []
    assert dc.messages_sent(THREAD_ID) == ["welcome in the thread"]
    assert dc.messages_sent(CHANNEL_ID) == ["hi alice"]
    # refused DMs are journaled as handled; ignored guild messages are not journaled at all
    # (journaled in arrival order per channel; channels do not wait for each other)
    assert [(r[0], r[2]) for r in rows if r[0] == refused_dm] == [(refused_dm, "ignored"), (refused_dm, "ignored")]
    assert [r[0] for r in rows if r[0] != refused_dm] == [CHANNEL_ID, CHANNEL_ID]  # the thread's parent, then the channel
    assert len(loop_requests(llm)) == 2


async def test_a_thread_is_its_own_conversation_under_its_channel(tmp_path, llm, dc):
    judges_say_done(llm)
    add_guild(dc)
    llm.push(say("thread answer"), when=is_loop)
    async with bot(dc, config(tmp_path, llm, dc)) as d:
        await dc.send_guild_message("plan it", GUILD_ID, THREAD_ID, mention_bot=True)
        await dc.wait_for_call("POST", f"/channels/{THREAD_ID}/messages", status=200)
        rows = await d.store._all("SELECT platform, chat_id, thread_id FROM conversations")
    assert [tuple(r) for r in rows] == [("discord", CHANNEL_ID, THREAD_ID)]
    assert dc.messages_sent(THREAD_ID) == ["thread answer"] and dc.messages_sent(CHANNEL_ID) == []


async def test_respond_in_guilds_all_answers_without_a_mention(tmp_path, llm, dc):
    judges_say_done(llm)
    add_guild(dc)
    llm.push(say("I heard that"), when=is_loop)
    async with bot(dc, config(tmp_path, llm, dc, respond_in_guilds="all")):
        await dc.send_guild_message("nobody pinged the bot", GUILD_ID, CHANNEL_ID)
        await dc.wait_for_call("POST", f"/channels/{CHANNEL_ID}/messages", status=200)
    assert dc.messages_sent(CHANNEL_ID) == ["I heard that"]
    assert user_text(loop_requests(llm)[0]).endswith("[alice]: nobody pinged the bot")


async def test_respond_in_guilds_off_ignores_even_mentions_but_answers_dms(tmp_path, llm, dc):
    judges_say_done(llm)
    add_guild(dc)
    llm.push(say("dm answer"), when=is_loop)
    async with bot(dc, config(tmp_path, llm, dc, respond_in_guilds="off")) as d:
        await dc.send_guild_message("hey bot", GUILD_ID, CHANNEL_ID, mention_bot=True)
        await dc.send_dm("are you there?")
        await dc.wait_for_call("POST", MESSAGES, status=200)
        rows = await journal(d)
    assert dc.messages_sent(CHANNEL_ID) == [] and dc.messages_sent(dc.dm_channel_id()) == ["dm answer"]
    assert [r[0] for r in rows] == [dc.dm_channel_id()]


async def test_a_reply_to_the_bot_is_answered_a_reply_to_someone_else_is_not(tmp_path, llm, dc):
    judges_say_done(llm)
    add_guild(dc)
    llm.push(say("first answer"), when=lambda r: is_loop(r) and "question" in user_text(r))
    llm.push(say("follow-up answer"), when=lambda r: is_loop(r) and "and why" in user_text(r))
    async with bot(dc, config(tmp_path, llm, dc)) as d:
        asked = await dc.send_guild_message("a question", GUILD_ID, CHANNEL_ID, mention_bot=True)
        await dc.wait_for_call("POST", MESSAGES, status=200)
        ours = dc.created_messages(CHANNEL_ID)[0]
        # a reply without the automatic ping (the person turned it off): no mention at all
        await dc.send_guild_message("me too", GUILD_ID, CHANNEL_ID, referenced_message=asked)
        follow = await dc.send_guild_message("and why?", GUILD_ID, CHANNEL_ID, referenced_message=ours)
        await dc.wait_for_call("POST", MESSAGES, n=2, status=200)
        rows = await journal(d)
    assert dc.messages_sent(CHANNEL_ID) == ["first answer", "follow-up answer"]
    assert [r[1] for r in rows] == [asked["id"], follow["id"]]


async def test_replies_never_ping(tmp_path, llm, dc):
    judges_say_done(llm)
    add_guild(dc)
    text = f"<@{HUMAN_ID}> said hi, @everyone and <@&{ROLE_ID}> take note"
    llm.push(say(text), when=is_loop)
    async with bot(dc, config(tmp_path, llm, dc)):
        await dc.send_guild_message("tell everyone", GUILD_ID, CHANNEL_ID, mention_bot=True)
        [call] = await dc.wait_for_call("POST", f"/channels/{CHANNEL_ID}/messages", status=200)
    assert call.json["content"] == text  # Discord's own markup is kept as is
    allowed = call.json["allowed_mentions"]
    assert allowed["parse"] == [] and not allowed.get("users") and not allowed.get("roles")
    assert not allowed.get("replied_user")


async def test_send_failing_with_503_stays_pending_and_is_sent_after_restart(tmp_path, llm, dc):
    """503 is not retried inside discord.py (it retries 500/502/504 with 1, 3, 5 s sleeps), so
    the outbox's own three attempts (0.5 s and 1 s apart) are the only wait in this test."""
    judges_say_done(llm)
    path = config(tmp_path, llm, dc)
    llm.push(say("stored for later"), when=is_loop)
    dc.fail_next("POST", MESSAGES, 503, {"message": "Service Unavailable", "code": 0}, times=3)
    async with bot(dc, path) as d:
        await dc.send_dm("hi")
        await dc.wait_for_call("POST", MESSAGES, n=3, status=503)
        await d.engine.wait_for_turns(1)  # the queued say counts as said: the turn ended
        rows = await d.store._all("SELECT status, attempts, last_error FROM outbox")
    assert len(loop_requests(llm)) == 1  # the queued say counts as said: the check lets it end
    assert [(r[0], r[1]) for r in rows] == [("pending", 1)] and "503" in rows[0][2]
    assert dc.messages_sent() == []
    async with bot(dc, path) as d:
        # the outbox sweeper retries pending rows at start; a second pass waits for it (one
        # lock) and finds nothing left to send, so the row is settled when this returns
        await d.delivery.retry_pending()
        rows = await d.store._all("SELECT status FROM outbox")
    assert [r[0] for r in rows] == ["sent"]
    assert dc.messages_sent() == ["stored for later"]
    assert len(loop_requests(llm)) == 1


async def test_text_commands_in_dm_and_guild_and_a_slash_command(tmp_path, llm, dc):
    judges_say_done(llm)
    add_guild(dc)
    async with bot(dc, config(tmp_path, llm, dc)) as d:
        assert sorted(c["name"] for c in dc.app_commands[None]) == ["compact", "help", "reset", "status", "stop", "tasks", "usage"]
        await dc.send_dm("/status")
        await dc.wait_for_call("POST", MESSAGES, status=200)
        await dc.send_guild_message("/reset", GUILD_ID, CHANNEL_ID, mention_bot=True)
        await dc.wait_for_call("POST", f"/channels/{CHANNEL_ID}/messages", status=200)
        await dc.send_guild_message("/reset", GUILD_ID, OTHER_CHANNEL_ID)  # not addressed: ignored
        interaction = await dc.send_interaction("help", channel_id=dc.dm_channel_id())
        [followup] = await dc.wait_for_call("POST", rf"/webhooks/{BOT_ID}/{interaction['token']}", status=200)
        rows = await journal(d)
    assert dc.messages_sent(dc.dm_channel_id())[0].startswith("Context: ~")
    assert dc.messages_sent(CHANNEL_ID) == ["Fresh start: I've put our earlier conversation aside."]
    assert dc.interaction_responses[0]["type"] == 5  # deferred, then the follow-up
    assert "/reset" in followup.json["content"] and followup.json["allowed_mentions"]["parse"] == []
    assert {r[2] for r in rows} == {"ignored"} and len(rows) == 3
    assert llm.requests == []


async def test_only_members_who_manage_messages_reset_a_guild_channel(tmp_path, llm, dc):
    """/reset and /compact change a channel's conversation for everyone in it: only members who
    manage messages may run them in a guild channel."""
    from adapters.discord.commands import NOT_MANAGER_TEXT

    owner = dc.human("500000000000000099", "owner")
    dc.add_guild(GUILD_ID, [CHANNEL_ID], name="Hive", owner=owner)
    async with bot(dc, config(tmp_path, llm, dc)):
        await dc.send_guild_message("/reset", GUILD_ID, CHANNEL_ID, mention_bot=True)  # alice: a plain member
        await dc.wait_for_call("POST", f"/channels/{CHANNEL_ID}/messages", status=200)
        await dc.send_guild_message("/status", GUILD_ID, CHANNEL_ID, mention_bot=True)  # anyone may look
        await dc.wait_for_call("POST", f"/channels/{CHANNEL_ID}/messages", n=2, status=200)
        await dc.send_guild_message("/reset", GUILD_ID, CHANNEL_ID, mention_bot=True, author=owner)
        await dc.wait_for_call("POST", f"/channels/{CHANNEL_ID}/messages", n=3, status=200)
        await dc.send_interaction("reset", channel_id=CHANNEL_ID, guild_id=GUILD_ID)
        await dc.wait_for_call("POST", r"/interactions/\d+/[^/]+/callback")
    refused, status, done = dc.messages_sent(CHANNEL_ID)
    assert refused == NOT_MANAGER_TEXT and status.startswith("Context: ") and done.startswith("Fresh start")
    assert dc.interaction_responses[-1]["data"]["content"] == NOT_MANAGER_TEXT
    assert llm.requests == []


async def test_a_plain_member_cannot_cancel_the_channels_task(tmp_path, llm, dc):
    """``/tasks cancel 1`` from any member cancelled what the channel scheduled."""
    from adapters.discord.commands import NOT_MANAGER_TEXT

    owner = dc.human("500000000000000099", "owner")
    dc.add_guild(GUILD_ID, [CHANNEL_ID], name="Hive", owner=owner)
    judges_say_done(llm)
    llm.push(tool_calls(("schedule_task", {"when": "in 2 hours", "task": "Water the plants."})), when=is_loop)
    llm.push(say("Scheduled."), when=is_loop)
    async with bot(dc, config(tmp_path, llm, dc)) as d:
        await dc.send_guild_message("remind us in 2 hours to water the plants", GUILD_ID, CHANNEL_ID, mention_bot=True)
        await d.engine.wait_for_turns(1)
        await dc.send_guild_message("/tasks cancel 1", GUILD_ID, CHANNEL_ID, mention_bot=True)  # alice: a member
        await dc.wait_for_call("POST", f"/channels/{CHANNEL_ID}/messages", n=2, status=200)
        await dc.send_guild_message("/tasks cancel 1", GUILD_ID, CHANNEL_ID, mention_bot=True, author=owner)
        await dc.wait_for_call("POST", f"/channels/{CHANNEL_ID}/messages", n=3, status=200)
        tasks = await d.store.tasks(active=False)
    assert dc.messages_sent(CHANNEL_ID)[1:] == [NOT_MANAGER_TEXT, "Cancelled task #1."]
    assert [t.status for t in tasks] == ["cancelled"]


async def test_wrong_token_fails_start_with_a_clear_message(tmp_path, llm, dc):
    with pytest.raises(AdapterError, match="DISCORD_BOT_TOKEN"):
        async with running(config(tmp_path, llm, dc), telegram_token=None, discord_token="WRONG"):
            pass
    assert dc.identify_count == 0


async def test_gateway_closing_with_auth_failure_resolves_failure(tmp_path, llm, dc):
    async with bot(dc, config(tmp_path, llm, dc)) as d:
        [adapter] = d.adapters
        await dc.force_reconnect("close", close_code=4004)
        with pytest.raises(AdapterError, match="4004"):
            await asyncio.wait_for(asyncio.shield(adapter.failure), 5)


async def test_one_process_serves_telegram_and_discord(tmp_path, llm, dc, tg):
    judges_say_done(llm)
    llm.push(say("hello discord"), when=lambda r: is_loop(r) and "from discord" in user_text(r))
    llm.push(say("hello telegram"), when=lambda r: is_loop(r) and "from telegram" in user_text(r))
    section = {"enabled": True, "api_base_url": dc.api_base, "gateway_url": dc.gateway_url}
    path = write_config(tmp_path, llm, tg, discord=section)
    async with running(path, telegram_token=TOKEN, discord_token=dc.token) as d:
        assert sorted(a.platform.value for a in d.adapters) == ["discord", "telegram"]
        await dc.send_dm("from discord")
        tg.push_text("from telegram", chat_id=31)
        await dc.wait_for_call("POST", MESSAGES, status=200)
        await tg.wait_for("sendMessage")
    assert dc.messages_sent() == ["hello discord"] and tg.sent(31) == ["hello telegram"]


@pytest.mark.parametrize("broken", [
    {"channel_id": "not a snowflake"},  # discord.py's parser raised ValueError
    {"author": None},  # and TypeError
    {"id": None, "channel_id": None},
])
async def test_a_gateway_event_discord_py_cannot_parse_is_skipped_and_intake_goes_on(tmp_path, llm, dc, caplog, broken):
    """A parser's exception escaped discord.py's gateway loop: the client stopped, and with it
    the daemon. The event is logged and skipped; the messages before and after it are answered."""
    judges_say_done(llm)
    llm.push(say("first"), when=lambda r: is_loop(r) and "before it" in contents(r))
    llm.push(say("second"), when=lambda r: is_loop(r) and "after it" in contents(r))
    async with bot(dc, config(tmp_path, llm, dc)) as d:
        await dc.send_dm("before it")
        dm = dc.dm_channel_id()
        await dc.wait_until(lambda: dc.messages_sent(dm) == ["first"])
        payload = dc.message_payload("odd", dm, author=dc.human_user)
        await dc.dispatch("MESSAGE_CREATE", {**payload, **broken})
        await dc.send_dm("after it")
        await dc.wait_until(lambda: dc.messages_sent(dm) == ["first", "second"])
        await d.engine.wait_for_turns(2)
        assert not d.adapters[0].failure.done()
    assert [r for r in caplog.records if "cannot be read" in r.getMessage() and r.levelname == "WARNING"]
