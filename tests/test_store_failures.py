"""A single failed write under a turn, and outages seen by several turns (the store, the actor's
recovery).

A transient database error ("database is locked" past the busy timeout, a full disk) at any
write of a turn must leave the conversation as if the write had been slow: the actor reads the
conversation back and resumes the turn, every message is answered once, and nothing stays
pending. The daemon runs in this event loop against the fakes, on real SQLite files.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiosqlite
import pytest
from conftest import running, write_config
from fakes.openai_server import error, is_loop, sequence_violation, text, tool_calls
from support import Gate, db, judges_say_done, say

from bumblebot.core.events import ChatKind, ChatRef, Inbound, Platform
from bumblebot.core.messages import Message
from bumblebot.runtime import actor as actor_module
from bumblebot.runtime.outage import OUTAGE_NOTICE, OutageWatch
from bumblebot.store import Store


@pytest.fixture(autouse=True)
def fast_recovery(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(actor_module, "RECOVER_FIRST_S", 0.05)


def fail_once(store: Store, name: str, when: Callable[..., bool] = lambda *a, **k: True) -> list[int]:
    """Make ``store.<name>`` raise "database is locked" the first time ``when`` holds; returns a
    list that gets one item when it did."""
    original = getattr(store, name)
    failed: list[int] = []

    async def flaky(*args: Any, **kwargs: Any) -> Any:
        if not failed and when(*args, **kwargs):
            failed.append(1)
            raise aiosqlite.OperationalError("database is locked")
        return await original(*args, **kwargs)

    setattr(store, name, flaky)
    return failed


def stored_history(tmp_path: Path) -> list[dict[str, Any]]:
    rows = db(tmp_path).execute("SELECT role, content, tool_calls, tool_call_id FROM messages ORDER BY id").fetchall()
    return [
        {"role": role, "content": content, **({"tool_calls": json.loads(calls)} if calls else {}),
         **({"tool_call_id": call_id} if call_id else {})}
        for role, content, calls, call_id in rows
    ]


async def test_a_failed_assistant_checkpoint_is_resumed_and_answered_once(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(say("the answer"), when=is_loop)
    llm.push(say("the answer"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        failed = fail_once(d.store, "record", lambda *a, **k: any(m.role == "assistant" for m in a[3]))
        tg.push_text("question", chat_id=61)
        await d.engine.wait_for_turns(1, timeout=15)
    assert failed and tg.sent(61) == ["the answer"]
    assert db(tmp_path).execute("SELECT status FROM journal").fetchall() == [("done",)]
    assert sequence_violation(stored_history(tmp_path)) is None


async def test_a_failed_begin_turn_does_not_lose_the_message(tmp_path, llm, tg):
    """Regression: the entries had left the inbox when the write failed; they stayed pending
    until the next restart."""
    judges_say_done(llm)
    llm.push(say("the answer"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        failed = fail_once(d.store, "begin_turn")
        tg.push_text("question", chat_id=62)
        await tg.wait_for("sendMessage", timeout=15)
        await d.engine.wait_for_turns(1, timeout=15)
    assert failed and tg.sent(62) == ["the answer"]
    assert db(tmp_path).execute("SELECT status FROM journal").fetchall() == [("done",)]


async def test_a_failed_steering_write_does_not_lose_the_steered_message(tmp_path, llm, tg):
    """Regression: the steered message had left the inbox when the write failed."""
    judges_say_done(llm)
    hang = Gate(tool_calls(("say", {"text": "answer one"})))
    llm.push(hang, when=is_loop)

    def model(request: dict[str, Any]) -> Any:
        if not is_loop(request):
            return text("DONE: fine")
        if "two" in json.dumps(request["messages"][-3:]) and "answer two" not in json.dumps(request["messages"]):
            return say("answer two")
        return tool_calls(("end_turn", {}))

    llm.default = model
    async with running(write_config(tmp_path, llm, tg)) as d:
        failed = fail_once(d.store, "record", lambda *a, **k: bool(k.get("journal_ids")))
        tg.push_text("Explain in detail, step by step, part one of the plan in the readme.", chat_id=63)  # deliberate ("file")
        await asyncio.wait_for(hang.entered.wait(), 10)
        tg.push_text("two", chat_id=63)
        await d.engine.wait_until(lambda: d.engine.progress.accepted >= 2)
        hang.release.set()
        await tg.wait_for("sendMessage", n=2, timeout=15)
        await d.engine.wait_until(lambda: d.engine.idle, timeout=15)
    assert failed and tg.sent(63).count("answer two") == 1 and tg.sent(63).count("answer one") == 1
    assert db(tmp_path).execute("SELECT status FROM journal").fetchall() == [("done",), ("done",)]


async def test_a_failed_tool_result_write_cancels_the_sibling_calls(tmp_path, llm, tg):
    """Regression: ``asyncio.gather`` left the sibling call running after one result failed to
    record; it then recorded a second result for a call already closed as interrupted."""
    judges_say_done(llm)
    llm.push(tool_calls(
        ("think", {"thought": "plan"}), ("run_command", {"command": "sleep 2; echo done >> effect.txt"}),
    ), when=is_loop)

    def model(request: dict[str, Any]) -> Any:
        if not is_loop(request):
            return text("DONE: fine")
        if any(m.get("role") == "tool" and "delivered" in (m.get("content") or "") for m in request["messages"][-3:]):
            return tool_calls(("end_turn", {}))
        return tool_calls(("say", {"text": "ok"}), ("end_turn", {}))

    llm.default = model
    config = write_config(tmp_path, llm, tg, tools={"shell": {"enabled": True}})
    async with running(config) as d:
        failed = fail_once(d.store, "record", lambda *a, **k: any(m.role == "tool" and m.name == "think" for m in a[3]))
        tg.push_text("go", chat_id=64)
        await d.engine.wait_for_turns(1, timeout=20)
        tg.push_text("again", chat_id=64)
        await d.engine.wait_for_turns(2, timeout=20)
    history = stored_history(tmp_path)
    results = [m["tool_call_id"] for m in history if m["role"] == "tool"]
    assert failed and len(results) == len(set(results))
    assert sequence_violation(history) is None and llm.violations == []


async def test_a_turn_given_up_after_too_many_resumes_closes_its_open_tool_calls(tmp_path, llm, tg):
    """Regression: the resume cap ended the turn with a tool call and no result in history, so
    every later request of the session had to be repaired."""
    chat = ChatRef(Platform.TELEGRAM, "66")
    async with Store(tmp_path / "data" / "bumblebot.db") as store:
        journal_id = await store.journal(Inbound(chat, "1", "66", "Ann", "crash me", ChatKind.PRIVATE))
        conversation = await store.conversation(chat)
        turn_id = await store.begin_turn(
            conversation.id, conversation.session, [journal_id], Message(role="user", content="crash me"),
            {"route": "deliberate", "resumes": 3, "stalled_resumes": 3, "active": True},
        )
        call = {"id": "call_cut", "type": "function",
                "function": {"name": "run_command", "arguments": '{"command": "sleep 60"}'}}
        await store.record(conversation.id, conversation.session, turn_id, [
            Message(role="assistant", content="", tool_calls=[call]),
        ])
    judges_say_done(llm)
    llm.push(say("second answer"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        await tg.wait_for("sendMessage", timeout=10)
        await d.engine.wait_for_turns(1)
        tg.push_text("second question", chat_id=66)
        await d.engine.wait_for_turns(2)
    assert "interrupted several times" in tg.sent(66)[0] and tg.sent(66)[1:] == ["second answer"]
    assert sequence_violation(stored_history(tmp_path)) is None and llm.violations == []


async def test_a_restart_during_an_outage_in_queue_mode_sends_one_notice(tmp_path, llm, tg):
    """Regression: after a restart the resumed turn (already told) did not mark the conversation
    told, so the queued message's turn sent a second notice."""
    llm.default = lambda request: error(503, "down")
    config = write_config(
        tmp_path, llm, tg, cognition={"classifier": False, "mid_turn_messages": "queue"},
        engine={"outage_limit_s": 3.0, "shutdown_grace_s": 5},
    )
    async with running(config) as d:
        tg.push_text("first", chat_id=67)
        await tg.wait_for("sendMessage", timeout=10)  # the notice
        tg.push_text("second", chat_id=67)
        await d.engine.wait_until(lambda: d.engine.progress.accepted >= 2)
    async with running(config) as d:
        await d.engine.wait_for_turns(2, timeout=30)
    sent = tg.sent(67)
    assert sent.count(OUTAGE_NOTICE) == 1
    assert len([t for t in sent if "couldn't reach" in t]) == 2


async def test_waiting_turns_retry_as_soon_as_the_endpoint_answers_another(tmp_path, llm, tg):
    """A turn told by the server to wait a minute (503 with Retry-After: 60) retries as soon as
    another turn gets an answer, instead of sleeping out the minute."""
    up = asyncio.Event()

    def model(request: dict[str, Any]) -> Any:
        if not up.is_set():
            return error(503, "overloaded", headers={"Retry-After": "60"})
        if not is_loop(request):
            return text("DONE: fine")
        said = any(m.get("role") == "tool" and "delivered" in (m.get("content") or "") for m in request["messages"][-3:])
        return tool_calls(("end_turn", {})) if said else tool_calls(("say", {"text": "back"}), ("end_turn", {}))

    llm.default = model
    config = write_config(tmp_path, llm, tg, llm={
        "base_url": llm.base_url, "model": "test-model", "reflex_model": "reflex-model", "max_retries": 0,
    })
    async with running(config) as d:
        tg.push_text("first", chat_id=68)
        await tg.wait_for("sendMessage", timeout=10)  # the notice
        await d.engine.wait_until(lambda: d.engine.waiting)  # it waits a minute now
        up.set()
        tg.push_text("hello", chat_id=69)
        await d.engine.wait_for_turns(2, timeout=15)  # well before the minute is out
    assert tg.sent(68) == [OUTAGE_NOTICE, "back"] and tg.sent(69) == ["back"]


def test_the_outage_clock_starts_at_the_earliest_failure_any_turn_recorded():
    """A turn resumed after a restart brings the start of its wait with it; a later turn in the
    same outage counts from there, and the endpoint answering ends the outage for every waiter."""
    watch = OutageWatch()
    assert watch.failed(100.0) == 100.0
    assert watch.failed(130.0, since=40.0) == 40.0  # a resumed turn has waited since 40
    assert watch.failed(150.0) == 40.0
    recovered = watch.recovered
    watch.back()
    assert recovered.is_set() and watch.down_since is None and watch.told == set()
    assert watch.failed(200.0) == 200.0 and not watch.recovered.is_set()  # a new outage, a new event


async def test_a_transaction_left_open_by_a_cancelled_write_does_not_block_every_later_write(tmp_path, store_location):
    """A write cancelled while its BEGIN runs is rolled back: it once left the connection inside a
    transaction (the statement ran in aiosqlite's thread, the ROLLBACK never did), and every later
    write failed with "cannot start a transaction within a transaction"."""
    from bumblebot.store import Store

    async with Store(store_location) as store:
        await store.db.execute("BEGIN IMMEDIATE")  # what the cancelled write left behind
        await store.set_kv("k", "v")  # one statement, autocommitted
        assert await store.get_kv("k") == "v"
        assert not store.db.in_transaction
        await store.db.execute("BEGIN IMMEDIATE")
        await store.delete_kv("k")
        async with store.transaction() as db:  # several statements, one transaction
            await db.execute("INSERT INTO kv (key, value) VALUES ('a', '1')")
        assert await store.get_kv("a") == "1" and await store.get_kv("k") is None
        assert not store.db.in_transaction


async def test_a_lone_write_is_committed_at_once_and_seen_by_another_connection(tmp_path, store_location):
    """A single statement is written in autocommit mode (no BEGIN … COMMIT): it must still be
    durable when it returns, visible to a second connection such as ``bumblebot trace``."""
    from bumblebot.store import Store

    async with Store(store_location) as store:
        await store.set_kv("k", "v")
        async with Store(store_location, readonly=True) as reader:
            assert await reader.get_kv("k") == "v"


#: A read that keeps aiosqlite's thread busy for a while (two million rows counted).
SLOW_READ = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c LIMIT 2000000) SELECT count(*) FROM c"


async def _cancel_a_transaction_while_its_begin_waits(store):
    """A write whose ``BEGIN`` waits in aiosqlite's queue behind a read, cancelled there (the
    lock is free at once; the ``BEGIN`` still runs after the read)."""
    import asyncio

    busy = asyncio.ensure_future(store.db.execute_fetchall(SLOW_READ))
    await asyncio.sleep(0)  # the read is queued first

    async def write():
        async with store.transaction() as db:
            await db.execute("INSERT INTO kv (key, value) VALUES ('cancelled', '1')")

    task = asyncio.ensure_future(write())
    for _ in range(3):  # a few turns of the loop: it takes the lock and queues its BEGIN
        await asyncio.sleep(0)
    task.cancel()
    return busy, task


async def test_a_write_after_a_write_cancelled_in_aiosqlites_queue_is_committed(tmp_path):
    """The cancelled write's ``BEGIN`` ran after its task was gone and left a transaction open:
    the next lone write ran inside it and returned as if done, unseen by any other connection and
    rolled back by the write after it (a delivery recorded as sent, lost)."""
    import asyncio
    import contextlib

    from bumblebot.store import Store

    async with Store(tmp_path / "b.db") as store:
        busy, task = await _cancel_a_transaction_while_its_begin_waits(store)
        await store.set_kv("sent", "yes")
        await busy
        with contextlib.suppress(asyncio.CancelledError):
            await task
        async with Store(tmp_path / "b.db", readonly=True) as reader:
            assert await reader.get_kv("sent") == "yes"
        await store.set_kv("other", "x")
        assert await store.get_kv("sent") == "yes" and await store.get_kv("cancelled") is None
        async with store.transaction() as db:  # and a transaction after it works too
            await db.execute("INSERT INTO kv (key, value) VALUES ('a', '1')")
        assert await store.get_kv("a") == "1" and not store.db.in_transaction


async def test_a_send_whose_recording_failed_is_not_sent_again(tmp_path, llm, tg):
    """The database failed just after the reply went out, when its row was to say so: the turn
    was resumed and its reply sent a second time."""
    judges_say_done(llm)
    llm.push(say("only once"), when=is_loop)
    llm.push(say("only once"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        failed = fail_once(d.store, "outbox_progress", lambda *a, **k: k.get("status") == "sent")
        tg.push_text("question", chat_id=62)
        await d.engine.wait_for_turns(1, timeout=15)
        async with asyncio.timeout(10):  # recorded again shortly after (delivery.RECORD_RETRY_S)
            while db(tmp_path).execute("SELECT status FROM outbox").fetchall() != [("sent",)]:
                await asyncio.sleep(0.05)
    assert failed and tg.sent(62) == ["only once"]


async def test_the_automations_go_on_after_the_database_failed_between_two_runs(tmp_path, llm, tg, monkeypatch):
    """The wait for the next due task read the database outside the loop's guard: one failure
    there ended the automations for good, and no task fired again."""
    from bumblebot.runtime import engine as engine_module

    monkeypatch.setattr(engine_module, "AUTOMATIONS_RETRY_S", 0.05)
    judges_say_done(llm)
    llm.push(say("stretch!"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        failed = fail_once(d.store, "next_task_due")
        await d.store.journal(Inbound(ChatRef(Platform.TELEGRAM, "63"), "1", "63", "Ann", "hi", ChatKind.PRIVATE),
                              status="done")
        await d.engine._scheduler.create("telegram:63", "in 1 seconds", "Remind them to stretch.")
        await tg.wait_for("sendMessage", predicate=lambda p: p.get("chat_id") == 63, timeout=15)
    assert failed and tg.sent(63) == ["stretch!"]
