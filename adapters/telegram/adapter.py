"""Telegram through python-telegram-bot: long polling; private chats, groups and forum topics.

Why our own polling loop instead of PTB's ``Updater``: the ``Updater`` asks for the next batch
(which acknowledges the previous one to Telegram) as soon as it has queued the updates, before
any handler ran, so a crash in between loses messages (reference-study.md, "Crash windows";
field-bugs.md item 1). Here each update is fed to the PTB ``Application`` (handlers, command
parsing) and journaled — together with the next offset, in one SQLite transaction — before the
next ``getUpdates`` moves the offset past it. A restart resumes from the stored offset; an
update Telegram delivers again is dropped by the journal's uniqueness on (chat, message id).

Conversations (issue 10): a private chat or a group is one conversation (``telegram:<chat
id>``); a forum topic, in a supergroup or a private chat (Bot API 9.3), is its own
(``telegram:<chat id>:<message_thread_id>``). Only a message with ``is_topic_message`` names a
topic: in a non-forum group ``message_thread_id`` only marks a reply thread, and the General
topic (id 1) is sent to without ``message_thread_id`` (Telegram refuses it there). When a group
becomes a supergroup (``migrate_to_chat_id``) its conversation moves to the new id. Who gets an
answer in a group is :mod:`adapters.telegram.policy`; a command for another bot
(``/reset@other_bot``) is never run, in a private chat or a group.

Edits (issue 16): ``edited_message`` updates go to one handler ahead of all others, and from it
to ``Intake.edit``: an edit replaces the message while no turn has taken it; later edits are
ignored, and an edit is never answered as a new message.

Files (issue 12): photos (the largest size within ``media.image_max_side_px`` and
``media.image_max_bytes``), image documents, voice notes, audio, video and other documents are
journaled as :class:`~bumblebot.core.events.Attachment` references (the ``file_id``) and fetched by
the engine before the turn through :meth:`TelegramAdapter.download` (``getFile``, then
``<telegram.base_file_url><token>/<file_path>``); one over ``telegram.max_file_bytes`` (20 MB,
the Bot API's own download limit) gets one polite reply and is never downloaded. Stickers,
locations, venues, contacts, polls and dice arrive as a short description in the text. The
entity's files leave through ``sendPhoto`` (falling back to ``sendDocument`` when Telegram
refuses the photo), ``sendDocument`` and ``sendVoice`` (Ogg/Opus); uploads are at most 50 MB
(10 MB for photos) and captions 1024 characters (Bot API, "Sending files").

Rules followed: a message is at most 4096 characters (counted in UTF-16 code units, the
conservative bound); the model's Markdown is sent as plain text plus formatting entities
(:func:`render_chunks`), never with a ``parse_mode``; empty messages are never sent; ``RetryAfter`` is honoured by the delivery
layer; a 409 ``Conflict`` (another instance polling the same token) is fatal.

Pacing (issue 16): every call to a chat (messages, previews and their edits, deletions,
files, the typing indicator) goes through one :class:`~adapters.telegram.pacing.Pacer`, keyed by the
chat id (a forum's topics share their group's limits): one call at a time per chat, in order,
about one a second, 20 a minute in a group (a negative chat id), 30 a second overall. A
``RetryAfter`` from any of them pauses that chat for its ``retry_after``; the typing indicator
is skipped while the chat is paused and never waits for a turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import telegramify_markdown
from telegram import (
    BotCommand,
    InlineKeyboardButton,
    InlineKeyboardMarkup,
    InputFile,
    Message,
    MessageEntity,
    PhotoSize,
    Update,
)
from telegram.constants import ChatAction, ChatType
from telegram.error import (
    BadRequest,
    ChatMigrated,
    Conflict,
    Forbidden,
    InvalidToken,
    NetworkError,
    RetryAfter,
    TelegramError,
    TimedOut,
)
from telegram.ext import (
    Application,
    ApplicationBuilder,
    CallbackQueryHandler,
    CommandHandler,
    ContextTypes,
    MessageHandler,
    filters,
)

from adapters.bots import BotTurnBudget
from adapters.telegram.policy import MessageFacts, Verdict, command_target, decide, may_manage
from bumblebot.core.adapter import MANAGING_COMMANDS, TOO_BIG_TEXT, Adapter, FileKind, Intake
from bumblebot.core.config import MediaSettings, TelegramSettings
from bumblebot.delivery import MAX_INLINE_WAIT_S
from bumblebot.media.documents import describe_size
from bumblebot.core.errors import AdapterError, DeliveryFailed, MediaError
from bumblebot.core.events import Attachment, AttachmentKind, ChatKind, ChatRef, Inbound, Platform
from adapters.telegram.pacing import Pacer
from bumblebot.delivery.splitting import TELEGRAM_LIMIT, split_text, utf16_len

log = logging.getLogger(__name__)

OFFSET_KEY = "telegram.offset"
#: Attempts at recording one update before it is skipped (logged) so others can flow.
MAX_UPDATE_ATTEMPTS = 5
REFUSAL_TEXT = "Sorry, this bot is private."
UNSUPPORTED_TEXT = "I can't read that kind of message; could you tell me in words?"
#: Bot API upload limits (sendDocument/sendVoice: 50 MB; sendPhoto: 10 MB) and caption length.
UPLOAD_LIMIT = 50 * 1024 * 1024
PHOTO_UPLOAD_LIMIT = 10 * 1024 * 1024
CAPTION_LIMIT = 1024
#: Seconds an upload may take to send and to be answered.
UPLOAD_TIMEOUT_S = 300.0
NOT_ADMIN_TEXT = "Only the admins of this group can do that here."
PRIVACY_NOTE = (
    "Telegram: privacy mode is on for @%s: in groups it only sees messages that mention it, reply "
    "to it or are commands, so telegram.group_context has nothing to show. To let it read "
    "the whole group: @BotFather, /mybots, the bot, Bot Settings, Group Privacy, Turn off; then "
    "remove the bot from each group and add it again"
)
#: The General topic of a forum: sent to without ``message_thread_id`` (Telegram refuses 1).
GENERAL_TOPIC_ID = 1
#: The quoted text of a reply is shortened to this many characters.
QUOTE_CHARS = 200
COMMANDS = [
    BotCommand("start", "About this bot"),
    BotCommand("stop", "Stop the answer in progress"),
    BotCommand("reset", "Start a fresh conversation"),
    BotCommand("status", "Context usage and compaction"),
    BotCommand("compact", "Compact the conversation now"),
    BotCommand("tasks", "Scheduled tasks (/tasks cancel ID)"),
    BotCommand("help", "What I can do"),
]


#: The Stop button under a message being streamed (``callback_data`` of the button).
STOP_DATA = "bumblebot:stop"
STOP_MARKUP = InlineKeyboardMarkup([[InlineKeyboardButton("Stop", callback_data=STOP_DATA)]])
#: Least seconds between edits of one streamed message: about one message a second in a
#: private chat, 20 a minute in a group (Bot API FAQ, "broadcasting to users").
PRIVATE_EDIT_INTERVAL_S = 1.0
GROUP_EDIT_INTERVAL_S = 3.0
#: Longest wait of a streamed preview's send or edit for its turn in the chat (issue 16),
#: seconds: past it the edit is skipped (the preview shows newer text at its next edit, the
#: final text goes through the outbox), so intermediate text never queues behind messages.
PREVIEW_WAIT_S = 2.0
#: Updates asked of getUpdates: messages, their edits, and the Stop button's presses.
ALLOWED_UPDATES = ["message", "edited_message", "callback_query"]


@dataclass(frozen=True, slots=True)
class TelegramChunk:
    """One message as Telegram takes it: plain text plus formatting entities (UTF-16 offsets)."""

    text: str
    entities: tuple[MessageEntity, ...] = ()


def render_chunks(markdown: str, limit: int = TELEGRAM_LIMIT) -> list[TelegramChunk]:
    """The model's Markdown as Telegram messages of at most ``limit`` UTF-16 units.

    ``telegramify-markdown`` turns Markdown into plain text plus ``MessageEntity`` objects, so
    no ``parse_mode`` is needed and no reply can fail with "can't parse entities"
    (Telegram answers "can't parse entities" to a reply with a stray ``*``); its splitter cuts at newlines and clips entities that span
    a cut. Whitespace at the end of a chunk is dropped (Telegram trims it anyway). If the
    conversion fails, the text is sent as it is, split by :func:`bumblebot.delivery.splitting.split_text`.
    """
    # CommonMark decodes character references (``&amp;`` becomes ``&``), but the model's text
    # must arrive as written: each ``&`` goes through the converter as a private-use character
    # no text holds (one UTF-16 unit, like ``&``, so entity offsets stay right) and comes back
    try:
        amp = _unused_character(markdown)
        plain, entities = telegramify_markdown.convert(markdown.replace("&", amp))
        plain = plain.replace(amp, "&")
        parts = telegramify_markdown.split_entities(plain, entities, limit)
    except Exception:  # a converter bug must never cost the user the message
        log.exception("Telegram: Markdown conversion failed; sending plain text")
        return [TelegramChunk(c) for c in split_text(markdown, limit, measure=utf16_len)]
    out = []
    for text, ents in parts:
        text = text.rstrip()
        if not text:
            continue
        size = utf16_len(text)
        kept = []
        for e in ents:
            if e.offset >= size or e.user is not None:
                continue
            kept.append(
                MessageEntity(
                    type=e.type, offset=e.offset, length=min(e.length, size - e.offset),
                    url=e.url.replace(amp, "&") if e.url else e.url, language=e.language,
                    custom_emoji_id=e.custom_emoji_id,
                )
            )
        out.append(TelegramChunk(text, tuple(kept)))
    return out


def _unused_character(text: str) -> str:
    """A character of Unicode's private-use area that ``text`` does not hold."""
    for code in range(0xE000, 0xF900):
        if chr(code) not in text:
            return chr(code)
    raise ValueError("text holds every private-use character")  # 6,400 distinct ones: not a chat message


def _seconds(value: int | float | timedelta) -> float:
    return value.total_seconds() if isinstance(value, timedelta) else float(value)


def _preview_text(text: str) -> str:
    """A streamed text as one plain message: cut to Telegram's limit (UTF-16 units)."""
    text = text.strip() or "…"
    if utf16_len(text) <= TELEGRAM_LIMIT:
        return text
    cut = TELEGRAM_LIMIT - 1
    while utf16_len(text[:cut]) > TELEGRAM_LIMIT - 1:
        cut -= max(1, (utf16_len(text[:cut]) - TELEGRAM_LIMIT + 1) // 2)
    return text[:cut] + "…"


def _shown(message: Message) -> str:
    """A message as a quote shows it: its text, or what it carried and its caption."""
    if message.text:
        return message.text
    what = (
        "(a photo)" if message.photo else "(a voice message)" if message.voice else
        "(a file)" if message.document or message.audio or message.video else ""
    )
    caption = message.caption or ""
    return " ".join(filter(None, (what, caption))) or _describe(message)


def _describe(message: Message) -> str:
    """A sticker, location, venue, contact, poll or dice in words, for the model."""
    if message.sticker is not None:
        sticker = message.sticker
        pack = f" from the pack {sticker.set_name}" if sticker.set_name else ""
        return f"[Sticker {sticker.emoji or ''}{pack}]".replace("  ", " ")
    if message.venue is not None:
        v = message.venue
        return f"[Venue: {v.title}, {v.address} ({v.location.latitude:.5f}, {v.location.longitude:.5f})]"
    if message.location is not None:
        loc = message.location
        return f"[Location: {loc.latitude:.5f}, {loc.longitude:.5f}]"
    if message.contact is not None:
        c = message.contact
        name = " ".join(filter(None, (c.first_name, c.last_name)))
        return f"[Contact: {name}, {c.phone_number}]"
    if message.poll is not None:
        poll = message.poll
        options = " / ".join(o.text for o in poll.options)
        return f"[Poll: {poll.question} (options: {options})]"
    if message.dice is not None:
        return f"[Dice {message.dice.emoji}: rolled {message.dice.value}]"
    return "(a message that is not text)"


@contextlib.asynccontextmanager
async def _refusals() -> AsyncIterator[None]:
    """Telegram's errors as :class:`DeliveryFailed` (retryable or not, the chat unreachable)."""
    try:
        yield
    except RetryAfter as exc:
        raise DeliveryFailed("Telegram rate limit", retryable=True, retry_after=_seconds(exc.retry_after)) from exc
    except (TimedOut, NetworkError) as exc:
        if isinstance(exc, BadRequest):
            gone = "chat not found" in exc.message.lower()
            raise DeliveryFailed(
                f"Telegram refused the message: {exc.message}", retryable=False, chat_unreachable=gone
            ) from exc
        raise DeliveryFailed(f"Telegram unreachable: {exc.message}", retryable=True) from exc
    except ChatMigrated as exc:
        raise DeliveryFailed(f"chat moved to {exc.new_chat_id}", retryable=False, chat_unreachable=True) from exc
    except Forbidden as exc:  # blocked by the user, kicked, deactivated
        raise DeliveryFailed(f"Telegram refused the message: {exc.message}", retryable=False, chat_unreachable=True) from exc
    except TelegramError as exc:
        raise DeliveryFailed(f"Telegram refused the message: {exc.message}", retryable=False) from exc


class TelegramAdapter(Adapter):
    """Connects the engine to one Telegram bot.

    Args:
        intake: the engine, as adapters see it.
        settings: the ``telegram`` config section.
        token: the bot token (``TELEGRAM_BOT_TOKEN``); never logged.
        media: the ``media`` config section.
        pacer: paces every call to a chat (default: one with Telegram's published limits).
    """

    platform = Platform.TELEGRAM

    def __init__(
        self, intake: Intake, settings: TelegramSettings, token: str, *, media: MediaSettings | None = None,
        pacer: Pacer | None = None,
    ) -> None:
        self.pacer = pacer or Pacer()
        self.intake = intake
        self.settings = settings
        self.media = media or MediaSettings()
        self.app: Application = (  # type: ignore[type-arg]
            ApplicationBuilder()
            .token(token)
            .base_url(settings.base_url)
            .base_file_url(settings.base_file_url)
            .updater(None)
            .get_updates_read_timeout(settings.poll_timeout_s + 10)
            .build()
        )
        # first: every other handler's filters (TEXT, COMMAND, PHOTO…) match edited messages
        # too, and an edit must never be answered as a new message
        self.app.add_handler(MessageHandler(filters.UpdateType.EDITED, self._on_edit))
        self.app.add_handler(CallbackQueryHandler(self._on_stop_button, pattern=f"^{STOP_DATA}$"))
        self.app.add_handler(MessageHandler(filters.StatusUpdate.MIGRATE, self._on_migrate))
        # joins, pins, title changes, topic creation: not speech; never answered or kept
        self.app.add_handler(MessageHandler(filters.StatusUpdate.ALL, self._on_service))
        self.app.add_handler(CommandHandler([c.command for c in COMMANDS], self._on_command))
        self.app.add_handler(MessageHandler(filters.TEXT & ~filters.COMMAND, self._on_text))
        self.app.add_handler(MessageHandler(filters.COMMAND, self._on_unknown_command))
        self.app.add_handler(MessageHandler(
            filters.PHOTO | filters.Document.ALL | filters.VOICE | filters.AUDIO | filters.VIDEO | filters.VIDEO_NOTE,
            self._on_files,
        ))
        self.app.add_handler(MessageHandler(
            filters.Sticker.ALL | filters.LOCATION | filters.CONTACT | filters.POLL | filters.Dice.ALL, self._on_described,
        ))
        self.app.add_handler(MessageHandler(filters.ALL, self._on_unsupported))
        self.app.add_error_handler(self._on_error)
        self._handler_error: BaseException | None = None
        self._update_failures: dict[int, int] = {}
        self._poller: asyncio.Task[None] | None = None
        self._pending_kv: dict[str, str] = {}
        self.failure: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._started = False
        self._bot_budget = BotTurnBudget()
        self._albums: dict[str, None] = {}  # albums answered lately (insertion order: oldest first)

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        if self._started:
            raise RuntimeError("Telegram adapter already started")
        self._started = True
        try:
            await self.app.initialize()
        except InvalidToken as exc:
            raise AdapterError("Telegram rejected the bot token (TELEGRAM_BOT_TOKEN); get one from @BotFather") from exc
        except TelegramError as exc:
            raise AdapterError(f"cannot reach Telegram at {self.settings.base_url}: {exc.message}") from exc
        with contextlib.suppress(TelegramError):
            await self.app.bot.delete_webhook(drop_pending_updates=False)
        with contextlib.suppress(TelegramError):
            await self.app.bot.set_my_commands(COMMANDS)
        await self.app.start()
        self._poller = asyncio.create_task(self._poll(), name="bumblebot:telegram:poll")
        log.info("Telegram: polling as @%s", self.app.bot.username)
        if self.settings.respond_in_groups != "never" and self.app.bot.can_read_all_group_messages is False:
            log.warning(PRIVACY_NOTE, self.app.bot.username)

    async def stop_intake(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
            self._poller = None

    async def stop(self) -> None:
        if not self._started:
            return
        self._started = False
        await self.stop_intake()
        if self.app.running:
            await self.app.stop()
        await self.app.shutdown()

    # -- intake ------------------------------------------------------------------------------

    async def _poll(self) -> None:
        stored = await self.intake.cursor(OFFSET_KEY)
        offset = int(stored) if stored else 0
        backoff = 1.0
        while True:
            try:
                updates = await self.app.bot.get_updates(
                    offset=offset, timeout=self.settings.poll_timeout_s, allowed_updates=ALLOWED_UPDATES
                )
                backoff = 1.0
            except Conflict as exc:
                log.error("Telegram: another process is polling this bot token (409 Conflict); stopping")
                if not self.failure.done():
                    self.failure.set_exception(AdapterError(f"Telegram conflict: {exc.message}"))
                return
            except InvalidToken as exc:
                if not self.failure.done():
                    self.failure.set_exception(AdapterError("Telegram rejected the bot token"))
                log.error("Telegram: %s", exc.message)
                return
            except RetryAfter as exc:
                await asyncio.sleep(_seconds(exc.retry_after))
                continue
            except (TimedOut, NetworkError) as exc:
                log.warning("Telegram: polling failed (%s); retrying in %.0f s", exc.message, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 60.0)
                continue
            for update in updates:
                next_offset = update.update_id + 1
                self._pending_kv = {OFFSET_KEY: str(next_offset)}
                self._handler_error = None
                await self.app.process_update(update)
                if not self.intake.accepting:
                    return  # stopping: never move the offset past an update we did not journal
                if self._handler_error is not None:
                    # e.g. the database is unavailable: keep the update unacknowledged, retry later;
                    # an update that fails every time must not block everyone else for ever
                    tries = self._update_failures.get(update.update_id, 0) + 1
                    self._update_failures = {update.update_id: tries}
                    if tries < MAX_UPDATE_ATTEMPTS:
                        delay = min(2.0**tries, 60.0)
                        log.error(
                            "Telegram: update %s not recorded (%s); retry %d in %.0f s",
                            update.update_id, self._handler_error, tries, delay,
                        )
                        await asyncio.sleep(delay)
                        break
                    log.error("Telegram: giving up on update %s after %d attempts", update.update_id, tries)
                    await self.intake.set_cursor(OFFSET_KEY, str(next_offset))
                if self._pending_kv:  # no handler journaled it (an update we do not answer)
                    await self.intake.set_cursor(OFFSET_KEY, str(next_offset))
                    self._pending_kv = {}
                offset = next_offset

    async def _on_error(self, update: object, context: ContextTypes.DEFAULT_TYPE) -> None:
        self._handler_error = context.error
        log.error("Telegram: handler failed: %r", context.error)

    def _take_kv(self) -> dict[str, str]:
        kv, self._pending_kv = self._pending_kv, {}
        return kv

    def _inbound(self, update: Update, text: str) -> Inbound | None:
        message = update.effective_message
        chat = update.effective_chat
        if message is None or chat is None:
            return None
        sender_id, sender_name, _ = self._sender(message)
        private = chat.type == ChatType.PRIVATE
        return Inbound(
            chat=ChatRef(Platform.TELEGRAM, str(chat.id), self._topic(message)),
            message_id=str(message.message_id),
            sender_id=str(sender_id),
            sender_name=sender_name,
            text=text,
            chat_kind=ChatKind.PRIVATE if private else ChatKind.GROUP,
            update_id=update.update_id,
            quote=self._quote(message),
            background=0 if private else self.settings.group_context,
        )

    @staticmethod
    def _topic(message: Message) -> str:
        """The forum topic a message is in (``""``: none, or the General topic)."""
        thread = message.message_thread_id
        if not message.is_topic_message or not thread:
            return ""  # outside forums the field marks a reply thread, not a topic
        if thread == GENERAL_TOPIC_ID and message.chat.type != ChatType.PRIVATE:
            return ""
        return str(thread)

    @staticmethod
    def _sender(message: Message) -> tuple[int, str, bool]:
        """``(id, name, is a bot)`` of who wrote ``message``. A message sent on behalf of a
        chat (an anonymous admin, a linked channel) counts as that chat, not as the helper
        bot Telegram puts in ``from``."""
        if message.sender_chat is not None:
            chat = message.sender_chat
            return chat.id, chat.title or chat.full_name or str(chat.id), False
        user = message.from_user
        if user is None:
            return message.chat.id, message.chat.title or str(message.chat.id), False
        return user.id, user.full_name, user.is_bot

    def _real_reply(self, message: Message) -> Message | None:
        """The message ``message`` replies to; in a forum topic every message "replies" to the
        topic's first message, which is not a reply."""
        replied = message.reply_to_message
        if replied is None:
            return None
        if message.is_topic_message and replied.message_id == message.message_thread_id:
            return None
        return replied

    def _quote(self, message: Message) -> str:
        """``"Name: text"`` of what ``message`` replies to (the quoted part when the user
        quoted one), shortened to :data:`QUOTE_CHARS`; ``""`` when it is not a reply."""
        replied = self._real_reply(message)
        text = message.quote.text if message.quote is not None else None
        if replied is None and text is None:
            return ""
        if replied is None:
            author = "a message from another chat"
        elif replied.from_user is not None and replied.from_user.id == self.app.bot.id:
            author = "you"
        else:
            author = self._sender(replied)[1]
        if text is None:
            text = _shown(replied) if replied is not None else ""
        text = " ".join(text.split())
        if len(text) > QUOTE_CHARS:
            text = text[: QUOTE_CHARS - 1] + "…"
        return f"{author}: {text}"

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
        replied = self._real_reply(message)
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
        if verdict is Verdict.ANSWER and self._sender(message)[2] and not self._bot_budget.allow(inbound.chat.key):
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
        sender_id, _, is_bot = self._sender(message)
        facts = MessageFacts(sender_id, is_bot, chat.id, chat.type == ChatType.PRIVATE, addressed or self._addressed(message))
        return decide(facts, self.settings, self.app.bot.id)

    async def _on_edit(self, update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
        """An edited message (``edited_message``, issue 16): the message as it reads now goes to
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
            attachments = self._attachments(message)
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

    async def _on_command(self, update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
        message = update.effective_message
        if message is None or not message.text:
            return
        inbound = await self._gate(update, message.text)
        if inbound is None:
            return
        name = message.text.split()[0].lstrip("/").split("@")[0].lower()
        private = inbound.chat_kind is ChatKind.PRIVATE
        user_id = int(inbound.sender_id)
        status = None
        if not private and name in MANAGING_COMMANDS:
            if message.sender_chat is not None and message.sender_chat.id == message.chat.id:
                status = "administrator"  # an anonymous admin of this group writes as the group
            else:
                status = await self._member_status(int(inbound.chat.chat_id), user_id)
        if not may_manage(name, private=private, user_id=user_id, admin_status=status, settings=self.settings):
            await self.intake.answer(inbound, NOT_ADMIN_TEXT, kv=self._take_kv())
            return
        answer = await self.intake.command(inbound, name, kv=self._take_kv())
        if answer:
            await self.intake.reply(inbound.chat, answer)

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
            chat=ChatRef(Platform.TELEGRAM, str(chat.id), self._topic(message)),
            message_id=f"button:{query.id}",  # a press Telegram delivers twice is handled once
            sender_id=str(user.id),
            sender_name=user.full_name,
            text="/stop",
            chat_kind=ChatKind.PRIVATE if chat.type == ChatType.PRIVATE else ChatKind.GROUP,
            update_id=update.update_id,
        )
        answer = await self.intake.command(inbound, "stop", kv=self._take_kv())
        with contextlib.suppress(TelegramError):
            await query.answer(answer or None)

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

    async def _on_unsupported(self, update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
        """Photos, stickers, voice…: say so once per message instead of staying silent (in a
        group only when the message was for the bot)."""
        inbound = await self._gate(update, "(a message that is not text)")
        if inbound is None:
            return
        await self.intake.answer(inbound, UNSUPPORTED_TEXT, kv=self._take_kv())

    async def _on_files(self, update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
        """A photo, document, voice note, audio or video, with its caption: journaled with its
        files (fetched before the turn, :meth:`download`); a file over ``max_file_bytes`` with no
        caption gets one polite reply instead, and nothing is downloaded (with a caption, the
        turn answers the caption and says the file was too big)."""
        message = update.effective_message
        if message is None:
            return
        attachments = self._attachments(message)
        album = message.media_group_id or ""
        # an album's caption (and mention) is on one part: the others follow it
        inbound = await self._gate(update, message.caption or "", attachments, addressed=album in self._albums)
        if inbound is None:
            return
        if album:  # its parts make one turn
            inbound = dataclasses.replace(inbound, album=album)
            self._albums[album] = None
            while len(self._albums) > 100:
                self._albums.pop(next(iter(self._albums)))
        limit = self.settings.max_file_bytes
        big = next((a for a in attachments if a.size is not None and a.size > limit), None)
        if big is not None and not inbound.text:  # with a caption the turn answers it, and says why
            text = TOO_BIG_TEXT.format(limit=describe_size(limit), name=big.name or "this one", size=describe_size(big.size or 0))
            await self.intake.answer(inbound, text, kv=self._take_kv())
            return
        await self.intake.submit(inbound, kv=self._take_kv())

    def _attachments(self, message: Message) -> tuple[Attachment, ...]:
        """The files of ``message``: a photo (one size, :meth:`_photo_size`), or its document,
        voice note, audio, video or video note."""
        if message.photo:
            size = self._photo_size(message.photo)
            return (Attachment(AttachmentKind.IMAGE, size.file_id, "photo.jpg", "image/jpeg", size.file_size,
                               size.width, size.height),)
        if message.voice is not None:
            v = message.voice
            return (Attachment(AttachmentKind.VOICE, v.file_id, "", v.mime_type or "audio/ogg", v.file_size,
                               duration_s=_seconds(v.duration)),)
        if message.audio is not None:
            a = message.audio
            return (Attachment(AttachmentKind.AUDIO, a.file_id, a.file_name or "audio", a.mime_type or "", a.file_size,
                               duration_s=_seconds(a.duration)),)
        if message.document is not None:
            d = message.document
            mime = (d.mime_type or "").lower()
            kind = AttachmentKind.IMAGE if mime.startswith("image/") and mime != "image/svg+xml" else (
                AttachmentKind.AUDIO if mime.startswith("audio/") else AttachmentKind.DOCUMENT
            )
            return (Attachment(kind, d.file_id, d.file_name or "", mime, d.file_size),)
        if message.video is not None:
            v = message.video
            return (Attachment(AttachmentKind.DOCUMENT, v.file_id, v.file_name or "video.mp4", v.mime_type or "video/mp4",
                               v.file_size, v.width, v.height, _seconds(v.duration)),)
        if message.video_note is not None:
            n = message.video_note
            return (Attachment(AttachmentKind.DOCUMENT, n.file_id, "video-note.mp4", "video/mp4", n.file_size,
                               duration_s=_seconds(n.duration)),)
        return ()

    def _photo_size(self, sizes: tuple[PhotoSize, ...]) -> PhotoSize:
        """The largest size of a photo within ``media.image_max_side_px`` and
        ``media.image_max_bytes`` (the smallest when none is)."""
        fits = [
            p for p in sizes
            if max(p.width, p.height) <= self.media.image_max_side_px and (p.file_size or 0) <= self.media.image_max_bytes
        ]
        if fits:
            return max(fits, key=lambda p: p.width * p.height)
        return min(sizes, key=lambda p: p.width * p.height)

    async def _on_described(self, update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
        """A sticker, location, venue, contact, poll or dice: answered as a short description."""
        message = update.effective_message
        if message is None:
            return
        inbound = await self._gate(update, _describe(message))
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

    # -- delivery ----------------------------------------------------------------------------

    def chunks(self, text: str) -> list[TelegramChunk]:
        return render_chunks(text)

    @contextlib.asynccontextmanager
    async def _paced(self, chat: ChatRef, *, ticket: str | None = None, preview: bool = False) -> AsyncIterator[None]:
        """One call to ``chat`` in its turn (:meth:`Pacer.slot <adapters.telegram.pacing.Pacer.slot>`),
        Telegram's errors as :class:`DeliveryFailed` (:func:`_refusals`); a ``RetryAfter``
        pauses the chat for its ``retry_after``, and the call's retry (the same ``ticket``:
        the delivery layer's chunk key) keeps its place before the calls queued meanwhile.

        Messages queued in the chat wait their turn whatever it takes, so their order holds;
        a known wait over the delivery layer's :data:`~bumblebot.delivery.outbox.MAX_INLINE_WAIT_S`
        (a long pause) is refused at once, retryable with ``retry_after``, so the message is
        left pending instead of holding its caller. A ``preview`` send or edit is skipped
        (retryable) when other calls are queued or its turn is over :data:`PREVIEW_WAIT_S` away."""
        key = chat.chat_id
        wait = PREVIEW_WAIT_S if preview else MAX_INLINE_WAIT_S
        async with _refusals(), self.pacer.slot(
            key, group=int(key) < 0, ticket=ticket, max_wait_s=wait, droppable=preview
        ):
            try:
                yield
            except RetryAfter as exc:
                self.pacer.pause(key, _seconds(exc.retry_after))
                raise

    async def send_chunk(self, chat: ChatRef, chunk: TelegramChunk, *, key: str) -> str:
        """Send one message (Telegram has no idempotency key: ``key`` is not used).

        A chat that became a supergroup is moved (:meth:`Intake.move_chat`) and the message
        sent there; a topic Telegram no longer knows ("message thread not found": deleted, or
        private-chat topics turned off) gets the message in the chat itself.
        """
        chat_id = int(chat.chat_id)
        thread = int(chat.thread_id) if chat.thread_id else None
        async with self._paced(chat, ticket=key):
            try:
                message = await self._send(chat_id, thread, chunk)
            except ChatMigrated as exc:
                new = ChatRef(Platform.TELEGRAM, str(exc.new_chat_id), chat.thread_id)
                await self.intake.move_chat(chat, new)
                message = await self._send(exc.new_chat_id, thread, chunk)
            except BadRequest as exc:
                if thread is None or "thread not found" not in exc.message.lower():
                    raise
                log.warning("Telegram: topic %s of %s is gone; sending to the chat itself", thread, chat_id)
                message = await self._send(chat_id, None, chunk)
        return str(message.message_id)

    # -- streaming (issue 11): one message edited in place ---------------------------------------

    def stream_interval_s(self, chat: ChatRef) -> float | None:
        """One edit a second in a private chat, one per 3 s in a group (20 a minute)."""
        return PRIVATE_EDIT_INTERVAL_S if int(chat.chat_id) > 0 else GROUP_EDIT_INTERVAL_S

    async def send_preview(self, chat: ChatRef, text: str, *, key: str) -> str:
        thread = int(chat.thread_id) if chat.thread_id else None
        async with self._paced(chat, preview=True):
            message = await self.app.bot.send_message(
                chat_id=int(chat.chat_id), text=_preview_text(text), message_thread_id=thread, reply_markup=STOP_MARKUP
            )
        return str(message.message_id)

    async def edit_preview(self, chat: ChatRef, message_id: str, text: str, *, final: bool = False) -> None:
        async with self._paced(chat, preview=not final):
            try:
                await self.app.bot.edit_message_text(
                    _preview_text(text), chat_id=int(chat.chat_id), message_id=int(message_id),
                    reply_markup=None if final else STOP_MARKUP,
                )
            except BadRequest as exc:
                if "not modified" not in exc.message.lower():
                    raise

    async def finish_preview(self, chat: ChatRef, message_id: str, chunk: TelegramChunk, *, key: str) -> str:
        """Edit the preview into the final, formatted first chunk. Without ``reply_markup`` the
        edit takes the Stop button away (Bot API, editMessageText). A preview that is gone or
        can no longer be edited is replaced by a new message (each call in its turn: the
        deletion and the new message wait for theirs)."""
        chat_id = int(chat.chat_id)
        gone = False
        async with self._paced(chat, ticket=key):
            try:
                try:
                    await self.app.bot.edit_message_text(
                        chunk.text, chat_id=chat_id, message_id=int(message_id), entities=chunk.entities or None
                    )
                except BadRequest as exc:
                    if not chunk.entities or "entit" not in exc.message.lower():
                        raise
                    await self.app.bot.edit_message_text(chunk.text, chat_id=chat_id, message_id=int(message_id))
            except BadRequest as exc:
                reason = exc.message.lower()
                if "not modified" in reason:
                    return message_id
                if "not found" not in reason and "can't be edited" not in reason:
                    raise
                log.info("Telegram: the streamed message %s in %s is gone (%s); sending it anew", message_id, chat_id, exc.message)
                gone = True
        if gone:
            with contextlib.suppress(DeliveryFailed):
                await self.delete_message(chat, message_id)
            return await self.send_chunk(chat, chunk, key=key)
        return message_id

    async def delete_message(self, chat: ChatRef, message_id: str) -> None:
        async with self._paced(chat):
            await self.app.bot.delete_message(int(chat.chat_id), int(message_id))

    async def _send(self, chat_id: int, thread: int | None, chunk: TelegramChunk) -> Message:
        try:
            return await self.app.bot.send_message(
                chat_id=chat_id, text=chunk.text, entities=chunk.entities or None, message_thread_id=thread
            )
        except BadRequest as exc:
            if not chunk.entities or "entit" not in exc.message.lower():
                raise
            # formatting refused: the words matter more than the bold
            return await self.app.bot.send_message(chat_id=chat_id, text=chunk.text, message_thread_id=thread)

    # -- files (issue 12) -----------------------------------------------------------------------

    async def download(self, attachment: Attachment, dest: Path) -> int:
        """``getFile``, then the file itself, into ``dest``.

        Raises:
            MediaError: over ``telegram.max_file_bytes`` (checked before anything is fetched),
                refused ("file is too big": the Bot API serves at most 20 MB), or Telegram
                unreachable (``retryable``).
        """
        limit = self.settings.max_file_bytes
        if attachment.size is not None and attachment.size > limit:
            raise MediaError(f"it is over the {describe_size(limit)} limit")
        try:
            file = await self.app.bot.get_file(attachment.ref)
            if file.file_size is not None and file.file_size > limit:
                raise MediaError(f"it is over the {describe_size(limit)} limit")
            data = await file.download_as_bytearray()
        except BadRequest as exc:
            if "too big" in exc.message.lower():
                raise MediaError("it is over the 20 MB that Telegram lets bots download") from exc
            raise MediaError(f"Telegram would not hand it over ({self._untokened(exc.message)})") from exc
        except (TimedOut, NetworkError) as exc:
            raise MediaError(f"Telegram could not be reached ({self._untokened(exc.message)})", retryable=True) from exc
        except TelegramError as exc:
            raise MediaError(f"Telegram would not hand it over ({self._untokened(exc.message)})") from exc
        await asyncio.to_thread(dest.write_bytes, bytes(data))
        return len(data)

    def _untokened(self, text: str) -> str:
        """``text`` (an error that reaches the user) without the bot token, which is part of
        every file URL."""
        return text.replace(self.app.bot.token, "<token>")

    def max_upload_bytes(self, chat: ChatRef, kind: FileKind) -> int | None:
        return PHOTO_UPLOAD_LIMIT if kind == "photo" else UPLOAD_LIMIT

    def caption_limit(self) -> int:
        return CAPTION_LIMIT

    def caption_fits(self, text: str) -> bool:
        return utf16_len(text) <= CAPTION_LIMIT  # Telegram counts UTF-16 code units

    async def send_file(self, chat: ChatRef, path: Path, *, kind: FileKind, caption: str, key: str) -> str:
        """``sendPhoto``, ``sendDocument`` or ``sendVoice``; a photo Telegram refuses (too large,
        odd dimensions) goes as a document."""
        chat_id = int(chat.chat_id)
        thread = int(chat.thread_id) if chat.thread_id else None
        data = await asyncio.to_thread(path.read_bytes)
        upload = InputFile(data, filename=path.name)
        bot = self.app.bot
        # an upload takes its time (PTB's 5 s read timeout would cut off a big one); one that
        # still times out may have arrived: it is not sent again (one copy at most)
        timeouts = {"write_timeout": UPLOAD_TIMEOUT_S, "read_timeout": UPLOAD_TIMEOUT_S}
        try:
            async with self._paced(chat, ticket=key):
                if kind == "photo":
                    try:
                        message = await bot.send_photo(
                            chat_id, upload, caption=caption or None, message_thread_id=thread, **timeouts
                        )
                        return str(message.message_id)
                    except BadRequest as exc:
                        log.info("Telegram refused %s as a photo (%s); sending it as a document", path.name, exc.message)
                        upload = InputFile(data, filename=path.name)
                send = bot.send_voice if kind == "voice" else bot.send_document
                message = await send(chat_id, upload, caption=caption or None, message_thread_id=thread, **timeouts)
        except DeliveryFailed as exc:
            if isinstance(exc.__cause__, TimedOut):
                raise DeliveryFailed(
                    f"the upload of {path.name} timed out; it may or may not have arrived, so it is not sent again",
                    retryable=False,
                ) from exc
            raise
        return str(message.message_id)

    async def send_typing(self, chat: ChatRef) -> None:
        """``sendChatAction``, outside the chat's turn (it never waits for messages, nor counts
        against them); skipped while the chat is paused after a 429.

        Raises:
            DeliveryFailed: Telegram refused it; a ``RetryAfter`` pauses the chat and sets
                ``retry_after`` (the refresh waits it out, :meth:`Adapter.typing`).
        """
        if self.pacer.paused_for(chat.chat_id) > 0:
            return
        async with _refusals():
            try:
                await self.app.bot.send_chat_action(
                    chat_id=int(chat.chat_id),
                    action=ChatAction.TYPING,
                    message_thread_id=int(chat.thread_id) if chat.thread_id else None,
                )
            except RetryAfter as exc:
                self.pacer.pause(chat.chat_id, _seconds(exc.retry_after))
                raise
