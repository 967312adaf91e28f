"""The wire between adapters and the engine: what comes in, and where it goes back.

An adapter turns a platform event into an :class:`Inbound` and hands it to
``Engine.submit``; the engine answers through the adapter's ``send``. The conversation key is
built here and nowhere else.
"""

from __future__ import annotations

import dataclasses
import re
import unicodedata
from dataclasses import dataclass
from enum import StrEnum

_SURROGATE = re.compile("[\ud800-\udfff]")
#: Unicode categories that show nothing on their own: controls, format characters (zero-width
#: space, joiners, direction marks, the BOM, soft hyphen), separators, lone surrogates.
_INVISIBLE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zs", "Zl", "Zp"})
#: Letters and symbols that render as blank: Hangul fillers, the blank Braille pattern, the
#: Mongolian vowel separator, the combining grapheme joiner (a favourite of "empty" messages).
_BLANK_CHARACTERS = frozenset("\u115f\u1160\u3164\uffa0\u2800\u180e\u034f")


def storable_text(text: str) -> str:
    """``text`` with lone UTF-16 surrogates replaced by U+FFFD: SQLite, and the UTF-8 of every
    request, refuse them (a model or a client may send ``"\\ud800"`` in its JSON)."""
    return _SURROGATE.sub("\ufffd", text) if _SURROGATE.search(text) else text


def blank(text: str) -> bool:
    """Whether ``text`` shows nothing: empty, whitespace, or only invisible characters
    (``"\u200b\u200d"``, a BOM, variation selectors, Hangul fillers). Such a message never
    becomes part of a history: endpoints that refuse blank text (Anthropic through OpenRouter)
    would then refuse every later request. Linear in ``len(text)`` and stops at the
    first visible character."""
    for ch in text:
        code = ord(ch)
        if ch in _BLANK_CHARACTERS or 0xFE00 <= code <= 0xFE0F or 0xE0100 <= code <= 0xE01EF:
            continue  # variation selectors
        if unicodedata.category(ch) not in _INVISIBLE_CATEGORIES:
            return False
    return True


class Platform(StrEnum):
    TELEGRAM = "telegram"
    DISCORD = "discord"
    CONSOLE = "console"


class ChatKind(StrEnum):
    PRIVATE = "private"
    GROUP = "group"


@dataclass(frozen=True, slots=True)
class ChatRef:
    """Where a conversation lives: platform, chat (or channel) id and thread/topic id.

    ``thread_id`` is ``""`` when the platform has no thread for this chat.
    """

    platform: Platform
    chat_id: str
    thread_id: str = ""

    @property
    def key(self) -> str:
        """``"platform:chat_id"`` or ``"platform:chat_id:thread_id"``: the conversation key."""
        base = f"{self.platform.value}:{self.chat_id}"
        return f"{base}:{self.thread_id}" if self.thread_id else base

    @classmethod
    def from_key(cls, key: str) -> ChatRef:
        """The chat of a conversation key (the inverse of :attr:`key`).

        Raises:
            ValueError: not a key of a known platform.
        """
        platform_name, _, rest = key.partition(":")
        platform = Platform(platform_name)
        # The terminal has no threads and its chat id is itself "local:<user>", so the whole
        # rest is the chat; Telegram and Discord chat ids are numbers, never holding a colon.
        chat_id, _, thread_id = (rest, "", "") if platform is Platform.CONSOLE else rest.partition(":")
        if not chat_id:
            raise ValueError(f"not a conversation key: {key!r}")
        return cls(platform, chat_id, thread_id)


class AttachmentKind(StrEnum):
    """What a file someone sent is to the engine."""

    IMAGE = "image"  # a photo, or an image sent as a file: the model sees it
    VOICE = "voice"  # a voice note: transcribed
    AUDIO = "audio"  # an audio file: transcribed
    DOCUMENT = "document"  # anything else: saved under <workspace>/inbox/


@dataclass(frozen=True, slots=True)
class Attachment:
    """A file that came with an inbound message, before it is downloaded.

    Args:
        kind: how the engine treats it.
        ref: the platform's handle to fetch it with (Telegram: the ``file_id``; Discord: the
            attachment URL); only the adapter that made it understands it.
        name: the file name as sent (untrusted; sanitised before it names a file), or ``""``.
        mime: the MIME type the platform or the sender claims (a hint, not trusted).
        size: bytes, when the platform says (``None``: unknown).
        width: pixels, for images when known.
        height: pixels, for images when known.
        duration_s: seconds, for voice notes and audio when known.
    """

    kind: AttachmentKind
    ref: str
    name: str = ""
    mime: str = ""
    size: int | None = None
    width: int | None = None
    height: int | None = None
    duration_s: float | None = None

    def to_json(self) -> dict[str, object]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v not in (None, "")}

    @classmethod
    def from_json(cls, data: dict[str, object]) -> Attachment:
        return cls(
            kind=AttachmentKind(str(data["kind"])), ref=str(data["ref"]), name=str(data.get("name", "")),
            mime=str(data.get("mime", "")), size=_int(data.get("size")), width=_int(data.get("width")),
            height=_int(data.get("height")),
            duration_s=None if data.get("duration_s") is None else float(data["duration_s"]),  # type: ignore[arg-type]
        )


def _int(value: object) -> int | None:
    return None if value is None else int(value)  # type: ignore[call-overload]


@dataclass(frozen=True, slots=True)
class Inbound:
    """One accepted inbound message.

    Args:
        chat: the conversation it belongs to.
        message_id: the platform's message id (unique within the chat); the dedupe key.
        sender_id: the platform's user id of the author.
        sender_name: a readable name of the author (for group chats and the turn context).
        text: what the person wrote, with platform markup (mentions) already made readable.
        chat_kind: private (DM) or group (guild channel, group chat).
        source: ``"chat"`` for a person; ``"automation"`` / ``"autonomous"`` for scheduled input.
        update_id: Telegram's update id, when there is one.
        quote: the message this one replies to, as ``"Name: text"`` (shortened), or ``""``.
        background: in a group, how many earlier messages not addressed to the bot the turn
            answering this one may see as background (``telegram.group_context``); ``0``: none.
        attachments: files that came with it (photos, voice notes, documents), not yet
            downloaded; ``text`` is then the caption (maybe ``""``).
        album: the platform's id of the group of messages this one was sent in (a Telegram
            album's ``media_group_id``): its parts are answered in one turn. Not journaled.
        paste_part: the message is as long as its platform allows, or nearly: a part of a long
            paste its client cut (the adapter knows its platform's limit). The turn waits a
            little longer for the next part, and the parts are joined as one text. Not journaled.
        chat_title: the chat's name as its platform shows it (a group's title, the person of a
            private chat, ``#channel in guild``), ``""`` when unknown. Not journaled: the
            engine keeps it as the conversation's title.
    """

    chat: ChatRef
    message_id: str
    sender_id: str
    sender_name: str
    text: str
    chat_kind: ChatKind = ChatKind.PRIVATE
    source: str = "chat"
    update_id: int | None = None
    quote: str = ""
    background: int = 0
    attachments: tuple[Attachment, ...] = ()
    album: str = ""
    paste_part: bool = False
    chat_title: str = ""

    @property
    def speaker(self) -> str:
        """The sender's name as one short line without brackets, safe to put in the model's
        input (a user-chosen name must not forge a ``[Turn context]`` or ``[Name]:`` line)."""
        cleaned = " ".join(self.sender_name.replace("[", "(").replace("]", ")").split())
        return cleaned[:64] or "?"

    @property
    def shown_text(self) -> str:
        """The text, after what came with it (``"(a photo) my new bike"``, ``"(a voice
        message)"``): how the message reads where its files are not shown (group background)."""
        if not self.attachments:
            return self.text
        kind = self.attachments[0].kind
        what = {AttachmentKind.IMAGE: "(a photo)", AttachmentKind.VOICE: "(a voice message)",
                AttachmentKind.AUDIO: "(an audio file)"}.get(kind, f"(a file: {self.attachments[0].name or 'unnamed'})")
        return f"{what} {self.text}" if self.text else what

    def storable(self) -> Inbound:
        """This message with lone UTF-16 surrogates (which SQLite and JSON encoders refuse,
        e.g. from a broken client or a terminal's bad byte) replaced by U+FFFD, in its texts and
        in its files' names and types."""
        files = tuple(
            dataclasses.replace(a, name=storable_text(a.name), mime=storable_text(a.mime)) for a in self.attachments
        )
        values = (self.text, self.sender_name, self.quote, self.message_id, self.sender_id)
        if not any(_SURROGATE.search(value) for value in values) and files == self.attachments:
            return self
        return dataclasses.replace(
            self, text=storable_text(self.text), sender_name=storable_text(self.sender_name), quote=storable_text(self.quote),
            message_id=storable_text(self.message_id), sender_id=storable_text(self.sender_id), attachments=files,
        )
