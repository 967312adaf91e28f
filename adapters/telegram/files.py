"""Files to and from Telegram.

In: the engine fetches a message's files before the turn through
:meth:`TelegramFiles.download` (``getFile``, then ``<telegram.base_file_url><token>/<file_path>``);
one over ``telegram.max_file_bytes`` (20 MB, the Bot API's own download limit) is never
downloaded. The bot token is part of every file URL, so it is cut out of any error that
reaches the user.

Out: the entity's files leave through ``sendPhoto`` (falling back to ``sendDocument`` when
Telegram refuses the photo), ``sendDocument`` and ``sendVoice`` (Ogg/Opus), each call paced like
a message (:mod:`adapters.telegram.sending`). Uploads are at most 50 MB (10 MB for photos) and
captions 1024 characters, counted in UTF-16 code units (Bot API, "Sending files").
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path

from telegram import InputFile
from telegram.error import BadRequest, NetworkError, TelegramError, TimedOut
from telegram.ext import Application

from bumblebot.core.adapter import FileKind
from bumblebot.core.errors import DeliveryFailed, MediaError
from bumblebot.core.events import Attachment, ChatRef
from bumblebot.core.regular import read_regular
from bumblebot.core.settings import TelegramSettings
from bumblebot.delivery.splitting import utf16_len
from bumblebot.media.documents import describe_size

log = logging.getLogger(__name__)

#: Bot API upload limits (sendDocument/sendVoice: 50 MB; sendPhoto: 10 MB) and caption length.
UPLOAD_LIMIT = 50 * 1024 * 1024
PHOTO_UPLOAD_LIMIT = 10 * 1024 * 1024
CAPTION_LIMIT = 1024
#: Seconds an upload may take to send and to be answered.
UPLOAD_TIMEOUT_S = 300.0


class TelegramFiles:
    """Downloads of a message's files and uploads of the entity's.

    Mixed into :class:`~adapters.telegram.adapter.TelegramAdapter`, which provides the
    attributes below; ``_paced`` (:class:`~adapters.telegram.sending.TelegramSending`) gives each
    upload its turn in the chat.
    """

    app: Application  # type: ignore[type-arg]
    settings: TelegramSettings
    _paced: Callable[..., AbstractAsyncContextManager[None]]

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
        except (TimedOut, NetworkError) as exc:  # its message names the HTTP library's exception: logged only
            log.info("Telegram: a download failed: %s", self._untokened(exc.message))
            raise MediaError("Telegram could not be reached", retryable=True) from exc
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

    async def send_file(
        self, chat: ChatRef, path: Path, *, kind: FileKind, caption: str, key: str, name: str = ""
    ) -> str:
        """``sendPhoto``, ``sendDocument`` or ``sendVoice``; a photo Telegram refuses (too large,
        odd dimensions) goes as a document."""
        chat_id = int(chat.chat_id)
        thread = int(chat.thread_id) if chat.thread_id else None
        data = await asyncio.to_thread(read_regular, path)  # a named pipe is refused, not waited on
        name = name or path.name
        upload = InputFile(data, filename=name)
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
                        log.info("Telegram refused %s as a photo (%s); sending it as a document", name, exc.message)
                        upload = InputFile(data, filename=name)
                send = bot.send_voice if kind == "voice" else bot.send_document
                message = await send(chat_id, upload, caption=caption or None, message_thread_id=thread, **timeouts)
        except DeliveryFailed as exc:
            if isinstance(exc.__cause__, TimedOut):
                raise DeliveryFailed(
                    f"the upload of {name} timed out; it may or may not have arrived, so it is not sent again",
                    retryable=False,
                ) from exc
            raise
        return str(message.message_id)
