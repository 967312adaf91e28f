"""Files people send, made into something the model can read.

An adapter journals a message with its :class:`~bumblebot.core.events.Attachment` list only (no
download holds up intake). Before a turn takes the message, :meth:`MediaIntake.prepare` fetches
each file through the adapter that received it and turns it into a :class:`Prepared`:

* **images** (Telegram photos, image documents, Discord image attachments) are checked and,
  when over ``media.image_max_side_px`` or ``media.image_max_bytes`` or in a format vision
  endpoints do not take, scaled and re-encoded with Pillow (off the event loop). They are
  kept under ``<data_dir>/media/<conversation>/`` and the history holds an
  :class:`ImageRef`, never the bytes; a request shows them as ``image_url`` data URLs
  (:class:`MediaFiles`) while they are in its protected tail (``bumblebot/cognition/context.py``).
* **voice notes and audio files** are transcribed (``bumblebot/llm/speech.py``); the model reads
  ``[Voice message, 0:07]: <transcript>``. A voice note that could not be transcribed is kept
  in ``<workspace>/inbox/`` and the user is told plainly.
* **documents** (everything else) are saved as ``<workspace>/inbox/<chat>/<name>`` (name sanitised,
  collisions suffixed: :func:`bumblebot.media.names.place`); the model is told the path, size
  and type, with the first ``media.inline_chars`` characters inline for text and PDFs.

The messages a turn takes at once fetch at most ``media.max_attachments_per_turn`` files together
(a thousand-part album must not make one request of a thousand images); the others are never
downloaded, and the model and the user are told, once, how many were left out. What came of it
(:class:`~bumblebot.media.fetched.Prepared`) is written to the journal row (``journal.media``)
before the turn begins, so a restart never downloads or transcribes a message twice. A file
that cannot be fetched or read gives a :attr:`Prepared.notices` line for the user (in words,
never an exception's name); when nothing of the message is left for the model (no caption,
nothing readable) the turn ends with that notice alone.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import logging
import os
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from bumblebot.core.errors import MediaError
from bumblebot.core.events import Attachment, AttachmentKind, Platform
from bumblebot.core.regular import read_regular
from bumblebot.core.settings import MediaSettings
from bumblebot.llm.speech import Speech
from bumblebot.media import documents
from bumblebot.media.fetched import ImageRef, Prepared, prepared
from bumblebot.media.kinds import sniff
from bumblebot.media.names import INBOX, chat_folder, place, safe_name
from bumblebot.store import JournalEntry, Store

log = logging.getLogger(__name__)

#: Image formats every vision endpoint takes as they are (OpenAI: PNG, JPEG, WEBP, non-animated GIF).
_DIRECT_FORMATS = {"JPEG": "image/jpeg", "PNG": "image/png", "WEBP": "image/webp", "GIF": "image/gif"}
#: Images with more pixels than this are refused before they are decoded (a decompression bomb).
MAX_IMAGE_PIXELS = 50_000_000
#: Tries at fetching one file when the platform is unreachable, and the first pause between them.
FETCH_TRIES = 3
FETCH_RETRY_S = 1.0
#: Bytes of image data URLs kept encoded between requests.
DATA_URL_CACHE_BYTES = 32 * 1024 * 1024
#: A transcript is shown whole up to ``media.inline_chars`` characters, but never cut shorter
#: than this (about a minute of speech); a longer one is kept as a file.
MIN_TRANSCRIPT_CHARS = 1000


class MediaUnavailable(Exception):
    """A message's files cannot be fetched or transcribed for now (the platform or the
    transcription endpoint is down); try again later. ``entries``: the entries given to
    :meth:`MediaIntake.prepare`, those it prepared before the failure with their ``media``."""

    def __init__(self, message: str, entries: list[JournalEntry] | None = None) -> None:
        super().__init__(message)
        self.entries = entries or []


class Downloader(Protocol):
    """What :class:`MediaIntake` needs of an adapter (``bumblebot.core.adapter.Adapter.download``)."""

    platform: Any

    async def download(self, attachment: Attachment, dest: Path) -> int:
        """Write the file to ``dest``; returns its size in bytes. Raises :class:`MediaError`."""


@dataclass(slots=True)
class _Result:
    text: list[str] = field(default_factory=list)
    images: list[ImageRef] = field(default_factory=list)
    notices: list[str] = field(default_factory=list)
    usable: int = 0
    spoken: list[str] = field(default_factory=list)


class MediaIntake:
    """Fetches and converts the files of journaled messages.

    Args:
        settings: the ``media`` section.
        store: where each message's :class:`Prepared` is recorded (``journal.media``).
        media_dir: ``<data_dir>/media`` (images kept for the model).
        workspace: the work tools' root; documents go to its ``inbox/``.
        speech: transcribes voice notes and audio (``None``: they are saved as documents).
    """

    def __init__(
        self, settings: MediaSettings, *, store: Store, media_dir: Path, workspace: Path, speech: Speech | None,
    ) -> None:
        self.settings = settings
        self._store = store
        self.media_dir = media_dir
        self.workspace = workspace
        self._speech = speech
        self._adapters: dict[Platform, Downloader] = {}

    def clean_partials(self) -> int:
        """Delete the unfinished downloads a killed process left (``.*.partial`` in the inbox
        and media folders); call at start, before any turn. Returns how many went."""
        gone = 0
        for root in (self.workspace / INBOX, self.media_dir):
            if not root.is_dir():
                continue
            for path in root.glob("**/.*.partial"):
                with contextlib.suppress(OSError):
                    path.unlink()
                    gone += 1
        if gone:
            log.info("removed %d unfinished download(s) left by the last process", gone)
        return gone

    def move_chat(self, old: str, new: str) -> None:
        """The chat with key ``old`` continues as ``new`` (a Telegram group became a
        supergroup): its inbox goes with it (merged into one the new chat has). Sync (a rename).

        Raises:
            OSError: the folder could not be moved.
        """
        source = self.workspace / INBOX / chat_folder(old)
        target = self.workspace / INBOX / chat_folder(new)
        if not source.is_dir():
            return
        if not target.exists():
            os.replace(source, target)
            return
        for path in sorted(source.iterdir()):
            if path.is_file() and not path.is_symlink():
                place(target, path.name, path)

    def register(self, adapter: Downloader) -> None:
        """Fetch the files of ``adapter``'s platform through it."""
        self._adapters[adapter.platform] = adapter

    async def prepare(self, entries: list[JournalEntry], *, final: bool = False) -> list[JournalEntry]:
        """``entries`` with the files of each fetched and converted (:class:`Prepared` in
        ``media``, also written to the journal); entries without files, or already prepared,
        come back as they were.

        Raises:
            MediaUnavailable: a file could not be fetched or transcribed because a service is
                down (after :data:`FETCH_TRIES` quick tries); the entries prepared before it
                are recorded. With ``final`` (it has waited long enough) such a file is told
                as failed instead.
        """
        out: list[JournalEntry] = []
        takes, left_out = self._plan(entries)
        for entry in entries:
            if entry.inbound.attachments and entry.media is None:
                try:
                    result = (await self._prepare(entry, final, takes[entry.id], left_out)).to_json()
                    left_out = left_out if result["left_out"] == 0 else 0  # told once, with the first
                except MediaUnavailable as exc:
                    exc.entries = [*out, *entries[len(out):]]  # what was prepared stays prepared
                    raise
                await self._store.save_media(entry.id, result)
                entry = dataclasses.replace(entry, media=result)
            out.append(entry)
        return out

    def _plan(self, entries: list[JournalEntry]) -> tuple[dict[int, int], int]:
        """How many of its files each entry to prepare may fetch, in order, so that ``entries``
        fetch at most ``media.max_attachments_per_turn`` together (counting those fetched
        before); and how many are left out."""
        room = self.settings.max_attachments_per_turn - sum(
            len(e.inbound.attachments) - prepared(e).left_out for e in entries if e.media is not None
        )
        takes: dict[int, int] = {}
        for e in entries:
            if e.inbound.attachments and e.media is None:
                takes[e.id] = min(len(e.inbound.attachments), max(room, 0))
                room -= takes[e.id]
        return takes, sum(len(e.inbound.attachments) for e in entries if e.id in takes) - sum(takes.values())

    async def _prepare(self, entry: JournalEntry, final: bool, take: int, left_out: int) -> Prepared:
        """The files of ``entry``, its first ``take`` fetched; when it leaves some out, it tells
        the model and the user how many of the turn's (``left_out``) were."""
        result = _Result()
        atts = entry.inbound.attachments
        for index, att in enumerate(atts[:take]):
            try:
                await self._one(entry, index, att, result, final)
            except MediaError as exc:
                if exc.retryable and not final:
                    raise MediaUnavailable(str(exc)) from exc
                what = _what(att)
                log.info("file %d of message %s in %s not used: %s", index, entry.inbound.message_id, entry.inbound.chat.key, exc)
                result.notices.append(f"I couldn't use {what}: {_sentence(exc)}")
                result.text.append(f"[{_what(att, cap=True)} that could not be used: {exc}]")
            except Exception:  # a converter bug must not lose the message
                log.exception("file %d of message %s in %s failed", index, entry.inbound.message_id, entry.inbound.chat.key)
                result.notices.append(f"I couldn't use {_what(att)}: something went wrong reading it.")
                result.text.append(f"[{_what(att, cap=True)} that could not be used]")
        if take < len(atts) and left_out:
            cap = self.settings.max_attachments_per_turn
            log.info("%d file(s) in %s left out: over %d at once", left_out, entry.inbound.chat.key, cap)
            files = f"{left_out} more file{'s' if left_out != 1 else ''}"
            result.text.append(f"[{files} came with this and {'were' if left_out != 1 else 'was'} left out unopened: at most {cap} are taken at once]")
            result.notices.append(f"I take {cap} files at a time, so I left the other {left_out} out. Send them again, a few at a time, if they matter.")
        return Prepared(
            text="\n".join(result.text), images=tuple(result.images),
            voice=any(a.kind is AttachmentKind.VOICE for a in atts),
            document=any(a.kind is AttachmentKind.DOCUMENT for a in atts),
            notices=tuple(result.notices), usable=result.usable, spoken="\n".join(result.spoken),
            left_out=len(atts) - take,
        )

    async def _fetch(self, entry: JournalEntry, att: Attachment, dest: Path) -> int:
        adapter = self._adapters.get(entry.inbound.chat.platform)
        if adapter is None:
            raise MediaError(f"{entry.inbound.chat.platform.value} is not connected", retryable=True)
        dest.parent.mkdir(parents=True, exist_ok=True)
        delay = FETCH_RETRY_S
        for attempt in range(FETCH_TRIES):
            try:
                return await adapter.download(att, dest)
            except MediaError as exc:
                dest.unlink(missing_ok=True)
                if not exc.retryable or attempt + 1 == FETCH_TRIES:
                    raise
                log.info("download of %s failed (%s); trying again in %.0f s", att.name or att.kind.value, exc, delay)
                await asyncio.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")

    def _inbox(self, entry: JournalEntry) -> Path:
        """Where the files of ``entry``'s chat go: ``<workspace>/inbox/<chat folder>`` (the file
        tools of other chats cannot reach it)."""
        return self.workspace / INBOX / chat_folder(entry.inbound.chat.key)

    def _partial(self, directory: Path) -> Path:
        return directory / f".{uuid.uuid4().hex}.partial"

    async def _one(self, entry: JournalEntry, index: int, att: Attachment, out: _Result, final: bool) -> None:
        if att.kind is AttachmentKind.IMAGE:
            await self._image(entry, index, att, out)
        elif att.kind in (AttachmentKind.VOICE, AttachmentKind.AUDIO) and self._speech is not None:
            await self._audio(entry, att, out, final)
        else:
            await self._document(entry, att, out)

    # -- images --------------------------------------------------------------------------------

    async def _image(self, entry: JournalEntry, index: int, att: Attachment, out: _Result) -> None:
        folder = self.media_dir / chat_folder(entry.inbound.chat.key)
        tmp = self._partial(folder)
        try:
            await self._fetch(entry, att, tmp)
            stem = folder / f"{entry.id}-{index}"
            try:
                path, mime, width, height = await asyncio.to_thread(
                    normalise_image, tmp, stem, self.settings.image_max_side_px, self.settings.image_max_bytes
                )
            except MediaError as exc:
                if "too large" in str(exc):
                    raise
                # HEIC without a plugin, a damaged file: kept for the tools, the user told
                name = att.name or f"image-{entry.inbound.message_id}"
                rel = self._rel(await asyncio.to_thread(place, self._inbox(entry), name, tmp))
                out.notices.append(f"I couldn't open the image: {_sentence(exc)[:-1]}. I kept the file as {rel}.")
                out.text.append(f"[An image that could not be opened ({exc}); the file is kept as {rel}]")
                return
        finally:
            tmp.unlink(missing_ok=True)
        ref = ImageRef(path.relative_to(self.media_dir).as_posix(), mime, width, height)
        out.images.append(ref)
        out.text.append(f"[Image {width}×{height}]")
        out.usable += 1

    # -- voice and audio -----------------------------------------------------------------------

    async def _audio(self, entry: JournalEntry, att: Attachment, out: _Result, final: bool) -> None:
        assert self._speech is not None
        voice = att.kind is AttachmentKind.VOICE
        tmp = self._partial(self._inbox(entry))
        try:
            size = await self._fetch(entry, att, tmp)
            name = att.name or _voice_name(entry, att)
            data = await asyncio.to_thread(tmp.read_bytes)
            try:
                transcript = await self._speech.transcribe(
                    data, name=safe_name(name), mime=att.mime or "audio/ogg", seconds=att.duration_s
                )
            except MediaError as exc:
                if exc.retryable and not final:
                    raise  # the service is down: the message waits for it
                saved = await asyncio.to_thread(place, self._inbox(entry), name, tmp)
                rel = self._rel(saved)
                what = "your voice message" if voice else f"the audio file {att.name or ''}".rstrip()
                out.notices.append(f"I couldn't transcribe {what} ({exc}). I kept the recording as {rel}.")
                out.text.append(f"[{'Voice message' if voice else 'Audio file'} saved as {rel}; it could not be transcribed: {exc}]")
                return
            length = _clock(att.duration_s)
            if voice:
                label = f"Voice message{', ' + length if length else ''}"
            else:  # an audio file is a file too: kept, and named for the model
                saved = await asyncio.to_thread(place, self._inbox(entry), name, tmp)
                label = f"Audio file {self._rel(saved)} ({documents.describe_size(size)}{', ' + length if length else ''})"
        finally:
            tmp.unlink(missing_ok=True)
        cap = max(MIN_TRANSCRIPT_CHARS, self.settings.inline_chars)
        if len(transcript) > cap:  # a long recording: the whole transcript is a file to read
            whole = await asyncio.to_thread(self._keep_text, entry, f"{Path(name).stem}.transcript.txt", transcript)
            head = transcript[:cap].rsplit(" ", 1)[0]
            out.text.append(
                f"[{label}, transcribed: {len(transcript)} characters, the first {len(head)} here; the whole "
                f'transcript is {whole}, read it with read_file("{whole}")]: {head} …'
            )
            out.spoken.append(head)
        elif transcript:
            out.text.append(f"[{label}, transcribed]: {transcript}")
            out.spoken.append(transcript)
        else:
            out.text.append(f"[{label}: no speech could be heard in it]")
        out.usable += 1

    # -- documents -----------------------------------------------------------------------------

    async def _document(self, entry: JournalEntry, att: Attachment, out: _Result) -> None:
        tmp = self._partial(self._inbox(entry))
        try:
            size = await self._fetch(entry, att, tmp)
            name = att.name or f"file-{entry.inbound.message_id}"
            saved = await asyncio.to_thread(place, self._inbox(entry), name, tmp)
        finally:
            tmp.unlink(missing_ok=True)
        rel = self._rel(saved)
        kind = await asyncio.to_thread(sniff, saved, att.mime or None, saved.name)
        head = f"[File received: {rel} ({_kind_label(kind, att.mime)}, {documents.describe_size(size)})."
        limit = self.settings.inline_chars
        if kind == "pdf":
            try:
                text, pages, cut = await asyncio.to_thread(documents.pdf_text_bounded, saved, max_chars=max(limit, 1))
            except documents.DocumentError as exc:
                out.notices.append(f"I saved {saved.name}, but I can't read it: {_sentence(exc)}")
                out.text.append(f"{head} It could not be read: {exc}]")
                return
            head = head[:-2] + f", {pages} page{'s' if pages != 1 else ''})."
            if not text.strip():
                out.text.append(f"{head} It has no extractable text (it may be scanned images).]")
            else:
                out.text.append(_with_excerpt(head, rel, text if limit else "", cut))
        elif kind == "text":
            text, cut = await asyncio.to_thread(documents.excerpt, saved, limit) if limit else ("", True)
            out.text.append(_with_excerpt(head, rel, text, cut))
        else:
            note = {"image": " It is an image file.", "audio": " It is audio.", "video": " It is a video; you cannot watch it.",
                    "archive": " It is an archive."}.get(kind, "")
            out.text.append(f"{head}{note}]")
        out.usable += 1

    async def keep_long_text(self, entries: list[JournalEntry], text: str) -> list[JournalEntry]:
        """A message (or a burst, a long paste in parts) too long to show the model whole,
        ``text`` being all of it: kept in the chat's inbox as ``message-<id>.txt`` (made once:
        a retry finds the same file), and ``entries`` come back with the first one's text
        an excerpt of ``media.inline_chars`` characters that names the file, the others' text
        emptied (their files stay). Raises ``OSError`` when the file cannot be written."""
        first = entries[0]
        name = f"message-{safe_name(first.inbound.message_id, fallback=str(first.id))}.txt"
        rel = await asyncio.to_thread(self._keep_text, first, name, text)
        limit = max(MIN_TRANSCRIPT_CHARS, self.settings.inline_chars)
        head = text[:limit].rsplit(" ", 1)[0] if len(text) > limit else text
        note = (
            f"[A message of {len(text)} characters, too long to show whole: it is saved as {rel}; "
            f'read it with read_file("{rel}"), part by part. The first {len(head)} characters:]\n{head} …'
        )
        out = [dataclasses.replace(first, inbound=dataclasses.replace(first.inbound, text=note, quote=""))]
        out += [dataclasses.replace(e, inbound=dataclasses.replace(e.inbound, text="", quote="")) for e in entries[1:]]
        return out

    def _keep_text(self, entry: JournalEntry, name: str, text: str) -> str:
        """Save ``text`` in the chat's inbox as ``name`` (sync); its workspace path."""
        inbox = self._inbox(entry)
        inbox.mkdir(parents=True, exist_ok=True)
        tmp = self._partial(inbox)
        tmp.write_text(text, encoding="utf-8")
        return self._rel(place(inbox, name, tmp))

    def _rel(self, path: Path) -> str:
        """``path`` as the file tools name it (relative to the workspace)."""
        return path.relative_to(self.workspace).as_posix()


class MediaFiles:
    """Images kept for the model, as requests carry them: ``image_url`` data URLs, encoded off
    the event loop and cached (at most :data:`DATA_URL_CACHE_BYTES`).

    Args:
        media_dir: ``<data_dir>/media``.
    """

    def __init__(self, media_dir: Path) -> None:
        self.media_dir = media_dir
        self._cache: OrderedDict[str, str] = OrderedDict()
        self._bytes = 0

    async def data_url(self, ref: ImageRef) -> str | None:
        """``data:<mime>;base64,…`` of ``ref``; ``None`` when its file is gone (deleted by hand)."""
        cached = self._cache.get(ref.path)
        if cached is not None:
            self._cache.move_to_end(ref.path)
            return cached
        path = self.media_dir / ref.path
        try:
            url = await asyncio.to_thread(_encode, path, ref.mime)
        except OSError as exc:
            log.warning("image %s is gone from the media directory (%s); it is left out", path, exc)
            return None
        self._cache[ref.path] = url
        self._bytes += len(url)
        while self._bytes > DATA_URL_CACHE_BYTES and len(self._cache) > 1:
            _, old = self._cache.popitem(last=False)
            self._bytes -= len(old)
        return url


def _encode(path: Path, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(read_regular(path, follow=True)).decode('ascii')}"


def normalise_image(src: Path, stem: Path, max_side: int, max_bytes: int) -> tuple[Path, str, int, int]:
    """Check the image at ``src`` and write it as ``stem`` plus an extension, within
    ``max_side`` pixels and ``max_bytes`` bytes, in a format vision endpoints take (kept as it
    is when it already fits, else scaled and written as JPEG, or PNG when it has transparency).
    Sync and CPU-bound: call it off the event loop. Returns ``(path, mime, width, height)``.

    Raises:
        MediaError: not an image Pillow can read, damaged, or over :data:`MAX_IMAGE_PIXELS`.
    """
    from PIL import Image, ImageOps, UnidentifiedImageError

    try:
        with Image.open(src) as probe:
            fmt, (width, height) = probe.format or "", probe.size
            if width * height > MAX_IMAGE_PIXELS:
                raise MediaError(f"the image is too large ({width}×{height} pixels)")
            frames = getattr(probe, "n_frames", 1)
            probe.verify()
        with Image.open(src) as image:
            image.load()
            size = src.stat().st_size
            direct = _DIRECT_FORMATS.get(fmt)
            if direct and frames == 1 and max(width, height) <= max_side and size <= max_bytes:
                path = stem.with_suffix("." + ("jpg" if fmt == "JPEG" else fmt.lower()))
                path.parent.mkdir(parents=True, exist_ok=True)
                os.replace(src, path)
                return path, direct, width, height
            image.seek(0)
            picture = ImageOps.exif_transpose(image)
            picture.thumbnail((max_side, max_side))
            alpha = picture.mode in ("RGBA", "LA") or (picture.mode == "P" and "transparency" in picture.info)
            path = stem.with_suffix(".png" if alpha else ".jpg")
            path.parent.mkdir(parents=True, exist_ok=True)
            picture = picture.convert("RGBA" if alpha else "RGB")
            quality = 85
            while True:
                tmp = path.with_name(f".{path.name}.partial")
                picture.save(tmp, "PNG" if alpha else "JPEG", **({} if alpha else {"quality": quality}))
                if tmp.stat().st_size <= max_bytes or min(picture.size) < 64:
                    os.replace(tmp, path)
                    break
                tmp.unlink()
                quality = max(40, quality - 15)
                picture = picture.resize((max(1, picture.width * 3 // 4), max(1, picture.height * 3 // 4)))
            return path, "image/png" if alpha else "image/jpeg", picture.width, picture.height
    except MediaError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:  # the warning, where it is an error
        raise MediaError("the image is too large (too many pixels)") from exc
    except UnidentifiedImageError as exc:
        raise MediaError("it is not an image I can open") from exc
    except (OSError, SyntaxError, ValueError, EOFError) as exc:  # Pillow's ways of saying "damaged"
        raise MediaError("the image seems to be damaged") from exc


def _sentence(exc: BaseException) -> str:
    """An error as the end of a sentence for the user: one period, no library jargon past 160
    characters."""
    text = " ".join(str(exc).split()).rstrip(".")
    if len(text) > 160:
        text = text[:159].rstrip() + "…"
    return text + "."


def _clock(seconds: float | None) -> str:
    if not seconds:
        return ""
    s = int(round(seconds))
    return f"{s // 60}:{s % 60:02d}"


def _voice_name(entry: JournalEntry, att: Attachment) -> str:
    ext = {"audio/ogg": ".ogg", "audio/mpeg": ".mp3", "audio/mp4": ".m4a", "audio/wav": ".wav", "audio/webm": ".webm"}.get(att.mime, ".ogg")
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    return f"voice-{stamp}-{safe_name(entry.inbound.message_id, fallback='msg')}{ext}"


def _what(att: Attachment, *, cap: bool = False) -> str:
    text = {
        AttachmentKind.IMAGE: "the image", AttachmentKind.VOICE: "your voice message",
        AttachmentKind.AUDIO: f"the audio file {att.name}".rstrip(), AttachmentKind.DOCUMENT: f"the file {att.name}".rstrip(),
    }[att.kind]
    if cap:
        text = {"your voice message": "a voice message", "the image": "an image"}.get(text, text.replace("the ", "a ", 1))
        return text[0].upper() + text[1:]
    return text


def _kind_label(kind: str, mime: str) -> str:
    labels = {"pdf": "PDF", "text": "text", "image": "image", "audio": "audio", "video": "video", "archive": "archive"}
    label = labels.get(kind, "binary file")
    return f"{label}, {mime}" if mime and kind not in ("pdf",) else label


def _with_excerpt(head: str, rel: str, text: str, cut: bool) -> str:
    read = f' Read it with read_file("{rel}").' if cut else ""
    if not text.strip():
        return f"{head}{read}]"
    return f"{head}{read} {'Its beginning' if cut else 'Its content'}:]\n{text}\n[End of {'excerpt' if cut else 'file'}]"
