"""Models that write past ``max_tokens``: :class:`Overruns`, and the schemas they are sent.

A model is seen doing so when an answer's reported usage goes past its budget by a quarter
(and 16 tokens: a server and its tokenizer count a little differently), its estimated size by
double, or a stream is cut past its budget (:class:`~bumblebot.llm.pace.TokenCount`). That is
remembered in ``kv`` ``llm.overruns:<endpoint>|<model>`` for :data:`OVERRUN_RETRY_S`, then the
model is trusted again, and caught again at its next overrun. Meanwhile:

* its requests get the tight deadline (:class:`~bumblebot.llm.pace.Speed`);
* its tool schemas carry a ``maxLength`` of the budget (at most a short reply), in characters,
  on each free string argument (:func:`bounded_tools`): a server that constrains calls to their
  schema with a grammar (llama.cpp, llama-cpp-python) then ends a runaway argument itself. Abandoning the
  request would not: llama-cpp-python finishes a whole request whose client has gone, and every
  request behind it waits.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from bumblebot.llm.capabilities import CapabilityMemory, Refusals
from bumblebot.llm.pace import past

log = logging.getLogger(__name__)


def overrun_key(endpoint: str, model: str) -> str:
    """The ``kv`` key recording that ``model`` at ``endpoint`` wrote past its budget: JSON
    ``{"reason": str, "since": float}`` (epoch seconds)."""
    return f"llm.overruns:{endpoint}|{model}"


#: Seconds an endpoint seen writing past its budget is treated so: then it is trusted again
#: (and caught again at its next overrun).
OVERRUN_RETRY_S = 7 * 24 * 3600.0


def overran(written: int, budget: int, *, estimated: bool) -> bool:
    """Whether an answer of ``written`` tokens went past a ``budget``: by a quarter and 16
    tokens as reported (:func:`~bumblebot.llm.pace.past`: counts differ a little between a
    server and its tokenizer), by double as estimated."""
    return written > budget * 2 + 16 if estimated else past(written, budget)


class Overruns:
    """What one endpoint has shown of ``max_tokens``: the models seen writing past it.

    Args:
        memory: where it is remembered.
        endpoint: the endpoint's name in the keys.
        clock: the wall clock, epoch seconds.
    """

    def __init__(self, memory: CapabilityMemory, endpoint: str, clock: Callable[[], float] = time.time) -> None:
        self.memory = memory
        self.endpoint = endpoint
        self._refusals = Refusals(memory, endpoint, clock, endpoint=endpoint)

    async def seen(self, model: str) -> bool:
        """Whether ``model`` was seen writing past its budget (within :data:`OVERRUN_RETRY_S`)."""
        key = overrun_key(self.endpoint, model)
        return await self._refusals.active(key, OVERRUN_RETRY_S, f"trusting {model} to stop at max_tokens again")

    async def reason(self, model: str) -> str | None:
        """What it was seen doing, ``None`` when it was not."""
        return await self._refusals.reason(overrun_key(self.endpoint, model)) if await self.seen(model) else None

    async def saw(self, model: str, reason: str) -> None:
        """``model`` wrote past its budget (``reason`` says how); remembered unless it already is."""
        if await self.seen(model):
            return
        await self._refusals.remember(overrun_key(self.endpoint, model), reason)
        log.warning(
            "endpoint %s, model %s does not stop at max_tokens (%s): its requests get a tight deadline, and its "
            "tool schemas a maxLength on string arguments", self.endpoint, model, reason,
        )


#: The longest string argument such a model is asked for, characters: a short reply. A grammar
#: repeats a character rule this many times, and llama.cpp's grammar parser refuses more than
#: about a thousand (llama-cpp-python 0.3.36's server dies of 1,024: seen here). One bound for
#: every budget from 500 tokens up, so that turns of either budget send the same schemas, and a
#: server that renders them into the prompt (llama-cpp-python) keeps its cached prefix.
MAX_STRING_CHARS = 500


def bounded_tools(tools: list[dict[str, Any]], budget: int) -> list[dict[str, Any]]:
    """``tools`` with a ``maxLength`` on each free string argument (not an enum, a pattern or a
    format), nested ones too: one character per token of the ``budget``, at most
    :data:`MAX_STRING_CHARS`, or the argument's own when shorter. A schema-constrained server
    enforces it; a longer text takes several calls. One character a token, not four: a runaway
    is often no language at all, random characters of about a token each. The bound is in
    characters, not tokens: a character outside ASCII, or a ``\\uXXXX`` escape, which the
    grammar counts as one, costs several tokens, so it bounds such text less tightly."""
    limit = min(budget, MAX_STRING_CHARS)
    return [_bounded_tool(tool, limit) for tool in tools]


def _bounded_tool(tool: dict[str, Any], limit: int) -> dict[str, Any]:
    fn = tool.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("parameters"), dict):
        return tool
    return {**tool, "function": {**fn, "parameters": _bounded_schema(fn["parameters"], limit)}}


def _bounded_schema(schema: Any, limit: int) -> Any:
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    kind = out.get("type")
    is_string = kind == "string" or (isinstance(kind, list) and "string" in kind)  # Optional[str]: ["string", "null"]
    if is_string and not {"enum", "const", "pattern", "format"} & out.keys():
        mine = out.get("maxLength")
        out["maxLength"] = min(mine, limit) if isinstance(mine, int) else limit  # its own, if shorter
    if isinstance(out.get("properties"), dict):
        out["properties"] = {name: _bounded_schema(sub, limit) for name, sub in out["properties"].items()}
    for key in ("items", "additionalProperties"):
        if isinstance(out.get(key), dict):
            out[key] = _bounded_schema(out[key], limit)
    for key in ("anyOf", "oneOf", "allOf"):
        if isinstance(out.get(key), list):
            out[key] = [_bounded_schema(sub, limit) for sub in out[key]]
    return out
