"""What ``bumblebot check`` learns about the endpoint is remembered where the daemon looks for
it (bumblebot/app/probing.py), so the first real turn pays nothing to learn it again; and it
says what it learned. ``check_all`` against ``FakeOpenAI``, real SQLite, then the daemon."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from conftest import running, write_config
from fakes.openai_server import FakeOpenAI, is_loop, text, tool_calls
from support import judges_say_done, loop_requests, say

from bumblebot.app.check import check_all
from bumblebot.core.config import Secrets, load_settings
from bumblebot.core.entity import load_entity
from bumblebot.llm import ForcingFallback, stream_key, thinking_key, tool_choice_key
from bumblebot.llm.window import LearnedWindow, window_key
from bumblebot.store import Store


async def check(config: Path) -> tuple[list[str], Any]:
    settings = load_settings(config)
    entity = load_entity(settings.entity, config_dir=config.parent)
    return await check_all(settings, Secrets(OPENAI_API_KEY="sk-test"), entity, chat_only=True), settings


def answer_with_ping(server: FakeOpenAI) -> None:
    server.default = lambda request: tool_calls(("ping", {})) if is_loop(request) else text("ok")


async def test_check_shows_the_configured_and_the_learned_window_and_remembers_it(tmp_path, capsys):
    async with FakeOpenAI(context_window=4096) as server:
        answer_with_ping(server)
        problems, settings = await check(write_config(tmp_path, server))
        assert problems == []
        out = capsys.readouterr().out
        assert ("[ok] context window test-model: cognition.max_context_tokens is not set (32768 assumed); the "
                "endpoint says 4096 tokens (from /props): the daemon uses 4096") in out
        async with Store(settings.db_path) as store:  # remembered for the daemon
            assert LearnedWindow.parse(await store.get_kv(window_key(server.base_url, "test-model"))).tokens == 4096
        # configured larger than the server's: both shown, and what to do about it
        problems, _ = await check(write_config(tmp_path, server, cognition={"max_context_tokens": 32768}))
        assert problems == []
        out = capsys.readouterr().out
        assert ("[note] context window test-model: cognition.max_context_tokens is 32768; the endpoint says 4096 "
                "tokens (from /props): the daemon uses 4096; lower cognition.max_context_tokens to 4096") in out




async def test_check_says_the_endpoint_tells_no_window_and_what_to_set(tmp_path, capsys):
    async with FakeOpenAI(context_window=4096, tells_window=None) as server:
        answer_with_ping(server)
        problems, _ = await check(write_config(tmp_path, server))
    assert problems == []
    out = capsys.readouterr().out
    assert "[ok] context window test-model: cognition.max_context_tokens is not set (32768 assumed); the endpoint " \
           "does not say its window" in out
    assert "the daemon uses 32768 until a context-length refusal states the endpoint's" in out


async def test_what_check_learns_is_remembered_so_the_first_turn_pays_nothing(tmp_path, tg, capsys):
    """An endpoint refusing tool_choice=required (a bare 500, as llama-cpp-python), streams
    (a 400) and reasoning_effort: check says what it learned, not a silent [ok], and writes it
    where the daemon reads it; the daemon's first turn then sends no request it would refuse."""
    async with FakeOpenAI(reject_tool_choice_required=500, tool_choice_refusal="", reject_stream=400,
                          reject_reasoning_effort=True) as server:
        answer_with_ping(server)
        config = write_config(tmp_path, server, tg, llm={"max_retries": 2}, delivery={"streaming": "on"})
        problems, settings = await check(config)
        assert problems == []
        out = capsys.readouterr().out
        assert "[note] tool forcing: auto: the endpoint refused tool_choice=required just now; remembered for the " \
               "daemon" in out
        assert "[ok] tool forcing" not in out
        assert "[note] streaming: whole messages, learned just now and remembered for the daemon" in out
        assert "[ok] thinking: not asked for: the daemon remembers that test-model refused reasoning_effort" in out
        async with Store(settings.db_path) as store:
            assert ForcingFallback.parse(await store.get_kv(tool_choice_key(server.base_url))) is not None
            assert await store.get_kv(stream_key(server.base_url))
            assert await store.get_kv(thinking_key(server.base_url, "test-model"))
        refused_by_check = len(server.rejected)
        judges_say_done(server)
        server.push(say("hello there"), when=is_loop)
        async with running(config) as d:
            tg.push_text("help me research the history of the bicycle and compare the sources", chat_id=51)
            await d.engine.wait_for_turns(1, timeout=20)
    assert tg.sent(51) == ["hello there"]
    assert len(server.rejected) == refused_by_check  # nothing refused: the turn started plain
    first = loop_requests(server)[-1]
    assert first["tool_choice"] == "auto" and not first.get("stream") and "reasoning_effort" not in first


async def test_check_next_to_a_running_daemon_writes_what_it_learns(tmp_path, tg, capsys):
    """check takes no lock and writes its rows through WAL and the busy timeout while the daemon
    holds the database open; the daemon keeps running and reads them at its next start."""
    async with FakeOpenAI(context_window=4096) as server:
        answer_with_ping(server)
        config = write_config(tmp_path, server, tg)
        async with running(config) as d:
            problems, settings = await check(config)
            assert problems == []
            raw = await d.store.get_kv(window_key(server.base_url, "test-model"))
        assert LearnedWindow.parse(raw).tokens == 4096
        assert "the endpoint says 4096 tokens (from /props)" in capsys.readouterr().out
