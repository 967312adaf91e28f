"""Scheduled tasks and autonomous cycles, end to end: the real daemon, the real
python-telegram-bot and openai clients against the fakes, real SQLite, the real clock with
short delays (the delays are the stimulus: a task fires when its time comes)."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from pathlib import Path

from conftest import running, write_config
from fakes.openai_server import is_loop, tool_calls
from support import (
    contents,
    is_classifier,
    judges_say_done,
    kill_daemon,
    loop_requests,
    say,
    start_daemon,
    stop_daemon,
    tool_results,
)


def scheduled(needle: str = "[Scheduled task #"):
    """A loop request of a scheduled task's turn (its own input, not the history, has it)."""
    def predicate(r: dict) -> bool:
        inputs = [m for m in r["messages"] if m["role"] == "user" and "[Turn context]" in str(m["content"])]
        return is_loop(r) and bool(inputs) and needle in str(inputs[-1]["content"])
    return predicate


async def until(condition, timeout: float = 10.0) -> None:
    """Poll the database until ``condition()`` holds (a subprocess daemon has no events to wait on)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.05)


def journal(tmp_path: Path, like: str) -> list[tuple[str, str]]:
    db = sqlite3.connect(tmp_path / "data" / "bumblebot.db")
    try:
        return db.execute("SELECT message_id, status FROM journal WHERE message_id LIKE ? ORDER BY id", (like,)).fetchall()
    finally:
        db.close()


async def test_a_reminder_in_3_seconds_fires_once_as_a_deliberate_turn_with_no_classifier_call(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(tool_calls(("schedule_task", {"when": "in 3 seconds", "task": "Remind the user to stretch."})),
             when=lambda r: is_loop(r) and not scheduled()(r))
    llm.push(say("Reminder set for 3 seconds from now."), when=lambda r: is_loop(r) and not scheduled()(r))
    llm.push(say("Time to stretch!"), when=scheduled())
    config = write_config(tmp_path, llm, tg, cognition={"classifier": True})
    async with running(config) as d:
        tg.push_text("remind me in 3 seconds to stretch, please", chat_id=80)
        await tg.wait_for("sendMessage", predicate=lambda p: p.get("text", "").startswith("Reminder set"))
        await tg.wait_for("sendMessage", predicate=lambda p: p.get("text") == "Time to stretch!", timeout=10)
        fired = time.time()
        await d.engine.wait_for_turns(2)
        traces = await d.store.recent_turns(limit=2)
        [task] = await d.store.tasks(active=False)
    assert tg.sent(80) == ["Reminder set for 3 seconds from now.", "Time to stretch!"]  # exactly once
    schedule_result = json.loads(tool_results(loop_requests(llm)[1])[0])
    assert schedule_result["task_id"] == 1 and schedule_result["schedule"] == "once"
    automation = traces[0]["trace"]
    assert automation["route"] == "deliberate" and automation["route_reason"].startswith("forced")
    assert not [r for r in llm.requests if is_classifier(r) and "stretch" in contents(r) and "Scheduled" in contents(r)]
    request = [r for r in loop_requests(llm) if scheduled()(r)][0]
    assert "Remind the user to stretch." in contents(request)
    assert (task.status, task.runs, task.next_due) == ("done", 1, None)
    assert task.last_due is not None and fired >= task.last_due  # never before its due time
    assert journal(tmp_path, "task:%") == [(f"task:1:{task.last_due:.0f}", "done")]


async def test_a_recurring_task_fires_twice_and_cancel_task_stops_it(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(tool_calls(("schedule_task", {"when": "every 2 seconds", "task": "Say tick."})),
             when=lambda r: is_loop(r) and not scheduled()(r))
    llm.push(say("Ticking every 2 seconds."), when=lambda r: is_loop(r) and not scheduled()(r))
    llm.push(say("tick 1"), when=scheduled())
    llm.push(tool_calls(("cancel_task", {"task_id": 1}), ("say", {"text": "tick 2, and that's the last"})), when=scheduled())
    llm.push(tool_calls(("end_turn", {})), when=scheduled())
    config = write_config(tmp_path, llm, tg, automation={"min_interval_s": 1})
    async with running(config) as d:
        tg.push_text("say tick every 2 seconds", chat_id=81)
        await tg.wait_for("sendMessage", n=3, timeout=15)
        await d.engine.wait_for_turns(3)
        [task] = await d.store.tasks(active=False)
        await asyncio.sleep(3)  # another period: a cancelled task must not fire again
        await d.engine.run_automations()
    assert tg.sent(81) == ["Ticking every 2 seconds.", "tick 1", "tick 2, and that's the last"]
    assert (task.status, task.runs) == ("cancelled", 2)
    assert [status for _, status in journal(tmp_path, "task:%")] == ["done", "done"]
    second = [r for r in loop_requests(llm) if scheduled()(r)][1]
    assert "every 2 seconds" in contents(second)


async def test_tasks_lists_and_cancels_on_telegram(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(tool_calls(("schedule_task", {"when": "in 2 hours", "task": "Water the plants."}),
                        ("schedule_task", {"when": "0 9 * * 1-5", "task": "Morning summary."})), when=is_loop)
    llm.push(say("Both scheduled."), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("remind me to water the plants in 2 hours and give me a summary at 9 on weekdays", chat_id=82)
        await tg.wait_for("sendMessage")
        await d.engine.wait_for_turns(1)
        tg.push_text("/tasks", chat_id=82)
        await tg.wait_for("sendMessage", n=2)
        tg.push_text("/tasks cancel 1", chat_id=82)
        await tg.wait_for("sendMessage", n=3)
        tg.push_text("/tasks cancel 1", chat_id=82)
        await tg.wait_for("sendMessage", n=4)
        tg.push_text("/tasks", chat_id=82)
        await tg.wait_for("sendMessage", n=5)
    listing, cancelled, again, after = tg.sent(82)[1:]
    lines = sorted(listing.splitlines())  # listed by next due time: which comes first depends on the hour
    assert len(lines) == 2
    assert lines[0].startswith("#1 · next ") and lines[0].endswith("· once · Water the plants.")
    assert lines[1].startswith("#2 · next ") and "09:00 (UTC) · cron 0 9 * * 1-5 · Morning summary." in lines[1]
    assert cancelled == "Cancelled task #1."
    assert again.startswith("Not cancelled: there is no active task 1 in this chat")
    assert after.startswith("#2 · next ") and "\n" not in after


async def test_a_bad_when_is_a_clear_tool_error(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(tool_calls(("schedule_task", {"when": "next tuesday-ish", "task": "Call Bob."})), when=is_loop)
    llm.push(say("I couldn't schedule that."), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("remind me to call Bob next tuesday-ish", chat_id=83)
        await d.engine.wait_for_turns(1)
        tasks = await d.store.tasks(active=False)
    [result] = tool_results(loop_requests(llm)[1])
    error = json.loads(result)["error"]
    assert "cannot read 'next tuesday-ish' as a time" in error and "ISO 8601" in error and "cron" in error
    assert tasks == []


async def test_the_cap_of_tasks_per_conversation_refuses_more(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(tool_calls(("schedule_task", {"when": "in 1 hour", "task": "A."}),
                        ("schedule_task", {"when": "in 2 hours", "task": "B."})), when=is_loop)
    llm.push(say("One of them."), when=is_loop)
    async with running(write_config(tmp_path, llm, tg, automation={"max_tasks": 1})) as d:
        tg.push_text("remind me of A in an hour and of B in two hours", chat_id=84)
        await d.engine.wait_for_turns(1)
        tasks = await d.store.tasks()
    results = [json.loads(r) for r in tool_results(loop_requests(llm)[1])]
    assert results[0]["task_id"] == 1
    assert "the most it may have (1)" in results[1]["error"]
    assert [t.text for t in tasks] == ["A."]


async def test_an_autonomous_turn_that_says_nothing_delivers_nothing(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(say("hello!"), when=lambda r: is_loop(r) and "Autonomous turn" not in contents(r))
    llm.push(tool_calls(("end_turn", {})), when=lambda r: is_loop(r) and "Autonomous turn" in contents(r))
    autonomy = {"enabled": True, "interval_s": 2, "active_window_s": 3600}
    async with running(write_config(tmp_path, llm, tg, autonomy=autonomy)) as d:
        tg.push_text("hi", chat_id=85)
        await tg.wait_for("sendMessage")
        await d.engine.wait_for_turns(2, timeout=10)
        outbox = await d.store.outbox_for_turn(2)
        trace = (await d.store.recent_turns(limit=1))[0]["trace"]
    assert tg.sent(85) == ["hello!"]  # no "Sorry, I couldn't put an answer together"
    assert outbox == [] and trace["stop_flags"] == ["silent"]
    [(message_id, status)] = journal(tmp_path, "autonomy:%")
    assert status == "done"
    autonomous = [r for r in loop_requests(llm) if "Autonomous turn" in contents(r)]
    assert len(autonomous) == 1 and "hi" in contents(autonomous[0])  # it sees the conversation


async def test_autonomy_respects_its_daily_cap_and_quiet_hours(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(say("hey"), when=lambda r: is_loop(r) and "Autonomous turn" not in contents(r))
    llm.push(say("Just checking in: how did the exam go?"), when=lambda r: is_loop(r) and "Autonomous turn" in contents(r))
    autonomy = {"enabled": True, "interval_s": 1, "active_window_s": 3600, "max_messages_per_day": 1}
    async with running(write_config(tmp_path, llm, tg, autonomy=autonomy)) as d:
        tg.push_text("I have an exam today", chat_id=86)
        await tg.wait_for("sendMessage", n=2, timeout=10)
        await d.engine.wait_for_turns(2)
        await asyncio.sleep(2.5)  # two more cycles come and go
        assert await d.engine.run_automations() == 0  # at the cap: no turn
        d.scheduler.autonomy = d.scheduler.autonomy.model_copy(update={"max_messages_per_day": 5, "quiet_hours": "00:00-23:59"})
        assert await d.engine.run_automations() == 0  # in quiet hours: no turn
    assert tg.sent(86) == ["hey", "Just checking in: how did the exam go?"]
    assert len(journal(tmp_path, "autonomy:%")) == 1


async def test_a_task_due_while_the_daemon_is_killed_fires_exactly_once_after_the_restart(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(tool_calls(("schedule_task", {"when": "in 2 seconds", "task": "Remind the user: the oven!"})),
             when=lambda r: is_loop(r) and not scheduled()(r))
    llm.push(say("Will do."), when=lambda r: is_loop(r) and not scheduled()(r))
    llm.push(say("The oven! (a bit late)"), when=scheduled())
    config = write_config(tmp_path, llm, tg)
    proc = await start_daemon(config, tmp_path)
    try:
        tg.push_text("remind me about the oven in 2 seconds", chat_id=87)
        await tg.wait_for("sendMessage", timeout=20)
        # the turn is over (its reply recorded as sent) before the kill: this test is about the task
        await until(lambda: journal(tmp_path, "%") and all(s == "done" for _, s in journal(tmp_path, "%")))
        await kill_daemon(proc)
    finally:
        if proc.returncode is None:
            proc.kill()
    db = sqlite3.connect(tmp_path / "data" / "bumblebot.db")
    [(due,)] = db.execute("SELECT next_due FROM tasks").fetchall()
    db.close()
    await asyncio.sleep(max(0.0, due + 6 - time.time()))  # it comes due, and more than LATE_S passes, while down
    proc = await start_daemon(config, tmp_path)
    try:
        await tg.wait_for("sendMessage", n=2, timeout=20)
    finally:
        assert await stop_daemon(proc) == 0
    proc = await start_daemon(config, tmp_path)  # a third start finds nothing left to fire
    try:
        llm.push(say("You're welcome."), when=lambda r: is_loop(r) and not scheduled()(r))
        tg.push_text("thanks", chat_id=87)
        await tg.wait_for("sendMessage", n=3, timeout=20)
    finally:
        assert await stop_daemon(proc) == 0
    assert tg.sent(87) == ["Will do.", "The oven! (a bit late)", "You're welcome."]
    assert [status for _, status in journal(tmp_path, "task:%")] == ["done"]
    request = [r for r in loop_requests(llm) if scheduled()(r)][0]
    assert "late (the bot was not running)" in contents(request)


# -- regressions, each with its failing input ---------------------------------------------


async def test_autonomy_never_reaches_out_to_refused_strangers_or_command_only_chats(tmp_path, llm, tg):
    """Regression: a user the allowlist refused, and a chat where only /help was sent, got
    an autonomous turn (with every tool) every cycle."""
    judges_say_done(llm)
    llm.push(say("hello owner"), when=lambda r: is_loop(r) and "Autonomous turn" not in contents(r))
    llm.push(tool_calls(("end_turn", {})), when=lambda r: is_loop(r) and "Autonomous turn" in contents(r))
    autonomy = {"enabled": True, "interval_s": 1, "active_window_s": 3600}
    config = write_config(tmp_path, llm, tg, autonomy=autonomy, telegram={"allowed_user_ids": [90]})
    async with running(config) as d:
        tg.push_text("let me in", chat_id=91)
        tg.push_text("/help", chat_id=92, user_id=90)
        tg.push_text("hi", chat_id=90)
        await tg.wait_for("sendMessage", n=3)
        await d.engine.wait_for_turns(2, timeout=10)  # the owner's turn and one autonomous one
        await asyncio.sleep(1.5)  # another cycle
        await d.engine.run_automations()
    chats = {m.split(":")[0] for m, _ in journal(tmp_path, "autonomy:%")}
    autonomous = [r for r in loop_requests(llm) if "Autonomous turn" in contents(r)]
    assert autonomous and all("Speaking: autonomous cycle (id autonomy)" in contents(r) for r in autonomous)
    db = sqlite3.connect(tmp_path / "data" / "bumblebot.db")
    rows = db.execute("SELECT DISTINCT chat_id FROM journal WHERE source='autonomous'").fetchall()
    db.close()
    assert rows == [("90",)] and chats == {"autonomy"}
    assert tg.sent(91) == ["Sorry, this bot is private."]


async def test_runs_never_pile_up_and_a_cancelled_task_does_not_run_its_queued_run(tmp_path):
    """Regression: an every-second task during a 6 s outage queued 6 runs, all sent on
    recovery, even after /tasks cancel."""
    from zoneinfo import ZoneInfo

    from bumblebot.core.events import ChatRef, Platform
    from bumblebot.core.settings import AutomationSettings, AutonomySettings
    from bumblebot.runtime.scheduler import Scheduler
    from bumblebot.store import Store

    now = [1_800_000_000.0]
    async with Store(tmp_path / "b.db") as store:
        scheduler = Scheduler(AutomationSettings(min_interval_s=1), AutonomySettings(), store, zone=lambda: ZoneInfo("UTC"),
                              clock=lambda: now[0])
        await scheduler.create("telegram:5", "every 1 seconds", "Report.")
        fired = []
        for _ in range(6):  # six due times pass while the first run waits for its turn
            now[0] += 1.0
            fired += await scheduler.fire_due()
        assert len(fired) == 1
        [task] = await store.tasks()
        assert task.runs == 1  # the five due times skipped meanwhile are not runs
        assert await scheduler.may_run(fired[0]) is None
        await scheduler.cancel("telegram:5", 1)
        assert await scheduler.may_run(fired[0]) == "task 1 was cancelled"
        assert await store.next_task_due({"telegram"}) is None
        await scheduler.create("console:local:me", "in 1 seconds", "Console only.")
        now[0] += 5
        assert await store.next_task_due({"telegram"}) is None  # an overdue console task: telegram's loop sleeps
        assert await store.next_task_due({"console"}) is not None
        assert await scheduler.fire_due({Platform.TELEGRAM}) == []
        assert ChatRef.from_key("console:local:me").platform is Platform.CONSOLE


async def test_a_silent_turn_never_posts_daemon_notes(tmp_path, llm, tg):
    """Regression: an autonomous turn told a chat where nobody wrote "My language model isn't reachable"."""
    from fakes.openai_server import error

    judges_say_done(llm)
    llm.push(say("hi there"), when=lambda r: is_loop(r) and "Autonomous turn" not in contents(r))
    llm.push(error(403, "forbidden for the test"), when=lambda r: is_loop(r) and "Autonomous turn" in contents(r))
    autonomy = {"enabled": True, "interval_s": 1, "active_window_s": 3600}
    async with running(write_config(tmp_path, llm, tg, autonomy=autonomy)) as d:
        tg.push_text("hi", chat_id=93)
        await tg.wait_for("sendMessage")
        await d.engine.wait_for_turns(2, timeout=10)
    assert tg.sent(93) == ["hi there"]
    assert [c for c in tg.calls if c.method == "sendChatAction"][-1].time < [c for c in tg.calls if c.method == "sendMessage"][-1].time


async def test_tasks_cancel_with_a_huge_or_foreign_number_is_a_clear_answer(tmp_path, llm, tg):
    async with running(write_config(tmp_path, llm, tg)):
        tg.push_text("/tasks cancel 99999999999999999999", chat_id=94)
        await tg.wait_for("sendMessage")
        tg.push_text("/tasks cancel ٣", chat_id=94)
        await tg.wait_for("sendMessage", n=2)
    assert tg.sent(94) == ["Use /tasks to list the scheduled tasks here, or /tasks cancel ID to cancel one."] * 2
