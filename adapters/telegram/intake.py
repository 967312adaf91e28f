"""Telegram messages into :class:`~bumblebot.core.events.Inbound` messages for the engine.

Conversations: a private chat or a group is one conversation (``telegram:<chat id>``); a forum
topic, in a supergroup or a private chat, is its own (``telegram:<chat id>:<message_thread_id>``,
:func:`~adapters.telegram.reading.topic_of`). When a group becomes a supergroup
(``migrate_to_chat_id``) its conversation moves to the new id.

The gate (:meth:`TelegramIntake._gate`): who gets an answer is decided by
:mod:`adapters.telegram.policy`; a message that is not answered is still journaled, as
background for the group's next turn, as a refusal (sent once per sender) or as ignored, so
the update's offset moves past it in the same transaction. Another bot is answered at most
as often as :class:`~adapters.bots.BotTurnBudget` allows.

Edits: ``edited_message`` updates go to one handler ahead of all others, and from it to
``Intake.edit``: an edit replaces the message while no turn has taken it; later edits are
ignored, and an edit is never answered as a new message.

Files: photos, image documents, voice notes, audio, video and other documents are journaled as
:class:`~bumblebot.core.events.Attachment` references (the ``file_id``,
:func:`~adapters.telegram.reading.attachments_of`) and fetched by the engine before the turn
(:mod:`adapters.telegram.files`); one over ``telegram.max_file_bytes`` gets one polite reply and
is never downloaded. Stickers, locations, venues, contacts, polls and dice arrive as a short
description in the text. The parts of an album make one turn; an album holds at most 10 files,
so the parts of one past ``media.max_attachments_per_turn`` are neither fetched nor answered
(the sender is told once, with the first of them). Service messages (joins, pins, new topics)
are nobody speaking: nothing is journaled.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from telegram import Message, MessageEntity, Update
from telegram.constants import ChatType
from telegram.ext import Application, ContextTypes, filters

from adapters.bots import BotTurnBudget
from adapters.telegram.policy import MessageFacts, Verdict, command_target, decide
from adapters.telegram.reading import (
    attachments_of,
    describe,
    real_reply,
    sender_of,
    shown,
    topic_of,
)
from adapters.telegram.render import paste_part
from bumblebot.core.adapter import TOO_BIG_TEXT, Intake
from bumblebot.core.events import Attachment, ChatKind, ChatRef, Inbound, Platform
from bumblebot.core.settings import MediaSettings, TelegramSettings
from bumblebot.media.documents import describe_size

log = logging.getLogger(__name__)

REFUSAL_TEXT = "Sorry, this bot is private."
UNSUPPORTED_TEXT = "I can't read that kind of message; could you tell me in words?"
#: The quoted text of a reply is shortened to this many characters.
QUOTE_CHARS = 200
#: Albums remembered as answered (their later parts follow the part with the caption).
ALBUMS_KEPT = 100
ALBUM_OVERFLOW_TEXT = (
    "That album has more files than I take at once ({cap}); I'm looking at the first {cap} and "
    "left the rest out. Send the others again, a few at a time, if they matter."
)


class TelegramIntake:
    """The handlers of new messages, their edits and service messages, and the gate they share.

    Mixed into :class:`~adapters.telegram.adapter.TelegramAdapter`, which registers the
    handlers and provides the attributes below; ``_take_kv`` hands over the next update offset,
    to be journaled with the message.
    """

    app: Application  # type: ignore[type-arg]
    intake: Intake
    settings: TelegramSettings
    media: MediaSettings
    _bot_budget: BotTurnBudget
    _albums: dict[str, int]  # albums answered lately, with the parts taken (insertion order: oldest first)
    _take_kv: Callable[[], dict[str, str]]

    # -- the message as the engine takes it ----------------------------------------------------

    def _inbound(self, update: Update, text: str) -> Inbound | None:
        message = update.effective_message
        chat = update.effective_chat
        if message is None or chat is None:
            return None
        sender_id, sender_name, _ = sender_of(message)
        private = chat.type == ChatType.PRIVATE
        return Inbound(
            chat=ChatRef(Platform.TELEGRAM, str(chat.id), topic_of(message)),
            message_id=str(message.message_id),
            sender_id=str(sender_id),
            sender_name=sender_name,
            text=text,
            chat_kind=ChatKind.PRIVATE if private else ChatKind.GROUP,
            update_id=update.update_id,
            quote=self._quote(message),
            background=0 if private else self.settings.group_context,
            paste_part=paste_part(text),
            chat_title=chat.title or " ".join(filter(None, [chat.first_name, chat.last_name])),
        )

    def _quote(self, message: Message) -> str:
        """``"Name: text"`` of what ``message`` replies to (the quoted part when the user
        quoted one), shortened to :data:`QUOTE_CHARS`; ``""`` when it is not a reply."""
        replied = real_reply(message)
        text = message.quote.text if message.quote is not None else None
        if replied is None and text is None:
            return ""
        if replied is None:
            author = "a message from another chat"
        elif replied.from_user is not None and replied.from_user.id == self.app.bot.id:
            author = "you"
        else:
            author = sender_of(replied)[1]
        if text is None:
            text = shown(replied) if replied is not None else ""
        text = " ".join(text.split())
        if len(text) > QUOTE_CHARS:
            text = text[: QUOTE_CHARS - 1] + "…"
        return f"{author}: {text}"

    # -- the gate ------------------------------------------------------------------------------

    def _addressed(self, message: Message) -> bool:
        """It mentions the bot (``@username`` or a ``text_mention`` of it), replies to one of
        its messages, or is a command for it (``/cmd``, ``/cmd@username``)."""
        bot = self.app.bot
        name = f"@{bot.username}".lower()
        if message.text is not None:
            found = message.parse_entities([MessageEntity.MENTION, MessageEntity.TEXT_MENTION])
        else:
            found = message.parse_caption_entities([MessageEntity.MENTION, MessageEntity.TEXT_MENTION])
        for entity, text in found.items():
            if entity.type == MessageEntity.MENTION and text.lower() == name:
                return True
            if entity.type == MessageEntity.TEXT_MENTION and entity.user is not None and entity.user.id == bot.id:
                return True
        replied = real_reply(message)
        if replied is not None and replied.from_user is not None and replied.from_user.id == bot.id:
            return True
        return command_target(message.text or "", bot.username) == "self"

    async def _gate(
        self, update: Update, text: str, attachments: tuple[Attachment, ...] = (), *, addressed: bool = False
    ) -> Inbound | None:
        """The message as an :class:`Inbound` if the bot answers it (:mod:`.policy`); otherwise
        it is journaled here (as background, refused or ignored) and ``None`` returned."""
        message = update.effective_message
        inbound = self._inbound(update, text)
        if inbound is not None and attachments:
            inbound = dataclasses.replace(inbound, attachments=attachments)
        if inbound is None or message is None:
            return None
        verdict = self._verdict(update, addressed=addressed)
        if verdict is Verdict.ANSWER and sender_of(message)[2] and not self._bot_budget.allow(inbound.chat.key):
            log.info("Telegram: bot %s in %s is over its budget; not answered", inbound.sender_id, inbound.chat.key)
            verdict = Verdict.IGNORE
        if verdict is Verdict.ANSWER:
            return inbound
        if verdict is Verdict.REFUSE:
            await self.intake.refuse_once(inbound, REFUSAL_TEXT, kv=self._take_kv())
        elif verdict is Verdict.BACKGROUND and self.settings.group_context > 0:
            await self.intake.observe(inbound, kv=self._take_kv())
        else:
            await self.intake.answer(inbound, None, kv=self._take_kv())
        return None

    def _verdict(self, update: Update, *, addressed: bool = False) -> Verdict:
        """The policy's verdict on the update's message (:func:`.policy.decide`); ``addressed``:
        it counts as addressed to the bot whatever it says (an album part after its caption)."""
        message, chat = update.effective_message, update.effective_chat
        if message is None or chat is None:
            return Verdict.IGNORE
        sender_id, _, is_bot = sender_of(message)
        facts = MessageFacts(sender_id, is_bot, chat.id, chat.type == ChatType.PRIVATE, addressed or self._addressed(message))
        return decide(facts, self.settings, self.app.bot.id)

    # -- handlers ------------------------------------------------------------------------------

    async def _on_edit(self, update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
        """An edited message (``edited_message``): the message as it reads now goes to
        :meth:`Intake.edit`, which replaces it while no turn has taken it; a later edit is
        ignored (the turn answered what was first written).

        Registered before every other handler, so an edit never reaches the handlers of new
        messages and is never answered as one. The gate is the one of a new message
        (allowlists, a group's addressing) but nothing is journaled or sent for an edit: a
        message that would not be answered now, a command (run once, when it came) and an
        edit into a command are ignored, and so are edits that change no words or files (a
        live location moving). The poller moves the offset past the update.
        """
        message = update.edited_message
        if message is None:
            return
        if message.text is not None:
            if filters.COMMAND.check_update(update):
                return
            text, attachments = message.text, ()
        else:
            attachments = attachments_of(message, self.media)
            if not attachments:
                return
            text = message.caption or ""
        album = message.media_group_id or ""
        if self._verdict(update, addressed=bool(album) and album in self._albums) is not Verdict.ANSWER:
            return
        inbound = self._inbound(update, text)
        if inbound is None:
            return
        replaced = await self.intake.edit(dataclasses.replace(inbound, attachments=attachments))
        log.info(
            "Telegram: message %s in %s edited; %s", inbound.message_id, inbound.chat.key,
            "the waiting message now reads as edited" if replaced else "too late (already answered or not kept): ignored",
        )

    async def _on_text(self, update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
        message = update.effective_message
        if message is None or not message.text:
            return
        inbound = await self._gate(update, message.text)
        if inbound is not None:
            await self.intake.submit(inbound, kv=self._take_kv())

    async def _on_unsupported(self, update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
        """Photos, stickers, voice…: say so once per message instead of staying silent (in a
        group only when the message was for the bot)."""
        inbound = await self._gate(update, "(a message that is not text)")
        if inbound is None:
            return
        await self.intake.answer(inbound, UNSUPPORTED_TEXT, kv=self._take_kv())

    async def _on_files(self, update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
        """A photo, document, voice note, audio or video, with its caption: journaled with its
        files (fetched before the turn, :meth:`~adapters.telegram.files.TelegramFiles.download`);
        a file over ``max_file_bytes`` with no caption gets one polite reply instead, and nothing
        is downloaded (with a caption, the turn answers the caption and says the file was too big)."""
        message = update.effective_message
        if message is None:
            return
        attachments = attachments_of(message, self.media)
        album = message.media_group_id or ""
        # an album's caption (and mention) is on one part: the others follow it
        inbound = await self._gate(update, message.caption or "", attachments, addressed=album in self._albums)
        if inbound is None:
            return
        if album:  # its parts make one turn
            taken = self._albums.get(album, 0)
            if taken >= self.media.max_attachments_per_turn:  # no client sends such an album
                cap = self.media.max_attachments_per_turn
                if taken == cap:
                    await self.intake.answer(inbound, ALBUM_OVERFLOW_TEXT.format(cap=cap), kv=self._take_kv())
                self._albums[album] = taken + 1
                return
            inbound = dataclasses.replace(inbound, album=album)
            self._albums[album] = taken + 1
            while len(self._albums) > ALBUMS_KEPT:
                self._albums.pop(next(iter(self._albums)))
        limit = self.settings.max_file_bytes
        big = next((a for a in attachments if a.size is not None and a.size > limit), None)
        if big is not None and not inbound.text:  # with a caption the turn answers it, and says why
            text = TOO_BIG_TEXT.format(limit=describe_size(limit), name=big.name or "this one", size=describe_size(big.size or 0))
            await self.intake.answer(inbound, text, kv=self._take_kv())
            return
        await self.intake.submit(inbound, kv=self._take_kv())

    async def _on_described(self, update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
        """A sticker, location, venue, contact, poll or dice: answered as a short description."""
        message = update.effective_message
        if message is None:
            return
        inbound = await self._gate(update, describe(message))
        if inbound is not None:
            await self.intake.submit(inbound, kv=self._take_kv())

    async def _on_service(self, update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
        """A service message (a member joined, a pin, a new topic…): nobody spoke. Nothing is
        journaled; the poller moves the offset past it."""

    async def _on_migrate(self, update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
        """A group became a supergroup: its conversation continues under the new id. Telegram
        sends ``migrate_to_chat_id`` in the old chat and ``migrate_from_chat_id`` in the new one;
        whichever comes first moves it."""
        message = update.effective_message
        if message is None:
            return
        if message.migrate_to_chat_id:
            old, new = message.chat.id, message.migrate_to_chat_id
        elif message.migrate_from_chat_id:
            old, new = message.migrate_from_chat_id, message.chat.id
        else:
            return
        await self.intake.move_chat(ChatRef(Platform.TELEGRAM, str(old)), ChatRef(Platform.TELEGRAM, str(new)))
