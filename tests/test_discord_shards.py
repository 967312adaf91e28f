"""Discord's gateway shards: one process running them all, workers of a cluster splitting them,
and a shard taken over without losing a message (``adapters/discord/shards.py``,
``bumblebot/cluster/shards.py``). The drill with killed workers is ``tests/test_cluster_drill.py``.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import pytest
from aiohttp import web
from conftest import running, write_config
from fakes.discord_server import FakeDiscord
from fakes.openai_server import FakeOpenAI, Reply, is_aux, text, tool_calls
from fakes.postgres_server import PostgresServer
from support import judges_say_done, say

from adapters.discord.shards import replayed
from bumblebot.app.cluster import cluster_state
from bumblebot.core.errors import AdapterError

TOKEN = re.compile(r"m\d+")


def echo(request: dict[str, Any]) -> Reply:
    """Answers each turn with the ``m<n>`` tokens of its user messages not answered yet."""
    if is_aux(request):
        return text("DONE: ok")
    asked: list[str] = []
    for m in reversed(request["messages"]):
        if m["role"] == "assistant":
            break
        if m["role"] == "user":
            asked[:0] = TOKEN.findall(str(m["content"]))
    return tool_calls(("say", {"text": "re: " + " ".join(asked)}), ("end_turn", {}))


def config(folder: Path, llm: FakeOpenAI, dc: FakeDiscord, **sections: Any) -> Path:
    folder.mkdir(exist_ok=True)
    discord = {"enabled": True, "api_base_url": dc.api_base, "gateway_url": dc.gateway_url,
               "respond_in_guilds": "all", "shard_count": 2}
    return write_config(folder, llm, None, **{"discord": discord, **sections})


def worker(tmp_path: Path, name: str, llm: FakeOpenAI, dc: FakeDiscord, url: str) -> Any:
    path = config(tmp_path / name, llm, dc, store={"url": url}, cluster={"worker": name, "lease_s": 10})
    return running(path, telegram_token=None, discord_token=dc.token)


def guilds(dc: FakeDiscord) -> list[tuple[str, str]]:
    """A guild on each of the two shards, with one channel each: ``[(guild, channel)]``."""
    out = []
    for shard in (0, 1):
        guild, channel = dc.guild_id_on_shard(shard), dc.snowflake()
        dc.add_guild(guild, [channel], name=f"guild on shard {shard}")
        out.append((guild, channel))
    return out


def answered(dc: FakeDiscord, channel: str) -> list[str]:
    return [t for sent in dc.messages_sent(channel) for t in TOKEN.findall(sent)]


async def until_answered(dc: FakeDiscord, channel: str, tokens: list[str]) -> None:
    await dc.wait_until(lambda: len(answered(dc, channel)) >= len(tokens), 15, f"answers {tokens} in {channel}")


async def opened(daemon: Any) -> None:
    """Wait until the shards ``daemon`` took at its last balance are open and caught up."""
    await asyncio.gather(*daemon.shard_leases._opening.values())


async def drive(daemon: Any) -> None:
    """Balance ``daemon``'s shards here, one balance at a time (its own loop stopped), and wait
    until the shards its first balance took are open and caught up."""
    daemon._shards_task.cancel()
    await daemon.shard_leases.balance()
    await opened(daemon)


async def lease_owners(url: str) -> dict[str, str]:
    conn = await asyncpg.connect(url)
    try:
        rows = await conn.fetch("SELECT name, owner FROM leases WHERE name LIKE 'discord.shard:%'"
                                " AND expires_at > EXTRACT(EPOCH FROM clock_timestamp())")
    finally:
        await conn.close()
    return {r["name"]: r["owner"] for r in rows}


async def test_alone_a_sharded_bot_runs_every_shard_and_answers_in_each(tmp_path, llm):
    llm.default = echo
    async with FakeDiscord(shard_count=2) as dc:
        (g0, c0), (g1, c1) = guilds(dc)
        async with running(config(tmp_path, llm, dc), telegram_token=None, discord_token=dc.token):
            assert dc.live_shards() == [0, 1]
            await dc.send_guild_message("m1 on shard zero", g0, c0)
            await dc.send_guild_message("m2 on shard one", g1, c1)
            await dc.send_dm("m3 in a DM")
            dm = dc.dm_channel_id()
            for channel, tokens in ((c0, ["m1"]), (c1, ["m2"]), (dm, ["m3"])):
                await until_answered(dc, channel, tokens)
        assert (answered(dc, c0), answered(dc, c1), answered(dc, dm)) == (["m1"], ["m2"], ["m3"])
        assert dc.identifies_by_shard == {0: 1, 1: 1}
        assert dc.server_errors == []


async def test_two_workers_split_the_shards_and_a_shard_handed_over_misses_no_message(
    tmp_path, llm, postgres_server: PostgresServer
):
    """Worker a runs both shards alone; b joins, a gives shard 1 up, and the messages sent
    while shard 1 had no connection are answered once b resumes a's session, in order."""
    url = await postgres_server.database()
    llm.default = echo
    async with FakeDiscord(shard_count=2) as dc:
        (g0, c0), (g1, c1) = guilds(dc)
        async with worker(tmp_path, "a", llm, dc, url) as a:
            await drive(a)
            assert dc.live_shards() == [0, 1] and sorted(a.shard_leases.held) == [0, 1]
            await dc.send_guild_message("m1", g0, c0)
            await dc.send_guild_message("m2", g1, c1)
            await until_answered(dc, c0, ["m1"])
            await until_answered(dc, c1, ["m2"])
            async with worker(tmp_path, "b", llm, dc, url) as b:
                b._shards_task.cancel()
                await b.shard_leases.balance()  # both held by a: b waits
                assert b.shard_leases.held == {}
                await a.shard_leases.balance()  # two workers now: a gives shard 1 up
                assert sorted(a.shard_leases.held) == [0] and dc.live_shards() == [0]
                await dc.send_guild_message("m3", g1, c1)  # nobody runs shard 1 meanwhile
                await dc.send_guild_message("m4", g1, c1)
                resumed = dc.resume_count
                await b.shard_leases.balance()
                await opened(b)
                assert sorted(b.shard_leases.held) == [1] and dc.live_shards() == [0, 1]
                assert dc.resume_count == resumed + 1  # b resumed a's session to catch up
                await dc.send_guild_message("m5", g1, c1)
                await dc.send_guild_message("m6", g0, c0)
                await until_answered(dc, c1, ["m2", "m3", "m4", "m5"])
                await until_answered(dc, c0, ["m1", "m6"])
                assert await lease_owners(url) == {"discord.shard:0": "a", "discord.shard:1": "b"}
                await asyncio.gather(a.engine.wait_until(lambda: a.engine.settled),
                                     b.engine.wait_until(lambda: b.engine.settled))
        assert answered(dc, c0) == ["m1", "m6"]
        assert answered(dc, c1) == ["m2", "m3", "m4", "m5"]
        assert dc.server_errors == []


async def test_a_shard_taken_over_elsewhere_is_closed_here_and_its_checkpoint_left_alone(
    tmp_path, llm, postgres_server: PostgresServer
):
    """a stalled past its shard's lease, and another worker took the shard: a's next balance
    closes the shard at once and does not overwrite the new holder's checkpoint."""
    url = await postgres_server.database()
    llm.default = echo
    async with FakeDiscord(shard_count=2) as dc:
        guilds(dc)
        async with worker(tmp_path, "a", llm, dc, url) as a:
            await drive(a)
            await a.shard_leases.balance()  # saves both checkpoints
            state = await cluster_state(a.settings)
            roles = state["workers"][0]["roles"]  # the shards, not the lease that counts a among their workers
            assert [r for r in roles if r.startswith("discord")] == ["discord.shard:0", "discord.shard:1"]
            conn = await asyncpg.connect(url)
            try:
                await conn.execute("UPDATE leases SET expires_at = 0 WHERE name = 'discord.shard:1'")
                assert await a.store.acquire("discord.shard:1", "c", 30) is not None
                mine = json.dumps({"session_id": "the-new-holders", "resume_url": dc.gateway_url, "seq": 7})
                await a.store.set_kv("discord.shard:1", mine)
                await a.shard_leases.balance()
                assert sorted(a.shard_leases.held) == [0] and dc.live_shards() == [0]
                assert await a.store.get_kv("discord.shard:1") == mine
            finally:
                await conn.close()
        assert dc.server_errors == []


async def test_a_session_caught_up_with_twice_replays_everything_after_the_checkpoint_both_times():
    """A holder that dies before saving its own checkpoint leaves the next one the same
    checkpoint: the second catch-up must get what the first got and what came since (the
    first catch-up's RESUMED is no end of the second's replay)."""
    async with FakeDiscord(shard_count=2) as dc:
        guild, channel = dc.guild_id_on_shard(1), dc.snowflake()
        dc.add_guild(guild, [channel])
        async with aiohttp.ClientSession() as http, http.ws_connect(f"{dc.gateway_url}?v=10&encoding=json") as ws:
            await ws.receive_json()  # HELLO
            await ws.send_json({"op": 2, "d": {"token": dc.token, "intents": (1 << 15) | 513, "shard": [1, 2],
                                               "properties": {}}})
            ready = await ws.receive_json()
            await ws.close(code=4000)  # the holder's connection drops; its session stays resumable
        checkpoint = {"session_id": ready["d"]["session_id"], "resume_url": dc.gateway_url, "seq": ready["s"] + 1}
        await dc.send_guild_message("m1", guild, channel)
        first = await replayed(checkpoint, dc.token)
        await dc.send_guild_message("m2", guild, channel)
        second = await replayed(checkpoint, dc.token)
        assert [e["d"]["content"] for e in first] == ["m1"]
        assert [e["d"]["content"] for e in second] == ["m1", "m2"]


async def test_a_shard_count_discord_refuses_stops_the_start_naming_the_setting(tmp_path, llm):
    async with FakeDiscord(shard_count=2) as dc:
        guilds(dc)
        path = config(tmp_path, llm, dc, discord={"enabled": True, "api_base_url": dc.api_base,
                                                  "gateway_url": dc.gateway_url, "shard_count": 3})
        with pytest.raises(AdapterError, match=r"4010.*discord\.shard_count"):
            async with running(path, telegram_token=None, discord_token=dc.token):
                pass
        assert dc.live_shards() == []


# -- the catch-up when the previous session's gateway misbehaves ----------------------------------


async def gateway(handler: Any) -> tuple[web.AppRunner, str]:
    """A gateway of its own on 127.0.0.1 that runs ``handler`` for each websocket."""
    app = web.Application()
    app.router.add_get("/gateway", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"ws://127.0.0.1:{port}/gateway"


async def closes_before_hello(request: web.Request) -> web.WebSocketResponse:
    ws = web.WebSocketResponse()
    await ws.prepare(request)
    await ws.close(code=1001, message=b"going away")
    return ws


async def test_a_catch_up_whose_gateway_closes_before_hello_gives_nothing_and_raises_nothing():
    runner, url = await gateway(closes_before_hello)
    try:
        assert await replayed({"session_id": "s", "resume_url": url, "seq": 3}, "TOKEN") == []
    finally:
        await runner.cleanup()


async def test_a_catch_up_that_fails_does_not_wedge_the_shard(tmp_path, llm, postgres_server: PostgresServer):
    """The stored checkpoint names a gateway that closes before HELLO: the shard's own session
    goes on (its messages were held back for good before), and its checkpoints are saved."""
    url = await postgres_server.database()
    llm.default = echo
    runner, resume_url = await gateway(closes_before_hello)
    try:
        async with FakeDiscord(shard_count=2) as dc:
            (_, _), (g1, c1) = guilds(dc)
            async with worker(tmp_path, "a", llm, dc, url) as a:
                a._shards_task.cancel()
                await a.store.set_kv("discord.shard:1", json.dumps({"session_id": "old", "resume_url": resume_url, "seq": 5}))
                await a.shard_leases.balance()
                await opened(a)
                await dc.send_guild_message("m1", g1, c1)
                await until_answered(dc, c1, ["m1"])
                await a.shard_leases.balance()
                saved = json.loads(await a.store.get_kv("discord.shard:1") or "{}")
                assert saved.get("session_id") != "old"
    finally:
        await runner.cleanup()


async def test_a_catch_up_is_bounded_even_when_the_handshake_hangs():
    """A resume host that accepts the connection and never answers the upgrade."""
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await reader.read(1024):
            pass
        writer.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        checkpoint = {"session_id": "s", "resume_url": f"ws://127.0.0.1:{port}/gateway", "seq": 1}
        assert await asyncio.wait_for(replayed(checkpoint, "T", timeout=0.5), 10) == []
    finally:
        server.close()
        await server.wait_closed()


async def test_a_replay_cut_off_by_a_reconnect_is_resumed_from_the_last_event():
    resumed_after: list[int] = []

    async def reconnects_once(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        await ws.send_json({"op": 10, "d": {"heartbeat_interval": 41250}})
        resumed_after.append((await ws.receive_json())["d"]["seq"])
        if len(resumed_after) == 1:
            await ws.send_json({"op": 0, "t": "MESSAGE_CREATE", "s": 4, "d": {"id": "1", "content": "m1"}})
            await ws.send_json({"op": 7, "d": None})  # RECONNECT, before the replay's end
            await ws.close(code=4000)
        else:
            await ws.send_json({"op": 0, "t": "MESSAGE_CREATE", "s": 5, "d": {"id": "2", "content": "m2"}})
            await ws.send_json({"op": 0, "t": "RESUMED", "s": 6, "d": {}})
            await ws.receive()
        return ws

    runner, url = await gateway(reconnects_once)
    try:
        events = await replayed({"session_id": "s", "resume_url": url, "seq": 3}, "T")
    finally:
        await runner.cleanup()
    assert [e["d"]["content"] for e in events] == ["m1", "m2"]
    assert resumed_after == [3, 4]


async def left_resumable(dc: FakeDiscord) -> tuple[dict[str, Any], str, str]:
    """A shard-1 session whose holder died (closed with 4000) with a long backlog, then m1:
    its checkpoint, guild and channel."""
    guild, channel = dc.guild_id_on_shard(1), dc.snowflake()
    dc.add_guild(guild, [channel])
    async with aiohttp.ClientSession() as http, http.ws_connect(f"{dc.gateway_url}?v=10&encoding=json") as ws:
        await ws.receive_json()
        await ws.send_json({"op": 2, "d": {"token": dc.token, "intents": (1 << 15) | 513, "shard": [1, 2], "properties": {}}})
        ready = await ws.receive_json()
        await ws.close(code=4000)
    for _ in range(20_000):  # a busy shard: a replay longer than the catch-up is let run
        await dc.dispatch("TYPING_START", {"guild_id": guild, "channel_id": channel, "user_id": "1"}, shard=1)
    await dc.send_guild_message("m1", guild, channel)
    return {"session_id": ready["d"]["session_id"], "resume_url": dc.gateway_url, "seq": ready["s"] + 1}, guild, channel


async def test_a_catch_up_cancelled_or_timed_out_leaves_the_previous_session_resumable():
    """Cancelled (the worker stops, loses or gives up the shard meanwhile) or out of time, the
    catch-up closes with 4000 as it does when done, never ending the session it resumed."""
    async with FakeDiscord(shard_count=2) as dc:
        checkpoint, _, _ = await left_resumable(dc)
        task = asyncio.create_task(replayed(checkpoint, dc.token))
        await dc.wait_until(lambda: any(s["live"] for s in dc.sessions(1)), 10, "the RESUME taken")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await dc.wait_until(lambda: not any(s["live"] for s in dc.sessions(1)), 5, "the catch-up closed")
        await replayed(checkpoint, dc.token, timeout=0.3)  # shorter than the replay
        await dc.wait_until(lambda: not any(s["live"] for s in dc.sessions(1)), 5, "the catch-up closed")
        again = await replayed(checkpoint, dc.token)  # the next holder
        assert [e["d"]["content"] for e in again] == ["m1"]
        assert not any(s["ended"] for s in dc.sessions(1))


async def test_a_message_whose_journaling_failed_stays_after_the_checkpoint(tmp_path, llm, postgres_server: PostgresServer):
    """The database refuses to journal m2 (a failing write): the checkpoint stays before it, so
    the next holder replays it."""
    url = await postgres_server.database()
    llm.default = echo
    async with FakeDiscord(shard_count=2) as dc:
        (_, _), (g1, c1) = guilds(dc)
        async with worker(tmp_path, "a", llm, dc, url) as a:
            await drive(a)
            conn = await asyncpg.connect(url)
            try:
                await conn.execute("ALTER TABLE journal ADD CONSTRAINT no_m2 CHECK (text NOT LIKE '%m2%') NOT VALID")
                await dc.send_guild_message("m2", g1, c1)
                await dc.send_guild_message("m3", g1, c1)
                await until_answered(dc, c1, ["m3"])  # one channel, in order: m2's handler ended before
            finally:
                await conn.close()
            m2 = [s["seq"] for s in dc.logged("m2") if not s["ended"]][-1]
            assert a.shard_leases.host.checkpoint(1)["seq"] < m2


async def test_the_stop_button_and_a_slash_command_work_on_a_shard(tmp_path, llm):
    judges_say_done(llm)
    hold = asyncio.Event()
    reply = say("a long answer, word by word. " * 40)
    reply.stream_hold, reply.stream_hold_after, reply.stream_chars = hold, 12, 4
    llm.push(reply, when=lambda r: "tools" in r)
    async with FakeDiscord(shard_count=2) as dc:
        (_, _), (g1, c1) = guilds(dc)
        path = config(tmp_path, llm, dc, delivery={"streaming": "on", "stream_edit_interval_s": 0.2})
        async with running(path, telegram_token=None, discord_token=dc.token) as daemon:
            await dc.send_guild_message("tell me something long", g1, c1)
            await dc.wait_for_call("POST", f"/channels/{c1}/messages", status=200)
            [preview] = dc.created_messages(c1)
            [button] = preview["components"][0]["components"]
            await dc.press_button(preview["id"], button["custom_id"])  # arrives on shard 1's connection
            progress = daemon.engine.progress
            await progress.wait_until(lambda: progress.turns_finished >= 1, timeout=5)
            hold.set()
            interaction = await dc.send_interaction("help", channel_id=c1, guild_id=g1)
            await dc.wait_for_call("POST", rf"/webhooks/\d+/{interaction['token']}", status=200)
        assert dc.interaction_responses[0]["data"]["content"] == "Stopped."
        assert dc.server_errors == []


async def test_a_message_stuck_in_an_earlier_session_does_not_set_the_new_sessions_checkpoint(
    tmp_path, llm, postgres_server: PostgresServer
):
    """m5's journaling failed in a session Discord then invalidated; the shard identifies a new
    session, whose numbers start again. Its checkpoint is its own (after m6), not one before m5's
    number in the old session, which would skip the new session's messages past it."""
    url = await postgres_server.database()
    llm.default = echo
    async with FakeDiscord(shard_count=2) as dc:
        (_, _), (g1, c1) = guilds(dc)
        async with worker(tmp_path, "a", llm, dc, url) as a:
            await drive(a)
            for n in range(1, 5):
                await dc.send_guild_message(f"m{n}", g1, c1)
            await until_answered(dc, c1, ["m1", "m2", "m3", "m4"])
            conn = await asyncpg.connect(url)
            try:
                await conn.execute("ALTER TABLE journal ADD CONSTRAINT no_m5 CHECK (text NOT LIKE '%m5%') NOT VALID")
                await dc.send_guild_message("m5", g1, c1)
                await dc.send_guild_message("m6", g1, c1)
                await until_answered(dc, c1, ["m1", "m2", "m3", "m4", "m6"])
            finally:
                await conn.close()
            identified = dc.identifies_by_shard[1]
            await dc.invalidate_session(resumable=False, shard=1)
            await dc.wait_until(lambda: dc.identifies_by_shard[1] > identified and dc.live_shards() == [0, 1], 15, "IDENTIFY again")
            await dc.send_guild_message("m7", g1, c1)
            await until_answered(dc, c1, ["m1", "m2", "m3", "m4", "m6", "m7"])
            [session] = [s for s in dc.sessions(1) if s["live"]]
            checkpoint = a.shard_leases.host.checkpoint(1)
            assert checkpoint["session_id"] == session["session_id"] and checkpoint["seq"] == session["seq"]


# -- handovers that go wrong -------------------------------------------------------------------


async def backlog(dc: FakeDiscord, guild: str, channel: str, n: int = 20_000) -> None:
    for _ in range(n):  # a busy shard: the catch-up's replay takes a while
        await dc.dispatch("TYPING_START", {"guild_id": guild, "channel_id": channel, "user_id": "1"}, shard=1)


async def test_a_worker_stopped_during_its_catch_up_leaves_the_previous_checkpoint_for_the_next(
    tmp_path, llm, postgres_server: PostgresServer
):
    url = await postgres_server.database()
    llm.default = echo
    async with FakeDiscord(shard_count=2) as dc:
        (_, _), (g1, c1) = guilds(dc)
        async with worker(tmp_path, "a", llm, dc, url) as a:
            await drive(a)
            await a.shard_leases.balance()  # checkpoints saved
            async with worker(tmp_path, "b", llm, dc, url) as b:
                b._shards_task.cancel()
                await b.shard_leases.balance()  # b counts among the workers
                await a.shard_leases.balance()  # a gives shard 1 up, checkpoint saved
                old = json.loads(await a.store.get_kv("discord.shard:1"))["session_id"]
                await backlog(dc, g1, c1)
                await dc.send_guild_message("m3 sent while shard 1 had no worker", g1, c1)
                await b.shard_leases.balance()  # b takes shard 1: identifies, then resumes a's session
                assert sorted(b.shard_leases.held) == [1]
                await dc.wait_until(lambda: any(s["live"] and s["session_id"] == old for s in dc.sessions(1)),
                                    30, "b's catch-up resuming a's session")
                # b is stopped now (SIGTERM), in the middle of its catch-up
            assert json.loads(await a.store.get_kv("discord.shard:1") or "{}")["session_id"] == old
            await a.shard_leases.balance()  # alone again: a takes shard 1 back
            await opened(a)
            await until_answered(dc, c1, ["m3"])
        assert answered(dc, c1) == ["m3"]


async def test_a_replayed_message_whose_journaling_failed_is_replayed_by_the_next_holder(
    tmp_path, llm, postgres_server: PostgresServer
):
    """As test_a_message_whose_journaling_failed_stays_after_the_checkpoint, for a message the
    catch-up replays: b keeps a's checkpoint a while, so a replays m3 once the database is back."""
    url = await postgres_server.database()
    llm.default = echo
    async with FakeDiscord(shard_count=2) as dc:
        (_, _), (g1, c1) = guilds(dc)
        async with worker(tmp_path, "a", llm, dc, url) as a:
            await drive(a)
            async with worker(tmp_path, "b", llm, dc, url) as b:
                b._shards_task.cancel()
                await b.shard_leases.balance()
                await a.shard_leases.balance()  # a gives shard 1 up
                await dc.send_guild_message("m3", g1, c1)  # while nobody runs shard 1
                conn = await asyncpg.connect(url)
                try:
                    await conn.execute("ALTER TABLE journal ADD CONSTRAINT no_m3 CHECK (text NOT LIKE '%m3%') NOT VALID")
                    await b.shard_leases.balance()
                    await opened(b)  # the catch-up replayed m3; journaling it failed
                    await conn.execute("ALTER TABLE journal DROP CONSTRAINT no_m3")  # the database is back
                finally:
                    await conn.close()
                await b.shard_leases.balance()  # b's checkpoint saved
            await a.shard_leases.balance()  # b stopped: a takes shard 1 back and resumes b's session
            await opened(a)
            await until_answered(dc, c1, ["m3"])


class Unreachable:
    """Worker b's adapter, seen by its shards' leases, on a machine that cannot reach Discord's
    gateway (the two workers of these tests share one process, and discord.py's gateway URL is
    a class attribute: b's own cannot point elsewhere)."""

    def __init__(self, adapter: Any) -> None:
        self.adapter, self.opened = adapter, 0

    async def open_shard(self, shard: int, resume: Any = None) -> None:
        self.opened += 1
        raise AdapterError("cannot reach Discord at ws://127.0.0.1:9/gateway")

    async def close_shard(self, shard: int) -> Any:
        return await self.adapter.close_shard(shard)

    def checkpoint(self, shard: int) -> Any:
        return self.adapter.checkpoint(shard)


async def test_a_worker_that_cannot_connect_its_shard_leaves_it_to_the_others(
    tmp_path, llm, postgres_server: PostgresServer
):
    url = await postgres_server.database()
    llm.default = echo
    async with FakeDiscord(shard_count=2) as dc:
        (_, _), (g1, c1) = guilds(dc)
        async with worker(tmp_path, "a", llm, dc, url) as a:
            await drive(a)
            async with worker(tmp_path, "b", llm, dc, url) as b:
                b._shards_task.cancel()
                b.shard_leases.host = unreachable = Unreachable(b.adapters[0])
                await b.shard_leases.balance()
                await a.shard_leases.balance()  # a gives shard 1 up
                for _ in range(3):
                    await b.shard_leases.balance()  # b takes shard 1 once, cannot open it, then rests
                    await opened(b)
                    await a.shard_leases.balance()
                assert unreachable.opened == 1
                assert sorted(a.shard_leases.held) == [0, 1] and b.shard_leases.held == {}
                await opened(a)
                await dc.send_guild_message("m1", g1, c1)
                await until_answered(dc, c1, ["m1"])


async def test_a_shard_count_discord_refuses_stops_a_worker_of_a_cluster_too(
    tmp_path, llm, postgres_server: PostgresServer
):
    url = await postgres_server.database()
    llm.default = echo
    async with FakeDiscord(shard_count=2) as dc:
        guilds(dc)
        path = config(tmp_path / "a", llm, dc, store={"url": url}, cluster={"worker": "a", "lease_s": 10})
        path.write_text(path.read_text().replace("shard_count: 2", "shard_count: 3"))
        async with running(path, telegram_token=None, discord_token=dc.token) as a:
            a._shards_task.cancel()
            for _ in range(4):
                await a.shard_leases.balance()
                await opened(a)
            refused = sum(1 for p in dc.gw_received if p.get("op") == 2)
            assert refused <= 3  # Discord counts each IDENTIFY against the bot's daily limit
            [adapter] = a.adapters
            with pytest.raises(AdapterError, match=r"4010.*discord\.shard_count"):
                adapter.failure.result()  # bumblebot run stops on it
