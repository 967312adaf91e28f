"""When the bot answers on Telegram, and who may run which command (pure functions).

Rules:

* The bot never answers itself. Other bots are ignored unless ``telegram.allow_bots``; even
  then a bot must address the bot (mention it or reply to it), and a per-chat budget
  (:class:`adapters.bots.BotTurnBudget`) stops two bots from talking in a loop.
* Private chats: users inside the allowlists (or anyone, when both are empty) are answered;
  others get one polite refusal.
* Groups and supergroups, by ``telegram.respond_in_groups``:

  - ``never``: nothing is ever answered there, commands included;
  - ``always``: every message from an allowed sender;
  - ``mention`` (default): a message that mentions the bot (a ``mention`` entity
    ``@<its username>``, any case, or a ``text_mention`` of its user), replies to one of its
    messages, or is a command addressed to it (``/status``, ``/status@<its username>``;
    never ``/status@otherbot``). Other messages from allowed senders are kept as background
    (:attr:`Verdict.BACKGROUND`) for the next turn there.

  A sender is allowed in a group when the chat is in ``telegram.allowed_chat_ids`` or the
  user in ``telegram.allowed_user_ids``, or when both lists are empty. Nothing is posted in a
  group for a refusal: others are ignored silently.
* In groups, ``/reset`` and ``/compact`` change the conversation of everyone there, so only
  chat administrators and allowlisted users may run them (:func:`may_manage`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

from bumblebot.core.commands import needs_manager
from bumblebot.core.settings import TelegramSettings

__all__ = ["MessageFacts", "Verdict", "command_target", "decide", "may_manage"]

#: Statuses of ``getChatMember`` that administer a chat (Bot API ``ChatMember``).
ADMIN_STATUSES = frozenset({"creator", "administrator"})
#: ``/name`` or ``/name@bot`` at the start of a message: a username has letters, digits and
#: ``_`` only, so whatever follows it (a space, ``.``, ``,``, ``-``) ends it, as Telegram's own
#: ``bot_command`` entity does (``/reset@other_bot.`` is for ``other_bot``).
_COMMAND = re.compile(r"/(?P<name>[A-Za-z0-9_]{1,32})(?:@(?P<bot>[A-Za-z0-9_]{1,64}))?(?![A-Za-z0-9_@])")


class Verdict(StrEnum):
    ANSWER = "answer"
    BACKGROUND = "background"  # an unaddressed group message: kept for context, not answered
    IGNORE = "ignore"
    REFUSE = "refuse"  # a private chat outside the allowlists: one polite refusal


@dataclass(frozen=True, slots=True)
class MessageFacts:
    """What the decision needs to know about one message.

    Args:
        sender_id: the author's user id (the chat id for a message sent on behalf of a chat).
        sender_is_bot: the author is a bot account.
        chat_id: the chat's id.
        private: a private (one-to-one) chat.
        addressed: it mentions the bot, replies to one of its messages, or is a command
            addressed to it.
    """

    sender_id: int
    sender_is_bot: bool
    chat_id: int
    private: bool
    addressed: bool = False


def command_target(text: str, username: str) -> str | None:
    """Who a leading command is for: ``"self"`` (``/cmd`` or ``/cmd@<username>``, any case),
    ``"other"`` (``/cmd@someone_else``), or ``None`` when ``text`` is not a command."""
    m = _COMMAND.match(text)
    if m is None:
        return None
    bot = m["bot"]
    return "self" if bot is None or bot.lower() == username.lower() else "other"


def _allowed(facts: MessageFacts, settings: TelegramSettings) -> bool:
    users, chats = settings.allowed_user_ids, settings.allowed_chat_ids
    if not users and not chats:
        return True
    return facts.sender_id in users or facts.chat_id in chats


def decide(facts: MessageFacts, settings: TelegramSettings, bot_id: int) -> Verdict:
    """Answer, keep as background, ignore or refuse ``facts``'s message (module rules)."""
    if facts.sender_id == bot_id:
        return Verdict.IGNORE
    if facts.sender_is_bot and not (settings.allow_bots and facts.addressed):
        return Verdict.IGNORE
    allowed = _allowed(facts, settings)
    if facts.private:
        return Verdict.ANSWER if allowed else Verdict.REFUSE
    if settings.respond_in_groups == "never" or not allowed:
        return Verdict.IGNORE
    if settings.respond_in_groups == "always" or facts.addressed:
        return Verdict.ANSWER
    return Verdict.BACKGROUND if not facts.sender_is_bot else Verdict.IGNORE


def may_manage(command: str, text: str = "", *, private: bool, manager: bool) -> bool:
    """Whether the sender may run ``command`` (written as ``text``) here: anything in a private
    chat; in a group, what :func:`~bumblebot.core.commands.needs_manager` reserves only for its
    managers (``manager``: an administrator, the creator, or a user in
    ``telegram.allowed_user_ids``)."""
    return private or manager or not needs_manager(command, text)
