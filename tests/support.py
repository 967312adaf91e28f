"""Small helpers shared by the end-to-end tests."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

from conftest import TOKEN
from fakes.openai_server import FakeOpenAI, Reply, error, is_aux, is_last_chance, text, tool_calls

#: A chat input the router's heuristic cannot place (80 to 200 characters, no cue either way):
#: only such input reaches the classifier (issue 11).
UNCLEAR = (
    "so my sister and I were arguing last night about whether a tomato counts as a fruit "
    "or a vegetable, who is right?"
)


def judges_say_done(llm: FakeOpenAI) -> None:
    """Answer every unscripted judge/classifier request with DONE; loop requests stay strict,
    and so does the loop's last try for a plain answer (it fails, so the honest note comes)."""

    def default(request: dict[str, Any]) -> Reply:
        if is_last_chance(request):
            return error(500, "unscripted last-chance request")
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
        content = m.get("content") or ""
        if isinstance(content, list):  # text and image_url parts: the text of it
            content = "\n".join(p.get("text", "") for p in content if p.get("type") == "text")
        parts.append(content)
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


def tool_results(request: dict[str, Any]) -> list[str]:
    """The contents of every tool result a request carries, in order."""
    return [m["content"] for m in request["messages"] if m["role"] == "tool"]


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
    return is_aux(request) and "delivered what the user asked for" in contents(request)


def is_grounding_judge(request: dict[str, Any]) -> bool:
    return is_aux(request) and "before it is final" in contents(request)


def is_loop_with(needle: str) -> Any:
    """A predicate: a loop request whose messages contain ``needle``."""
    return lambda request: "tools" in request and needle in contents(request)


# -- ``bumblebot run`` as a subprocess ------------------------------------------------------------


def env_for(tmp_path: Path) -> dict[str, str]:
    """The environment of a daemon subprocess: test secrets, no ``BUMBLEBOT_`` overrides."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BUMBLEBOT_")}
    env.update(TELEGRAM_BOT_TOKEN=TOKEN, OPENAI_API_KEY="sk-test-key-not-real-000000", PYTHONUNBUFFERED="1")
    return env


async def start_daemon(config: Path, tmp_path: Path) -> asyncio.subprocess.Process:
    """``bumblebot run`` in the background; its stderr goes to ``tmp_path/daemon.log``."""
    with open(tmp_path / "daemon.log", "ab") as log:
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bumblebot", "--config", str(config), "run",
            env=env_for(tmp_path), stdout=asyncio.subprocess.DEVNULL, stderr=log,
        )


async def stop_daemon(proc: asyncio.subprocess.Process) -> int:
    """SIGTERM; the exit code (the process is killed if it does not exit in 20 s)."""
    try:
        proc.send_signal(signal.SIGTERM)
        return await asyncio.wait_for(proc.wait(), 20)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def kill_daemon(proc: asyncio.subprocess.Process) -> None:
    """SIGKILL and reap."""
    proc.send_signal(signal.SIGKILL)
    await asyncio.wait_for(proc.wait(), 10)


async def kill_inside_model_call(config: Path, tmp_path: Path, tg: Any, hang: Gate, text: str, chat_id: int) -> None:
    """Start ``bumblebot run``, send ``text``, SIGKILL the daemon while ``hang`` holds its model call."""
    proc = await start_daemon(config, tmp_path)
    try:
        tg.push_text(text, chat_id=chat_id)
        await asyncio.wait_for(hang.entered.wait(), 20)
        await kill_daemon(proc)
    finally:
        if proc.returncode is None:
            proc.kill()
    hang.release.set()
