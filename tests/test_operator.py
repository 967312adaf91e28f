"""The operator's actions on the engine (``bumblebot/runtime/commands.py``), end to end on the
fakes with real SQLite: pause and resume (or set aside), a task that falls due while paused,
pauses across a restart, blocked senders, ``operate(..., "stop")``, titles, and the journal
row each action leaves."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path

from conftest import running, write_config
from fakes.openai_server import is_loop
from support import Gate, handled, is_loop_with, judges_say_done, loop_requests, say, user_text

from bumblebot.core.events import ChatRef, Platform

GROUP = -800


def rows(tmp_path: Path, sql: str, *params: object) -> list[tuple]:
    db = sqlite3.connect(tmp_path / "data" / "bumblebot.db")
    try:
        return db.execute(sql, params).fetchall()
    finally:
        db.close()


def operator_rows(tmp_path: Path) -> list[tuple[str, str, str]]:
    """``(chat id, text, status)`` of every journal row of the operator, oldest first."""
    return rows(tmp_path, "SELECT chat_id, text, status FROM journal WHERE sender_id='operator' AND source='console'"
                " ORDER BY id")


def chat(chat_id: int) -> ChatRef:
    return ChatRef(Platform.TELEGRAM, str(chat_id))


async def another_chat_answered(d, llm, tg, n: int) -> None:
    """A message in another chat is answered from start to end: the engine had every chance
    to take what waits elsewhere meanwhile."""
    llm.push(say(f"other answer {n}"), when=is_loop_with(f"other question {n}"))
    tg.push_text(f"other question {n}", chat_id=990)
    await tg.wait_for("sendMessage", predicate=lambda p: p.get("text") == f"other answer {n}")


async def test_a_paused_chat_keeps_a_message_waiting_unanswered_until_resumed_then_answers_it_once(tmp_path, llm, tg):
    judges_say_done(llm)
    async with running(write_config(tmp_path, llm, tg)) as d:
        engine = d.engine
        assert (await engine.operate(chat(601), "pause")).startswith("Paused")
        assert engine.paused("telegram:601") and await engine.operate(chat(601), "pause") == "Already paused."
        tg.push_text("are you there?", chat_id=601)
        tg.push_text("hello??", chat_id=601)
        await engine.wait_until(lambda: engine.queue_depth == 2)
        await another_chat_answered(d, llm, tg, 1)
        assert not [r for r in loop_requests(llm) if "are you there?" in user_text(r)]  # the model never saw it
        assert engine.queue_depth == 2 and tg.sent(601) == []
        llm.push(say("Yes, here now."), when=is_loop_with("are you there?"))
        assert await engine.operate(chat(601), "resume") == "Resumed; 2 messages waiting will be answered."
        await tg.wait_for("sendMessage", predicate=lambda p: p.get("text") == "Yes, here now.")
        await engine.wait_for_turns(2)
        assert await engine.operate(chat(601), "resume") == "Not paused."
        kinds = [e.kind for e in d.activity.recent("telegram:601")]
    assert tg.sent(601) == ["Yes, here now."]
    asked = [r for r in loop_requests(llm) if "are you there?" in user_text(r)]
    assert len(asked) == 1 and "hello??" in user_text(asked[0])  # one turn for both, as after a burst
    assert rows(tmp_path, "SELECT text, status FROM journal WHERE chat_id='601' AND source='chat'") == [
        ("are you there?", "done"), ("hello??", "done")]
    assert operator_rows(tmp_path) == [("601", "/pause", "ignored"), ("601", "/pause", "ignored"),
                                       ("601", "/resume", "ignored"), ("601", "/resume", "ignored")]
    assert kinds.index("paused") < kinds.index("resumed") < kinds.index("turn_started")


async def test_resume_with_set_aside_never_answers_what_waited(tmp_path, llm, tg):
    judges_say_done(llm)
    async with running(write_config(tmp_path, llm, tg)) as d:
        engine = d.engine
        await engine.operate(chat(602), "pause")
        tg.push_text("spam spam spam", chat_id=602)
        await engine.wait_until(lambda: engine.queue_depth == 1)
        text = await engine.operate(chat(602), "resume_set_aside")
        assert text == "Resumed; 1 message set aside, never to be answered."
        llm.push(say("Fresh answer."), when=is_loop_with("a new question"))
        tg.push_text("a new question", chat_id=602)
        await tg.wait_for("sendMessage", predicate=lambda p: p.get("text") == "Fresh answer.")
        await engine.wait_for_turns(1)
    assert tg.sent(602) == ["Fresh answer."]
    assert not [r for r in loop_requests(llm) if "spam spam spam" in str(r["messages"])]
    assert rows(tmp_path, "SELECT text, status FROM journal WHERE chat_id='602' AND source='chat'") == [
        ("spam spam spam", "ignored"), ("a new question", "done")]
    assert [t for _, t, _ in operator_rows(tmp_path)] == ["/pause", "/resume_set_aside"]


async def test_a_task_due_while_paused_fires_once_only_after_resume(tmp_path, llm, tg):
    judges_say_done(llm)
    async with running(write_config(tmp_path, llm, tg)) as d:
        engine, key = d.engine, "telegram:603"
        await engine.operate(chat(603), "pause")
        task = await d.scheduler.create(key, "every 1 minute", "Say tick.")
        await d.store.write("UPDATE tasks SET next_due = ? WHERE id = ?", (time.time() - 1, task.id))  # due now
        d.scheduler.changed.set()
        assert await engine.run_automations() == 0  # paused: nothing fires
        await another_chat_answered(d, llm, tg, 1)  # the automation loop had its chances too
        assert rows(tmp_path, "SELECT COUNT(*) FROM journal WHERE message_id LIKE 'task:%'") == [(0,)]
        llm.push(say("tick"), when=lambda r: is_loop(r) and "Say tick." in str(r["messages"]))
        await engine.operate(chat(603), "resume")
        await tg.wait_for("sendMessage", predicate=lambda p: p.get("text") == "tick")
        await engine.wait_for_turns(2)
        [after] = await d.store.tasks()
    assert tg.sent(603) == ["tick"]
    assert rows(tmp_path, "SELECT status FROM journal WHERE message_id LIKE 'task:%'") == [("done",)]
    assert after.runs == 1 and after.next_due is not None and after.next_due > time.time()  # once, then on schedule


async def test_a_pause_survives_a_restart(tmp_path, llm, tg):
    judges_say_done(llm)
    config = write_config(tmp_path, llm, tg)
    async with running(config) as d:
        await d.engine.operate(chat(604), "pause")
    async with running(config) as d:
        engine = d.engine
        assert engine.paused("telegram:604")
        tg.push_text("still paused?", chat_id=604)
        await engine.wait_until(lambda: engine.queue_depth == 1)
        await another_chat_answered(d, llm, tg, 1)
        assert tg.sent(604) == [] and engine.queue_depth == 1
    async with running(config) as d:  # the waiting message is kept across the restart too
        engine = d.engine
        await engine.wait_until(lambda: engine.queue_depth == 1)
        llm.push(say("Back."), when=is_loop_with("still paused?"))
        await engine.operate(chat(604), "resume")
        await tg.wait_for("sendMessage", predicate=lambda p: p.get("text") == "Back.")
        assert not engine.paused("telegram:604")
    assert tg.sent(604) == ["Back."]
    assert rows(tmp_path, "SELECT paused_at FROM conversations WHERE chat_id='604'") == [(None,)]


async def test_a_blocked_sender_is_never_answered_anywhere_until_unblocked(tmp_path, llm, tg):
    judges_say_done(llm)
    async with running(write_config(tmp_path, llm, tg)) as d:
        engine = d.engine
        assert await engine.block(Platform.TELEGRAM, "700") == "Blocked telegram user 700."
        assert await engine.block(Platform.TELEGRAM, "700") == "Already blocked."
        for update in (
            tg.push_text("hi bot", chat_id=700),
            tg.push_text("@fake_bot hi all", chat_id=GROUP, user_id=700, chat_type="group", first_name="Mallory"),
            tg.push_text("/reset", chat_id=700),
        ):
            await handled(tg, update)
        await another_chat_answered(d, llm, tg, 1)
        assert rows(tmp_path, "SELECT COUNT(*) FROM outbox WHERE chat_id IN ('700', ?)", str(GROUP)) == [(0,)]
        assert rows(tmp_path, "SELECT session FROM conversations WHERE chat_id='700'") in ([], [(1,)])  # no /reset ran
        assert await engine.unblock(Platform.TELEGRAM, "700") == "Unblocked telegram user 700."
        assert await engine.unblock(Platform.TELEGRAM, "700") == "Not blocked."
        llm.push(say("Hello again."), when=is_loop_with("am I back?"))
        tg.push_text("am I back?", chat_id=700)
        await tg.wait_for("sendMessage", predicate=lambda p: p.get("text") == "Hello again.")
        kinds = [e.kind for e in d.activity.recent("telegram:operator")]
    assert tg.sent(700) == ["Hello again."] and tg.sent(GROUP) == []
    assert not [r for r in loop_requests(llm) if "hi bot" in str(r["messages"]) or "hi all" in str(r["messages"])]
    assert rows(tmp_path, "SELECT text, status FROM journal WHERE sender_id='700' ORDER BY id") == [
        ("hi bot", "ignored"), ("@fake_bot hi all", "ignored"), ("/reset", "ignored"), ("am I back?", "done")]
    assert operator_rows(tmp_path) == [("operator", f"/{a} 700", "ignored") for a in ("block", "block", "unblock", "unblock")]
    assert kinds == ["blocked", "blocked", "unblocked", "unblocked"]


async def test_operate_stops_a_running_turn_and_every_action_is_journaled(tmp_path, llm, tg):
    judges_say_done(llm)
    hold = Gate(say("never said"))
    llm.push(hold, when=is_loop_with("work on this"))
    async with running(write_config(tmp_path, llm, tg)) as d:
        engine = d.engine
        tg.push_text("work on this", chat_id=605)
        await asyncio.wait_for(hold.entered.wait(), 10)
        assert await engine.operate(chat(605), "stop") == "Stopped."
        await engine.wait_for_turns(1)
        hold.release.set()
        assert await engine.operate(chat(605), "stop") == "Nothing to stop: I'm not working on anything here."
        task = await d.scheduler.create("telegram:605", "in 1 hour", "Water the plants.")
        assert await engine.operate(chat(605), "cancel_task", argument=str(task.id)) == f"Cancelled task #{task.id}."
        assert (await engine.operate(chat(605), "cancel_task", argument="99")).startswith("Not cancelled")
        assert (await engine.operate(chat(605), "reset")).startswith("Fresh start")
        assert (await engine.operate(chat(605), "compact")).startswith("Compacting")
        await engine.wait_until(lambda: any(e.data.get("what") == "compacted" for e in d.activity.recent("telegram:605")))
        assert await engine.operate(chat(605), "explode") == "Unknown action 'explode'."
        [turn] = await d.store.recent_turns(limit=1)
    assert turn["trace"]["stop_reason"] == "stopped"
    assert tg.sent(605) == []  # nothing of the operator's reaches the chat
    assert [t for _, t, _ in operator_rows(tmp_path)] == [
        "/stop", "/stop", f"/cancel_task {task.id}", "/cancel_task 99", "/reset", "/compact"]
    assert {s for _, _, s in operator_rows(tmp_path)} == {"ignored"}


async def test_titles_come_from_the_platform_and_are_written_once_per_change(tmp_path, llm, tg):
    judges_say_done(llm)
    async with running(write_config(tmp_path, llm, tg)) as d:
        writes: list[tuple[str, str]] = []
        set_title = d.store.set_title

        async def spy(key: str, title: str) -> None:
            writes.append((key, title))
            await set_title(key, title)

        d.store.set_title = spy  # type: ignore[method-assign]
        for n in range(2):
            llm.push(say(f"answer {n}"), when=is_loop_with(f"question {n}"))
            tg.push_text(f"question {n}", chat_id=606, first_name="Alice")
            await tg.wait_for("sendMessage", predicate=lambda p, n=n: p.get("text") == f"answer {n}")
        llm.push(say("group answer"), when=is_loop_with("group question"))
        tg.push_text("@fake_bot group question", chat_id=GROUP, user_id=7, chat_type="group")
        await tg.wait_for("sendMessage", predicate=lambda p: p.get("text") == "group answer")
    assert writes == [("telegram:606", "Alice"), (f"telegram:{GROUP}", "Test Group")]
    assert rows(tmp_path, "SELECT chat_id, title FROM conversations ORDER BY id") == [
        ("606", "Alice"), (str(GROUP), "Test Group")]
