"""The ledger (bumblebot/runtime/ledger.py), end to end: every model request a turn makes lands
in the ``usage`` table under whom it was for (chat, sender, kind, background) with its cost,
and in the turn's trace. The real daemon, the real python-telegram-bot and openai clients
against the fakes, real SQLite."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path
from typing import Any

from conftest import running, write_config
from fakes.openai_server import is_loop, text
from support import UNCLEAR, is_classifier, judges_say_done, say

from bumblebot.core.errors import SpendingLimitReached
from bumblebot.core.usage import Scope, Usage
from bumblebot.runtime.ledger import Ledger
from bumblebot.store import Store

DETAILS = {"prompt_tokens": 1200, "completion_tokens": 90,
           "prompt_tokens_details": {"cached_tokens": 1024}, "completion_tokens_details": {"reasoning_tokens": 40}}
PRICES = {"reflex-model": {"input": 2.0, "cached_input": 0.5, "output": 8.0}}
#: what a request with :data:`DETAILS` costs at :data:`PRICES`
COST = ((1200 - 1024) * 2.0 + 1024 * 0.5 + 90 * 8.0) / 1_000_000


def usage_rows(tmp_path: Path) -> list[dict[str, Any]]:
    db = sqlite3.connect(tmp_path / "data" / "bumblebot.db")
    db.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in db.execute("SELECT * FROM usage ORDER BY kind")]
    finally:
        db.close()


async def test_a_turns_requests_are_counted_for_its_chat_and_sender_by_kind_with_their_cost(tmp_path, llm, tg, capsys):
    from bumblebot.app.cli import main

    judges_say_done(llm)
    llm.push(text("CHAT", usage={"prompt_tokens": 300, "completion_tokens": 1}), when=is_classifier)
    llm.push(say("a fruit, botanically", usage=DETAILS), when=is_loop)
    config = write_config(tmp_path, llm, tg, cognition={"classifier": True}, llm={
        "base_url": llm.base_url, "model": "test-model", "reflex_model": "reflex-model", "max_retries": 0,
        "timeout_s": 10, "prices": PRICES,
    })
    async with running(config) as d:
        tg.push_text(UNCLEAR, chat_id=41, user_id=4141)
        await d.engine.wait_for_turns(1)
        trace = (await d.store.recent_turns())[0]["trace"]
    rows = {r["kind"]: r for r in usage_rows(tmp_path)}
    assert sorted(rows) == ["classifier", "judge", "turn"]
    assert {(r["conversation"], r["sender"], r["background"], r["model"]) for r in rows.values()} == {
        ("telegram:41", "4141", 0, "reflex-model")
    }
    turn = rows["turn"]
    assert (turn["requests"], turn["prompt_tokens"], turn["cached_tokens"]) == (1, 1200, 1024)
    assert (turn["completion_tokens"], turn["reasoning_tokens"], turn["estimated"], turn["priced"]) == (90, 40, 0, 1)
    assert abs(turn["cost"] - COST) < 1e-12
    assert rows["classifier"]["prompt_tokens"] == 300 and rows["judge"]["requests"] == 1
    [step] = trace["steps"]
    assert step["usage"]["cached"] == 1024 and step["usage"]["reasoning"] == 40
    assert not step["usage"]["estimated"] and abs(step["usage"]["cost"] - COST) < 1e-12
    assert await asyncio.to_thread(main, ["--config", str(config), "trace", "--chat", "telegram:41"]) == 0
    out = capsys.readouterr().out
    assert "prompt_tokens=1200 (cached 1024," in out and "completion_tokens=90 (reasoning 40)" in out
    assert f"cost={COST:.6f} USD" in out


async def test_an_automations_turn_is_background_work_for_nobody_and_so_is_its_check(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(say("Time to stretch!"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        await d.scheduler.create("telegram:42", "in 1 second", "Remind the user to stretch.")
        await tg.wait_for("sendMessage", predicate=lambda p: p.get("text") == "Time to stretch!", timeout=10)
        await d.engine.wait_for_turns(1)
    rows = {r["kind"]: r for r in usage_rows(tmp_path)}
    assert sorted(rows) == ["automation", "judge"]
    assert {(r["conversation"], r["sender"], r["background"]) for r in rows.values()} == {("telegram:42", "", 1)}
    assert rows["automation"]["model"] == "test-model" and rows["automation"]["estimated"] == 0


async def test_a_voice_note_s_transcription_is_counted_for_the_chat_and_sender_who_sent_it(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push_transcript("remind me to buy milk")
    llm.transcript_usage = None  # a whisper server that reports nothing: the length Telegram gave
    llm.push(say("noted: milk"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_voice(b"OggS" + b"\x00" * 200, duration=7, chat_id=43, user_id=4343)
        await d.engine.wait_for_turns(1)
    [transcription] = [r for r in usage_rows(tmp_path) if r["kind"] == "transcription"]
    assert (transcription["conversation"], transcription["sender"], transcription["model"]) == ("telegram:43", "4343", "whisper-1")
    assert (transcription["audio_seconds"], transcription["estimated"], transcription["priced"]) == (7.0, 1, 0)


async def test_the_trace_shows_what_the_classifier_and_the_completion_check_used(tmp_path, llm, tg, capsys):
    from bumblebot.app.cli import main

    judges_say_done(llm)
    llm.push(text("CHAT", usage={"prompt_tokens": 300, "completion_tokens": 1}), when=is_classifier)
    llm.push(say("a fruit, botanically"), when=is_loop)
    config = write_config(tmp_path, llm, tg, cognition={"classifier": True})
    async with running(config) as d:
        tg.push_text(UNCLEAR, chat_id=44, user_id=4444)
        await d.engine.wait_for_turns(1)
        trace = (await d.store.recent_turns())[0]["trace"]
    rows = {r["kind"]: r for r in usage_rows(tmp_path)}
    classifier = trace["classifier_usage"]
    assert (classifier["requests"], classifier["prompt"], classifier["completion"]) == (1, 300, 1)
    [verdict] = trace["gate"]
    assert verdict["judge"] == "adequacy" and verdict["usage"]["requests"] == 1
    judged = rows["judge"]["prompt_tokens"]
    assert verdict["usage"]["prompt"] == judged > 0
    assert await asyncio.to_thread(main, ["--config", str(config), "trace", "--chat", "telegram:44"]) == 0
    out = capsys.readouterr().out
    assert "classifier: 1 request(s), prompt_tokens=300 completion_tokens=1" in out
    assert f"(adequacy): the reply is adequate [1 request(s), prompt_tokens={judged} " in out


async def test_a_voice_reply_is_counted_as_speech_for_the_chat_and_sender_it_answers(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push_transcript("remind me to buy milk")
    llm.push(say("noted: milk"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg, voice={"reply": "mirror"})) as d:
        tg.push_voice(b"OggS" + b"\x00" * 200, duration=7, chat_id=45, user_id=4545)
        await tg.wait_for("sendVoice", timeout=10)
        await d.engine.wait_for_turns(1)
    [speech] = [r for r in usage_rows(tmp_path) if r["kind"] == "speech"]
    assert (speech["conversation"], speech["sender"], speech["model"], speech["requests"]) == ("telegram:45", "4545", "tts-1", 1)
    assert speech["prompt_tokens"] > 0 and speech["estimated"] == 1 and len(llm.speech_requests) == 1


class Refusing:
    """Spending limits that refuse every request for one sender."""

    def __init__(self, sender: str) -> None:
        self.sender = sender
        self.asked: list[tuple[Scope, str]] = []

    async def admit(self, scope: Scope, model: str) -> None:
        self.asked.append((scope, model))
        if scope.sender == self.sender:
            raise SpendingLimitReached("your daily limit of 10 tokens", resets_at=0.0)


async def test_the_ledger_asks_its_limits_before_a_request_and_counts_nothing_itself(tmp_path):
    limits = Refusing("7")
    async with Store(tmp_path / "b.db") as store:
        ledger = Ledger(store, {}, limits=limits)
        await ledger.admit(Scope(conversation="telegram:1", sender="8", kind="turn"), "m")
        try:
            await ledger.admit(Scope(conversation="telegram:1", sender="7", kind="turn"), "m")
        except SpendingLimitReached as exc:
            refused = exc.limit
        else:
            refused = None
        totals = await store.usage_totals("2000-01-01")
        await Ledger(store, {}).admit(Scope(sender="7"), "m")  # no limits: nothing refused
        await ledger.record(Scope(sender="7"), Usage("u", "m", prompt=3, completion=1))
        after = await store.usage_totals("2000-01-01", sender="7")
    assert refused == "your daily limit of 10 tokens" and [s.sender for s, _ in limits.asked] == ["8", "7"]
    assert totals.requests == 0 and after.requests == 1
