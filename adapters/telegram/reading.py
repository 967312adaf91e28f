"""What a Telegram message says: who wrote it, the forum topic it is in, what it really
replies to, its files, and what is not text, in words.

Plain reads of python-telegram-bot objects, shared by the intake and the command handlers.

Topics: only a message with ``is_topic_message`` names a forum topic (in a supergroup, or in
a private chat since Bot API 9.3). In a non-forum group ``message_thread_id`` only marks a
reply thread, and the General topic (id 1) of a group is the group itself. Files: a photo is
taken at the largest size within ``media.image_max_side_px`` and ``media.image_max_bytes``;
image documents are images, voice notes are voice, audio is audio, and videos, video notes
and other documents are documents. Stickers, locations, venues, contacts, polls and dice
become a short description.
"""

from __future__ import annotations

from datetime import timedelta

from telegram import Message, PhotoSize
from telegram.constants import ChatType

from bumblebot.core.events import Attachment, AttachmentKind
from bumblebot.core.settings import MediaSettings

#: The General topic of a forum: sent to without ``message_thread_id`` (Telegram refuses 1).
GENERAL_TOPIC_ID = 1


def seconds(value: float | timedelta) -> float:
    """A Bot API duration (a ``retry_after``, a recording's length) in seconds."""
    return value.total_seconds() if isinstance(value, timedelta) else float(value)


def topic_of(message: Message) -> str:
    """The forum topic a message is in (``""``: none, or the General topic)."""
    thread = message.message_thread_id
    if not message.is_topic_message or not thread:
        return ""  # outside forums the field marks a reply thread, not a topic
    if thread == GENERAL_TOPIC_ID and message.chat.type != ChatType.PRIVATE:
        return ""
    return str(thread)


def sender_of(message: Message) -> tuple[int, str, bool]:
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


def real_reply(message: Message) -> Message | None:
    """The message ``message`` replies to; in a forum topic every message "replies" to the
    topic's first message, which is not a reply."""
    replied = message.reply_to_message
    if replied is None:
        return None
    if message.is_topic_message and replied.message_id == message.message_thread_id:
        return None
    return replied


def shown(message: Message) -> str:
    """A message as a quote shows it: its text, or what it carried and its caption."""
    if message.text:
        return message.text
    what = (
        "(a photo)" if message.photo else "(a voice message)" if message.voice else
        "(a file)" if message.document or message.audio or message.video else ""
    )
    caption = message.caption or ""
    return " ".join(filter(None, (what, caption))) or describe(message)


def describe(message: Message) -> str:
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


def attachments_of(message: Message, media: MediaSettings) -> tuple[Attachment, ...]:
    """The files of ``message`` as references (their ``file_id``): a photo (one size,
    :func:`photo_size`), or its document, voice note, audio, video or video note."""
    if message.photo:
        size = photo_size(message.photo, media)
        return (Attachment(AttachmentKind.IMAGE, size.file_id, "photo.jpg", "image/jpeg", size.file_size,
                           size.width, size.height),)
    if message.voice is not None:
        v = message.voice
        return (Attachment(AttachmentKind.VOICE, v.file_id, "", v.mime_type or "audio/ogg", v.file_size,
                           duration_s=seconds(v.duration)),)
    if message.audio is not None:
        a = message.audio
        return (Attachment(AttachmentKind.AUDIO, a.file_id, a.file_name or "audio", a.mime_type or "", a.file_size,
                           duration_s=seconds(a.duration)),)
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
                           v.file_size, v.width, v.height, seconds(v.duration)),)
    if message.video_note is not None:
        n = message.video_note
        return (Attachment(AttachmentKind.DOCUMENT, n.file_id, "video-note.mp4", "video/mp4", n.file_size,
                           duration_s=seconds(n.duration)),)
    return ()


def photo_size(sizes: tuple[PhotoSize, ...], media: MediaSettings) -> PhotoSize:
    """The largest size of a photo within ``media.image_max_side_px`` and
    ``media.image_max_bytes`` (the smallest when none is)."""
    fits = [
        p for p in sizes
        if max(p.width, p.height) <= media.image_max_side_px and (p.file_size or 0) <= media.image_max_bytes
    ]
    if fits:
        return max(fits, key=lambda p: p.width * p.height)
    return min(sizes, key=lambda p: p.width * p.height)
