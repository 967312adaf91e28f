"""Where a file someone sent goes: a safe name, in the chat's inbox folder, never over another.

The engine saves each document under ``<workspace>/inbox/<chat>/<name>``: :data:`INBOX` and
:func:`chat_folder` name the folder, :func:`safe_name` makes the sender's file name safe on
Linux, macOS and Windows, and :func:`place` moves the finished download there without
overwriting anything (a numbered variant when the name is taken; the existing file when it
already holds the same bytes).

What is trusted: nothing the sender controls. The name may hold ``..``, separators, control
characters, bidirectional controls or a Windows device name.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
import stat
import tempfile
import unicodedata
from collections.abc import Callable
from pathlib import Path

import regex

from bumblebot.core.regular import open_regular
from bumblebot.media.kinds import EXT_KINDS

__all__ = ["INBOX", "MAX_NAME_BYTES", "MAX_VARIANTS", "chat_folder", "fit_name", "name_max", "place", "safe_name"]

#: Longest name :func:`safe_name` returns, in UTF-8 bytes (file systems allow 255).
MAX_NAME_BYTES = 120
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


def fit_name(name: str, max_bytes: int) -> str:
    """``name`` in at most ``max_bytes`` UTF-8 bytes: its stem shortened, never inside a
    character or a grapheme cluster, its extension kept (``.tar.gz`` and its kin count as one);
    ``name`` itself when it fits."""
    if len(name.encode("utf-8")) <= max_bytes:
        return name
    stem, ext = _split_ext(name)
    return _fit(stem, ext, max_bytes)


def name_max(directory: Path) -> int:
    """The longest file name, in bytes, the file system of ``directory`` takes (asked of its
    nearest existing parent when it does not exist yet); 255 when the system does not say."""
    for folder in (directory, *directory.parents):
        try:
            return int(os.pathconf(folder, "PC_NAME_MAX"))
        except (OSError, ValueError):
            continue
    return 255


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
    return ("." + lowered) in _DOUBLE_EXTS or ("." not in lowered and lowered in EXT_KINDS)


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
    digest = _lazy_digest(source)

    taken: set[int] = set()
    for number, found in _variants_present(directory, base):
        same = _same_content(found, src_stat, digest)
        if same:
            return _reuse(found, source, same)
        taken.add(number)

    _fsync_file(source)
    return _publish_free(directory, name, base, source, src_stat, digest, taken)


def _variants_present(directory: Path, base: str) -> list[tuple[int, Path]]:
    """The files in ``directory`` named ``base`` or one of its numbered variants, by name,
    with their numbers (0 for ``base`` itself)."""
    stem, ext = _split_ext(base)
    with os.scandir(directory) as entries:
        names = [entry.name for entry in entries]
    present = []
    for existing in sorted(names):
        number = _variant_number(existing, base, stem, ext)
        if number is not None:
            present.append((number, directory / existing))
    return present


def _publish_free(
    directory: Path,
    name: str,
    base: str,
    source: Path,
    src_stat: os.stat_result,
    digest: Callable[[], str],
    taken: set[int],
) -> Path:
    """Publish ``source`` under the first name of ``base``'s variants not ``taken``: one that
    appears meanwhile is skipped, or reused when it holds the same bytes (see :func:`place`)."""
    stem, ext = _split_ext(base)
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
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
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
    with os.fdopen(open_regular(path), "rb") as fh:
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
