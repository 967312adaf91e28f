"""Failover between endpoints (bumblebot/llm/failover.py): the primary and ``llm.fallbacks``, each
a real ``openai`` client against its own fake server; end to end through the daemon and the
Telegram fake, and ``bumblebot check``."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from conftest import running, write_config
from fakes.openai_server import FakeOpenAI, Reply, is_loop, text, tool_calls
from support import db, judges_say_done, loop_requests, say

from bumblebot.app.check import check_all
from bumblebot.core.config import Secrets, load_settings
from bumblebot.core.entity import load_entity
from bumblebot.core.errors import ModelUnavailable
from bumblebot.core.settings import FallbackSettings, LLMSettings, ThinkingSettings
from bumblebot.llm import Endpoints, build_endpoints
from bumblebot.llm.failover import fallback_settings
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
