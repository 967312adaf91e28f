"""The discord.py client: the gateway intents it asks for, its events handed to the adapter,
the slash command tree, and why it could not log in or stay connected, in one line.

A gateway event discord.py cannot read (a field of the wrong type, a missing id) raises in its
parser, and that escapes discord.py's gateway loop: the client stops, and the daemon with it.
Each parser is therefore wrapped (:func:`guarded`): such an event is logged and skipped, the
next one is read. Events that make the session itself (``READY``, ``RESUMED``) are left as
they are: without them there is no connection to keep.

Redirection (config ``discord.api_base_url`` / ``discord.gateway_url``, for a proxy or tests) is
done by the adapter on discord.py's class attributes (:meth:`DiscordAdapter._redirect
<adapters.discord.adapter.DiscordAdapter._redirect>`); resumes use the ``resume_gateway_url``
of the server's READY.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import aiohttp
import discord
from discord import app_commands

from adapters.discord.commands import SLASH_COMMANDS
from adapters.discord.sending import NO_PINGS
from bumblebot.core.settings import DiscordSettings

if TYPE_CHECKING:
    from adapters.discord.adapter import DiscordAdapter

log = logging.getLogger(__name__)

#: Seconds the adapter waits for a gateway connection's READY before giving up.
READY_TIMEOUT_S = 60.0
#: Seconds discord.py waits for further GUILD_CREATEs after READY before ``on_ready``. The
#: guilds arrive right after READY; the cache fills on its own for any that come later, and
#: messages are taken before ``on_ready`` anyway, so a long wait would only delay start-up.
GUILD_READY_TIMEOUT_S = 0.2
#: Gateway events whose parsers are not guarded: they make the session.
SESSION_EVENTS = frozenset({"READY", "RESUMED"})
#: Longest rate limit discord.py sleeps through (discord.py raises it to at least 30 s); a
#: longer one becomes a retryable DeliveryFailed and the outbox takes over.
MAX_RATELIMIT_WAIT_S = 30.0


def intents() -> discord.Intents:
    """Guilds (channel/role/thread names), guild and DM messages, and MESSAGE CONTENT.

    MESSAGE CONTENT is privileged: it must be enabled in the developer portal, or Discord
    closes the gateway with 4014 (:class:`discord.PrivilegedIntentsRequired`). Without it
    guild messages that do not mention the bot arrive with empty content.
    """
    wanted = discord.Intents.none()
    wanted.guilds = True
    wanted.guild_messages = True
    wanted.dm_messages = True
    wanted.message_content = True
    return wanted


def describe_failure(exc: BaseException, settings: DiscordSettings) -> str:
    """A one-line explanation of why the client could not log in or stay connected."""
    if isinstance(exc, discord.LoginFailure):
        return (
            "Discord rejected DISCORD_BOT_TOKEN (401 Unauthorized); copy the token from the "
            "Bot page of your application in the Discord developer portal"
        )
    if isinstance(exc, discord.PrivilegedIntentsRequired):
        return (
            "Discord refused the MESSAGE CONTENT intent: enable 'Message Content Intent' under "
            "Bot > Privileged Gateway Intents in the developer portal "
            "(https://discord.com/developers/applications); the bot needs it to read messages"
        )
    if isinstance(exc, discord.ConnectionClosed):
        if exc.code == 4004:
            return "Discord gateway rejected DISCORD_BOT_TOKEN (close code 4004)"
        if exc.code in (4010, 4011):  # invalid shard / sharding required
            return (f"Discord gateway refused the shards (close code {exc.code}: {exc.reason or 'no reason'}): set "
                    "discord.shard_count, the same on every worker, to at least the shards GET /gateway/bot recommends")
        reason = exc.reason or "no reason"
        return f"Discord gateway closed the connection (close code {exc.code}: {reason})"
    if isinstance(exc, discord.HTTPException):
        return f"Discord API at {settings.api_base_url} answered {exc.status}: {exc.text or exc}"
    if isinstance(exc, (aiohttp.ClientError, OSError, TimeoutError, discord.GatewayNotFound)):
        return f"cannot reach Discord at {settings.api_base_url} / {settings.gateway_url}: {exc!r}"
    return f"Discord client failed: {exc!r}"


class Client(discord.Client):
    """discord.Client whose events go to the adapter.

    Args:
        adapter: the adapter its events go to.
        shard: ``(shard_id, shard_count)`` for one gateway shard of several
            (:class:`adapters.discord.shards.ShardClient`); ``None``: the whole bot on one
            connection, or (sharded) the client the adapter sends and syncs commands with.
    """

    def __init__(self, adapter: DiscordAdapter, shard: tuple[int, int] | None = None) -> None:
        # Bumblebot uses no voice: skip discord.py's start-up warnings about voice libraries.
        discord.VoiceClient.warn_nacl = discord.VoiceClient.warn_dave = False
        super().__init__(
            intents=intents(),
            allowed_mentions=NO_PINGS,
            guild_ready_timeout=GUILD_READY_TIMEOUT_S,
            max_ratelimit_timeout=MAX_RATELIMIT_WAIT_S,
            chunk_guilds_at_startup=False,
            **({"shard_id": shard[0], "shard_count": shard[1]} if shard is not None else {}),
        )
        self.adapter = adapter
        # discord.py has no hook around its parsers: its connection state holds them by event
        parsers = self._connection.parsers
        for event, parse in list(parsers.items()):
            if event not in SESSION_EVENTS:
                parsers[event] = guarded(event, parse)
        self.tree = app_commands.CommandTree(self)
        for name, description in SLASH_COMMANDS.items():
            self.tree.add_command(
                app_commands.Command(
                    name=name, description=description, callback=_slash_callback(adapter, name)
                )
            )

    async def setup_hook(self) -> None:
        self.add_view(self.adapter._stop_view)  # presses on any streamed message
        await self.adapter._sync_commands()

    async def on_ready(self) -> None:
        self.adapter._on_ready()

    async def on_message(self, message: discord.Message) -> None:
        await self.adapter._on_message(message)

    async def on_raw_message_edit(self, payload: discord.RawMessageUpdateEvent) -> None:
        # raw: a message sent before the start (not in discord.py's cache) still counts
        await self.adapter._on_edit(payload)


def guarded(event: str, parse: Callable[[Any], None]) -> Callable[[Any], None]:
    """``parse`` (discord.py's parser of gateway ``event``), logging and skipping an event it
    cannot read instead of raising out of the gateway loop."""

    def read(data: Any) -> None:
        try:
            parse(data)
        except Exception as exc:  # noqa: BLE001 - whatever the parser fails with, the event is skipped
            what = data.get("id") if isinstance(data, dict) else None
            log.warning("Discord: a %s event (id %s) cannot be read (%s: %s); skipped", event, what, type(exc).__name__, exc)

    return read


def _slash_callback(adapter: DiscordAdapter, name: str) -> Any:
    async def callback(interaction: discord.Interaction) -> None:
        await adapter._on_slash_command(interaction, name)

    callback.__name__ = f"slash_{name}"
    return callback
