"""The model's Markdown as Telegram messages: plain text plus formatting entities.

A Telegram message is at most 4096 characters, counted here in UTF-16 code units (the
conservative bound). The model's Markdown is converted into plain text plus ``MessageEntity``
objects (:func:`render_chunks`) and sent without a ``parse_mode``, so no reply can fail with
"can't parse entities". A streamed preview is the text as it is, cut to the limit
(:func:`preview_text`).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import telegramify_markdown
from telegram import MessageEntity

from bumblebot.delivery.splitting import split_text, utf16_len

log = logging.getLogger(__name__)

#: Telegram Bot API, sendMessage: 1-4096 characters of text after entity parsing (counted here
#: in UTF-16 code units, the conservative bound).
MESSAGE_LIMIT = 4096
#: A message this long (UTF-16 units) is probably a part of a long paste the Telegram client cut
#: at its limit: the engine waits a little longer for the next part and joins them.
PASTE_PART_UNITS = 3900


@dataclass(frozen=True, slots=True)
class TelegramChunk:
    """One message as Telegram takes it: plain text plus formatting entities (UTF-16 offsets)."""

    text: str
    entities: tuple[MessageEntity, ...] = ()


def paste_part(text: str) -> bool:
    """Whether ``text`` is long enough to be a part of a long paste (:data:`PASTE_PART_UNITS`)."""
    return len(text) >= PASTE_PART_UNITS // 2 and utf16_len(text) >= PASTE_PART_UNITS


def render_chunks(markdown: str, limit: int = MESSAGE_LIMIT) -> list[TelegramChunk]:
    """The model's Markdown as Telegram messages of at most ``limit`` UTF-16 units.

    ``telegramify-markdown`` turns Markdown into plain text plus ``MessageEntity`` objects, so
    no ``parse_mode`` is needed and no reply can fail with "can't parse entities"
    (Telegram answers "can't parse entities" to a reply with a stray ``*``); its splitter cuts at newlines and clips entities that span
    a cut. Whitespace at the end of a chunk is dropped (Telegram trims it anyway). If the
    conversion fails, the text is sent as it is, split by :func:`bumblebot.delivery.splitting.split_text`.
    """
    # CommonMark decodes character references (``&amp;`` becomes ``&``) and reads ``<…>`` as
    # raw HTML, which the converter drops (``List<String>`` became ``List``), but the model's
    # text must arrive as written: each ``&``, and each ``<`` that opens no autolink or comment,
    # goes through the converter as a private-use character no text holds (one UTF-16 unit
    # each, so entity offsets stay right) and comes back
    try:
        amp = _unused_character(markdown)
        lt = _unused_character(markdown + amp)
        plain, entities = telegramify_markdown.convert(_LITERAL_LT.sub(lt, markdown.replace("&", amp)))
        plain = plain.replace(amp, "&").replace(lt, "<")
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
                    url=e.url.replace(amp, "&").replace(lt, "<") if e.url else e.url, language=e.language,
                    custom_emoji_id=e.custom_emoji_id,
                )
            )
        out.append(TelegramChunk(text, tuple(kept)))
    return out


#: A ``<`` that Markdown reads as something other than raw HTML is kept: escaped (``\<``), a
#: link's destination (``[a](<url with spaces>)``), a CommonMark autolink (``<https://…>``,
#: ``<bob@example.com>``), or a closed HTML comment (``<!-- … -->``, the one piece of HTML
#: meant to show nothing; an unclosed ``<!--`` would hide everything after it).
_LITERAL_LT = re.compile(
    r"(?<!\\)(?<!\]\()<(?![A-Za-z][A-Za-z0-9+.-]{1,31}:[^\s<>]*>"
    r"|[A-Za-z0-9.!#$%&'*+/=?^_`{|}~-]+@[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*>"
    r"|!--[\s\S]*?-->)"
)


def _unused_character(text: str) -> str:
    """A character of Unicode's private-use area that ``text`` does not hold."""
    for code in range(0xE000, 0xF900):
        if chr(code) not in text:
            return chr(code)
    raise ValueError("text holds every private-use character")  # 6,400 distinct ones: not a chat message


def preview_text(text: str) -> str:
    """A streamed text as one plain message: cut to Telegram's limit (UTF-16 units)."""
    text = text.strip() or "…"
    if utf16_len(text) <= MESSAGE_LIMIT:
        return text
    cut = MESSAGE_LIMIT - 1
    while utf16_len(text[:cut]) > MESSAGE_LIMIT - 1:
        cut -= max(1, (utf16_len(text[:cut]) - MESSAGE_LIMIT + 1) // 2)
    return text[:cut] + "…"
