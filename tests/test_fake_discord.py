"""The fake Discord server (tests/fakes/discord_server.py) against the real discord.py client.

Every test runs a real ``discord.Client`` connected to `FakeDiscord` over 127.0.0.1 and waits
on events (asyncio.Event / Condition) with timeouts, never on sleeps.
"""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

with warnings.catch_warnings():
    # discord.py 2.7.1 (discord/player.py) imports the stdlib `audioop`, deprecated since
    # Python 3.11; under filterwarnings=error that import fails. Not the fake's doing; the
    # project-wide fix is an "ignore:'audioop' is deprecated:DeprecationWarning" filter.
    warnings.filterwarnings("ignore", "'audioop' is deprecated", DeprecationWarning)
    import discord
    from discord import app_commands

from fakes.discord_server import BOT_ID, INTENT_MESSAGE_CONTENT, FakeDiscord

GUILD_ID = "500000000000000050"
CHANNEL_ID = "500000000000000051"
OTHER_CHANNEL_ID = "500000000000000052"


def default_intents(message_content: bool = True) -> discord.Intents:
    intents = discord.Intents.default()
    intents.message_content = message_content
    return intents


class RecordingClient(discord.Client):
    """A discord.Client that records on_ready/on_message/on_resumed and handler errors."""

    def __init__(self, intents: discord.Intents) -> None:
        super().__init__(intents=intents, guild_ready_timeout=0.1)
        self.ready = asyncio.Event()
        self.received: list[discord.Message] = []
        self.handler_errors: list[str] = []
        self.reply: Callable[[discord.Message], Awaitable[None]] | None = None
        self._cond = asyncio.Condition()

    async def before_identify_hook(self, shard_id: int | None, *, initial: bool = False) -> None:
        """No pause before a re-IDENTIFY (discord.py's documented default sleeps 5 s)."""

    async def on_ready(self) -> None:
        self.ready.set()

    async def on_message(self, message: discord.Message) -> None:
        if self.user is not None and message.author.id == self.user.id:
            return
        async with self._cond:
            self.received.append(message)
            self._cond.notify_all()
        if self.reply is not None:
            await self.reply(message)

    async def on_error(self, event_method: str, /, *args: object, **kwargs: object) -> None:
        import traceback

        self.handler_errors.append(f"{event_method}: {traceback.format_exc()}")

    async def wait_messages(self, n: int, timeout: float = 5.0) -> list[discord.Message]:
        async with self._cond:
            await asyncio.wait_for(self._cond.wait_for(lambda: len(self.received) >= n), timeout)
        return self.received


StartBot = Callable[..., Awaitable[RecordingClient]]


@pytest.fixture
async def dc() -> AsyncIterator[FakeDiscord]:
    async with FakeDiscord() as fake:
        with fake.patch_discord():
            yield fake
        assert fake.server_errors == []


@pytest.fixture
async def start_bot(dc: FakeDiscord) -> AsyncIterator[StartBot]:
    """Start RecordingClients against ``dc``; on teardown close each and require a clean exit."""
    running: list[tuple[RecordingClient, asyncio.Task[None]]] = []

    async def start(
        intents: discord.Intents | None = None, wait_ready: bool = True
    ) -> RecordingClient:
        client = RecordingClient(intents or default_intents())
        task = asyncio.create_task(client.start(dc.token))
        running.append((client, task))
        await dc.wait_identified(count=dc.identify_count + 1)
        if wait_ready:
            await asyncio.wait_for(client.ready.wait(), 5.0)
        return client

    yield start
    for client, task in running:
        await client.close()
        await asyncio.wait_for(task, 5.0)  # re-raises anything client.start() raised
        assert client.handler_errors == []


async def test_login_identify_and_ready(dc: FakeDiscord, start_bot: StartBot) -> None:
    client = await start_bot()

    assert client.user is not None and str(client.user.id) == BOT_ID
    assert client.application_id == int(BOT_ID)
    paths = [(c.method, c.path) for c in dc.calls]
    assert ("GET", "/users/@me") in paths and ("GET", "/oauth2/applications/@me") in paths
    identify = next(p for p in dc.gw_received if p["op"] == 2)
    assert identify["d"]["token"] == "TESTTOKEN"
    assert dc.intents is not None and dc.intents & INTENT_MESSAGE_CONTENT
    assert dc.gw_queries[0]["v"] == "10" and dc.gw_queries[0]["encoding"] == "json"


async def test_wrong_token_is_login_failure(dc: FakeDiscord) -> None:
    client = discord.Client(intents=default_intents())
    try:
        with pytest.raises(discord.LoginFailure):
            await client.login("WRONG")
    finally:
        await client.close()
    assert dc.requests[-1].status == 401


async def test_dm_fires_on_message_and_reply_is_recorded(
    dc: FakeDiscord, start_bot: StartBot
) -> None:
    client = await start_bot()
    sent: list[discord.Message] = []
    replied = asyncio.Event()

    async def echo(message: discord.Message) -> None:
        sent.append(await message.channel.send(f"echo: {message.content}"))
        replied.set()

    client.reply = echo
    payload = await dc.send_dm("hello there")
    [message] = await client.wait_messages(1)
    await asyncio.wait_for(replied.wait(), 5.0)
    dm_channel = dc.dm_channel_id()

    assert isinstance(message.channel, discord.DMChannel)
    assert message.guild is None
    assert message.content == "hello there" and str(message.id) == payload["id"]
    await dc.wait_for_call("POST", rf"/channels/{dm_channel}/messages", status=200)
    assert dc.messages_sent(dm_channel) == ["echo: hello there"]
    assert dc.messages_sent("1") == []
    assert str(sent[0].id) == dc.created_messages(dm_channel)[0]["id"]
    assert sent[0].author.id == int(BOT_ID)

    await dc.dispatch("MESSAGE_CREATE", payload)  # the same payload twice: delivered twice
    received = await client.wait_messages(2)
    assert received[1].id == received[0].id


async def test_typing_is_recorded(dc: FakeDiscord, start_bot: StartBot) -> None:
    client = await start_bot()
    await dc.send_dm("type please")
    [message] = await client.wait_messages(1)

    async with message.channel.typing():
        pass

    [call] = await dc.wait_for_call("POST", f"/channels/{message.channel.id}/typing", status=204)
    assert call.json is None


async def test_guild_message_has_guild_and_mention(dc: FakeDiscord, start_bot: StartBot) -> None:
    dc.add_guild(GUILD_ID, [CHANNEL_ID, OTHER_CHANNEL_ID], name="Hive")
    client = await start_bot()
    guild = client.get_guild(int(GUILD_ID))
    assert guild is not None and guild.name == "Hive"
    perms = guild.get_channel(int(CHANNEL_ID)).permissions_for(guild.me)  # type: ignore[union-attr]
    assert perms.view_channel and perms.send_messages and perms.read_message_history

    await dc.send_guild_message("are you there?", GUILD_ID, CHANNEL_ID, mention_bot=True)
    await dc.send_guild_message("just chatting", GUILD_ID, OTHER_CHANNEL_ID)
    mentioned, plain = await client.wait_messages(2)

    assert client.user is not None
    assert mentioned.guild is not None and mentioned.guild.id == int(GUILD_ID)
    assert isinstance(mentioned.channel, discord.TextChannel)
    assert mentioned.content == f"<@{BOT_ID}> are you there?"
    assert client.user.mentioned_in(mentioned)
    assert isinstance(mentioned.author, discord.Member)
    assert plain.channel.id == int(OTHER_CHANNEL_ID) and plain.content == "just chatting"
    assert not client.user.mentioned_in(plain)

    reply = await mentioned.reply("yes")
    assert reply.reference is not None and reply.reference.message_id == mentioned.id
    assert dc.messages_sent(CHANNEL_ID) == ["yes"]


async def test_without_content_intent_unmentioned_guild_content_is_blank(
    dc: FakeDiscord, start_bot: StartBot
) -> None:
    dc.add_guild(GUILD_ID, [CHANNEL_ID])
    client = await start_bot(default_intents(message_content=False))

    await dc.send_guild_message("secret", GUILD_ID, CHANNEL_ID)
    await dc.send_guild_message("hi bot", GUILD_ID, CHANNEL_ID, mention_bot=True)
    await dc.send_dm("dm text")
    plain, mentioned, dm = await client.wait_messages(3)

    assert plain.content == ""
    assert mentioned.content == f"<@{BOT_ID}> hi bot"
    assert dm.content == "dm text"


async def test_content_over_2000_chars_is_400_and_2000_is_fine(
    dc: FakeDiscord, start_bot: StartBot
) -> None:
    client = await start_bot()
    await dc.send_dm("x")
    [message] = await client.wait_messages(1)

    with pytest.raises(discord.HTTPException) as info:
        await message.channel.send("a" * 2001)
    assert info.value.status == 400 and info.value.code == 50035
    with pytest.raises(discord.HTTPException) as empty:
        await message.channel.send("   ")
    assert empty.value.status == 400 and empty.value.code == 50006
    await message.channel.send("b" * 2000)

    assert dc.messages_sent() == ["b" * 2000]


async def test_429_with_via_is_retried_once_transparently(
    dc: FakeDiscord, start_bot: StartBot
) -> None:
    client = await start_bot()
    await dc.send_dm("x")
    [message] = await client.wait_messages(1)
    path = rf"/channels/{message.channel.id}/messages"
    dc.fail_next_rate_limited("POST", path, retry_after=0.05)

    sent = await message.channel.send("after the limit")

    assert [r.status for r in dc.matching_calls("POST", path)] == [429, 200]
    assert dc.messages_sent() == ["after the limit"]
    assert str(sent.id) == dc.created_messages()[0]["id"]


async def test_injected_403_raises_forbidden(dc: FakeDiscord, start_bot: StartBot) -> None:
    client = await start_bot()
    await dc.send_dm("x")
    [message] = await client.wait_messages(1)
    dc.fail_next_forbidden("POST", r"/channels/\d+/messages")

    with pytest.raises(discord.Forbidden) as info:
        await message.channel.send("nope")
    assert info.value.code == 50013
    await message.channel.send("now fine")
    assert dc.messages_sent() == ["now fine"]


async def test_edit_fetch_and_unknown_message(dc: FakeDiscord, start_bot: StartBot) -> None:
    client = await start_bot()
    payload = await dc.send_dm("original")
    [message] = await client.wait_messages(1)

    sent = await message.channel.send("draft")
    edited = await sent.edit(content="final")
    fetched = await message.channel.fetch_message(int(payload["id"]))

    assert edited.content == "final" and edited.edited_at is not None
    assert dc.message(sent.id)["content"] == "final"  # type: ignore[index]
    assert dc.messages_sent() == ["draft"]
    assert fetched.content == "original"
    with pytest.raises(discord.NotFound):
        await message.channel.fetch_message(123)
    with pytest.raises(discord.NotFound):
        await client.fetch_guild(999)
    assert [(c.method, c.path) for c in dc.unknown_routes] == [("GET", "/guilds/999")]


@pytest.mark.parametrize("how", ["op7", "close"])
async def test_force_reconnect_resumes_and_delivers(
    dc: FakeDiscord, start_bot: StartBot, how: str
) -> None:
    client = await start_bot()
    await dc.send_dm("before")
    await client.wait_messages(1)

    await dc.force_reconnect(how)  # type: ignore[arg-type]
    await dc.wait_resumed()
    await dc.send_dm("after")
    messages = await client.wait_messages(2)

    assert [m.content for m in messages] == ["before", "after"]
    resume = [p for p in dc.gw_received if p["op"] == 6]
    assert len(resume) == 1 and resume[0]["d"]["session_id"].startswith("fake-session-")
    assert dc.identify_count == 1 and len(dc.gw_queries) == 2


async def test_events_dispatched_while_disconnected_are_replayed_on_resume(
    dc: FakeDiscord, start_bot: StartBot
) -> None:
    client = await start_bot()
    await dc.force_reconnect("close")
    await dc.send_dm("sent while down")  # logged, replayed after RESUME

    await dc.wait_resumed()
    [message] = await client.wait_messages(1)
    assert message.content == "sent while down"


async def test_invalid_session_makes_client_identify_again(
    dc: FakeDiscord, start_bot: StartBot
) -> None:
    client = await start_bot()
    await dc.invalidate_session(resumable=False)
    await dc.wait_identified(count=2)

    await dc.send_dm("fresh session")
    [message] = await client.wait_messages(1)
    assert message.content == "fresh session"


async def test_close_is_clean(dc: FakeDiscord) -> None:
    client = RecordingClient(default_intents())
    task = asyncio.create_task(client.start(dc.token))
    await dc.wait_identified()
    await asyncio.wait_for(client.ready.wait(), 5.0)
    n_calls = len(dc.calls)

    await client.close()
    await asyncio.wait_for(task, 5.0)

    assert task.exception() is None and client.is_closed()
    assert len(dc.calls) == n_calls  # close makes no REST calls
    await dc.wait_until(lambda: len(dc.gw_close_codes) == 1, 5.0, "gateway close")
    assert {p["op"] for p in dc.gw_received} == {1, 2}


async def test_slash_command_sync_and_interaction_response(
    dc: FakeDiscord, start_bot: StartBot
) -> None:
    client = await start_bot()
    tree = app_commands.CommandTree(client)
    asked: list[str] = []

    @tree.command(name="ask", description="Ask the entity")
    async def ask(interaction: discord.Interaction, text: str) -> None:
        asked.append(text)
        await interaction.response.send_message(f"you asked: {text}")

    synced = await tree.sync()
    assert [c.name for c in synced] == ["ask"] and synced[0].id
    payload = await dc.send_interaction("ask", {"text": "why?"}, channel_id=dc.dm_channel_id())
    [call] = await dc.wait_for_call(
        "POST", rf"/interactions/{payload['id']}/[^/]+/callback", status=200
    )

    assert asked == ["why?"]
    assert call.json["type"] == 4 and call.json["data"]["content"] == "you asked: why?"
    assert dc.interaction_responses[0]["id"] == payload["id"]
