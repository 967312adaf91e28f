"""Tool forcing recovers (bumblebot/llm/forcing.py).

An endpoint that refuses ``tool_choice="required"`` is switched to ``"auto"``, and the fallback
is remembered with its reason and time in ``kv``. It is not for good: after a bound (tool
requests or seconds under the fallback) one request tries ``"required"`` again; accepted, the
memory is cleared; refused, the fallback stays and the timer restarts. Real ``openai`` client
against ``FakeOpenAI``, real SQLite, an injected clock, no sleeps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import running, write_config
from fakes.openai_server import FakeOpenAI, error, is_loop, text, tool_calls
from support import judges_say_done, say

from bumblebot.app.check import check_all, forcing_mode
from bumblebot.core.config import Secrets, load_settings
from bumblebot.core.entity import load_entity
from bumblebot.core.errors import ModelUnavailable
from bumblebot.core.settings import LLMSettings
from bumblebot.llm import FORCING_RETRY_S, LLM, CapabilityMemory, ForcingFallback, tool_choice_key
from bumblebot.store import Store

PING = {
    "type": "function",
    "function": {"name": "ping", "description": "Answer a ping.", "parameters": {"type": "object", "properties": {}}},
}
MESSAGES = [{"role": "user", "content": "ping please"}]
T0 = 1_780_000_000.0  # 2026-05-28 20:26 UTC


class Clock:
    """A wall clock the test moves by hand (epoch seconds)."""

    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def answer_with_ping(server: FakeOpenAI) -> None:
    server.default = lambda request: tool_calls(("ping", {})) if is_loop(request) else text("ok")


#: the clients :func:`client` made in the running test, closed after it (a client left open
#: holds its sockets to a fake that is gone, and warns of them whenever it is collected)
_CLIENTS: list[LLM] = []


@pytest.fixture(autouse=True)
async def _close_clients() -> Any:
    yield
    while _CLIENTS:
        await _CLIENTS.pop().aclose()


def client(server: FakeOpenAI, store: Store, clock: Clock, **kwargs: Any) -> LLM:
    """The LLM as ``Daemon.open`` wires it: the memory on the store's ``kv``."""
    llm = LLM(
        LLMSettings(model="test-model", max_retries=0, timeout_s=10),
        base_url=server.base_url,
        api_key="sk-test",
        capabilities=CapabilityMemory(store.get_kv, store.set_kv),
        clock=clock,
        **kwargs,
    )
    _CLIENTS.append(llm)
    return llm


async def ask(llm: LLM) -> str | None:
    """One tool request; the tool_choice that answered it."""
    completion = await llm.complete(MESSAGES, max_tokens=32, tools=[PING])
    assert [c.name for c in completion.tool_calls] == ["ping"]
    return completion.tool_choice


async def remembered(store: Store, server: FakeOpenAI) -> ForcingFallback | None:
    return ForcingFallback.parse(await store.get_kv(tool_choice_key(server.base_url)))


async def test_fallback_is_remembered_with_reason_and_time_across_a_restart(tmp_path):
    clock = Clock()
    async with FakeOpenAI(reject_tool_choice_required=400) as server:
        answer_with_ping(server)
        async with Store(tmp_path / "bumblebot.db") as store:
            llm = client(server, store, clock)
            assert await ask(llm) == "auto"  # refused, retried at once with auto
            await llm.aclose()
        assert len(server.rejected) == 1
        async with Store(tmp_path / "bumblebot.db") as store:  # a new process: new store, new client
            fallback = await remembered(store, server)
            assert fallback == ForcingFallback(
                "HTTP 400: tool_choice 'required' is not supported by this endpoint", T0, T0, 0
            )
            llm = client(server, store, clock)
            clock.now += 60
            assert await ask(llm) == "auto"
            await llm.aclose()
        assert len(server.rejected) == 1  # straight to auto: no second refusal
        assert [r["tool_choice"] for r in server.requests] == ["required", "auto", "auto"]


async def test_forcing_is_re_tried_after_the_request_bound_and_comes_back(tmp_path):
    clock = Clock()
    async with FakeOpenAI(reject_tool_choice_required=400) as server:
        answer_with_ping(server)
        async with Store(tmp_path / "bumblebot.db") as store:
            llm = client(server, store, clock, forcing_retry_requests=3)
            assert await ask(llm) == "auto"
            assert [await ask(llm) for _ in range(3)] == ["auto"] * 3  # the bound: 3 under the fallback
            assert len(server.rejected) == 1
            server.reject_tool_choice_required = None  # the endpoint was fixed meanwhile
            assert await ask(llm) == "required"  # the 4th re-tries forcing, accepted
            assert await remembered(store, server) is None  # the memory is cleared
            assert await ask(llm) == "required"
            await llm.aclose()
        async with Store(tmp_path / "bumblebot.db") as store:  # and stays cleared after a restart
            assert await remembered(store, server) is None
            llm = client(server, store, clock)
            assert await ask(llm) == "required"
            await llm.aclose()
        assert [r["tool_choice"] for r in server.requests] == ["required", "auto", "auto", "auto", "auto"] + [
            "required"
        ] * 3


async def test_a_refused_retry_keeps_the_fallback_and_restarts_the_timer(tmp_path):
    clock = Clock()
    async with FakeOpenAI(reject_tool_choice_required=400) as server:
        answer_with_ping(server)
        async with Store(tmp_path / "bumblebot.db") as store:
            llm = client(server, store, clock)
            assert await ask(llm) == "auto"
            clock.now += FORCING_RETRY_S - 1
            assert await ask(llm) == "auto"
            assert len(server.rejected) == 1  # not due yet
            clock.now += 1  # 6 h under the fallback: due
            assert await ask(llm) == "auto"  # re-tried, refused again, answered with auto
            assert len(server.rejected) == 2
            fallback = await remembered(store, server)
            assert fallback is not None
            assert (fallback.since, fallback.checked_at, fallback.retries) == (T0, T0 + FORCING_RETRY_S, 1)
            clock.now += FORCING_RETRY_S - 1  # the timer restarted at the refused retry
            assert await ask(llm) == "auto"
            assert len(server.rejected) == 2
            await llm.aclose()
        async with Store(tmp_path / "bumblebot.db") as store:  # the timer survives a restart
            llm = client(server, store, clock)
            assert await ask(llm) == "auto"
            assert len(server.rejected) == 2
            clock.now += 1
            server.reject_tool_choice_required = None
            assert await ask(llm) == "required"
            assert await remembered(store, server) is None
            await llm.aclose()


async def test_plain_auto_of_an_older_version_is_re_tried_at_once(tmp_path):
    clock = Clock()
    async with FakeOpenAI() as server:
        answer_with_ping(server)
        async with Store(tmp_path / "bumblebot.db") as store:
            await store.set_kv(tool_choice_key(server.base_url), "auto")  # written "for good" by 0.x
            fallback = await remembered(store, server)
            assert fallback is not None and fallback.since is None and "older version" in fallback.reason
            llm = client(server, store, clock)
            assert await ask(llm) == "required"
            assert await remembered(store, server) is None
            await llm.aclose()


async def test_an_outage_during_the_retry_decides_nothing(tmp_path):
    """A retry that meets a server outage (503 on "required" and then on "auto") neither
    brings forcing back nor restarts the timer: the next request tries again."""
    clock = Clock()
    async with FakeOpenAI() as server:
        answer_with_ping(server)
        async with Store(tmp_path / "bumblebot.db") as store:
            key = tool_choice_key(server.base_url)
            await store.set_kv(key, ForcingFallback("HTTP 400: no forcing here", T0, T0).dump())
            clock.now += FORCING_RETRY_S
            server.push(error(503, "overloaded"))
            llm = client(server, store, clock)
            with pytest.raises(ModelUnavailable):
                await llm.complete(MESSAGES, max_tokens=32, tools=[PING])
            assert await remembered(store, server) == ForcingFallback("HTTP 400: no forcing here", T0, T0)
            assert await ask(llm) == "required"  # tried again at once, accepted
            assert await remembered(store, server) is None
            await llm.aclose()
        assert [r["tool_choice"] for r in server.requests] == ["required", "required"]


async def test_the_memory_clears_through_delete_when_wired(tmp_path):
    async with FakeOpenAI() as server:
        answer_with_ping(server)
        async with Store(tmp_path / "bumblebot.db") as store:
            key = tool_choice_key(server.base_url)
            await store.set_kv(key, "auto")
            llm = LLM(
                LLMSettings(model="test-model", max_retries=0),
                base_url=server.base_url,
                api_key="sk-test",
                capabilities=CapabilityMemory(store.get_kv, store.set_kv, store.delete_kv),
            )
            assert await ask(llm) == "required"
            assert await store.get_kv(key) is None  # the row is gone, not just emptied
            await llm.aclose()


# -- bumblebot check -----------------------------------------------------------------------------


def check_settings(tmp_path: Path, server: FakeOpenAI) -> Any:
    return load_settings(write_config(tmp_path, server))


async def run_check(tmp_path: Path, server: FakeOpenAI) -> list[str]:
    settings = check_settings(tmp_path, server)
    entity = load_entity(settings.entity, config_dir=tmp_path)
    return await check_all(settings, Secrets(OPENAI_API_KEY="sk-test"), entity)


async def test_check_says_required_when_nothing_is_remembered(tmp_path, capsys):
    async with FakeOpenAI() as server:
        answer_with_ping(server)
        assert await run_check(tmp_path, server) == []
    assert "[ok] tool forcing: required\n" in capsys.readouterr().out


async def test_check_does_not_claim_required_when_the_endpoint_refuses_it(tmp_path, capsys):
    """Against llama.cpp (500 on required) check does not claim "tool forcing: required" after
    printing "called a tool, with tool_choice=auto"."""
    async with FakeOpenAI(reject_tool_choice_required=500) as server:
        answer_with_ping(server)
        assert await run_check(tmp_path, server) == []
    out = capsys.readouterr().out
    assert "with tool_choice=auto" in out and "[ok] tool forcing: required\n" not in out
    assert "refused tool_choice=required just now" in out


async def test_check_says_auto_since_when_and_why(tmp_path, capsys):
    async with FakeOpenAI(reject_tool_choice_required=400) as server:
        answer_with_ping(server)
        settings = check_settings(tmp_path, server)
        async with Store(settings.db_path) as store:
            await store.set_kv(
                tool_choice_key(server.base_url),
                ForcingFallback("HTTP 400: tool_choice 'required' is not supported", T0, T0).dump(),
            )
        mode, fallback = await forcing_mode(settings, server.base_url, now=T0 + 3600)
        assert fallback is not None
        assert mode == (
            "auto since 2026-05-28 20:26 UTC: HTTP 400: tool_choice 'required' is not supported; re-tried "
            "every 50 tool requests or 6 h, whichever comes first (next within 5 h)"
        )
        assert await run_check(tmp_path, server) == []
        out = capsys.readouterr().out
        assert "[ok] tool forcing: auto since 2026-05-28 20:26 UTC: HTTP 400: tool_choice 'required'" in out
        assert "accepts tool_choice=required now" not in out  # the probe was refused too
        # the endpoint got fixed: check sees forcing work and says the daemon will follow
        server.reject_tool_choice_required = None
        assert await run_check(tmp_path, server) == []
        assert "so the daemon switches back at its next re-try" in capsys.readouterr().out


async def test_check_says_the_forcing_its_own_re_try_left_and_logs_the_real_re_try_time(tmp_path, capsys, caplog):
    """check re-tries "required" under a remembered fallback; its line said the state from before
    that re-try ("next within 5 h"), and the log "next try after 50 tool requests or 0 s" (the
    timer was zeroed to force the re-try)."""
    import logging
    import time

    caplog.set_level(logging.INFO, logger="bumblebot.llm.forcing")
    async with FakeOpenAI(reject_tool_choice_required=400) as server:
        answer_with_ping(server)
        settings = check_settings(tmp_path, server)
        hour_ago = time.time() - 3600
        async with Store(settings.db_path) as store:
            await store.set_kv(tool_choice_key(server.base_url), ForcingFallback("HTTP 400: no", hour_ago, hour_ago).dump())
        assert await run_check(tmp_path, server) == []
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("[ok] tool forcing: "))
    assert "(re-tried 1 time(s) since, refused)" in line and "(next within 6 h)" in line
    assert line.endswith("; check re-tried tool_choice=required just now: refused")
    assert "still refuses tool_choice=required" in caplog.text and "tool requests or 6 h" in caplog.text
    assert " or 0 s" not in caplog.text


async def test_check_names_a_plain_auto_of_an_older_version(tmp_path):
    async with FakeOpenAI() as server:
        settings = check_settings(tmp_path, server)
        async with Store(settings.db_path) as store:
            await store.set_kv(tool_choice_key(server.base_url), "auto")
        mode, _ = await forcing_mode(settings, server.base_url)
        assert mode.startswith("auto: remembered by an older version; reason not recorded; re-tried every 50")
        assert mode.endswith("(next at the first tool request)")


async def test_a_500_about_tool_call_arguments_does_not_switch_forcing_off(tmp_path):
    """The failing input: one 500 "Failed to parse tool call arguments" (the model's output, not
    the endpoint's rule) used to switch forcing off at once."""
    async with FakeOpenAI() as server, Store(tmp_path / "b.db") as store:
        answer_with_ping(server)
        server.push(error(500, "Failed to parse tool call arguments"), when=lambda r: r.get("tool_choice") == "required")
        llm = client(server, store, Clock())
        assert await ask(llm) == "auto"  # answered through the one retry
        assert await remembered(store, server) is None
        assert await ask(llm) == "required"


async def test_flaky_500s_between_successes_never_switch_forcing_off(tmp_path):
    """A flaky upstream: every other forced request fails with 500 (a run with 40 % of them
    failing once switched forcing off for good). From an endpoint that accepted forcing before,
    strikes only count on consecutive requests."""
    async with FakeOpenAI() as server, Store(tmp_path / "b.db") as store:
        answer_with_ping(server)
        llm = client(server, store, Clock())
        assert await ask(llm) == "required"
        for _ in range(10):
            server.push(error(500, "upstream hiccup"), when=lambda r: r.get("tool_choice") == "required")
            server.push(error(500, "upstream hiccup"), when=lambda r: r.get("tool_choice") == "required")
            assert await ask(llm) == "auto"
            assert await ask(llm) == "auto"
            assert await ask(llm) == "required"
        assert await remembered(store, server) is None


async def test_three_unexplained_refusals_in_a_row_switch_forcing_off(tmp_path):
    """An endpoint that accepted forcing (remembered from an earlier process) and then refuses
    it without a reason on three requests in a row."""
    async with FakeOpenAI() as server, Store(tmp_path / "b.db") as store:
        answer_with_ping(server)
        first = client(server, store, Clock())
        assert await ask(first) == "required"
        await first.aclose()
        for _ in range(3):
            server.push(error(500, "internal error"), when=lambda r: r.get("tool_choice") == "required")
        llm = client(server, store, Clock())
        for _ in range(3):
            assert await ask(llm) == "auto"
        fallback = await remembered(store, server)
        assert fallback is not None and "3 unexplained refusals" in fallback.reason


# -- through the whole daemon ------------------------------------------------------------------


async def test_one_upstream_hiccup_does_not_turn_tool_forcing_off(tmp_path, llm, tg):
    """An endpoint seen accepting forcing has one unexplained 500: forcing stays on."""
    judges_say_done(llm)
    forced = lambda r: is_loop(r) and r.get("tool_choice") == "required"  # noqa: E731
    llm.push(say("forced"), when=forced)
    llm.push(error(500, "upstream hiccup"), when=forced)
    llm.push(say("recovered"), when=is_loop)
    llm.push(say("still forced"), when=forced)
    async with running(write_config(tmp_path, llm, tg)) as d:
        for n, words in enumerate(("hi", "hello", "again"), start=1):
            tg.push_text(words, chat_id=9)
            await tg.wait_for("sendMessage", n=n)
        remembered = await d.store.get_kv(f"llm.tool_choice:{llm.base_url}")
    assert tg.sent(9) == ["forced", "recovered", "still forced"]
    assert ForcingFallback.parse(remembered) is None
