"""Issue 16, items 6 and 7: what the platforms hand in (commands, edits, quoted replies).

Each test uses the failing input of the issue, through the real python-telegram-bot and
discord.py clients against the fakes. "Nothing happened" is observed after the update was
handled, never after a sleep: on Telegram once the next ``getUpdates`` moved the offset past it;
on Discord once a later event was handled (the adapter takes events one at a time, in order).

* Commands: ``/reset@other_bot`` reset this bot's conversation (Discord took ``/Reset@anything``
  as its own). A command for another bot is now ignored; ``/reset@<our name>`` still resets.
* Edits: an edit of a message still waiting for its turn was never seen (Telegram polled only
  ``message``; Discord had no MESSAGE_UPDATE handler). It now replaces the message; a later
  edit is ignored and the message is answered once.
* Quotes: a reply on Discord did not show the model what it replied to. It now does, as on
  Telegram (``[Replying to Name: text]``).
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from conftest import running, write_config
from fakes.discord_server import FakeDiscord
from fakes.openai_server import FakeOpenAI, is_loop
from fakes.telegram_server import BOT_USER, FakeTelegram
from support import Gate, contents, judges_say_done, loop_requests, say

from adapters.discord.adapter import DiscordAdapter
from adapters.discord.replies import DELETED_QUOTE, QUOTE_CHARS
from bumblebot.core.events import Inbound
from bumblebot.core.settings import DiscordSettings

GROUP = -500
GUILD_ID = "600000000000000060"
CHANNEL_ID = "600000000000000061"
MESSAGES = r"/channels/\d+/messages"
FRESH = "Fresh start"


# -- helpers ---------------------------------------------------------------------------------


@pytest.fixture
async def dc() -> AsyncIterator[FakeDiscord]:
    async with FakeDiscord() as fake:
        yield fake
        assert fake.server_errors == []


def discord_config(tmp_path: Path, llm: FakeOpenAI, dc: FakeDiscord, **sections: Any) -> Path:
    section = {"enabled": True, "api_base_url": dc.api_base, "gateway_url": dc.gateway_url}
    return write_config(tmp_path, llm, None, discord=section, **sections)


def discord_bot(dc: FakeDiscord, config: Path) -> Any:
    return running(config, telegram_token=None, discord_token=dc.token)


async def handled(tg: FakeTelegram, update: dict[str, Any]) -> None:
    """Wait until the daemon acknowledged ``update`` (its next poll starts past it)."""
    await tg.wait_for("getUpdates", predicate=lambda p: int(p.get("offset") or 0) > update["update_id"], timeout=10)


async def discord_barrier(dc: FakeDiscord, n: int) -> None:
    """Wait until every event dispatched so far was handled: a ``/help`` DM from another user
    (answered without a turn) is taken after them; ``n`` counts the barriers so far."""
    carol = dc.human("2000000000000000077", "carol")
    await dc.send_dm("/help", author=carol)
    await dc.wait_for_call("POST", f"/channels/{dc.dm_channel_id(carol)}/messages", n=n, status=200)


def user_text(request: dict[str, Any]) -> str:
    """The last user message of a model request (the turn's input)."""
    return [m["content"] for m in request["messages"] if m["role"] == "user"][-1]


def journal_texts(tmp_path: Path) -> list[tuple[str, str]]:
    rows = sqlite3.connect(tmp_path / "data" / "bumblebot.db").execute("SELECT text, status FROM journal ORDER BY id")
    return [tuple(r) for r in rows]


class RecordingIntake:
    """The engine as an adapter sees it (``bumblebot.core.adapter.Intake``), recording each call:
    for the adapter's own decisions, which the daemon's visible behaviour cannot tell apart
    (an update that is no edit and an edit that comes too late both change nothing)."""

    accepting = True
    entity_name = "Bumble"

    def __init__(self) -> None:
        self.calls: list[tuple[str, Inbound | None]] = []
        self._changed = asyncio.Condition()

    async def _record(self, name: str, inbound: Inbound | None = None) -> None:
        async with self._changed:
            self.calls.append((name, inbound))
            self._changed.notify_all()

    def of(self, name: str) -> list[Inbound]:
        return [i for n, i in self.calls if n == name and i is not None]

    async def wait_for(self, name: str, n: int = 1, timeout: float = 5.0) -> list[Inbound]:
        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(lambda: len(self.of(name)) >= n), timeout)
        return self.of(name)

    async def submit(self, inbound: Inbound, *, kv: dict[str, str] | None = None) -> bool:
        await self._record("submit", inbound)
        return True

    async def command(self, inbound: Inbound, name: str, *, kv: dict[str, str] | None = None) -> str | None:
        await self._record("command", inbound)
        return None

    async def answer(self, inbound: Inbound, text: str | None, *, kv: dict[str, str] | None = None) -> bool:
        await self._record("answer", inbound)
        return True

    async def observe(self, inbound: Inbound, *, kv: dict[str, str] | None = None) -> bool:
        await self._record("observe", inbound)
        return True

    async def edit(self, inbound: Inbound) -> bool:
        await self._record("edit", inbound)
        return True

    async def move_chat(self, old: Any, new: Any) -> bool:
        return False

    async def refuse_once(self, inbound: Inbound, text: str, *, kv: dict[str, str] | None = None) -> None:
        await self._record("refuse_once", inbound)

    async def reply(self, chat: Any, text: str) -> None:
        await self._record("reply")

    async def cursor(self, key: str) -> str | None:
        return None

    async def set_cursor(self, key: str, value: str) -> None:
        return None


# -- item 6: a command addressed to another bot ------------------------------------------------


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


# -- item 7: edits -------------------------------------------------------------------------------


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


async def test_discord_edit_of_a_queued_message_is_what_the_model_sees(tmp_path, llm, dc):
    judges_say_done(llm)
    first = Gate(say("one moment"))
    llm.push(first, when=lambda r: is_loop(r) and "hello" in user_text(r))
    llm.push(say("Paris"), when=lambda r: is_loop(r) and "capital" in user_text(r))
    config = discord_config(tmp_path, llm, dc, cognition={"mid_turn_messages": "queue", "classifier": False})
    async with discord_bot(dc, config) as d:
        await dc.send_dm("hello")
        await asyncio.wait_for(first.entered.wait(), 5)
        queued = await dc.send_dm("what is the capital of Spain?")
        await discord_barrier(dc, 1)  # journaled as first written
        await dc.edit_message(queued["id"], "what is the capital of France?")
        await discord_barrier(dc, 2)
        first.release.set()
        await d.engine.wait_for_turns(2)
    assert dc.messages_sent(dc.dm_channel_id()) == ["one moment", "Paris"]
    assert "what is the capital of France?" in user_text(loop_requests(llm)[-1])
    assert all("Spain" not in contents(r) for r in loop_requests(llm))


async def test_discord_a_later_edit_is_ignored_and_answered_once(tmp_path, llm, dc):
    judges_say_done(llm)
    llm.push(say("Madrid"), when=lambda r: is_loop(r) and "Spain" in user_text(r))
    async with discord_bot(dc, discord_config(tmp_path, llm, dc)) as d:
        asked = await dc.send_dm("what is the capital of Spain?")
        await d.engine.wait_for_turns(1)
        await dc.edit_message(asked["id"], "what is the capital of France?")
        status = await dc.send_dm("/status")
        await dc.wait_for_call("POST", f"/channels/{dc.dm_channel_id()}/messages", n=2, status=200)
        await dc.edit_message(status["id"], "/reset")  # after it ran: not run again, nor /reset
        await discord_barrier(dc, 1)
        finished = d.engine.progress.turns_finished
    sent = dc.messages_sent(dc.dm_channel_id())
    assert sent[0] == "Madrid" and len(sent) == 2 and sent[1].startswith("Context: ")
    assert finished == 1 and len(loop_requests(llm)) == 1
    assert all("France" not in contents(r) for r in llm.requests)


async def test_discord_link_previews_are_not_edits_and_an_edit_into_a_command_is_not_run(dc):
    """Discord sends MESSAGE_UPDATE when it adds a link preview (embeds, no ``edited_timestamp``)
    and again after an edit; only the author's change of the text reaches ``Intake.edit``, once,
    as the message reads now. An edit into ``/reset`` runs nothing and edits nothing."""
    intake = RecordingIntake()
    settings = DiscordSettings(enabled=True, api_base_url=dc.api_base, gateway_url=dc.gateway_url)
    adapter = DiscordAdapter(intake, settings, dc.token)  # type: ignore[arg-type]
    await adapter.start()
    try:
        sent = await dc.send_dm("look at https://example.com")
        await intake.wait_for("submit")
        preview = [{"type": "link", "url": "https://example.com", "title": "Example Domain"}]
        await dc.edit_message(sent["id"], embeds=preview)  # the preview: no edit
        await dc.edit_message(sent["id"], "look at https://example.org")  # the person's edit
        await dc.edit_message(sent["id"], embeds=preview)  # the new link's preview: no edit
        await dc.edit_message(sent["id"], "/reset")  # a command now: not run, not an edit
        await dc.send_dm("/status")
        await intake.wait_for("command")
    finally:
        await adapter.stop()
    [edited] = intake.of("edit")
    assert edited.message_id == sent["id"] and edited.text == "look at https://example.org"
    assert [i.text for i in intake.of("command")] == ["/status"]


# -- item 7: quoted replies ----------------------------------------------------------------------


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


async def test_discord_a_slow_quote_lookup_holds_up_only_its_own_channel(tmp_path, llm, dc):
    """Review of issue 16: one intake lock for all of Discord was held while a replied-to message
    was fetched for its quote (up to 5 s), so every channel's messages waited. Now the order is
    kept per channel. (The lookup is slowed by a 429 discord.py waits out, 2 s.)"""
    judges_say_done(llm)
    dc.add_guild(GUILD_ID, [CHANNEL_ID], name="Hive")
    llm.push(say("answer in the guild"), when=lambda r: is_loop(r) and "meanwhile" in user_text(r))
    llm.push(say("answer in the DM"), when=lambda r: is_loop(r) and "still true" in user_text(r))
    async with discord_bot(dc, discord_config(tmp_path, llm, dc)) as d:
        dm = dc.dm_channel_id()
        old = dc.message_payload("an old note about the roadmap", dm)  # never seen by the client
        fetch = dc.message_payload("still true?", dm, referenced_message=old)
        del fetch["referenced_message"]  # Discord did not resolve it: the client looks it up
        dc.fail_next_rate_limited("GET", rf"/channels/{dm}/messages/{old['id']}", retry_after=2.0)
        await dc.dispatch("MESSAGE_CREATE", fetch)
        await dc.wait_for_call("GET", rf"/channels/{dm}/messages/{old['id']}")  # the lookup waits
        await dc.send_guild_message("meanwhile, in the guild", GUILD_ID, CHANNEL_ID, mention_bot=True)
        await d.engine.wait_for_turns(2, timeout=15)
    guild, direct = (dc.matching_calls("POST", rf"/channels/{c}/messages", status=200)[-1] for c in (CHANNEL_ID, dm))
    assert guild.time < direct.time  # the guild's answer did not wait for the DM's lookup
