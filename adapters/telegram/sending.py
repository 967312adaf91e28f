"""Messages out to Telegram: outbox chunks, streamed previews, deletions, the typing indicator.

Rules followed: a message is at most 4096 characters (counted in UTF-16 code units, the
conservative bound); the model's Markdown is sent as plain text plus formatting entities
(:func:`~adapters.telegram.render.render_chunks`), never with a ``parse_mode``, and as plain
text when Telegram refuses the entities; empty messages are never sent. Telegram's errors
become :class:`~bumblebot.core.errors.DeliveryFailed` (:func:`refusals`), and the delivery
layer retries what is retryable.

Pacing: every call to a chat (messages, previews and their edits, deletions, files, the typing
indicator) goes through one :class:`~adapters.telegram.pacing.Pacer`, keyed by the chat id (a
forum's topics share their group's limits): one call at a time per chat, in order, about one a
second, 20 a minute in a group (a negative chat id), 30 a second overall. A ``RetryAfter`` from
any of them pauses that chat for its ``retry_after``; the typing indicator is skipped while
the chat is paused and never waits for a turn.

Streaming: a turn's answer shows as one message, edited in place as the text grows (about one
edit a second in a private chat, one per 3 s in a group), with a Stop button under it; the
final edit formats it and takes the button away.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

from telegram import InlineKeyboardButton, InlineKeyboardMarkup, Message
from telegram.constants import ChatAction
from telegram.error import (
    BadRequest,
    ChatMigrated,
    Forbidden,
    NetworkError,
    RetryAfter,
    TelegramError,
    TimedOut,
)
from telegram.ext import Application

from adapters.telegram.pacing import Pacer
from adapters.telegram.reading import seconds
from adapters.telegram.render import TelegramChunk, preview_text, render_chunks
from bumblebot.core.adapter import Intake
from bumblebot.core.errors import DeliveryFailed
from bumblebot.core.events import ChatRef, Platform
from bumblebot.delivery import MAX_INLINE_WAIT_S

log = logging.getLogger(__name__)

#: The Stop button under a message being streamed (``callback_data`` of the button).
STOP_DATA = "bumblebot:stop"
STOP_MARKUP = InlineKeyboardMarkup([[InlineKeyboardButton("Stop", callback_data=STOP_DATA)]])
#: Least seconds between edits of one streamed message: about one message a second in a
#: private chat, 20 a minute in a group (Bot API FAQ, "broadcasting to users").
PRIVATE_EDIT_INTERVAL_S = 1.0
GROUP_EDIT_INTERVAL_S = 3.0
#: Longest wait of a streamed preview's send or edit for its turn in the chat, seconds: past
#: it the edit is skipped (the preview shows newer text at its next edit, the final text goes
#: through the outbox), so intermediate text never queues behind messages.
PREVIEW_WAIT_S = 2.0


@contextlib.asynccontextmanager
async def refusals() -> AsyncIterator[None]:
    """Telegram's errors as :class:`DeliveryFailed` (retryable or not, the chat unreachable)."""
    try:
        yield
    except RetryAfter as exc:
        raise DeliveryFailed("Telegram rate limit", retryable=True, retry_after=seconds(exc.retry_after)) from exc
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


class TelegramSending:
    """The adapter's sending side: chunks, previews, deletions and typing, each call paced.

    Mixed into :class:`~adapters.telegram.adapter.TelegramAdapter`, which provides the
    attributes below.
    """

    app: Application  # type: ignore[type-arg]
    intake: Intake
    pacer: Pacer

    def chunks(self, text: str) -> list[TelegramChunk]:
        return render_chunks(text)

    @contextlib.asynccontextmanager
    async def _paced(self, chat: ChatRef, *, ticket: str | None = None, preview: bool = False) -> AsyncIterator[None]:
        """One call to ``chat`` in its turn (:meth:`Pacer.slot <adapters.telegram.pacing.Pacer.slot>`),
        Telegram's errors as :class:`DeliveryFailed` (:func:`refusals`); a ``RetryAfter``
        pauses the chat for its ``retry_after``, and the call's retry (the same ``ticket``:
        the delivery layer's chunk key) keeps its place before the calls queued meanwhile.

        Messages queued in the chat wait their turn whatever it takes, so their order holds;
        a known wait over the delivery layer's :data:`~bumblebot.delivery.outbox.MAX_INLINE_WAIT_S`
        (a long pause) is refused at once, retryable with ``retry_after``, so the message is
        left pending instead of holding its caller. A ``preview`` send or edit is skipped
        (retryable) when other calls are queued or its turn is over :data:`PREVIEW_WAIT_S` away."""
        key = chat.chat_id
        wait = PREVIEW_WAIT_S if preview else MAX_INLINE_WAIT_S
        async with refusals(), self.pacer.slot(
            key, group=int(key) < 0, ticket=ticket, max_wait_s=wait, droppable=preview
        ):
            try:
                yield
            except RetryAfter as exc:
                self.pacer.pause(key, seconds(exc.retry_after))
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

    # -- streaming: one message edited in place --------------------------------------------------

    def stream_interval_s(self, chat: ChatRef) -> float | None:
        """One edit a second in a private chat, one per 3 s in a group (20 a minute)."""
        return PRIVATE_EDIT_INTERVAL_S if int(chat.chat_id) > 0 else GROUP_EDIT_INTERVAL_S

    async def send_preview(self, chat: ChatRef, text: str, *, key: str) -> str:
        thread = int(chat.thread_id) if chat.thread_id else None
        async with self._paced(chat, preview=True):
            message = await self.app.bot.send_message(
                chat_id=int(chat.chat_id), text=preview_text(text), message_thread_id=thread, reply_markup=STOP_MARKUP
            )
        return str(message.message_id)

    async def edit_preview(self, chat: ChatRef, message_id: str, text: str, *, final: bool = False) -> None:
        async with self._paced(chat, preview=not final):
            try:
                await self.app.bot.edit_message_text(
                    preview_text(text), chat_id=int(chat.chat_id), message_id=int(message_id),
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

    # -- typing --------------------------------------------------------------------------------

    async def send_typing(self, chat: ChatRef) -> None:
        """``sendChatAction``, outside the chat's turn (it never waits for messages, nor counts
        against them); skipped while the chat is paused after a 429.

        Raises:
            DeliveryFailed: Telegram refused it; a ``RetryAfter`` pauses the chat and sets
                ``retry_after`` (the refresh waits it out, :meth:`Adapter.typing`).
        """
        if self.pacer.paused_for(chat.chat_id) > 0:
            return
        async with refusals():
            try:
                await self.app.bot.send_chat_action(
                    chat_id=int(chat.chat_id),
                    action=ChatAction.TYPING,
                    message_thread_id=int(chat.thread_id) if chat.thread_id else None,
                )
            except RetryAfter as exc:
                self.pacer.pause(chat.chat_id, seconds(exc.retry_after))
                raise
