"""Splitting replies to fit platform message limits (pure functions).

Each adapter passes its platform's limit and how it counts (Telegram counts UTF-16 code
units: :func:`utf16_len`). No platform accepts empty text; a cut must never land inside a code point, and a fenced code
block cut in two must be closed and reopened so that each message renders on its own.

Cut preference, best first: a paragraph break (a blank line), a line break, a sentence end,
any whitespace, and last a hard cut (never between a surrogate pair, and by a cheap rule not
inside an obvious grapheme cluster: combining marks, ZWJ sequences, variation selectors, skin
tones, tags, flag pairs, CR LF). A boundary of a better kind wins when it leaves the chunk at
least half as long as the longest chunk that would fit; otherwise the best boundary anywhere in
that window wins, and a hard cut is used only when the window holds no boundary at all.

Whitespace dropped (nothing else is ever dropped or reordered): every chunk is a slice
``text[a:b]`` of the input (in :func:`split_markdown`, plus added fence lines), and the gap
between two consecutive slices is whitespace only, namely

* the trailing whitespace of the earlier chunk (the line break at a line cut included), and
* at the start of the later chunk, blank lines: whitespace up to and including the last line
  break before its first non-whitespace character. The indentation of the later chunk's first
  line is kept; only a cut inside a line drops the spaces at the cut.

The text's own leading blank lines and trailing whitespace are dropped by the same rule.
"""

from __future__ import annotations

import re
import unicodedata
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["split_markdown", "split_text", "utf16_len"]

Measure = Callable[[str], int]

# Each pattern may only start where its run starts (the lookbehinds): without them a long run
# of spaces or dots with no match would be rescanned from every position in it, O(n²) on
# untrusted text, and the event loop would stall on it (tests/test_event_loop.py).
_PARAGRAPH = re.compile(r"(?<![^\S\n])[^\S\n]*+\n[^\S\n]*+\n")  # a blank line; cut at its start
_LINE = re.compile(r"(?<![^\S\n])[^\S\n]*+\n")
_SENTENCE = re.compile(r"(?<![.!?…])[.!?…]++[\"'”’»)\]]*+(?=\s)|[。！？]+")  # the cut is at its end
_SPACE = re.compile(r"\s+")
_NONSPACE = re.compile(r"\S")
_FENCE = re.compile(r"([ \t]*)(`{3,}|~{3,})(.*)")
_FENCE_RUN = re.compile(r"`{3,}|~{3,}")
_HARD_CUT_BACKOFF = 32  # code points a hard cut may move back to avoid splitting a cluster


def utf16_len(text: str) -> int:
    """Length of ``text`` in UTF-16 code units (astral characters such as emoji count 2).

    Telegram's limit appears to count characters, while its entity offsets are UTF-16, so UTF-16
    is the conservative measure. Lone surrogates count 1.
    """
    return len(text.encode("utf-16-le", "surrogatepass")) // 2


def split_text(text: str, limit: int, *, measure: Measure = len) -> list[str]:
    """Split ``text`` into chunks with ``measure(chunk) <= limit``, at the best boundaries.

    Args:
        text: the reply.
        limit: the largest allowed ``measure`` of a chunk, e.g. Telegram's 4096.
        measure: the length function, ``len`` (code points) by default or :func:`utf16_len`;
            it must not shrink when text is appended.

    Returns:
        The chunks in order, none empty or whitespace-only; ``[]`` for whitespace-only input.
        See the module docstring for the exact whitespace dropped at a cut.

    Raises:
        ValueError: ``limit`` is below 1, or a single character does not fit in ``limit``.
    """
    if limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    return _split(text, limit, measure, _Layout(text, markdown=False))


def split_markdown(text: str, limit: int, *, measure: Measure = len) -> list[str]:
    """Split Markdown like :func:`split_text`, keeping fenced code blocks renderable.

    When a cut falls inside a ````` ``` ````` or ``~~~`` fenced block, the chunk is closed with a
    line holding the opener's fence (``"\\n```"``) and the next chunk reopens it with the opener
    line, info string included (``"```python\\n"``); if that line leaves no room, with the bare
    fence. These added lines count toward ``limit``. Blank lines inside a block are line breaks,
    not paragraph breaks; the boundaries of a block count as paragraph breaks, so a block is
    kept whole when it fits. An unclosed block is closed at the end of the last chunk, so every
    chunk has balanced fences. An opener line longer than the window is cut inside its info
    string and the rest continues after a bare reopened fence. Fences are recognised per line
    (any indentation, CommonMark closing rule); inline triple backticks are not fences. A cut
    never leaves a fence-like fragment (``"```"`` from ``"```py"``, or a line starting with a
    run of backticks) at a chunk's edge, except when ``limit`` is below the length of such a
    line plus the added fence lines; only then may a chunk's fences fail to balance.

    Args:
        text: the reply, in Markdown.
        limit: the largest allowed ``measure`` of a chunk, e.g. Discord's 2000.
        measure: as for :func:`split_text`.

    Returns:
        The chunks; with the added fence lines removed they follow the rules of
        :func:`split_text` (except that a cut inside a block also drops the block's closing
        fence line when only whitespace precedes it: the added closer stands in for it).

        A fence too long to carry (``limit`` cannot hold it, one character and the closing
        fence: model output such as a line of 5000 backticks) cannot be kept renderable: the
        text is then split by :func:`split_text`, so nothing of it is lost.

    Raises:
        ValueError: ``limit`` is below 1.
    """
    if limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    layout = _Layout(text, markdown=True)
    if any(measure(f"{fence.fence}\nx\n{fence.fence}") > limit for fence in layout.fences):
        return split_text(text, limit, measure=measure)
    return _split(text, limit, measure, layout)


@dataclass(frozen=True, slots=True)
class _Fence:
    """A fenced code block; all positions are indices into the text."""

    open_start: int  # first character of the opener line
    info_start: int  # just past the opener's fence run
    open_end: int  # the newline ending the opener line, or len(text)
    first_content: int  # first non-whitespace of the body, or close_start if the body is blank
    close_start: int  # first character of the closer line; len(text) if unclosed
    close_end: int  # just past the closer's fence run; len(text) if unclosed
    opener: str  # the opener line, e.g. "```python"
    fence: str  # indentation and fence run, e.g. "```": the line that closes this block


def _find_fences(text: str) -> tuple[list[_Fence], list[tuple[int, int]]]:
    """The fenced blocks, and the ``(start, end)`` of every line that looks like a fence."""
    n = len(text)
    fences: list[_Fence] = []
    lines: list[tuple[int, int]] = []
    start = 0
    opened: tuple[int, re.Match[str], int] | None = None  # (open_start, match, open_end)
    while start <= n:
        end = text.find("\n", start)
        end = n if end == -1 else end
        m = _FENCE.fullmatch(text, start, end)
        if m:
            lines.append((start, end))
        if opened is None:
            if m and not (m[2][0] == "`" and "`" in m[3]):
                opened = (start, m, end)
        elif m and not m[3].strip() and _closes(opened[1][2], m[2]):
            fences.append(_make_fence(text, opened, start, m.end(2)))
            opened = None
        start = end + 1
    if opened is not None:
        fences.append(_make_fence(text, opened, n, n))
    return fences, lines


def _closes(opener_run: str, run: str) -> bool:
    return run[0] == opener_run[0] and len(run) >= len(opener_run)


def _make_fence(
    text: str, opened: tuple[int, re.Match[str], int], close_start: int, close_end: int
) -> _Fence:
    open_start, m, open_end = opened
    body = _NONSPACE.search(text, min(open_end + 1, close_start), close_start)
    return _Fence(
        open_start=open_start,
        info_start=m.end(2),
        open_end=open_end,
        first_content=body.start() if body else close_start,
        close_start=close_start,
        close_end=close_end,
        opener=text[open_start:open_end].rstrip(),
        fence=m[1] + m[2],
    )


def _first_content(text: str, pos: int) -> int:
    m = _NONSPACE.search(text, pos)
    return m.start() if m else len(text)


def _skip_separator(text: str, cut: int) -> int:
    """Start of the next chunk after a cut at ``cut`` (the whitespace rule of the module doc)."""
    content = _first_content(text, cut)
    newline = text.rfind("\n", cut, content)
    if newline >= 0:
        return newline + 1
    return cut if cut == 0 or text[cut - 1] == "\n" else content  # keep a line's indentation


def _breakable(text: str, i: int) -> bool:
    """Whether a hard cut before ``text[i]`` keeps code points and obvious clusters whole."""
    prev, cur = text[i - 1], text[i]
    cp = ord(cur)
    if "\ud800" <= prev <= "\udbff" and "\udc00" <= cur <= "\udfff":
        return False
    if "\u200d" in (prev, cur) or (prev, cur) == ("\r", "\n"):
        return False
    if unicodedata.category(cur) in ("Mn", "Mc", "Me"):
        return False
    if 0xFE00 <= cp <= 0xFE0F or 0x1F3FB <= cp <= 0x1F3FF or 0xE0000 <= cp <= 0xE01EF:
        return False
    if _regional(cur) and _regional(prev):
        run = 0
        while i - run - 1 >= 0 and _regional(text[i - run - 1]):
            run += 1
        return run % 2 == 0  # flags are pairs of regional indicators
    return True


def _regional(ch: str) -> bool:
    return 0x1F1E6 <= ord(ch) <= 0x1F1FF


def _last_fit(fits: Callable[[int], bool], lo: int, hi: int, step: int) -> int:
    """Largest ``i`` in ``[lo, hi)`` with ``fits(i)``, given ``fits(lo)`` and not ``fits(hi)``."""
    step = max(1, step)
    while lo + step < hi:
        if not fits(lo + step):
            hi = lo + step
            break
        lo, step = lo + step, step * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


class _Layout:
    """Where a text may be cut, and which fence (if any) is open at a cut."""

    def __init__(self, text: str, *, markdown: bool) -> None:
        self.text = text
        self.markdown = markdown
        self.fences, fence_lines = _find_fences(text) if markdown else ([], [])
        fences = self.fences
        self._opens = [f.open_start for f in fences]
        self._fence_lines = fence_lines
        self._fence_line_starts = [start for start, _ in fence_lines]
        para = [m.start() for m in _PARAGRAPH.finditer(text) if not self._in_block(m.start())]
        para += [f.open_start for f in fences] + [f.close_end for f in fences]
        sentences = [m.end() for m in _SENTENCE.finditer(text) if not self._in_block(m.end())]
        self.kinds = [
            sorted(set(para)),
            [m.start() for m in _LINE.finditer(text)],
            sentences,
            [m.start() for m in _SPACE.finditer(text)],
        ]

    def _fence_before(self, i: int) -> _Fence | None:
        k = bisect_right(self._opens, i - 1)
        return self.fences[k - 1] if k else None

    def _in_block(self, i: int) -> bool:
        f = self._fence_before(i + 1)
        return f is not None and i < f.close_end

    def open_at(self, cut: int) -> _Fence | None:
        """The fence a chunk ending at ``cut`` leaves open (it must be closed), or ``None``."""
        f = self._fence_before(cut)
        return f if f is not None and f.info_start <= cut <= f.close_start else None

    def closer(self, cut: int) -> str:
        f = self.open_at(cut)
        return "" if f is None else "\n" + f.fence

    def reopeners(self, fence: _Fence | None, pos: int) -> list[str]:
        """Prefixes to try, best first, for a chunk starting at ``pos`` inside ``fence``."""
        if fence is None:
            return [""]
        if pos < fence.open_end:  # the cut fell inside an over-long opener line
            return [fence.fence]
        return list(dict.fromkeys([fence.opener + "\n", fence.fence + "\n"]))

    def allowed(self, cut: int) -> bool:
        """False inside a fence-like line and between an opener and its block's first content.

        Cutting ``"````py"`` inside a block into ``"````"`` and ``"py"`` would make a closer.
        """
        k = bisect_right(self._fence_line_starts, cut - 1)
        if k and cut < self._fence_lines[k - 1][1]:
            return False
        if self.markdown and self._starts_stray_fence(cut):
            return False
        f = self._fence_before(cut)
        if f is None:
            return True
        return not (f.open_start < cut <= f.first_content or f.close_start < cut < f.close_end)

    def choose(self, content: int, end: int, pos: int, fits: Callable[[int], bool]) -> int:
        """The best cut in ``(content, end]``; ``fits(end)`` holds."""
        floor = max(content + 1, pos + (end - pos) // 2)
        for low, high in ((floor, end), (content + 1, floor - 1)):
            for cuts in self.kinds:
                j = bisect_right(cuts, high)
                while j > 0 and cuts[j - 1] >= low:
                    j -= 1
                    if self.allowed(cuts[j]) and fits(cuts[j]):
                        return cuts[j]
        return self._hard_cut(content, end, fits)

    def _hard_cut(self, content: int, end: int, fits: Callable[[int], bool]) -> int:
        """A cut in ``(content, end]`` when no boundary fits: near the end, clusters kept whole.

        Falls back, in order, to any allowed cut, then (for a limit below the length of a
        fence-like line plus the added fence lines) to a cut that leaves no fence-like fragment
        at the end of the chunk, then to ``end``.
        """
        cut = end
        f = self._fence_before(end)
        if f is not None and f.open_start < end <= f.first_content and f.open_start > content:
            cut = f.open_start  # keep the opener with its block
        elif f is not None and f.close_start < end < f.close_end and f.close_start > content:
            cut = f.close_start  # never cut through a closing fence
        for i in range(cut, max(content, cut - _HARD_CUT_BACKOFF), -1):
            if _breakable(self.text, i) and self.allowed(i) and fits(i):
                return i
        for i in range(cut, content, -1):
            if self.allowed(i) and fits(i):
                return i
        for i in range(end, content, -1):
            if self._safe(i, content) and fits(i):
                return i
        return end

    def _starts_stray_fence(self, cut: int) -> bool:
        """Whether a cut inside a line would start the next chunk with a stray fence."""
        start = _skip_separator(self.text, cut)
        if start == 0 or self.text[start - 1] == "\n":
            return False
        end = self.text.find("\n", start)
        return self._stray(self.text[start : len(self.text) if end == -1 else end], cut)

    def _stray(self, piece: str, cut: int) -> bool:
        """Whether ``piece`` of a line cut at ``cut`` would open or close a fence on its own."""
        m = _FENCE.fullmatch(piece)
        if m is None:
            return False
        f = self.open_at(cut)
        if f is None:
            return not (m[2][0] == "`" and "`" in m[3])
        return _closes(f.fence.lstrip(" \t"), m[2]) and not m[3].strip()

    def _safe(self, cut: int, content: int) -> bool:
        """Whether a cut leaves no stray fence at the end of the chunk or the start of the next."""
        if self._starts_stray_fence(cut):
            return False
        k = bisect_right(self._fence_line_starts, cut - 1)
        if not k or cut >= self._fence_lines[k - 1][1]:
            return True
        start = self._fence_lines[k - 1][0]
        f = self._fence_before(cut)
        if f is not None and start in (f.open_start, f.close_start):
            # Inside an over-long opener; the rest must not lengthen the reopened fence run.
            return start == f.open_start and cut >= f.info_start and self.text[cut] != f.fence[-1]
        return not self._stray(self.text[max(start, content) : cut], cut)


def _fitter(
    layout: _Layout, limit: int, measure: Measure, inside: _Fence | None, pos: int, content: int
) -> tuple[int, str, Callable[[int], bool]]:
    """Start, reopening prefix and fit test of the chunk whose first content is ``content``.

    Tries, best first, the kept indentation before dropping it and the full reopened opener
    before the bare fence, and takes the first that holds one character.

    Raises:
        ValueError: none holds one character.
    """
    text = layout.text
    for start in [pos] if pos == content else [pos, content]:
        for prefix in layout.reopeners(inside, start):

            def fits(cut: int, prefix: str = prefix, start: int = start) -> bool:
                chunk = prefix + text[start:cut].rstrip() + layout.closer(cut)
                return measure(chunk) <= limit

            if fits(content + 1):
                return start, prefix, fits
    raise ValueError(f"limit {limit} cannot hold {text[content]!r} at index {content}")


def _split(text: str, limit: int, measure: Measure, layout: _Layout) -> list[str]:
    n = len(text)
    chunks: list[str] = []
    pos = _skip_separator(text, 0)
    inside: _Fence | None = None  # the fence open where the current chunk starts
    while (content := _first_content(text, pos)) < n:
        if inside is not None and content >= inside.close_start:
            # Only blank lines remain in the block: the closer added to the last chunk ends it.
            pos, inside = _skip_separator(text, inside.close_end), None
            continue
        pos, prefix, fits = _fitter(layout, limit, measure, inside, pos, content)
        if fits(n):
            cut = n
        else:
            cut = layout.choose(content, _last_fit(fits, content + 1, n, limit), pos, fits)
        chunks.append(prefix + text[pos:cut].rstrip() + layout.closer(cut))
        inside = layout.open_at(cut)
        pos = _skip_separator(text, cut)
    return chunks
