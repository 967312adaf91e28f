"""Failover between endpoints (bumblebot/llm/failover.py): the primary and ``llm.fallbacks``, each
a real ``openai`` client against its own fake server; end to end through the daemon and the
Telegram fake, and ``bumblebot check``."""

from __future__ import annotations

import json

import asyncio
import logging
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from conftest import running, write_config
from fakes.openai_server import FakeOpenAI, Reply, error, is_loop, text, tool_calls
from support import Gate, db, judges_say_done, loop_requests, say

from bumblebot.app.check import check_all
from bumblebot.core.config import Secrets, load_settings
from bumblebot.core.entity import load_entity
from bumblebot.core.errors import ModelError, ModelUnavailable
from bumblebot.core.settings import FallbackSettings, LLMSettings, ThinkingSettings
from bumblebot.llm import CapabilityMemory, Endpoints, build_endpoints, tool_choice_key
from bumblebot.llm.failover import fallback_settings, memory_keys
from bumblebot.runtime.outage import OUTAGE_NOTICE

FALLBACK_KEY = "sk-fallback-key-from-the-environment-0001"
SAY_TOOL = {
    "type": "function",
    "function": {"name": "say", "description": "Say something.", "parameters": {
        "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}},
}


@pytest.fixture
async def fallback() -> AsyncIterator[FakeOpenAI]:
    async with FakeOpenAI(models=("big-fallback", "small-fallback")) as server:
        yield server


class Clock:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def failover_config(tmp_path: Path, llm: FakeOpenAI, tg: Any, fallback: FakeOpenAI, **fallback_keys: Any) -> Path:
    entry = {"base_url": fallback.base_url, "model": "big-fallback", "reflex_model": "small-fallback", **fallback_keys}
    # max_retries 2 as by default: the primary must still fail over at once
    return write_config(tmp_path, llm, tg, llm={"max_retries": 2, "fallbacks": [entry]})


def endpoints(primary: FakeOpenAI, fallback: FakeOpenAI, clock: Clock) -> Endpoints:
    settings = LLMSettings(
        model="test-model", reflex_model="reflex-model", max_retries=2,
        # the last endpoint keeps its client retries: none here, to keep the test quick
        fallbacks=[FallbackSettings(base_url=fallback.base_url, model="big-fallback", max_retries=0)],
    )
    built = build_endpoints(settings, base_url=primary.base_url, api_key="sk-primary", key_of=lambda name: None)
    built.clock = clock
    return built


async def ask(llm: Endpoints) -> str:
    return await llm.text([{"role": "user", "content": "hello"}], model="test-model", max_tokens=16, temperature=0)


def answers(server: FakeOpenAI, words: str) -> None:
    server.default = lambda request: text(words)


# -- end to end ----------------------------------------------------------------------------------


async def test_the_fallback_answers_the_turn_the_primary_fails_and_the_primary_is_back_after_its_cooldown(
    tmp_path, llm, tg, fallback
):
    llm.fail_completions(500, "upstream exploded")
    judges_say_done(fallback)
    fallback.push(say("answered by the fallback"), when=is_loop)
    fallback.push(say("the fallback again"), when=is_loop)
    clock = Clock()
    async with running(failover_config(tmp_path, llm, tg, fallback)) as d:
        d.llm.clock = clock
        tg.push_text("what's the capital of France?", chat_id=90)
        await tg.wait_for("sendMessage", timeout=10)
        await d.engine.wait_for_turns(1)
        # failed over at once: no client retries of the primary (2 requests: a 500 to a forced tool
        # call is asked once more with tool_choice "auto", llama.cpp's refusal of forcing)
        assert [r.body["tool_choice"] for r in llm.request_log] == ["required", "auto"]
        llm.stop_failing()
        judges_say_done(llm)
        llm.push(say("the primary again"), when=is_loop)
        clock.now += 9.9  # still cooling down: the fallback answers, the primary is not asked
        tg.push_text("and of Italy?", chat_id=90)
        await tg.wait_for("sendMessage", n=2, timeout=10)
        await d.engine.wait_for_turns(2)
        assert len(llm.request_log) == 2
        clock.now += 0.2  # its 10 s are over: it is asked first again
        tg.push_text("and of Spain?", chat_id=90)
        await tg.wait_for("sendMessage", n=3, timeout=10)
        await d.engine.wait_for_turns(3)
        traces = [t["trace"] for t in reversed(await d.store.recent_turns(limit=3))]
    assert tg.sent(90) == ["answered by the fallback", "the fallback again", "the primary again"]  # no outage notice
    first = traces[0]["steps"][0]
    assert first["endpoint"] == fallback.base_url
    assert first["model"] == ("small-fallback" if traces[0]["route"] == "reflex" else "big-fallback")
    assert first["model"] == loop_requests(fallback)[0]["model"]
    assert traces[2]["steps"][0]["endpoint"] == llm.base_url
    assert traces[2]["steps"][0]["model"] in ("test-model", "reflex-model")
    config = tmp_path / "bumblebot.yaml"
    shown = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "bumblebot", "--config", str(config), "trace"],
        capture_output=True, text=True, cwd=tmp_path,
    )
    assert f"model={first['model']} at {fallback.base_url}" in shown.stdout  # bumblebot trace names it


async def test_all_endpoints_down_gives_one_notice_and_the_answer_when_one_is_back(tmp_path, llm, tg, fallback):
    llm.fail_completions(503, "primary down")
    fallback.fail_completions(503, "fallback down")
    async with running(failover_config(tmp_path, llm, tg, fallback)) as d:
        d.llm.backoff_first_s = 0.05  # the turn's own outage backoff paces the retries
        tg.push_text("are you there?", chat_id=91)
        await tg.wait_for("sendMessage", timeout=10)  # the notice
        assert tg.sent(91) == [OUTAGE_NOTICE]
        judges_say_done(fallback)
        fallback.push(say("the fallback is back"), when=is_loop)
        fallback.stop_failing()
        await tg.wait_for("sendMessage", n=2, timeout=15)
        await d.engine.wait_for_turns(1)
    assert tg.sent(91) == [OUTAGE_NOTICE, "the fallback is back"]
    assert {r.status for r in llm.request_log} == {503}  # the primary never came back
    assert db(tmp_path).execute("SELECT status FROM journal").fetchall() == [("done",)]


async def test_a_fallback_key_from_the_environment_reaches_its_server_only_and_is_never_stored(
    tmp_path, llm, tg, fallback, monkeypatch
):
    monkeypatch.setenv("FALLBACK_API_KEY", FALLBACK_KEY)
    llm.fail_completions(502, "bad gateway")
    judges_say_done(fallback)
    fallback.push(say(f"my key is {FALLBACK_KEY}"), when=is_loop)  # a model echoing it back
    async with running(failover_config(tmp_path, llm, tg, fallback, api_key_env="FALLBACK_API_KEY")) as d:
        tg.push_text("tell me a secret", chat_id=92)
        await tg.wait_for("sendMessage", timeout=10)
        await d.engine.wait_for_turns(1)
    assert {r.headers["Authorization"] for r in fallback.request_log} == {f"Bearer {FALLBACK_KEY}"}
    assert {r.headers["Authorization"] for r in llm.request_log} == {"Bearer sk-test-key-not-real-000000"}
    [shown] = tg.sent(92)
    assert shown.startswith("my key is") and FALLBACK_KEY not in shown
    stored = b"".join(p.read_bytes() for p in (tmp_path / "data").glob("bumblebot.db*"))
    assert stored and FALLBACK_KEY.encode() not in stored


async def test_a_primary_blip_with_a_fallback_missing_its_key_is_answered_not_failed(tmp_path, llm, tg, fallback):
    # regression: the fallback's 401 (it is sent the placeholder key) failed the turn
    llm.fail_completions(503, "primary briefly down", times=1)
    fallback.fail_completions(401, "Incorrect API key provided")  # what a real provider says to no key
    judges_say_done(llm)
    llm.push(say("answered by the primary"), when=is_loop)
    async with running(failover_config(tmp_path, llm, tg, fallback, api_key_env="MISSING_FALLBACK_KEY")) as d:
        tg.push_text("hello?", chat_id=93)
        await tg.wait_for("sendMessage", predicate=lambda p: p["text"] == "answered by the primary", timeout=15)
        await d.engine.wait_for_turns(1)
        assert d.llm.cooling(d.llm.all[1]) > 0  # the broken fallback cools down
    assert tg.sent(93)[-1] == "answered by the primary"
    assert not any("refused" in sent for sent in tg.sent(93))
    assert db(tmp_path).execute("SELECT status FROM journal").fetchall() == [("done",)]
    assert {r.headers["Authorization"] for r in fallback.request_log} == {"Bearer not-needed"}  # docs/models.md


async def test_a_stream_broken_after_its_text_was_shown_is_answered_by_the_fallback_at_once_untold(
    tmp_path, llm, tg, fallback
):
    # regression: the chat got the fallback's answer and "isn't reachable" while the fallback was up
    judges_say_done(llm)
    judges_say_done(fallback)
    reply = say("a long answer from the primary that breaks off somewhere in the middle of it all")
    llm.push(Reply(message=reply.message, finish_reason="tool_calls", stream_chars=4, stream_cut_after=8,
                   stream_delay=0.05), when=is_loop)
    whole = "a long answer from the fallback, whole"
    fallback.push(say(whole), when=is_loop)
    config = write_config(tmp_path, llm, tg, delivery={"streaming": "on"}, llm={"max_retries": 2, "fallbacks": [
        {"base_url": fallback.base_url, "model": "big-fallback"}]})
    async with running(config) as d:
        tg.push_text("tell me something long", chat_id=96)
        await tg.wait_for("editMessageText", predicate=lambda p: p.get("text") == whole, timeout=15)
        await d.engine.wait_for_turns(1)
        assert d.llm.cooling(d.llm.primary) > 0
        assert d.runner.outages.down_since is None  # no outage was counted
    assert tg.shown(96) == [whole]
    assert OUTAGE_NOTICE not in tg.sent(96)


async def test_the_fallbacks_first_request_is_traced_as_the_first_its_cache_sees(tmp_path, llm, tg, fallback):
    """Regression: the trace's ``repeated`` was kept per model the turn asked for, so the first
    request the fallback answered was measured against the primary's, whose cache it cannot use."""
    judges_say_done(llm)
    judges_say_done(fallback)
    llm.push(say("the primary answers"), when=is_loop)
    fallback.push(say("the fallback answers"), when=is_loop)
    fallback.push(say("the fallback again"), when=is_loop)
    async with running(failover_config(tmp_path, llm, tg, fallback)) as d:
        d.llm.clock = Clock()  # the primary stays in its cooldown
        tg.push_text("what's the capital of France?", chat_id=97)
        await d.engine.wait_for_turns(1)
        llm.fail_completions(500, "upstream exploded")
        tg.push_text("what's the capital of Italy?", chat_id=97)
        await d.engine.wait_for_turns(2)
        tg.push_text("what's the capital of Spain?", chat_id=97)
        await d.engine.wait_for_turns(3)
        steps = [t["trace"]["steps"][0] for t in reversed(await d.store.recent_turns(limit=3))]
    assert tg.sent(97) == ["the primary answers", "the fallback answers", "the fallback again"]
    assert [s["endpoint"] for s in steps] == [llm.base_url, fallback.base_url, fallback.base_url]
    assert steps[0]["repeated"] is None and steps[1]["repeated"] is None  # the first of each endpoint
    assert steps[2]["model"] == steps[1]["model"] and steps[2]["repeated"] >= 0.9  # the fallback's own


# -- the endpoints, one request at a time --------------------------------------------------------


async def test_a_429_retry_after_sets_the_cooldown_of_the_primary(llm, fallback):
    clock = Clock()
    answers(llm, "from the primary")
    answers(fallback, "from the fallback")
    llm.fail_completions(429, "slow down", times=1, retry_after=42)
    endpoints_ = endpoints(llm, fallback, clock)
    try:
        assert await ask(endpoints_) == "from the fallback"
        assert endpoints_.cooling(endpoints_.primary) == 42
        clock.now += 41.9
        assert await ask(endpoints_) == "from the fallback"
        assert len(llm.requests) == 1  # not asked while it cools down
        clock.now += 0.1
        assert await ask(endpoints_) == "from the primary"
        assert endpoints_.cooling(endpoints_.primary) == 0
    finally:
        await endpoints_.aclose()
    assert [r["model"] for r in fallback.requests] == ["big-fallback", "big-fallback"]


async def test_without_retry_after_the_cooldown_doubles_with_each_failure_in_a_row(llm, fallback):
    clock = Clock()
    answers(fallback, "from the fallback")
    llm.fail_completions(503, "down")
    endpoints_ = endpoints(llm, fallback, clock)
    try:
        await ask(endpoints_)
        assert endpoints_.cooling(endpoints_.primary) == 10
        clock.now += 10
        await ask(endpoints_)  # tried again, failed again
        assert len(llm.requests) == 2 and endpoints_.cooling(endpoints_.primary) == 20
        llm.stop_failing()
        answers(llm, "from the primary")
        clock.now += 20
        assert await ask(endpoints_) == "from the primary"
        clock.now += 0.1
        llm.fail_completions(503, "down again")
        await ask(endpoints_)
        assert endpoints_.cooling(endpoints_.primary) == 10  # an answer in between starts over
    finally:
        await endpoints_.aclose()


async def test_every_endpoint_down_raises_with_the_shortest_cooldown_left(llm, fallback):
    clock = Clock()
    llm.fail_completions(503, "down", retry_after=30)
    fallback.fail_completions(429, "busy", retry_after=12)
    endpoints_ = endpoints(llm, fallback, clock)
    try:
        with pytest.raises(ModelUnavailable) as failed:
            await ask(endpoints_)
        assert failed.value.retry_after == 12
        clock.now += 5
        with pytest.raises(ModelUnavailable) as cooling:
            await ask(endpoints_)
        assert cooling.value.retry_after == 7
        assert len(llm.requests) == 1 and len(fallback.requests) == 1  # neither was asked again
    finally:
        await endpoints_.aclose()


async def test_a_stream_refused_before_any_answer_fails_over_and_is_heard_from_the_fallback(llm, fallback):
    llm.fail_completions(500, "no")
    fallback.push(tool_calls(("say", {"text": "heard from the fallback"})))
    heard: list[str] = []
    endpoints_ = endpoints(llm, fallback, Clock())
    try:
        completion = await endpoints_.complete(
            [{"role": "user", "content": "hi"}], max_tokens=64, tools=[SAY_TOOL],
            on_say=lambda index, words: heard.append(words),
        )
    finally:
        await endpoints_.aclose()
    assert "".join(heard) == "heard from the fallback"
    assert (completion.endpoint, completion.model, completion.streamed) == (fallback.base_url, "big-fallback", True)


async def test_a_stream_broken_after_its_text_was_shown_is_not_sent_to_the_fallback(llm, fallback):
    reply = tool_calls(("say", {"text": "a long answer that breaks off in the middle"}))
    llm.push(Reply(message=reply.message, finish_reason="tool_calls", stream_chars=4, stream_cut_after=6))
    heard: list[str] = []
    endpoints_ = endpoints(llm, fallback, Clock())
    try:
        with pytest.raises(ModelUnavailable):
            await endpoints_.complete(
                [{"role": "user", "content": "hi"}], max_tokens=64, tools=[SAY_TOOL],
                on_say=lambda index, words: heard.append(words),
            )
        assert heard and fallback.requests == []  # the turn's retry takes the shown text over
        assert endpoints_.cooling(endpoints_.primary) == 10  # and goes to the fallback
    finally:
        await endpoints_.aclose()


async def test_the_primarys_reflex_model_maps_to_the_fallbacks_reflex_model(llm, fallback):
    settings = LLMSettings(model="test-model", reflex_model="reflex-model", fallbacks=[
        FallbackSettings(base_url=fallback.base_url, model="big-fallback", reflex_model="small-fallback"),
    ])
    endpoints_ = build_endpoints(settings, base_url=llm.base_url, api_key=None, key_of=lambda name: None)
    llm.fail_completions(500)
    answers(fallback, "ok")
    try:
        await endpoints_.text([{"role": "user", "content": "judge this"}], max_tokens=8, temperature=0)
        await endpoints_.complete([{"role": "user", "content": "think"}], max_tokens=8)
        await endpoints_.complete([{"role": "user", "content": "background"}], model="cheap-model", max_tokens=8)
    finally:
        await endpoints_.aclose()
    assert [r["model"] for r in fallback.requests] == ["small-fallback", "big-fallback", "big-fallback"]


def test_a_fallback_inherits_what_it_leaves_unset_from_the_primary():
    primary = LLMSettings(
        model="main", reflex_model="quick", timeout_s=30, tool_choice="auto", vision="off",
        thinking=ThinkingSettings(mode="off"), max_concurrent_requests=5, background_model="cheap",
        fallbacks=[FallbackSettings(base_url="http://127.0.0.1:9/v1")],
    )
    own = fallback_settings(primary, FallbackSettings(base_url="http://127.0.0.1:9/v1", vision="on", timeout_s=90))
    assert (own.model, own.reflex_model, own.base_url) == ("main", None, "http://127.0.0.1:9/v1")
    assert (own.vision, own.timeout_s, own.tool_choice, own.thinking.mode, own.max_concurrent_requests) == (
        "on", 90, "auto", "off", 5)
    assert own.fallbacks == [] and own.background_model is None
    with pytest.raises(ValueError, match="base_url"):
        FallbackSettings(model="m")
    with pytest.raises(ValueError, match="api_key_env"):
        FallbackSettings(base_url="http://127.0.0.1:9/v1", api_key_env="sk-a key itself")


@pytest.mark.parametrize(("status", "message"), [
    (401, "Incorrect API key provided"), (402, "Insufficient credits"), (403, "Forbidden"),
    (404, "The model `test-model` does not exist"), (400, "test-model is not a valid model ID"),
])
async def test_an_endpoint_refusing_its_configuration_cools_down_and_the_next_answers(
    llm, fallback, caplog, status, message
):
    clock = Clock()
    llm.fail_completions(status, message)
    answers(fallback, "from the fallback")
    endpoints_ = endpoints(llm, fallback, clock)
    try:
        with caplog.at_level(logging.ERROR, logger="bumblebot.llm.failover"):
            assert await ask(endpoints_) == "from the fallback"
            assert await ask(endpoints_) == "from the fallback"
        assert endpoints_.cooling(endpoints_.primary) == 10 and len(llm.requests) == 1
        assert len([r for r in caplog.records if "refused its configuration" in r.getMessage()]) == 1
        fallback.fail_completions(403, "Forbidden")
        clock.now += 10
        with pytest.raises(ModelError) as refused:  # every endpoint refused its own: as with one endpoint
            await ask(endpoints_)
        assert not isinstance(refused.value, ModelUnavailable) and refused.value.status == status
    finally:
        await endpoints_.aclose()


async def test_a_refusal_of_the_request_is_not_sent_to_the_fallback(llm, fallback):
    llm.fail_completions(400, "Invalid 'messages': something in them")
    endpoints_ = endpoints(llm, fallback, Clock())
    try:
        with pytest.raises(ModelError) as refused:
            await ask(endpoints_)
    finally:
        await endpoints_.aclose()
    assert refused.value.status == 400 and fallback.requests == [] and endpoints_.cooling(endpoints_.primary) == 0


async def test_a_fallback_refusing_its_key_during_an_outage_is_logged_once_and_the_turn_waits(llm, fallback, caplog):
    # regression: the fallback's 401 while the primary was down failed the turn ("refused (401)")
    release = asyncio.Event()

    async def held(request: dict[str, Any]) -> Reply:
        await release.wait()
        return error(401, "Incorrect API key provided")

    llm.fail_completions(503, "down")
    fallback.default = held
    endpoints_ = endpoints(llm, fallback, Clock())
    try:
        with caplog.at_level(logging.ERROR, logger="bumblebot.llm.failover"):
            both = asyncio.gather(ask(endpoints_), ask(endpoints_), return_exceptions=True)
            await fallback.wait_for_requests(2)  # both on their way to it
            release.set()
            failed = await both
        assert [type(f) for f in failed] == [ModelUnavailable, ModelUnavailable]  # the outage path
        assert len([r for r in caplog.records if "refused its configuration" in r.getMessage()]) == 1
        assert endpoints_.cooling(endpoints_.all[1]) == 10
    finally:
        await endpoints_.aclose()


async def test_an_answer_to_a_request_sent_before_the_failure_does_not_end_the_cooldown(llm, fallback):
    # regression: a slow answer of a request sent before a 429 wiped the 429's cooldown
    slow = Gate(text("slow answer"))
    llm.push(slow)
    answers(fallback, "from the fallback")
    endpoints_ = endpoints(llm, fallback, Clock())
    try:
        first = asyncio.create_task(ask(endpoints_))
        await asyncio.wait_for(slow.entered.wait(), 5)
        llm.fail_completions(429, "rate limited", retry_after=60)
        assert await ask(endpoints_) == "from the fallback"
        slow.release.set()
        assert await first == "slow answer"
        assert endpoints_.cooling(endpoints_.primary) == 60
        assert await ask(endpoints_) == "from the fallback"
        assert len(llm.requests) == 2
    finally:
        await endpoints_.aclose()


async def test_one_trial_request_at_a_time_goes_to_an_endpoint_out_of_its_cooldown(llm, fallback):
    # regression: when its cooldown ended every request went to the primary (a hanging one held them all)
    clock = Clock()
    llm.fail_completions(503, "down", times=1)
    trial = Gate(text("the primary is back"))
    llm.push(trial)
    answers(fallback, "from the fallback")
    endpoints_ = endpoints(llm, fallback, clock)
    try:
        assert await ask(endpoints_) == "from the fallback"
        clock.now += 10  # its cooldown is over
        first = asyncio.create_task(ask(endpoints_))
        await asyncio.wait_for(trial.entered.wait(), 5)
        assert await asyncio.gather(*(ask(endpoints_) for _ in range(4))) == ["from the fallback"] * 4
        assert len(llm.requests) == 2  # the failure and the one trial
        trial.release.set()
        assert await first == "the primary is back"
        answers(llm, "from the primary")
        assert await ask(endpoints_) == "from the primary"
        # with no other endpoint to go to, a request waits for the trial's answer
        llm.fail_completions(503, "down", times=1)
        fallback.fail_completions(429, "busy", retry_after=120)
        with pytest.raises(ModelUnavailable):
            await ask(endpoints_)
        second = Gate(text("back again"))
        llm.push(second)
        clock.now += 10
        first = asyncio.create_task(ask(endpoints_))
        await asyncio.wait_for(second.entered.wait(), 5)
        waiting = asyncio.create_task(ask(endpoints_))
        await asyncio.sleep(0)  # it runs up to its wait: nothing before it awaits I/O
        assert not waiting.done()
        second.release.set()
        assert (await first, await waiting) == ("back again", "from the primary")
        assert len(fallback.requests) == 6
    finally:
        await endpoints_.aclose()


async def test_when_every_endpoint_cools_down_each_try_asks_them_so_one_back_answers_the_next(llm, fallback):
    # regression: after a long outage of both, the fallback back was asked only at the end of its
    # 5-minute cooldown, not at the turn's next retry (at most 60 s later)
    clock = Clock()
    llm.fail_completions(503, "down")
    fallback.fail_completions(503, "down")
    endpoints_ = endpoints(llm, fallback, clock)
    try:
        for _ in range(11):  # the turn's outage retries, 60 s apart at most
            with pytest.raises(ModelUnavailable) as failed:
                await ask(endpoints_)
            assert failed.value.retry_after is None  # the turn's own backoff paces the tries
            clock.now += 60
        assert endpoints_.cooling(endpoints_.all[1]) > 60  # its backoff is long by now
        assert len(llm.requests) == len(fallback.requests) == 11  # each try asked both
        fallback.stop_failing()
        answers(fallback, "the fallback is back")
        assert await ask(endpoints_) == "the fallback is back"
    finally:
        await endpoints_.aclose()


@pytest.mark.parametrize("retry_after", ["0", "Wed, 21 Oct 2015 07:28:00 GMT"])
async def test_a_retry_after_of_zero_or_in_the_past_cools_down_by_the_backoff(llm, fallback, retry_after):
    # regression: it meant no cooldown at all, every request asked the primary first again
    llm.fail_completions(429, "slow down", times=1, retry_after=retry_after)
    answers(llm, "from the primary")
    answers(fallback, "from the fallback")
    endpoints_ = endpoints(llm, fallback, Clock())
    try:
        assert await ask(endpoints_) == "from the fallback"
        assert endpoints_.cooling(endpoints_.primary) == 10
        assert await ask(endpoints_) == "from the fallback"
        assert len(llm.requests) == 1
    finally:
        await endpoints_.aclose()


async def test_two_endpoints_at_one_base_url_learn_tool_forcing_apart(llm):
    # regression: one OpenRouter model refusing tool_choice "required" turned forcing off for the
    # other model there too
    def answer(request: dict[str, Any]) -> Reply:
        if request["model"] == "big-fallback" and request.get("tool_choice") == "required":
            return error(400, "tool_choice 'required' is not supported for this model")
        return tool_calls(("say", {"text": "hi"}))

    llm.default = answer
    saved: dict[str, str] = {}

    async def save(key: str, value: str) -> None:
        saved[key] = value

    settings = LLMSettings(model="test-model", max_retries=0, fallbacks=[
        FallbackSettings(base_url=llm.base_url, model="big-fallback", max_retries=0)])
    endpoints_ = build_endpoints(settings, base_url=llm.base_url, api_key="sk-test", key_of=lambda name: None,
                                 capabilities=CapabilityMemory(save=save))
    endpoints_.clock = clock = Clock()
    hello = [{"role": "user", "content": "hi"}]
    try:
        llm.fail_completions(429, "rate limited on test-model", times=1, retry_after=1)
        await endpoints_.complete(hello, max_tokens=64, tools=[SAY_TOOL])  # the fallback answers, with auto
        clock.now += 1
        await endpoints_.complete(hello, max_tokens=64, tools=[SAY_TOOL])  # the primary again
    finally:
        await endpoints_.aclose()
    assert [(r.body["model"], r.body.get("tool_choice"), r.status) for r in llm.request_log] == [
        ("test-model", "required", 429), ("big-fallback", "required", 400), ("big-fallback", "auto", 200),
        ("test-model", "required", 200),
    ]
    # the fallback model's refusal is its own; the primary's key records only that it accepted
    assert json.loads(saved[tool_choice_key(f"{llm.base_url}|big-fallback")])["mode"] == "auto"
    assert json.loads(saved[tool_choice_key(llm.base_url)])["mode"] == "required"
    # the first endpoint at a URL keeps the bare URL: what the primary learnt before is still read
    assert memory_keys([("http://a/v1", "m1"), ("http://a/v1", "m2"), ("http://b/v1", "m1")]) == [
        "http://a/v1", "http://a/v1|m2", "http://b/v1"]


# -- bumblebot check -----------------------------------------------------------------------------


async def test_check_lists_each_endpoint_with_what_it_found(tmp_path, llm, fallback, capsys, monkeypatch):
    monkeypatch.setenv("FALLBACK_API_KEY", FALLBACK_KEY)
    ping = tool_calls(("ping", {}))
    llm.default = lambda r: ping if "tools" in r else text("ok")
    fallback.default = lambda r: ping if "tools" in r else text("ok")
    config = write_config(tmp_path, llm, None, llm={"fallbacks": [
        {"base_url": fallback.base_url, "model": "big-fallback", "api_key_env": "FALLBACK_API_KEY", "tool_choice": "auto"},
        {"base_url": "http://127.0.0.1:9/v1", "api_key_env": "UNSET_FALLBACK_KEY"},
    ]})
    settings = load_settings(config)
    problems = await check_all(settings, Secrets(OPENAI_API_KEY="sk-test"), load_entity(settings.entity), chat_only=True)
    out = capsys.readouterr().out
    assert problems == ["fallback 2"]
    assert f"[ok] model test-model: answered at {llm.base_url}" in out
    assert f"[ok] fallback 1: {fallback.base_url} (key from FALLBACK_API_KEY)" in out
    assert f"[ok] fallback 1 model big-fallback: answered at {fallback.base_url}" in out
    assert "[ok] fallback 1 tool calls: big-fallback called a tool, with tool_choice=auto" in out
    # regression: an endpoint configured with tool_choice auto was said to have refused "required"
    assert "[ok] fallback 1 tool forcing: auto (llm.tool_choice in the config; never forced)\n" in out
    assert "[ok] tool forcing: required" in out
    assert "[FAIL] fallback 2: UNSET_FALLBACK_KEY (llm.fallbacks[1].api_key_env) is not set" in out
    assert FALLBACK_KEY not in out
    assert {r.headers["Authorization"] for r in fallback.request_log} == {f"Bearer {FALLBACK_KEY}"}


async def test_check_hides_a_key_a_fallback_echoes_and_says_nothing_more_of_a_fallback_that_failed(
    tmp_path, llm, fallback, capsys, monkeypatch
):
    # regression: the key was printed as the endpoint's 401 quoted it, and "[ok]" lines followed
    monkeypatch.setenv("FALLBACK_API_KEY", FALLBACK_KEY)
    ping = tool_calls(("ping", {}))
    llm.default = lambda r: ping if "tools" in r else text("ok")
    fallback.default = lambda r: error(401, f"Incorrect API key provided: {FALLBACK_KEY}. You can find your key at …")
    config = write_config(tmp_path, llm, None, llm={"fallbacks": [
        {"base_url": fallback.base_url, "model": "big-fallback", "api_key_env": "FALLBACK_API_KEY"}]})
    settings = load_settings(config)
    problems = await check_all(settings, Secrets(OPENAI_API_KEY="sk-test"), load_entity(settings.entity), chat_only=True)
    out = capsys.readouterr().out
    assert problems == ["fallback 1 model endpoint"]
    assert "[FAIL] fallback 1 model endpoint: " in out and "Incorrect API key provided: [REDACTED]." in out
    assert FALLBACK_KEY not in out
    assert [line for line in out.splitlines() if line.startswith("[ok] fallback 1")] == [
        f"[ok] fallback 1: {fallback.base_url} (key from FALLBACK_API_KEY); tried when the endpoints before it are down"]


async def test_a_500ing_primary_with_streaming_costs_at_most_two_requests_before_the_fallback(tmp_path, tg):
    """Streamed, forcing "required": a primary failing every request with a 500 was sent each
    step's request four times (streamed and whole, "required" and "auto") before the fallback
    answered. A streamed 5xx goes to the next endpoint, not again whole."""
    async with FakeOpenAI() as primary, FakeOpenAI() as spare:
        judges_say_done(primary)
        judges_say_done(spare)
        primary.fail_completions(500, "upstream failed")
        spare.push(say("from the spare"), when=is_loop)
        config = write_config(tmp_path, primary, tg, delivery={"streaming": "on"},
                              llm={"max_retries": 2, "fallbacks": [{"base_url": spare.base_url, "model": "test-model"}]})
        async with running(config) as d:
            tg.push_text("hi", chat_id=45)
            await d.engine.wait_for_turns(1, timeout=30)
    assert tg.sent(45) == ["from the spare"]
    sent = [(r.body.get("stream", False), r.body.get("tool_choice")) for r in primary.request_log if r.body.get("tools")]
    assert sent == [(True, "required"), (True, "auto")]


async def test_check_says_a_fallback_with_a_smaller_window_than_the_primarys(tmp_path, capsys):
    """The daemon sizes every request for it; check marked the fallback's window [ok]."""
    async with FakeOpenAI(context_window=16384) as primary, FakeOpenAI(context_window=4096) as spare:
        for server in (primary, spare):
            server.default = lambda r: tool_calls(("ping", {})) if "tools" in r else text("ok")
        config = write_config(tmp_path, primary, None, llm={"fallbacks": [{"base_url": spare.base_url, "model": "test-model"}]})
        settings = load_settings(config)
        problems = await check_all(settings, Secrets(OPENAI_API_KEY="sk-test"), load_entity(settings.entity), chat_only=True)
    out = capsys.readouterr().out
    assert problems == []
    assert "[ok] context window test-model: cognition.max_context_tokens is not set (32768 assumed); the endpoint " \
           "says 16384 tokens (from /props): the daemon uses 16384" in out
    assert ("[note] fallback 1 context window: 4096 tokens, smaller than the primary's 16384: the daemon sizes every "
            "request for 4096, the primary's too") in out
