"""How much of the previous request a request repeats: the share an endpoint's prompt cache
can reuse, shown per step in the trace (``repeated``).

Prefix caches (OpenAI, vLLM, llama.cpp) reuse a request's tokens up to the first one that
differs from a request they processed before, at the same endpoint, for the same model.
:class:`Prefixes` keeps, per conversation and the endpoint and model that answered (the loop
passes them as one key, ``<endpoint>|<model>``: under failover a fallback has a cache of its
own), the last loop request answered as the hash and length of each of its parts (the tool
schemas, then each message as JSON), and measures the next one answered there against it: the
parts repeated whole from the start, as a share of the characters of the previous request. A
part that changed counts as not repeated at all, so the share is at most what a cache can
reuse. A request that was not answered (refused as too long, or the endpoint failed) is not
measured and is not kept.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

#: Conversations and endpoint-models remembered at most (the least recently used is forgotten).
KEPT = 256

Parts = list[tuple[int, int]]


def _part(value: Any) -> tuple[int, int]:
    text = json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hash(text), len(text)


class Prefixes:
    """The last loop request answered per conversation and endpoint-model, and the share of it
    the next one repeats (module docstring)."""

    def __init__(self, kept: int = KEPT) -> None:
        self._kept = kept
        self._last: OrderedDict[tuple[str, str], Parts] = OrderedDict()

    def repeated(
        self, conversation: str, answered_by: str, tools: list[dict[str, Any]], messages: list[dict[str, Any]]
    ) -> float | None:
        """The share (0 to 1, three decimals) of the previous request ``answered_by`` (an
        endpoint and model) answered in ``conversation`` that this one, which it answered
        too, repeats as a prefix; ``None`` for the first one. This request becomes the previous one."""
        parts = [_part(tools), *(_part(m) for m in messages)]
        key = (conversation, answered_by)
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
