"""Telegram commands: the bot's own (``/reset``, ``/status``…), the admin check, commands for
another bot, and presses of the Stop button under a streamed message.

A command goes through the same gate as any message (:meth:`TelegramIntake._gate
<adapters.telegram.intake.TelegramIntake._gate>`) and then to ``Intake.command``. In a group,
``/reset``, ``/compact`` and ``/tasks cancel`` change the conversation for everyone: only the
group's admins (an anonymous admin writes as the group itself) and allowlisted users may run
them (:func:`~adapters.telegram.policy.may_manage`); ``/stop`` (also the Stop button) is for
the person being answered and those managers, which the engine decides from what it is
answering and the ``manager`` fact found here. A command for another bot
(``/reset@other_bot``) is never run, in a private chat or a group, and in a group an unknown
command gets "Unknown command" only when it names this bot. The Stop button sends ``/stop``
from whoever pressed it; its answer shows as the button's notification.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable

from telegram import BotCommand, Message, Update
from telegram.constants import ChatType
from telegram.error import TelegramError
from telegram.ext import Application, ContextTypes

from adapters.telegram.intake import REFUSAL_TEXT
from adapters.telegram.policy import ADMIN_STATUSES, MessageFacts, Verdict, command_target, decide, may_manage
from adapters.telegram.reading import topic_of
from bumblebot.core.adapter import Intake
from bumblebot.core.commands import COMMANDS, asks_manager
from bumblebot.core.events import ChatKind, ChatRef, Inbound, Platform
from bumblebot.core.settings import TelegramSettings

log = logging.getLogger(__name__)

NOT_ADMIN_TEXT = "Only the admins of this group can do that here."
#: The command menu (``setMyCommands``): every command of the table.
MENU = [BotCommand(c.name, c.line()) for c in COMMANDS]


class TelegramCommands:
    """The handlers of commands and of the Stop button.

    Mixed into :class:`~adapters.telegram.adapter.TelegramAdapter`, which registers them; the
    gate and the making of an :class:`Inbound` come from
    :class:`~adapters.telegram.intake.TelegramIntake`.
    """

    app: Application  # type: ignore[type-arg]
    intake: Intake
    settings: TelegramSettings
    _take_kv: Callable[[], dict[str, str]]
    _gate: Callable[[Update, str], Awaitable[Inbound | None]]
    _inbound: Callable[[Update, str], Inbound | None]

    async def _on_command(self, update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
        message = update.effective_message
        if message is None or not message.text:
            return
        inbound = await self._gate(update, message.text)
        if inbound is None:
            return
        name = message.text.split()[0].lstrip("/").split("@")[0].lower()
        private = inbound.chat_kind is ChatKind.PRIVATE
        manager = private
        if not private and asks_manager(name, message.text):
            anonymous = message.sender_chat is not None and message.sender_chat.id == message.chat.id
            manager = await self._manages(inbound, anonymous_admin=anonymous)
        if not may_manage(name, message.text, private=private, manager=manager):
            await self.intake.answer(inbound, NOT_ADMIN_TEXT, kv=self._take_kv())
            return
        answer = await self.intake.command(inbound, name, kv=self._take_kv(), manager=manager)
        if answer:
            await self.intake.reply(inbound.chat, answer)

    async def _manages(self, inbound: Inbound, *, anonymous_admin: bool = False) -> bool:
        """Whether the sender of ``inbound`` manages its group: an anonymous admin (who writes as
        the group itself), an administrator or its creator, or a user in
        ``telegram.allowed_user_ids``."""
        user_id = int(inbound.sender_id)
        if anonymous_admin or user_id in self.settings.allowed_user_ids:
            return True
        return await self._member_status(int(inbound.chat.chat_id), user_id) in ADMIN_STATUSES

    async def _member_status(self, chat_id: int, user_id: int) -> str | None:
        """``getChatMember``'s status of ``user_id`` (``None`` if Telegram would not say)."""
        try:
            member = await self.app.bot.get_chat_member(chat_id, user_id)
        except TelegramError as exc:
            log.warning("Telegram: cannot read the member status of %s in %s: %s", user_id, chat_id, exc.message)
            return None
        return str(member.status)

    async def _on_unknown_command(self, update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
        """A command the bot has not registered, or one addressed to another bot. In groups
        only one addressed to this bot by name gets "Unknown command"; the rest are other
        bots' business."""
        message, chat = update.effective_message, update.effective_chat
        if message is None or chat is None or not message.text:
            return
        target = command_target(message.text, self.app.bot.username)
        if target == "other" or (chat.type != ChatType.PRIVATE and "@" not in message.text.split()[0]):
            inbound = self._inbound(update, message.text)
            if inbound is not None:
                await self.intake.answer(inbound, None, kv=self._take_kv())
            return
        await self._on_command(update, context)

    async def _on_stop_button(self, update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
        """The Stop button of a streamed message: ``/stop`` from whoever pressed it, if they
        may talk to the bot here; the answer shows as the button's notification."""
        query = update.callback_query
        if query is None or query.message is None or not isinstance(query.message, Message):
            return
        message, user = query.message, query.from_user
        chat = message.chat
        facts = MessageFacts(user.id, user.is_bot, chat.id, chat.type == ChatType.PRIVATE, True)
        if decide(facts, self.settings, self.app.bot.id) is not Verdict.ANSWER:
            with contextlib.suppress(TelegramError):
                await query.answer(REFUSAL_TEXT)
            return
        inbound = Inbound(
            chat=ChatRef(Platform.TELEGRAM, str(chat.id), topic_of(message)),
            message_id=f"button:{query.id}",  # a press Telegram delivers twice is handled once
            sender_id=str(user.id),
            sender_name=user.full_name,
            text="/stop",
            chat_kind=ChatKind.PRIVATE if chat.type == ChatType.PRIVATE else ChatKind.GROUP,
            update_id=update.update_id,
        )
        private = inbound.chat_kind is ChatKind.PRIVATE
        manager = private or await self._manages(inbound)
        answer = await self.intake.command(inbound, "stop", kv=self._take_kv(), manager=manager)
        with contextlib.suppress(TelegramError):
            await query.answer(answer or None)
