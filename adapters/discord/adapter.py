"""Discord through discord.py: one ``Client`` on the gateway, messages in, outbox chunks out.

:class:`DiscordAdapter` is composed of one part per concept: the intake of messages and their
edits (:mod:`adapters.discord.intake`, with replies and their quotes in
:mod:`adapters.discord.replies`), slash and text commands and the Stop button
(:mod:`adapters.discord.commands`), messages and streamed previews out
(:mod:`adapters.discord.sending`), files in and out (:mod:`adapters.discord.files`) and, with
``discord.shard_count`` set, one connection per gateway shard run here
(:mod:`adapters.discord.shards`). Who is
answered is :mod:`adapters.discord.policy`; mention tokens are made readable by
:mod:`adapters.discord.mentions`; the discord.py client and its events are
:mod:`adapters.discord.client`. This module holds the lifecycle.

Redirection (config ``discord.api_base_url`` / ``discord.gateway_url``, for a proxy or tests):
discord.py reads its REST base from ``discord.http.Route.BASE`` and its first gateway URL from
``discord.gateway.DiscordWebSocket.DEFAULT_GATEWAY`` (class attributes, set before login and
restored on stop). Resumes use the ``resume_gateway_url`` of the server's READY.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import discord
import discord.gateway
import discord.http
import yarl

from adapters.bots import BotTurnBudget
from adapters.discord.client import READY_TIMEOUT_S, Client, describe_failure
from adapters.discord.commands import DiscordCommands
from adapters.discord.files import DiscordFiles
from adapters.discord.intake import DiscordIntake
from adapters.discord.sending import DiscordSending, StopView
from adapters.discord.shards import ShardClient, ShardedGateway
from bumblebot.core.adapter import Adapter, Intake
from bumblebot.core.errors import AdapterError
from bumblebot.core.events import Platform
from bumblebot.core.settings import DiscordSettings

log = logging.getLogger(__name__)

__all__ = ["READY_TIMEOUT_S", "DiscordAdapter"]


class DiscordAdapter(DiscordIntake, DiscordCommands, DiscordSending, DiscordFiles, ShardedGateway, Adapter):
    """Connects the engine to one Discord bot: the handlers (intake, commands), sending and
    files come from the parts it is composed of; here is the lifecycle.

    Args:
        intake: the engine, as adapters see it.
        settings: the ``discord`` config section.
        token: the bot token (``DISCORD_BOT_TOKEN``); never logged.
        leased_shards: with ``discord.shard_count`` set, the shards are opened as the cluster
            grants their leases (:meth:`open_shard`), not all at start.

    Attributes:
        failure: resolves with an :class:`AdapterError` when the connection fails for good
            after ``start()`` (e.g. the token is revoked); ``bumblebot run`` exits on it.
        client: the discord.py client: on the gateway, or with shards the one that sends and
            syncs the slash commands (each shard has its own, in :attr:`shards`).
    """

    platform = Platform.DISCORD

    def __init__(self, intake: Intake, settings: DiscordSettings, token: str, *, leased_shards: bool = False) -> None:
        self.intake = intake
        self.settings = settings
        self._token = token
        self._stop_view = StopView(self._on_stop_button)
        self.client = Client(self)
        self.failure: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._ready = asyncio.Event()
        self._runner: asyncio.Task[None] | None = None
        #: per channel: a lock (messages journaled in arrival order) and how many hold or wait for it
        self._intake: dict[int, tuple[asyncio.Lock, list[int]]] = {}
        self._bot_budget = BotTurnBudget()
        self._saved_endpoints: tuple[str, yarl.URL] | None = None
        self._stopping = False
        self.dm_keys: set[str] = set()  # conversations seen to be DMs (DiscordIntake adds them)
        self.shards: dict[int, ShardClient] = {}
        self._shard_tasks: dict[int, asyncio.Task[None]] = {}
        self._leased_shards = leased_shards
        self._started = False

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Log in, connect to the gateway and wait for READY.

        Raises:
            RuntimeError: already started.
            AdapterError: the token was rejected, the MESSAGE CONTENT intent is not enabled,
                Discord is unreachable, or no READY came within :data:`READY_TIMEOUT_S`.
        """
        if self._started:
            raise RuntimeError("Discord adapter already started")
        self._started = True
        self._redirect()
        if self.settings.shard_count is not None:
            await self._start_sharded()
            return
        self._runner = asyncio.create_task(
            self.client.start(self._token), name="bumblebot:discord:client"
        )
        ready = asyncio.create_task(self._ready.wait(), name="bumblebot:discord:ready")
        done, _ = await asyncio.wait(
            {self._runner, ready}, timeout=READY_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED
        )
        if ready in done:
            self._runner.add_done_callback(self._on_runner_done)
            return
        ready.cancel()
        if self._runner in done:
            exc = self._runner.exception() or AdapterError("the client stopped before READY")
            message = describe_failure(exc, self.settings)
        else:
            exc = None
            message = (
                f"no READY from the Discord gateway at {self.settings.gateway_url} "
                f"within {READY_TIMEOUT_S:.0f} s"
            )
        await self._close_client()
        raise AdapterError(message) from exc

    async def _start_sharded(self) -> None:
        """Log the sending client in (and sync the commands); open every shard unless the
        cluster grants them."""
        try:
            await self.client.login(self._token)
        except Exception as exc:
            await self._close_client()
            raise AdapterError(describe_failure(exc, self.settings)) from exc
        if not self._leased_shards:
            assert self.settings.shard_count is not None
            try:
                for shard in range(self.settings.shard_count):  # in order, each READY before the next IDENTIFY
                    await self.open_shard(shard)
            except AdapterError:
                await self._close_client()
                raise

    def is_dm(self, key: str) -> bool:
        """Whether conversation ``key`` is a DM (a Discord key does not say): one a message came
        in since the adapter started (until then, it is not trusted as one)."""
        return key in self.dm_keys

    async def stop(self) -> None:
        """Close the gateway and REST session; restore discord.py's endpoints. Idempotent."""
        if self._stopping or not self._started:
            return
        await self._close_client()

    def _redirect(self) -> None:
        gateway = discord.gateway.DiscordWebSocket
        self._saved_endpoints = (discord.http.Route.BASE, gateway.DEFAULT_GATEWAY)
        discord.http.Route.BASE = self.settings.api_base_url.rstrip("/")
        gateway.DEFAULT_GATEWAY = yarl.URL(self.settings.gateway_url)

    async def _close_client(self) -> None:
        self._stopping = True
        for shard in list(self.shards):
            await self.close_shard(shard)
        await self.client.close()
        if self._runner is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._runner
        if self._saved_endpoints is not None:
            base, gateway = self._saved_endpoints
            discord.http.Route.BASE = base
            discord.gateway.DiscordWebSocket.DEFAULT_GATEWAY = gateway
            self._saved_endpoints = None
        if self.failure.done():
            self.failure.exception()  # logged when it came; once stopped, nobody waits for it

    def _on_ready(self, client: discord.Client | None = None) -> None:
        """A connection's READY (``client``: a shard's; the whole bot's by default)."""
        client = client or self.client
        user = client.user
        if client is not self.client:
            log.info("Discord: shard %s of %s connected as %s in %d guild(s)", client.shard_id, client.shard_count,
                     user, len(client.guilds))
        elif not self._ready.is_set():
            log.info("Discord: connected as %s (id %s) in %d guild(s)", user, user and user.id, len(client.guilds))
        self._ready.set()

    def _on_runner_done(self, task: asyncio.Task[None]) -> None:
        if self._stopping or self.failure.done():
            return
        exc = None if task.cancelled() else task.exception()
        message = (
            describe_failure(exc, self.settings) if exc else "the Discord client stopped unexpectedly"
        )
        log.error("Discord: %s", message)
        self.failure.set_exception(AdapterError(message))
