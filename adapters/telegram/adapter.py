"""Telegram through python-telegram-bot: long polling, private chats.

Why our own polling loop instead of PTB's ``Updater``: the ``Updater`` asks for the next batch
(which acknowledges the previous one to Telegram) as soon as it has queued the updates, before
any handler ran, so a crash in between loses messages (reference-study.md, "Crash windows";
field-bugs.md item 1). Here each update is fed to the PTB ``Application`` (handlers, command
parsing) and journaled — together with the next offset, in one SQLite transaction — before the
next ``getUpdates`` moves the offset past it. A restart resumes from the stored offset; an
update Telegram delivers again is dropped by the journal's uniqueness on (chat, message id).

Rules followed: a message is at most 4096 characters (counted in UTF-16 code units, the
conservative bound); the model's Markdown is sent as plain text plus formatting entities
(:func:`render_chunks`), never with a ``parse_mode``; empty messages are never sent; ``RetryAfter`` is honoured by the delivery
layer; a 409 ``Conflict`` (another instance polling the same token) is fatal.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from datetime import timedelta
import telegramify_markdown
from telegram import BotCommand, MessageEntity, Update
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
from telegram.ext import Application, ApplicationBuilder, CommandHandler, ContextTypes, MessageHandler, filters

from bumblebot.adapter import Adapter, Intake
from bumblebot.config import TelegramSettings
from bumblebot.errors import AdapterError, DeliveryFailed
from bumblebot.events import ChatKind, ChatRef, Inbound, Platform
from bumblebot.splitting import TELEGRAM_LIMIT, split_text, utf16_len

log = logging.getLogger(__name__)

OFFSET_KEY = "telegram.offset"
#: Attempts at recording one update before it is skipped (logged) so others can flow.
MAX_UPDATE_ATTEMPTS = 5
REFUSAL_TEXT = "Sorry, this bot is private."
UNSUPPORTED_TEXT = "I can only read text messages for now; could you write it out?"
COMMANDS = [
    BotCommand("start", "About this bot"),
    BotCommand("reset", "Start a fresh conversation"),
    BotCommand("status", "Context usage and compaction"),
    BotCommand("compact", "Compact the conversation now"),
    BotCommand("help", "What I can do"),
]


@dataclass(frozen=True, slots=True)
class TelegramChunk:
    """One message as Telegram takes it: plain text plus formatting entities (UTF-16 offsets)."""

    text: str
    entities: tuple[MessageEntity, ...] = ()


def render_chunks(markdown: str, limit: int = TELEGRAM_LIMIT) -> list[TelegramChunk]:
    """The model's Markdown as Telegram messages of at most ``limit`` UTF-16 units.

    ``telegramify-markdown`` turns Markdown into plain text plus ``MessageEntity`` objects, so
    no ``parse_mode`` is needed and no reply can fail with "can't parse entities"
    (field-bugs.md items 14 and 16); its splitter cuts at newlines and clips entities that span
    a cut. Whitespace at the end of a chunk is dropped (Telegram trims it anyway). If the
    conversion fails, the text is sent as it is, split by :func:`bumblebot.splitting.split_text`.
    """
    try:
        plain, entities = telegramify_markdown.convert(markdown)
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
                    url=e.url, language=e.language, custom_emoji_id=e.custom_emoji_id,
                )
            )
        out.append(TelegramChunk(text, tuple(kept)))
    return out


def _seconds(value: int | float | timedelta) -> float:
    return value.total_seconds() if isinstance(value, timedelta) else float(value)


class TelegramAdapter(Adapter):
    """Connects the engine to one Telegram bot.

    Args:
        intake: the engine, as adapters see it.
        settings: the ``telegram`` config section.
        token: the bot token (``TELEGRAM_BOT_TOKEN``); never logged.
    """

    platform = Platform.TELEGRAM

    def __init__(self, intake: Intake, settings: TelegramSettings, token: str) -> None:
        self.intake = intake
        self.settings = settings
        self.app: Application = (  # type: ignore[type-arg]
            ApplicationBuilder()
            .token(token)
            .base_url(settings.base_url)
            .base_file_url(settings.base_file_url)
            .updater(None)
            .get_updates_read_timeout(settings.poll_timeout_s + 10)
            .build()
        )
        self.app.add_handler(CommandHandler([c.command for c in COMMANDS], self._on_command))
        self.app.add_handler(MessageHandler(filters.TEXT & ~filters.COMMAND, self._on_text))
        self.app.add_handler(MessageHandler(filters.COMMAND, self._on_unknown_command))
        self.app.add_handler(MessageHandler(filters.ALL, self._on_unsupported))
        self.app.add_error_handler(self._on_error)
        self._handler_error: BaseException | None = None
        self._update_failures: dict[int, int] = {}
        self._poller: asyncio.Task[None] | None = None
        self._pending_kv: dict[str, str] = {}
        self.failure: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._started = False

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
                    offset=offset, timeout=self.settings.poll_timeout_s, allowed_updates=["message"]
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
        user = update.effective_user
        if message is None or chat is None:
            return None
        thread = str(message.message_thread_id) if message.is_topic_message and message.message_thread_id else ""
        return Inbound(
            chat=ChatRef(Platform.TELEGRAM, str(chat.id), thread),
            message_id=str(message.message_id),
            sender_id=str(user.id) if user else str(chat.id),
            sender_name=(user.full_name if user else chat.title or str(chat.id)),
            text=text,
            chat_kind=ChatKind.PRIVATE if chat.type == ChatType.PRIVATE else ChatKind.GROUP,
            update_id=update.update_id,
        )

    def _allowed(self, inbound: Inbound) -> bool:
        users, chats = self.settings.allowed_user_ids, self.settings.allowed_chat_ids
        if not users and not chats:
            return True
        return int(inbound.sender_id) in users or int(inbound.chat.chat_id) in chats

    async def _gatekeep(self, inbound: Inbound) -> bool:
        """``True`` if the message may proceed; otherwise it is journaled as handled here."""
        if inbound.chat_kind is not ChatKind.PRIVATE:
            if await self.intake.answer(inbound, None, kv=self._take_kv()):
                log.info("Telegram: ignoring group chat %s (private chats only)", inbound.chat.chat_id)
            return False
        if self._allowed(inbound):
            return True
        await self.intake.refuse_once(inbound, REFUSAL_TEXT, kv=self._take_kv())
        return False

    async def _on_text(self, update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
        message = update.effective_message
        if message is None or not message.text:
            return
        inbound = self._inbound(update, message.text)
        if inbound is None or not await self._gatekeep(inbound):
            return
        await self.intake.submit(inbound, kv=self._take_kv())

    async def _on_command(self, update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
        message = update.effective_message
        if message is None or not message.text:
            return
        inbound = self._inbound(update, message.text)
        if inbound is None or not await self._gatekeep(inbound):
            return
        name = message.text.split()[0].lstrip("/").split("@")[0]
        answer = await self.intake.command(inbound, name, kv=self._take_kv())
        if answer:
            await self.intake.reply(inbound.chat, answer)

    async def _on_unknown_command(self, update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
        await self._on_command(update, context)

    async def _on_unsupported(self, update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
        """Photos, stickers, voice…: say so once per message instead of staying silent."""
        inbound = self._inbound(update, "(a message that is not text)")
        if inbound is None or not await self._gatekeep(inbound):
            return
        await self.intake.answer(inbound, UNSUPPORTED_TEXT, kv=self._take_kv())

    # -- delivery ----------------------------------------------------------------------------

    def chunks(self, text: str) -> list[TelegramChunk]:
        return render_chunks(text)

    async def send_chunk(self, chat: ChatRef, chunk: TelegramChunk, *, key: str) -> str:
        """Send one message (Telegram has no idempotency key: ``key`` is not used)."""
        thread = int(chat.thread_id) if chat.thread_id else None
        try:
            try:
                message = await self.app.bot.send_message(
                    chat_id=int(chat.chat_id), text=chunk.text, entities=chunk.entities or None,
                    message_thread_id=thread,
                )
            except BadRequest as exc:
                if not chunk.entities or "entit" not in exc.message.lower():
                    raise
                # formatting refused: the words matter more than the bold
                message = await self.app.bot.send_message(
                    chat_id=int(chat.chat_id), text=chunk.text, message_thread_id=thread
                )
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
        return str(message.message_id)

    async def send_typing(self, chat: ChatRef) -> None:
        await self.app.bot.send_chat_action(
            chat_id=int(chat.chat_id),
            action=ChatAction.TYPING,
            message_thread_id=int(chat.thread_id) if chat.thread_id else None,
        )
