"""Replies on Discord: the message a message replies to, and the quote the model sees of it.

A reply (``message.reference``, not a forward) carries what it replies to in
``Inbound.quote`` as Telegram's do (``"you: …"`` or ``"Name: text"``, at most
:data:`QUOTE_CHARS`; :data:`DELETED_QUOTE` for a deleted one, :func:`quote`). The replied-to
message is looked up once per message (:class:`Replied`): the gate needs it too, to tell a
reply to the bot.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import aiohttp
import discord

from adapters.discord.files import attachment
from adapters.discord.mentions import MentionNames, readable_text
from bumblebot.core.events import AttachmentKind

log = logging.getLogger(__name__)

#: Seconds a look-up of a replied-to message may take before it counts as "not the bot's".
REFERENCE_FETCH_TIMEOUT_S = 5.0
#: The quoted text of a reply is shortened to this many characters (as on Telegram).
QUOTE_CHARS = 200
#: ``Inbound.quote`` of a reply to a message that was deleted meanwhile.
DELETED_QUOTE = "a deleted message"


class Replied:
    """The message a message replies to, looked up at most once: the gateway payload's
    ``referenced_message``, then discord.py's cache, then one ``fetch_message`` bounded by
    :data:`REFERENCE_FETCH_TIMEOUT_S`. A forward (reference type ``forward``) is no reply.

    Attributes:
        is_reply: the message replies to another one.
        deleted: after :meth:`get`, the replied-to message is known to be deleted.
    """

    __slots__ = ("_found", "_looked_up", "_message", "deleted", "is_reply")

    def __init__(self, message: discord.Message) -> None:
        self._message = message
        reference = message.reference
        self.is_reply = (
            reference is not None
            and reference.message_id is not None
            and reference.type is not discord.MessageReferenceType.forward
        )
        self.deleted = False
        self._looked_up = False
        self._found: discord.Message | None = None

    async def get(self) -> discord.Message | None:
        """The replied-to message, or ``None`` (no reply, deleted, or not to be had)."""
        if not self._looked_up:
            self._looked_up = True
            self._found = await self._look_up()
        return self._found

    async def _look_up(self) -> discord.Message | None:
        reference = self._message.reference
        if not self.is_reply or reference is None or reference.message_id is None:
            return None
        if isinstance(reference.resolved, discord.Message):
            return reference.resolved
        if isinstance(reference.resolved, discord.DeletedReferencedMessage):
            self.deleted = True
            return None
        if reference.cached_message is not None:
            return reference.cached_message
        try:
            async with asyncio.timeout(REFERENCE_FETCH_TIMEOUT_S):
                return await self._message.channel.fetch_message(reference.message_id)
        except discord.NotFound:
            self.deleted = True
        except (discord.HTTPException, aiohttp.ClientError, OSError, TimeoutError) as exc:
            log.debug("Discord: cannot look up replied-to message %s: %s", reference.message_id, exc)
        return None


async def quote(replied: Replied, bot_id: int, names: Callable[[discord.Message], MentionNames]) -> str:
    """``Inbound.quote`` of a reply, as Telegram's: ``"you: …"`` for the bot's own message,
    ``"<display name>: <text>"`` otherwise, whitespace collapsed, shortened to
    :data:`QUOTE_CHARS` with "…", files described as on Telegram ("(a photo) caption").
    :data:`DELETED_QUOTE` when the replied-to message was deleted; ``""`` for no reply, a
    forward, or a message that could not be looked up (the model then sees the text
    alone, as before). ``names``: the mention names of a message, to make its text readable."""
    if not replied.is_reply:
        return ""
    found = await replied.get()
    if found is None:
        return DELETED_QUOTE if replied.deleted else ""
    author = "you" if found.author.id == bot_id else found.author.display_name
    text = " ".join(shown(found, readable_text(found.content, names(found))).split())
    if len(text) > QUOTE_CHARS:
        text = text[: QUOTE_CHARS - 1] + "…"
    return f"{author}: {text}"


def shown(message: discord.Message, text: str) -> str:
    """A message as a quote shows it: what it carried ("(a photo)", "(a voice message)", "(a
    file)", a sticker), then ``text`` (its readable content); an embed's title or description
    for a message with nothing else (another bot's card)."""
    what = ""
    if message.attachments:
        kind = attachment(message.attachments[0], voice=message.flags.voice).kind
        what = {AttachmentKind.IMAGE: "(a photo)", AttachmentKind.VOICE: "(a voice message)"}.get(kind, "(a file)")
    elif message.stickers:
        what = f"[Sticker: {message.stickers[0].name}]"
    shown = " ".join(filter(None, (what, text)))
    if not shown and message.embeds:
        embed = message.embeds[0]
        shown = embed.title or embed.description or ""
    return shown or "(a message that is not text)"
