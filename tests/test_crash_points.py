"""A crash after every single write: the turn is resumed exactly (bumblebot/cognition/resume.py).

A process killed with SIGKILL stops between two SQLite commits: everything committed is on
disk (WAL), nothing after it happens. :class:`CrashingStore` reproduces exactly that, in
process and deterministically: after its ``k``-th committed write every further access to the
database raises :class:`Crash`, a ``BaseException`` that no handler of the engine catches, so
the tasks that touch the store die on the spot like a killed process. The test runs one
multi-step turn once to count its writes ``N``, then for every ``k`` in ``1..N`` crashes it
after write ``k``, starts a fresh daemon on the same database file, and checks what the user
saw and what the workspace holds.

The turn (a rule-based model, so it behaves the same wherever the crash lands): ``say`` part
one and ``append_file`` in one step, then ``say`` part two and ``end_turn``. After a crash the
model never says again a text its history holds, whatever the result of that ``say`` reports
(so a ``say`` recorded before the crash but never sent must be delivered by the engine when it
resumes the turn), and an ``append_file`` reported "interrupted" is checked with ``read_file``
before it is repeated.

* On **Discord** every message is seen exactly once for every ``k``: sends carry a nonce.
* On **Telegram** the same holds except for the send that was in flight at the crash
  (Telegram took it, the daemon had not recorded it): that one message is repeated once, the
  documented at-least-once limit of a platform without idempotency keys.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from conftest import TOKEN, write_config
from fakes.discord_server import FakeDiscord
from fakes.openai_server import FakeOpenAI, Reply, error, is_last_chance, is_loop, text, tool_calls
from fakes.telegram_server import FakeTelegram

from bumblebot.app.daemon import Daemon
from bumblebot.cognition.notes import LOOPING_MESSAGE, NO_REPLY_MESSAGE
from bumblebot.core.config import Secrets, load_settings
from bumblebot.core.entity import load_entity
from bumblebot.runtime.outage import OUTAGE_NOTICE
from bumblebot.store import Store

#: A crash abandons connections mid-request, as a killed process does; the OS would close them,
#: here the garbage collector does, and warns. Only this module's simulated crashes are exempt.
pytestmark = [
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]

PART_ONE, PART_TWO = "part one", "part two"
LINE = "remember the milk\n"


class Crash(BaseException):
    """The process died (raised from every database access after the crash point)."""


class CrashingStore(Store):
    """A real store that dies after its ``crash_after``-th committed write (``None``: never)."""

    def __init__(self, path: Path, crash_after: int | None) -> None:
        super().__init__(path)
        self.crash_after = crash_after
        self.writes = 0
        self.crashed = asyncio.Event()

    def _alive(self) -> None:
        if self.crashed.is_set():
            raise Crash

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[Any]:
        self._alive()
        async with super().transaction() as db:
            yield db
        self.writes += 1
        if self.crash_after is not None and self.writes >= self.crash_after:
            self.crashed.set()

    async def _one(self, sql: str, params: tuple[Any, ...] = ()) -> Any:
        self._alive()
        return await super()._one(sql, params)

    async def _all(self, sql: str, params: tuple[Any, ...] = ()) -> list[Any]:
        self._alive()
        return await super()._all(sql, params)


# -- the model ----------------------------------------------------------------------------------


def _results(request: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for m in request["messages"]:
        if m["role"] == "tool":
            try:
                out[m["tool_call_id"]] = json.loads(m["content"])
            except ValueError:
                out[m["tool_call_id"]] = m["content"]
    return out


def _calls(request: dict[str, Any]) -> list[tuple[str, dict[str, Any], Any]]:
    """``(name, arguments, result)`` of every tool call in the request, in order."""
    results = _results(request)
    out = []
    for m in request["messages"]:
        for call in m.get("tool_calls") or () if m["role"] == "assistant" else ():
            out.append((call["function"]["name"], json.loads(call["function"]["arguments"]), results.get(call["id"])))
    return out


def careful_model(request: dict[str, Any]) -> Reply:
    """Part one and the note, then part two; never says a text twice (what its history holds
    counts as said), checks an interrupted append before repeating it."""
    if not is_loop(request):
        return text("DONE: fine")
    calls = _calls(request)
    said = {a.get("text") for n, a, _ in calls if n == "say"}
    appends = [r for n, _, r in calls if n == "append_file"]
    reads = [r for n, _, r in calls if n == "read_file"]
    noted = any(isinstance(r, str) and "appended" in r.lower() for r in appends) or any(
        isinstance(r, str) and "milk" in r for r in reads
    )
    in_doubt = appends and not noted and isinstance(appends[-1], dict) and "Interrupted" in appends[-1].get("error", "")
    step: list[tuple[str, dict[str, Any]]] = []
    if PART_ONE not in said:
        step.append(("say", {"text": PART_ONE}))
    if in_doubt and not reads:
        step.append(("read_file", {"path": "notes.txt"}))
    elif not noted:
        step.append(("append_file", {"path": "notes.txt", "content": LINE}))
    if step:
        return tool_calls(*step)
    if PART_TWO not in said:
        return tool_calls(("say", {"text": PART_TWO}), ("end_turn", {}))
    return tool_calls(("end_turn", {}))


def looping_model(request: dict[str, Any]) -> Reply:
    """Lists the same directory without a word until the loop stops it (it is looping); the
    daemon's stop note is then the only message."""
    if is_last_chance(request):
        return error(500, "no plain answer either")
    if not is_loop(request):
        return text("DONE: fine")
    return tool_calls(("list_directory", {"path": "."}))


def silent_model(request: dict[str, Any]) -> Reply:
    """Only ever ends its turn without a word: the gate pushes twice, then the daemon's
    fallback note answers."""
    if is_last_chance(request):
        return error(500, "no plain answer either")
    return tool_calls(("end_turn", {})) if is_loop(request) else text("DONE: fine")


class OutageThenCareful:
    """The endpoint's first loop request fails with 503 (an outage); then :func:`careful_model`."""

    def __init__(self) -> None:
        self.failed = False

    def __call__(self, request: dict[str, Any]) -> Reply:
        if is_loop(request) and not self.failed:
            self.failed = True
            return error(503, "upstream connect error")
        return careful_model(request)


#: turn shape -> (model factory, config overrides, what the user must see, the note file)
SHAPES: dict[str, tuple[Any, dict[str, Any], list[str], str]] = {
    "two_parts": (lambda: careful_model, {}, [PART_ONE, PART_TWO], LINE),
    "step_cap": (lambda: looping_model, {"cognition": {"classifier": False, "tool_continuation_rounds": 0}},
                 [LOOPING_MESSAGE], ""),
    "fallback": (lambda: silent_model, {}, [NO_REPLY_MESSAGE], ""),
    "outage": (OutageThenCareful, {}, [OUTAGE_NOTICE, PART_ONE, PART_TWO], LINE),
}


# -- running a daemon on a crashing store ------------------------------------------------------


async def run_until(config: Path, secrets: Secrets, crash_after: int | None, trigger: Any) -> CrashingStore:
    """Start a daemon whose store crashes after ``crash_after`` writes, call ``trigger()``,
    wait for the crash (or, with ``None``, for one finished turn), and tear it down."""
    settings = load_settings(config)
    daemon = Daemon(settings, secrets, load_entity(settings.entity, config_dir=config.parent))
    store = daemon.store = CrashingStore(settings.db_path, crash_after)
    before = asyncio.all_tasks()
    try:
        await daemon.start()
        assert daemon.engine is not None
        await trigger()
        if crash_after is None:
            await daemon.engine.wait_for_turns(1, timeout=20)
        else:
            await asyncio.wait_for(store.crashed.wait(), 20)
    finally:
        store.crashed.set()
        if crash_after is not None:  # the process is gone: every task it ran stops where it is
            orphans = asyncio.all_tasks() - before - {asyncio.current_task()}
            for task in orphans:
                task.cancel()
            await asyncio.gather(*orphans, return_exceptions=True)
        with contextlib.suppress(Crash):
            await daemon.stop()  # only closes connections now: every write raises Crash
        await Store.close(store)
        del daemon
        # the abandoned connections are collected now, under this module's exemption: left to
        # a later collection, their warnings failed whichever test of another module ran then
        gc.collect()
    return store


async def finish(config: Path, secrets: Secrets) -> None:
    """A fresh daemon on the same database: it resumes (or starts) the turn and finishes it."""
    settings = load_settings(config)
    daemon = Daemon(settings, secrets, load_entity(settings.entity, config_dir=config.parent))
    try:
        await daemon.start()
        assert daemon.engine is not None
        engine = daemon.engine
        await engine.wait_until(lambda: engine.idle and not engine.waiting, timeout=20)  # all work done
        await daemon.delivery.retry_pending()  # waits for the sweeper's pass at start, if any
    finally:
        await daemon.stop()


def notes(config: Path) -> str:
    """What the workspace's notes.txt holds (``""`` if it does not exist)."""
    path = config.parent / "data" / "workspace" / "notes.txt"
    return path.read_text() if path.exists() else ""


# -- the two platforms --------------------------------------------------------------------------

QUESTION = "tell me in two parts and note the milk"


@contextlib.asynccontextmanager
async def platform(name: str, tmp_path: Path, shape: str) -> AsyncIterator[tuple[Path, Secrets, Any, Any]]:
    """The fakes, a config and secrets for ``name``; yields ``(config, secrets, send, seen)``:
    ``send()`` delivers the user's message, ``seen()`` lists what the user was shown."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    model, overrides, _, _ = SHAPES[shape]
    async with FakeOpenAI(default=model()) as llm:
        if name == "telegram":
            async with FakeTelegram(token=TOKEN) as tg:

                async def send_tg() -> None:
                    tg.push_text(QUESTION, chat_id=71)

                secrets = Secrets(TELEGRAM_BOT_TOKEN=TOKEN, OPENAI_API_KEY="sk-test-key-not-real-000000")
                yield write_config(tmp_path, llm, tg, **overrides), secrets, send_tg, lambda: tg.sent(71)
        else:
            async with FakeDiscord() as dc:

                async def send_dc() -> None:
                    await dc.send_dm(QUESTION)

                section = {"enabled": True, "api_base_url": dc.api_base, "gateway_url": dc.gateway_url}
                secrets = Secrets(DISCORD_BOT_TOKEN=dc.token, OPENAI_API_KEY="sk-test-key-not-real-000000")
                yield write_config(tmp_path, llm, None, discord=section, **overrides), secrets, send_dc, dc.messages_sent


async def crash_case(
    name: str, shape: str, tmp_path: Path, crash_after: int | None
) -> tuple[list[str], str, list[str], int]:
    """The turn with a crash after write ``crash_after`` (``None``: no crash) and a restart.

    Returns what the user saw, what notes.txt holds, what the user had seen when the first
    process died, and how many writes that process committed.
    """
    async with platform(name, tmp_path, shape) as (config, secrets, send, seen):
        store = await run_until(config, secrets, crash_after, send)
        before = list(seen())
        if crash_after is not None:
            await finish(config, secrets)
        return list(seen()), notes(config), before, store.writes


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("name", ["telegram", "discord"])
@pytest.mark.timeout(300)
async def test_a_crash_after_any_write_is_resumed_exactly(tmp_path, name, shape):
    _, _, expected, expected_note = SHAPES[shape]
    seen, note, _, total = await crash_case(name, shape, tmp_path / "uncrashed", None)
    assert seen == expected and note == expected_note
    assert total >= 5  # journal, turn begin, the step records and outbox rows, finish
    problems = []
    for k in range(1, total + 1):
        seen, note, before, _ = await crash_case(name, shape, tmp_path / f"k{k}", k)
        if note != expected_note:
            problems.append(f"crash after write {k}: notes.txt holds {note!r}")
        if name == "discord" or not before:
            if seen != expected:
                problems.append(f"crash after write {k}: the user saw {seen}")
            continue
        # Telegram: only the message it took in the instant before the crash may come twice
        repeats = {t for t in seen if seen.count(t) > 1}
        if sorted(set(seen)) != sorted(expected) or not repeats <= {before[-1]} or len(seen) > len(expected) + 1:
            problems.append(f"crash after write {k}: the user saw {seen} (before the crash: {before})")
    assert problems == [], "\n".join(problems)
