"""Turns that survive a crash or an outage exactly (bumblebot/cognition/resume.py, the runner).

Subprocess tests run the real ``bumblebot run`` and SIGKILL it at a chosen event; in-process
tests run the daemon in this event loop. All of them use the real python-telegram-bot, openai
and discord.py clients against the fakes, and real SQLite files.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import sys
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import pytest
from aiohttp import web
from conftest import running, write_config
from fakes.discord_server import FakeDiscord
from fakes.openai_server import error, is_aux, is_loop, text, tool_calls
from support import (
    Gate,
    contents,
    db,
    env_for,
    judges_say_done,
    kill_daemon,
    loop_requests,
    say,
    start_daemon,
    stop_daemon,
    tool_result,
)

from bumblebot.cognition.budget import ContextBudget
from bumblebot.cognition.knowledge import Memory
from bumblebot.cognition.notes import INTERRUPTED
from bumblebot.cognition.state import LoopState
from bumblebot.core.events import ChatKind, ChatRef, Inbound, Platform
from bumblebot.core.messages import Message, TurnContext
from bumblebot.core.toolkit import ToolKind
from bumblebot.runtime.conversation import Session, Turn
from bumblebot.runtime.turnstate import TurnState
from bumblebot.store import CompactionState, Store


class SlowSite:
    """A local web page that never answers until released: a work tool that is mid-call."""

    def __init__(self) -> None:
        self.hits = 0
        self.entered = asyncio.Event()
        self.release = asyncio.Event()
        self.url = ""

    async def handler(self, request: web.Request) -> web.Response:
        self.hits += 1
        self.entered.set()
        await self.release.wait()
        return web.Response(text="the page")


@pytest.fixture
async def site() -> AsyncIterator[SlowSite]:
    slow = SlowSite()
    app = web.Application()
    app.router.add_get("/page", slow.handler)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    slow.url = f"http://127.0.0.1:{runner.addresses[0][1]}/page"
    yield slow
    slow.release.set()
    await runner.cleanup()


async def test_a_call_cut_off_by_a_crash_is_reported_interrupted_and_never_run_again(tmp_path, llm, tg, site):
    judges_say_done(llm)
    (tmp_path / "data" / "workspace").mkdir(parents=True)
    (tmp_path / "data" / "workspace" / "a.txt").write_text("alpha")
    llm.push(tool_calls(("read_file", {"path": "a.txt"})), when=is_loop)
    llm.push(tool_calls(("fetch_url", {"url": site.url})), when=is_loop)
    config = write_config(tmp_path, llm, tg, tools={"web": {"allow_private": True}})
    proc = await start_daemon(config, tmp_path)
    try:
        tg.push_text("read a.txt, then fetch the page", chat_id=61)
        await asyncio.wait_for(site.entered.wait(), 20)  # step 2's fetch is running
        await kill_daemon(proc)
    finally:
        if proc.returncode is None:
            proc.kill()
    site.release.set()
    llm.push(say("a.txt says alpha; the page fetch was cut off"), when=is_loop)
    proc = await start_daemon(config, tmp_path)
    try:
        await tg.wait_for("sendMessage", timeout=20)
        await tg.wait_for("getUpdates", n=2, predicate=lambda p: int(p.get("offset", 0)) > 0, timeout=10)
        assert await stop_daemon(proc) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
    resumed = loop_requests(llm)[-1]
    assert tool_result(resumed, "read_file")[0] == "alpha"  # step 1 was checkpointed: not run again
    [fetch] = tool_result(resumed, "fetch_url")
    assert fetch == {"error": INTERRUPTED}
    assert site.hits == 1  # the cut-off call was not silently run again
    assert tg.sent(61) == ["a.txt says alpha; the page fetch was cut off"]
    assert db(tmp_path).execute("SELECT status FROM turns").fetchall() == [("done",)]


async def test_a_message_steered_into_a_turn_is_answered_by_the_resumed_turn(tmp_path, llm, tg):
    judges_say_done(llm)
    first = Gate(tool_calls(("think", {"thought": "planning"})))
    second = Gate(say("never"))
    llm.push(first, when=is_loop)
    llm.push(second, when=is_loop)
    config = write_config(tmp_path, llm, tg)
    proc = await start_daemon(config, tmp_path)
    try:
        tg.push_text("plan my week", chat_id=62)
        await asyncio.wait_for(first.entered.wait(), 20)
        tg.push_text("and include Sunday", chat_id=62)
        await tg.wait_for("getUpdates", predicate=lambda p: int(p.get("offset", 0)) >= 3, timeout=10)
        first.release.set()
        await asyncio.wait_for(second.entered.wait(), 20)
        assert "and include Sunday" in contents(loop_requests(llm)[-1])  # steered into step 2
        await kill_daemon(proc)
    finally:
        if proc.returncode is None:
            proc.kill()
    second.release.set()
    llm.push(say("Monday to Sunday, planned"), when=is_loop)
    proc = await start_daemon(config, tmp_path)
    try:
        await tg.wait_for("sendMessage", timeout=20)
        assert await stop_daemon(proc) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
    assert tg.sent(62) == ["Monday to Sunday, planned"]
    resumed = contents(loop_requests(llm)[-1])
    assert "plan my week" in resumed and "and include Sunday" in resumed
    rows = db(tmp_path).execute("SELECT status, turn_id FROM journal ORDER BY id").fetchall()
    assert rows == [("done", 1), ("done", 1)]  # both answered by the one resumed turn
    assert db(tmp_path).execute("SELECT COUNT(*) FROM turns").fetchone() == (1,)


async def test_endpoint_down_for_20_s_then_up_answers_after_one_notice(tmp_path, llm, tg):
    judges_say_done(llm)
    down_until: list[float] = []

    def endpoint(request: dict[str, Any]) -> Any:
        if not down_until:
            down_until.append(time.monotonic() + 20)
        if time.monotonic() < down_until[0]:
            return error(503, "upstream connect error")
        if is_aux(request):
            return text("DONE: fine")
        return say("back, and here is your answer")

    llm.default = endpoint
    config = write_config(tmp_path, llm, tg)
    async with running(config) as d:
        tg.push_text("what's the plan?", chat_id=63)
        await tg.wait_for("sendMessage", n=2, timeout=60)
        await d.engine.wait_for_turns(1, timeout=10)
    assert tg.sent(63) == [
        "My language model isn't reachable right now. I'll answer as soon as it's back; "
        "no need to send your message again.",
        "back, and here is your answer",
    ]
    failures = [r for r in llm.request_log if r.status == 503]
    assert len(failures) >= 4  # retried with backoff meanwhile
    gaps = [b.time - a.time for a, b in zip(failures, failures[1:])]
    assert all(g <= 60.5 for g in gaps) and gaps == sorted(gaps)  # backing off, capped
    assert db(tmp_path).execute("SELECT status FROM journal").fetchall() == [("done",)]
    [(status, trace)] = db(tmp_path).execute("SELECT status, trace FROM turns").fetchall()
    assert status == "done" and json.loads(trace)["outage_s"] >= 19


async def test_endpoint_down_past_the_limit_fails_honestly_and_the_next_message_works(tmp_path, llm, tg):
    llm.default = lambda request: error(502, "bad gateway")
    config = write_config(tmp_path, llm, tg, engine={"outage_limit_s": 1.5, "shutdown_grace_s": 5})
    async with running(config) as d:
        tg.push_text("anyone home?", chat_id=64)
        await tg.wait_for("sendMessage", n=2, timeout=20)
        await d.engine.wait_for_turns(1, timeout=10)
        notice, gave_up = tg.sent(64)
        assert "isn't reachable" in notice
        assert "couldn't reach my language model" in gave_up and "send it again" in gave_up
        judges_say_done(llm)
        llm.push(say("hello again"), when=is_loop)
        tg.push_text("anyone home now?", chat_id=64)
        await tg.wait_for("sendMessage", n=3, timeout=10)
    assert tg.sent(64)[2] == "hello again"
    statuses = db(tmp_path).execute("SELECT status FROM journal ORDER BY id").fetchall()
    assert statuses == [("failed",), ("done",)]


async def test_an_outage_survives_a_restart_without_a_second_notice(tmp_path, llm, tg):
    llm.default = lambda request: error(503, "down")
    config = write_config(tmp_path, llm, tg)
    async with running(config):
        tg.push_text("are you up?", chat_id=65)
        await tg.wait_for("sendMessage", timeout=10)  # the notice
        await llm.wait_for_requests(2, timeout=10)  # and a retry after it
    judges_say_done(llm)
    llm.push(say("up now"), when=is_loop)
    async with running(config) as d:
        await tg.wait_for("sendMessage", n=2, timeout=10)
        await d.engine.wait_for_turns(1)
    assert [t for t in tg.sent(65) if "reachable" in t] and tg.sent(65)[1:] == ["up now"]


async def left_running(tmp_path, chat_id: str, text: str, state: dict[str, Any]) -> None:
    """A turn of Telegram chat ``chat_id`` answering ``text``, left running with ``state`` by
    the last process."""
    chat = ChatRef(Platform.TELEGRAM, chat_id)
    async with Store(tmp_path / "data" / "bumblebot.db") as store:
        journal_id = await store.journal(Inbound(chat, "1", chat_id, "Ann", text, ChatKind.PRIVATE))
        conversation = await store.conversation(chat)
        await store.begin_turn(conversation.id, conversation.session, [journal_id], Message(role="user", content=text), state)


@pytest.mark.parametrize("state", [{"resumes": 3, "stalled_resumes": 3}, {"resumes": 10, "stalled_resumes": 0}])
async def test_a_turn_resumed_too_often_is_given_up_with_one_message(tmp_path, llm, tg, state):
    config = write_config(tmp_path, llm, tg)
    # cut off at the same point, or after each of its steps
    await left_running(tmp_path, "66", "crash me", {"route": "reflex", **state})
    async with running(config) as d:
        await tg.wait_for("sendMessage", timeout=10)
        await d.engine.wait_for_turns(1)
    assert llm.requests == []
    assert "interrupted several times" in tg.sent(66)[0]
    assert db(tmp_path).execute("SELECT status FROM journal").fetchall() == [("failed",)]


async def test_a_step_of_the_model_starts_the_count_of_resumes_again(tmp_path, llm, tg):
    """A turn whose workers were killed while it progressed (the cluster drill: a chat taken
    over three times) is not given up: only resumes with no step between them count."""
    judges_say_done(llm)
    llm.push(say("still here"), when=is_loop)
    config = write_config(tmp_path, llm, tg)
    # this start's resume is its third with no step
    await left_running(tmp_path, "67", "keep going", {"route": "reflex", "resumes": 5, "stalled_resumes": 2})
    async with running(config) as d:
        await tg.wait_for("sendMessage", timeout=10)
        await d.engine.wait_for_turns(1)
    assert tg.sent(67) == ["still here"]
    [(state,)] = db(tmp_path).execute("SELECT state FROM turns").fetchall()
    assert json.loads(state)["stalled_resumes"] == 0  # a crash after its step would be its first resume again
    assert json.loads(state)["resumes"] == 6  # as the trace tells


async def test_the_learned_token_scale_survives_a_restart(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(say("ok"), when=is_loop)
    config = write_config(tmp_path, llm, tg)
    original = llm._completion

    def dense_usage(body: dict[str, Any], reply: Any) -> dict[str, Any]:
        out = original(body, reply)  # an endpoint whose tokenizer counts far more than we guess
        out["usage"]["prompt_tokens"] *= 8
        return out

    llm._completion = dense_usage  # type: ignore[method-assign]
    async with running(config) as d:
        tg.push_text("hi", chat_id=67)
        await d.engine.wait_for_turns(1)
        learned = d.budget.scale
    assert learned > 1.2
    async with running(config) as d:
        assert d.budget.scale == pytest.approx(learned, abs=0.06)


async def test_a_second_process_on_a_held_data_dir_exits_at_once_naming_the_holder(tmp_path, llm, tg):
    config = write_config(tmp_path, llm, tg)
    env = env_for(tmp_path)
    holder = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bumblebot", "--config", str(config), "chat",
        env=env, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        assert holder.stdout is not None
        assert b"Talking to" in await asyncio.wait_for(holder.stdout.readline(), 30)  # it holds the lock
        for command in ("chat", "run"):
            started = time.monotonic()
            second = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "bumblebot", "--config", str(config), command,
                env=env, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            _, err = await asyncio.wait_for(second.communicate(b"hello\n"), 30)
            assert second.returncode == 1, err
            assert b"in use" in err and f"pid {holder.pid}".encode() in err
            assert time.monotonic() - started < 20  # "at once": not after the holder ends (a loaded CI took 10.4 s)
    finally:
        await asyncio.wait_for(holder.communicate(b"/quit\n"), 30)
    assert llm.requests == [] and tg.sent() == []  # nobody answered "hello"
    assert db(tmp_path).execute("SELECT COUNT(*) FROM journal").fetchone() == (0,)


async def test_a_discord_resend_after_a_crash_is_deduplicated_by_its_nonce(tmp_path, llm):
    judges_say_done(llm)
    llm.push(say("exactly once"), when=is_loop)
    async with FakeDiscord() as dc:
        section = {"enabled": True, "api_base_url": dc.api_base, "gateway_url": dc.gateway_url}
        config = write_config(tmp_path, llm, None, discord=section)
        async with running(config, telegram_token=None, discord_token=dc.token) as d:
            await dc.send_dm("hi")
            await dc.wait_for_call("POST", r"/channels/\d+/messages", status=200)
            await d.engine.wait_for_turns(1)
            # the process died after Discord took the message, before it was recorded as sent
            await d.store.db.execute("UPDATE outbox SET status='pending', platform_message_ids='[]'")
            [entry] = await d.store.outbox_pending()
            assert (await d.delivery.deliver(entry)).delivered
        assert dc.messages_sent() == ["exactly once"]


# -- pure logic -------------------------------------------------------------------------------


def _kind(name: str) -> ToolKind:
    return ToolKind.AGENCY if name in ("say", "think", "end_turn", "wait") else ToolKind.WORK


def test_replaying_a_transcript_rebuilds_what_the_loop_knew():
    call = lambda i, name, args: {"id": f"c{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}  # noqa: E731
    transcript = [
        Message(role="user", content="read it and tell me"),
        Message(role="assistant", tool_calls=[call(1, "read_file", {"path": "a"}), call(2, "say", {"text": "reading"})]),
        Message(role="tool", content="alpha", tool_call_id="c1", name="read_file", ok=True),
        Message(role="tool", content='{"delivered": true}', tool_call_id="c2", name="say", ok=True),
        Message(role="assistant", content="notice from the daemon", note=True),
        Message(role="assistant", tool_calls=[call(3, "fetch_url", {"url": "u"})]),
        Message(role="tool", content='{"error": "x"}', tool_call_id="c3", name="fetch_url", ok=False),
        Message(role="assistant", content="It says alpha."),
    ]
    state = LoopState.replay(transcript, _kind)
    assert state.user_texts == ["read it and tell me"]
    assert state.delivered == ["reading", "It says alpha."]  # the daemon's notice is not the model's
    assert (state.steps, state.work_calls, state.work_ok) == (3, 2, 1)
    assert [p.tool for p in state.previews] == ["read_file", "fetch_url"]


async def test_tool_results_recorded_out_of_order_come_back_in_call_order(tmp_path):
    async with Store(tmp_path / "db.sqlite") as store:
        record = await store.conversation(ChatRef(Platform.CONSOLE, "x"))
        session = Session(store, record.id, record.session, [], CompactionState(None, 0, 0, 0, 0.0), record.chat.key)
        user = Message(role="user", content="go")
        turn_id = await store.begin_turn(record.id, record.session, [], user, {})
        turn = Turn(store, record, session, turn_id, [], [user], TurnState())
        calls = [{"id": f"c{i}", "type": "function", "function": {"name": "t", "arguments": "{}"}} for i in range(3)]
        await turn.record(Message(role="assistant", tool_calls=calls))
        for i in (2, 0, 1):  # completion order
            await turn.record(Message(role="tool", content=str(i), tool_call_id=f"c{i}", ok=True))
        assert [m.content for m in turn.transcript[2:]] == ["0", "1", "2"]
        assert [m.content for m in await store.turn_messages(turn_id)][2:] == ["0", "1", "2"]


async def test_the_budget_persists_its_scale_only_when_it_moves(tmp_path):
    async with Store(tmp_path / "db.sqlite") as store:
        writes: list[str] = []

        async def save(key: str, value: str) -> None:
            writes.append(value)
            await store.set_kv(key, value)

        budget = ContextBudget(8000, 0.75, key="k", load=store.get_kv, save=save)
        await budget.load()
        await budget.observe(1000, 1000)  # ratio 1: nothing learned
        assert writes == [] and budget.window() == 8000
        for _ in range(30):
            await budget.observe(2000, 1000)
        assert budget.scale > 1.95 and 1 < len(writes) < 10  # written while it moved, then not
        again = ContextBudget(8000, 0.75, key="k", load=store.get_kv)
        await again.load()
        assert again.scale == pytest.approx(budget.scale, abs=0.05)
        assert again.threshold() == int(again.window() * 0.75) < 6000


# -- regressions, each with its failing input ----------------------------------------------------


async def test_restarts_while_waiting_out_an_outage_do_not_use_up_the_resumes(tmp_path, llm, tg):
    """Regression: every clean restart counted as a crash; the 4th gave the message up."""
    llm.default = lambda request: error(503, "down")
    config = write_config(tmp_path, llm, tg)
    for restart in range(5):
        async with running(config) as d:
            if restart == 0:
                tg.push_text("still there?", chat_id=80)
                await tg.wait_for("sendMessage", timeout=10)  # the one notice
            await d.engine.wait_until(lambda: d.engine.waiting == 1, timeout=10)
    judges_say_done(llm)
    llm.push(say("yes, back now"), when=is_loop)
    async with running(config) as d:
        await tg.wait_for("sendMessage", n=2, timeout=10)
        await d.engine.wait_for_turns(1)
    assert tg.sent(80)[1:] == ["yes, back now"] and "reachable" in tg.sent(80)[0]
    assert db(tmp_path).execute("SELECT status FROM journal").fetchall() == [("done",)]
    [(resumes,)] = db(tmp_path).execute("SELECT json_extract(state, '$.resumes') FROM turns").fetchall()
    assert resumes == 0


async def test_a_key_the_endpoint_echoes_never_reaches_the_database(tmp_path, llm, tg):
    """Regression: a classifier error quoting the API key was stored in turns.state."""
    from support import UNCLEAR, is_classifier

    key = "sk-test-key-not-real-000000"
    llm.push(error(401, f"Incorrect API key provided: {key}."), when=is_classifier)
    judges_say_done(llm)
    llm.push(say("answered anyway"), when=is_loop)
    config = write_config(tmp_path, llm, tg, cognition={"classifier": True})
    async with running(config) as d:
        tg.push_text(UNCLEAR, chat_id=81)  # only unclear input reaches the classifier
        await d.engine.wait_for_turns(1)
    dump = "\n".join(db(tmp_path).iterdump())
    assert "Incorrect API key" in dump and key not in dump


async def test_an_unreadable_knowledge_file_does_not_stop_the_entity(tmp_path, llm, tg):
    """Regression: knowledge.md that could not be read left every turn running, unanswered."""
    judges_say_done(llm)
    llm.push(say("still talking"), when=is_loop)
    (tmp_path / "data" / "knowledge.md").mkdir(parents=True)  # a directory where the file goes
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("hello", chat_id=82)
        await d.engine.wait_for_turns(1)
    assert tg.sent(82) == ["still talking"]
    assert db(tmp_path).execute("SELECT status FROM turns").fetchall() == [("done",)]


async def test_a_failed_write_under_a_turn_is_recovered_and_answered_once(tmp_path, llm, tg):
    """Regression: after a database error the actor ran new turns while the broken one stayed
    running; at the next start two turns ran in one conversation."""
    import aiosqlite

    from bumblebot.runtime import actor as actor_module

    judges_say_done(llm)
    llm.push(say("first answer"), when=is_loop)
    llm.push(say("second answer"), when=is_loop)
    actor_module.RECOVER_FIRST_S = 0.05
    config = write_config(tmp_path, llm, tg)
    async with running(config) as d:
        original = d.store.finish_turn
        failures = [aiosqlite.OperationalError("disk I/O error")]

        async def flaky_finish(*args: Any, **kwargs: Any) -> None:
            if failures:
                raise failures.pop()
            await original(*args, **kwargs)

        d.store.finish_turn = flaky_finish  # type: ignore[method-assign]
        tg.push_text("one", chat_id=83)
        await tg.wait_for("sendMessage", timeout=10)
        tg.push_text("two", chat_id=83)
        await d.engine.wait_for_turns(2, timeout=10)
    actor_module.RECOVER_FIRST_S = 5.0
    assert tg.sent(83) == ["first answer", "second answer"]
    assert db(tmp_path).execute("SELECT status FROM turns ORDER BY id").fetchall() == [("done",), ("done",)]
    assert db(tmp_path).execute("SELECT status FROM journal").fetchall() == [("done",), ("done",)]


async def test_chat_quits_at_once_while_a_turn_waits_out_an_outage(tmp_path, llm):
    """Regression: /quit hung while the turn in flight was waiting for the endpoint."""
    llm.default = lambda request: error(503, "down")
    config = write_config(tmp_path, llm, None)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bumblebot", "--config", str(config), "chat", env=env_for(tmp_path),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(b"hello\n")
    await proc.stdin.drain()
    while b"reachable" not in await asyncio.wait_for(proc.stdout.readline(), 20):
        pass  # the notice: the turn is waiting now
    started = time.monotonic()
    await asyncio.wait_for(proc.communicate(b"/quit\n"), 20)
    assert proc.returncode == 0 and time.monotonic() - started < 10
    assert db(tmp_path).execute("SELECT status FROM journal").fetchall() == [("pending",)]  # kept


async def test_the_outage_clock_restarts_when_the_endpoint_answered_in_between(tmp_path, llm, tg):
    """Regression: a 1 s blip late in a turn gave up at once because the clock of an earlier
    outage in the same turn was still running."""
    script = iter([
        error(503, "down"), error(503, "down"),  # retried after ~1 s and ~2 s: under the limit
        tool_calls(("say", {"text": "part one"})),
        error(503, "blip", delay=2.5),  # fails after the limit has passed since the first outage
        say("part two"),
    ])
    llm.default = lambda request: next(script) if is_loop(request) else text("DONE: fine")
    config = write_config(tmp_path, llm, tg, engine={"outage_limit_s": 4.0, "shutdown_grace_s": 5})
    async with running(config) as d:
        tg.push_text("write it in two parts please", chat_id=84)  # deliberate ("code"): not one reply
        await d.engine.wait_for_turns(1, timeout=30)
    notice, *rest = tg.sent(84)
    assert "reachable" in notice and rest == ["part one", "part two"]  # one notice, no give-up
    assert db(tmp_path).execute("SELECT status FROM journal").fetchall() == [("done",)]


async def test_queued_messages_share_the_outage_one_notice_and_one_wait(tmp_path, llm, tg):
    """Regression (queue mode): messages behind a suspended turn started their own clock and
    sent their own notice, so the user got two of each."""
    llm.default = lambda request: error(503, "down")
    config = write_config(
        tmp_path, llm, tg, cognition={"classifier": False, "mid_turn_messages": "queue"},
        engine={"outage_limit_s": 2.0, "shutdown_grace_s": 5},
    )
    async with running(config) as d:
        tg.push_text("first", chat_id=85)
        await tg.wait_for("sendMessage", timeout=10)  # the notice
        tg.push_text("second", chat_id=85)
        await d.engine.wait_for_turns(2, timeout=30)
    sent = tg.sent(85)
    assert len([t for t in sent if "reachable" in t]) == 1
    assert len([t for t in sent if "couldn't reach" in t]) == 2  # one honest answer per turn
    gave_up = [r for r in db(tmp_path).execute("SELECT json_extract(trace, '$.wall_s') FROM turns ORDER BY id")]
    assert len(gave_up) == 2


async def test_a_busy_chat_leaves_the_turn_steps_to_answer_what_it_took(tmp_path, llm, tg):
    """Regression: messages steered into the last step were marked done without an answer."""
    judges_say_done(llm)
    steps = [("read_file", {"path": f"f{i}"}) if i % 2 else ("list_directory", {"path": f"d{i}"}) for i in range(6)]
    held = [Gate(tool_calls(step)) for step in steps]  # six steps of fresh work
    for gate in held:
        llm.push(gate, when=is_loop)
    llm.push(say("the late one, answered"), when=is_loop)
    config = write_config(tmp_path, llm, tg, cognition={"classifier": False, "tool_continuation_rounds": 0})
    async with running(config) as d:
        tg.push_text("start", chat_id=86)
        for i, gate in enumerate(held):
            await asyncio.wait_for(gate.entered.wait(), 10)
            if i == 4:  # step 5 of 6 is running: one step would be left after it
                tg.push_text("late message", chat_id=86)
                await d.engine.wait_until(lambda: d.engine.progress.accepted == 2)
            gate.release.set()
        await d.engine.wait_for_turns(2, timeout=10)
    first_turn = loop_requests(llm)[:6]
    assert not any("late message" in contents(r) for r in first_turn)  # not taken into the cap
    assert "late message" in contents(loop_requests(llm)[6])
    assert tg.sent(86)[-1] == "the late one, answered"
    rows = db(tmp_path).execute("SELECT text, turn_id FROM journal ORDER BY id").fetchall()
    assert rows == [("start", 1), ("late message", 2)]


async def test_a_turn_cut_off_before_the_upgrade_resumes_with_what_it_had_said(tmp_path, llm, tg):
    """Regression: a schema-1 turn (no checkpoints) was re-run from scratch and repeated what
    it had delivered before the upgrade."""
    judges_say_done(llm)
    chat = ChatRef(Platform.TELEGRAM, "87")
    async with Store(tmp_path / "data" / "bumblebot.db") as store:
        journal_id = await store.journal(Inbound(chat, "1", "87", "Ann", "tell me two things", ChatKind.PRIVATE))
        conversation = await store.conversation(chat)
        async with store.transaction() as conn:  # what version 1 left behind: no state, no messages
            await conn.execute(
                "INSERT INTO turns (id, conversation_id, status, started_at) VALUES (7, ?, 'running', 0)",
                (conversation.id,),
            )
            await conn.execute("UPDATE journal SET turn_id=7 WHERE id=?", (journal_id,))
        entry = await store.outbox_add(conversation.id, 7, chat, "thing one")
        await store.outbox_progress(entry.id, status="sent", message_ids=["5"])

    def model(request: dict[str, Any]) -> Any:
        said = contents(request)
        return say("thing two") if "thing one" in said else say("thing one", end=False)

    llm.push(model, when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        await tg.wait_for("sendMessage", timeout=10)
        await d.engine.wait_for_turns(1)
    assert tg.sent(87) == ["thing two"]
    resumed = loop_requests(llm)[0]
    assert tool_result(resumed, "say") == [{"delivered": True, "queued": False}]  # "thing one", said
    assert [m["role"] for m in resumed["messages"][1:]] == ["user", "assistant", "tool", "user"]


async def test_trace_only_reads_an_older_database(tmp_path, llm):
    """Regression: `bumblebot trace` migrated a schema-1 database under a running daemon."""
    from bumblebot.store import MIGRATIONS

    data = tmp_path / "data"
    data.mkdir()
    conn = sqlite3.connect(data / "bumblebot.db")
    conn.executescript(f"BEGIN;\n{MIGRATIONS[0]}\nPRAGMA user_version=1;\nCOMMIT;")
    conn.execute("PRAGMA journal_mode=WAL")
    conn.close()
    config = write_config(tmp_path, llm, None)
    result = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bumblebot", "--config", str(config), "trace",
        env=env_for(tmp_path), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    _, err = await asyncio.wait_for(result.communicate(), 30)
    assert result.returncode == 0, err
    assert sqlite3.connect(data / "bumblebot.db").execute("PRAGMA user_version").fetchone() == (1,)


async def test_a_reflex_turn_redoing_a_step_a_crash_cut_off_reaches_its_second_part(tmp_path, llm, tg):
    """A brief request is reflex, and a reflex step that says something ends the
    turn. A crash had cut off a step after its work tool ran and before its say got out; the
    resumed step said that part again (and only that) and the turn ended there, so the second
    part never came (tests/test_crash_points.py, two_parts, about one run in two)."""
    judges_say_done(llm)
    chat = ChatRef(Platform.TELEGRAM, "88")
    async with Store(tmp_path / "data" / "bumblebot.db") as store:
        journal_id = await store.journal(Inbound(chat, "1", "88", "Ann", "tell me in two parts", ChatKind.PRIVATE))
        conversation = await store.conversation(chat)
        state = {"route": "reflex", "route_reason": "brief: 20 chars, no cue", "resumes": 0, "active": True}
        turn_id = await store.begin_turn(
            conversation.id, conversation.session, [journal_id], Message(role="user", content="tell me in two parts"), state
        )
        step = Message(role="assistant", content="", tool_calls=[
            {"id": "c1", "type": "function", "function": {"name": "say", "arguments": '{"text": "part one"}'}},
            {"id": "c2", "type": "function", "function": {"name": "list_directory", "arguments": '{"path": "."}'}},
        ])
        done = Message(role="tool", content="(empty)", tool_call_id="c2", name="list_directory", ok=True)
        await store.record(conversation.id, conversation.session, turn_id, [step, done], state=state)
        # the crash: list_directory's result is recorded, the say never reached the outbox

    def model(request: dict[str, Any]) -> Any:
        said = [r for r in tool_result(request, "say") if isinstance(r, dict) and r.get("delivered")]
        return say("part two") if said else tool_calls(("say", {"text": "part one"}))

    llm.default = lambda request: model(request) if is_loop(request) else text("DONE: fine")
    async with running(write_config(tmp_path, llm, tg)) as d:
        await tg.wait_for("sendMessage", n=2, timeout=10)
        await d.engine.wait_for_turns(1)
    assert tg.sent(88) == ["part one", "part two"]


async def test_a_say_that_got_out_before_a_crash_is_not_sent_again(tmp_path, llm, tg):
    """The crash came after the say was sent: the resumed turn reads that from its outbox
    row, tells the model it was delivered, and goes on from there."""
    judges_say_done(llm)
    chat = ChatRef(Platform.TELEGRAM, "89")
    async with Store(tmp_path / "data" / "bumblebot.db") as store:
        journal_id = await store.journal(Inbound(chat, "1", "89", "Ann", "hello there friend", ChatKind.PRIVATE))
        conversation = await store.conversation(chat)
        state = {"route": "reflex", "route_reason": "greeting", "resumes": 0, "active": True}
        turn_id = await store.begin_turn(
            conversation.id, conversation.session, [journal_id], Message(role="user", content="hello there friend"), state
        )
        step = Message(role="assistant", content="", tool_calls=[
            {"id": "c1", "type": "function", "function": {"name": "say", "arguments": '{"text": "Hello!"}'}}])
        await store.record(conversation.id, conversation.session, turn_id, [step], state=state)
        entry = await store.speak(conversation.id, conversation.session, turn_id, chat, "Hello!", tool_call_id="c1")
        await store.outbox_progress(entry.id, status="sent", message_ids=["5"])  # it got out; then the crash
    takes = iter(range(10))
    llm.default = lambda r: say(f"Hello again, take {next(takes)}!") if is_loop(r) else text("DONE: fine")
    async with running(write_config(tmp_path, llm, tg)) as d:
        await d.engine.wait_for_turns(1)
    assert tg.sent(89) == ["Hello again, take 0!"]  # "Hello!" was not sent a second time
    [request] = loop_requests(llm)
    assert tool_result(request, "say") == [{"delivered": True, "queued": False}]


async def test_a_resumed_step_that_fills_the_message_cap_is_told_and_bounded(tmp_path, llm, tg):
    """A resumed step said more than the cap allows: three messages get out, the model is told
    of the rest, and a model that goes on saying nothing new is stopped as looping."""
    judges_say_done(llm)
    chat = ChatRef(Platform.TELEGRAM, "90")
    async with Store(tmp_path / "data" / "bumblebot.db") as store:
        journal_id = await store.journal(Inbound(chat, "1", "90", "Ann", "list my files", ChatKind.PRIVATE))
        conversation = await store.conversation(chat)
        state = {"route": "reflex", "route_reason": "brief", "resumes": 0, "active": True}
        turn_id = await store.begin_turn(
            conversation.id, conversation.session, [journal_id], Message(role="user", content="list my files"), state
        )
        step = Message(role="assistant", content="", tool_calls=[
            {"id": "c1", "type": "function", "function": {"name": "list_directory", "arguments": '{"path": "."}'}}])
        await store.record(conversation.id, conversation.session, turn_id, [step], state=state)  # cut off here
    chatty = [("say", {"text": f"Here is file number {i}."}) for i in range(8)]
    llm.default = lambda r: tool_calls(*chatty) if is_loop(r) else text("DONE: fine")
    config = write_config(tmp_path, llm, tg, cognition={"classifier": False, "max_messages_per_turn": 3})
    async with running(config) as d:
        await d.engine.wait_for_turns(1)
        trace = (await d.store.recent_turns())[0]["trace"]
    assert tg.sent(90) == [f"Here is file number {i}." for i in range(3)]
    # the next step only says more past the cap: it is the last
    assert len(loop_requests(llm)) == 2 and trace["stop_reason"] == "looping"
    assert [r.get("dropped") for r in tool_result(loop_requests(llm)[1], "say")] == [None] * 3 + [True] * 5


def _user_text(message: dict[str, Any]) -> str:
    content = message.get("content") or ""
    return "\n".join(p.get("text", "") for p in content if p.get("type") == "text") if isinstance(content, list) else content


async def test_a_turn_retried_after_a_steered_message_keeps_the_turn_context_of_the_message_it_answers(
    tmp_path, llm, tg
):
    """Regression: a turn retried after an outage built its [Turn context] again from the last
    journal entry, a message steered in after it began: Ann's message went on with "Speaking:
    Bob". Its block is kept as it was sent (in the same minute, byte for byte)."""
    judges_say_done(llm)
    first = Gate(tool_calls(("say", {"text": "on it"})))
    llm.push(first, when=is_loop)
    llm.push(say("sunny, and nothing new"), when=is_loop)
    config = write_config(tmp_path, llm, tg, telegram={"respond_in_groups": "always"})
    group = dict(chat_id=-500, chat_type="group")
    async with running(config) as d:
        now = datetime(2026, 3, 1, 9, 0, 30, tzinfo=UTC)
        d.runner.contexts.clock = lambda: now  # the retry comes within the same minute
        tg.push_text("please look up the weather", user_id=7, first_name="Ann", **group)
        await asyncio.wait_for(first.entered.wait(), 10)
        tg.push_text("and the news too", user_id=8, first_name="Bob", **group)
        await d.engine.wait_until(lambda: d.engine.progress.accepted >= 2)
        llm.fail_completions(503, times=1)  # step 2, with Bob's message steered in, meets an outage
        first.release.set()
        await d.engine.wait_for_turns(1, timeout=30)
    failed = [r.body for r in llm.request_log if r.status == 503]
    assert len(failed) == 1 and "and the news too" in contents(failed[0])
    retried = loop_requests(llm)[-1]

    def ann(request: dict[str, Any]) -> str:
        return next(_user_text(m) for m in request["messages"] if "[Ann]: please" in _user_text(m))

    assert "Speaking: Ann (id 7)" in ann(retried) and "Bob" not in ann(retried)
    assert ann(retried) == ann(failed[0])  # the block as it was sent
    assert tg.sent(-500)[-1] == "sunny, and nothing new"


async def test_a_resumed_turn_keeps_its_turn_context_with_the_time_brought_up_to_date(tmp_path, llm, tg):
    """Regression: a turn resumed after a message was steered into it built its [Turn context]
    again from that message ("Speaking: Bob" with Ann's words). The block its message was sent
    with is kept, facts included; only its Time line is brought up to date."""
    chat = ChatRef(Platform.TELEGRAM, "-500")
    was = "Time: Sunday 2026-03-01 09:00 (UTC)"
    block = TurnContext(
        ("[Turn context]", was, "Platform: telegram, group chat (several people)", "Speaking: Ann (id 7)"),
        ("## Picnic\nThe picnic is on Saturday.",),
    )
    facts = Memory(tmp_path / "data").of(chat.key)
    facts.append_sections([("Picnic", "The picnic is on Saturday."), ("Weather", "Ann checks the forecast daily.")])
    async with Store(tmp_path / "data" / "bumblebot.db") as store:
        asked = await store.journal(Inbound(chat, "1", "7", "Ann", "please look up the weather", ChatKind.GROUP))
        conversation = await store.conversation(chat)
        state = {"route": "deliberate", "resumes": 0, "active": True, "speaker_entry": asked}
        user = Message(role="user", content="[Ann]: please look up the weather", context=block)
        turn_id = await store.begin_turn(conversation.id, conversation.session, [asked], user, state)
        step = Message(role="assistant", content="", tool_calls=[
            {"id": "c1", "type": "function", "function": {"name": "think", "arguments": '{"thought": "weather"}'}}])
        result = Message(role="tool", content="ok", tool_call_id="c1", name="think", ok=True)
        await store.record(conversation.id, conversation.session, turn_id, [step, result], state=state)
        steered = await store.journal(Inbound(chat, "2", "8", "Bob", "and the news too", ChatKind.GROUP))
        await store.record(conversation.id, conversation.session, turn_id,
                           [Message(role="user", content="[Bob]: and the news too")], journal_ids=[steered])
    llm.default = lambda r: say("sunny, and nothing new") if is_loop(r) else text("DONE: fine")
    config = write_config(tmp_path, llm, tg, telegram={"respond_in_groups": "always"})
    async with running(config) as d:
        await d.engine.wait_for_turns(1)
    sent = _user_text(loop_requests(llm)[0]["messages"][1])
    time = next(line for line in sent.splitlines() if line.startswith("Time: "))
    assert "Speaking: Ann (id 7)" in sent and time != was  # as of the resume
    assert sent == block.text().replace(was, time) + "\n[Ann]: please look up the weather"
