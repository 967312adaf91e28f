"""Messages out to Discord: outbox chunks, streamed previews with the Stop button, deletions,
the typing indicator.

Rules followed (Discord developer docs, "Create Message"): content is at most 2000 characters
(measured here in UTF-16 code units, the conservative bound), never empty; replies are split
with :func:`bumblebot.delivery.splitting.split_markdown`, so code fences are closed and reopened.
Every message goes out with ``allowed_mentions`` parsing nothing (:data:`NO_PINGS`), so a reply
never pings anyone: an automatic ping of the replied-to author counts as a mention, and two bots
in one channel would answer each other for ever. Each message carries the outbox chunk key as
its nonce, so a retry never posts it twice.

Errors (:func:`refusals`): discord.py waits out rate limits up to 30 s itself; a longer one, a
5xx or a network error raises :class:`~bumblebot.core.errors.DeliveryFailed` with
``retryable=True`` and the outbox retries it later; 400/403/404 are permanent.

Streaming: a turn's answer shows as one message, edited in place as the text grows (at most one
edit a second), with a Stop button under it (:class:`StopView`); the final edit takes the
button away.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import discord

from bumblebot.core.errors import DeliveryFailed
from bumblebot.core.events import ChatRef
from bumblebot.delivery.splitting import split_markdown, utf16_len

log = logging.getLogger(__name__)

#: Discord API, Create Message: content is at most 2000 characters.
MESSAGE_LIMIT = 2000
#: A message this long is probably a part of a long paste the Discord client cut at its limit:
#: the engine waits a little longer for the next part and joins them.
PASTE_PART_CHARS = 1900
NO_PINGS = discord.AllowedMentions.none()
#: ``custom_id`` of the Stop button under a streamed message.
STOP_ID = "bumblebot:stop"
#: Least seconds between edits of one streamed message (5 edits per 5 s per channel).
EDIT_INTERVAL_S = 1.0
#: JSON error code of a message that does not exist (any more).
UNKNOWN_MESSAGE = 10008


def paste_part(text: str) -> bool:
    """Whether ``text`` is long enough to be a part of a long paste (:data:`PASTE_PART_CHARS`)."""
    return len(text) >= PASTE_PART_CHARS // 2 and utf16_len(text) >= PASTE_PART_CHARS


class StopView(discord.ui.View):
    """The Stop button under a streamed message: a persistent view (no timeout, a fixed
    ``custom_id``), so a press reaches the adapter whichever message it is under."""

    def __init__(self, on_press: Any) -> None:
        super().__init__(timeout=None)
        self._on_press = on_press

    @discord.ui.button(label="Stop", style=discord.ButtonStyle.secondary, custom_id=STOP_ID)
    async def stop_button(self, interaction: discord.Interaction, button: discord.ui.Button[Any]) -> None:
        await self._on_press(interaction)


def preview_text(text: str) -> str:
    """A streamed text as one plain message, cut to Discord's 2000 characters."""
    text = text.strip() or "…"
    return text if len(text) <= MESSAGE_LIMIT else text[: MESSAGE_LIMIT - 1] + "…"


def nonce(key: str) -> str:
    """A Discord nonce (at most 25 characters) for an outbox chunk key."""
    return key[-25:]


@contextlib.asynccontextmanager
async def refusals() -> AsyncIterator[None]:
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


class DiscordSending:
    """The adapter's sending side: chunks, previews, deletions and typing.

    Mixed into :class:`~adapters.discord.adapter.DiscordAdapter`, which provides the
    attributes below.
    """

    client: discord.Client
    _stop_view: StopView

    def chunks(self, text: str) -> list[str]:
        return split_markdown(text, MESSAGE_LIMIT, measure=utf16_len)

    async def send_chunk(self, chat: ChatRef, text: str, *, key: str) -> str:
        """Send one message; ``key`` becomes its nonce, and Discord (``enforce_nonce``) returns
        the first message instead of posting a second one when a retry repeats it."""
        if not text.strip():
            raise DeliveryFailed("refusing to send an empty Discord message", retryable=False)
        async with refusals():
            message = await self._channel(chat).send(text, allowed_mentions=NO_PINGS, nonce=nonce(key))
        return str(message.id)

    def _channel(self, chat: ChatRef) -> discord.PartialMessageable:
        if self.client.is_closed():
            raise DeliveryFailed("the Discord client is not connected", retryable=True)
        return self.client.get_partial_messageable(int(chat.thread_id or chat.chat_id))

    # -- streaming: one message edited in place --------------------------------------------------

    def stream_interval_s(self, chat: ChatRef) -> float | None:
        """Discord allows 5 edits per 5 s in a channel: one a second."""
        return EDIT_INTERVAL_S

    async def send_preview(self, chat: ChatRef, text: str, *, key: str) -> str:
        async with refusals():
            message = await self._channel(chat).send(
                preview_text(text), allowed_mentions=NO_PINGS, nonce=nonce(key), view=self._stop_view
            )
        return str(message.id)

    async def edit_preview(self, chat: ChatRef, message_id: str, text: str, *, final: bool = False) -> None:
        async with refusals():
            await self._channel(chat).get_partial_message(int(message_id)).edit(
                content=preview_text(text), allowed_mentions=NO_PINGS, view=None if final else self._stop_view
            )

    async def finish_preview(self, chat: ChatRef, message_id: str, chunk: str, *, key: str) -> str:
        """Edit the preview into the first chunk; a preview that is gone (deleted by a
        moderator: 10008 Unknown Message) is replaced by a new message."""
        try:
            async with refusals():
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
        async with refusals():
            await self._channel(chat).get_partial_message(int(message_id)).delete()

    async def send_typing(self, chat: ChatRef) -> None:
        channel = self.client.get_partial_messageable(int(chat.thread_id or chat.chat_id))
        await channel.typing()
