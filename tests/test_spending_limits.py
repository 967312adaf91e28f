"""Spending limits (bumblebot/runtime/limits.py) and what a refused turn does (the runner).

End to end, the daemon runs in this event loop with the real python-telegram-bot and openai
clients against the fakes, on real SQLite files. What the day used so far is written into the
``usage`` table as the daemon's meter would have recorded it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from conftest import running, write_config
from fakes.openai_server import is_loop, tool_calls
from support import (
    Gate,
    contents,
    db,
    is_loop_with,
    journal_texts,
    judges_say_done,
    loop_requests,
    say,
    user_text,
)

from bumblebot.core.errors import wait_words
from bumblebot.core.events import ChatRef
from bumblebot.core.settings import LimitsSettings, Settings
from bumblebot.core.usage import Scope, Usage
from bumblebot.runtime.limits import (
    NOTIFIED_KEY,
    LimitReached,
    SpendingLimits,
    check_lines,
    next_midnight,
    utc_day,
)
from bumblebot.store import Store, TaskRecord

GROUP = -500
URL = "http://127.0.0.1:1/v1"


def used(prompt: int, completion: int = 0) -> Usage:
    return Usage(URL, "test-model", prompt=prompt, completion=completion)


async def seed(tmp_path: Path, *rows: tuple[Scope, Usage, float | None]) -> None:
    """What today's requests used before the daemon starts."""
    async with Store(tmp_path / "data" / "bumblebot.db") as store:
        for scope, usage, cost in rows:
            await store.add_usage(utc_day(time.time()), scope, usage, cost)


def person(chat: int | str, sender: int | str) -> Scope:
    return Scope(conversation=f"telegram:{chat}", sender=str(sender), kind="turn")


def asked(llm, needle: str) -> list[dict]:
    return [r for r in llm.requests if needle in contents(r)]


# -- end to end --------------------------------------------------------------------------------


async def test_a_sender_over_the_daily_limit_is_told_once_and_the_endpoint_sees_no_request(tmp_path, llm, tg):
    judges_say_done(llm)
    await seed(tmp_path, (person(42, 42), used(900, 150), None))
    llm.push(say("Hello Bo."), when=is_loop)
    config = write_config(tmp_path, llm, tg, limits={"sender_daily_tokens": 1000})
    async with running(config) as d:
        tg.push_text("hi there", chat_id=42)
        await tg.wait_for("sendMessage")
        await d.engine.wait_for_turns(1)
        tg.push_text("are you there?", chat_id=42)
        await d.engine.wait_for_turns(2)
        tg.push_text("hello", chat_id=43)  # another person: their own limit is not reached
        await d.engine.wait_for_turns(3)
    [notice] = tg.sent(42)
    assert "your daily limit of 1,000 tokens has been reached" in notice and "00:00 UTC" in notice
    assert "Error" not in notice and "Limit" not in notice  # no exception class name
    assert tg.sent(43) == ["Hello Bo."]
    assert asked(llm, "hi there") == [] and asked(llm, "are you there?") == []
    # the refused messages are settled as answered, not left pending for ever
    assert [s for (s,) in db(tmp_path).execute("SELECT status FROM journal ORDER BY id")] == ["done"] * 3
    stops = db(tmp_path).execute("SELECT status, json_extract(trace, '$.stop_reason') FROM turns ORDER BY id")
    assert stops.fetchall() == [("done", "spending_limit"), ("done", "spending_limit"), ("done", "end_turn")]


async def test_the_chat_limit_refuses_everyone_in_that_group_and_no_other_chat(tmp_path, llm, tg):
    judges_say_done(llm)
    await seed(tmp_path, (person(GROUP, 7), used(5000, 100), None))
    llm.push(say("Hi Alice."), when=is_loop)
    config = write_config(tmp_path, llm, tg, limits={"chat_daily_tokens": 5000})
    async with running(config) as d:
        tg.push_text("@fake_bot what's up", chat_id=GROUP, user_id=8, chat_type="group")
        await tg.wait_for("sendMessage")
        tg.push_text("hi", chat_id=8)  # the same person in their private chat
        await d.engine.wait_for_turns(2)
    [notice] = tg.sent(GROUP)
    assert "this chat's daily limit of 5,000 tokens has been reached" in notice
    assert tg.sent(8) == ["Hi Alice."]
    assert asked(llm, "what's up") == []


async def test_the_bot_limit_tells_each_chat_once_and_the_operator_once(tmp_path, llm, tg, caplog):
    caplog.set_level(logging.WARNING, logger="bumblebot.runtime.limits")
    judges_say_done(llm)
    await seed(tmp_path, (person(50, 50), used(300, 20), 1.25))
    limits = {"bot_daily_cost": 1.0, "notify_chat": "telegram:99"}
    async with running(write_config(tmp_path, llm, tg, limits=limits)) as d:
        tg.push_text("first", chat_id=51)
        await tg.wait_for("sendMessage", predicate=lambda p: p.get("chat_id") == 51)
        await d.engine.wait_for_turns(1)
        tg.push_text("second", chat_id=51)
        tg.push_text("third", chat_id=52)
        await tg.wait_for("sendMessage", predicate=lambda p: p.get("chat_id") == 52)
        await d.engine.wait_for_turns(3)
    assert llm.requests == []
    for chat in (51, 52):
        [notice] = tg.sent(chat)
        assert "the daily spending limit of 1.00 for all chats together has been reached" in notice
    [operator] = tg.sent(99)
    assert "limits.bot_daily_cost" in operator and "1.00" in operator and "00:00 UTC" in operator
    warnings = [r.getMessage() for r in caplog.records if "limits.bot_daily_cost" in r.getMessage()]
    assert len(warnings) == 1


async def test_an_automation_counts_against_the_background_limit_and_each_refused_task_is_told(tmp_path, llm, tg):
    judges_say_done(llm)
    await seed(tmp_path, (Scope(conversation="telegram:60", kind="automation", background=True), used(150), None))
    llm.push(say("Hi, here I am."), when=is_loop)
    config = write_config(tmp_path, llm, tg, limits={"background_daily_tokens": 100, "notify_chat": "telegram:99"})
    async with running(config) as d:
        for n in (1, 2):
            await d.scheduler.create("telegram:60", "in 1 second", f"Water the plants, round {n}.")
            await d.engine.wait_for_turns(n, timeout=15)  # settled without a turn
        tg.push_text("hello?", chat_id=60)  # a person's turn is not background work
        await d.engine.wait_for_turns(3)
    # no request for the tasks, and their text does not wait in the history for the next turn
    assert asked(llm, "Water the plants") == [] and len(loop_requests(llm)) == 1
    first, second, answer = tg.sent(60)
    assert first.endswith("So scheduled task #1 did not run: Water the plants, round 1.")
    assert second.endswith("So scheduled task #2 did not run: Water the plants, round 2.")
    assert answer == "Hi, here I am."
    [operator] = tg.sent(99)
    assert "limits.background_daily_tokens" in operator
    assert db(tmp_path).execute("SELECT COUNT(*) FROM turns").fetchone() == (1,)
    journal = db(tmp_path).execute("SELECT text, status FROM journal ORDER BY id").fetchall()
    assert [status for _, status in journal] == ["ignored", "ignored", "done"]


async def test_a_turn_cut_by_a_limit_mid_way_ends_with_what_it_said_delivered_once(tmp_path, llm, tg):
    judges_say_done(llm)
    first = Gate(say("Here is the first part.", end=False))
    llm.push(first, when=is_loop)
    config = write_config(tmp_path, llm, tg, limits={"sender_daily_tokens": 1000})
    async with running(config) as d:
        tg.push_text("tell me two things", chat_id=70)
        await asyncio.wait_for(first.entered.wait(), 10)
        # what the first request used, recorded before its answer comes back
        await d.store.add_usage(utc_day(time.time()), person(70, 70), used(1200, 30), None)
        first.release.set()
        await d.engine.wait_for_turns(1)
    part, notice = tg.sent(70)
    assert part == "Here is the first part." and "your daily limit of 1,000 tokens" in notice
    assert len(loop_requests(llm)) == 1 and not llm.violations
    row = db(tmp_path).execute("SELECT status, json_extract(trace, '$.stop_reason') FROM turns").fetchone()
    assert row == ("done", "spending_limit")
    assert db(tmp_path).execute("SELECT status FROM journal").fetchall() == [("done",)]


def usage_of(tmp_path: Path) -> list[tuple[str, str, int]]:
    """``(sender, kind, requests)`` of what the daemon recorded (not what a test seeded)."""
    return db(tmp_path).execute(
        "SELECT sender, kind, requests FROM usage WHERE endpoint != ? ORDER BY sender, kind", (URL,)
    ).fetchall()


async def test_a_person_over_their_limit_in_a_burst_is_told_and_the_other_is_answered_for_himself(tmp_path, llm, tg):
    """Alice (7) used her day; Bob (8) writes in the same burst: her message gets the limit in
    a turn of its own, his is answered and counted for him (before, the turn went by the last
    sender's limit: one of them was answered inside the other's turn, or refused for it)."""
    judges_say_done(llm)
    await seed(tmp_path, (person(GROUP, 7), used(5000), None))
    llm.push(say("Here you are, Bob."), when=is_loop)
    config = write_config(tmp_path, llm, tg, limits={"sender_daily_tokens": 4000},
                          cognition={"classifier": False, "debounce_s": 1.0})
    async with running(config) as d:
        tg.push_text("@fake_bot write me a long essay on tomatoes", chat_id=GROUP, user_id=7, chat_type="group")
        tg.push_text("@fake_bot same here", chat_id=GROUP, user_id=8, chat_type="group")
        await d.engine.wait_for_turns(2)
    notice, answer = tg.sent(GROUP)
    assert "your daily limit of 4,000 tokens has been reached" in notice and answer == "Here you are, Bob."
    [request] = loop_requests(llm)
    assert "same here" in user_text(request) and "long essay" not in user_text(request)
    assert usage_of(tmp_path) == [("8", "judge", 1), ("8", "turn", 1)]
    turns = db(tmp_path).execute("SELECT json_extract(trace, '$.stop_reason') FROM turns ORDER BY id").fetchall()
    assert turns == [("spending_limit",), ("end_turn",)]
    assert [status for _, status in journal_texts(tmp_path)] == ["done", "done"]


async def test_a_person_under_their_limit_is_not_refused_for_the_one_who_wrote_after_him(tmp_path, llm, tg):
    """Bob (8) asks, then Alice (7), over her limit, in the same burst: Bob is answered."""
    judges_say_done(llm)
    await seed(tmp_path, (person(GROUP, 7), used(5000), None))
    llm.push(say("Tokyo: 22:00."), when=is_loop)
    config = write_config(tmp_path, llm, tg, limits={"sender_daily_tokens": 4000},
                          cognition={"classifier": False, "debounce_s": 1.0})
    async with running(config) as d:
        tg.push_text("@fake_bot what time is it in Tokyo", chat_id=GROUP, user_id=8, chat_type="group")
        tg.push_text("@fake_bot and in Paris?", chat_id=GROUP, user_id=7, chat_type="group")
        await d.engine.wait_for_turns(2)
    assert sorted(tg.sent(GROUP))[1] == "Tokyo: 22:00."
    assert any("your daily limit of 4,000 tokens" in t for t in tg.sent(GROUP))
    [request] = loop_requests(llm)
    assert "Tokyo" in user_text(request) and "Paris" not in user_text(request)
    assert usage_of(tmp_path) == [("8", "judge", 1), ("8", "turn", 1)]


async def test_a_message_from_a_person_over_their_limit_is_not_taken_into_anothers_running_turn(tmp_path, llm, tg):
    judges_say_done(llm)
    first = Gate(say("Looking it up.", end=False))
    llm.push(first, when=is_loop)
    llm.push(say("Tokyo: 22:00."), when=is_loop)
    config = write_config(tmp_path, llm, tg, limits={"sender_daily_tokens": 100_000})
    async with running(config) as d:
        tg.push_text("@fake_bot what time is it in Tokyo", chat_id=GROUP, user_id=8, chat_type="group")
        await asyncio.wait_for(first.entered.wait(), 10)
        await d.store.add_usage(utc_day(time.time()), person(GROUP, 7), used(100_000), None)  # Alice's day is used up
        tg.push_text("@fake_bot write me a long essay", chat_id=GROUP, user_id=7, chat_type="group")
        await d.engine.wait_until(lambda: d.engine.progress.accepted >= 2)
        first.release.set()
        await d.engine.wait_for_turns(2)
    assert not any("long essay" in contents(r) for r in loop_requests(llm))
    looking, answer, notice = tg.sent(GROUP)
    assert (looking, answer) == ("Looking it up.", "Tokyo: 22:00.") and "your daily limit of 100,000" in notice
    assert usage_of(tmp_path) == [("8", "judge", 1), ("8", "turn", 2)]


async def test_a_message_taken_into_a_running_turn_makes_its_later_requests_its_senders(tmp_path, llm, tg):
    judges_say_done(llm)
    first = Gate(say("Looking it up.", end=False))
    llm.push(first, when=is_loop)
    llm.push(say("Tokyo: 22:00, Paris: 15:00."), when=is_loop_with("in Paris"))
    async with running(write_config(tmp_path, llm, tg, limits={"sender_daily_tokens": 100_000})) as d:
        tg.push_text("@fake_bot what time is it in Tokyo", chat_id=GROUP, user_id=8, chat_type="group")
        await asyncio.wait_for(first.entered.wait(), 10)
        tg.push_text("@fake_bot and in Paris?", chat_id=GROUP, user_id=9, chat_type="group")
        await d.engine.wait_until(lambda: d.engine.progress.accepted >= 2)
        first.release.set()
        await d.engine.wait_for_turns(1)
    assert tg.sent(GROUP) == ["Looking it up.", "Tokyo: 22:00, Paris: 15:00."]
    kinds = [k for _, k, _ in usage_of(tmp_path)]
    assert ("8", "turn", 1) in usage_of(tmp_path) and ("9", "turn", 1) in usage_of(tmp_path)
    assert ("9", "judge", 1) in usage_of(tmp_path) and kinds.count("judge") == 1


async def test_a_one_shot_reminder_a_limit_refuses_is_told_with_its_text_and_not_run_later(tmp_path, llm, tg):
    judges_say_done(llm)
    await seed(tmp_path, (Scope(conversation="telegram:60", kind="automation", background=True), used(500), None))
    config = write_config(tmp_path, llm, tg, limits={"background_daily_tokens": 100})
    async with running(config) as d:
        await d.scheduler.create("telegram:60", "in 1 second", "Remind Alice to take her pills.")
        await d.engine.wait_for_turns(1, timeout=15)
        await tg.wait_for("sendMessage")
    [told] = tg.sent(60)
    assert told.startswith("A spending limit stops me here: the daily limit of 100 tokens for scheduled and autonomous work")
    assert "It resets at 00:00 UTC, in " in told
    assert told.endswith("So scheduled task #1 did not run: Remind Alice to take her pills.")
    assert llm.requests == []
    assert db(tmp_path).execute("SELECT status, next_due FROM tasks").fetchall() == [("done", None)]


async def test_a_scheduled_turn_a_limit_cuts_before_it_said_anything_is_told_as_a_task_that_did_not_run(tmp_path, llm, tg):
    judges_say_done(llm)
    first = Gate(tool_calls(("think", {"thought": "What to say about the plants?"})))
    llm.push(first, when=is_loop)
    config = write_config(tmp_path, llm, tg, limits={"background_daily_tokens": 1000})
    async with running(config) as d:
        await d.scheduler.create("telegram:61", "in 1 second", "Water the plants.")
        await asyncio.wait_for(first.entered.wait(), 15)
        await d.store.add_usage(utc_day(time.time()), Scope(conversation="telegram:61", kind="automation", background=True), used(1200), None)
        first.release.set()
        await d.engine.wait_for_turns(1)
        await tg.wait_for("sendMessage")
    [told] = tg.sent(61)
    assert "scheduled and autonomous work" in told and told.endswith("So scheduled task #1 did not run: Water the plants.")


async def test_a_voice_reply_a_limit_refuses_goes_out_as_text_alone(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push_transcript("remind me to buy milk")
    first = Gate(say("Noted: milk."))
    llm.push(first, when=is_loop)
    config = write_config(tmp_path, llm, tg, voice={"reply": "mirror"}, limits={"sender_daily_tokens": 100_000})
    async with running(config) as d:
        tg.push_voice(b"OggS" + b"\x00" * 200, duration=7, chat_id=62, user_id=62)
        await asyncio.wait_for(first.entered.wait(), 10)
        await d.store.add_usage(utc_day(time.time()), person(62, 62), used(100_000), None)
        first.release.set()
        await d.engine.wait_for_turns(1)
    assert tg.sent(62) == ["Noted: milk."]
    assert llm.speech_requests == [] and not [c for c in tg.calls if c.method == "sendVoice"]


async def test_a_voice_note_under_a_reached_limit_is_not_transcribed_and_is_named_in_the_history(tmp_path, llm, tg):
    judges_say_done(llm)
    await seed(tmp_path, (person(5, 5), used(5000), None))
    llm.push_transcript("remind me to buy milk")
    async with running(write_config(tmp_path, llm, tg, limits={"bot_daily_tokens": 1000})) as d:
        tg.push_voice(b"OggS" + b"\x00" * 200, duration=7, chat_id=9, user_id=9)
        await d.engine.wait_for_turns(1)
    [told] = tg.sent(9)
    assert told.startswith("A spending limit stops me here: the daily limit of 1,000 tokens for all chats together")
    assert llm.transcriptions == [] and llm.requests == []
    history = db(tmp_path).execute("SELECT role, content FROM messages ORDER BY id").fetchall()
    assert history[0] == ("user", "(a voice message)") and history[1][1] == told


async def test_a_refused_completion_check_passes_as_a_failing_one_does(tmp_path, llm, tg):
    """The limit is reached while the turn's answer is being written: its completion check
    is refused, and the turn ends as it does when the check fails, answered."""
    judges_say_done(llm)
    first = Gate(say("All done."))
    llm.push(first, when=is_loop)
    config = write_config(tmp_path, llm, tg, limits={"sender_daily_tokens": 1000})
    async with running(config) as d:
        tg.push_text("do it", chat_id=71)
        await asyncio.wait_for(first.entered.wait(), 10)
        await d.store.add_usage(utc_day(time.time()), person(71, 71), used(1200, 30), None)
        first.release.set()
        await d.engine.wait_for_turns(1)
    assert tg.sent(71) == ["All done."]
    assert len(llm.requests) == 1  # the judge was not asked
    row = db(tmp_path).execute("SELECT status, json_extract(trace, '$.stop_reason') FROM turns").fetchone()
    assert row == ("done", "end_turn")


# -- the limits on their own --------------------------------------------------------------------


async def test_no_limit_set_costs_nothing(tmp_path):
    limits = SpendingLimits(LimitsSettings(), Store(tmp_path / "never-opened.db"))
    await limits.admit(person(1, 1), "test-model")  # an unopened store raises if it is read


async def test_background_work_counts_against_the_chat_and_bot_limits_and_turns_not_against_background(tmp_path):
    now = 1_796_000_000.0  # 2026-11-30 00:53:20 UTC
    task = Scope(conversation="telegram:5", kind="automation", background=True)
    settings = LimitsSettings(chat_daily_tokens=100, background_daily_tokens=1000)
    async with Store(tmp_path / "b.db") as store:
        await store.add_usage(utc_day(now), task, used(150), None)
        limits = SpendingLimits(settings, store, clock=lambda: now)
        try:
            await limits.admit(person(5, 11), "m")
        except LimitReached as exc:
            refused = exc
        assert refused.limit == "this chat's daily limit of 100 tokens"
        assert refused.resets_at == next_midnight(now) == 1_796_083_200.0
        await limits.admit(person(6, 11), "m")  # another chat
        await store.add_usage(utc_day(now), person(6, 11), used(5000), None)
        await limits.admit(Scope(conversation="telegram:7", kind="automation", background=True), "m")


async def test_the_operator_and_each_chat_are_told_once_a_day(tmp_path):
    clock = [1_796_000_000.0]
    told: list[tuple[str, str]] = []

    async def reply(chat, text):
        told.append((chat.key, text))

    settings = LimitsSettings(sender_daily_tokens=10, notify_chat="telegram:99")
    async with Store(tmp_path / "b.db") as store:
        await store.add_usage(utc_day(clock[0]), person(5, 11), used(20), None)
        limits = SpendingLimits(settings, store, reply=reply, clock=lambda: clock[0])
        refusals = await asyncio.gather(*(_refusal(limits, person(5, 11)) for _ in range(3)))
        assert len(told) == 1 and "limits.sender_daily_tokens" in told[0][1] and told[0][0] == "telegram:99"
        again = SpendingLimits(settings, store, reply=reply, clock=lambda: clock[0])  # after a restart
        await _refusal(again, person(5, 11))
        assert len(told) == 1 and await store.get_kv(NOTIFIED_KEY)
        first = await limits.notice("telegram:5", refusals[0])
        assert first is not None and "your daily limit of 10 tokens" in first and "in 23 h 6 min" in first
        assert await limits.notice("telegram:5", refusals[1]) is None
        clock[0] = next_midnight(clock[0]) + 60  # the next day: a new limit to tell of, if reached again
        await store.add_usage(utc_day(clock[0]), person(5, 11), used(20), None)
        refusal = await _refusal(limits, person(5, 11))
        assert await limits.notice("telegram:5", refusal) is not None and len(told) == 2


async def test_a_refused_one_shot_task_is_told_each_time_a_repeating_one_once_a_day(tmp_path):
    clock = [1_796_000_000.0]
    told: list[tuple[str, str]] = []

    async def reply(chat, text):
        told.append((chat.key, text))

    def task(task_id: int, kind: str) -> TaskRecord:
        return TaskRecord(task_id, 1, ChatRef.from_key("telegram:5"), kind, "", "UTC", f"Task {task_id}.", 0.0, None,
                          "active", 0, None)

    background = Scope(conversation="telegram:5", kind="automation", background=True)
    async with Store(tmp_path / "b.db") as store:
        await store.add_usage(utc_day(clock[0]), background, used(20), None)
        limits = SpendingLimits(LimitsSettings(background_daily_tokens=10), store, reply=reply, clock=lambda: clock[0])
        refusal = await _refusal(limits, background)
        for tasked in (task(1, "every"), task(2, "cron"), task(3, "once"), task(4, "once")):
            await limits.tell_task(ChatRef.from_key("telegram:5"), refusal, tasked)
    assert [t.rsplit(" ", 1)[-1] for _, t in told] == ["1.", "3.", "4."]
    assert told[0][1].endswith("It resets at 00:00 UTC, in 23 h 6 min. So scheduled task #1 did not run: Task 1.")


async def _refusal(limits: SpendingLimits, scope: Scope) -> LimitReached:
    try:
        await limits.admit(scope, "m")
    except LimitReached as exc:
        return exc
    raise AssertionError("not refused")


def test_wait_words():
    assert wait_words(30) == "less than a minute"
    assert wait_words(12 * 60 + 5) == "12 min"
    assert wait_words(5 * 3600) == "5 h"
    assert wait_words(5 * 3600 + 12 * 60) == "5 h 12 min"


def test_check_warns_of_cost_limits_while_a_model_has_no_price():
    assert check_lines(Settings()) == ["none set"]
    settings = Settings(limits={"sender_daily_tokens": 50000, "bot_daily_cost": 5}, llm={"model": "big", "reflex_model": "small"})
    described, warning = check_lines(settings)
    assert described == "sender 50,000 tokens a day; bot 5.00 a day (reset at 00:00 UTC)"
    assert warning.startswith("WARNING:") and "big, small" in warning and "llm.prices" in warning
    assert check_lines(Settings(limits={"chat_daily_tokens": 10})) == ["chat 10 tokens a day (reset at 00:00 UTC)"]
