"""File tools confined to the workspace: read, write, append, list, search.

Confinement rule: every path the
model gives is joined to the workspace and resolved with :meth:`pathlib.Path.resolve`,
which follows symlinks (also dangling ones, to the path they name). The result must be
the workspace itself or inside it, otherwise the call is refused with
``path escapes the workspace: <path>``. So ``..`` escapes, absolute paths outside the
workspace, and symlinks inside the workspace that point outside are all refused, for
every operation. A leading ``~`` is refused too: it is never expanded (the daemon's home
is not the workspace) and a literal ``~`` directory would only confuse.

After the check, files are opened by their resolved path with ``O_NOFOLLOW``, and writes
go to a temporary file that replaces the target, so a symlink swapped in after the check
is not written through. ``list_directory`` and ``search_files`` never descend into
symlinked directories and skip symlinked files that resolve outside the workspace.

Only regular files are read or written (:func:`bumblebot.core.regular.open_regular`: opened
with ``O_NONBLOCK``, then checked with ``fstat``): a named pipe or a device the shell made in
the workspace would otherwise block the worker thread for ever. ``read_file``,
``write_file`` and ``append_file`` refuse one (``notes.txt is not a regular file (a named
pipe)``), ``search_files`` skips it without opening it, ``list_directory`` lists it with its
kind.

PDFs: ``read_file`` on a file whose first bytes are a PDF's (:func:`bumblebot.media.kinds.is_pdf`,
whatever its name) returns the text pypdf extracts (:func:`bumblebot.media.documents.pdf_text`, at
most :data:`PDF_MAX_PAGES` pages and :data:`PDF_MAX_CHARS` characters), after a first line
saying so, and pages through it with the same ``offset_line``/``max_lines``/64 KiB rules as a
text file. The extraction is cached per file (path, inode, mtime, size) in a small LRU
(:data:`PDF_CACHE_ENTRIES` entries, :data:`PDF_CACHE_CHARS` characters in all), so paging
through a PDF parses it once. The file is read through the same ``O_NOFOLLOW`` descriptor.

Limits: ``read_file`` returns at most :data:`READ_CAP_BYTES` bytes and ``max_lines``
lines; ``list_directory`` at most :data:`MAX_LIST_ENTRIES` entries; ``search_files`` at
most :data:`MAX_SEARCH_MATCHES` matches, skipping binary files and files over
:data:`MAX_SEARCH_FILE_BYTES`.
"""

from __future__ import annotations

import asyncio
import io
import os
import stat
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

import regex
from pydantic import BaseModel, Field

from bumblebot.core.regular import NotRegularFile, describe_kind, open_regular
from bumblebot.core.toolkit import ToolContext, ToolKind, ToolResult
from bumblebot.media.documents import DocumentError, pdf_text_bounded
from bumblebot.media.kinds import is_pdf
from bumblebot.media.names import INBOX, chat_folder, fit_name, name_max

from .definition import Tool, tool

__all__ = [
    "FILE_TOOLS",
    "MAX_LIST_ENTRIES",
    "MAX_SEARCH_FILE_BYTES",
    "MAX_SEARCH_MATCHES",
    "PDF_MAX_CHARS",
    "PDF_MAX_PAGES",
    "READ_CAP_BYTES",
    "PathError",
    "PathEscapeError",
    "append_file",
    "list_directory",
    "read_file",
    "chat_inbox",
    "inbox_allowed",
    "resolve_in_workspace",
    "search_files",
    "write_file",
]

#: Most bytes one ``read_file`` call returns.
READ_CAP_BYTES = 64 * 1024
#: ``read_file`` extracts at most this many pages of a PDF.
PDF_MAX_PAGES = 200
#: ``read_file`` extracts at most this many characters of a PDF's text.
PDF_MAX_CHARS = 1_000_000
#: Most PDF extractions kept for paging, and most characters they hold together.
PDF_CACHE_ENTRIES = 8
PDF_CACHE_CHARS = 4_000_000
#: Most entries one ``list_directory`` call returns.
MAX_LIST_ENTRIES = 500
#: Most matches one ``search_files`` call returns.
MAX_SEARCH_MATCHES = 200
#: Files larger than this are skipped by ``search_files``.
MAX_SEARCH_FILE_BYTES = 1024 * 1024
#: ``search_files`` stops after looking at this many files.
MAX_SEARCH_FILES = 20_000
#: Wall-clock budget of one search_files call, seconds (a pathological regex stops here).
SEARCH_BUDGET_S = 10.0
#: Directories ``search_files`` does not enter.
SEARCH_SKIP_DIRS = frozenset({".git", "__pycache__", "node_modules", ".venv"})
#: A NUL byte in this many leading bytes marks a file as binary.
_SNIFF_BYTES = 8192
#: Longest matching line shown by ``search_files``, in characters.
_MAX_MATCH_LINE = 300


class PathError(ValueError):
    """A path the file tools refuse; the message is shown to the model."""


class PathEscapeError(PathError):
    """A path that resolves outside the workspace."""


def resolve_in_workspace(workspace: Path, path: str, *, chat: str = "", own_only: bool = False) -> Path:
    """Resolve ``path`` (relative to ``workspace``) and check it stays inside.

    Args:
        workspace: the confinement root (resolved here too).
        path: what the model gave; relative, or absolute inside the workspace.
        chat: the conversation key of the turn: the files people sent in other chats
            (``inbox/<their chat>/``) are refused, as their memory is (``""``: no check).
        own_only: only the chat's own folder (``inbox/<chat>/``) may be touched: the turn's
            chat may not reach the workspace trusted chats share (``ToolContext.own_files_only``).
            A relative path then starts in that folder (``notes.md`` is
            ``inbox/<chat>/notes.md``), unless it starts with ``inbox/`` (as the paths of the
            files people sent are given).

    Returns:
        The resolved absolute path: the workspace itself or a path inside it. It need not
        exist.

    Raises:
        PathEscapeError: if the path starts with ``~`` or resolves outside the workspace
            (through ``..``, an absolute path or a symlink, dangling or not).
        PathError: if the path contains a NUL byte or cannot be resolved (symlink loop).
    """
    if "\x00" in path:
        raise PathError(f"invalid path (contains a NUL byte): {path!r}")
    parts = Path(path).parts
    if parts and parts[0].startswith("~"):
        raise PathEscapeError(
            f"path escapes the workspace: {path} ('~' is not expanded; "
            "use a path relative to the workspace)"
        )
    root = workspace.resolve()
    base = root / chat_inbox(chat) if own_only and chat and parts[:1] != (INBOX,) else root
    try:
        target = (base / path).resolve()
    except (OSError, RuntimeError) as exc:
        raise PathError(f"cannot resolve path {path}: {exc}") from exc
    if not target.is_relative_to(root):
        raise PathEscapeError(f"path escapes the workspace: {path}")
    if chat and not inbox_allowed(root, target, chat):
        raise PathError(f"{path} holds files sent in another chat; this chat's are in {chat_inbox(chat)}/")
    if chat and own_only and not inbox_allowed(root, target, chat, own_only):
        raise PathError(f"{path} is outside this chat's folder: here the file tools reach only {chat_inbox(chat)}/")
    return target


def chat_inbox(chat: str) -> str:
    """The folder (relative to the workspace) of the files people sent in the conversation
    with key ``chat``: ``inbox/<chat folder>``."""
    return f"{INBOX}/{chat_folder(chat)}"


def inbox_allowed(root: Path, target: Path, chat: str, own_only: bool = False) -> bool:
    """Whether a turn of ``chat`` may touch ``target``: anything but another chat's inbox; with
    ``own_only``, only what is in its own inbox."""
    inbox = root / INBOX
    if own_only:
        return target.is_relative_to(inbox / chat_folder(chat))
    if not target.is_relative_to(inbox) or target == inbox:
        return True
    return target.relative_to(inbox).parts[0] == chat_folder(chat)


def _own_folder(root: Path, chat: str, own_only: bool) -> None:
    """A chat confined to its own folder finds it, empty, before anyone sent a file there."""
    if own_only and chat:
        (root / chat_inbox(chat)).mkdir(parents=True, exist_ok=True)


def _display(root: Path, target: Path) -> str:
    relative = target.relative_to(root).as_posix()
    return relative if relative != "." else "."


def _is_binary(head: bytes) -> bool:
    return b"\x00" in head[:_SNIFF_BYTES]


async def _run(fn: Callable[..., ToolResult | str], workspace: Path, *args: object) -> ToolResult | str:
    """Run a blocking file operation on ``workspace`` in a thread; refusals and OS errors
    become errors, naming paths as the tools take them (relative to the workspace)."""
    try:
        return await asyncio.to_thread(fn, workspace, *args)
    except PathError as exc:
        return ToolResult.error(str(exc))
    except NotRegularFile as exc:
        return ToolResult.error(f"{_shown_name(workspace, exc.filename)} is not a regular file ({exc.kind})")
    except OSError as exc:
        where = f"{_shown_name(workspace, exc.filename)}: " if exc.filename else ""
        return ToolResult.error(f"{where}{exc.strerror or exc}")


def _shown_name(workspace: Path, name: object) -> str:
    """A path an OS error names, relative to the workspace (only its last part when it lies
    outside)."""
    path = Path(os.fsdecode(name))  # type: ignore[arg-type]
    root = workspace.resolve()
    return _display(root, path) if path.is_relative_to(root) else path.name


# -- read_file ----------------------------------------------------------------------------


class ReadFileArgs(BaseModel):
    path: str = Field(description="Path relative to the workspace")
    offset_line: int = Field(1, ge=1, description="First line to return, counting from 1")
    max_lines: int = Field(400, ge=1, le=2000, description="Most lines to return")
    line_numbers: bool = Field(False, description="Prefix each line with its number")


@tool(kind=ToolKind.WORK, brief="Read a text file (or a PDF's text) of the workspace.")
async def read_file(ctx: ToolContext, args: ReadFileArgs) -> ToolResult | str:
    """Read a text file from the workspace (at most 64 KiB per call; use offset_line to
    continue). For a PDF, reads the text extracted from it, paged the same way."""
    return await _run(_read_sync, ctx.workspace, args, ctx.conversation, ctx.own_files_only)


def _read_sync(workspace: Path, args: ReadFileArgs, chat: str = "", own_only: bool = False) -> ToolResult | str:
    root = workspace.resolve()
    target = resolve_in_workspace(root, args.path, chat=chat, own_only=own_only)
    shown = _display(root, target)
    if not target.exists():
        return ToolResult.error(f"no such file: {shown}")
    if target.is_dir():
        return ToolResult.error(f"{shown} is a directory; use list_directory")
    fd = open_regular(target)
    with os.fdopen(fd, "rb") as fh:
        head = fh.read(_SNIFF_BYTES)
        if is_pdf(head):
            return _read_pdf(fh, target, shown, args)
        if _is_binary(head):
            size = os.fstat(fh.fileno()).st_size
            return ToolResult.error(f"{shown} is a binary file ({size} bytes); not shown")
        fh.seek(0)
        return _read_lines(fh, shown, args)


def _read_lines(fh: BinaryIO, shown: str, args: ReadFileArgs) -> ToolResult | str:
    """The window of ``fh`` (a binary stream at its start) that ``args`` asks for, with the
    footer that says how to continue."""
    line_no = 1
    while line_no < args.offset_line:
        chunk = fh.readline(READ_CAP_BYTES)
        if not chunk:
            return ToolResult.error(
                f"offset_line {args.offset_line} is past the end of {shown} "
                f"({line_no - 1} lines)"
            )
        if chunk.endswith(b"\n"):
            line_no += 1
    lines: list[bytes] = []
    used = 0
    cut_mid_line = more = False
    while len(lines) < args.max_lines and used < READ_CAP_BYTES:
        line = fh.readline(READ_CAP_BYTES - used)
        if not line:
            break
        if not line.endswith(b"\n") and fh.read(1):
            # the line does not fit: show it cut only if it is the first one
            cut_mid_line = not lines
            if cut_mid_line:
                lines.append(line)
            more = True
            break
        used += len(line)
        lines.append(line)
    else:
        more = bool(fh.read(1))
    text = _format_lines(lines, args.offset_line, args.line_numbers)
    if not lines:
        return "(empty file)" if args.offset_line == 1 else f"(no lines after line {line_no - 1})"
    if more:
        next_line = args.offset_line + len(lines) - (1 if cut_mid_line else 0)
        why = (
            f"line {next_line} is longer than {READ_CAP_BYTES // 1024} KiB and was cut"
            if cut_mid_line
            else f"continue with offset_line={next_line}"
        )
        last = args.offset_line + len(lines) - 1
        text += f"\n[... showed lines {args.offset_line}-{last} of {shown}; {why}]"
    return text


def _read_pdf(fh: BinaryIO, target: Path, shown: str, args: ReadFileArgs) -> ToolResult | str:
    """``read_file`` on a PDF: its extracted text, paged like a text file."""
    try:
        text, pages, cut = _extract_pdf(fh, target)
    except DocumentError as exc:
        return ToolResult.error(f"{shown}: {exc}")
    of = f"a PDF of {pages} page{'' if pages == 1 else 's'}"
    if not text:
        return f"{shown} is {of} with no extractable text; it may be scanned images"
    note = ""
    if cut:
        note = (
            f"; only its first {PDF_MAX_PAGES} pages were read"
            if pages > PDF_MAX_PAGES
            else f"; only its first {PDF_MAX_CHARS} characters were kept"
        )
    body = _read_lines(io.BytesIO(text.encode("utf-8")), shown, args)
    if isinstance(body, ToolResult):
        return body
    return f"[text extracted from {of}{note}]\n{body}"


_pdf_cache: OrderedDict[tuple[str, int, int, int, int], tuple[str, int, bool]] = OrderedDict()
_pdf_cache_lock = threading.Lock()


def _extract_pdf(fh: BinaryIO, target: Path) -> tuple[str, int, bool]:
    """:func:`pdf_text` of the open PDF ``fh``, through the LRU cache.

    Raises:
        DocumentError: the PDF cannot be read (not cached: it is quick to find again).
    """
    st = os.fstat(fh.fileno())
    key = (str(target), st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)
    with _pdf_cache_lock:
        if key in _pdf_cache:
            _pdf_cache.move_to_end(key)
            return _pdf_cache[key]
    fh.seek(0)
    result = pdf_text_bounded(fh, max_chars=PDF_MAX_CHARS, max_pages=PDF_MAX_PAGES)
    with _pdf_cache_lock:
        _pdf_cache[key] = result
        total = sum(len(text) for text, _pages, _cut in _pdf_cache.values())
        while len(_pdf_cache) > PDF_CACHE_ENTRIES or (total > PDF_CACHE_CHARS and len(_pdf_cache) > 1):
            _old, (text, _pages, _cut) = _pdf_cache.popitem(last=False)
            total -= len(text)
    return result


def _format_lines(lines: list[bytes], first: int, numbered: bool) -> str:
    decoded = [raw.decode("utf-8", errors="replace") for raw in lines]
    if not numbered:
        return "".join(decoded)
    return "".join(
        f"{first + index:>6}\t{line if line.endswith(chr(10)) else line + chr(10)}"
        for index, line in enumerate(decoded)
    ).rstrip("\n")


# -- write_file / append_file -------------------------------------------------------------


class WriteFileArgs(BaseModel):
    path: str = Field(description="Path relative to the workspace")
    content: str = Field(description="The whole new content of the file")


@tool(kind=ToolKind.WORK, brief="Create or overwrite a file of the workspace.")
async def write_file(ctx: ToolContext, args: WriteFileArgs) -> ToolResult | str:
    """Create or overwrite a file in the workspace with the given content (parent
    directories are created)."""
    return await _run(_write_sync, ctx.workspace, args.path, args.content, ctx.conversation, ctx.own_files_only)


def _writable_target(workspace: Path, path: str, chat: str = "", own_only: bool = False) -> tuple[Path, Path, str]:
    """Where a write goes: ``path`` resolved in the workspace, its parents created; a last
    part longer than its file system allows is shortened (its extension kept) and the result
    names the path written."""
    root = workspace.resolve()
    target = resolve_in_workspace(root, path, chat=chat, own_only=own_only)
    target = target.with_name(fit_name(target.name, name_max(target.parent)))
    shown = _display(root, target)
    if target == root or target.is_dir():
        raise PathError(f"{shown} is a directory")
    if target == root / INBOX:
        raise PathError(f"{INBOX} is where the files people send are kept; choose another name")
    target.parent.mkdir(parents=True, exist_ok=True)
    return root, target, shown


def _write_sync(workspace: Path, path: str, content: str, chat: str = "", own_only: bool = False) -> str:
    _root, target, shown = _writable_target(workspace, path, chat, own_only)
    data = content.encode("utf-8")
    try:  # the owner's permissions of the file replaced; nothing for the group or others
        found = os.stat(target, follow_symlinks=False).st_mode
    except FileNotFoundError:
        found = stat.S_IFREG | 0o600
    if not stat.S_ISREG(found):  # a named pipe, a socket: not the file write_file makes
        raise NotRegularFile(target, describe_kind(found))
    mode = found & 0o700
    fd, temp = tempfile.mkstemp(dir=target.parent, prefix=f".{fit_name(target.name, 100)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.chmod(temp, mode)
        os.replace(temp, target)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    return f"wrote {len(data)} bytes to {shown}"


class AppendFileArgs(BaseModel):
    path: str = Field(description="Path relative to the workspace")
    content: str = Field(description="Text to add at the end of the file")


@tool(kind=ToolKind.WORK, brief="Append text to a file of the workspace.")
async def append_file(ctx: ToolContext, args: AppendFileArgs) -> ToolResult | str:
    """Append text to the end of a file in the workspace (created if missing)."""
    return await _run(_append_sync, ctx.workspace, args.path, args.content, ctx.conversation, ctx.own_files_only)


def _append_sync(workspace: Path, path: str, content: str, chat: str = "", own_only: bool = False) -> str:
    _root, target, shown = _writable_target(workspace, path, chat, own_only)
    data = content.encode("utf-8")
    fd = open_regular(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    with os.fdopen(fd, "ab") as fh:
        fh.write(data)
    return f"appended {len(data)} bytes to {shown}"


# -- list_directory -----------------------------------------------------------------------


class ListDirectoryArgs(BaseModel):
    path: str = Field(".", description="Directory relative to the workspace")


@tool(kind=ToolKind.WORK, brief="List a directory of the workspace.")
async def list_directory(ctx: ToolContext, args: ListDirectoryArgs) -> ToolResult | str:
    """List a directory of the workspace; directories end with "/", symlinks with "@", and
    what is neither a file nor these says its kind ("(a named pipe)")."""
    return await _run(_list_sync, ctx.workspace, args.path, ctx.conversation, ctx.own_files_only)


def _list_sync(workspace: Path, path: str, chat: str = "", own_only: bool = False) -> ToolResult | str:
    root = workspace.resolve()
    _own_folder(root, chat, own_only)
    target = resolve_in_workspace(root, path, chat=chat, own_only=own_only)
    shown = _display(root, target)
    if not target.exists():
        return ToolResult.error(f"no such directory: {shown}")
    if not target.is_dir():
        return ToolResult.error(f"{shown} is not a directory")
    with os.scandir(target) as scan:
        entries = sorted(
            (e for e in scan if not chat or inbox_allowed(root, Path(e.path), chat, own_only)), key=lambda entry: entry.name
        )
    lines = [f"{shown}/ ({len(entries)} entries)"]
    for entry in entries[:MAX_LIST_ENTRIES]:
        lines.append(_describe_entry(root, entry))
    if len(entries) > MAX_LIST_ENTRIES:
        lines.append(f"[... and {len(entries) - MAX_LIST_ENTRIES} more]")
    return "\n".join(lines)


def _describe_entry(root: Path, entry: os.DirEntry[str]) -> str:
    if entry.is_symlink():
        try:
            inside = Path(entry.path).resolve().is_relative_to(root)
        except (OSError, RuntimeError):
            inside = False
        return f"{entry.name}@" if inside else f"{entry.name}@ (points outside the workspace)"
    if entry.is_dir(follow_symlinks=False):
        return f"{entry.name}/"
    if entry.is_file(follow_symlinks=False):
        return entry.name
    try:
        return f"{entry.name} ({describe_kind(entry.stat(follow_symlinks=False).st_mode)})"
    except OSError:
        return entry.name


# -- search_files -------------------------------------------------------------------------


class SearchFilesArgs(BaseModel):
    pattern: str = Field(min_length=1, description="Text (or regular expression) to find")
    path: str = Field(".", description="Directory (or file) relative to the workspace")
    regex: bool = Field(False, description="Treat pattern as a Python regular expression")
    ignore_case: bool = Field(False, description="Match regardless of letter case")


@tool(kind=ToolKind.WORK, brief="Search the workspace files for a pattern.")
async def search_files(ctx: ToolContext, args: SearchFilesArgs) -> ToolResult | str:
    """Search the text files of the workspace for a pattern, line by line (skips binary
    files, files over 1 MiB and .git, node_modules, .venv, __pycache__)."""
    return await _run(_search_sync, ctx.workspace, args, ctx.conversation, ctx.own_files_only)


def _search_sync(workspace: Path, args: SearchFilesArgs, chat: str = "", own_only: bool = False) -> ToolResult | str:
    root = workspace.resolve()
    _own_folder(root, chat, own_only)
    target = resolve_in_workspace(root, args.path, chat=chat, own_only=own_only)
    shown = _display(root, target)
    flags = regex.IGNORECASE if args.ignore_case else 0
    source = args.pattern if args.regex else regex.escape(args.pattern)
    try:
        matcher = regex.compile(source, flags)
    except regex.error as exc:
        return ToolResult.error(f"invalid regular expression: {exc}")
    if not target.exists():
        return ToolResult.error(f"no such file or directory: {shown}")
    if not target.is_dir() and not target.is_file():
        raise NotRegularFile(target, describe_kind(target.stat().st_mode))
    matches: list[str] = []
    scanned = 0
    deadline = time.monotonic() + SEARCH_BUDGET_S
    try:
        for file, real in _walk_files(root, target, chat, own_only):
            scanned += 1
            if scanned > MAX_SEARCH_FILES or len(matches) >= MAX_SEARCH_MATCHES:
                break
            _search_file(root, file, real, matcher, matches, deadline)
    except TimeoutError:
        return ToolResult.error(
            f"the search took longer than {SEARCH_BUDGET_S:g} s and was stopped "
            "(a regular expression with nested repetition can backtrack for ever); simplify the pattern"
        )
    header = f"{len(matches)} matches for {args.pattern!r} in {shown}"
    if len(matches) >= MAX_SEARCH_MATCHES:
        header += f" (stopped at {MAX_SEARCH_MATCHES})"
    elif scanned > MAX_SEARCH_FILES:
        header += f" (stopped after {MAX_SEARCH_FILES} files)"
    return "\n".join([header, *matches[:MAX_SEARCH_MATCHES]])


def _walk_files(root: Path, target: Path, chat: str = "", own_only: bool = False) -> Iterator[tuple[Path, Path]]:
    """Files under ``target`` in a stable order, never following symlinks out (nor into
    another chat's inbox): each as its path under ``target`` and the path it resolves to."""
    if not target.is_dir():
        yield target, target
        return
    for dirpath, dirnames, filenames in os.walk(target, followlinks=False):
        dirnames[:] = sorted(
            d for d in dirnames
            if d not in SEARCH_SKIP_DIRS and (not chat or inbox_allowed(root, Path(dirpath, d), chat, own_only))
        )
        for name in sorted(filenames):
            file = real = Path(dirpath, name)
            if file.is_symlink():
                try:
                    real = file.resolve()
                except (OSError, RuntimeError):
                    continue
                if not real.is_relative_to(root) or (chat and not inbox_allowed(root, real, chat, own_only)):
                    continue
            yield file, real


def _search_file(
    root: Path, file: Path, real: Path, matcher: regex.Pattern[str], out: list[str], deadline: float
) -> None:
    """Append ``file``'s matching lines to ``out`` (read at ``real``, where it resolves to). A
    file that is not regular (a named pipe) is skipped without being opened.

    Raises:
        TimeoutError: ``deadline`` (monotonic seconds) passed; the ``regex`` module enforces it
            inside a single match too, and releases the GIL while matching, so a pathological
            pattern can neither hang the search nor stall the event loop.
    """
    try:
        found = os.stat(real, follow_symlinks=False)
        if not stat.S_ISREG(found.st_mode) or found.st_size > MAX_SEARCH_FILE_BYTES:
            return
        with os.fdopen(open_regular(real), "rb") as fh:
            data = fh.read(MAX_SEARCH_FILE_BYTES + 1)
    except OSError:
        return
    if len(data) > MAX_SEARCH_FILE_BYTES:
        return
    if _is_binary(data):
        return
    shown = _display(root, file)
    for number, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        if matcher.search(line, timeout=remaining, concurrent=True):
            text = line.strip()
            if len(text) > _MAX_MATCH_LINE:
                text = text[:_MAX_MATCH_LINE] + "..."
            out.append(f"{shown}:{number}: {text}")
            if len(out) >= MAX_SEARCH_MATCHES:
                return


#: The file tools, in the order they are offered.
FILE_TOOLS: tuple[Tool, ...] = (read_file, write_file, append_file, list_directory, search_files)
