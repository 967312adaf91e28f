"""How much of the previous request a request repeats: the share an endpoint's prompt cache
can reuse, shown per step in the trace (``repeated``).

Prefix caches (OpenAI, vLLM, llama.cpp) reuse a request's tokens up to the first one that
differs from a request they processed before, for the same model. :class:`Prefixes` keeps, per
conversation and model, the last loop request as the hash and length of each of its parts (the
tool schemas, then each message as JSON), and measures the next one against it: the parts
repeated whole from the start, as a share of the characters of the previous request. A part
that changed counts as not repeated at all, so the share is at most what a cache can reuse.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

#: Conversations and models remembered at most (the least recently used is forgotten).
KEPT = 256

Parts = list[tuple[int, int]]


def _part(value: Any) -> tuple[int, int]:
    text = json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hash(text), len(text)


class Prefixes:
    """The last loop request per conversation and model, and the share of it the next one
    repeats (module docstring)."""

    def __init__(self, kept: int = KEPT) -> None:
        self._kept = kept
        self._last: OrderedDict[tuple[str, str], Parts] = OrderedDict()

    def repeated(
        self, conversation: str, model: str, tools: list[dict[str, Any]], messages: list[dict[str, Any]]
    ) -> float | None:
        """The share (0 to 1, three decimals) of the previous request of ``model`` in
        ``conversation`` that this one repeats as a prefix; ``None`` for the first one.
        This request becomes the previous one."""
        parts = [_part(tools), *(_part(m) for m in messages)]
        key = (conversation, model)
        before = self._last.pop(key, None)
        self._last[key] = parts
        while len(self._last) > self._kept:
            self._last.popitem(last=False)
        if not before:
            return None
        same = 0
        for old, new in zip(before, parts, strict=False):
            if old != new:
                break
            same += old[1]
        return round(same / sum(n for _, n in before), 3)
