"""The text rules: the only places where the engine reads what the model wrote.

Everything else the engine decides (whether a turn ends, whether the completion check runs,
whether a message is delivered) it decides from structure: tool calls, delivery state, caps
and budgets, or by asking the model (the completion gate's judges). No rule here depends on
the language of the conversation, and none removes text the user asked for: each removes
text that is not meant for the user at all.

=====================  ==========================================  ===============================
rule                   what is removed                              why
=====================  ==========================================  ===============================
reasoning              ``<think>…</think>`` (also ``thinking``,     the model's private reasoning;
(:func:`strip_         ``reasoning``), a lone closing tag and what  templates that pre-fill the
reasoning`)            precedes it, an unclosed tag at the start    opening tag show only the close
call as text           a reply that is nothing but a tool call      weak models and servers that
(:func:`call_as_       written in a template's syntax naming an     parse calls badly write the
text`)                 offered tool: ``<tool_call>`` blocks,        call as text; it is a call, not
                       ``functions.<tool>…``, a JSON object whose   words for the user
                       ``name`` is an offered tool
engine echo            a sentence copied verbatim from a note the   weak models copy the post-tool
(:func:`without_       engine sent the model in this turn           note into what they say
echoes`)
=====================  ==========================================  ===============================

Rendering Markdown for the platform is the adapters' (character references such as ``&amp;``
stay as written). Everything here is linear in the text.
"""

from __future__ import annotations

import html
import json
import re
from collections.abc import Collection, Iterable

TAGS = ("think", "thinking", "reasoning")
#: The first line of the block the engine writes before the latest user message.
TURN_CONTEXT = "[Turn context]"


#: ASCII case folding that keeps every position: ``str.lower`` turns "İ" into two characters,
#: and offsets found in the folded copy would cut the original in the wrong place.
_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


def _searchable(text: str) -> str:
    """``text`` folded to ASCII lower case, with every character inside code (a fenced block,
    an inline code span) replaced by NUL: same length, so positions carry over, and a tag
    written in code is never taken for one. One pass over the text."""
    out = list(text.translate(_ASCII_LOWER))
    fence = ""
    at = 0
    for line in text.split("\n"):
        end = at + len(line)
        opening = line.lstrip()[:3]
        if fence:
            out[at:end] = "\0" * len(line)
            if line.lstrip().startswith(fence):
                fence = ""
        elif opening in ("```", "~~~"):
            fence = opening
            out[at:end] = "\0" * len(line)
        else:
            i = at
            while (start := text.find("`", i, end)) != -1:
                run = start
                while run < end and text[run] == "`":
                    run += 1
                close = text.find(text[start:run], run, end)
                if close == -1:
                    break
                out[start : close + run - start] = "\0" * (close + run - start - start)
                i = close + run - start
        at = end + 1
    return "".join(out)


def strip_reasoning(text: str) -> str:
    """``text`` without its reasoning, stripped of surrounding space.

    Models and chat templates show reasoning in three ways: closed blocks anywhere
    (``<think>…</think>``); a lone closing tag, when the template pre-filled the opening one
    in the prompt (Qwen3, DeepSeek-R1 distills return ``…reasoning…</think>answer``), so
    everything up to the last closing tag with no opening tag before it is reasoning; and an
    unclosed opening tag at the very start (a completion cut off mid-thought). A tag merely
    mentioned in the middle of a reply ("write a <thinking> tag"), or written in code, is left
    alone. Reasoning *fields* (``reasoning_content``) are never read at all. Literal ``str``
    searches, no regex.
    """
    if not text:
        return ""
    out = text
    lower = _searchable(out)  # same length as out: positions carry over
    for tag in TAGS:
        opening, closing = f"<{tag}>", f"</{tag}>"
        # lone closing tags: everything up to the last one before any opening tag is reasoning
        first_open = lower.find(opening)
        lone = lower.rfind(closing, 0, len(lower) if first_open == -1 else first_open)
        if lone != -1:
            out, lower = out[lone + len(closing):], lower[lone + len(closing):]
        # closed blocks anywhere
        pieces, at = [], 0
        while (start := lower.find(opening, at)) != -1:
            end = lower.find(closing, start + len(opening))
            if end == -1:
                break
            pieces.append(out[at:start])
            at = end + len(closing)
        if pieces:
            pieces.append(out[at:])
            out = "".join(pieces)
            lower = _searchable(out)
        # an unclosed block that opens the text
        if lower.lstrip().startswith(opening):
            return ""
    return out.strip()


def shown_so_far(text: str) -> str:
    """What of a reply still being written may be shown (a streamed preview): like
    :func:`strip_reasoning`, and also nothing from an opening tag whose block has not closed
    yet (it may be reasoning still coming), nor a partial tag at the very end (``"<thi"``).
    Linear in the text."""
    lower = _searchable(text)
    cut = len(text)
    for tag in TAGS:
        opening, closing = f"<{tag}>", f"</{tag}>"
        start = lower.rfind(opening)
        if start != -1 and lower.find(closing, start) == -1:
            cut = min(cut, start)
    tail = lower.rfind("<", max(0, cut - len("</reasoning>")), cut)
    if tail != -1 and any(f"<{t}>".startswith(lower[tail:cut]) or f"</{t}>".startswith(lower[tail:cut]) for t in TAGS):
        cut = tail
    return strip_reasoning(text[:cut])


# -- call as text -------------------------------------------------------------------------------

#: Hermes and Qwen chat templates wrap a call in these tags.
_TAG_OPEN, _TAG_CLOSE = "<tool_call>", "</tool_call>"
#: OpenAI's harmony format and some llama.cpp templates name a call ``functions.<tool>``.
_FUNCTIONS = "functions."
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
#: Keys of a call written as a JSON object (OpenAI, Llama 3.1 ``parameters``, Mistral ``id``).
_CALL_KEYS = frozenset({"name", "arguments", "parameters", "id", "type"})
_WRAPPER_KEYS = frozenset({"function", "type", "id"})
#: Characters of a streamed text read to tell whether it may still become a call.
_PREFIX_CHARS = 300


def call_as_text(text: str, tools: Collection[str]) -> bool:
    """All of ``text`` is a tool call written as text, in a syntax chat templates use: one or
    more ``<tool_call>…</tool_call>`` blocks each holding a call (the last may be cut off),
    ``functions.<tool>`` followed by its JSON arguments, or a JSON object (or a list of them)
    with an offered tool's ``name`` and its ``arguments`` (or ``parameters``), and no key a
    call does not have. A JSON answer such as ``{"name": "Bob", "age": 3}`` is not a call:
    Bob is no tool, and ``age`` no key of one; prose that mentions the syntax is not one either."""
    body = text.strip()
    if body.startswith(_TAG_OPEN):
        while body.startswith(_TAG_OPEN):
            end = body.find(_TAG_CLOSE)
            inner = body[len(_TAG_OPEN) : end if end != -1 else len(body)].strip()
            if end == -1:  # cut off inside the block
                return inner.startswith("{") and may_be_call(inner, tools)
            if not _json_call(inner, tools):
                return False
            body = body[end + len(_TAG_CLOSE):].lstrip()
        return not body
    if body.startswith(_FUNCTIONS):
        m = _NAME.match(body, len(_FUNCTIONS))
        if m is None or m.group() not in tools:
            return False
        rest = body[m.end():].strip().lstrip(":").strip()
        if rest.startswith("(") and rest.endswith(")"):
            rest = rest[1:-1].strip()
        return not rest or _json_object(rest)
    return body.startswith(("{", "[")) and _json_call(body, tools)


def holds_call(text: str, tools: Collection[str]) -> bool:
    """``text`` is a call written as text (:func:`call_as_text`), or holds a whole
    ``<tool_call>`` block with a call of an offered tool (a server that parsed its model's
    calls badly returns them inside the text)."""
    if call_as_text(text, tools):
        return True
    at = 0
    while (start := text.find(_TAG_OPEN, at)) != -1:
        end = text.find(_TAG_CLOSE, start)
        if end == -1:
            return False
        if _json_call(text[start + len(_TAG_OPEN) : end].strip(), tools):
            return True
        at = end + len(_TAG_CLOSE)
    return False


def _json_value(text: str) -> object:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _json_object(text: str) -> bool:
    return isinstance(_json_value(text), dict)


def _json_call(text: str, tools: Collection[str]) -> bool:
    value = _json_value(text)
    calls = value if isinstance(value, list) and value else [value]
    return all(_is_call(v, tools) for v in calls)


def _is_call(value: object, tools: Collection[str]) -> bool:
    if isinstance(value, dict) and isinstance(value.get("function"), dict) and set(value) <= _WRAPPER_KEYS:
        value = value["function"]
    return (
        isinstance(value, dict) and value.get("name") in tools and set(value) <= _CALL_KEYS
        and ("arguments" in value or "parameters" in value)
    )


def may_be_call(text: str, tools: Collection[str]) -> bool:
    """Whether ``text``, the beginning of a reply still being streamed, may turn out to be a
    call as text (:func:`call_as_text`): its preview waits until it cannot, or until it is
    complete. Reads at most the first :data:`_PREFIX_CHARS` characters."""
    body = text[:_PREFIX_CHARS].lstrip()
    for opening in (_TAG_OPEN, _FUNCTIONS):
        if opening.startswith(body):
            return True
    if body.startswith(_TAG_OPEN):
        inner = body[len(_TAG_OPEN):].lstrip()
        return not inner or (inner.startswith("{") and may_be_call(inner, tools))
    if body.startswith(_FUNCTIONS):
        m = _NAME.match(body, len(_FUNCTIONS))
        if m is None:
            return False
        if m.end() == len(body):  # the name may still grow
            return any(t.startswith(m.group()) for t in tools)
        rest = body[m.end():].lstrip(" \t:")
        return m.group() in tools and (not rest or rest[0] in "({")
    m = _FIRST_KEY.match(body)
    if m is None:  # not JSON, or its first key not complete yet
        return body.startswith(("{", "[")) and _FIRST_KEY_PREFIX.fullmatch(body) is not None
    if m.group(1) != "name":
        return m.group(1) in _WRAPPER_KEYS
    value = _STRING.match(body, m.end())
    if value is None:  # the name is still being written
        partial = body[m.end() + 1 :] if body[m.end() :].startswith('"') else ""
        return body[m.end() :] in ("", '"') or any(t.startswith(partial) for t in tools)
    return value.group(1) in tools


#: The first key of a JSON object (in a list, perhaps), and what precedes its value.
_FIRST_KEY = re.compile(r'\[?\s*\{\s*"([A-Za-z_]{1,20})"\s*:\s*')
#: A JSON text whose first key is not complete yet (``{``, ``[{"na``).
_FIRST_KEY_PREFIX = re.compile(r'\[?\s*(?:\{\s*(?:"[A-Za-z_]{0,20}"?\s*:?\s*)?)?')
_STRING = re.compile(r'"([A-Za-z0-9_-]{1,64})"')


# -- engine echo ----------------------------------------------------------------------------------

_END_MARKS = frozenset(".!?。！？")
_OPEN_QUOTES, _CLOSE_QUOTES = frozenset('"“'), frozenset('"”')
#: A marker that opens an engine note: ``[Same turn]``, ``[Turn context]``.
_MARKER = re.compile(r"\[[^\[\]\n]{1,40}\]")


def _sentences(line: str) -> list[str]:
    """``line`` cut after each sentence's end mark and the blanks after it (joined back, the
    pieces are the line). An end mark inside double quotes ends nothing: a quoted message
    stays in the sentence that quotes it. One pass."""
    pieces, start, quoted, i = [], 0, False, 0
    while i < len(line):
        c = line[i]
        if quoted and c in _CLOSE_QUOTES:
            quoted = False
        elif not quoted and c in _OPEN_QUOTES:
            quoted = True
        elif not quoted and c in _END_MARKS and i + 1 < len(line) and line[i + 1] in " \t":
            i += 1
            while i < len(line) and line[i] in " \t":
                i += 1
            pieces.append(line[start:i])
            start = i
            continue
        i += 1
    if start < len(line):
        pieces.append(line[start:])
    return pieces


def _key(sentence: str) -> str:
    """A sentence as it is compared: what it quotes left out (the post-tool note quotes what
    the model said: its words are the model's, not the engine's), runs of whitespace made one
    space, case folded, character references read (a server whose chat template escapes the
    prompt shows the model ``user&#39;s`` for ``user's``, and the model copies that)."""
    out, quoted = [], False
    for c in html.unescape(sentence):
        if quoted:
            if c in _CLOSE_QUOTES:
                quoted = False
                out.append('"')
        else:
            out.append(c)
            quoted = c in _OPEN_QUOTES
    return " ".join("".join(out).split()).casefold()


def _split_marker(sentence: str) -> tuple[str, str]:
    """``(marker, rest)`` of a sentence that opens with a bracketed marker, else ``("", sentence)``."""
    m = _MARKER.match(sentence.lstrip())
    if m is None:
        return "", sentence
    return m.group(), sentence.lstrip()[m.end():]


#: Words in a row copied from a note that make a sentence an echo, however it goes on (a weak
#: model copies the note and mangles the rest); fewer are a phrase any answer may share.
ECHO_RUN_WORDS = 6


def _words(text: str) -> list[str]:
    """The words of ``text`` as echoes are compared: case folded, the punctuation around each
    word left out."""
    out = []
    for token in html.unescape(text).casefold().split():
        word = token.strip("\"'“”‘’()[]{}<>.,;:!?¿¡…*_`~-")
        if word:
            out.append(word)
    return out


def _runs(words: list[str]) -> set[tuple[str, ...]]:
    return {tuple(words[i : i + ECHO_RUN_WORDS]) for i in range(len(words) - ECHO_RUN_WORDS + 1)}


class EchoFilter:
    """Removes from what the model says the sentences it copied from the notes the engine
    sent it this turn (the post-tool note, the completion check's nudge, the requests for
    plain words), with or without the marker those notes open with, and a marker standing
    alone. A sentence is a copy when it is a sentence of a note (case, runs of whitespace and
    what the note quotes aside), or when it holds :data:`ECHO_RUN_WORDS` words in a row of
    one. What a note quotes (the model's own earlier messages, the check's reason) is the
    model's, never an echo; code blocks are kept whole, and a sentence that only opens with a
    marker keeps it."""

    def __init__(self, notes: Iterable[str] = ()) -> None:
        self._sentences: set[str] = set()
        self._markers: set[str] = set()
        self._runs: set[tuple[str, ...]] = set()
        for note in notes:
            self.add(note)

    def add(self, note: str, *, model_words: Iterable[str] = ()) -> None:
        """Learn the sentences of ``note``. ``model_words``: the spans of it that are the
        model's own (what it said this turn, quoted; the check's reason), taken out first: the
        model saying them again is not an echo, whatever quotes they hold or lose to a clip.
        A span of one word ("No", "a") stays: taking it out would take that word out of the
        note's own sentences too, and alone it can neither be a sentence of the note nor
        make a run of :data:`ECHO_RUN_WORDS`."""
        for words in sorted({w for w in model_words if len(w.split()) > 1}, key=len, reverse=True):
            note = note.replace(words, " ")
        for line in note.splitlines():
            for sentence in _sentences(line):
                marker, rest = _split_marker(sentence)
                if marker:
                    self._markers.add(_key(marker))
                for key in (_key(sentence), _key(rest)):
                    if key:
                        self._sentences.add(key)
                self._runs |= _runs(_words(_key(rest)))

    def _echo(self, sentence: str) -> bool:
        marker, rest = _split_marker(sentence)
        if marker and _key(marker) in self._markers and not rest.strip():
            return True  # a marker alone
        if _key(sentence) in self._sentences:
            return True
        return bool(self._runs) and not self._runs.isdisjoint(_runs(_words(sentence)))

    def __call__(self, text: str) -> str:
        if not self._markers and not self._sentences and not self._runs:
            return text
        lines, fenced = [], False
        for line in text.split("\n"):
            fence = line.lstrip().startswith(("```", "~~~"))
            if fence:
                fenced = not fenced
            if fenced or fence:
                lines.append(line)
                continue
            pieces = _sentences(line)
            kept = [p for p in pieces if not self._echo(p)]
            if len(kept) == len(pieces):
                lines.append(line)
            elif kept:  # a line that only echoed goes entirely
                lines.append("".join(kept).rstrip())
        return "\n".join(lines).strip()

    def partial(self, text: str) -> str:
        """What of a text still being written may be shown: :meth:`__call__`, and not its
        last sentence while that may still grow into an echo (its beginning is the beginning
        of a sentence or marker of a note)."""
        shown = self(text)
        if not shown or not (self._markers or self._sentences) or text[-1:] in " \t\n":
            return shown
        head, _, last = shown.rpartition("\n")
        pieces = _sentences(last)
        tail = _key(pieces[-1]) if pieces else ""
        if tail and any(known.startswith(tail) for known in (*self._sentences, *self._markers)):
            pieces = pieces[:-1]
            last = "".join(pieces).rstrip()
            return f"{head}\n{last}".strip() if head else last
        return shown
