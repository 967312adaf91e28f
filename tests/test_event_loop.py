"""Nothing blocks the event loop (spec, "Nothing blocks the loop").

* The text rules and the router's cues are linear in the text: inputs that make a backtracking
  regex or a quadratic scan run for minutes return at once. "At once" is proven without a
  timed test: the call runs in a child process with a generous timeout (5 s) that the old code
  overran by minutes. Not in a thread: a regex holds the GIL while it backtracks, so the
  thread that waits on ``join(timeout)`` cannot even run until the match is over.
* Two chats: while one chat's model answers with a pathological text, the other is answered.
* ``LoopWatchdog`` logs a deliberate stall once, with the function's name, and nothing on a
  healthy loop; it stops cleanly.
"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import running, write_config
from fakes.openai_server import text
from support import contents, is_adequacy_judge, is_loop_with, judges_say_done, say

from bumblebot.app.watchdog import LoopWatchdog, location
from bumblebot.cognition.gate import CompletionGate, GateInput
from bumblebot.cognition.router import heuristic

ROOT = Path(__file__).resolve().parent.parent

#: Texts that would make a backtracking pattern or a quadratic scan hold the loop for seconds.
PATHOLOGICAL = [
    "[a] " * 50_000,
    ". " * 100_000 + "x",
    "{" * 100_000,
    '{"name": ' * 30_000,
    "<tool_call>" * 20_000,
    "functions." + "a" * 100_000,
    "```\n" * 30_000,
    "<think>" * 20_000 + "</think" * 20_000,
    "let me check, " * 12 + "... 42",
]
TOOLS = "{'say', 'read_file', 'end_turn'}"
NOTES = "['[Same turn] Tool results are ready. Already told the user (do not repeat): \"a\".']"


def finishes(function: str, value: str, timeout: float = 5.0, *, args: str = "") -> Any:
    """``function(value, *args)`` (``"module:expression"``, the expression evaluated in the
    module's namespace; ``args`` is Python source evaluated there too) in a child process:
    whether its result is truthy; fails if it has not returned within ``timeout`` seconds of
    being given ``value`` (the child is then killed). The child's start-up and imports come
    before that and are not counted: on a loaded machine importing discord.py alone can take
    seconds."""
    module, name = function.split(":", 1)
    rest = f", *[{args}]" if args else ""
    code = (
        f"import json, sys; from {module} import *; f = {name}; print('ready', flush=True); "
        f"print(json.dumps(bool(f(sys.stdin.read(){rest}))), flush=True)"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, cwd=ROOT,
    )
    try:
        ready = _line(child, 120.0)
        assert ready == "ready\n", f"{function}: the child did not start ({ready!r}): {child.stderr.read() if ready == '' else ''}"
        assert child.stdin is not None
        child.stdin.write(value)
        child.stdin.close()
        answer = _line(child, timeout)
        if answer is None:
            pytest.fail(f"{function} still running after {timeout} s on {value[:40]!r}… ({len(value)} chars)")
        assert answer, f"{function} failed: {child.stderr.read()}"
        return json.loads(answer)
    finally:
        child.kill()
        child.wait()
        for stream in (child.stdin, child.stdout, child.stderr):
            if stream is not None and not stream.closed:
                stream.close()


def _line(child: subprocess.Popen[str], timeout: float) -> str | None:
    """The child's next line of output ("" at its end), or None when none came within ``timeout``
    seconds. Read in a thread: the pipe read releases the GIL, the child runs the work."""
    got: list[str] = []
    assert child.stdout is not None
    reader = threading.Thread(target=lambda: got.append(child.stdout.readline()), daemon=True)  # type: ignore[union-attr]
    reader.start()
    reader.join(timeout)
    return got[0] if got else None


# -- the text rules --------------------------------------------------------------------------------


@pytest.mark.parametrize("value", PATHOLOGICAL, ids=lambda v: f"{v[:8]!r}x{len(v)}")
@pytest.mark.parametrize("rule", [
    "strip_reasoning", "shown_so_far", f"EchoFilter({NOTES})", f"lambda text: call_as_text(text, {TOOLS})",
    f"lambda text: may_be_call(text, {TOOLS})",
])
def test_the_text_rules_return_at_once_on_pathological_text(rule, value):
    finishes(f"bumblebot.core.textrules:{rule}", value)


# -- the router -----------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["a-" * 20_000, "a-" * 50_000 + ".", "x-" * 20_000 + ".md", "-" * 30_000 + "a.com"])
def test_router_cues_are_linear_on_hyphen_runs(value):
    assert finishes("bumblebot.cognition.router:heuristic", value)  # old `\b[\w-]+\.`: 3 s at 20,000 chars, quadratic
    assert heuristic(value) is not None


@pytest.mark.parametrize(
    "value", ["hello " * 20_000, "hi" + " a" * 50_000, "good morning " + "sam " * 30_000, "hey " + "x" * 100_000]
)
def test_router_greeting_and_brief_rules_are_linear(value):
    assert finishes("bumblebot.cognition.router:heuristic", value)  # every one is "long": deliberate
    assert heuristic(value).reason.startswith("long: ")


def test_router_still_finds_file_names_and_domains():
    assert heuristic("open my-notes.md please").reason == "file: 'my-notes.md'"
    assert heuristic("what's on foo-bar.com today").reason == "research: 'foo-bar.com'"
    assert heuristic("check --weird-name.txt").reason.startswith("file: ")
    decision = heuristic("what about a-b and c-d")
    assert decision is None or not decision.reason.startswith(("file", "research"))


# -- two chats ------------------------------------------------------------------------------------


async def test_another_chat_is_answered_while_a_pathological_text_is_delivered(tmp_path, llm, tg, caplog):
    """Chat A's model answers with a text that once froze the loop; chat B, written as that
    answer goes out, is answered within a few seconds (it used to wait for minutes)."""
    caplog.set_level(logging.WARNING, logger="bumblebot.app.watchdog")
    judges_say_done(llm)
    pathological = "let me check, " * 20 + "... the answer is 42"

    def answer_a(request: dict[str, Any]) -> Any:
        tg.push_text("hello from chat B", chat_id=2)  # B arrives while A's reply is judged
        return text(pathological)

    llm.push(answer_a, when=is_loop_with("question from chat A"))
    llm.push(say("hi B!"), when=is_loop_with("hello from chat B"))
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("question from chat A: research what the answer is", chat_id=1)
        await tg.wait_for("sendMessage", timeout=5, predicate=lambda p: int(p["chat_id"]) == 2)
        await tg.wait_for("sendMessage", timeout=5, predicate=lambda p: int(p["chat_id"]) == 1)
        await d.engine.wait_for_turns(2)
    assert tg.sent(2) == ["hi B!"]
    assert tg.sent(1) == [pathological]  # delivered as written, and the adequacy judge let it end
    assert any(is_adequacy_judge(r) and pathological[:40] in contents(r) for r in llm.requests)
    assert not [r for r in caplog.records if "bumblebot.cognition.gate" in r.getMessage()]
    assert not llm.unscripted


# -- the watchdog ---------------------------------------------------------------------------------


class Recorder(logging.Handler):
    """Keeps the watchdog's records; sets ``ended`` (on the loop) when a stall's end is logged."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self.ended = asyncio.Event()
        self._loop = loop

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        if "ended after" in record.getMessage():
            self._loop.call_soon_threadsafe(self.ended.set)

    def warnings(self) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno >= logging.WARNING]


@pytest.fixture
async def recorder() -> Any:
    handler = Recorder(asyncio.get_running_loop())
    logger = logging.getLogger("bumblebot.app.watchdog")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


def watchdog_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "bumblebot:watchdog"]


async def hold_the_loop() -> None:
    time.sleep(0.8)  # noqa: ASYNC251 - the stimulus: a blocking call on the loop


async def test_a_blocking_call_is_logged_once_with_its_name(recorder):
    async with LoopWatchdog(threshold_s=0.3, interval_s=0.02) as watchdog:
        await asyncio.create_task(hold_the_loop(), name="holder")
        await asyncio.wait_for(recorder.ended.wait(), 5)
    [warning] = recorder.warnings()
    assert "event loop stalled for" in warning
    assert "hold_the_loop (test_event_loop.py:" in warning and "task holder" in warning
    [end] = [r.getMessage() for r in recorder.records if r.levelno == logging.INFO]
    assert "hold_the_loop" in end and "ended after" in end
    assert watchdog.stalls == 1


async def test_the_stall_is_named_after_our_own_innermost_frame(recorder):
    blocked = []

    def on_beat() -> None:  # called from bumblebot/app/watchdog.py: that is the frame named
        if not blocked:
            blocked.append(True)
            time.sleep(0.8)

    async with LoopWatchdog(threshold_s=0.3, interval_s=0.02, on_beat=on_beat):
        await asyncio.wait_for(recorder.ended.wait(), 5)
    [warning] = recorder.warnings()
    assert "in bumblebot.app.watchdog.LoopWatchdog._heartbeat (watchdog.py:" in warning


async def test_a_healthy_loop_logs_nothing(recorder):
    beats = 0
    enough = asyncio.Event()

    def on_beat() -> None:
        nonlocal beats
        beats += 1
        if beats == 25:
            enough.set()

    async with LoopWatchdog(threshold_s=0.5, interval_s=0.02, on_beat=on_beat) as watchdog:
        await asyncio.wait_for(enough.wait(), 5)
    assert recorder.records == [] and watchdog.stalls == 0


async def test_a_failing_on_beat_is_logged_once_and_the_heartbeat_goes_on(recorder):
    beats = 0
    enough = asyncio.Event()

    def on_beat() -> None:
        nonlocal beats
        beats += 1
        if beats == 5:
            enough.set()
        raise RuntimeError("sd_notify failed")

    async with LoopWatchdog(threshold_s=0.5, interval_s=0.01, on_beat=on_beat):
        await asyncio.wait_for(enough.wait(), 5)
    assert [r.levelno for r in recorder.records] == [logging.ERROR]


async def test_stop_is_idempotent_and_leaves_no_thread(recorder):
    before = set(asyncio.all_tasks())
    watchdog = LoopWatchdog(threshold_s=0.5, interval_s=0.01)
    await watchdog.stop()  # never started: nothing to do, and it cannot start any more
    with pytest.raises(RuntimeError, match="stopped"):
        await watchdog.start()
    watchdog = LoopWatchdog(threshold_s=0.5, interval_s=0.01)
    await watchdog.start()
    assert len(watchdog_threads()) == 1 and watchdog_threads()[0].daemon
    with pytest.raises(RuntimeError, match="running"):
        await watchdog.start()
    await watchdog.stop()
    await watchdog.stop()
    assert watchdog_threads() == []
    assert set(asyncio.all_tasks()) == before


async def test_the_daemon_runs_the_watchdog_from_start_to_stop(tmp_path, llm, tg):
    async with running(write_config(tmp_path, llm, tg)) as d:
        assert len(watchdog_threads()) == 1
        assert any(t.get_name() == "bumblebot:watchdog" for t in asyncio.all_tasks())
    assert watchdog_threads() == []
    assert not any(t.get_name() == "bumblebot:watchdog" for t in asyncio.all_tasks())
    await d.stop()  # stopping again is harmless


def test_location_prefers_our_own_frames():
    assert location(sys._getframe()).startswith("test_event_loop.test_location_prefers_our_own_frames (")
    seen = []

    async def judge(messages: list[dict[str, Any]]) -> str:
        seen.append(location(sys._getframe()))
        return "DONE: ok"

    asyncio.run(CompletionGate(judge).check(GateInput(user_text="hi", visible=["hey"], work_calls=0, work_ok=0)))
    assert seen[0].startswith("bumblebot.cognition.gate.CompletionGate._verdict (gate.py:")


def test_thresholds_must_be_positive():
    with pytest.raises(ValueError):
        LoopWatchdog(threshold_s=0)
    with pytest.raises(ValueError):
        LoopWatchdog(interval_s=-1)


# -- message splitting and Discord mentions (the regexes the audit found quadratic) ----------------

#: Runs of one character with no match at their end: the old patterns rescanned each run from
#: every position in it (20 000 dots took 3.2 s in ``_SENTENCE``, 20 000 spaces 0.6 s in ``_LINE``).
SPLIT_RUNS = [
    "." * 200_000 + "x",
    " " * 200_000 + "x",
    " " * 200_000 + "\nx",
    "!" * 100_000 + ")" * 100_000 + "x",
    ("word " * 10 + " " * 5_000 + "\n") * 40,
]


@pytest.mark.parametrize("value", SPLIT_RUNS, ids=lambda v: f"{v[:1]!r}x{len(v)}")
def test_splitting_returns_at_once_on_long_runs(value):
    assert finishes("bumblebot.delivery.splitting:split_markdown", value, args="4096")


def test_splitting_still_cuts_at_paragraphs_lines_and_sentences():
    from bumblebot.delivery.splitting import split_text

    assert split_text("one two.  \n\nthree four", 12) == ["one two.", "three four"]
    assert split_text("one two three  \nfour", 16) == ["one two three", "four"]
    assert split_text("One is here... Two is here! Three", 30) == ["One is here... Two is here!", "Three"]


def test_discord_mention_cleanup_returns_at_once_on_a_long_blank_run():
    assert finishes("adapters.discord.mentions:readable_text", " " * 200_000 + "x", args="MentionNames()")
