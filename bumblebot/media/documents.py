"""Reading a document someone sent: the start of a text file, a PDF's text, its size.

The engine shows the model the start of a text file inline (:func:`excerpt`) and the text of
a PDF (:func:`pdf_text_bounded`: :func:`pdf_text` in a worker process that is killed after
:data:`PDF_TIMEOUT_S`, started as ``python -m bumblebot.media.documents``); the ``read_file``
tool reads PDFs the same way. :func:`describe_size` says how big a file is.

Where a document is saved and under which name is ``bumblebot.media.names``; its kind is
``bumblebot.media.kinds``.

Errors: a document that is corrupt or cannot be read raises :class:`DocumentError`, whose
message is written for the user ("the PDF is password-protected"). OS errors (a missing file,
a full disk) propagate as :class:`OSError`, and so does a path that is not a regular file (a
named pipe, whose read would block for ever): :class:`bumblebot.core.regular.NotRegularFile`,
raised without waiting on it.
"""

from __future__ import annotations

import codecs
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from bumblebot.core.errors import BumblebotError
from bumblebot.core.events import storable_text
from bumblebot.core.regular import open_regular_file
from bumblebot.media.kinds import SNIFF_BYTES, magic_kind, text_encoding

if TYPE_CHECKING:
    import pypdf

__all__ = ["PDF_TIMEOUT_S", "DocumentError", "describe_size", "excerpt", "pdf_text", "pdf_text_bounded"]


class DocumentError(BumblebotError):
    """A document is corrupt, encrypted or not of the kind asked for; ``str(exc)`` is written
    for the user ("the PDF is password-protected")."""


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
    with open_regular_file(path, follow=True) as fh:
        data = fh.read(SNIFF_BYTES)
        need = 4 * max_chars + 4 + len(codecs.BOM_UTF8)
        if len(data) == SNIFF_BYTES and need > len(data):
            data += fh.read(need - len(data))
        more = bool(fh.read(1))
    encoding = text_encoding(data[:SNIFF_BYTES], complete=not more and len(data) <= SNIFF_BYTES)
    if magic_kind(data) or (data and encoding is None):
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
        with open_regular_file(source, follow=True) as fh:
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

    fh = open_regular_file(source, follow=True) if isinstance(source, Path) else source
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
    return storable_text(str(answer["text"])), int(answer["pages"]), bool(answer["cut"])


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
    # ASCII: pypdf returns lone surrogates from a malformed ToUnicode map, which a UTF-8 stdout
    # cannot write; the daemon takes them back as U+FFFD
    sys.stdout.write(json.dumps(answer))


def _pdf_text(fh: BinaryIO, max_chars: int | None, max_pages: int) -> tuple[str, int, bool]:
    import pypdf  # here, not at the top: reading a PDF is rare, and the daemon starts faster without it

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
    import pypdf

    try:
        return reader.decrypt("") != pypdf.PasswordType.NOT_DECRYPTED
    except pypdf.errors.DependencyError as exc:
        raise DocumentError(
            "the PDF uses an encryption this bot cannot open (AES needs the cryptography package)"
        ) from exc


def _reason(exc: Exception) -> str:
    """Why a PDF could not be read, in the reader's words (a user reads it: never the
    exception's name)."""
    text = " ".join(str(exc).split()) or "it seems damaged"
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
    return text.removesuffix(".0")


if __name__ == "__main__":
    _worker(sys.argv[1:])
