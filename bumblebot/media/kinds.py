"""What kind a file is, from its first bytes: :func:`sniff` and :func:`is_pdf`.

The MIME type the platform reports and the file's extension are only hints: the sender
controls both. The first :data:`SNIFF_BYTES` bytes decide where they can (magic numbers, text
that decodes cleanly); a claim never makes a file "pdf" or "text" on its own.
:func:`text_encoding` and :func:`magic_kind` also tell ``bumblebot.media.documents.excerpt``
whether a file is text, and :data:`EXT_KINDS` tells ``bumblebot.media.names`` which
extensions are known.
"""

from __future__ import annotations

import codecs
from pathlib import Path

from bumblebot.core.regular import open_regular_file

__all__ = ["EXT_KINDS", "KINDS", "SNIFF_BYTES", "is_pdf", "magic_kind", "sniff", "text_encoding"]

#: What :func:`sniff` answers.
KINDS = ("pdf", "text", "image", "audio", "video", "archive", "binary")
#: Leading bytes :func:`sniff` and ``excerpt`` look at.
SNIFF_BYTES = 8192


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
#: The kind each known extension suggests (lower case, without the dot).
EXT_KINDS: dict[str, str] = {
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


def is_pdf(head: bytes) -> bool:
    """``True`` when ``head``, the leading bytes of a file, is a PDF's: it starts with
    ``%PDF-``, or has it in its first 1024 bytes (readers skip junk before it) and is not
    UTF-8 text (which may only be talking about PDFs)."""
    if head.startswith(b"%PDF-"):
        return True
    if head.find(b"%PDF-", 0, 1024) < 0:
        return False
    return text_encoding(head, complete=False) in (None, "legacy")


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
        OSError: the file cannot be read, or is not a regular file
            (:class:`bumblebot.core.regular.NotRegularFile`).
    """
    with open_regular_file(path, follow=True) as fh:  # a named pipe is refused, not waited on
        head = fh.read(SNIFF_BYTES)
        complete = not fh.read(1)
    kind = magic_kind(head)
    if kind:
        return kind
    if not head:
        return "text"
    encoding = text_encoding(head, complete)
    claimed = _claimed(mime, name)
    if encoding == "legacy" and claimed == "text":
        return "text"
    if encoding and encoding != "legacy":
        return "text"
    if _mpeg_audio(head):
        return "audio"
    return claimed if claimed in ("image", "audio", "video", "archive") else "binary"


def magic_kind(head: bytes) -> str | None:
    """The kind the magic number at the start of ``head`` shows, ``None`` when there is none."""
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


def text_encoding(head: bytes, complete: bool) -> str | None:
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
        kind = EXT_KINDS.get(ext.lower()) if dot else None
    return kind

