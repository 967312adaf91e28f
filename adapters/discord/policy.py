"""When the bot answers on Discord, and which messages are commands (pure functions).

Rules:

* The bot never answers itself.
* Other bots are ignored unless ``discord.allow_bots``; even then a bot must mention the bot
  in its text (a reply's automatic ping does not count), and :class:`adapters.bots.BotTurnBudget` caps how
  many bot messages per channel are answered per minute, so two bots cannot loop forever.
* DMs are always answered, except for users outside ``discord.allowed_user_ids`` (when set):
  they get one polite refusal (:attr:`Verdict.REFUSE`).
* In guild channels (and their threads), ``discord.respond_in_guilds`` decides: ``off`` never,
  ``all`` every message, ``mention`` (default) only when the bot is mentioned or replied to.
  Users outside the user allowlist and channels outside ``discord.allowed_channel_ids`` (when
  set; a thread counts as its parent channel too) are ignored silently: nothing is ever
  posted in a shared channel for a refusal.

Text commands: ``/status`` and ``/status@<this bot's name>`` (its username, global
display name or server nickname, any case) are this bot's; ``/status@other_bot`` names another
bot and is ignored entirely (:func:`command_target` says ``"other"``): not run, not journaled, and
not answered as ordinary text either, as Telegram does with a command for another bot.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

from bumblebot.core.commands import BY_NAME
from bumblebot.core.settings import DiscordSettings

__all__ = ["TEXT_COMMANDS", "MessageFacts", "Verdict", "command_target", "decide", "parse_command"]

#: Commands recognised as text (``/status`` or ``@bot /status``); the engine answers them.
TEXT_COMMANDS = tuple(BY_NAME)
_COMMAND = re.compile(r"/(?P<name>[A-Za-z]+)(?:@(?P<bot>\S*))?(?=\s|$)")


class Verdict(StrEnum):
    ANSWER = "answer"
    IGNORE = "ignore"
    REFUSE = "refuse"  # a DM from a user outside the allowlist: answered once with a refusal


@dataclass(frozen=True, slots=True)
class MessageFacts:
    """What the decision needs to know about one message.

    Args:
        author_id: the author's user id.
        author_is_bot: the author is a bot account (or a webhook).
        is_dm: a direct message (no guild).
        channel_ids: the channel, and for a thread also its parent channel.
        mentioned: the bot's user or managed role is among the message's mentions (this
            includes the automatic ping of a reply to the bot).
        typed_mention: the content itself contains the bot's ``<@id>`` token.
        replies_to_bot: the message is a reply to a message the bot wrote.
    """

    author_id: int
    author_is_bot: bool
    is_dm: bool
    channel_ids: tuple[int, ...] = ()
    mentioned: bool = False
    typed_mention: bool = False
    replies_to_bot: bool = False


def decide(facts: MessageFacts, settings: DiscordSettings, bot_user_id: int) -> Verdict:
    """Answer, ignore or refuse ``facts``'s message under ``settings`` (see the module rules)."""
    if facts.author_id == bot_user_id:
        return Verdict.IGNORE
    if facts.author_is_bot and not (settings.allow_bots and facts.typed_mention):
        return Verdict.IGNORE
    user_allowed = not settings.allowed_user_ids or facts.author_id in settings.allowed_user_ids
    if facts.is_dm:
        return Verdict.ANSWER if user_allowed else Verdict.REFUSE
    if settings.respond_in_guilds == "off" or not user_allowed:
        return Verdict.IGNORE
    channels = settings.allowed_channel_ids
    if channels and not any(c in channels for c in facts.channel_ids):
        return Verdict.IGNORE
    if settings.respond_in_guilds == "all":
        return Verdict.ANSWER
    addressed = facts.mentioned or facts.typed_mention or facts.replies_to_bot
    return Verdict.ANSWER if addressed else Verdict.IGNORE


def command_target(text: str, bot_names: Collection[str]) -> Literal["self", "other"] | None:
    """Who a leading ``/word`` of ``text`` (already without the bot's mention) is for.

    Args:
        text: the message as the model would read it (:func:`~adapters.discord.mentions.readable_text`).
        bot_names: this bot's names, any case (username, global display name, server nickname).

    Returns:
        ``"self"`` for ``/word`` and ``/word@<one of bot_names>`` (also ``/word@`` followed by
        the bot's own mention, which the mention removal leaves as ``/word@``); ``"other"`` for
        ``/word@someone_else`` (``/word@@someone`` too, a mention of another user made
        readable); ``None`` when ``text`` does not start with ``/word``.
    """
    m = _COMMAND.match(text.strip())
    return None if m is None else _target(m, bot_names)


def _target(m: re.Match[str], bot_names: Collection[str]) -> Literal["self", "other"]:
    bot = (m["bot"] or "").lstrip("@").lower()
    return "self" if not bot or bot in {n.lower() for n in bot_names} else "other"


def parse_command(text: str, bot_names: Collection[str]) -> str | None:
    """The command name when ``text`` (already without the bot's mention) is one of this bot's
    text commands (:data:`TEXT_COMMANDS`; ``bot_names`` as for :func:`command_target`).

    ``"/status"``, ``"/Reset@bumblebot"`` (``bumblebot`` among ``bot_names``) and ``"/help
    me"`` are commands; ``"/reset@other_bot"``, ``"/shrug"``, ``"a /status"`` and ``"/"`` are
    not (unknown slash words stay ordinary text; one for another bot is not ours at all).
    """
    m = _COMMAND.match(text.strip())
    if m is None or _target(m, bot_names) != "self":
        return None
    name = m["name"].lower()
    return name if name in TEXT_COMMANDS else None
