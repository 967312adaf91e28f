"""Small helpers shared by the end-to-end tests."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fakes.openai_server import FakeOpenAI, Reply, error, is_aux, text, tool_calls


def judges_say_done(llm: FakeOpenAI) -> None:
    """Answer every unscripted judge/classifier request with DONE; loop requests stay strict."""

    def default(request: dict[str, Any]) -> Reply:
        if is_aux(request):
            return text("DONE: the reply is adequate")
        return error(500, "unscripted loop request")

    llm.default = default


def say(*texts: str, end: bool = True, **kwargs: Any) -> Reply:
    """A step that says each text (one ``say`` call each) and, by default, ends the turn."""
    calls: list[tuple[str, dict[str, Any]]] = [("say", {"text": t}) for t in texts]
    if end:
        calls.append(("end_turn", {}))
    return tool_calls(*calls, **kwargs)


def loop_requests(llm: FakeOpenAI) -> list[dict[str, Any]]:
    return [r for r in llm.requests if "tools" in r]


def contents(request: dict[str, Any]) -> str:
    """Every message content of a request, joined (for "does the model see X" checks)."""
    parts = []
    for m in request["messages"]:
        parts.append(m.get("content") or "")
        for call in m.get("tool_calls") or ():
            parts.append(call["function"]["arguments"])
    return "\n".join(parts)


class Gate:
    """A reply that waits until released: lets a test hold a turn open deterministically."""

    def __init__(self, reply: Reply) -> None:
        self.reply = reply
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    async def __call__(self, request: dict[str, Any]) -> Reply:
        self.entered.set()
        await self.release.wait()
        return self.reply


def tool_result(request: dict[str, Any], name: str) -> list[Any]:
    """Tool results in a request for calls of tool ``name`` (decoded JSON when possible)."""
    names = {}
    for m in request["messages"]:
        for call in m.get("tool_calls") or ():
            names[call["id"]] = call["function"]["name"]
    out = []
    for m in request["messages"]:
        if m["role"] == "tool" and names.get(m.get("tool_call_id")) == name:
            try:
                out.append(json.loads(m["content"]))
            except ValueError:
                out.append(m["content"])
    return out


def is_classifier(request: dict[str, Any]) -> bool:
    return is_aux(request) and "You route chat messages" in contents(request)


def is_adequacy_judge(request: dict[str, Any]) -> bool:
    return is_aux(request) and "used none successfully" in contents(request)


def is_grounding_judge(request: dict[str, Any]) -> bool:
    return is_aux(request) and "before it is final" in contents(request)


def is_loop_with(needle: str) -> Any:
    """A predicate: a loop request whose messages contain ``needle``."""
    return lambda request: "tools" in request and needle in contents(request)
