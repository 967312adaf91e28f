"""Discord commands: slash commands, text commands, who may run them, and the Stop button.

``/stop``, ``/reset``, ``/status``, ``/compact``, ``/tasks`` and ``/help`` are registered as
application (slash) commands (synced at start only when they changed) and recognised as text
(``/status`` in a DM, ``@bot /status`` in a guild, ``/status@<this bot's name>``); the engine
answers both the same way. A text command naming another bot (``/reset@other_bot``) is ignored
entirely by the intake: not run, not journaled, not answered as text
(:func:`adapters.discord.policy.command_target`). In a guild channel ``/reset`` and
``/compact`` change the conversation for everyone in it: only members with Manage Messages and
allowlisted users may run them. A press of the Stop button under a streamed message is
``/stop`` from whoever pressed it, answered to them only (ephemeral), as is a refused slash
command.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import aiohttp
import discord

from adapters.discord.intake import REFUSAL_TEXT, chat_ref
from adapters.discord.policy import MessageFacts, Verdict, decide
from adapters.discord.sending import NO_PINGS
from bumblebot.core.adapter import Intake
from bumblebot.core.commands import COMMANDS, needs_manager
from bumblebot.core.events import ChatKind, Inbound
from bumblebot.core.settings import DiscordSettings

if TYPE_CHECKING:
    from adapters.discord.client import Client

log = logging.getLogger(__name__)

NOT_HERE_TEXT = "I don't answer in this channel."
NOT_MANAGER_TEXT = "Only members who can manage messages here can do that."
#: The slash commands: the table's, without the greeting (Discord has no ``/start`` convention).
SLASH_COMMANDS = {c.name: c.line() for c in COMMANDS if not c.greeting}


class DiscordCommands:
    """Slash and text commands and the Stop button's presses.

    Mixed into :class:`~adapters.discord.adapter.DiscordAdapter`, which provides the attributes
    below; ``chunks`` comes from :class:`~adapters.discord.sending.DiscordSending`.
    """

    client: Client
    intake: Intake
    settings: DiscordSettings
    chunks: Callable[[str], list[str]]

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

    async def _text_command(self, message: discord.Message, inbound: Inbound, name: str, is_dm: bool) -> None:
        """A text command for this bot: run if its author may (:meth:`_manager`), and the
        engine's answer sent as a reply."""
        manager = self._manager(is_dm, message.author.id, self._manages_messages(message))
        if not manager and needs_manager(name, inbound.text):
            await self.intake.answer(inbound, NOT_MANAGER_TEXT)
            return
        answer = await self.intake.command(inbound, name, manager=manager)
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
        manager = self._manager(is_dm, user.id, bool(interaction.permissions.manage_messages))
        if not manager and needs_manager(name):
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
            answer = await self.intake.command(inbound, name, manager=manager) or "Already done."
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
            manager = self._manager(is_dm, user.id, bool(interaction.permissions.manage_messages))
            answer = await self.intake.command(inbound, "stop", manager=manager)
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

    def _manager(self, is_dm: bool, user_id: int, manages_messages: bool) -> bool:
        """Whether a user manages the conversation: in a DM, its one person; in a guild channel,
        members with Manage Messages and allowlisted users. ``/reset``, ``/compact`` and
        ``/tasks cancel`` change a channel's conversation for everyone, so only they may run
        them there (:func:`~bumblebot.core.commands.needs_manager`); ``/stop`` is theirs and
        the person being answered's (the engine knows who that is)."""
        return is_dm or manages_messages or user_id in self.settings.allowed_user_ids

    def _user_allowed(self, user_id: int) -> bool:
        return not self.settings.allowed_user_ids or user_id in self.settings.allowed_user_ids
