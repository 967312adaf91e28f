"""Small helpers shared by the end-to-end tests."""

from __future__ import annotations

import asyncio
import json
import os
import selectors
import signal
import sqlite3
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from conftest import TOKEN, running, write_config
from fakes.discord_server import FakeDiscord
from fakes.openai_server import FakeOpenAI, Reply, error, is_aux, is_last_chance, text, tool_calls
from fakes.telegram_server import FakeTelegram

from bumblebot.core.adapter import Adapter
from bumblebot.core.errors import DeliveryFailed
from bumblebot.core.events import ChatRef, Platform

#: A chat input the router's heuristic cannot place (80 to 200 characters, no cue either way):
#: only such input reaches the classifier (a brief or cued input is routed without it).
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


async def until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    """Wait until ``condition`` holds (for state that notifies nobody, such as the request
    slots: it is polled), or fail."""
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.01)


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


def user_text(request: dict[str, Any]) -> str:
    """The last user message of a model request (the turn's input)."""
    return [m["content"] for m in request["messages"] if m["role"] == "user"][-1]


#: Characters that show nothing (zero-width space and non-joiner, joiner, word joiner, BOM): a
#: message of only these is blank to an endpoint that refuses blank text.
ZERO_WIDTH = "\u200b\u200c\u200d\u2060\ufeff"
#: How the answer to ``/reset`` begins.
FRESH = "Fresh start"


# -- the daemon's database -------------------------------------------------------------------------


def db(tmp_path: Path) -> sqlite3.Connection:
    return sqlite3.connect(tmp_path / "data" / "bumblebot.db")


def journal_texts(tmp_path: Path) -> list[tuple[str, str]]:
    """``(text, status)`` of every journaled message, oldest first."""
    rows = sqlite3.connect(tmp_path / "data" / "bumblebot.db").execute("SELECT text, status FROM journal ORDER BY id")
    return [tuple(r) for r in rows]


# -- Telegram --------------------------------------------------------------------------------------


async def handled(tg: FakeTelegram, update: dict[str, Any]) -> None:
    """Wait until the daemon acknowledged ``update`` (its next poll starts past it)."""
    await tg.wait_for("getUpdates", predicate=lambda p: int(p.get("offset") or 0) > update["update_id"], timeout=10)


#: The longest message a Telegram client sends in one piece, characters.
TG_LIMIT = 4096


def telegram_parts(paste: str) -> list[str]:
    """``paste`` cut as a Telegram client cuts a long message: at line breaks, each part at
    most 4096 characters, the break itself dropped."""
    parts, current = [], ""
    for line in paste.split("\n"):
        if current and len(current) + 1 + len(line) > TG_LIMIT:
            parts.append(current)
            current = line
        else:
            current = f"{current}\n{line}" if current else line
    parts.append(current)
    return parts


# -- Discord (the ``dc`` fixture is in conftest.py) -------------------------------------------------

#: The test guild and its channel.
GUILD_ID = "600000000000000060"
CHANNEL_ID = "600000000000000061"


def discord_config(tmp_path: Path, llm: FakeOpenAI, dc: FakeDiscord, **sections: Any) -> Path:
    section = {"enabled": True, "api_base_url": dc.api_base, "gateway_url": dc.gateway_url}
    return write_config(tmp_path, llm, None, discord=section, **sections)


def discord_bot(dc: FakeDiscord, config: Path) -> Any:
    """The daemon serving Discord only, as ``bumblebot run`` with DISCORD_BOT_TOKEN set."""
    return running(config, telegram_token=None, discord_token=dc.token)


async def discord_barrier(dc: FakeDiscord, n: int) -> None:
    """Wait until every event dispatched so far was handled: a ``/help`` DM from another user
    (answered without a turn) is taken after them; ``n`` counts the barriers so far."""
    carol = dc.human("2000000000000000077", "carol")
    await dc.send_dm("/help", author=carol)
    await dc.wait_for_call("POST", f"/channels/{dc.dm_channel_id(carol)}/messages", n=n, status=200)


# -- a platform whose sends fail on demand -----------------------------------------------------------


class FlakyConsole(Adapter):
    """A console-like platform whose sends fail on demand (a real Adapter, no mock library)."""

    platform = Platform.CONSOLE

    def __init__(self, fail_on_call: set[int], crash_on_call: set[int] = frozenset()) -> None:
        self.fail_on_call = fail_on_call
        self.crash_on_call = crash_on_call
        self.calls = 0
        self.sent: list[str] = []

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def chunks(self, text: str) -> list[str]:
        return text.split("|")

    async def send_chunk(self, chat: ChatRef, text: str, *, key: str = "") -> str:
        self.calls += 1
        if self.calls in self.crash_on_call:
            raise asyncio.CancelledError  # the process is going down mid-message
        if self.calls in self.fail_on_call:
            raise DeliveryFailed("network down", retryable=True)
        self.sent.append(text)
        return str(self.calls)

    async def send_typing(self, chat: ChatRef) -> None: ...


# -- endpoints with a small window -------------------------------------------------------------------


def tokenizer_fake(window: int, reply: Any, chars_per_token: float) -> Any:
    """A server whose tokenizer counts ``chars_per_token`` characters a token: it refuses a
    prompt plus ``max_tokens`` over ``window`` the way vLLM words it, and reports honest usage."""
    import time as _time

    def endpoint(request: dict[str, Any]) -> Reply:
        prompt = int((len(json.dumps(request["messages"])) + len(json.dumps(request.get("tools", [])))) / chars_per_token)
        asked = int(request.get("max_tokens", 0))
        if prompt + asked > window:
            return error(400, f"This model's maximum context length is {window} tokens. However, you requested "
                              f"{prompt + asked} tokens ({prompt} in the messages, {asked} in the completion).")
        answer = reply(request)
        message = dict(answer.message or {})
        if not message.get("tool_calls"):
            message.pop("tool_calls", None)
        return Reply(body={
            "id": "chatcmpl-t", "object": "chat.completion", "created": int(_time.time()), "model": request["model"],
            "choices": [{"index": 0, "message": message, "finish_reason": answer.finish_reason, "logprobs": None}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": 10, "total_tokens": prompt + 10},
        })

    return endpoint


def chatty(answer: str) -> Any:
    """A model that answers every turn with ``answer``, compacts with a summary of every heading
    and finds no durable facts; judges say DONE."""
    from bumblebot.cognition.compaction import SUMMARY_HEADINGS

    summary = "\n".join(f"## {h}\n- the user keeps telling me about the garden" for h in SUMMARY_HEADINGS)

    def reply(request: dict[str, Any]) -> Reply:
        if is_aux(request):
            if "durable facts" in contents(request):
                return text("[]")
            if "You compact the history" in contents(request):
                return text(summary)
            return text("DONE: fine")
        return say(answer)

    return reply


# -- virtual time -------------------------------------------------------------------------


class _JumpingSelector(selectors.DefaultSelector):
    """Polls the real selector without blocking; a wait for a timer moves the clock instead."""

    def __init__(self, loop: VirtualClockLoop) -> None:
        super().__init__()
        self._loop = loop

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        events = super().select(0)
        if not events and timeout is None:
            raise RuntimeError("deadlock: nothing is scheduled and nothing can wake the loop")
        if not events and timeout:
            self._loop.now += timeout
        return events


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock only moves when every task waits for a timer."""

    def __init__(self) -> None:
        self.now = 1000.0
        super().__init__(_JumpingSelector(self))

    def time(self) -> float:
        return self.now


def virtual(main: Coroutine[Any, Any, Any]) -> Any:
    loop = VirtualClockLoop()
    try:
        return loop.run_until_complete(main)
    finally:
        loop.close()


def now() -> float:
    return asyncio.get_running_loop().time()
