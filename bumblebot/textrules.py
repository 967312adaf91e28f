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

import json
import re
from collections.abc import Collection, Iterable

TAGS = ("think", "thinking", "reasoning")
#: The first line of the block the engine writes before the latest user message.
TURN_CONTEXT = "[Turn context]"


#: ASCII case folding that keeps every position: ``str.lower`` turns "İ" into two characters,
#: and offsets found in the folded copy would cut the original in the wrong place.
_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


def strip_reasoning(text: str) -> str:
    """``text`` without its reasoning, stripped of surrounding space.

    Models and chat templates show reasoning in three ways: closed blocks anywhere
    (``<think>…</think>``); a lone closing tag, when the template pre-filled the opening one
    in the prompt (Qwen3, DeepSeek-R1 distills return ``…reasoning…</think>answer``), so
    everything up to the last closing tag with no opening tag before it is reasoning; and an
    unclosed opening tag at the very start (a completion cut off mid-thought). A tag merely
    mentioned in the middle of a reply ("write a <thinking> tag") is left alone. Reasoning
    *fields* (``reasoning_content``) are never read at all. Literal ``str`` searches, no regex.
    """
    if not text:
        return ""
    out = text
    lower = out.translate(_ASCII_LOWER)  # same length as out: positions carry over
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
            lower = out.translate(_ASCII_LOWER)
        # an unclosed block that opens the text
        if lower.lstrip().startswith(opening):
            return ""
    return out.strip()


def shown_so_far(text: str) -> str:
    """What of a reply still being written may be shown (a streamed preview): like
    :func:`strip_reasoning`, and also nothing from an opening tag whose block has not closed
    yet (it may be reasoning still coming), nor a partial tag at the very end (``"<thi"``).
    Linear in the text."""
    lower = text.translate(_ASCII_LOWER)
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
    more ``<tool_call>…</tool_call>`` blocks (the last may be cut off), ``functions.<tool>``
    followed by its arguments, or a JSON object (or a list of them, or one in a code fence)
    whose ``name`` is one of ``tools`` and whose other keys are a call's. A JSON answer such as
    ``{"name": "Bob", "age": 3}`` is not a call: Bob is no tool, and ``age`` no key of one."""
    body = _unfenced(text.strip())
    if body.startswith(_TAG_OPEN):
        while body.startswith(_TAG_OPEN):
            end = body.find(_TAG_CLOSE)
            if end == -1:
                return True  # cut off inside the block
            body = body[end + len(_TAG_CLOSE):].lstrip()
        return not body
    if body.startswith(_FUNCTIONS):
        m = _NAME.match(body, len(_FUNCTIONS))
        rest = body[m.end():].lstrip(" \t:") if m else "x"
        return m is not None and m.group() in tools and (not rest or rest[0] in "{(")
    if not body.startswith(("{", "[")):
        return False
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return False
    calls = value if isinstance(value, list) and value else [value]
    return all(_is_call(v, tools) for v in calls)


def _unfenced(body: str) -> str:
    """The inside of a text that is one fenced code block (```json … ```), else the text."""
    if body.startswith("```") and body.endswith("```") and len(body) > 6 and "\n" in body:
        inner = body[body.index("\n") + 1 : -3]
        return inner.strip() if "```" not in inner else body
    return body


def _is_call(value: object, tools: Collection[str]) -> bool:
    if isinstance(value, dict) and isinstance(value.get("function"), dict) and set(value) <= _WRAPPER_KEYS:
        value = value["function"]
    return isinstance(value, dict) and value.get("name") in tools and set(value) <= _CALL_KEYS


def may_be_call(text: str, tools: Collection[str]) -> bool:
    """Whether ``text``, the beginning of a reply still being streamed, may turn out to be a
    call as text (:func:`call_as_text`): its preview waits until it cannot, or until it is
    complete. Reads at most the first :data:`_PREFIX_CHARS` characters."""
    body = text[:_PREFIX_CHARS].lstrip()
    if body.startswith("```"):
        if "\n" not in body:
            return True
        body = body[body.index("\n") + 1 :].lstrip()
    for opening in (_TAG_OPEN, _FUNCTIONS):
        if opening.startswith(body):
            return True
    if body.startswith(_TAG_OPEN):
        return True
    if body.startswith(_FUNCTIONS):
        m = _NAME.match(body, len(_FUNCTIONS))
        if m is None:
            return False
        if m.end() == len(body):  # the name may still grow
            return any(t.startswith(m.group()) for t in tools)
        return m.group() in tools
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

#: Splits a line into sentences after their end mark, keeping the mark with the sentence.
_SENTENCE_END = re.compile(r"(?<=[.!?。！？])[ \t]+")
#: A marker that opens an engine note: ``[Same turn]``, ``[Turn context]``.
_MARKER = re.compile(r"\[[^\[\]\n]{1,40}\]")


def _norm(text: str) -> str:
    return " ".join(text.split()).casefold()


def _split_marker(sentence: str) -> tuple[str, str]:
    """``(marker, rest)`` of a sentence that opens with a bracketed marker, else ``("", sentence)``."""
    m = _MARKER.match(sentence.lstrip())
    if m is None:
        return "", sentence
    return m.group(), sentence.lstrip()[m.end():]


class EchoFilter:
    """Removes from what the model says the sentences it copied verbatim from the notes the
    engine sent it this turn (the post-tool note, the completion check's nudge), and the
    markers those notes open with. Comparison ignores case and runs of whitespace; code
    blocks are kept whole."""

    def __init__(self, notes: Iterable[str] = ()) -> None:
        self._sentences: set[str] = set()
        self._markers: set[str] = set()
        for note in notes:
            self.add(note)

    def add(self, note: str) -> None:
        for line in note.splitlines():
            for sentence in _SENTENCE_END.split(line):
                marker, rest = _split_marker(sentence)
                if marker:
                    self._markers.add(_norm(marker))
                if key := _norm(rest):
                    self._sentences.add(key)

    def __call__(self, text: str) -> str:
        if not self._markers and not self._sentences:
            return text
        lines, fenced = [], False
        for line in text.split("\n"):
            if line.lstrip().startswith(("```", "~~~")):
                fenced = not fenced
            if fenced or line.lstrip().startswith(("```", "~~~")):
                lines.append(line)
                continue
            kept, changed = [], False
            for sentence in _SENTENCE_END.split(line):
                marker, rest = _split_marker(sentence)
                if marker and _norm(marker) not in self._markers:
                    marker, rest = "", sentence
                if _norm(rest) in self._sentences or (marker and not rest.strip()):
                    changed = True  # an echoed sentence, or a marker alone: dropped
                elif marker:
                    changed = True
                    kept.append(rest.strip())
                else:
                    kept.append(sentence)
            if not changed:
                lines.append(line)
            elif kept:  # a line that only echoed goes entirely
                lines.append(" ".join(kept))
        return "\n".join(lines).strip()

