"""Discord intake (adapters/discord/intake.py): edits of a waiting message, link previews, order per channel."""

from __future__ import annotations

import asyncio
from typing import Any

from fakes.openai_server import is_loop
from support import (
    CHANNEL_ID,
    GUILD_ID,
    Gate,
    contents,
    discord_barrier,
    discord_bot,
    discord_config,
    judges_say_done,
    loop_requests,
    say,
    user_text,
)

from adapters.discord.adapter import DiscordAdapter
from bumblebot.core.events import Inbound
from bumblebot.core.settings import DiscordSettings


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

    async def command(
        self, inbound: Inbound, name: str, *, kv: dict[str, str] | None = None, manager: bool = False
    ) -> str | None:
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


# -- edits -------------------------------------------------------------------------------------


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


# -- arrival order -----------------------------------------------------------------------------


async def test_discord_a_slow_quote_lookup_holds_up_only_its_own_channel(tmp_path, llm, dc):
    """Arrival order is kept per channel, not for all of Discord: while a replied-to message is
    fetched for its quote (up to 5 s), a message in another channel is answered meanwhile (one
    lock for all of Discord once made every channel wait). (The lookup is slowed by a 429
    discord.py waits out, 2 s.)"""
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
