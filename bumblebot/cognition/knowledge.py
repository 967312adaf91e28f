"""Durable facts, as Markdown H2 sections: one file shared by all conversations, one per
conversation (:class:`Memory`), each a :class:`KnowledgeFile`.

**Privacy**: a fact the entity learns in a conversation (the ``remember`` tool, the
compaction memory flush) goes to that conversation's file, ``<data_dir>/knowledge/<chat>.md``,
and appears only in that conversation's prompts and ``recall``. ``<data_dir>/knowledge.md`` is
**global**: the operator's file, read in every conversation and never written by the entity
(what an older version flushed there stays global).

Format (docs/compaction.md, "One compaction, pass by pass")::

    # Knowledge            <- preamble, kept as is
    ## [locked] About yourself
    body ...
    ## User prefs
    body ...

A section is *locked* when its title starts with ``[locked]`` (case-insensitive). Locked
sections are written by the operator only: :meth:`KnowledgeFile.append_sections` never
touches them, never adds a title that starts with ``[locked]`` and never adds a section whose
title equals a locked one without the prefix. Lines inside fenced code blocks are never read
as headings.

Writes are atomic (temporary file in the same directory, ``fsync``, ``os.replace``) and
serialised by a per-path re-entrant :class:`threading.RLock` shared by every
:class:`KnowledgeFile` of the process, so concurrent conversations of one entity cannot lose
each other's appends. Another process writing the same file at the same time is not guarded
against (one daemon per entity).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from bumblebot.core.regular import open_regular_file

#: Content of a newly created knowledge file.
SEED = "# Knowledge\n"

LOCKED_PREFIX = "[locked]"

_H2 = re.compile(r"^##(?!#)(?:[ \t]+(.*?))??(?:[ \t]+#+)?[ \t]*$")
_CLOSING = re.compile(r"(?:^|[ \t])#+$")
_NEWLINE = re.compile(r"\r\n|\r|\n")
_FENCE = re.compile(r"^[ \t]{0,3}(```|~~~)")
_BODY_HEADING = re.compile(r"^([ \t]{0,3})(#{1,2})(?=[ \t]|$)", re.MULTILINE)

_WORD = re.compile(r"[^\W_]{3,}", re.UNICODE)
#: Words too common to say that a fact is relevant.
_STOPWORDS = frozenset(
    "the and you your for are was were what who whom how why when where which this that these those "
    "with from have has had not but can will would about into out our its his her they them their "
    "she him all any one".split()
)
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")
#: A conversation file name keeps at most this many characters of the conversation key.
MAX_NAME = 80

_locks: dict[str, threading.RLock] = {}
_locks_guard = threading.Lock()


def _lock_for(path: Path) -> threading.RLock:
    key = os.path.realpath(path)
    with _locks_guard:
        return _locks.setdefault(key, threading.RLock())


@dataclass(frozen=True, slots=True)
class Section:
    """One ``## title`` section; ``body`` is the text up to the next H2, stripped."""

    title: str
    body: str
    locked: bool


def is_locked_title(title: str) -> bool:
    """``True`` when ``title`` starts with ``[locked]`` (case-insensitive, after whitespace)."""
    return title.lstrip().casefold().startswith(LOCKED_PREFIX)


def normalize_title(title: str) -> str:
    """Comparison key of a title: ``[locked]`` prefix removed, whitespace collapsed, casefolded."""
    t = title.strip()
    if is_locked_title(t):
        t = t.lstrip()[len(LOCKED_PREFIX) :]
    return " ".join(t.split()).casefold()


def parse_sections(text: str) -> list[Section]:
    """The H2 sections of ``text`` in file order (the preamble before the first H2 is skipped)."""
    sections: list[Section] = []
    title: str | None = None
    body: list[str] = []
    in_fence = False

    def close() -> None:
        if title is not None:
            sections.append(Section(title, "\n".join(body).strip(), is_locked_title(title)))

    for line in _NEWLINE.split(text):
        if _FENCE.match(line):
            in_fence = not in_fence
        heading = None if in_fence else _H2.match(line)
        if heading:
            close()
            title, body = heading.group(1) or "", []
        else:
            body.append(line)
    close()
    return sections


def clean_title(title: str) -> str:
    """``title`` as written: one line, whitespace collapsed, no leading or closing ``#``s."""
    t = " ".join(title.split())
    while True:
        cleaned = _CLOSING.sub("", t.lstrip("#").strip()).strip()
        if cleaned == t:
            return t
        t = cleaned


def clean_body(body: str) -> str:
    """``body`` as written: stripped, ``\\n`` line ends, ``#``/``##`` lines demoted to ``###``
    (they would start a new section when read back), an unclosed code fence closed (it would
    hide the headings after it)."""
    text = _BODY_HEADING.sub(r"\1###", _NEWLINE.sub("\n", body).strip())
    if sum(1 for line in text.split("\n") if _FENCE.match(line)) % 2:
        text += "\n```"
    return text


class KnowledgeFile:
    """The knowledge file at ``path`` (created with :data:`SEED` on first read if missing)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def read(self) -> str:
        """The whole file as text; creates it (and its directory) with :data:`SEED` if missing.

        Raises:
            OSError: the file or its directory cannot be read or created.
        """
        try:
            return self._read_text()
        except FileNotFoundError:
            with _lock_for(self.path):
                if not self.path.exists():
                    self.path.parent.mkdir(parents=True, exist_ok=True)
                    self._write_atomic(SEED)
            return self._read_text()

    def _read_text(self) -> str:
        # errors="replace": an operator's edit in another encoding must not stop every turn; a
        # named pipe in the file's place is refused (an OSError), not waited on for ever
        with open_regular_file(self.path, follow=True, mode="r", encoding="utf-8", errors="replace") as fh:
            text: str = fh.read()
        return text

    def sections(self) -> list[Section]:
        """All H2 sections, in file order."""
        return parse_sections(self.read())

    def titles(self) -> list[str]:
        """Titles of all sections, as written (locked ones keep their prefix)."""
        return [s.title for s in self.sections()]

    def fingerprint(self) -> str:
        """SHA-256 hex digest of the file's content, for the system prompt cache key."""
        return hashlib.sha256(self.read().encode("utf-8")).hexdigest()

    def append_sections(self, items: list[tuple[str, str]]) -> list[str]:
        """Append ``(title, body)`` items whose title is new; returns the titles appended.

        An item is skipped when its title or body is empty after stripping, when its title
        starts with ``[locked]``, or when its title equals (case- and whitespace-insensitively)
        an existing title, a locked title without its prefix, or an earlier item's title.
        Titles are written on one line; ``#``/``##`` lines in a body are demoted to ``###``.
        Existing text is never modified. The file is rewritten atomically under the per-path
        lock, and only if something is appended.

        Raises:
            OSError: the file cannot be read or written (nothing is changed then).
        """
        with _lock_for(self.path):
            text = self.read()
            known = {normalize_title(s.title) for s in parse_sections(text)}
            added: list[str] = []
            blocks: list[str] = []
            for raw_title, raw_body in items:
                title, body = clean_title(raw_title), clean_body(raw_body)
                key = normalize_title(title)
                if not key or not body or is_locked_title(title) or key in known:
                    continue
                known.add(key)
                added.append(title)
                blocks.append(f"## {title}\n{body}\n")
            if blocks:
                sep = (
                    ""
                    if not text or text.endswith("\n\n")
                    else ("\n" if text.endswith("\n") else "\n\n")
                )
                self._write_atomic(text + sep + "\n".join(blocks))
            return added

    def _write_atomic(self, text: str) -> None:
        directory = self.path.parent
        try:
            mode: int | None = self.path.stat().st_mode & 0o700  # the owner's: the file is private
        except FileNotFoundError:
            mode = None
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=directory)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            if mode is not None:
                os.chmod(tmp, mode)
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        try:
            dfd = os.open(directory, os.O_RDONLY)
        except OSError:
            return
        try:
            os.fsync(dfd)
        except OSError:
            pass
        finally:
            os.close(dfd)


def conversation_file_name(key: str) -> str:
    """The file name of a conversation's facts: its key (``telegram:123``) with every
    character outside ``[A-Za-z0-9_.-]`` made ``_``, a hash suffix when that is ambiguous
    or long, and ``.md``."""
    safe = _UNSAFE.sub("_", key)
    if safe != key.replace(":", "_") or len(safe) > MAX_NAME:
        safe = f"{safe[:MAX_NAME]}-{hashlib.sha256(key.encode()).hexdigest()[:10]}"
    return f"{safe}.md"


def words(text: str) -> set[str]:
    """The words of at least three letters of ``text``, lowercased, common ones left out
    (relevance scoring). Linear in the text."""
    return {w for w in (m.lower() for m in _WORD.findall(text)) if w not in _STOPWORDS}


def relevant(sections: list[Section], text: str, limit: int) -> list[Section]:
    """Up to ``limit`` sections sharing the most words (:func:`words`) with ``text``, the
    later one first on a tie (newer facts win); sections sharing none are left out."""
    wanted = words(text)
    if not wanted:
        return []
    scored = []
    for index, section in enumerate(sections):
        overlap = len(wanted & words(f"{section.title} {section.body}"))
        if overlap:
            scored.append((overlap, index, section))
    scored.sort(key=lambda item: (-item[0], -item[1]))
    return [section for _, _, section in scored[:limit]]


class Memory:
    """Where facts live: the global ``knowledge.md`` and one file per conversation.

    Args:
        data_dir: the daemon's data directory.
    """

    def __init__(self, data_dir: str | os.PathLike[str]) -> None:
        self.data_dir = Path(data_dir)
        self.shared = KnowledgeFile(self.data_dir / "knowledge.md")

    def of(self, conversation: str) -> KnowledgeFile:
        """The facts of the conversation with key ``conversation`` (``ChatRef.key``)."""
        return KnowledgeFile(self.data_dir / "knowledge" / conversation_file_name(conversation))

    def move(self, old: str, new: str) -> bool:
        """Give conversation ``old``'s facts to ``new`` (a chat that changed its id). ``False``
        when ``old`` has none or ``new`` already has its own (nothing is overwritten).

        Raises:
            OSError: the rename failed.
        """
        source, target = self.of(old).path, self.of(new).path
        if not source.exists() or target.exists():
            return False
        source.rename(target)
        return True
