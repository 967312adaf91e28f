"""A fake Telegram Bot API server for tests (aiohttp on 127.0.0.1, port 0).

Point python-telegram-bot at it with ``base_url=tg.base_url`` and
``base_file_url=tg.base_file_url``; PTB appends the token (``/bot<token>/<method>``).
Request decoding and response shapes follow the Bot API documentation ("Making requests"): form
fields carry JSON for non-string values; responses are ``{"ok": true, "result": ...}``.

Usage::

    async with FakeTelegram() as tg:
        tg.push_text("/start")
        ... run the bot ...
        calls = await tg.wait_for("sendMessage")
        assert tg.sent(chat_id=1001) == ["hello"]

Files (Bot API "getFile" and the file download URL ``/file/bot<token>/<file_path>``, which PTB
builds as ``base_file_url + token + "/" + file_path``):

- ``add_file(data, *, file_path=None, file_size=None) -> file_id`` registers bytes;
  ``getFile {file_id}`` answers a File ``{file_id, file_unique_id, file_size, file_path}``,
  400 "Bad Request: file is too big" when the registered size is over 20 MB
  (:data:`MAX_DOWNLOAD_SIZE`), 400 "Bad Request: invalid file_id" for unknown ids. A GET of
  the download URL serves the bytes (404 for unknown paths). ``get_file_calls`` (file ids,
  every getFile received) and ``downloads`` (file paths served) record them; ``files`` maps
  file_id -> :class:`StoredFile`. ``fail_next("download", status, body)`` fails a download.
- Incoming media (each returns the update; the keyword ``sender`` arguments are push_text's
  ``chat_id``, ``user_id``, ``chat_type``, ``first_name``, ``username``, ``message_id``,
  ``reply_to``, ``thread_id``, ``is_forum``, ``is_bot``, ``quote``, plus ``media_group_id``;
  captions get ``caption_entities`` computed like push_text's entities, plus any given):
  ``push_photo(sizes=[(w, h, bytes), ...], caption=None, ...)`` (PhotoSizes small to large),
  ``push_document(data, file_name, mime_type, caption=None, file_size=None, ...)``
  (``file_size`` overrides the reported and registered size), ``push_voice(data,
  duration=3, mime_type="audio/ogg", caption=None, ...)``, ``push_audio(data,
  file_name="song.mp3", mime_type="audio/mpeg", duration=10, caption=None, ...)``,
  ``push_video(data, file_name="clip.mp4", mime_type="video/mp4", duration=5, width=640,
  height=360, caption=None, ...)``, ``push_sticker(emoji="😀", set_name="Pack", ...)``,
  ``push_location(latitude, longitude, ...)``, ``push_contact(phone_number, first_name,
  last_name=None, ...)`` (the sender's name is ``sender_name``) and ``push_poll(question,
  options, ...)``.
- Uploads: ``sendPhoto``/``sendDocument``/``sendVoice``/``sendAudio``/``sendVideo`` take a
  multipart file part named after the method's field (or a known file_id string) and answer
  a Message with ``photo`` sizes / ``document`` / ``voice`` / ``audio`` / ``video`` and the
  ``caption``. Every one received (failed ones too) is appended to ``files_sent`` as a dict
  ``{method, chat_id, filename, data, caption, mime, message_thread_id, file_id, status,
  message_id}`` (``file_id`` set when a file was re-sent by id; ``status`` is the HTTP status
  answered, ``message_id`` the created message's id or None). ``fail_next`` works for them as
  for any method. Rules mimicked: caption at most 1024 characters, photo bytes must be an
  image (PNG/JPEG/GIF/WebP/BMP; else "IMAGE_PROCESS_FAILED"), photos at most 10 MB and other
  files at most 50 MB (413). ``editMessageCaption`` edits a caption; ``editMessageText`` on
  a message without text answers "there is no text in the message to edit".
  ``shown(chat_id)`` shows a message's text, else its caption, else "".
- Edits: ``push_edit(chat_id, message_id, text=None, *, caption=None)`` pushes an
  ``edited_message`` update of a pushed message (Bot API "Update").
- Raw updates: ``push_raw_update(update_id, text)`` queues an update given as its JSON text
  (served as it is: one nested deeper than ``json.dumps`` goes, or one no client can read).
"""

from __future__ import annotations

import contextlib
import asyncio
import functools
import html
import itertools
import json
import mimetypes
import re
import secrets
import struct
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, TypedDict

from aiohttp import web
from typing_extensions import Unpack

BOT_USER = {"id": 4242, "is_bot": True, "first_name": "FakeBot", "username": "fake_bot"}
GET_ME = {**BOT_USER, "can_join_groups": True, "can_read_all_group_messages": False,
          "supports_inline_queries": False}
MAX_TEXT_UTF16 = 4096  # Bot API sendMessage: "1-4096 characters after entities parsing"
_COMMAND_NAME = re.compile(r"[a-z0-9_]{1,32}")  # Bot API BotCommand.command
# Fields the Bot API types as String: PTB sends them raw, so "42" must stay a string.
_STRING_FIELDS = frozenset({"text", "caption", "parse_mode", "action", "title", "description",
                            "short_description", "name", "language_code", "emoji", "url",
                            "performer", "file_id"})
MAX_CAPTION_UTF16 = 1024  # Bot API: "0-1024 characters after entities parsing"
MAX_DOWNLOAD_SIZE = 20 * 1024 * 1024  # getFile: "bots can download files of up to 20MB in size"
MAX_UPLOAD_SIZE = 50 * 1024 * 1024  # multipart uploads: 50 MB for other files
MAX_PHOTO_UPLOAD = 10 * 1024 * 1024  # sendPhoto: "The photo must be at most 10 MB in size"
# upload method -> the field holding the file (and the Message field of the answer)
UPLOAD_FIELDS = {"sendPhoto": "photo", "sendDocument": "document", "sendVoice": "voice",
                 "sendAudio": "audio", "sendVideo": "video"}
DOWNLOAD = "download"  # pseudo-method for fail_next: the file download URL
# kind -> (file_id prefix as Telegram's, file_path folder, default extension)
_FILE_KINDS = {"photo": ("AgAC", "photos", ".jpg"), "document": ("BQAC", "documents", ""),
               "voice": ("AwAC", "voice", ".oga"), "audio": ("CQAC", "music", ".mp3"),
               "video": ("BAAC", "videos", ".mp4"), "sticker": ("CAAC", "stickers", ".webp")}
_PHOTO_BOXES = (90, 320, 800)  # Telegram's s/m/x thumbnails below the largest (y, 1280)
_file_counter = itertools.count()


@dataclass
class RawUpdate:
    """An update queued as JSON text (:meth:`FakeTelegram.push_raw_update`); it answers
    ``update["update_id"]`` and ``kind in update`` like an update dict."""

    update_id: int
    text: str
    kind: str = "message"

    def __getitem__(self, key: str) -> int:
        if key != "update_id":
            raise KeyError(key)
        return self.update_id

    def __contains__(self, key: object) -> bool:
        return key in ("update_id", self.kind)


class Call(NamedTuple):
    """One API call: ``method``, decoded ``params``, ``content_type``, monotonic ``time`` (s)."""

    method: str
    params: dict[str, Any]
    content_type: str
    time: float


class UploadedFile(NamedTuple):
    """A multipart file part as decoded by the fake: name, bytes and the part's content type."""

    filename: str | None
    data: bytes
    content_type: str


@dataclass
class StoredFile:
    """A file in the fake's registry (what getFile and the download URL serve)."""

    file_id: str
    file_unique_id: str
    data: bytes
    file_path: str
    file_size: int
    file_name: str | None = None
    mime_type: str | None = None
    width: int | None = None  # photos
    height: int | None = None


class Sender(TypedDict, total=False):
    """Keyword arguments every push_* shares with push_text: who sends where."""

    chat_id: int
    user_id: int | None
    chat_type: str
    first_name: str
    username: str | None
    message_id: int | None
    reply_to: int | None
    thread_id: int | None
    is_forum: bool
    is_bot: bool
    quote: str | None
    media_group_id: str | None


def utf16_len(text: str) -> int:
    """Length in UTF-16 code units, the unit of Telegram's limits and entity offsets."""
    return len(text.encode("utf-16-le")) // 2


def retry_after_body(seconds: int) -> dict[str, Any]:
    """Body of Telegram's flood-control error (send with status 429 → PTB ``RetryAfter``)."""
    return {"ok": False, "error_code": 429,
            "description": f"Too Many Requests: retry after {seconds}",
            "parameters": {"retry_after": seconds}}


def bad_request_body(description: str) -> dict[str, Any]:
    """Body of a 400 error (→ PTB ``BadRequest``); adds the ``Bad Request: `` prefix."""
    if not description.startswith("Bad Request: "):
        description = f"Bad Request: {description}"
    return {"ok": False, "error_code": 400, "description": description}


def visible_text(text: str, parse_mode: str | None) -> str:
    """Approximate the text left after Telegram parses ``parse_mode`` markup (for limits only)."""
    if parse_mode and parse_mode.upper() == "HTML":
        return html.unescape(re.sub(r"<[^>]*>", "", text))
    if parse_mode and parse_mode.lower().startswith("markdown"):
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
        return re.sub(r"\\(.)|[*_~`|]", lambda m: m.group(1) or "", text)
    return text


class FakeTelegram:
    """Fake Bot API; see the module docstring for usage and the methods it serves."""

    def __init__(self, token: str = "123:TEST") -> None:
        self.token = token
        self.calls: list[Call] = []
        self.updates: list[dict[str, Any]] = []  # pending (unconfirmed) updates
        # (chat id, message id) -> Message, for pushed and sent messages
        self.messages: dict[tuple[int, int], dict[str, Any]] = {}
        self.commands: dict[str, list[dict[str, Any]]] = {}  # scope key -> BotCommand list
        self.confirmed_offset = 0
        self.allowed_updates: list[str] | None = None  # getUpdates' last non-empty allowed_updates
        self.next_update_id = 1
        self.base_url = self.base_file_url = ""
        self._next_message_id = 1
        self._chats: dict[int, dict[str, Any]] = {}
        self.get_me = dict(GET_ME)  # getMe's answer (e.g. can_read_all_group_messages)
        self.member_status: dict[tuple[int, int], str] = {}  # (chat, user) -> getChatMember status
        self.migrated: dict[int, int] = {}  # old group id -> supergroup id (sends to it fail)
        self._failures: dict[str, deque[tuple[int, dict[str, Any]]]] = {}
        self._called = asyncio.Condition()
        self._pushed = asyncio.Event()  # set on push; a sync push cannot hold a Condition's lock
        self._closing = False
        self._runner: web.AppRunner | None = None
        self._handlers: dict[str, Callable[[dict[str, Any]], Any]] = {
            "getMe": lambda p: self.get_me, "deleteWebhook": self._delete_webhook, "setWebhook": self._set_webhook,
            "getChatMember": self._get_chat_member,
            "sendChatAction": lambda p: True, "close": lambda p: True, "logOut": lambda p: True,
            "sendMessage": self._send_message, "editMessageText": self._edit_message_text,
            "deleteMessage": self._delete_message, "setMyCommands": self._set_my_commands,
            "getMyCommands": lambda p: self.commands.get(_scope_key(p), []),
            "deleteMyCommands": self._delete_my_commands,
            "answerCallbackQuery": self._answer_callback_query,
        }
        self.callback_answers: list[dict[str, Any]] = []  # answerCallbackQuery params
        #: setWebhook's last parameters while a webhook is set (``None``: updates are polled)
        self.webhook: dict[str, Any] | None = None
        #: where the webhook's POSTs really go, in turn (a test's workers behind the public
        #: URL, as a proxy would spread them); empty: the URL itself
        self.webhook_targets: list[str] = []
        #: each webhook POST: (target, update id, the answer's status or the error's name)
        self.webhook_posts: list[tuple[str, int, str]] = []
        self._webhook_task: asyncio.Task[None] | None = None
        self.files: dict[str, StoredFile] = {}  # file_id -> registered file
        self._files_by_path: dict[str, StoredFile] = {}
        self.get_file_calls: list[str] = []  # file ids of every getFile received
        self.downloads: list[str] = []  # file paths served by the download URL
        self.files_sent: list[dict[str, Any]] = []  # every upload call (module docstring)
        self._handlers["getFile"] = self._get_file
        self._handlers["editMessageCaption"] = self._edit_message_caption
        for method, field in UPLOAD_FIELDS.items():
            self._handlers[method] = functools.partial(self._send_media, field)

    # ---- test API -------------------------------------------------------------------------
    def push_update(self, update: dict[str, Any]) -> None:
        """Queue ``update`` as is (so the same update can be pushed twice) and wake long polls."""
        self.updates.append(update)
        self.next_update_id = max(self.next_update_id, int(update["update_id"]) + 1)
        self._pushed.set()

    def push_raw_update(self, update_id: int, text: str, kind: str = "message") -> RawUpdate:
        """Queue an update given as its JSON text (``kind``: its field, e.g. ``message``),
        served byte for byte inside getUpdates' answer."""
        update = RawUpdate(update_id, text, kind)
        self.push_update(update)  # type: ignore[arg-type]
        return update

    def push_text(self, text: str, chat_id: int = 1001, user_id: int | None = None,
                  chat_type: str = "private", first_name: str = "Alice",
                  username: str | None = "alice", message_id: int | None = None,
                  reply_to: int | None = None, thread_id: int | None = None,
                  is_forum: bool = False, is_bot: bool = False,
                  entities: list[dict[str, Any]] | None = None,
                  quote: str | None = None) -> dict[str, Any]:
        """Push a text message from a user; return the update. A leading ``/word`` gets a
        ``bot_command`` entity and ``@name`` words get ``mention`` entities (UTF-16 offsets);
        ``entities`` adds more (e.g. a ``text_mention``).

        Groups: ``chat_type`` ``"group"`` or ``"supergroup"`` (``is_forum`` for topics). In a
        forum, ``thread_id`` names the topic (``is_topic_message``, and the message "replies"
        to the topic's first message, as Telegram does); ``None`` is the General topic. Outside
        forums ``thread_id`` is a reply thread (no ``is_topic_message``). ``quote``: the part
        of the replied-to message the user quoted."""
        message = self._user_message(
            chat_id=chat_id, user_id=user_id, chat_type=chat_type, first_name=first_name,
            username=username, message_id=message_id, reply_to=reply_to, thread_id=thread_id,
            is_forum=is_forum, is_bot=is_bot, quote=quote)
        message["text"] = text
        found = _auto_entities(text) + (entities or [])
        if found:
            message["entities"] = found
        return self._push_message(message)

    def _user_message(self, chat_id: int = 1001, user_id: int | None = None,
                      chat_type: str = "private", first_name: str = "Alice",
                      username: str | None = "alice", message_id: int | None = None,
                      reply_to: int | None = None, thread_id: int | None = None,
                      is_forum: bool = False, is_bot: bool = False, quote: str | None = None,
                      media_group_id: str | None = None) -> dict[str, Any]:
        """A Message from a user without its content (text, photo, ...): chat, sender,
        topic, reply and quote as push_text documents."""
        user = {"id": chat_id if user_id is None else user_id, "is_bot": is_bot,
                "first_name": first_name, **({"username": username} if username else {})}
        chat: dict[str, Any] = {"id": chat_id, "type": chat_type}
        chat.update({"first_name": first_name, **({"username": username} if username else {})}
                    if chat_type == "private" else {"title": "Test Group"})
        if is_forum:
            chat["is_forum"] = True
        self._chats[chat_id] = chat
        message: dict[str, Any] = {
            "message_id": message_id or self._new_message_id(), "date": int(time.time()),
            "chat": chat, "from": user}
        if thread_id is not None:
            message["message_thread_id"] = thread_id
            if is_forum or chat_type == "private":
                message["is_topic_message"] = True
                if reply_to is None:  # Telegram: a topic's messages reply to its first message
                    message["reply_to_message"] = {
                        "message_id": thread_id, "date": message["date"], "chat": chat,
                        "from": user, "forum_topic_created": {"name": "Topic", "icon_color": 7322096}}
        if reply_to is not None:
            stub = {"message_id": reply_to, "date": message["date"], "chat": chat}
            message["reply_to_message"] = self.messages.get((chat_id, reply_to), stub)
        if quote is not None:
            message["quote"] = {"text": quote, "position": 0}
        if media_group_id is not None:
            message["media_group_id"] = media_group_id
        return message

    def _push_message(self, message: dict[str, Any]) -> dict[str, Any]:
        self.messages[(message["chat"]["id"], message["message_id"])] = message
        update = {"update_id": self.next_update_id, "message": message}
        self.push_update(update)
        return update

    def _media_message(self, sender: Sender, caption: str | None,
                       caption_entities: list[dict[str, Any]] | None) -> dict[str, Any]:
        message = self._user_message(**sender)
        if caption is not None:
            message["caption"] = caption
            found = _auto_entities(caption) + (caption_entities or [])
            if found:
                message["caption_entities"] = found
        return message

    # ---- files ------------------------------------------------------------------------------
    def add_file(self, data: bytes, *, file_path: str | None = None,
                 file_size: int | None = None) -> str:
        """Register ``data`` as a file; return its file_id. ``file_path`` defaults to
        ``documents/file_<n>``; ``file_size`` overrides the size getFile reports and checks
        against the 20 MB download limit (e.g. to claim 30 MB without storing them)."""
        return self._register(data, "document", file_path=file_path, file_size=file_size).file_id

    def _register(self, data: bytes, kind: str, *, file_path: str | None = None,
                  file_size: int | None = None, file_name: str | None = None,
                  mime_type: str | None = None, width: int | None = None,
                  height: int | None = None) -> StoredFile:
        prefix, folder, ext = _FILE_KINDS[kind]
        n = next(_file_counter)
        if file_path is None:
            guessed = (mimetypes.guess_extension(mime_type) if mime_type else None) or ""
            if file_name and "." in file_name:
                guessed = "." + file_name.rsplit(".", 1)[1]
            file_path = f"{folder}/file_{n}{ext or guessed}"
        stored = StoredFile(
            file_id=f"{prefix}AgAD{n:06d}" + secrets.token_urlsafe(33),
            file_unique_id=f"AQAD{n:05d}" + secrets.token_urlsafe(6),
            data=bytes(data), file_path=file_path,
            file_size=len(data) if file_size is None else int(file_size),
            file_name=file_name, mime_type=mime_type, width=width, height=height)
        self.files[stored.file_id] = stored
        self._files_by_path[stored.file_path] = stored
        return stored

    @staticmethod
    def _file_object(stored: StoredFile, **fields: Any) -> dict[str, Any]:
        return {"file_id": stored.file_id, "file_unique_id": stored.file_unique_id,
                **fields, "file_size": stored.file_size}

    def push_photo(self, sizes: list[tuple[int, int, bytes]], caption: str | None = None, *,
                   caption_entities: list[dict[str, Any]] | None = None,
                   **sender: Unpack[Sender]) -> dict[str, Any]:
        """Push a photo: ``sizes`` are ``(width, height, bytes)``, each registered as its own
        file; the Message's ``photo`` lists them small to large, as Telegram does."""
        message = self._media_message(sender, caption, caption_entities)
        message["photo"] = [
            self._file_object(self._register(data, "photo", width=w, height=h), width=w, height=h)
            for w, h, data in sorted(sizes, key=lambda s: s[0] * s[1])]
        return self._push_message(message)

    def push_document(self, data: bytes, file_name: str, mime_type: str,
                      caption: str | None = None, file_size: int | None = None, *,
                      caption_entities: list[dict[str, Any]] | None = None,
                      **sender: Unpack[Sender]) -> dict[str, Any]:
        """Push a document (a file sent as a file). ``file_size`` overrides the reported size
        (over 20 MB, getFile answers "file is too big")."""
        message = self._media_message(sender, caption, caption_entities)
        stored = self._register(data, "document", file_size=file_size, file_name=file_name,
                                mime_type=mime_type)
        message["document"] = self._file_object(stored, file_name=file_name, mime_type=mime_type)
        return self._push_message(message)

    def push_voice(self, data: bytes, duration: int = 3, mime_type: str = "audio/ogg",
                   caption: str | None = None, *, file_size: int | None = None,
                   caption_entities: list[dict[str, Any]] | None = None,
                   **sender: Unpack[Sender]) -> dict[str, Any]:
        """Push a voice note (``voice``: duration in seconds, OGG/Opus by default)."""
        message = self._media_message(sender, caption, caption_entities)
        stored = self._register(data, "voice", file_size=file_size, mime_type=mime_type)
        message["voice"] = self._file_object(stored, duration=duration, mime_type=mime_type)
        return self._push_message(message)

    def push_audio(self, data: bytes, file_name: str = "song.mp3", mime_type: str = "audio/mpeg",
                   duration: int = 10, caption: str | None = None, *,
                   performer: str | None = None, title: str | None = None,
                   file_size: int | None = None,
                   caption_entities: list[dict[str, Any]] | None = None,
                   **sender: Unpack[Sender]) -> dict[str, Any]:
        """Push an audio file (music: ``audio`` with duration, file name and MIME type)."""
        message = self._media_message(sender, caption, caption_entities)
        stored = self._register(data, "audio", file_size=file_size, file_name=file_name,
                                mime_type=mime_type)
        extra = {k: v for k, v in (("performer", performer), ("title", title)) if v is not None}
        message["audio"] = self._file_object(stored, duration=duration, file_name=file_name,
                                             mime_type=mime_type, **extra)
        return self._push_message(message)

    def push_video(self, data: bytes, file_name: str = "clip.mp4", mime_type: str = "video/mp4",
                   duration: int = 5, width: int = 640, height: int = 360,
                   caption: str | None = None, *, file_size: int | None = None,
                   caption_entities: list[dict[str, Any]] | None = None,
                   **sender: Unpack[Sender]) -> dict[str, Any]:
        """Push a video (``video`` with size, duration, file name and MIME type)."""
        message = self._media_message(sender, caption, caption_entities)
        stored = self._register(data, "video", file_size=file_size, file_name=file_name,
                                mime_type=mime_type)
        message["video"] = self._file_object(stored, width=width, height=height,
                                             duration=duration, file_name=file_name,
                                             mime_type=mime_type)
        return self._push_message(message)

    def push_sticker(self, emoji: str = "😀", set_name: str = "Pack", *,
                     data: bytes = b"RIFF\x1a\x00\x00\x00WEBPVP8L\x0d\x00\x00\x00/\xff\xc1?\x00",
                     width: int = 512, height: int = 512, is_animated: bool = False,
                     is_video: bool = False, **sender: Unpack[Sender]) -> dict[str, Any]:
        """Push a regular sticker (a Sticker object; its file is registered for getFile)."""
        message = self._user_message(**sender)
        ext = ".tgs" if is_animated else ".webm" if is_video else ".webp"
        stored = self._register(data, "sticker")
        if not stored.file_path.endswith(ext):
            del self._files_by_path[stored.file_path]
            stored.file_path = stored.file_path.rsplit(".", 1)[0] + ext
            self._files_by_path[stored.file_path] = stored
        message["sticker"] = self._file_object(
            stored, width=width, height=height, is_animated=is_animated, is_video=is_video,
            type="regular", emoji=emoji, set_name=set_name)
        return self._push_message(message)

    def push_location(self, latitude: float, longitude: float, *,
                      horizontal_accuracy: float | None = None, live_period: int | None = None,
                      **sender: Unpack[Sender]) -> dict[str, Any]:
        """Push a shared location (``location {latitude, longitude}``)."""
        message = self._user_message(**sender)
        location: dict[str, Any] = {"latitude": latitude, "longitude": longitude}
        if horizontal_accuracy is not None:
            location["horizontal_accuracy"] = horizontal_accuracy
        if live_period is not None:
            location["live_period"] = live_period
        message["location"] = location
        return self._push_message(message)

    def push_contact(self, phone_number: str, first_name: str, last_name: str | None = None, *,
                     contact_user_id: int | None = None, vcard: str | None = None,
                     sender_name: str = "Alice", **sender: Any) -> dict[str, Any]:
        """Push a shared contact (``contact {phone_number, first_name, ...}``); the sender's
        own first name is ``sender_name`` (the other ``sender`` keywords as push_text's)."""
        message = self._user_message(first_name=sender_name, **sender)
        contact: dict[str, Any] = {"phone_number": phone_number, "first_name": first_name}
        for key, value in (("last_name", last_name), ("user_id", contact_user_id),
                           ("vcard", vcard)):
            if value is not None:
                contact[key] = value
        message["contact"] = contact
        return self._push_message(message)

    def push_poll(self, question: str, options: list[str], *, poll_type: str = "regular",
                  is_anonymous: bool = True, allows_multiple_answers: bool = False,
                  **sender: Unpack[Sender]) -> dict[str, Any]:
        """Push a poll a user sent (a Poll object, open, no votes yet)."""
        message = self._user_message(**sender)
        message["poll"] = {
            "id": str(5000000000000000000 + next(_file_counter)), "question": question,
            "options": [{"text": o, "voter_count": 0, "persistent_id": str(i)}
                        for i, o in enumerate(options)],
            "total_voter_count": 0, "is_closed": False, "is_anonymous": is_anonymous,
            "type": poll_type, "allows_multiple_answers": allows_multiple_answers,
            "allows_revoting": poll_type != "quiz", "members_only": False}
        return self._push_message(message)

    def push_migration(self, old_chat_id: int, new_chat_id: int) -> None:
        """A group becomes a supergroup: the two service messages Telegram sends (in the old
        chat and the new one); from now on sends to the old id fail with ``migrate_to_chat_id``."""
        old = self._chats.get(old_chat_id, {"id": old_chat_id, "type": "group", "title": "Test Group"})
        new = {**old, "id": new_chat_id, "type": "supergroup"}
        self._chats[new_chat_id] = new
        self.migrated[old_chat_id] = new_chat_id
        admin = {"id": 1, "is_bot": False, "first_name": "Admin"}
        for chat, field, value in ((old, "migrate_to_chat_id", new_chat_id), (new, "migrate_from_chat_id", old_chat_id)):
            message = {"message_id": self._new_message_id(), "date": int(time.time()), "chat": chat,
                       "from": admin, field: value}
            self.push_update({"update_id": self.next_update_id, "message": message})

    def push_callback_query(self, chat_id: int, message_id: int, data: str, user_id: int | None = None,
                            first_name: str = "Alice") -> dict[str, Any]:
        """Push a press of an inline button (``callback_data`` ``data``) under the bot's
        message ``message_id`` in ``chat_id``; return the update."""
        user = {"id": chat_id if user_id is None else user_id, "is_bot": False, "first_name": first_name}
        message = self.messages.get((chat_id, message_id)) or {
            "message_id": message_id, "date": int(time.time()), "from": BOT_USER, "text": "",
            "chat": self._chats.get(chat_id, {"id": chat_id, "type": "private" if chat_id > 0 else "supergroup"})}
        update = {"update_id": self.next_update_id,
                  "callback_query": {"id": f"cq{self.next_update_id}", "from": user, "message": message,
                                     "chat_instance": str(chat_id), "data": data}}
        self.push_update(update)
        return update

    def push_edit(self, chat_id: int, message_id: int, text: str | None = None, *,
                  caption: str | None = None) -> dict[str, Any]:
        """The user edits their message ``message_id`` in ``chat_id`` (pushed earlier): an
        ``edited_message`` update with the new ``text`` (entities computed as push_text does)
        or the new ``caption`` of a file, and ``edit_date``; the stored message changes too.
        Returns the update."""
        message = dict(self.messages[(chat_id, message_id)])
        if text is not None:
            message["text"] = text
            message.pop("entities", None)
            if found := _auto_entities(text):
                message["entities"] = found
        if caption is not None:
            message["caption"] = caption
            message.pop("caption_entities", None)
            if found := _auto_entities(caption):
                message["caption_entities"] = found
        message["edit_date"] = max(int(time.time()), message["date"] + 1)
        self.messages[(chat_id, message_id)] = message
        update = {"update_id": self.next_update_id, "edited_message": message}
        self.push_update(update)
        return update

    def shown(self, chat_id: int) -> list[str]:
        """What the chat shows of the bot now: the current text of each of its messages there
        (edits applied, deleted ones gone), oldest first."""
        return [m["text"] if "text" in m else m.get("caption", "")
                for (chat, _), m in sorted(self.messages.items())
                if chat == chat_id and m.get("from", {}).get("id") == BOT_USER["id"]]

    def fail_next(self, method: str, status: int, body: dict[str, Any], times: int = 1) -> None:
        """Answer the next ``times`` calls of ``method`` with ``status`` and ``body``."""
        self._failures.setdefault(method, deque()).extend([(status, body)] * times)

    def sent(self, chat_id: int | None = None) -> list[str]:
        """Texts of all sendMessage calls (successful or not), optionally for one chat."""
        return [c.params.get("text", "") for c in self.calls if c.method == "sendMessage"
                and (chat_id is None or int(c.params.get("chat_id", 0)) == chat_id)]

    async def wait_for(self, method: str, n: int = 1, timeout: float = 5.0,
                       predicate: Callable[[dict[str, Any]], bool] | None = None) -> list[Call]:
        """Wait until ``n`` calls of ``method`` (matching ``predicate(params)``) were received;
        return all matching calls. AssertionError on timeout, listing what was called."""
        def matching() -> list[Call]:
            return [c for c in self.calls
                    if c.method == method and (predicate is None or predicate(c.params))]
        try:
            async with asyncio.timeout(timeout):
                async with self._called:
                    await self._called.wait_for(lambda: len(matching()) >= n)
        except TimeoutError:
            seen = dict(Counter(c.method for c in self.calls))
            raise AssertionError(f"FakeTelegram: wanted {n} {method} call(s) within {timeout}s, "
                                 f"got {len(matching())}; calls so far: {seen}") from None
        return matching()

    # ---- lifecycle ------------------------------------------------------------------------
    async def __aenter__(self) -> FakeTelegram:
        app = web.Application(client_max_size=64 * 1024 * 1024)  # uploads go up to 50 MB
        app.router.add_route("*", "/bot{token}/{method}", self._handle)
        app.router.add_get("/file/bot{token}/{file_path:.+}", self._download)
        self._runner = web.AppRunner(app, shutdown_timeout=0.25, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        root = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        self.base_url, self.base_file_url = f"{root}/bot", f"{root}/file/bot"
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._closing = True
        self._pushed.set()  # release pending long polls so shutdown is immediate
        if self._webhook_task is not None:
            self._webhook_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._webhook_task
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ---- HTTP -----------------------------------------------------------------------------
    async def _handle(self, request: web.Request) -> web.Response:
        if request.match_info["token"] != self.token:
            return _error(401, {"ok": False, "error_code": 401, "description": "Unauthorized"})
        method, params = request.match_info["method"], await _params(request)
        upload = self._record_upload(method, params) if method in UPLOAD_FIELDS else None
        if method == "getFile":
            self.get_file_calls.append(str(params.get("file_id", "")))
        async with self._called:
            self.calls.append(Call(method, params, request.content_type, time.monotonic()))
            self._called.notify_all()
        response = await self._respond(method, params)
        if upload is not None:
            upload["status"] = response.status
            if response.status == 200 and response.body:
                upload["message_id"] = json.loads(response.body)["result"]["message_id"]
        return response

    async def _respond(self, method: str, params: dict[str, Any]) -> web.Response:
        failures = self._failures.get(method)
        if failures:
            return _error(*failures.popleft())
        if method == "getUpdates" and self.webhook is not None:
            return _error(409, {"ok": False, "error_code": 409,
                                "description": "Conflict: can't use getUpdates method while webhook is active"})
        if method == "getUpdates":
            result = await self._get_updates(params)
            parts = [u.text if isinstance(u, RawUpdate) else json.dumps(u) for u in result]
            return web.Response(text='{"ok": true, "result": [' + ", ".join(parts) + "]}", content_type="application/json")
        handler = self._handlers.get(method)
        if handler is None:
            return _error(404, {"ok": False, "error_code": 404,
                                "description": "Not Found: method not found"})
        result = handler(params)
        if isinstance(result, web.Response):
            return result
        return web.json_response({"ok": True, "result": result})

    async def _download(self, request: web.Request) -> web.Response:
        """``GET /file/bot<token>/<file_path>``: the bytes of a registered file."""
        not_found = {"ok": False, "error_code": 404, "description": "Not Found"}
        failures = self._failures.get(DOWNLOAD)
        if failures:
            return _error(*failures.popleft())
        stored = self._files_by_path.get(request.match_info["file_path"])
        if request.match_info["token"] != self.token or stored is None:
            return _error(404, not_found)
        self.downloads.append(stored.file_path)
        return web.Response(body=stored.data, content_type="application/octet-stream")

    def _record_upload(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        value = params.get(UPLOAD_FIELDS[method])
        filename = mime = file_id = None
        data = b""
        if isinstance(value, UploadedFile):
            filename, data, mime = value.filename, value.data, value.content_type
        elif isinstance(value, str) and value in self.files:
            file_id, data = value, self.files[value].data
        thread = params.get("message_thread_id")
        entry = {"method": method, "chat_id": params.get("chat_id"), "filename": filename,
                 "data": data, "caption": params.get("caption"), "mime": mime,
                 "message_thread_id": int(thread) if thread not in (None, "") else None,
                 "file_id": file_id, "status": None, "message_id": None}
        self.files_sent.append(entry)
        return entry

    async def _get_updates(self, params: dict[str, Any]) -> list[dict[str, Any]]:
        """Bot API getUpdates: ids below ``offset`` are confirmed and forgotten; a negative
        offset keeps the last ``-offset``; waits up to ``timeout`` s for something to return.
        ``allowed_updates`` (a non-empty list) is remembered, as Telegram does, and updates of
        other kinds are never delivered (dropped)."""
        offset = int(params.get("offset") or 0)
        limit = min(max(int(params.get("limit") or 100), 1), 100)
        if params.get("allowed_updates"):
            self.allowed_updates = list(params["allowed_updates"])
        if offset > 0:
            self.confirmed_offset = max(self.confirmed_offset, offset)
            self.updates = [u for u in self.updates if u["update_id"] >= offset]
        elif offset < 0:
            self.updates = self.updates[offset:]
        deadline = time.monotonic() + float(params.get("timeout") or 0)
        while not self._wanted() and not self._closing:
            self._pushed.clear()
            try:
                async with asyncio.timeout(max(deadline - time.monotonic(), 0)):
                    await self._pushed.wait()
            except TimeoutError:
                break
        return self.updates[:limit]

    def _set_webhook(self, params: dict[str, Any]) -> bool:
        """Bot API setWebhook: from now on each update is POSTed to the URL (or to
        :attr:`webhook_targets`, in turn) with the secret token, until one answers 200."""
        allowed = params.get("allowed_updates")
        if isinstance(allowed, str):
            allowed = json.loads(allowed)
        self.webhook = {"url": params["url"], "secret_token": params.get("secret_token"), "allowed_updates": allowed}
        if allowed:
            self.allowed_updates = list(allowed)
        if self._webhook_task is None:
            self._webhook_task = asyncio.ensure_future(self._post_updates())
        return True

    def _delete_webhook(self, params: dict[str, Any]) -> bool:
        self.webhook = None
        return True

    async def _post_updates(self) -> None:
        """Telegram's side of a webhook: the oldest update is POSTed until some target takes
        it (200), one at a time, in order; a refusal or an unreachable target is tried again
        shortly, at the next target."""
        import aiohttp

        turn = 0
        async with aiohttp.ClientSession() as session:
            while not self._closing:
                if self.webhook is None or not self._wanted():
                    self._pushed.clear()
                    await self._pushed.wait()
                    continue
                update = self.updates[0]
                targets = self.webhook_targets or [self.webhook["url"]]
                target = targets[turn % len(targets)]
                turn += 1
                headers = {"X-Telegram-Bot-Api-Secret-Token": self.webhook["secret_token"] or ""}
                try:
                    async with session.post(target, json=update, headers=headers,
                                            timeout=aiohttp.ClientTimeout(total=30)) as answer:
                        outcome = str(answer.status)
                except (aiohttp.ClientError, TimeoutError) as exc:
                    outcome = type(exc).__name__
                self.webhook_posts.append((target, int(update["update_id"]), outcome))
                if outcome == "200":
                    self.updates.pop(0)
                    self.confirmed_offset = max(self.confirmed_offset, int(update["update_id"]) + 1)
                else:
                    await asyncio.sleep(0.05)

    def _wanted(self) -> list[dict[str, Any]]:
        """The pending updates, without those of kinds ``allowed_updates`` leaves out."""
        if self.allowed_updates is not None:
            self.updates = [u for u in self.updates if any(k in u for k in self.allowed_updates)]
        return self.updates

    def _new_message_id(self) -> int:
        self._next_message_id += 1
        return self._next_message_id - 1

    def _bot_message(self, params: dict[str, Any], message_id: int) -> dict[str, Any]:
        chat_id = int(params["chat_id"])
        chat = self._chats.get(chat_id, {"id": chat_id,
                                         "type": "private" if chat_id > 0 else "supergroup"})
        return {"message_id": message_id, "date": int(time.time()), "chat": chat,
                "from": BOT_USER, "text": params.get("text", "")}

    def _get_chat_member(self, params: dict[str, Any]) -> dict[str, Any]:
        chat_id, user_id = int(params["chat_id"]), int(params["user_id"])
        status = self.member_status.get((chat_id, user_id), "member")
        user = {"id": user_id, "is_bot": False, "first_name": "Member"}
        member: dict[str, Any] = {"status": status, "user": user}
        if status == "administrator":
            member.update(can_be_edited=False, is_anonymous=False, can_manage_chat=True,
                          can_delete_messages=True, can_manage_video_chats=True,
                          can_restrict_members=True, can_promote_members=False,
                          can_change_info=True, can_invite_users=True, can_post_stories=False,
                          can_edit_stories=False, can_delete_stories=False)
        elif status == "creator":
            member.update(is_anonymous=False)
        return member

    def _target_error(self, params: dict[str, Any]) -> web.Response | None:
        """Why a send to ``chat_id``/``message_thread_id`` fails, or None."""
        chat_id = int(params["chat_id"])
        if chat_id in self.migrated:
            return _error(400, {"ok": False, "error_code": 400,
                                "description": "Bad Request: group chat was upgraded to a supergroup chat",
                                "parameters": {"migrate_to_chat_id": self.migrated[chat_id]}})
        thread = int(params.get("message_thread_id") or 0)
        if thread == 1 or (thread and not self._chats.get(chat_id, {}).get("is_forum")
                           and self._chats.get(chat_id, {}).get("type") != "private"):
            # Bot API: the General topic takes no thread id, and non-forums have no topics
            return _error(400, bad_request_body("message thread not found"))
        return None

    def _store_sent(self, params: dict[str, Any], message: dict[str, Any]) -> dict[str, Any]:
        """Add markup, topic and reply to a message the bot sent, and store it."""
        if params.get("reply_markup"):
            message["reply_markup"] = params["reply_markup"]
        thread = int(params.get("message_thread_id") or 0)
        if thread:
            message.update(message_thread_id=thread, is_topic_message=True)
        reply = params.get("reply_parameters") or {}
        replied = self.messages.get((message["chat"]["id"], reply.get("message_id", 0)))
        if replied:
            message["reply_to_message"] = replied
        self.messages[(message["chat"]["id"], message["message_id"])] = message
        return message

    def _send_message(self, params: dict[str, Any]) -> Any:
        invalid = _text_error(params) or self._target_error(params)
        if invalid:
            return invalid
        return self._store_sent(params, self._bot_message(params, self._new_message_id()))

    def _send_media(self, field: str, params: dict[str, Any]) -> Any:
        """sendPhoto/sendDocument/sendVoice/sendAudio/sendVideo (``field`` holds the file)."""
        invalid = _caption_error(params) or self._target_error(params)
        if invalid:
            return invalid
        value = params.get(field)
        if isinstance(value, UploadedFile):
            data, filename, mime = value.data, value.filename, value.content_type
            if len(data) > (MAX_PHOTO_UPLOAD if field == "photo" else MAX_UPLOAD_SIZE):
                return _error(413, {"ok": False, "error_code": 413,
                                    "description": "Request Entity Too Large"})
            known = None
        elif isinstance(value, str) and value in self.files:  # re-sent by file_id
            known = self.files[value]
            data, filename, mime = known.data, known.file_name, known.mime_type
        elif isinstance(value, str) and value:
            return _error(400, bad_request_body("wrong file identifier/HTTP URL specified"))
        else:
            return _error(400, bad_request_body(f"there is no {field} in the request"))
        if mime in (None, "application/octet-stream") and filename:
            mime = mimetypes.guess_type(filename)[0] or mime
        message = self._bot_message(params, self._new_message_id())
        del message["text"]
        if params.get("caption"):
            message["caption"] = params["caption"]
        if field == "photo" and known is not None and known.width:
            message["photo"] = [self._file_object(known, width=known.width, height=known.height)]
            return self._store_sent(params, message)
        if field == "photo":
            size = image_size(data)
            if size is None:
                return _error(400, bad_request_body("IMAGE_PROCESS_FAILED"))
            width, height = size
            if width + height > 10000 or max(width, height) > 20 * max(min(width, height), 1):
                return _error(400, bad_request_body("PHOTO_INVALID_DIMENSIONS"))
            message["photo"] = self._photo_sizes(data, width, height)
            return self._store_sent(params, message)
        kind = known or self._register(data, field, file_name=filename, mime_type=mime)
        media: dict[str, Any] = {}
        if field in ("document", "audio", "video") and filename:
            media["file_name"] = filename
        if field in ("voice", "audio", "video"):
            media["duration"] = int(params.get("duration") or 1)
        if field == "video":
            media.update(width=int(params.get("width") or 640),
                         height=int(params.get("height") or 360))
        if field == "audio":
            media.update({k: params[k] for k in ("performer", "title") if params.get(k)})
        if field == "voice" and not (mime or "").startswith("audio/"):
            mime = "audio/ogg"  # Telegram's voice notes are OGG/Opus (or MP3/M4A)
        if mime:
            media["mime_type"] = mime
        message[field] = self._file_object(kind, **media)
        return self._store_sent(params, message)

    def _photo_sizes(self, data: bytes, width: int, height: int) -> list[dict[str, Any]]:
        """The PhotoSizes Telegram makes of an uploaded photo: thumbnails fitting 90, 320 and
        800 px, then the photo fitting 1280 px (each a registered file; the fake does not
        scale, so every size serves the uploaded bytes)."""
        longest = max(width, height)
        boxes = [b for b in _PHOTO_BOXES if b < longest] + [min(longest, 1280)]
        sizes = []
        for box in boxes:
            scale = box / longest
            w, h = max(1, round(width * scale)), max(1, round(height * scale))
            stored = self._register(data, "photo", width=w, height=h,
                                    file_size=max(1, round(len(data) * scale * scale)))
            sizes.append(self._file_object(stored, width=w, height=h))
        return sizes

    def _get_file(self, params: dict[str, Any]) -> Any:
        stored = self.files.get(str(params.get("file_id", "")))
        if stored is None:
            return _error(400, bad_request_body("invalid file_id"))
        if stored.file_size > MAX_DOWNLOAD_SIZE:
            return _error(400, bad_request_body("file is too big"))
        return {"file_id": stored.file_id, "file_unique_id": stored.file_unique_id,
                "file_size": stored.file_size, "file_path": stored.file_path}

    def _edit_message_caption(self, params: dict[str, Any]) -> Any:
        invalid = _caption_error(params)
        if invalid:
            return invalid
        key = (int(params["chat_id"]), int(params["message_id"]))
        old = self.messages.get(key)
        if old is None or old.get("from", {}).get("id") != BOT_USER["id"]:
            return _error(400, bad_request_body("message to edit not found"))
        if "text" in old:
            return _error(400, bad_request_body("there is no caption in the message to edit"))
        caption = params.get("caption") or ""
        markup = params.get("reply_markup") or None
        if old.get("caption", "") == caption and old.get("reply_markup") == markup:
            return _error(400, bad_request_body(
                "message is not modified: specified new message content and reply markup are "
                "exactly the same as a current content and reply markup of the message"))
        message = {k: v for k, v in old.items() if k not in ("caption", "reply_markup")}
        message["edit_date"] = int(time.time())
        if caption:
            message["caption"] = caption
        if markup:
            message["reply_markup"] = markup
        self.messages[key] = message
        return message

    def _edit_message_text(self, params: dict[str, Any]) -> Any:
        invalid = _text_error(params)
        if invalid:
            return invalid
        key = (int(params["chat_id"]), int(params["message_id"]))
        old = self.messages.get(key)
        if old is None or old.get("from", {}).get("id") != BOT_USER["id"]:
            return _error(400, bad_request_body("message to edit not found"))
        if "text" not in old:
            return _error(400, bad_request_body("there is no text in the message to edit"))
        markup = params.get("reply_markup") or None  # an edit without one removes the keyboard
        if old["text"] == params["text"] and old.get("reply_markup") == markup:
            return _error(400, bad_request_body(
                "message is not modified: specified new message content and reply markup are "
                "exactly the same as a current content and reply markup of the message"))
        message = {**old, "text": params["text"], "edit_date": int(time.time())}
        message.pop("reply_markup", None)
        if markup:
            message["reply_markup"] = markup
        self.messages[key] = message
        return message

    def _delete_message(self, params: dict[str, Any]) -> Any:
        if self.messages.pop((int(params["chat_id"]), int(params["message_id"])), None) is None:
            return _error(400, bad_request_body("message to delete not found"))
        return True

    def _answer_callback_query(self, params: dict[str, Any]) -> bool:
        self.callback_answers.append(params)
        return True

    def _set_my_commands(self, params: dict[str, Any]) -> Any:
        commands = params.get("commands") or []
        for command in commands:
            if not _COMMAND_NAME.fullmatch(str(command.get("command", ""))):
                return _error(400, bad_request_body("BOT_COMMAND_INVALID"))
            if not 1 <= len(str(command.get("description", "")).strip()) <= 256:
                return _error(400, bad_request_body("command description is empty"))
        self.commands[_scope_key(params)] = commands
        return True

    def _delete_my_commands(self, params: dict[str, Any]) -> bool:
        self.commands.pop(_scope_key(params), None)
        return True


def _text_error(params: dict[str, Any]) -> web.Response | None:
    """The Bot API's text rules for sendMessage/editMessageText, or None if the text is fine."""
    shown = visible_text(str(params.get("text", "")), params.get("parse_mode"))
    if not shown.strip():
        return _error(400, bad_request_body("message text is empty"))
    if utf16_len(shown) > MAX_TEXT_UTF16:
        return _error(400, bad_request_body("message is too long"))
    return None


def _caption_error(params: dict[str, Any]) -> web.Response | None:
    """The Bot API's caption limit (1024 characters after entities parsing), or None."""
    shown = visible_text(str(params.get("caption") or ""), params.get("parse_mode"))
    if utf16_len(shown) > MAX_CAPTION_UTF16:
        return _error(400, bad_request_body("message caption is too long"))
    return None


def _auto_entities(text: str) -> list[dict[str, Any]]:
    """A leading ``/command`` (bot_command) and ``@name`` words (mention), UTF-16 offsets."""
    found = [{"type": "bot_command", "offset": 0, "length": utf16_len(m.group())}
             for m in [re.match(r"/\S+", text)] if m]
    found += [{"type": "mention", "offset": utf16_len(text[:m.start()]),
               "length": utf16_len(m.group())}
              for m in re.finditer(r"(?<![\w/])@\w{3,}", text)]
    return found


def image_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) of PNG, GIF, JPEG, WebP or BMP bytes; None if not such an image."""
    try:
        if data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR":
            return struct.unpack(">II", data[16:24])
        if data[:6] in (b"GIF87a", b"GIF89a"):
            return struct.unpack("<HH", data[6:10])
        if data[:2] == b"BM":
            w, h = struct.unpack("<ii", data[18:26])
            return abs(w), abs(h)
        if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
            chunk = data[12:16]
            if chunk == b"VP8X":
                return (int.from_bytes(data[24:27], "little") + 1,
                        int.from_bytes(data[27:30], "little") + 1)
            if chunk == b"VP8L":
                bits = int.from_bytes(data[21:25], "little")
                return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
            if chunk == b"VP8 ":
                w, h = struct.unpack("<HH", data[26:30])
                return w & 0x3FFF, h & 0x3FFF
            return None
        if data[:2] == b"\xff\xd8":
            i = 2
            while i + 9 <= len(data):
                if data[i] != 0xFF:
                    return None
                marker = data[i + 1]
                if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:
                    i += 2
                    continue
                length = struct.unpack(">H", data[i + 2:i + 4])[0]
                if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
                    h, w = struct.unpack(">HH", data[i + 5:i + 9])
                    return w, h
                i += 2 + length
    except struct.error:
        return None
    return None


def _scope_key(params: dict[str, Any]) -> str:
    scope = params.get("scope") or {"type": "default"}
    return json.dumps([scope, params.get("language_code", "")], sort_keys=True)


def _error(status: int, body: dict[str, Any]) -> web.Response:
    return web.json_response(body, status=status)


async def _params(request: web.Request) -> dict[str, Any]:
    """Query + body; form fields holding JSON (PTB's encoding of non-strings) are decoded;
    multipart file parts become :class:`UploadedFile` (filename, bytes, content type)."""
    params: dict[str, Any] = dict(request.query)
    if request.can_read_body:
        if request.content_type == "application/json":
            params.update(await request.json())
        else:
            for key, value in (await request.post()).items():
                if isinstance(value, web.FileField):  # a multipart file part: keep its bytes
                    value = UploadedFile(value.filename, value.file.read(), value.content_type)
                elif isinstance(value, (bytes, bytearray)):
                    value = UploadedFile(None, bytes(value), "application/octet-stream")
                elif isinstance(value, str) and key not in _STRING_FIELDS:
                    try:
                        value = json.loads(value)
                    except ValueError:
                        pass
                params[key] = value
    return params
