"""Discord through discord.py: one ``Client`` on the gateway, messages in, outbox chunks out.

Intake. ``on_message`` turns a message into an :class:`~bumblebot.core.events.Inbound` and hands it
to ``Engine.submit``, which journals it; the journal's uniqueness on (platform, channel,
message id) drops the same MESSAGE_CREATE seen twice (a gateway RESUME replay, a reconnect,
a restart). Messages are taken one at a time in arrival order (one lock), so a channel's
messages are journaled in the order Discord sent them; turns then run in the engine's own
tasks, so the gateway is never blocked by a turn. Who is answered is decided by
:func:`adapters.discord.policy.decide`; mention tokens are made readable by
:func:`adapters.discord.mentions.readable_text`.

Conversations. A DM channel or a guild channel is one conversation (``discord:<channel id>``);
a thread is its own conversation keyed by its parent channel and the thread
(``discord:<parent id>:<thread id>``), so ``bumblebot trace`` groups it under its channel and
the channel allowlist applies to it. A guild channel is shared: every message is
:attr:`~bumblebot.core.events.ChatKind.GROUP` and carries its speaker's display name, which the
engine puts before the text (``[Name]: ...``).

Delivery (Discord developer docs, "Create Message"): content is at most 2000 characters
(measured here in UTF-16 code units, the conservative bound), never empty; replies are split
with :func:`bumblebot.delivery.splitting.split_markdown`, so code fences are closed and reopened.
Every message goes out with ``allowed_mentions`` parsing nothing, so a reply never pings
anyone (field-bugs.md item 26). discord.py waits out rate limits up to 30 s itself; a longer
one, a 5xx or a network error raises :class:`~bumblebot.core.errors.DeliveryFailed` with
``retryable=True`` and the outbox retries it later; 400/403/404 are permanent.

Files (issue 12). Attachments are journaled as :class:`~bumblebot.core.events.Attachment`
references (their URL) and fetched by the engine before the turn (:meth:`DiscordAdapter.download`,
through discord.py's CDN request): ``image/*`` ones are images the model sees, voice messages
(flag ``IS_VOICE_MESSAGE``) and ``audio/*`` are transcribed, the rest are documents. One over
``discord.max_file_bytes`` gets one polite reply and is never downloaded. Stickers arrive as
``[Sticker: name]``. The entity's files leave as attachments of a message (at most 10 MB, the
upload limit of a server without boosts).

Commands. ``/reset``, ``/status``, ``/compact`` and ``/help`` are registered as application
(slash) commands (synced at start only when they changed) and recognised as text (``/status``
in a DM, ``@bot /status`` in a guild, ``/status@<this bot's name>``); the engine answers both
the same way. A text command naming another bot (``/reset@other_bot``) is ignored entirely: not
run, not journaled, not answered as text (:func:`adapters.discord.policy.command_target`).

Replies and edits (issue 16). A reply (``message.reference``, not a forward) carries what it
replies to in ``Inbound.quote`` as Telegram's do (``"you: …"`` or ``"Name: text"``, at most
:data:`QUOTE_CHARS`; :data:`DELETED_QUOTE` for a deleted one), looked up once per message
(:class:`_Replied`). An edit (MESSAGE_UPDATE with ``edited_timestamp`` whose content or files
changed; link previews are not edits) goes through the same gate to ``Intake.edit``: it replaces
the message while no turn has taken it; later edits are ignored.

Redirection (config ``discord.api_base_url`` / ``discord.gateway_url``, for a proxy or tests):
discord.py reads its REST base from ``discord.http.Route.BASE`` and its first gateway URL from
``discord.gateway.DiscordWebSocket.DEFAULT_GATEWAY`` (class attributes, set before login and
restored on stop). Resumes use the ``resume_gateway_url`` of the server's READY.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import discord
import discord.gateway
import discord.http
import yarl
from discord import app_commands

from adapters.bots import BotTurnBudget
from adapters.discord.mentions import MentionNames, mentions_user, readable_text
from adapters.discord.policy import MessageFacts, Verdict, command_target, decide, parse_command
from bumblebot.core.adapter import MANAGING_COMMANDS, TOO_BIG_TEXT, Adapter, FileKind, Intake
from bumblebot.core.config import DiscordSettings
from bumblebot.media.documents import describe_size
from bumblebot.core.errors import AdapterError, DeliveryFailed, MediaError
from bumblebot.core.events import Attachment, AttachmentKind, ChatKind, ChatRef, Inbound, Platform
from bumblebot.delivery.splitting import DISCORD_LIMIT, split_markdown, utf16_len

log = logging.getLogger(__name__)

#: Seconds ``start()`` waits for the gateway's READY before giving up.
READY_TIMEOUT_S = 60.0
#: Seconds discord.py waits for further GUILD_CREATEs after READY before ``on_ready``. The
#: guilds arrive right after READY; the cache fills on its own for any that come later, and
#: messages are taken before ``on_ready`` anyway, so a long wait would only delay start-up.
GUILD_READY_TIMEOUT_S = 0.2
#: Longest rate limit discord.py sleeps through (discord.py raises it to at least 30 s); a
#: longer one becomes a retryable DeliveryFailed and the outbox takes over.
MAX_RATELIMIT_WAIT_S = 30.0
#: Seconds a look-up of a replied-to message may take before it counts as "not the bot's".
REFERENCE_FETCH_TIMEOUT_S = 5.0
#: The quoted text of a reply is shortened to this many characters (as on Telegram).
QUOTE_CHARS = 200
#: ``Inbound.quote`` of a reply to a message that was deleted meanwhile.
DELETED_QUOTE = "a deleted message"
REFUSAL_TEXT = "Sorry, this bot is private."
#: The upload limit of a server without boosts (and of DMs), bytes.
UPLOAD_LIMIT = 10 * 1024 * 1024
NOT_HERE_TEXT = "I don't answer in this channel."
NOT_MANAGER_TEXT = "Only members who can manage messages here can do that."
NO_PINGS = discord.AllowedMentions.none()
#: ``custom_id`` of the Stop button under a streamed message.
STOP_ID = "bumblebot:stop"
SLASH_COMMANDS = {
    "stop": "Stop the answer in progress",
    "reset": "Start a fresh conversation",
    "status": "Context usage and compaction",
    "compact": "Compact the conversation now",
    "tasks": "Scheduled tasks here (cancel one with the text command /tasks cancel ID)",
    "help": "What I can do",
}
_ANSWERED_TYPES = (discord.MessageType.default, discord.MessageType.reply)


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
        reason = exc.reason or "no reason"
        return f"Discord gateway closed the connection (close code {exc.code}: {reason})"
    if isinstance(exc, discord.HTTPException):
        return f"Discord API at {settings.api_base_url} answered {exc.status}: {exc.text or exc}"
    if isinstance(exc, (aiohttp.ClientError, OSError, TimeoutError, discord.GatewayNotFound)):
        return f"cannot reach Discord at {settings.api_base_url} / {settings.gateway_url}: {exc!r}"
    return f"Discord client failed: {exc!r}"


def _is_dm(channel: Any) -> bool:
    if isinstance(channel, discord.DMChannel):
        return True
    return isinstance(channel, discord.PartialMessageable) and channel.guild_id is None


def chat_ref(channel: Any) -> ChatRef:
    """The conversation of a channel: a thread is ``(parent, thread)``, anything else itself."""
    if isinstance(channel, discord.Thread) and channel.parent_id is not None:
        return ChatRef(Platform.DISCORD, str(channel.parent_id), str(channel.id))
    return ChatRef(Platform.DISCORD, str(channel.id))


class StopView(discord.ui.View):
    """The Stop button under a streamed message: a persistent view (no timeout, a fixed
    ``custom_id``), so a press reaches the adapter whichever message it is under."""

    def __init__(self, on_press: Any) -> None:
        super().__init__(timeout=None)
        self._on_press = on_press

    @discord.ui.button(label="Stop", style=discord.ButtonStyle.secondary, custom_id=STOP_ID)
    async def stop_button(self, interaction: discord.Interaction, button: discord.ui.Button[Any]) -> None:
        await self._on_press(interaction)


class _Client(discord.Client):
    """discord.Client whose events go to the adapter."""

    def __init__(self, adapter: DiscordAdapter) -> None:
        # Bumblebot uses no voice: skip discord.py's start-up warnings about voice libraries.
        discord.VoiceClient.warn_nacl = discord.VoiceClient.warn_dave = False
        super().__init__(
            intents=intents(),
            allowed_mentions=NO_PINGS,
            guild_ready_timeout=GUILD_READY_TIMEOUT_S,
            max_ratelimit_timeout=MAX_RATELIMIT_WAIT_S,
            chunk_guilds_at_startup=False,
        )
        self.adapter = adapter
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


def _slash_callback(adapter: DiscordAdapter, name: str) -> Any:
    async def callback(interaction: discord.Interaction) -> None:
        await adapter._on_slash_command(interaction, name)

    callback.__name__ = f"slash_{name}"
    return callback


class DiscordAdapter(Adapter):
    """Connects the engine to one Discord bot.

    Args:
        intake: the engine, as adapters see it.
        settings: the ``discord`` config section.
        token: the bot token (``DISCORD_BOT_TOKEN``); never logged.

    Attributes:
        failure: resolves with an :class:`AdapterError` when the connection fails for good
            after ``start()`` (e.g. the token is revoked); ``bumblebot run`` exits on it.
        client: the discord.py client.
    """

    platform = Platform.DISCORD

    def __init__(self, intake: Intake, settings: DiscordSettings, token: str) -> None:
        self.intake = intake
        self.settings = settings
        self._token = token
        self._stop_view = StopView(self._on_stop_button)
        self.client = _Client(self)
        self.failure: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._ready = asyncio.Event()
        self._runner: asyncio.Task[None] | None = None
        #: per channel: a lock (messages journaled in arrival order) and how many hold or wait for it
        self._intake: dict[int, tuple[asyncio.Lock, list[int]]] = {}
        self._bot_budget = BotTurnBudget()
        self._saved_endpoints: tuple[str, yarl.URL] | None = None
        self._stopping = False

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Log in, connect to the gateway and wait for READY.

        Raises:
            RuntimeError: already started.
            AdapterError: the token was rejected, the MESSAGE CONTENT intent is not enabled,
                Discord is unreachable, or no READY came within :data:`READY_TIMEOUT_S`.
        """
        if self._runner is not None:
            raise RuntimeError("Discord adapter already started")
        self._redirect()
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

    async def stop(self) -> None:
        """Close the gateway and REST session; restore discord.py's endpoints. Idempotent."""
        if self._stopping or self._runner is None:
            return
        await self._close_client()

    def _redirect(self) -> None:
        gateway = discord.gateway.DiscordWebSocket
        self._saved_endpoints = (discord.http.Route.BASE, gateway.DEFAULT_GATEWAY)
        discord.http.Route.BASE = self.settings.api_base_url.rstrip("/")
        gateway.DEFAULT_GATEWAY = yarl.URL(self.settings.gateway_url)

    async def _close_client(self) -> None:
        self._stopping = True
        await self.client.close()
        if self._runner is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._runner
        if self._saved_endpoints is not None:
            base, gateway = self._saved_endpoints
            discord.http.Route.BASE = base
            discord.gateway.DiscordWebSocket.DEFAULT_GATEWAY = gateway
            self._saved_endpoints = None

    def _on_ready(self) -> None:
        user = self.client.user
        if not self._ready.is_set():
            guilds = len(self.client.guilds)
            log.info("Discord: connected as %s (id %s) in %d guild(s)", user, user and user.id, guilds)
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

    async def _sync_commands(self) -> None:
        """Register the slash commands unless Discord already has exactly these."""
        tree = self.client.tree
        try:
            existing = {(c.name, c.description) for c in await tree.fetch_commands()}
            if existing != set(SLASH_COMMANDS.items()):
                await tree.sync()
                names = ", ".join(f"/{n}" for n in SLASH_COMMANDS)
                log.info("Discord: registered slash commands %s", names)
        except (discord.HTTPException, aiohttp.ClientError, OSError) as exc:
            log.warning("Discord: could not register slash commands (%s); text commands still work", exc)

    # -- intake ------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _in_order(self, channel_id: int) -> AsyncIterator[None]:
        """One message of a channel at a time, in arrival order (FIFO); other channels are not
        held up (a replied-to message fetched for a quote can take seconds)."""
        lock, users = self._intake.setdefault(channel_id, (asyncio.Lock(), [0]))
        users[0] += 1
        try:
            async with lock:
                yield
        finally:
            users[0] -= 1
            if not users[0]:
                del self._intake[channel_id]

    async def _on_message(self, message: discord.Message) -> None:
        async with self._in_order(message.channel.id):  # FIFO: journal in arrival order
            await self._take(message)

    async def _take(self, message: discord.Message) -> None:
        me = self.client.user
        if me is None or message.author.id == me.id or message.type not in _ANSWERED_TYPES:
            return
        replied = _Replied(message)
        facts = await self._facts(message, me.id, replied)
        verdict = decide(facts, self.settings, me.id)
        chat = chat_ref(message.channel)
        if verdict is Verdict.ANSWER and facts.author_is_bot and not self._bot_budget.allow(chat.key):
            log.warning("Discord: too many bot messages in %s; ignoring %s", chat.key, message.author)
            return
        if verdict is Verdict.IGNORE:
            return
        inbound = self._inbound(message, chat, facts)
        if verdict is Verdict.REFUSE:
            await self._refuse(inbound)
            return
        names = self._bot_names(message)
        if command_target(inbound.text, names) == "other":
            log.debug("Discord: %r in %s is another bot's command; ignored", inbound.text[:40], chat.key)
            return
        command = parse_command(inbound.text, names)
        if command is not None:
            if not self._may_manage(command, facts.is_dm, message.author.id, self._manages_messages(message)):
                await self.intake.answer(inbound, NOT_MANAGER_TEXT)
                return
            await self._answer_command(inbound, command)
            return
        if not inbound.text and not inbound.attachments:
            return
        limit = self.settings.max_file_bytes
        oversized = [a for a in inbound.attachments if a.size is not None and a.size > limit]
        big = oversized[0] if oversized else None
        if big is not None and not inbound.text and len(oversized) == len(inbound.attachments):
            # nothing else came with it; otherwise the turn answers the rest and says why
            await self.intake.answer(
                inbound, TOO_BIG_TEXT.format(limit=describe_size(limit), name=big.name or "this one", size=describe_size(big.size or 0))
            )
            return
        inbound = dataclasses.replace(inbound, quote=await self._quote(replied, me.id))
        await self.intake.submit(inbound)

    async def _on_edit(self, payload: discord.RawMessageUpdateEvent) -> None:
        """A MESSAGE_UPDATE: when the author changed the text or the files, the message as it
        reads now goes to :meth:`Intake.edit`, which replaces it if no turn has taken it yet
        (a later edit is ignored: the turn answered what was first written).

        Only a real edit counts: Discord also sends MESSAGE_UPDATE when it adds link previews
        (embeds), pins a message or starts a thread on it, without setting
        ``edited_timestamp``; and a later update that leaves the content and the attachments as
        discord.py's cache has them is not an edit of the text either. The gate is the one of a
        new message (:meth:`_take`) except that nothing is journaled or answered for an edit:
        a message that would not be answered now, a command (run once, when it came) and an
        edit into a command are ignored. Edits are taken in the same FIFO as new messages, so
        an edit is never seen before the message it edits. (discord.py updates its cached copy
        of a message in place: a message edited before the adapter got to it is taken as it
        reads by then, and its edit then changes nothing.)
        """
        message = payload.message
        if not _text_edited(payload):
            return
        async with self._in_order(message.channel.id):
            me = self.client.user
            if me is None or message.author.id == me.id or message.type not in _ANSWERED_TYPES:
                return
            replied = _Replied(message)
            facts = await self._facts(message, me.id, replied)
            if decide(facts, self.settings, me.id) is not Verdict.ANSWER:
                return
            inbound = self._inbound(message, chat_ref(message.channel), facts)
            names = self._bot_names(message)
            if command_target(inbound.text, names) == "other" or parse_command(inbound.text, names) is not None:
                return  # a command runs once, when it came; an edit into one is not run
            if not inbound.text and not inbound.attachments:
                return
            inbound = dataclasses.replace(inbound, quote=await self._quote(replied, me.id))
            replaced = await self.intake.edit(inbound)
        log.info(
            "Discord: message %s in %s edited; %s", inbound.message_id, inbound.chat.key,
            "the waiting message now reads as edited" if replaced else "too late (already answered or not kept): ignored",
        )

    async def _facts(self, message: discord.Message, bot_id: int, replied: _Replied) -> MessageFacts:
        channel = message.channel
        is_dm = _is_dm(channel)
        ids = [channel.id]
        if isinstance(channel, discord.Thread) and channel.parent_id is not None:
            ids.append(channel.parent_id)
        bot_roles = self._bot_role_ids(message)
        mentioned = any(u.id == bot_id for u in message.mentions) or any(
            r in bot_roles for r in message.raw_role_mentions
        )
        facts = MessageFacts(
            author_id=message.author.id,
            author_is_bot=message.author.bot or message.webhook_id is not None,
            is_dm=is_dm,
            channel_ids=tuple(ids),
            mentioned=mentioned,
            typed_mention=mentions_user(message.content, bot_id),
        )
        needs_reply_check = (
            not is_dm
            and self.settings.respond_in_guilds == "mention"
            and not mentioned
            and replied.is_reply
        )
        if needs_reply_check:
            found = await replied.get()
            if found is not None and found.author.id == bot_id:
                facts = dataclasses.replace(facts, replies_to_bot=True)
        return facts

    async def _quote(self, replied: _Replied, bot_id: int) -> str:
        """``Inbound.quote`` of a reply, as Telegram's: ``"you: …"`` for the bot's own message,
        ``"<display name>: <text>"`` otherwise, whitespace collapsed, shortened to
        :data:`QUOTE_CHARS` with "…", files described as on Telegram ("(a photo) caption").
        :data:`DELETED_QUOTE` when the replied-to message was deleted; ``""`` for no reply, a
        forward, or a message that could not be looked up (the model then sees the text
        alone, as before)."""
        if not replied.is_reply:
            return ""
        found = await replied.get()
        if found is None:
            return DELETED_QUOTE if replied.deleted else ""
        author = "you" if found.author.id == bot_id else found.author.display_name
        text = " ".join(_shown(found, readable_text(found.content, self._names(found))).split())
        if len(text) > QUOTE_CHARS:
            text = text[: QUOTE_CHARS - 1] + "…"
        return f"{author}: {text}"

    def _bot_names(self, message: discord.Message) -> set[str]:
        """What ``/cmd@name`` may call this bot: its username, its global display name and,
        in a guild, its nickname there."""
        me = self.client.user
        names = {me.name, me.display_name} if me is not None else set()
        guild = message.guild
        if guild is not None and guild.me is not None:
            names.add(guild.me.display_name)
        return names

    def _bot_role_ids(self, message: discord.Message) -> frozenset[int]:
        guild = message.guild
        role = guild.self_role if guild is not None else None
        return frozenset({role.id}) if role is not None else frozenset()

    def _names(self, message: discord.Message) -> MentionNames:
        guild = message.guild
        channels: dict[int, str] = {}
        for cid in message.raw_channel_mentions:
            found = guild.get_channel_or_thread(cid) if guild else None
            found = found or self.client.get_channel(cid)
            name = getattr(found, "name", None)
            if name:
                channels[cid] = name
        return MentionNames(
            users={u.id: u.display_name for u in message.mentions},
            channels=channels,
            roles={r.id: r.name for r in message.role_mentions},
            bot_user_id=self.client.user.id if self.client.user else None,
            bot_role_ids=self._bot_role_ids(message),
        )

    def _inbound(self, message: discord.Message, chat: ChatRef, facts: MessageFacts) -> Inbound:
        text = readable_text(message.content, self._names(message))
        stickers = [f"[Sticker: {s.name}]" for s in message.stickers]
        text = "\n".join(filter(None, [text, *stickers]))
        attachments = tuple(_attachment(a, voice=message.flags.voice) for a in message.attachments)
        if not text and not attachments and (facts.mentioned or facts.typed_mention) and self.client.user is not None:
            text = f"@{self.client.user.display_name}"  # only a ping: the person said just that
        return Inbound(
            chat=chat,
            message_id=str(message.id),
            sender_id=str(message.author.id),
            sender_name=message.author.display_name,
            text=text,
            chat_kind=ChatKind.PRIVATE if facts.is_dm else ChatKind.GROUP,
            attachments=attachments,
        )

    async def _refuse(self, inbound: Inbound) -> None:
        """One refusal per user outside the allowlist (DMs only); later messages are dropped."""
        await self.intake.refuse_once(inbound, REFUSAL_TEXT)

    async def _answer_command(self, inbound: Inbound, name: str) -> None:
        answer = await self.intake.command(inbound, name)
        if answer:
            await self.intake.reply(inbound.chat, answer)

    async def _on_slash_command(self, interaction: discord.Interaction, name: str) -> None:
        """Answer a slash command: the same gate and the same engine command as text."""
        user, channel = interaction.user, interaction.channel
        if channel is None or interaction.channel_id is None:
            return
        is_dm = interaction.guild_id is None
        verdict = self._interaction_verdict(interaction)
        if verdict is not Verdict.ANSWER:
            allowed = verdict is not Verdict.REFUSE and self._user_allowed(user.id)
            text = NOT_HERE_TEXT if allowed else REFUSAL_TEXT
            with contextlib.suppress(discord.HTTPException):
                await interaction.response.send_message(
                    text, ephemeral=True, allowed_mentions=NO_PINGS
                )
            return
        if not self._may_manage(name, is_dm, user.id, bool(interaction.permissions.manage_messages)):
            with contextlib.suppress(discord.HTTPException):
                await interaction.response.send_message(NOT_MANAGER_TEXT, ephemeral=True, allowed_mentions=NO_PINGS)
            return
        inbound = Inbound(
            chat=chat_ref(channel),
            message_id=f"interaction:{interaction.id}",
            sender_id=str(user.id),
            sender_name=user.display_name,
            text=f"/{name}",
            chat_kind=ChatKind.PRIVATE if is_dm else ChatKind.GROUP,
        )
        try:
            await interaction.response.defer(thinking=True)
        except discord.HTTPException as exc:  # already acknowledged (a replayed interaction)
            log.debug("Discord: cannot acknowledge /%s: %s", name, exc)
            return
        try:
            answer = await self.intake.command(inbound, name) or "Already done."
        except Exception:
            log.exception("Discord: /%s failed", name)
            answer = "Sorry, that did not work. Try again later."
        with contextlib.suppress(discord.HTTPException):
            for chunk in self.chunks(answer):
                await interaction.followup.send(chunk, allowed_mentions=NO_PINGS)

    def _interaction_verdict(self, interaction: discord.Interaction) -> Verdict:
        """The policy's verdict on an interaction (a slash command, a button press): as a
        message addressed to the bot, from its user, in its channel (and a thread's parent)."""
        channel = interaction.channel
        ids = [interaction.channel_id or 0]
        if isinstance(channel, discord.Thread) and channel.parent_id is not None:
            ids.append(channel.parent_id)
        facts = MessageFacts(
            author_id=interaction.user.id, author_is_bot=interaction.user.bot,
            is_dm=interaction.guild_id is None, channel_ids=tuple(ids), mentioned=True,
        )
        return decide(facts, self.settings, self.client.user.id if self.client.user else 0)

    async def _on_stop_button(self, interaction: discord.Interaction) -> None:
        """A press of the Stop button: ``/stop`` from whoever pressed it, if they may talk to
        the bot there; the answer is shown to them only (ephemeral)."""
        user, channel = interaction.user, interaction.channel
        if channel is None or interaction.channel_id is None:
            return
        is_dm = interaction.guild_id is None
        if self._interaction_verdict(interaction) is not Verdict.ANSWER:
            answer: str | None = REFUSAL_TEXT
        else:
            inbound = Inbound(
                chat=chat_ref(channel), message_id=f"interaction:{interaction.id}", sender_id=str(user.id),
                sender_name=user.display_name, text="/stop", chat_kind=ChatKind.PRIVATE if is_dm else ChatKind.GROUP,
            )
            answer = await self.intake.command(inbound, "stop")
        with contextlib.suppress(discord.HTTPException):
            if answer:
                await interaction.response.send_message(answer, ephemeral=True, allowed_mentions=NO_PINGS)
            else:
                await interaction.response.defer()

    @staticmethod
    def _manages_messages(message: discord.Message) -> bool:
        author = message.author
        if not isinstance(author, discord.Member) or isinstance(message.channel, discord.DMChannel):
            return False
        return bool(message.channel.permissions_for(author).manage_messages)  # type: ignore[union-attr]

    def _may_manage(self, command: str, is_dm: bool, user_id: int, manages_messages: bool) -> bool:
        """``/reset`` and ``/compact`` change a guild channel's conversation for everyone in it:
        there only members with Manage Messages and allowlisted users may run them (issue 10)."""
        if is_dm or command not in MANAGING_COMMANDS:
            return True
        return manages_messages or user_id in self.settings.allowed_user_ids

    def _user_allowed(self, user_id: int) -> bool:
        return not self.settings.allowed_user_ids or user_id in self.settings.allowed_user_ids

    # -- delivery ----------------------------------------------------------------------------

    def chunks(self, text: str) -> list[str]:
        return split_markdown(text, DISCORD_LIMIT, measure=utf16_len)

    async def send_chunk(self, chat: ChatRef, text: str, *, key: str) -> str:
        """Send one message; ``key`` becomes its nonce, and Discord (``enforce_nonce``) returns
        the first message instead of posting a second one when a retry repeats it."""
        if not text.strip():
            raise DeliveryFailed("refusing to send an empty Discord message", retryable=False)
        async with self._refusals():
            message = await self._channel(chat).send(text, allowed_mentions=NO_PINGS, nonce=_nonce(key))
        return str(message.id)

    # -- files (issue 12) -----------------------------------------------------------------------

    async def download(self, attachment: Attachment, dest: Path) -> int:
        """The attachment from Discord's CDN (discord.py's own request), into ``dest``.

        Raises:
            MediaError: over ``discord.max_file_bytes``, gone (its signed URL expired or the
                message was deleted), or Discord unreachable (``retryable``).
        """
        limit = self.settings.max_file_bytes
        if attachment.size is not None and attachment.size > limit:
            raise MediaError(f"it is over the {describe_size(limit)} limit")
        try:
            data = await self.client.http.get_from_cdn(attachment.ref)
        except discord.HTTPException as exc:
            retryable = exc.status == 429 or exc.status >= 500
            raise MediaError(f"Discord would not hand it over (HTTP {exc.status})", retryable=retryable) from exc
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise MediaError("Discord could not be reached", retryable=True) from exc
        if len(data) > limit:
            raise MediaError(f"it is over the {describe_size(limit)} limit")
        await asyncio.to_thread(dest.write_bytes, data)
        return len(data)

    def max_upload_bytes(self, chat: ChatRef, kind: FileKind) -> int | None:
        return UPLOAD_LIMIT

    def caption_limit(self) -> int:
        return DISCORD_LIMIT

    def caption_fits(self, text: str) -> bool:
        return utf16_len(text) <= DISCORD_LIMIT

    async def send_file(self, chat: ChatRef, path: Path, *, kind: FileKind, caption: str, key: str) -> str:
        """One message with the file attached (and ``caption`` as its text), with ``key`` as
        its nonce."""
        data = await asyncio.to_thread(path.read_bytes)
        async with self._refusals():
            message = await self._channel(chat).send(
                content=caption or None, file=discord.File(io.BytesIO(data), filename=path.name),
                allowed_mentions=NO_PINGS, nonce=_nonce(key),
            )
        return str(message.id)

    def _channel(self, chat: ChatRef) -> discord.PartialMessageable:
        if self.client.is_closed():
            raise DeliveryFailed("the Discord client is not connected", retryable=True)
        return self.client.get_partial_messageable(int(chat.thread_id or chat.chat_id))

    @contextlib.asynccontextmanager
    async def _refusals(self) -> AsyncIterator[None]:
        """Discord's errors as :class:`DeliveryFailed` (retryable or not, the chat unreachable)."""
        try:
            yield
        except discord.RateLimited as exc:
            raise DeliveryFailed("Discord rate limit", retryable=True, retry_after=exc.retry_after) from exc
        except discord.HTTPException as exc:
            retryable = exc.status == 429 or exc.status >= 500
            verb = "failed" if retryable else "refused the message"
            reason = f"Discord {verb}: {exc.status} {exc.text}"
            # 403 (no permission, DMs closed: 50007) and 404 (channel gone): nothing will get through
            unreachable = exc.status in (403, 404) and exc.code != UNKNOWN_MESSAGE
            raise DeliveryFailed(reason, retryable=retryable, chat_unreachable=unreachable) from exc
        except (aiohttp.ClientError, OSError, TimeoutError, RuntimeError) as exc:
            raise DeliveryFailed(f"Discord unreachable: {exc!r}", retryable=True) from exc

    # -- streaming (issue 11): one message edited in place ---------------------------------------

    def stream_interval_s(self, chat: ChatRef) -> float | None:
        """Discord allows 5 edits per 5 s in a channel: one a second."""
        return EDIT_INTERVAL_S

    async def send_preview(self, chat: ChatRef, text: str, *, key: str) -> str:
        async with self._refusals():
            message = await self._channel(chat).send(
                _preview_text(text), allowed_mentions=NO_PINGS, nonce=_nonce(key), view=self._stop_view
            )
        return str(message.id)

    async def edit_preview(self, chat: ChatRef, message_id: str, text: str, *, final: bool = False) -> None:
        async with self._refusals():
            await self._channel(chat).get_partial_message(int(message_id)).edit(
                content=_preview_text(text), allowed_mentions=NO_PINGS, view=None if final else self._stop_view
            )

    async def finish_preview(self, chat: ChatRef, message_id: str, chunk: str, *, key: str) -> str:
        """Edit the preview into the first chunk; a preview that is gone (deleted by a
        moderator: 10008 Unknown Message) is replaced by a new message."""
        try:
            async with self._refusals():
                await self._channel(chat).get_partial_message(int(message_id)).edit(
                    content=chunk, allowed_mentions=NO_PINGS, view=None  # the Stop button goes
                )
        except DeliveryFailed as exc:
            cause = exc.__cause__
            if not (isinstance(cause, discord.NotFound) and cause.code == UNKNOWN_MESSAGE):
                raise
            log.info("Discord: the streamed message %s is gone; sending it anew", message_id)
            return await self.send_chunk(chat, chunk, key=key)
        return message_id

    async def delete_message(self, chat: ChatRef, message_id: str) -> None:
        async with self._refusals():
            await self._channel(chat).get_partial_message(int(message_id)).delete()

    async def send_typing(self, chat: ChatRef) -> None:
        channel = self.client.get_partial_messageable(int(chat.thread_id or chat.chat_id))
        await channel.typing()


#: Least seconds between edits of one streamed message (5 edits per 5 s per channel).
EDIT_INTERVAL_S = 1.0
#: JSON error code of a message that does not exist (any more).
UNKNOWN_MESSAGE = 10008


def _preview_text(text: str) -> str:
    """A streamed text as one plain message, cut to Discord's 2000 characters."""
    text = text.strip() or "…"
    return text if len(text) <= DISCORD_LIMIT else text[: DISCORD_LIMIT - 1] + "…"


def _attachment(a: discord.Attachment, *, voice: bool) -> Attachment:
    """A Discord attachment as the engine takes it (by its URL)."""
    mime = (a.content_type or "").split(";")[0].strip().lower()
    if voice:
        kind = AttachmentKind.VOICE
    elif mime.startswith("image/") and mime != "image/svg+xml":
        kind = AttachmentKind.IMAGE
    elif mime.startswith("audio/"):
        kind = AttachmentKind.AUDIO
    else:
        kind = AttachmentKind.DOCUMENT
    return Attachment(
        kind, a.url, a.filename, mime or ("audio/ogg" if voice else ""), a.size, a.width, a.height, a.duration,
    )


def _nonce(key: str) -> str:
    """A Discord nonce (at most 25 characters) for an outbox chunk key."""
    return key[-25:]


class _Replied:
    """The message a message replies to, looked up at most once: the gateway payload's
    ``referenced_message``, then discord.py's cache, then one ``fetch_message`` bounded by
    :data:`REFERENCE_FETCH_TIMEOUT_S`. A forward (reference type ``forward``) is no reply.

    Attributes:
        is_reply: the message replies to another one.
        deleted: after :meth:`get`, the replied-to message is known to be deleted.
    """

    __slots__ = ("_found", "_looked_up", "_message", "deleted", "is_reply")

    def __init__(self, message: discord.Message) -> None:
        self._message = message
        reference = message.reference
        self.is_reply = (
            reference is not None
            and reference.message_id is not None
            and reference.type is not discord.MessageReferenceType.forward
        )
        self.deleted = False
        self._looked_up = False
        self._found: discord.Message | None = None

    async def get(self) -> discord.Message | None:
        """The replied-to message, or ``None`` (no reply, deleted, or not to be had)."""
        if not self._looked_up:
            self._looked_up = True
            self._found = await self._look_up()
        return self._found

    async def _look_up(self) -> discord.Message | None:
        reference = self._message.reference
        if not self.is_reply or reference is None or reference.message_id is None:
            return None
        if isinstance(reference.resolved, discord.Message):
            return reference.resolved
        if isinstance(reference.resolved, discord.DeletedReferencedMessage):
            self.deleted = True
            return None
        if reference.cached_message is not None:
            return reference.cached_message
        try:
            async with asyncio.timeout(REFERENCE_FETCH_TIMEOUT_S):
                return await self._message.channel.fetch_message(reference.message_id)
        except discord.NotFound:
            self.deleted = True
        except (discord.HTTPException, aiohttp.ClientError, OSError, TimeoutError) as exc:
            log.debug("Discord: cannot look up replied-to message %s: %s", reference.message_id, exc)
        return None


def _text_edited(payload: discord.RawMessageUpdateEvent) -> bool:
    """Whether a MESSAGE_UPDATE is its author's edit of the text or the files: Discord sets
    ``edited_timestamp`` only for those (link previews, pins and threads leave it alone), and
    against discord.py's cached copy the content or the attachments must differ."""
    if payload.message.edited_at is None:
        return False
    before = payload.cached_message
    if before is None:
        return True  # not cached (sent before the start): the engine tells a replacement apart
    after = payload.message
    return before.content != after.content or [a.id for a in before.attachments] != [a.id for a in after.attachments]


def _shown(message: discord.Message, text: str) -> str:
    """A message as a quote shows it: what it carried ("(a photo)", "(a voice message)", "(a
    file)", a sticker), then ``text`` (its readable content); an embed's title or description
    for a message with nothing else (another bot's card)."""
    what = ""
    if message.attachments:
        kind = _attachment(message.attachments[0], voice=message.flags.voice).kind
        what = {AttachmentKind.IMAGE: "(a photo)", AttachmentKind.VOICE: "(a voice message)"}.get(kind, "(a file)")
    elif message.stickers:
        what = f"[Sticker: {message.stickers[0].name}]"
    shown = " ".join(filter(None, (what, text)))
    if not shown and message.embeds:
        embed = message.embeds[0]
        shown = embed.title or embed.description or ""
    return shown or "(a message that is not text)"
