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
from fakes.openai_server import is_loop
from support import Gate, contents, db, judges_say_done, loop_requests, say

from bumblebot.core.settings import LimitsSettings, Settings
from bumblebot.core.usage import Scope, Usage
from bumblebot.runtime.limits import (
    NOTIFIED_KEY,
    LimitReached,
    SpendingLimits,
    check_lines,
    next_midnight,
    utc_day,
    wait_words,
)
from bumblebot.store import Store

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


async def test_an_automation_counts_against_the_background_limit_and_the_chat_is_not_spammed(tmp_path, llm, tg):
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
    assert tg.sent(60) == ["Hi, here I am."]
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
