"""Files to and from Discord.

In: a message's attachments are journaled as :class:`~bumblebot.core.events.Attachment`
references (their URL, :func:`attachment`) and fetched by the engine before the turn
(:meth:`DiscordFiles.download`, through discord.py's CDN request): ``image/*`` ones are images
the model sees, voice messages (flag ``IS_VOICE_MESSAGE``) and ``audio/*`` are transcribed, the
rest are documents. One over ``discord.max_file_bytes`` is never downloaded.

Out: the entity's files leave as attachments of a message (at most 10 MB, the upload limit of a
server without boosts), the caption as its text, the outbox chunk key as its nonce.
"""

from __future__ import annotations

import asyncio
import io
from collections.abc import Callable
from pathlib import Path

import aiohttp
import discord

from adapters.discord.sending import MESSAGE_LIMIT, NO_PINGS, nonce, refusals
from bumblebot.core.adapter import FileKind
from bumblebot.core.errors import MediaError
from bumblebot.core.events import Attachment, AttachmentKind, ChatRef
from bumblebot.core.regular import read_regular
from bumblebot.core.settings import DiscordSettings
from bumblebot.delivery.splitting import utf16_len
from bumblebot.media.documents import describe_size

#: The upload limit of a server without boosts (and of DMs), bytes.
UPLOAD_LIMIT = 10 * 1024 * 1024


def attachment(a: discord.Attachment, *, voice: bool) -> Attachment:
    """A Discord attachment as the engine takes it (by its URL)."""
    mime = (a.content_type or "").split(";")[0].strip().lower()
    if voice:
        kind = AttachmentKind.VOICE
    elif mime.startswith("image/") and mime != "image/svg+xml":
        kind = AttachmentKind.IMAGE
    elif mime.startswith("audio/"):
        kind = AttachmentKind.AUDIO
    else:
        kind = AttachmentKind.DOCUMENT
    return Attachment(
        kind, a.url, a.filename, mime or ("audio/ogg" if voice else ""), a.size, a.width, a.height, a.duration,
    )


class DiscordFiles:
    """Downloads of a message's files and uploads of the entity's.

    Mixed into :class:`~adapters.discord.adapter.DiscordAdapter`, which provides the attributes
    below; ``_channel`` comes from :class:`~adapters.discord.sending.DiscordSending`.
    """

    client: discord.Client
    settings: DiscordSettings
    _channel: Callable[[ChatRef], discord.PartialMessageable]

    async def download(self, attachment: Attachment, dest: Path) -> int:
        """The attachment from Discord's CDN (discord.py's own request), into ``dest``.

        Raises:
            MediaError: over ``discord.max_file_bytes``, gone (its signed URL expired or the
                message was deleted), or Discord unreachable (``retryable``).
        """
        limit = self.settings.max_file_bytes
        if attachment.size is not None and attachment.size > limit:
            raise MediaError(f"it is over the {describe_size(limit)} limit")
        try:
            data = await self.client.http.get_from_cdn(attachment.ref)
        except discord.HTTPException as exc:
            retryable = exc.status == 429 or exc.status >= 500
            raise MediaError(f"Discord would not hand it over (HTTP {exc.status})", retryable=retryable) from exc
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise MediaError("Discord could not be reached", retryable=True) from exc
        if len(data) > limit:
            raise MediaError(f"it is over the {describe_size(limit)} limit")
        await asyncio.to_thread(dest.write_bytes, data)
        return len(data)

    def max_upload_bytes(self, chat: ChatRef, kind: FileKind) -> int | None:
        return UPLOAD_LIMIT

    def caption_limit(self) -> int:
        return MESSAGE_LIMIT

    def caption_fits(self, text: str) -> bool:
        return utf16_len(text) <= MESSAGE_LIMIT

    async def send_file(
        self, chat: ChatRef, path: Path, *, kind: FileKind, caption: str, key: str, name: str = ""
    ) -> str:
        """One message with the file attached (and ``caption`` as its text), with ``key`` as
        its nonce."""
        data = await asyncio.to_thread(read_regular, path)  # a named pipe is refused, not waited on
        async with refusals():
            message = await self._channel(chat).send(
                content=caption or None, file=discord.File(io.BytesIO(data), filename=name or path.name),
                allowed_mentions=NO_PINGS, nonce=nonce(key),
            )
        return str(message.id)
