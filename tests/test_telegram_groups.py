"""Telegram groups, supergroups and forum topics (adapters/telegram/policy.py and the daemon).

The daemon runs in this event loop with the real python-telegram-bot against the fake Bot API,
on real SQLite files. "Nothing happened" is observed after the update was acknowledged (the
next ``getUpdates`` moved the offset past it), never after a sleep.
"""

from __future__ import annotations

import asyncio
import logging

from conftest import running, write_config
from fakes.openai_server import is_loop, tool_calls
from fakes.telegram_server import BOT_USER, FakeTelegram
from support import contents, db, handled, judges_say_done, loop_requests, say

from adapters.telegram.adapter import PRIVACY_NOTE
from adapters.telegram.commands import NOT_ADMIN_TEXT
from adapters.telegram.policy import MessageFacts, Verdict, command_target, decide, may_manage
from bumblebot.core.settings import TelegramSettings
from bumblebot.runtime.engine import NOT_ANSWERED_TEXT
from bumblebot.runtime.conversation import BACKGROUND_OPEN

GROUP = -500
FORUM = -1001234


def sends(tg: FakeTelegram, chat_id: int) -> list[tuple[str, int | None]]:
    """``(text, message_thread_id)`` of every sendMessage to ``chat_id``."""
    return [
        (c.params.get("text", ""), c.params.get("message_thread_id"))
        for c in tg.calls if c.method == "sendMessage" and int(c.params["chat_id"]) == chat_id
    ]


def bot_message_id(tg: FakeTelegram, chat_id: int) -> int:
    return max(m for (c, m), msg in tg.messages.items() if c == chat_id and msg.get("from", {}).get("id") == BOT_USER["id"])


# -- the policy, as plain functions ----------------------------------------------------------


def test_command_target_tells_this_bot_from_another():
    assert command_target("/status", "fake_bot") == "self"
    assert command_target("/status@Fake_Bot now", "fake_bot") == "self"
    assert command_target("/status@otherbot", "fake_bot") == "other"
    assert command_target("hello /status", "fake_bot") is None


def test_decide_follows_the_mode_the_allowlists_and_bots():
    mention = TelegramSettings()
    group = MessageFacts(sender_id=7, sender_is_bot=False, chat_id=GROUP, private=False)
    assert decide(group, mention, bot_id=42) is Verdict.BACKGROUND
    assert decide(MessageFacts(7, False, GROUP, False, addressed=True), mention, 42) is Verdict.ANSWER
    assert decide(group, TelegramSettings(respond_in_groups="always"), 42) is Verdict.ANSWER
    assert decide(MessageFacts(7, False, GROUP, False, True), TelegramSettings(respond_in_groups="never"), 42) is Verdict.IGNORE
    assert decide(MessageFacts(9, True, GROUP, False, True), mention, 42) is Verdict.IGNORE  # a bot
    assert decide(MessageFacts(9, True, GROUP, False, True), TelegramSettings(allow_bots=True), 42) is Verdict.ANSWER
    assert decide(MessageFacts(9, True, GROUP, False, False), TelegramSettings(allow_bots=True), 42) is Verdict.IGNORE
    assert decide(MessageFacts(42, True, GROUP, False, True), mention, 42) is Verdict.IGNORE  # itself
    listed = TelegramSettings(allowed_chat_ids=[GROUP])
    assert decide(MessageFacts(7, False, GROUP, False, True), listed, 42) is Verdict.ANSWER
    assert decide(MessageFacts(7, False, -9, False, True), listed, 42) is Verdict.IGNORE  # silently, in a group
    assert decide(MessageFacts(7, False, 7, True), listed, 42) is Verdict.REFUSE  # a private chat is told once
    users = TelegramSettings(allowed_user_ids=[7])
    assert decide(MessageFacts(7, False, -9, False, True), users, 42) is Verdict.ANSWER


def test_only_managers_run_what_changes_a_group_for_everyone():
    assert may_manage("reset", "/reset", private=False, manager=False) is False
    assert may_manage("compact", "/compact@bee_bot", private=False, manager=False) is False
    assert may_manage("tasks", "/tasks cancel 1", private=False, manager=False) is False
    assert may_manage("tasks", "/tasks CANCEL #1", private=False, manager=False) is False
    assert may_manage("tasks", "/tasks", private=False, manager=False)  # listing changes nothing
    assert may_manage("status", "/status", private=False, manager=False)
    assert may_manage("stop", "/stop", private=False, manager=False)  # the engine decides: who is answered
    assert may_manage("reset", "/reset", private=False, manager=True)
    assert may_manage("tasks", "/tasks cancel 1", private=True, manager=False)


# -- through the real client -----------------------------------------------------------------


async def test_an_unmentioned_message_starts_no_turn_and_a_mention_gets_it_as_background(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(say("They are on the hook."), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        chatter = tg.push_text("anyone seen the keys?", chat_id=GROUP, user_id=8, chat_type="group", first_name="Bob")
        await handled(tg, chatter)
        assert llm.requests == [] and sends(tg, GROUP) == []
        tg.push_text("@fake_bot where are they?", chat_id=GROUP, user_id=7, chat_type="group", first_name="Alice")
        await d.engine.wait_for_turns(1)
    assert sends(tg, GROUP) == [("They are on the hook.", None)]
    [request] = loop_requests(llm)
    user = [m["content"] for m in request["messages"] if m["role"] == "user"][-1]
    assert user.index(BACKGROUND_OPEN) < user.index("[Bob]: anyone seen the keys?") < user.index(
        "[Alice]: @fake_bot where are they?"
    )
    assert db(tmp_path).execute("SELECT status, background FROM journal ORDER BY id").fetchall() == [
        ("ignored", 1), ("done", 0),
    ]


async def test_background_is_only_what_came_since_the_last_turn(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(say("one"), when=is_loop)
    llm.push(say("two"), when=is_loop)
    config = write_config(tmp_path, llm, tg, telegram={"group_context": 1})
    async with running(config) as d:
        for text in ("old chatter", "newer chatter"):
            tg.push_text(text, chat_id=GROUP, user_id=8, chat_type="group", first_name="Bob")
        tg.push_text("@fake_bot first", chat_id=GROUP, user_id=7, chat_type="group")
        await d.engine.wait_for_turns(1)
        tg.push_text("@fake_bot second", chat_id=GROUP, user_id=7, chat_type="group")
        await d.engine.wait_for_turns(2)
    first, second = loop_requests(llm)
    last_user = [m["content"] for m in first["messages"] if m["role"] == "user"][-1]
    assert "newer chatter" in last_user and "old chatter" not in last_user  # group_context: 1
    last_user = [m["content"] for m in second["messages"] if m["role"] == "user"][-1]
    assert last_user.endswith("[Alice]: @fake_bot second") and BACKGROUND_OPEN not in last_user


async def test_a_reply_to_the_bot_is_answered_and_carries_what_it_replies_to(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(say("The meeting is at noon."), when=is_loop)
    llm.push(say("Room 4."), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("@fake_bot when is the meeting?", chat_id=GROUP, user_id=7, chat_type="group")
        await d.engine.wait_for_turns(1)
        tg.push_text("and where?", chat_id=GROUP, user_id=7, chat_type="group", reply_to=bot_message_id(tg, GROUP))
        await d.engine.wait_for_turns(2)
    assert [t for t, _ in sends(tg, GROUP)] == ["The meeting is at noon.", "Room 4."]
    second = loop_requests(llm)[1]
    user = [m["content"] for m in second["messages"] if m["role"] == "user"][-1]
    assert user.endswith("\n[Alice]: [Replying to you: The meeting is at noon.]\nand where?")


async def test_a_quoted_reply_to_someone_else_shows_the_quote(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(say("Sounds right."), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        bob = tg.push_text("the build is red because of the cache " * 20, chat_id=GROUP, user_id=8,
                           chat_type="group", first_name="Bob")
        tg.push_text("@fake_bot is he right?", chat_id=GROUP, user_id=7, chat_type="group",
                     reply_to=bob["message"]["message_id"], quote="the build is red")
        await d.engine.wait_for_turns(1)
    user = [m["content"] for m in loop_requests(llm)[0]["messages"] if m["role"] == "user"][-1]
    assert "[Alice]: [Replying to Bob: the build is red]\n@fake_bot is he right?" in user


async def test_a_text_mention_of_the_bot_is_answered(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(say("Yes?"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("FakeBot, a question", chat_id=GROUP, user_id=7, chat_type="group",
                     entities=[{"type": "text_mention", "offset": 0, "length": 7, "user": BOT_USER}])
        await d.engine.wait_for_turns(1)
    assert sends(tg, GROUP) == [("Yes?", None)]


async def test_commands_for_another_bot_are_ignored_and_its_own_are_answered(tmp_path, llm, tg):
    async with running(write_config(tmp_path, llm, tg)) as d:
        other = tg.push_text("/status@otherbot", chat_id=GROUP, user_id=7, chat_type="group")
        unknown = tg.push_text("/weather", chat_id=GROUP, user_id=7, chat_type="group")
        await handled(tg, unknown)
        assert sends(tg, GROUP) == [] and other["update_id"] < unknown["update_id"]
        tg.push_text("/status@fake_bot", chat_id=GROUP, user_id=7, chat_type="group")
        tg.push_text("/status", chat_id=GROUP, user_id=7, chat_type="group")
        await tg.wait_for("sendMessage", n=2)
        assert d.engine.progress.turns_finished == 0
    assert all(text.startswith("Context: ") for text, _ in sends(tg, GROUP))
    assert llm.requests == []


async def test_forum_topics_are_separate_conversations_answered_in_their_threads(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(say("About topic ten."), when=lambda r: is_loop(r) and "@fake_bot ten" in contents(r))
    llm.push(say("About topic twenty."), when=lambda r: is_loop(r) and "@fake_bot twenty" in contents(r))
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("@fake_bot ten", chat_id=FORUM, user_id=7, chat_type="supergroup", is_forum=True, thread_id=10)
        tg.push_text("@fake_bot twenty", chat_id=FORUM, user_id=7, chat_type="supergroup", is_forum=True, thread_id=20)
        await d.engine.wait_for_turns(2)
    assert sorted(sends(tg, FORUM)) == [("About topic ten.", 10), ("About topic twenty.", 20)]
    rows = db(tmp_path).execute("SELECT chat_id, thread_id FROM conversations ORDER BY thread_id").fetchall()
    assert rows == [(str(FORUM), "10"), (str(FORUM), "20")]
    for request in loop_requests(llm):  # neither topic saw the other
        assert ("@fake_bot ten" in contents(request)) != ("@fake_bot twenty" in contents(request))
    typing = {c.params.get("message_thread_id") for c in tg.calls if c.method == "sendChatAction"}
    assert typing == {10, 20}


async def test_the_general_topic_is_answered_without_a_thread_id(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(say("Hello, General."), when=is_loop)
    llm.push(say("Still General."), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("@fake_bot hi", chat_id=FORUM, user_id=7, chat_type="supergroup", is_forum=True)
        await d.engine.wait_for_turns(1)
        # a client that names the General topic by its id 1: still no thread id (Telegram refuses it)
        tg.push_text("@fake_bot again", chat_id=FORUM, user_id=7, chat_type="supergroup", is_forum=True, thread_id=1)
        await d.engine.wait_for_turns(2)
    assert sends(tg, FORUM) == [("Hello, General.", None), ("Still General.", None)]
    assert db(tmp_path).execute("SELECT thread_id FROM conversations").fetchall() == [("",)]


async def test_a_private_chat_topic_is_its_own_conversation(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(say("In the topic."), when=is_loop)
    llm.push(say("In the chat."), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("in a topic", chat_id=77, thread_id=5)
        await d.engine.wait_for_turns(1)
        tg.push_text("outside it", chat_id=77)
        await d.engine.wait_for_turns(2)
    assert sends(tg, 77) == [("In the topic.", 5), ("In the chat.", None)]
    assert db(tmp_path).execute("SELECT thread_id FROM conversations ORDER BY id").fetchall() == [("5",), ("",)]


async def test_a_group_that_becomes_a_supergroup_keeps_its_history(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(say("Nice to meet you, Zed."), when=is_loop)
    llm.push(say("You are Zed."), when=is_loop)
    supergroup = -100500
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("@fake_bot my name is Zed", chat_id=GROUP, user_id=7, chat_type="group")
        await d.engine.wait_for_turns(1)
        tg.push_migration(GROUP, supergroup)
        tg.push_text("@fake_bot who am I?", chat_id=supergroup, user_id=7, chat_type="supergroup")
        await d.engine.wait_for_turns(2)
    assert [t for t, _ in sends(tg, supergroup)] == ["You are Zed."]
    assert "my name is Zed" in contents(loop_requests(llm)[1])
    assert db(tmp_path).execute("SELECT chat_id FROM conversations").fetchall() == [(str(supergroup),)]


async def test_a_reply_to_a_group_that_migrated_meanwhile_reaches_the_supergroup(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(say("Still here."), when=is_loop)
    supergroup = -100501
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.migrated[GROUP] = supergroup  # upgraded before the service message reached the bot
        tg.push_text("@fake_bot ping", chat_id=GROUP, user_id=7, chat_type="group")
        await d.engine.wait_for_turns(1)
    assert sends(tg, supergroup) == [("Still here.", None)]
    assert db(tmp_path).execute("SELECT chat_id FROM conversations").fetchall() == [(str(supergroup),)]


async def test_never_stays_silent_in_groups(tmp_path, llm, tg):
    config = write_config(tmp_path, llm, tg, telegram={"respond_in_groups": "never"})
    async with running(config):
        tg.push_text("@fake_bot hello?", chat_id=GROUP, user_id=7, chat_type="group")
        last = tg.push_text("/status@fake_bot", chat_id=GROUP, user_id=7, chat_type="group")
        await handled(tg, last)
    assert tg.sent(GROUP) == [] and llm.requests == []


async def test_always_answers_every_group_message(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(say("I heard."), when=is_loop)
    config = write_config(tmp_path, llm, tg, telegram={"respond_in_groups": "always"})
    async with running(config) as d:
        tg.push_text("no mention at all", chat_id=GROUP, user_id=7, chat_type="group")
        await d.engine.wait_for_turns(1)
    assert tg.sent(GROUP) == ["I heard."]


async def test_other_bots_are_not_answered_unless_allowed(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(say("Hi, bot."), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)):
        last = tg.push_text("@fake_bot hi", chat_id=GROUP, user_id=99, chat_type="group", is_bot=True)
        await handled(tg, last)
    assert tg.sent(GROUP) == [] and llm.requests == []
    async with running(write_config(tmp_path, llm, tg, telegram={"allow_bots": True})) as d:
        tg.push_text("@fake_bot hi again", chat_id=GROUP, user_id=99, chat_type="group", is_bot=True)
        await d.engine.wait_for_turns(1)
    assert tg.sent(GROUP) == ["Hi, bot."]


async def test_a_member_cannot_reset_a_group_but_an_admin_can(tmp_path, llm, tg):
    tg.member_status[(GROUP, 8)] = "administrator"
    async with running(write_config(tmp_path, llm, tg)):
        tg.push_text("/reset", chat_id=GROUP, user_id=7, chat_type="group")
        await tg.wait_for("sendMessage")
        tg.push_text("/reset@fake_bot", chat_id=GROUP, user_id=8, chat_type="group")
        await tg.wait_for("sendMessage", n=2)
    refused, done = tg.sent(GROUP)
    assert refused == NOT_ADMIN_TEXT and done.startswith("Fresh start")
    assert [c.params["user_id"] for c in tg.calls if c.method == "getChatMember"] == [7, 8]


async def test_privacy_mode_is_reported_once_at_start(tmp_path, llm, tg, caplog):
    caplog.set_level(logging.WARNING, logger="adapters.telegram.adapter")
    async with running(write_config(tmp_path, llm, tg)):
        pass
    notes = [r for r in caplog.records if r.msg == PRIVACY_NOTE]
    assert len(notes) == 1 and "Group Privacy" in notes[0].getMessage()
    caplog.clear()
    tg.get_me["can_read_all_group_messages"] = True
    async with running(write_config(tmp_path, llm, tg)):
        pass
    assert not [r for r in caplog.records if r.msg == PRIVACY_NOTE]


# -- regressions, each with its failing input -------------------------------------------------


async def test_service_messages_are_neither_answered_nor_background(tmp_path, llm, tg):
    """Regression: in ``always`` mode a member joining got "I can only read text messages"."""
    judges_say_done(llm)
    llm.push(say("Hi Dan."), when=is_loop)
    config = write_config(tmp_path, llm, tg, telegram={"respond_in_groups": "always"})
    async with running(config) as d:
        chat = {"id": GROUP, "type": "group", "title": "Test Group"}
        carol = {"id": 9, "is_bot": False, "first_name": "Carol"}
        for extra in ({"new_chat_members": [carol]}, {"new_chat_title": "Renamed"}):
            tg.push_update({"update_id": tg.next_update_id, "message": {
                "message_id": 9000 + tg.next_update_id, "date": 0, "chat": chat, "from": carol, **extra}})
        tg.push_text("hello all", chat_id=GROUP, user_id=10, chat_type="group", first_name="Dan")
        await d.engine.wait_for_turns(1)
    assert tg.sent(GROUP) == ["Hi Dan."]
    assert db(tmp_path).execute("SELECT COUNT(*) FROM journal").fetchone() == (1,)


async def test_an_anonymous_admin_may_reset_the_group(tmp_path, llm, tg):
    """Regression: a message sent as the group asked getChatMember about the group's id."""
    async with running(write_config(tmp_path, llm, tg)):
        update = tg.push_text("/reset", chat_id=GROUP, user_id=1087968824, chat_type="group",
                              first_name="Group", is_bot=True)
        update["message"]["sender_chat"] = {"id": GROUP, "type": "group", "title": "Test Group"}
        await tg.wait_for("sendMessage")
    assert tg.sent(GROUP)[0].startswith("Fresh start")
    assert not [c for c in tg.calls if c.method == "getChatMember"]


async def test_background_arriving_during_a_turn_reaches_the_steered_message(tmp_path, llm, tg):
    """Regression: chatter between a turn's first message and one steered into it was shown to
    neither that turn nor the next."""
    from fakes.openai_server import tool_calls
    from support import Gate

    judges_say_done(llm)
    hang = Gate(tool_calls(("think", {"thought": "reading"})))
    llm.push(hang, when=is_loop)
    llm.push(say("Code is 4711."), when=lambda r: is_loop(r) and "4711" in contents(r))
    config = write_config(tmp_path, llm, tg)
    async with running(config) as d:
        tg.push_text("@fake_bot Explain in detail, step by step, how the door works.", chat_id=GROUP,
                     user_id=7, chat_type="group")
        await hang.entered.wait()
        tg.push_text("the server room code is 4711", chat_id=GROUP, user_id=8, chat_type="group", first_name="Bob")
        tg.push_text("@fake_bot and the code?", chat_id=GROUP, user_id=7, chat_type="group")
        await d.engine.wait_until(lambda: d.engine.progress.accepted >= 2)
        hang.release.set()
        await d.engine.wait_for_turns(1)
    assert tg.sent(GROUP) == ["Code is 4711."]


async def test_a_migration_never_makes_new_supergroup_messages_look_like_duplicates(tmp_path, llm, tg):
    """Regression: the old group's journal rows took the new chat's message ids, so a
    supergroup message with a reused id was dropped as a duplicate."""
    judges_say_done(llm)
    llm.push(say("Noted, Zed."), when=is_loop)
    llm.push(say("You are Zed."), when=is_loop)
    supergroup = -100700
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("@fake_bot my name is Zed", chat_id=GROUP, user_id=7, chat_type="group", message_id=3)
        await d.engine.wait_for_turns(1)
        tg.push_text("we meet on friday", chat_id=GROUP, user_id=8, chat_type="group", first_name="Bob", message_id=4)
        tg.push_migration(GROUP, supergroup)
        tg.push_text("@fake_bot who am I and when do we meet?", chat_id=supergroup, user_id=7,
                     chat_type="supergroup", message_id=3)
        await d.engine.wait_for_turns(2)
    assert [t for t, _ in sends(tg, supergroup)] == ["You are Zed."]
    second = contents(loop_requests(llm)[1])
    assert "my name is Zed" in second and "[Bob]: we meet on friday" in second


async def test_a_group_the_bot_only_listened_to_keeps_its_background_when_it_migrates(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(say("On Friday."), when=is_loop)
    supergroup = -100701
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("we meet on friday", chat_id=GROUP, user_id=8, chat_type="group", first_name="Bob")
        tg.push_migration(GROUP, supergroup)
        tg.push_text("@fake_bot when do we meet?", chat_id=supergroup, user_id=7, chat_type="supergroup")
        await d.engine.wait_for_turns(1)
    assert "[Bob]: we meet on friday" in contents(loop_requests(llm)[0])


async def test_a_migration_moves_the_groups_facts_file(tmp_path, llm, tg):
    from bumblebot.cognition.knowledge import conversation_file_name

    judges_say_done(llm)
    llm.push(say("Hi."), when=is_loop)
    supergroup = -100702
    facts = tmp_path / "data" / "knowledge"
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("@fake_bot hi", chat_id=GROUP, user_id=7, chat_type="group")
        await d.engine.wait_for_turns(1)
        facts.mkdir(parents=True, exist_ok=True)
        (facts / conversation_file_name(f"telegram:{GROUP}")).write_text("## Team\nThe team ships on Fridays.\n")
        last = tg.push_text("@otherbot unrelated", chat_id=supergroup, user_id=7, chat_type="supergroup")
        tg.push_migration(GROUP, supergroup)
        await handled(tg, last)
        await tg.wait_for("getUpdates", predicate=lambda p: int(p.get("offset") or 0) >= tg.next_update_id)
    assert not (facts / conversation_file_name(f"telegram:{GROUP}")).exists()
    assert "ships on Fridays" in (facts / conversation_file_name(f"telegram:{supergroup}")).read_text()


async def test_only_a_real_reply_or_mention_of_the_bot_addresses_it(tmp_path, llm, tg):
    """A topic's messages all "reply" to the topic's first message, a reply thread in a plain
    group is not a topic, and a text_mention of someone else is not of the bot."""
    judges_say_done(llm)
    llm.push(say("Yes, in the thread."), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("chatting in a topic", chat_id=FORUM, user_id=7, chat_type="supergroup", is_forum=True,
                     thread_id=30)
        tg.push_text("Bob, look", chat_id=GROUP, user_id=7, chat_type="group",
                     entities=[{"type": "text_mention", "offset": 0, "length": 3,
                                "user": {"id": 8, "is_bot": False, "first_name": "Bob"}}])
        tg.push_text("@fake_bot in a reply thread", chat_id=-600, user_id=7, chat_type="supergroup", thread_id=55)
        await d.engine.wait_for_turns(1)
    assert sends(tg, FORUM) == [] and sends(tg, GROUP) == []
    assert sends(tg, -600) == [("Yes, in the thread.", None)]  # no topic outside a forum
    assert db(tmp_path).execute("SELECT chat_id, thread_id FROM conversations").fetchall() == [("-600", "")]


async def test_a_member_cannot_cancel_the_groups_task_but_an_admin_can(tmp_path, llm, tg):
    """A member's ``/tasks cancel 1`` answered "Cancelled task #1." before: any member could
    cancel what the group scheduled. Listing stays open to everyone."""
    tg.member_status[(GROUP, 8)] = "administrator"
    judges_say_done(llm)
    llm.push(tool_calls(("schedule_task", {"when": "in 2 hours", "task": "Water the plants."})), when=is_loop)
    llm.push(say("Scheduled."), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("@fake_bot remind us to water the plants in 2 hours", chat_id=GROUP, user_id=7, chat_type="group")
        await d.engine.wait_for_turns(1)
        for n, (user, text) in enumerate([(7, "/tasks cancel 1"), (7, "/tasks"), (8, "/tasks cancel 1")], start=2):
            tg.push_text(text, chat_id=GROUP, user_id=user, chat_type="group")
            await tg.wait_for("sendMessage", n=n)
        tasks = await d.store.tasks(active=False)
    scheduled, refused, listing, cancelled = tg.sent(GROUP)
    assert refused == NOT_ADMIN_TEXT and "Water the plants." in listing and cancelled == "Cancelled task #1."
    assert [t.status for t in tasks] == ["cancelled"]


async def test_only_the_person_answered_or_an_admin_stops_an_answer_in_a_group(tmp_path, llm, tg):
    """``/stop`` from any member cut another member's answer off."""
    tg.member_status[(GROUP, 8)] = "administrator"
    judges_say_done(llm)
    holds = []
    for _ in range(3):
        hold = asyncio.Event()
        reply = say("A long answer, written slowly, word by word, for the member who asked for it.")
        reply.stream_hold, reply.stream_hold_after, reply.stream_chars = hold, 12, 4
        llm.push(reply, when=is_loop)
        holds.append(hold)
    config = write_config(tmp_path, llm, tg, delivery={"streaming": "on", "stream_edit_interval_s": 0.2})
    async with running(config) as d:
        progress = d.engine.progress
        tg.push_text("@fake_bot tell me something long", chat_id=GROUP, user_id=7, chat_type="group")
        await tg.wait_for("sendMessage", predicate=lambda p: p.get("chat_id") == GROUP)
        tg.push_text("/stop", chat_id=GROUP, user_id=9, chat_type="group")  # another member
        await tg.wait_for("sendMessage", predicate=lambda p: p.get("text") == NOT_ANSWERED_TEXT)
        tg.push_text("/stop", chat_id=GROUP, user_id=7, chat_type="group")  # the one being answered
        await tg.wait_for("sendMessage", predicate=lambda p: p.get("text") == "Stopped.")
        await progress.wait_until(lambda: progress.turns_finished >= 1, timeout=5)
        tg.push_text("@fake_bot and another long one", chat_id=GROUP, user_id=9, chat_type="group")
        await tg.wait_for("sendMessage", predicate=lambda p: p.get("chat_id") == GROUP, n=4)
        tg.push_text("/stop", chat_id=GROUP, user_id=8, chat_type="group")  # an admin
        await tg.wait_for("sendMessage", predicate=lambda p: p.get("text") == "Stopped.", n=2)
        await progress.wait_until(lambda: progress.turns_finished >= 2, timeout=5)
    for hold in holds:
        hold.set()
    rows = db(tmp_path).execute("SELECT json_extract(trace, '$.stop_reason') FROM turns ORDER BY id").fetchall()
    assert [r[0] for r in rows] == ["stopped", "stopped"]


async def test_a_member_cannot_stop_a_scheduled_tasks_turn_but_an_admin_can(tmp_path, llm, tg):
    """A member's /stop while the group's scheduled task was being answered said there was
    nothing to stop; nobody of the group is the one answered there, so only a manager may."""
    tg.member_status[(GROUP, 8)] = "administrator"
    judges_say_done(llm)
    hold = asyncio.Event()
    reply = say("The plants need water now, everyone: the big fern first, then the rest of them.")
    reply.stream_hold, reply.stream_hold_after, reply.stream_chars = hold, 12, 4
    llm.push(reply, when=is_loop)
    config = write_config(tmp_path, llm, tg, delivery={"streaming": "on", "stream_edit_interval_s": 0.2})
    async with running(config) as d:
        await d.scheduler.create(f"telegram:{GROUP}", "in 1 second", "Remind the group to water the plants.")
        await tg.wait_for("sendMessage", predicate=lambda p: p.get("chat_id") == GROUP, timeout=15)
        tg.push_text("/stop", chat_id=GROUP, user_id=9, chat_type="group")
        await tg.wait_for("sendMessage", predicate=lambda p: p.get("text") == NOT_ANSWERED_TEXT)
        tg.push_text("/stop", chat_id=GROUP, user_id=8, chat_type="group")
        await tg.wait_for("sendMessage", predicate=lambda p: p.get("text") == "Stopped.")
        await d.engine.progress.wait_until(lambda: d.engine.progress.turns_finished >= 1, timeout=5)
    hold.set()
    rows = db(tmp_path).execute("SELECT json_extract(trace, '$.stop_reason') FROM turns").fetchall()
    assert [r[0] for r in rows] == ["stopped"]
