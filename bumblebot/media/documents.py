"""Documents people send: safe file names, placing a download, telling its kind, reading it.

The engine saves each document under ``<workspace>/inbox/<name>`` with :func:`place` (the name
made safe by :func:`safe_name`), tells the model its kind (:func:`sniff`) and size
(:func:`describe_size`), and shows the start of a text file inline (:func:`excerpt`). The
``read_file`` tool reads PDFs through :func:`pdf_text`.

What is trusted: nothing the sender controls. The name may hold ``..``, separators, control
characters or a Windows device name; the MIME type the platform reports is only a hint, and the
first bytes of the file decide where they can (:func:`sniff`).

Errors: a document that is corrupt or cannot be read raises :class:`DocumentError`, whose
message is written for the user ("the PDF is password-protected"). OS errors (a missing file,
a full disk) propagate as :class:`OSError`.
"""

from __future__ import annotations

import codecs
import contextlib
import errno
import hashlib
import json
import os
import shutil
import stat
import sys
import tempfile
import unicodedata
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import pypdf
import regex

from bumblebot.core.errors import BumblebotError

__all__ = [
    "KINDS",
    "MAX_NAME_BYTES",
    "DocumentError",
    "describe_size",
    "excerpt",
    "is_pdf",
    "pdf_text",
    "place",
    "safe_name",
    "sniff",
]

#: Longest name :func:`safe_name` returns, in UTF-8 bytes (file systems allow 255).
MAX_NAME_BYTES = 120
#: What :func:`sniff` answers.
KINDS = ("pdf", "text", "image", "audio", "video", "archive", "binary")
#: Leading bytes :func:`sniff` and :func:`excerpt` look at.
SNIFF_BYTES = 8192
#: :func:`place` gives up after this many ``stem-N`` variants of one name.
MAX_VARIANTS = 100_000

#: Extensions kept whole by :func:`safe_name` and :func:`place` (``a.tar-1.gz`` is ugly).
_DOUBLE_EXTS = (".tar.gz", ".tar.bz2", ".tar.xz", ".tar.zst")
#: Longest single extension kept by the length cap, in characters after the dot.
_MAX_EXT_CHARS = 15
_FORBIDDEN = frozenset('<>:"/\\|?*')
#: Bidirectional controls: "invoice\u202efdp.exe" shows as "invoiceexe.pdf".
_BIDI = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")
_RESERVED = frozenset(
    {"CON", "PRN", "AUX", "NUL", "CONIN$", "CONOUT$"}
    | {f"{port}{n}" for port in ("COM", "LPT") for n in "123456789\u00b9\u00b2\u00b3"}
)
_GRAPHEME = regex.compile(r"\X")
_REGEX_TIMEOUT_S = 1.0


def _words(text: str) -> list[str]:
    return text.split()


_TEXT_EXTS = frozenset(_words(
    "txt text md markdown rst adoc org csv tsv json jsonl ndjson geojson yaml yml toml ini cfg "
    "conf properties log xml html htm xhtml css scss sass less js mjs cjs ts tsx jsx vue svelte "
    "py pyi ipynb rb go rs java kt kts scala groovy gradle c h cc cpp cxx hpp hh hxx cs fs swift "
    "m mm php pl pm lua r jl dart ex exs erl hrl hs ml mli clj cljs el lisp scm rkt nim zig sh "
    "bash zsh fish ps1 psm1 bat cmd sql graphql gql proto tex bib sty srt vtt ass diff patch svg "
    "rtf tf hcl nix cmake mk"
))
_EXT_KINDS: dict[str, str] = {
    **dict.fromkeys(_TEXT_EXTS, "text"),
    "pdf": "pdf",
    **dict.fromkeys(_words("png jpg jpeg jpe gif webp bmp tif tiff heic heif avif"), "image"),
    **dict.fromkeys(_words("mp3 ogg oga opus m4a aac flac wav aif aiff amr mid midi wma"), "audio"),
    **dict.fromkeys(_words("mp4 m4v mov mkv webm avi flv wmv 3gp mpeg mpg"), "video"),
    **dict.fromkeys(_words("zip tar gz tgz bz2 tbz2 xz txz zst 7z rar jar apk"), "archive"),
}
_TEXT_MIMES = frozenset(_words(
    "application/json application/xml application/javascript application/x-javascript "
    "application/ecmascript application/x-sh application/x-shellscript application/x-python "
    "application/sql application/x-sql application/yaml application/x-yaml application/toml "
    "application/x-ndjson application/x-tex application/x-latex application/rtf application/csv "
    "application/x-subrip application/x-httpd-php application/graphql"
))
_ARCHIVE_MIMES = frozenset(_words(
    "application/zip application/x-zip-compressed application/x-tar application/gzip "
    "application/x-gzip application/x-bzip2 application/x-xz application/zstd "
    "application/x-7z-compressed application/x-rar-compressed application/vnd.rar "
    "application/java-archive"
))
#: Signatures at offset 0 (only ones a text file cannot plausibly start with).
_SIGNATURES: tuple[tuple[bytes, str], ...] = (
    (b"\x89PNG\r\n\x1a\n", "image"),
    (b"\xff\xd8\xff", "image"),
    (b"GIF87a", "image"),
    (b"GIF89a", "image"),
    (b"II*\x00", "image"),
    (b"MM\x00*", "image"),
    (b"fLaC", "audio"),
    (b"MThd\x00\x00\x00\x06", "audio"),
    (b"#!AMR", "audio"),
    (b"\x1a\x45\xdf\xa3", "video"),
    (b"FLV\x01", "video"),
    (b"PK\x03\x04", "archive"),
    (b"PK\x05\x06", "archive"),
    (b"PK\x07\x08", "archive"),
    (b"\x1f\x8b", "archive"),
    (b"\xfd7zXZ\x00", "archive"),
    (b"\x28\xb5\x2f\xfd", "archive"),
    (b"7z\xbc\xaf\x27\x1c", "archive"),
    (b"Rar!\x1a\x07", "archive"),
    (b"\x7fELF", "binary"),
    (b"\xfe\xed\xfa\xce", "binary"),
    (b"\xfe\xed\xfa\xcf", "binary"),
    (b"\xce\xfa\xed\xfe", "binary"),
    (b"\xcf\xfa\xed\xfe", "binary"),
    (b"\xca\xfe\xba\xbe", "binary"),
    (b"SQLite format 3\x00", "binary"),
)
_RIFF = {b"WEBP": "image", b"WAVE": "audio", b"AVI ": "video"}
_FTYP_IMAGE = frozenset({b"heic", b"heix", b"heim", b"heis", b"hevc", b"mif1", b"msf1", b"avif", b"avis"})
_FTYP_AUDIO = frozenset({b"M4A ", b"M4B ", b"M4P ", b"F4A "})
#: Control characters that text does carry: tab, newlines, form feed, backspace, ANSI escape.
_TEXT_CONTROLS = frozenset("\t\n\r\f\v\b\x1b")


class DocumentError(BumblebotError):
    """A document is corrupt, encrypted or not of the kind asked for; ``str(exc)`` is written
    for the user ("the PDF is password-protected")."""


# -- names ------------------------------------------------------------------------------------


#: The folder of the workspace that holds the files people sent, one sub-folder per chat.
INBOX = "inbox"


def chat_folder(key: str) -> str:
    """The inbox sub-folder of the conversation with key ``key``: ``telegram:123`` becomes
    ``telegram_123`` (letters, digits, ``-`` and ``_`` kept, anything else ``_``)."""
    return "".join(c if c.isascii() and (c.isalnum() or c in "-_") else "_" for c in key)


def safe_name(name: str, *, fallback: str = "file") -> str:
    """A file name that is safe to create in a directory on Linux, macOS and Windows.

    Only the last path component is kept (``/`` and ``\\`` both separate). The name is put in
    Unicode NFC; whitespace (newlines and tabs too) becomes single spaces; control characters,
    unpaired surrogates, bidirectional controls and ``<>:"/\\|?*`` are dropped; leading dots and
    spaces and trailing dots and spaces are stripped (so the result is never hidden and never
    collides with a ``.<something>.partial`` download). A Windows device name (``CON``, ``PRN``,
    ``AUX``, ``NUL``, ``COM1``-``COM9``, ``LPT1``-``LPT9``, any case, with or without an
    extension) gets a ``_`` prefix. The result is at most :data:`MAX_NAME_BYTES` UTF-8 bytes:
    the stem is shortened, never inside a character or a grapheme cluster (an emoji with its
    modifiers), and the extension is kept (``.tar.gz`` and its kin count as one).

    Args:
        name: what the sender called the file.
        fallback: the name when nothing is left (``".."``, ``""``, ``"   "``); made safe the
            same way, ``"file"`` if that leaves nothing either. A name that was only a known
            extension (``"???.pdf"``) becomes ``fallback`` plus it (``"file.pdf"``).

    Returns:
        A non-empty name with no separator, e.g. ``safe_name("../../etc/passwd") == "passwd"``
        and ``safe_name("con.txt") == "_con.txt"``.
    """
    cleaned = _clean(name.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1])
    core = cleaned.strip(". ")
    if not core or (cleaned.lstrip(" ").startswith(".") and _is_bare_extension(core)):
        base = _clean(fallback).strip(". ") or "file"
        core = base + ("." + core if core else "")
    if core.split(".", 1)[0].rstrip(" ").upper() in _RESERVED:
        core = "_" + core
    stem, ext = _split_ext(core)
    return _fit(stem, ext, MAX_NAME_BYTES)


def _clean(name: str) -> str:
    kept: list[str] = []
    for char in unicodedata.normalize("NFC", name):
        if char.isspace():
            kept.append(" ")
        elif char in _FORBIDDEN or char in _BIDI or unicodedata.category(char) in ("Cc", "Cs"):
            continue
        else:
            kept.append(char)
    # NFC again: a dropped character may have sat between a letter and its accent
    return unicodedata.normalize("NFC", " ".join("".join(kept).split()))


def _is_bare_extension(core: str) -> bool:
    lowered = core.lower()
    return ("." + lowered) in _DOUBLE_EXTS or ("." not in lowered and lowered in _EXT_KINDS)


def _split_ext(name: str) -> tuple[str, str]:
    """``(stem, extension)``; the extension has its dot, or is ``""`` when there is none (or it
    is too long or has spaces to be one)."""
    lowered = name.lower()
    for double in _DOUBLE_EXTS:
        if lowered.endswith(double) and len(name) > len(double):
            return name[: -len(double)], name[-len(double) :]
    dot = name.rfind(".")
    if dot <= 0 or len(name) - dot - 1 > _MAX_EXT_CHARS or " " in name[dot:]:
        return name, ""
    return name[:dot], name[dot:]


def _fit(stem: str, ext: str, budget: int, suffix: str = "") -> str:
    """``stem + suffix + ext`` in at most ``budget`` UTF-8 bytes, shortening the stem."""
    room = budget - len((suffix + ext).encode("utf-8"))
    if len(stem.encode("utf-8")) > room:
        stem = _cut(stem, room).rstrip(". ") or _cut(stem, room)
    return stem + suffix + ext


def _cut(text: str, budget: int) -> str:
    """The longest prefix of ``text`` in ``budget`` UTF-8 bytes ending at a grapheme boundary
    (or at a character boundary when a single cluster is over the budget)."""
    out: list[str] = []
    used = 0
    try:
        for match in _GRAPHEME.finditer(text, timeout=_REGEX_TIMEOUT_S):
            size = len(match.group().encode("utf-8"))
            if used + size > budget:
                break
            out.append(match.group())
            used += size
    except TimeoutError:
        out = []
    if out:
        return "".join(out)
    return text.encode("utf-8")[: max(budget, 0)].decode("utf-8", errors="ignore")


# -- placing a download -----------------------------------------------------------------------


def place(directory: Path, name: str, source: Path) -> Path:
    """Move the finished download ``source`` into ``directory`` as ``safe_name(name)``.

    When that name is taken by another file, ``stem-1.ext``, ``stem-2.ext``, … are tried
    (``.tar.gz`` and its kin count as one extension: ``logs-1.tar.gz``). When the name or one of
    its numbered variants already holds the same bytes (same size, then same SHA-256), that file
    is returned and ``source`` is deleted, so a download repeated after a crash leaves one copy.

    An existing file is never overwritten, even when two calls race for one name: the file is
    published with :func:`os.link`, which fails when the name exists, so the loser moves on
    to the next number. ``source`` is fsynced first and the directory after, so a name that
    appeared survives a crash with its bytes. Where hard links are not supported the name is
    reserved with ``O_CREAT | O_EXCL`` and :func:`os.replace` moves ``source`` onto it (an
    empty file is visible for that moment).

    Args:
        directory: where the document goes (created with its parents if missing).
        name: the name the sender gave (made safe here).
        source: the complete download, a regular file. Download it into ``directory`` (e.g.
            ``directory / f".{token}.partial"``: :func:`safe_name` never starts with a dot) so
            it is on the same file system; one elsewhere is copied first, which is slower.

    Returns:
        The path the document now has (``source`` no longer exists, unless it already was that
        path).

    Raises:
        ValueError: ``source`` is not a regular file (a symlink, a directory).
        FileExistsError: all :data:`MAX_VARIANTS` variants of the name hold other files.
        OSError: the directory cannot be created or written, ``source`` is missing.
    """
    directory.mkdir(parents=True, exist_ok=True)
    src_stat = os.lstat(source)
    if not stat.S_ISREG(src_stat.st_mode):
        raise ValueError(f"not a regular file: {source}")
    base = safe_name(name)
    stem, ext = _split_ext(base)
    digest = _lazy_digest(source)

    taken: set[int] = set()
    with os.scandir(directory) as entries:
        names = [entry.name for entry in entries]
    for existing in sorted(names):
        number = _variant_number(existing, base, stem, ext)
        if number is None:
            continue
        found = directory / existing
        same = _same_content(found, src_stat, digest)
        if same:
            return _reuse(found, source, same)
        taken.add(number)

    _fsync_file(source)
    for number in range(MAX_VARIANTS):
        if number in taken:
            continue
        target = directory / (base if number == 0 else _fit(stem, ext, MAX_NAME_BYTES, f"-{number}"))
        try:
            _publish(source, target)
        except FileExistsError:
            same = _same_content(target, src_stat, digest)
            if same:
                return _reuse(target, source, same)
            continue
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                raise
            return _place_copy(directory, name, source)
        _fsync_dir(directory)
        return target
    raise FileExistsError(f"{MAX_VARIANTS} files named like {base} already exist in {directory}")


def _publish(source: Path, target: Path) -> None:
    """Move ``source`` to ``target`` unless that name exists (then FileExistsError, and
    ``source`` stays)."""
    try:
        os.link(source, target)
    except FileExistsError:
        raise
    except OSError as exc:
        if exc.errno == errno.EXDEV:
            raise
        # no hard links here (FAT, some network shares): reserve the name, then replace it
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
        os.close(fd)
        try:
            os.replace(source, target)
        except BaseException:
            target.unlink(missing_ok=True)
            raise
    else:
        source.unlink()


def _place_copy(directory: Path, name: str, source: Path) -> Path:
    """``source`` is on another file system: copy it into ``directory`` first."""
    fd, temp = tempfile.mkstemp(dir=directory, prefix=".", suffix=".partial")
    try:
        with os.fdopen(fd, "wb") as out, open(source, "rb") as src:
            shutil.copyfileobj(src, out)
        placed = place(directory, name, Path(temp))
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    source.unlink()
    return placed


def _variant_number(existing: str, base: str, stem: str, ext: str) -> int | None:
    """``n`` when ``existing`` is the ``n``-th name :func:`place` tries for ``base`` (0 for it)."""
    if existing == base:
        return 0
    if ext and not existing.endswith(ext):
        return None
    body = existing[: len(existing) - len(ext)]
    _head, dash, digits = body.rpartition("-")
    if not dash or not digits.isascii() or not digits.isdigit() or digits[0] == "0" or len(digits) > 6:
        return None
    number = int(digits)
    if number >= MAX_VARIANTS or _fit(stem, ext, MAX_NAME_BYTES, f"-{number}") != existing:
        return None
    return number


def _lazy_digest(path: Path) -> Callable[[], str]:
    cache: list[str] = []

    def digest() -> str:
        if not cache:
            cache.append(_sha256(path))
        return cache[0]

    return digest


def _sha256(path: Path) -> str:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def _same_content(path: Path, src_stat: os.stat_result, digest: Callable[[], str]) -> str:
    """``"same file"`` when ``path`` is ``source`` itself, ``"same bytes"`` when it is a regular
    file with identical content, ``""`` otherwise (missing, a symlink, different)."""
    try:
        found = os.lstat(path)
        if not stat.S_ISREG(found.st_mode):
            return ""
        if os.path.samestat(found, src_stat):
            return "same file"
        if found.st_size != src_stat.st_size:
            return ""
        return "same bytes" if _sha256(path) == digest() else ""
    except OSError:
        return ""


def _reuse(found: Path, source: Path, same: str) -> Path:
    if same == "same bytes":
        source.unlink(missing_ok=True)
    return found


def _fsync_file(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):  # not possible on Windows
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# -- kinds ------------------------------------------------------------------------------------


def is_pdf(head: bytes) -> bool:
    """``True`` when ``head``, the leading bytes of a file, is a PDF's: it starts with
    ``%PDF-``, or has it in its first 1024 bytes (readers skip junk before it) and is not
    UTF-8 text (which may only be talking about PDFs)."""
    if head.startswith(b"%PDF-"):
        return True
    if head.find(b"%PDF-", 0, 1024) < 0:
        return False
    return _text_encoding(head, complete=False) in (None, "legacy")


def sniff(path: Path, mime: str | None, name: str) -> str:
    """The kind of a file: one of :data:`KINDS`.

    The first :data:`SNIFF_BYTES` bytes decide where they can: magic numbers for PDF, PNG,
    JPEG, GIF, WebP, TIFF, BMP, HEIC/AVIF, MP3, Ogg, FLAC, WAV, MIDI, MP4/QuickTime, Matroska,
    AVI, ZIP (also DOCX, XLSX, EPUB, JAR: "archive"), gzip, bzip2, xz, zstd, 7z, RAR, tar and
    executables ("binary"). Otherwise the file is "text" when it decodes as UTF-8, or as UTF-8
    or UTF-16 after a BOM, with no NUL and few control characters (an empty file is text too);
    or when ``mime``/``name`` say text and it has no NUL and few control characters (a CSV
    saved in a legacy encoding). Failing that, the kind ``mime`` or the extension of ``name``
    claims is used for image, audio, video and archive, and "binary" for the rest: a claim
    never makes a file "pdf" or "text" on its own.

    Args:
        path: the file (read here; it should be a regular file).
        mime: the MIME type the platform reported, parameters allowed; ``None`` if none.
        name: the file's name as sent, for its extension.

    Raises:
        OSError: the file cannot be read.
    """
    with open(path, "rb") as fh:
        head = fh.read(SNIFF_BYTES)
        complete = not fh.read(1)
    kind = _magic(head)
    if kind:
        return kind
    if not head:
        return "text"
    encoding = _text_encoding(head, complete)
    claimed = _claimed(mime, name)
    if encoding == "legacy" and claimed == "text":
        return "text"
    if encoding and encoding != "legacy":
        return "text"
    if _mpeg_audio(head):
        return "audio"
    return claimed if claimed in ("image", "audio", "video", "archive") else "binary"


def _magic(head: bytes) -> str | None:
    if is_pdf(head):
        return "pdf"
    for signature, kind in _SIGNATURES:
        if head.startswith(signature):
            return kind
    if head[:4] == b"RIFF" and head[8:12] in _RIFF:
        return _RIFF[head[8:12]]
    if head[:4] == b"FORM" and head[8:12] in (b"AIFF", b"AIFC"):
        return "audio"
    if head[:2] == b"\x00\x00" and head[4:8] == b"ftyp":
        brand = head[8:12]
        return "image" if brand in _FTYP_IMAGE else "audio" if brand in _FTYP_AUDIO else "video"
    if head[:5] == b"OggS\x00":
        return "video" if b"theora" in head[:512] else "audio"
    if head[:3] == b"ID3" and len(head) > 4 and head[3] in (2, 3, 4) and head[4] == 0:
        return "audio"
    if head[:2] == b"BM" and len(head) >= 14 and head[6:10] == b"\x00\x00\x00\x00":
        return "image"
    if head[:3] == b"BZh" and head[3:4].isdigit() and head[4:10] in (b"1AY&SY", b"\x17rE8P\x90"):
        return "archive"
    if head[257:262] == b"ustar":
        return "archive"
    if head[:2] == b"MZ" and b"\x00" in head[2:64]:
        return "binary"
    return None


def _mpeg_audio(head: bytes) -> bool:
    """An MPEG audio frame header (MP3, AAC/ADTS) at offset 0."""
    if len(head) < 3 or head[0] != 0xFF or head[1] & 0xE0 != 0xE0:
        return False
    return (head[1] >> 3) & 3 != 1 and head[2] >> 4 != 15


def _text_encoding(head: bytes, complete: bool) -> str | None:
    """How ``head`` decodes as text: ``"utf-8-sig"``, ``"utf-16"`` (after a BOM), ``"utf-8"``,
    ``"legacy"`` (not UTF-8 but no NUL and few controls), or ``None`` (binary)."""
    if head.startswith(codecs.BOM_UTF8):
        encoding = "utf-8-sig"
    elif head.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        encoding = "utf-16"
    else:
        if b"\x00" in head:
            return None
        encoding = "utf-8"
    try:
        text = codecs.getincrementaldecoder(encoding)("strict").decode(head, final=complete)
    except UnicodeDecodeError:
        if encoding != "utf-8":
            return None
        return None if _mostly_controls(head.decode("latin-1")) else "legacy"
    if "\x00" in text or _mostly_controls(text):
        return None
    return encoding


def _mostly_controls(text: str) -> bool:
    """More than 1 % of ``text`` is control characters text does not carry."""
    controls = sum(1 for char in text if (char < " " and char not in _TEXT_CONTROLS) or char == "\x7f")
    return controls * 100 > len(text)


def _claimed(mime: str | None, name: str) -> str | None:
    """The kind ``mime`` claims, else the kind the extension of ``name`` suggests."""
    kind = None
    if mime:
        essence = mime.split(";", 1)[0].strip().lower()
        major, _slash, minor = essence.partition("/")
        if major == "text" or essence in _TEXT_MIMES or minor.endswith(("+json", "+xml")):
            kind = "text"
        elif essence == "application/pdf":
            kind = "pdf"
        elif major in ("image", "audio", "video"):
            kind = major
        elif essence == "application/ogg":
            kind = "audio"
        elif essence in _ARCHIVE_MIMES:
            kind = "archive"
    if kind is None:
        _stem, dot, ext = name.rpartition(".")
        kind = _EXT_KINDS.get(ext.lower()) if dot else None
    return kind


# -- reading ----------------------------------------------------------------------------------


def excerpt(path: Path, max_chars: int) -> tuple[str, bool]:
    """The first ``max_chars`` characters of a text file, and whether the file goes on.

    Only about ``4 * max_chars + 4`` bytes are read (at least :data:`SNIFF_BYTES`, to tell text
    from binary). A BOM selects UTF-8 or UTF-16 and is not part of the text; other files are
    decoded as UTF-8 with ``errors="replace"``. When the text is cut and a newline lies in its
    last 20 %, it ends before that newline (and before a ``\\r`` there), not mid-line.

    Args:
        path: a text file.
        max_chars: most characters to return (``>= 0``).

    Returns:
        ``(text, cut)``; ``cut`` is ``True`` when the file has more than ``text``.

    Raises:
        DocumentError: the file is not text (a known binary format, NUL bytes, mostly control
            characters).
        ValueError: ``max_chars`` is negative.
        OSError: the file cannot be read.
    """
    if max_chars < 0:
        raise ValueError(f"max_chars must be >= 0, not {max_chars}")
    with open(path, "rb") as fh:
        data = fh.read(SNIFF_BYTES)
        need = 4 * max_chars + 4 + len(codecs.BOM_UTF8)
        if len(data) == SNIFF_BYTES and need > len(data):
            data += fh.read(need - len(data))
        more = bool(fh.read(1))
    encoding = _text_encoding(data[:SNIFF_BYTES], complete=not more and len(data) <= SNIFF_BYTES)
    if _magic(data) or (data and encoding is None):
        raise DocumentError("the file is not text")
    codec = encoding if encoding and encoding != "legacy" else "utf-8"
    text = codecs.getincrementaldecoder(codec)("replace").decode(data, final=not more)
    if not more and len(text) <= max_chars:
        return text, False
    text = text[:max_chars]
    newline = text.rfind("\n")
    if newline >= 0 and newline >= max_chars * 0.8:
        text = text[:newline].removesuffix("\r")
    return text, True


def pdf_text(
    source: Path | BinaryIO, *, max_chars: int | None = None, max_pages: int = 200
) -> tuple[str, int, bool]:
    """The text of a PDF, extracted with pypdf.

    pypdf is pure Python and slow (seconds for a long document): this is synchronous, so call it
    off the event loop (``await asyncio.to_thread(pdf_text, path)``). Pathological files are
    bounded by ``max_pages``, by stopping once ``max_chars`` is reached, and by pypdf's own
    decompression limits. An encrypted PDF is opened with the empty password when it has one.
    A page that fails to parse is shown as ``[page N could not be read]``; when every page
    fails, the PDF is corrupt.

    Args:
        source: the PDF file, or a binary file object open on it (seekable; not closed here).
        max_chars: most characters of text to return; ``None`` for no limit.
        max_pages: most pages to read (``>= 1``).

    Returns:
        ``(text, pages, cut)``: the pages' text joined by ``"\\n\\n--- page N ---\\n\\n"``
        (``""`` when no page has extractable text, e.g. scanned images), the document's page
        count, and whether the text stops early (``max_chars`` or ``max_pages``).

    Raises:
        DocumentError: the PDF is password-protected, uses encryption pypdf cannot open, or is
            corrupt ("the PDF could not be read: ...").
        ValueError: ``max_pages < 1`` or ``max_chars < 0``.
        OSError: ``source`` (a path) cannot be opened.
    """
    if max_pages < 1 or (max_chars is not None and max_chars < 0):
        raise ValueError(f"bad limits: max_pages={max_pages}, max_chars={max_chars}")
    if isinstance(source, Path):
        with open(source, "rb") as fh:
            return _pdf_text(fh, max_chars, max_pages)
    return _pdf_text(source, max_chars, max_pages)


#: Seconds one PDF may take to read in its worker process before it is given up: a tiny PDF
#: whose pages share one long content stream costs pypdf about 9 s a page.
PDF_TIMEOUT_S = 20.0


def pdf_text_bounded(
    source: Path | BinaryIO, *, max_chars: int | None = None, max_pages: int = 200, timeout_s: float = PDF_TIMEOUT_S
) -> tuple[str, int, bool]:
    """:func:`pdf_text` in a worker process that is killed after ``timeout_s`` seconds, so a
    pathological PDF costs a bounded time and never holds a thread (or the interpreter's
    lock) of the daemon. Synchronous: it waits for the worker, so call it off the event loop.
    ``source`` is a path or a binary file open on the PDF (its descriptor is handed to the
    worker, so a path checked once is the file read).

    Raises:
        DocumentError: as :func:`pdf_text`, or the PDF took longer than ``timeout_s``.
    """
    import subprocess

    fh = open(source, "rb") if isinstance(source, Path) else source  # noqa: SIM115 - closed below
    try:
        fd = fh.fileno()
        command = [sys.executable, "-m", "bumblebot.media.documents", str(fd), str(-1 if max_chars is None else max_chars), str(max_pages)]
        try:
            done = subprocess.run(command, pass_fds=(fd,), capture_output=True, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            raise DocumentError(f"the PDF took too long to read (over {timeout_s:g} s)") from None
    finally:
        if isinstance(source, Path):
            fh.close()
    try:
        answer = json.loads(done.stdout.decode("utf-8"))
    except ValueError:
        raise DocumentError("the PDF could not be read (its reader failed)") from None
    if "error" in answer:
        raise DocumentError(str(answer["error"]))
    return str(answer["text"]), int(answer["pages"]), bool(answer["cut"])


def _worker(argv: list[str]) -> None:
    """``python -m bumblebot.media.documents FD MAX_CHARS MAX_PAGES``: :func:`pdf_text` of the open
    descriptor ``FD``, as one JSON line on stdout."""
    fd, max_chars, max_pages = int(argv[0]), int(argv[1]), int(argv[2])
    with os.fdopen(fd, "rb", closefd=False) as fh:
        fh.seek(0)
        try:
            text, pages, cut = pdf_text(fh, max_chars=None if max_chars < 0 else max_chars, max_pages=max_pages)
            answer: dict[str, object] = {"text": text, "pages": pages, "cut": cut}
        except DocumentError as exc:
            answer = {"error": str(exc)}
    sys.stdout.write(json.dumps(answer, ensure_ascii=False))


def _pdf_text(fh: BinaryIO, max_chars: int | None, max_pages: int) -> tuple[str, int, bool]:
    try:
        reader = pypdf.PdfReader(fh)
        if reader.is_encrypted and not _decrypt(reader):
            raise DocumentError("the PDF is password-protected")
        count = len(reader.pages)
    except DocumentError:
        raise
    except Exception as exc:  # a malformed file raises anything (KeyError, ...)
        raise DocumentError(f"the PDF could not be read: {_reason(exc)}") from exc
    parts: list[str] = []
    length, cut, has_text = 0, count > max_pages, False
    failure: Exception | None = None
    for index in range(min(count, max_pages)):
        try:
            page = (reader.pages[index].extract_text() or "").replace("\x00", "").rstrip()
        except Exception as exc:  # noqa: BLE001 - one broken page must not lose the others
            failure = failure or exc
            page = f"[page {index + 1} could not be read]"
        else:
            has_text = has_text or bool(page.strip())
        part = page if index == 0 else f"\n\n--- page {index + 1} ---\n\n{page}"
        parts.append(part)
        length += len(part)
        if max_chars is not None and length >= max_chars:
            cut = cut or length > max_chars or index + 1 < min(count, max_pages)
            break
    if failure is not None and not has_text:
        raise DocumentError(f"the PDF could not be read: {_reason(failure)}") from failure
    if not has_text:
        return "", count, cut
    text = "".join(parts)
    return (text if max_chars is None else text[:max_chars]), count, cut


def _decrypt(reader: pypdf.PdfReader) -> bool:
    """Open ``reader`` with the empty password; ``False`` when a password is needed."""
    try:
        return reader.decrypt("") != pypdf.PasswordType.NOT_DECRYPTED
    except pypdf.errors.DependencyError as exc:
        raise DocumentError(
            "the PDF uses an encryption this bot cannot open (AES needs the cryptography package)"
        ) from exc


def _reason(exc: Exception) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 200 else text[:199] + "…"


def describe_size(n: int) -> str:
    """A size as people read it: ``"812 bytes"``, ``"14.2 KB"``, ``"3.4 MB"``, ``"1.5 GB"``.

    Units are binary (1 KB = 1024 bytes) but labelled KB/MB/GB, as Telegram shows sizes, with
    one decimal unless it is 0 (``"20 MB"``); a value that would round to 1024 moves to the
    next unit.

    Raises:
        ValueError: ``n`` is negative.
    """
    if n < 0:
        raise ValueError(f"negative size: {n}")
    if n < 1024:
        return "1 byte" if n == 1 else f"{n} bytes"
    value = n / 1024
    for unit in ("KB", "MB", "GB"):
        if round(value, 1) < 1024:
            return f"{_one_decimal(value)} {unit}"
        value /= 1024
    return f"{_one_decimal(value)} TB"


def _one_decimal(value: float) -> str:
    text = f"{value:.1f}"
    return text[:-2] if text.endswith(".0") else text


if __name__ == "__main__":
    _worker(sys.argv[1:])
