"""Discord messages and their edits into :class:`~bumblebot.core.events.Inbound` messages.

``on_message`` turns a message into an Inbound and hands it to ``Engine.submit``, which
journals it; the journal's uniqueness on (platform, channel, message id) drops the same
MESSAGE_CREATE seen twice (a gateway RESUME replay, a reconnect, a restart). A channel's
messages are taken one at a time in arrival order (:meth:`DiscordIntake._in_order`), so they
are journaled in the order Discord sent them; turns then run in the engine's own tasks, so the
gateway is never blocked by a turn. Who is answered is decided by
:func:`adapters.discord.policy.decide`; mention tokens are made readable by
:func:`adapters.discord.mentions.readable_text`; a reply carries its quote
(:mod:`adapters.discord.replies`); a text command goes to
:mod:`adapters.discord.commands`, and one naming another bot is ignored entirely.

Conversations: a DM channel or a guild channel is one conversation (``discord:<channel id>``);
a thread is its own conversation keyed by its parent channel and the thread
(``discord:<parent id>:<thread id>``, :func:`chat_ref`), so ``bumblebot trace`` groups it under
its channel and the channel allowlist applies to it. A guild channel is shared: every message
is :attr:`~bumblebot.core.events.ChatKind.GROUP` and carries its speaker's display name, which
the engine puts before the text (``[Name]: ...``).

Files: attachments arrive as references (:func:`adapters.discord.files.attachment`), stickers
as ``[Sticker: name]``; a message with no text whose files are all over
``discord.max_file_bytes`` gets one polite reply and nothing is downloaded.

Edits: an edit (MESSAGE_UPDATE with ``edited_timestamp`` whose content or files changed; link
previews are not edits) goes through the same gate to ``Intake.edit``: it replaces the message
while no turn has taken it; later edits are ignored.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import discord

from adapters.bots import BotTurnBudget
from adapters.discord.files import attachment
from adapters.discord.mentions import MentionNames, mentions_user, readable_text
from adapters.discord.policy import MessageFacts, Verdict, command_target, decide, parse_command
from adapters.discord.replies import Replied, quote
from adapters.discord.sending import paste_part
from bumblebot.core.adapter import TOO_BIG_TEXT, Intake
from bumblebot.core.events import ChatKind, ChatRef, Inbound, Platform
from bumblebot.core.settings import DiscordSettings
from bumblebot.media.documents import describe_size

log = logging.getLogger(__name__)

REFUSAL_TEXT = "Sorry, this bot is private."
#: Message types that are someone speaking (not joins, pins, boosts, thread starts…).
ANSWERED_TYPES = (discord.MessageType.default, discord.MessageType.reply)


def is_dm(channel: Any) -> bool:
    if isinstance(channel, discord.DMChannel):
        return True
    return isinstance(channel, discord.PartialMessageable) and channel.guild_id is None


def chat_ref(channel: Any) -> ChatRef:
    """The conversation of a channel: a thread is ``(parent, thread)``, anything else itself."""
    if isinstance(channel, discord.Thread) and channel.parent_id is not None:
        return ChatRef(Platform.DISCORD, str(channel.parent_id), str(channel.id))
    return ChatRef(Platform.DISCORD, str(channel.id))


def text_edited(payload: discord.RawMessageUpdateEvent) -> bool:
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


class DiscordIntake:
    """The handlers of new messages and their edits, and the facts the gate decides on.

    Mixed into :class:`~adapters.discord.adapter.DiscordAdapter`, which provides the attributes
    below; ``_text_command`` comes from :class:`~adapters.discord.commands.DiscordCommands`.
    """

    client: discord.Client
    intake: Intake
    settings: DiscordSettings
    dm_keys: set[str]
    #: per channel: a lock (messages journaled in arrival order) and how many hold or wait for it
    _intake: dict[int, tuple[asyncio.Lock, list[int]]]
    _bot_budget: BotTurnBudget
    _text_command: Callable[[discord.Message, Inbound, str, bool], Awaitable[None]]

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
        if me is None or message.author.id == me.id or message.type not in ANSWERED_TYPES:
            return
        replied = Replied(message)
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
            await self._text_command(message, inbound, command, facts.is_dm)
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
        inbound = dataclasses.replace(inbound, quote=await quote(replied, me.id, self._names))
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
        if not text_edited(payload):
            return
        async with self._in_order(message.channel.id):
            me = self.client.user
            if me is None or message.author.id == me.id or message.type not in ANSWERED_TYPES:
                return
            replied = Replied(message)
            facts = await self._facts(message, me.id, replied)
            if decide(facts, self.settings, me.id) is not Verdict.ANSWER:
                return
            inbound = self._inbound(message, chat_ref(message.channel), facts)
            names = self._bot_names(message)
            if command_target(inbound.text, names) == "other" or parse_command(inbound.text, names) is not None:
                return  # a command runs once, when it came; an edit into one is not run
            if not inbound.text and not inbound.attachments:
                return
            inbound = dataclasses.replace(inbound, quote=await quote(replied, me.id, self._names))
            replaced = await self.intake.edit(inbound)
        log.info(
            "Discord: message %s in %s edited; %s", inbound.message_id, inbound.chat.key,
            "the waiting message now reads as edited" if replaced else "too late (already answered or not kept): ignored",
        )

    async def _facts(self, message: discord.Message, bot_id: int, replied: Replied) -> MessageFacts:
        channel = message.channel
        dm = is_dm(channel)
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
            is_dm=dm,
            channel_ids=tuple(ids),
            mentioned=mentioned,
            typed_mention=mentions_user(message.content, bot_id),
        )
        needs_reply_check = (
            not dm
            and self.settings.respond_in_guilds == "mention"
            and not mentioned
            and replied.is_reply
        )
        if needs_reply_check:
            found = await replied.get()
            if found is not None and found.author.id == bot_id:
                facts = dataclasses.replace(facts, replies_to_bot=True)
        return facts

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

    def _any_channel(self, cid: int) -> Any:
        """Channel ``cid`` from the cache of any connection here (with shards, each caches its own guilds)."""
        for client in (self.client, *getattr(self, "shards", {}).values()):
            if (found := client.get_channel(cid)) is not None:
                return found
        return None

    def _names(self, message: discord.Message) -> MentionNames:
        guild = message.guild
        channels: dict[int, str] = {}
        for cid in message.raw_channel_mentions:
            found = guild.get_channel_or_thread(cid) if guild else None
            found = found or self._any_channel(cid)
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
        attachments = tuple(attachment(a, voice=message.flags.voice) for a in message.attachments)
        if not text and not attachments and (facts.mentioned or facts.typed_mention) and self.client.user is not None:
            text = f"@{self.client.user.display_name}"  # only a ping: the person said just that
        if facts.is_dm:
            self.dm_keys.add(chat.key)
        return Inbound(
            chat=chat,
            message_id=str(message.id),
            sender_id=str(message.author.id),
            sender_name=message.author.display_name,
            text=text,
            chat_kind=ChatKind.PRIVATE if facts.is_dm else ChatKind.GROUP,
            attachments=attachments,
            paste_part=paste_part(text),
            chat_title=chat_title(message),
        )

    async def _refuse(self, inbound: Inbound) -> None:
        """One refusal per user outside the allowlist (DMs only); later messages are dropped."""
        await self.intake.refuse_once(inbound, REFUSAL_TEXT)


def chat_title(message: discord.Message) -> str:
    """The conversation's title: ``#channel in guild`` (a thread's name likewise), or the
    person of a DM."""
    if message.guild is None:
        return message.author.display_name
    name = getattr(message.channel, "name", None) or str(message.channel.id)
    return f"#{name} in {message.guild.name}"
