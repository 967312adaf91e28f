"""Gateway shards: one connection per shard this process runs, and the catch-up of a shard
taken over from a worker that stopped or died.

Discord sends a guild's events to shard ``(guild_id >> 22) % shard_count`` and DMs to shard 0
(Discord developer docs, "Gateway" > "Sharding"). With ``discord.shard_count`` set, the adapter
logs in one REST client (it sends, downloads and syncs the slash commands) and opens one
:class:`ShardClient` per shard it runs: every shard alone, or, among the workers of a cluster,
those whose lease it holds (``bumblebot/cluster/shards.py``).

**Taking a shard over.** A session of the gateway outlives its connection: closed with any code
but 1000 or 1001 it can be resumed, from any connection, for a while, and Discord replays the
events it missed (Discord developer docs, "Gateway" > "Resuming"). A shard's holder therefore
keeps a **checkpoint** of its session (its id, resume URL, and the sequence number up to which
every message was journaled), saved by the cluster at each renewal, and never closes a shard
with 1000. The next holder identifies a session of its own, holds its messages back, resumes
the previous holder's session on a second connection, takes the messages it replays (the
journal keeps a message once: those taken already are not answered again), and only then lets
its own session's messages in. A message sent while the shard had no worker is answered, in
order.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import aiohttp
import discord
import yarl

from adapters.discord.client import READY_TIMEOUT_S, Client, describe_failure
from bumblebot.core.errors import AdapterError

if TYPE_CHECKING:
    from adapters.discord.adapter import DiscordAdapter

log = logging.getLogger(__name__)

#: the events a checkpoint waits for: a message, or its edit, taken through to the journal
TRACKED = ("MESSAGE_CREATE", "MESSAGE_UPDATE")
#: the gateway version discord.py speaks (discord.http.INTERNAL_API_VERSION)
GATEWAY_VERSION = 10
#: seconds the catch-up waits for the previous session's replay to end (RESUMED), connecting included
CATCH_UP_S = 15.0
#: RESUMEs of the previous session when its replay breaks off before RESUMED
CATCH_UP_TRIES = 3
#: seconds after which an event still being taken no longer holds the checkpoint back (a
#: handler that never ran must not keep every later takeover replaying from it)
STUCK_S = 60.0
#: the session and sequence number of the event whose handler runs in this task
EVENT_SEQ: contextvars.ContextVar[tuple[str, int] | None] = contextvars.ContextVar("discord_event_seq", default=None)

Checkpoint = dict[str, Any]  # {"session_id", "resume_url", "seq"}


class ShardClient(Client):
    """The connection of shard ``shard_id`` of ``shard_count``: its messages go to the adapter
    once the shard has caught up with its previous holder's session."""

    def __init__(self, adapter: DiscordAdapter, shard_id: int, shard_count: int) -> None:
        super().__init__(adapter, shard=(shard_id, shard_count))
        self.ready = asyncio.Event()
        #: set once the previous holder's missed messages are taken: this session's wait until then
        self.caught_up = asyncio.Event()
        self._taking: dict[tuple[str, int], float] = {}  # (session, sequence) of messages being taken: since when
        #: the previous holder's checkpoint, kept until when: some of what it replayed could not be taken
        self.behind: tuple[Checkpoint, float] | None = None
        parsers = self._connection.parsers
        for event in TRACKED:
            parsers[event] = self._noted(parsers[event])

    def _noted(self, parse: Callable[[Any], None]) -> Callable[[Any], None]:
        """``parse``, noting the event's sequence number for the handler it dispatches (a task
        created by the parser inherits the context it runs in)."""

        def read(data: Any) -> None:
            ws = self.ws
            if ws is None or ws.session_id is None or ws.sequence is None:
                parse(data)
                return
            event = (ws.session_id, ws.sequence)
            self._taking[event] = time.monotonic()
            token = EVENT_SEQ.set(event)
            try:
                parse(data)
            finally:
                EVENT_SEQ.reset(token)

        return read

    async def setup_hook(self) -> None:
        self.add_view(self.adapter._stop_view)  # the REST client syncs the commands, once

    async def on_ready(self) -> None:
        self.ready.set()
        self.adapter._on_ready(self)

    async def on_message(self, message: discord.Message) -> None:
        await self.caught_up.wait()
        await self.adapter._on_message(message)
        self._taken()  # not when taking it raised: the next holder replays it (for STUCK_S)

    async def on_raw_message_edit(self, payload: discord.RawMessageUpdateEvent) -> None:
        await self.caught_up.wait()
        await self.adapter._on_edit(payload)
        self._taken()

    def _taken(self) -> None:
        event = EVENT_SEQ.get()
        if event is not None:
            self._taking.pop(event, None)

    def checkpoint(self) -> Checkpoint | None:
        """Where the next holder resumes this shard's session: after the last event up to which
        every message was taken (``None``: no session yet, or still catching up)."""
        ws = self.ws
        if ws is None or ws.session_id is None or ws.sequence is None or not self.caught_up.is_set():
            return None
        now = time.monotonic()
        if self.behind is not None and now < self.behind[1]:
            return self.behind[0]
        # another session's (before a new IDENTIFY) or a stuck one's no longer count
        self._taking = {event: since for event, since in self._taking.items()
                        if event[0] == ws.session_id and now - since < STUCK_S}
        waiting = [seq for _, seq in self._taking]
        seq = min(waiting) - 1 if waiting else ws.sequence
        return {"session_id": ws.session_id, "resume_url": str(ws.gateway), "seq": seq}

    async def leave(self) -> None:
        """Close the connection keeping its session resumable (code 4000): the next holder
        resumes it and gets what came after. discord.py's ``close()`` ends the session with
        1000, so its websocket is told to close with 4000 whatever it is asked."""
        ws = self.ws
        if ws is not None and ws.open:
            close = ws.close

            async def keep_session(code: int = 4000) -> None:
                await close(code=4000)

            ws.close = keep_session  # type: ignore[method-assign]
        await self.close()


async def replayed(checkpoint: Checkpoint, token: str, *, timeout: float = CATCH_UP_S) -> list[dict[str, Any]]:
    """The message events the session of ``checkpoint`` got after its sequence number, as
    Discord replays them on a RESUME: none when the session can no longer be resumed; those
    that came, with a warning, when the replay could not be finished within ``timeout``
    seconds. A replay broken off before its RESUMED (a RECONNECT, a dropped connection) is
    resumed again from the last event received, at most :data:`CATCH_UP_TRIES` times. Every
    connection is closed with 4000, whatever happens (a cancellation too): the session stays
    resumable, so a holder that dies before its own first checkpoint leaves it to the next."""
    events: list[dict[str, Any]] = []
    seq = checkpoint["seq"]
    try:
        async with asyncio.timeout(timeout), aiohttp.ClientSession() as http:
            for _ in range(CATCH_UP_TRIES):
                done, seq = await _replay(http, checkpoint, seq, token, events)
                if done:
                    return events
        log.warning("Discord: the replay of the previous session broke off %d times; %d message event(s) "
                    "replayed, later ones may be missing", CATCH_UP_TRIES, len(events))
    except Exception as exc:  # noqa: BLE001 - whatever failed, the shard goes on with what came
        log.warning("Discord: catching up with the previous session failed (%s: %s); %d message event(s) "
                    "replayed, later ones may be missing", type(exc).__name__, exc, len(events))
    return events


async def _replay(http: aiohttp.ClientSession, checkpoint: Checkpoint, seq: int, token: str,
                  events: list[dict[str, Any]]) -> tuple[bool, int]:
    """One RESUME of ``checkpoint``'s session after ``seq``, its message events appended to
    ``events``; whether the replay ended (RESUMED, or the session is gone) and the last
    sequence number received."""
    url = yarl.URL(str(checkpoint["resume_url"])).with_query(v=GATEWAY_VERSION, encoding="json")
    ws = await http.ws_connect(url, max_msg_size=0, autoclose=False)
    try:
        await ws.receive_json()  # HELLO
        await ws.send_json({"op": 6, "d": {"token": token, "session_id": checkpoint["session_id"], "seq": seq}})
        async for frame in ws:
            payload = frame.json() if frame.type == aiohttp.WSMsgType.TEXT else {}
            if payload.get("op") == 9:  # INVALID_SESSION: ended, or too old to resume
                log.warning("Discord: the session to catch up with cannot be resumed; messages sent "
                            "while its shard had no worker are not answered")
                return True, seq
            if payload.get("t") == "RESUMED":
                return True, seq
            if payload.get("op") == 0:
                seq = payload.get("s") or seq
                if payload.get("t") in TRACKED:
                    events.append(payload)
        return False, seq  # closed before RESUMED (a RECONNECT): resumed again from here
    finally:
        if not ws.closed:
            with contextlib.suppress(Exception):
                await asyncio.shield(ws.close(code=4000))


async def take_replayed(client: ShardClient, events: list[dict[str, Any]]) -> bool:
    """Take the replayed messages and edits one by one, in their order, as discord.py's own
    parsers would hand them over (``parse_message_create`` / ``parse_message_update``: the
    channel from the shard's cache, a DM channel made for one it does not know). Whether every
    one was taken."""
    state = client._connection
    adapter = client.adapter
    taken = True
    for event in events:
        data = event["d"]
        try:
            channel, _ = state._get_guild_channel(data)
            message = discord.Message(state=state, channel=channel, data=data)  # type: ignore[arg-type]
            if event["t"] == "MESSAGE_CREATE":
                await adapter._on_message(message)
            else:
                await adapter._on_edit(discord.RawMessageUpdateEvent(data=data, message=message))
        except Exception as exc:  # noqa: BLE001 - one unreadable event must not stop the others
            taken = False
            log.warning("Discord: a replayed %s (id %s) cannot be taken (%s: %s); skipped",
                        event["t"], data.get("id") if isinstance(data, dict) else None, type(exc).__name__, exc)
    return taken


def fatal(exc: BaseException | None) -> bool:
    """Whether a connection failed on what only the operator can mend: the token, the intents,
    or a ``discord.shard_count`` Discord refuses (close codes 4004, 4010, 4011, 4014). Opened
    again at each balance, Discord would count every IDENTIFY against the bot's daily limit."""
    if isinstance(exc, (discord.LoginFailure, discord.PrivilegedIntentsRequired)):
        return True
    return isinstance(exc, discord.ConnectionClosed) and exc.code in (4004, 4010, 4011, 4014)


class ShardedGateway:
    """The shards this process runs (with ``discord.shard_count`` set): opened at start (alone)
    or as the cluster grants their leases, closed keeping their sessions resumable. Mixed into
    :class:`~adapters.discord.adapter.DiscordAdapter`, which provides the attributes below."""

    settings: Any
    _token: str
    _stopping: bool
    failure: asyncio.Future[None]
    #: the shards open here, by id
    shards: dict[int, ShardClient]
    _shard_tasks: dict[int, asyncio.Task[None]]

    async def open_shard(self, shard: int, resume: Checkpoint | None = None) -> None:
        """Connect shard ``shard``; once its session is READY, take what the session of
        ``resume`` (its previous holder's) missed, then let this session's messages in.

        Raises:
            AdapterError: no READY within :data:`~adapters.discord.client.READY_TIMEOUT_S`, or
                the connection failed (the shard is closed again).
        """
        if shard in self.shards:
            return
        client = self.shards[shard] = ShardClient(self, shard, int(self.settings.shard_count))  # type: ignore[arg-type]  # mixed into DiscordAdapter
        task = self._shard_tasks[shard] = asyncio.create_task(
            client.start(self._token), name=f"bumblebot:discord:shard:{shard}"
        )
        ready = asyncio.create_task(client.ready.wait())
        done, _ = await asyncio.wait({task, ready}, timeout=READY_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED)
        if ready not in done:
            ready.cancel()
            failed = task.exception() if task in done and not task.cancelled() else None
            await self.close_shard(shard)
            error = AdapterError(
                describe_failure(failed, self.settings) if failed else f"no READY for shard {shard} within {READY_TIMEOUT_S:.0f} s"
            )
            if fatal(failed) and not self.failure.done():
                self.failure.set_exception(error)  # bumblebot run stops: trying again cannot help
            raise error from failed
        task.add_done_callback(lambda t: self._on_shard_done(shard, client, t))
        # neither raises but a cancellation: a shard closed before it caught up saves no
        # checkpoint of its own (the previous one stands); else this session's messages go on
        # whatever the catch-up came to
        if resume is not None:
            events = await replayed(resume, self._token)
            log.info("Discord: shard %d caught up with its previous session after %s (%d message event(s) "
                     "replayed)", shard, resume.get("seq"), len(events))
            if not await take_replayed(client, events):  # the next holder replays them, for a while
                client.behind = (resume, time.monotonic() + STUCK_S)
        client.caught_up.set()

    async def close_shard(self, shard: int) -> Checkpoint | None:
        """Close shard ``shard`` keeping its session resumable; its checkpoint (``None``: not
        open, or no session to resume)."""
        client = self.shards.pop(shard, None)
        task = self._shard_tasks.pop(shard, None)
        if client is None:
            return None
        checkpoint = client.checkpoint()
        await client.leave()
        if task is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        return checkpoint

    def checkpoint(self, shard: int) -> Checkpoint | None:
        """Where the next holder of shard ``shard`` would resume (``None``: not open here)."""
        client = self.shards.get(shard)
        return client.checkpoint() if client is not None else None

    def _on_shard_done(self, shard: int, client: ShardClient, task: asyncio.Task[None]) -> None:
        if self._stopping or self.failure.done() or self.shards.get(shard) is not client:
            return  # closed on purpose
        exc = None if task.cancelled() else task.exception()
        message = f"shard {shard}: " + (describe_failure(exc, self.settings) if exc else "the client stopped unexpectedly")
        log.error("Discord: %s", message)
        self.failure.set_exception(AdapterError(message))
