"""Reasoning text never reaches users or history: the one function that removes it.

Models and chat templates show their reasoning in three ways, and :func:`strip_reasoning`
handles each (reasoning *fields* such as ``reasoning_content`` are simply never read: only
``message.content`` is, in ``bumblebot/llm.py``):

* closed blocks anywhere: ``<think>…</think>``, ``<thinking>…</thinking>``,
  ``<reasoning>…</reasoning>``;
* a lone closing tag: templates that pre-fill ``<think>`` in the prompt (Qwen3, DeepSeek-R1
  distills) return only ``…reasoning…</think>answer``, so everything up to the last closing tag
  with no opening tag before it is reasoning;
* an unclosed opening tag at the very start (a completion cut off mid-thought).

A tag merely mentioned in the middle of a reply ("write a <thinking> tag") is left alone. The
work is linear in the text: a fixed set of literal tags found with ``str`` searches, no regex.
"""

from __future__ import annotations

TAGS = ("think", "thinking", "reasoning")


#: ASCII case folding that keeps every position: ``str.lower`` turns "İ" into two characters,
#: and offsets found in the folded copy would cut the original in the wrong place.
_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


def strip_reasoning(text: str) -> str:
    """``text`` without its reasoning (module docstring), stripped of surrounding space."""
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
