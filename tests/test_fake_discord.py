"""The fake Discord server (tests/fakes/discord_server.py) against the real discord.py client.

Every test runs a real ``discord.Client`` connected to `FakeDiscord` over 127.0.0.1 and waits
on events (asyncio.Event / Condition) with timeouts, never on sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
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

    def __init__(self, intents: discord.Intents, **options: Any) -> None:
        super().__init__(intents=intents, guild_ready_timeout=0.1, **options)
        self.ready = asyncio.Event()
        self.ready_payloads: list[dict[str, Any]] = []  # READY ``d``s, with enable_debug_events
        self.task: asyncio.Task[None] | None = None  # client.start(), when run by `Bots`
        self.received: list[discord.Message] = []
        self.handler_errors: list[str] = []
        self.reply: Callable[[discord.Message], Awaitable[None]] | None = None
        self._cond = asyncio.Condition()

    async def before_identify_hook(self, shard_id: int | None, *, initial: bool = False) -> None:
        """No pause before a re-IDENTIFY (discord.py's documented default sleeps 5 s)."""

    async def on_ready(self) -> None:
        self.ready.set()

    async def on_socket_raw_receive(self, raw: str) -> None:
        frame = json.loads(raw)
        if frame.get("t") == "READY":
            self.ready_payloads.append(frame["d"])

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


# ---- shards and concurrent sessions ---------------------------------------------------------


class Bots:
    """RecordingClients started against any FakeDiscord, closed on teardown (`bots` fixture)."""

    def __init__(self) -> None:
        self.running: list[RecordingClient] = []

    async def start(self, fake: FakeDiscord, *, shard_id: int | None = None) -> RecordingClient:
        options: dict[str, Any] = {"enable_debug_events": True}
        if shard_id is not None:
            options.update(shard_id=shard_id, shard_count=fake.shard_count)
        client = RecordingClient(default_intents(), **options)
        client.task = asyncio.create_task(client.start(fake.token))
        self.running.append(client)
        await fake.wait_identified(count=fake.identify_count + 1)
        await asyncio.wait_for(client.ready.wait(), 5.0)
        return client

    async def close_all(self) -> None:
        for client in self.running:
            await client.close()
            assert client.task is not None
            await asyncio.wait_for(client.task, 5.0)  # re-raises anything client.start() raised
            assert client.handler_errors == []


@pytest.fixture
async def bots() -> AsyncIterator[Bots]:
    started = Bots()
    yield started
    await started.close_all()


@pytest.fixture
async def sharded() -> AsyncIterator[FakeDiscord]:
    """A FakeDiscord that expects two shards."""
    async with FakeDiscord(shard_count=2) as fake:
        with fake.patch_discord():
            yield fake
        assert fake.server_errors == []


@contextlib.asynccontextmanager
async def raw_gateway(fake: FakeDiscord) -> AsyncIterator[aiohttp.ClientWebSocketResponse]:
    """A bare websocket on the fake's gateway, past HELLO, speaking the protocol by hand."""
    url = f"{fake.gateway_url}?v=10&encoding=json"
    async with aiohttp.ClientSession() as http, http.ws_connect(url) as ws:
        hello = await ws.receive_json(timeout=5.0)
        assert hello["op"] == 10
        yield ws


async def resume(
    ws: aiohttp.ClientWebSocketResponse, fake: FakeDiscord, session_id: str, seq: int
) -> list[dict[str, Any]]:
    """Send RESUME; return the frames up to RESUMED or INVALID_SESSION, that one included."""
    await ws.send_json({"op": 6, "d": {"token": fake.token, "session_id": session_id, "seq": seq}})
    frames: list[dict[str, Any]] = []
    while not frames or (frames[-1].get("t") != "RESUMED" and frames[-1]["op"] != 9):
        frames.append(await ws.receive_json(timeout=5.0))
    return frames


def events(frames: list[dict[str, Any]]) -> list[tuple[str | None, str | None]]:
    """(event name, message id) of each frame, to compare replays."""
    return [(f.get("t"), (f.get("d") or {}).get("id")) for f in frames]


async def drop(client: RecordingClient) -> tuple[str, int]:
    """Stop a client as a process dying mid-session does: its socket closes with 4000 (the code
    discord.py closes with when it means to RESUME) and it never comes back. Returns its
    session id and last sequence number.

    ``client.close()`` runs while discord.py's gateway loop still waits for the server's answer
    to the close frame, so the loop sees the client closed and does not reconnect; the socket
    is closed already, so no 1000 follows."""
    assert client.ws is not None and client.task is not None
    session_id, seq = client.ws.session_id, client.ws.sequence
    assert session_id is not None and seq is not None
    await client.ws.close(code=4000)
    await client.close()
    await asyncio.wait_for(client.task, 5.0)
    return session_id, seq


async def test_each_shard_gets_its_guilds_and_dms_go_to_shard_0(
    sharded: FakeDiscord, bots: Bots
) -> None:
    g0, g1 = sharded.guild_id_on_shard(0), sharded.guild_id_on_shard(1)
    ch0, ch1 = sharded.snowflake(), sharded.snowflake()
    sharded.add_guild(g0, [ch0], name="Zero")
    sharded.add_guild(g1, [ch1], name="One")
    zero = await bots.start(sharded, shard_id=0)
    early = await sharded.send_guild_message("early", g1, ch1)  # shard 1 not identified yet
    one = await bots.start(sharded, shard_id=1)

    assert [r["guilds"] for r in zero.ready_payloads] == [[{"id": g0, "unavailable": True}]]
    assert [r["guilds"] for r in one.ready_payloads] == [[{"id": g1, "unavailable": True}]]
    assert [r["shard"] for r in zero.ready_payloads + one.ready_payloads] == [[0, 2], [1, 2]]
    assert [g.id for g in zero.guilds] == [int(g0)] and [g.id for g in one.guilds] == [int(g1)]
    assert zero.guilds[0].shard_id == 0 and one.guilds[0].shard_id == 1  # discord.py agrees
    assert sharded.shard_of(g0) == 0 and sharded.shard_of(g1) == 1
    assert sharded.live_shards() == [0, 1] and sharded.identifies_by_shard == {0: 1, 1: 1}
    assert [(s["shard"], s["live"], s["ended"]) for s in sharded.sessions()] == [
        (0, True, False),
        (1, True, False),
    ]

    await sharded.send_guild_message("for one", g1, ch1)
    await sharded.send_guild_message("for zero", g0, ch0)
    await sharded.send_dm("direct")
    # Each socket keeps its order: anything sent to the wrong shard would arrive before these.
    await sharded.send_dm("last for zero")
    await sharded.send_guild_message("last for one", g1, ch1)

    got_zero = await zero.wait_messages(3)
    got_one = await one.wait_messages(3)
    assert [m.content for m in got_zero] == ["for zero", "direct", "last for zero"]
    assert [m.content for m in got_one] == ["early", "for one", "last for one"]
    assert got_one[0].id == int(early["id"])
    assert isinstance(got_zero[1].channel, discord.DMChannel)
    async with aiohttp.ClientSession() as http:
        headers = {"Authorization": f"Bot {sharded.token}"}
        async with http.get(f"{sharded.api_base}/gateway/bot", headers=headers) as response:
            assert (await response.json())["shards"] == 2


async def test_force_reconnect_of_one_shard_leaves_the_other_alone(
    sharded: FakeDiscord, bots: Bots
) -> None:
    g1, ch1 = sharded.guild_id_on_shard(1), sharded.snowflake()
    sharded.add_guild(g1, [ch1])
    zero = await bots.start(sharded, shard_id=0)
    one = await bots.start(sharded, shard_id=1)
    before = sharded.sessions()

    await sharded.force_reconnect("close", shard=1)
    await sharded.send_guild_message("while one is away", g1, ch1)
    await sharded.wait_resumed()

    [message] = await one.wait_messages(1)
    assert message.content == "while one is away"
    assert sharded.resume_count == 1 and sharded.identify_count == 2
    assert len(sharded.gw_close_codes) == 1 and sharded.live_shards() == [0, 1]
    assert [s["session_id"] for s in sharded.sessions()] == [s["session_id"] for s in before]
    assert zero.received == []


async def test_a_dropped_session_is_resumed_from_another_socket_until_closed_with_1000(
    dc: FakeDiscord, bots: Bots
) -> None:
    client = await bots.start(dc)
    await dc.send_dm("seen live")
    await client.wait_messages(1)
    session_id, seq = await drop(client)
    await dc.wait_until(lambda: dc.live_shards() == [], 5.0, "the socket gone")
    assert [(s["session_id"], s["live"], s["ended"]) for s in dc.sessions()] == [
        (session_id, False, False)
    ]
    assert len(dc.gw_queries) == 1 and dc.resume_count == 0  # the client did not come back

    missed = [await dc.send_dm("missed 1"), await dc.send_dm("missed 2")]
    async with raw_gateway(dc) as first:
        frames = await resume(first, dc, session_id, seq)
        assert events(frames) == [
            ("MESSAGE_CREATE", missed[0]["id"]),
            ("MESSAGE_CREATE", missed[1]["id"]),
            ("RESUMED", None),
        ]
        assert [f["s"] for f in frames] == [seq + 1, seq + 2, seq + 3]
        assert dc.resume_count == 1 and dc.live_shards() == [0]
        live = await dc.send_dm("live again")
        assert events([await first.receive_json(timeout=5.0)]) == [("MESSAGE_CREATE", live["id"])]

        # A second socket takes the session over: the first is closed with 4000 first.
        async with raw_gateway(dc) as second:
            first_closed = asyncio.create_task(first.receive(timeout=5.0))
            frames = await resume(second, dc, session_id, seq + 4)
            assert events(frames) == [("RESUMED", None)] and frames[0]["s"] == seq + 5
            closing = await first_closed
            assert closing.type == aiohttp.WSMsgType.CLOSE and closing.data == 4000
            assert [(s["live"], s["ended"]) for s in dc.sessions()] == [(True, False)]
            await second.close(code=1000)
    await dc.wait_until(lambda: dc.sessions()[0]["ended"], 5.0, "the session ended")

    async with raw_gateway(dc) as late:
        assert await resume(late, dc, session_id, seq + 5) == [{"op": 9, "d": False}]
    assert dc.resume_count == 2 and dc.identify_count == 1


async def test_a_new_identify_beside_a_resumable_session_opens_a_second_session(
    sharded: FakeDiscord, bots: Bots
) -> None:
    g1, ch1 = sharded.guild_id_on_shard(1), sharded.snowflake()
    sharded.add_guild(g1, [ch1])
    old = await bots.start(sharded, shard_id=1)
    old_id, old_seq = await drop(old)
    assert sharded.sessions(1)[0]["seq"] == old_seq

    new = await bots.start(sharded, shard_id=1)
    new_id = new.ws.session_id
    assert new_id != old_id and sharded.identifies_by_shard[1] == 2
    assert [(s["session_id"], s["live"], s["ended"]) for s in sharded.sessions(1)] == [
        (old_id, False, False),
        (new_id, True, False),
    ]

    payload = await sharded.send_guild_message("to shard one", g1, ch1)
    [message] = await new.wait_messages(1)
    assert message.id == int(payload["id"])
    assert sharded.sessions(1)[0]["seq"] == old_seq + 1  # logged for the old session too

    async with raw_gateway(sharded) as ws:
        frames = await resume(ws, sharded, old_id, old_seq)
        assert events(frames) == [("MESSAGE_CREATE", payload["id"]), ("RESUMED", None)]
        assert [s["live"] for s in sharded.sessions(1)] == [True, True]
    assert sharded.live_shards() == [1] and sharded.sessions(0) == []


@pytest.mark.parametrize(
    ("shard_id", "shard_count"),
    [(0, 3), (2, 2), (None, None)],
    ids=["wrong-count", "id-out-of-range", "no-shard-field"],
)
async def test_identify_with_a_wrong_shard_is_closed_with_4010(
    sharded: FakeDiscord, shard_id: int | None, shard_count: int | None
) -> None:
    client = RecordingClient(default_intents(), shard_id=shard_id, shard_count=shard_count)
    with pytest.raises(discord.ConnectionClosed) as closed:
        await asyncio.wait_for(client.start(sharded.token), 5.0)

    assert closed.value.code == 4010
    assert sharded.identify_count == 0 and sharded.sessions() == []
    assert len(sharded.gw_queries) == 1  # discord.py does not retry after 4010
    identify = next(p for p in sharded.gw_received if p["op"] == 2)
    assert identify["d"].get("shard") == (None if shard_id is None else [shard_id, shard_count])
