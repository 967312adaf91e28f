"""The endpoint's real context window (bumblebot/llm/window.py): asked where the server tells it,
read from its context-length refusals, remembered, and used by the budget for every later
request. Real ``openai`` client and httpx against ``FakeOpenAI``, real SQLite, the whole daemon."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
from conftest import running, write_config
from fakes.openai_server import FakeOpenAI, is_aux, is_loop, text, tool_calls
from support import chatty, judges_say_done, loop_requests, say

from bumblebot.core.errors import ContextTooLong
from bumblebot.core.settings import LLMSettings
from bumblebot.llm import LLM, CapabilityMemory
from bumblebot.llm.window import (
    OLLAMA_DEFAULT_NUM_CTX,
    LearnedWindow,
    Windows,
    WindowSet,
    window_in_refusal,
    window_key,
)
from bumblebot.runtime.notices import TOO_LONG, TOO_LONG_MESSAGE
from bumblebot.store import Store

T0 = 1_780_000_000.0


def client(server: FakeOpenAI, store: Store, **settings: Any) -> LLM:
    """The LLM as ``Daemon.open`` wires it: the memory on the store's ``kv``."""
    return LLM(
        LLMSettings(model="test-model", max_retries=0, timeout_s=10, **settings), base_url=server.base_url,
        api_key="sk-test", capabilities=CapabilityMemory(store.get_kv, store.set_kv, store.delete_kv),
        clock=lambda: T0,
    )


@pytest.mark.parametrize(
    ("tells", "window", "source", "assumed"),
    [
        ("props", 4096, "/props", False),  # llama.cpp server
        ("models", 8192, "/models max_model_len", False),  # vLLM
        ("ollama", 6144, "/api/show num_ctx", False),  # num_ctx in the model's parameters
        ("ollama_running", 16384, "/api/ps (the running model)", False),
        ("ollama_default", OLLAMA_DEFAULT_NUM_CTX, "Ollama's default num_ctx", True),
    ],
)
async def test_the_window_is_asked_where_the_server_tells_it_and_remembered(tmp_path, tells, window, source, assumed):
    async with FakeOpenAI(context_window=window if tells != "ollama_default" else 2048, tells_window=tells) as server:
        async with Store(tmp_path / "b.db") as store:
            llm = client(server, store)
            said = await llm.windows.ask(["test-model"])
            await llm.aclose()
        learned = said["test-model"]
        assert learned is not None and (learned.tokens, learned.assumed) == (window, assumed)
        assert learned.source.startswith(source)
        async with Store(tmp_path / "b.db") as store:  # a restart starts with it
            assert LearnedWindow.parse(await store.get_kv(window_key(server.base_url, "test-model"))) == learned
            windows = Windows(CapabilityMemory(store.get_kv, store.set_kv), server.base_url, None, lambda: T0 + 60)
            await windows.load(["test-model"])
            assert windows.get("test-model") == learned


async def test_a_server_that_tells_nothing_leaves_the_window_unknown(tmp_path):
    async with FakeOpenAI(context_window=4096, tells_window=None) as server, Store(tmp_path / "b.db") as store:
        llm = client(server, store)
        assert await llm.windows.ask(["test-model"]) == {"test-model": None}
        assert llm.windows.get("test-model") is None
        await llm.aclose()


@pytest.mark.parametrize("shape", ["llama.cpp", "openai"])
async def test_the_window_is_learned_from_a_context_length_refusal_and_remembered(tmp_path, shape):
    async with FakeOpenAI(context_window=4096, tells_window=None, context_error=shape) as server:
        async with Store(tmp_path / "b.db") as store:
            llm = client(server, store)
            with pytest.raises(ContextTooLong) as refused:
                await llm.complete([{"role": "user", "content": "word " * 5000}], max_tokens=64)
            assert refused.value.window == 4096
            assert llm.windows.get("test-model") == LearnedWindow(4096, "a context-length refusal", T0)
            await llm.aclose()
        async with Store(tmp_path / "b.db") as store:
            raw = await store.get_kv(window_key(server.base_url, "test-model"))
        assert LearnedWindow.parse(raw) == LearnedWindow(4096, "a context-length refusal", T0)


@pytest.mark.parametrize(
    ("message", "body", "window"),
    [
        ("This model's maximum context length is 4096 tokens. However, you requested 6026 tokens "
         "(6010 in the messages, 16 in the completion).", None, 4096),  # vLLM, OpenAI, llama-cpp-python
        ("the request exceeds the available context size, try increasing it",
         {"error": {"type": "exceed_context_size_error", "n_prompt_tokens": 5000, "n_ctx": 8192}}, 8192),  # llama.cpp
        ("Prompt contains 40000 tokens and 0 draft tokens, too large for model with 32768 maximum context length",
         None, 32768),  # Mistral
        ("`inputs` tokens + `max_new_tokens` must be <= 2048. Given: 3000 `inputs` tokens", None, 2048),  # TGI
        ("prompt is too long: 210000 tokens > 200000 maximum", None, 200000),  # Anthropic through a proxy
        ("the request exceeds the available context size, try increasing it", None, None),  # says none
        ("context length exceeded", {"error": {"n_ctx": 12}}, None),  # not a window
    ],
)
def test_the_window_a_refusal_states(message, body, window):
    assert window_in_refusal(message, body) == window


async def test_asking_a_server_that_never_answers_is_bounded(tmp_path, monkeypatch):
    """Turns wait for the asking at start: a server that takes connections and never answers
    holds them ASK_TOTAL_S at most, not each question's timeout over every route and model."""
    import asyncio

    import bumblebot.llm.window as window

    monkeypatch.setattr(window, "ASK_TOTAL_S", 0.5)
    held: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with Store(tmp_path / "b.db") as store:
        windows = Windows(CapabilityMemory(store.get_kv, store.set_kv), f"http://127.0.0.1:{port}/v1", None, lambda: T0)
        async with asyncio.timeout(3):  # ASK_TIMEOUT_S alone (5 s a route) would take longer
            said = await windows.ask(["a", "b"])
    assert said == {}
    for writer in held:
        writer.close()
    server.close()


async def test_an_old_learned_window_is_forgotten(tmp_path):
    async with Store(tmp_path / "b.db") as store:
        key = window_key("http://x/v1", "m")
        await store.set_kv(key, LearnedWindow(4096, "a context-length refusal", T0).dump())
        windows = Windows(CapabilityMemory(store.get_kv, store.set_kv, store.delete_kv), "http://x/v1", None,
                          lambda: T0 + 25 * 3600)
        await windows.load(["m"])
        assert windows.get("m") is None and await store.get_kv(key) is None


# -- the budget follows it ----------------------------------------------------------------------


async def test_a_configured_window_larger_than_the_servers_is_corrected_with_one_warning(tmp_path, llm, tg, caplog):
    """cognition.max_context_tokens says 32768, the server (llama.cpp) says 4096: every request,
    its reply cap and its fixed part are sized for 4096, and the log warns once, even when a
    refusal later states the same window again."""
    caplog.set_level(logging.INFO, logger="bumblebot.cognition.budget")
    llm.context_window = 4096
    judges_say_done(llm)
    llm.push(say("one"), when=is_loop)
    llm.push(say("two"), when=is_loop)
    config = write_config(tmp_path, llm, tg, cognition={"classifier": False, "max_context_tokens": 32768})
    async with running(config) as d:
        tg.push_text("hello", chat_id=41)
        await d.engine.wait_for_turns(1)
        await d.llm.primary.windows.refused("test-model", 4096)  # a refusal restating it
        tg.push_text("again", chat_id=41)
        await d.engine.wait_for_turns(2)
        level = d.runner.fixed_part()[0]
        budget = d.runner.budget
    assert tg.sent(41) == ["one", "two"]
    assert (budget.configured_tokens, budget.max_context_tokens) == (32768, 4096)
    assert level > 0  # the fixed part compacted to fit a quarter of 4096, not of 32768
    assert all(r["max_tokens"] <= 1024 for r in loop_requests(llm))  # the reply cap: a quarter of 4096
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "bumblebot.cognition.budget"]
    assert len(warnings) == 1 and "cognition.max_context_tokens is 32768" in warnings[0] and "4096" in warnings[0]
    assert llm.context_refused == []


async def test_a_learned_window_sizes_compaction_without_a_restart(tmp_path, llm, tg):
    """Nothing configured; the server tells nothing (llama-cpp-python) and enforces 4096 tokens.
    A long chat: the first refusal teaches the window mid-run, and from then on compaction keeps
    the conversation under it, so the chat goes on with at most that one refused request."""
    llm.context_window, llm.tells_window, llm.context_error = 4096, None, "openai"
    llm.default = chatty("Noted, the garden sounds lovely.")
    config = write_config(tmp_path, llm, tg)
    async with running(config) as d:
        for i in range(14):
            tg.push_text(f"Part {i} of my garden story: " + "the roses climb the old stone wall by the pond. " * 12,
                         chat_id=42)
            await d.engine.wait_for_turns(i + 1, timeout=30)
        budget = d.runner.budget
    assert budget.max_context_tokens == 4096
    assert tg.sent(42) == ["Noted, the garden sounds lovely."] * 14
    assert len(llm.context_refused) <= 2
    assert any("You compact the history" in str(r["messages"]) for r in llm.requests)


# -- a long paste on a small window ---------------------------------------------------------------


def paste_27kb() -> str:
    return "\n".join(f"line {i:04d}: " + "the quick brown fox jumps over the lazy dog, again and again. " for i in range(370))


@pytest.mark.parametrize("tells", ["props", None])
async def test_a_27kb_paste_in_a_new_conversation_on_a_4096_token_server_is_kept_as_a_file_and_answered(
    tmp_path, llm, tg, tells
):
    """No window configured. Told at start (llama.cpp), the paste is kept as a file before any
    request; told nowhere (llama-cpp-python), the first refusal teaches the window and the paste
    is kept as a file then. Either way the user gets an answer, never "too long even after
    compacting" (nothing was compacted)."""
    paste = paste_27kb()
    assert 27_000 <= len(paste) <= 28_500
    llm.context_window, llm.tells_window, llm.context_error = 4096, tells, "openai"

    def model(request: dict[str, Any]) -> Any:
        if is_aux(request):
            return text("DONE: the reply is adequate")
        return say("I saved your text and read its start.")

    llm.default = model
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text(paste, chat_id=43)
        await d.engine.wait_for_turns(1, timeout=30)
    assert tg.sent(43) == ["I saved your text and read its start."]
    kept = list((tmp_path / "data" / "workspace" / "inbox" / "telegram_43").glob("message-*.txt"))
    assert len(kept) == 1 and kept[0].read_text() == paste
    answered = [r for r in loop_requests(llm) if r not in llm.context_refused]
    user = next(m["content"] for m in answered[0]["messages"] if m["role"] == "user")
    assert f'read_file("inbox/telegram_43/{kept[0].name}")' in user and "line 0369" not in user
    # the refusal that taught it; the loop's compacting retry, which could not help, is not sent
    assert len(llm.context_refused) == (0 if tells else 1)


async def test_a_paste_on_a_server_refusing_required_and_telling_no_window_costs_one_refusal_of_forcing(tmp_path, tg):
    """llama-cpp-python refuses a forced request with a bare 500 before it looks at the prompt's
    length; the same request with "auto" is then refused as too long. That "auto" got further
    counts: the fallback is remembered at once, so the step asked again with the paste kept as
    a file goes straight to "auto" (three 500s there before)."""
    async with FakeOpenAI(reject_tool_choice_required=500, tool_choice_refusal="", context_window=4096,
                          tells_window=None, context_error="openai") as llm:
        judges_say_done(llm)
        llm.default = lambda r: text("DONE: the reply is adequate") if is_aux(r) else say("Saved; I read its start.")
        async with running(write_config(tmp_path, llm, tg, delivery={"streaming": "on"})) as d:
            tg.push_text(paste_27kb(), chat_id=46)
            await d.engine.wait_for_turns(1, timeout=30)
    assert tg.sent(46) == ["Saved; I read its start."]
    assert len(llm.rejected) == 2  # one forced request: streamed, then whole
    assert len(llm.context_refused) == 1  # the refusal that taught the window (no compacting retry)


async def test_a_message_too_long_for_an_uncompacted_conversation_is_not_called_compacted(tmp_path, llm, tg):
    """A new conversation whose one message cannot be kept as a file (the fixed part alone
    nearly fills a tiny window): the note speaks of the message, not of compacting."""
    llm.context_window, llm.tells_window = 1024, None
    judges_say_done(llm)
    async with running(write_config(tmp_path, llm, tg)) as d:
        d.runner.preparer.media = None  # nothing can be kept as a file
        tg.push_text("tell me about " + "the history of rivers and bridges " * 200, chat_id=44)
        await d.engine.wait_for_turns(1, timeout=30)
    assert tg.sent(44) == [TOO_LONG_MESSAGE]
    assert TOO_LONG not in tg.sent(44)


async def test_the_first_turn_on_a_server_refusing_required_with_500_makes_at_most_2_refused_requests(tmp_path, tg):
    """llama-cpp-python answers tool_choice "required" with a bare HTTP 500. With the client's
    own retries (llm.max_retries: 2) that made 9 refused requests before the fallback; now the
    refused request is not retried, the same request with "auto" answers, and the fallback is
    used from the next request on. Streamed as turns are by default."""
    async with FakeOpenAI(reject_tool_choice_required=500, tool_choice_refusal="") as llm:
        judges_say_done(llm)
        llm.push(say("first", end=False), when=is_loop)
        llm.push(tool_calls(("end_turn", {})), when=is_loop)
        llm.push(say("second"), when=is_loop)
        config = write_config(tmp_path, llm, tg, llm={"max_retries": 2}, delivery={"streaming": "on"})
        async with running(config) as d:
            tg.push_text("hi", chat_id=45)
            await d.engine.wait_for_turns(1, timeout=30)
            refused_first_turn = [r for r in llm.request_log if r.status == 500]
            tg.push_text("and again", chat_id=45)
            await d.engine.wait_for_turns(2, timeout=30)
    assert tg.sent(45) == ["first", "second"]
    assert 1 <= len(refused_first_turn) <= 2
    assert len([r for r in llm.request_log if r.status == 500]) == len(refused_first_turn)  # none after
    assert all(r["tool_choice"] == "auto" for r in loop_requests(llm)[-2:])


async def test_a_fallback_with_a_smaller_window_answers_long_conversations_while_the_primary_is_down(tmp_path, tg):
    """The primary tells 16384, the fallback (the same model, started with a 4096 context) 4096:
    requests are sized for the smallest window of any endpoint that may answer them. Sized for
    the primary's, every long turn the fallback took ended "too long even after compacting"."""
    part = "the roses climb the old stone wall by the pond. " * 40
    async with FakeOpenAI(context_window=16384) as primary, FakeOpenAI(context_window=4096) as spare:
        primary.default, spare.default = chatty("Noted (primary)."), chatty("Noted (spare).")
        config = write_config(tmp_path, primary, tg, llm={"fallbacks": [{"base_url": spare.base_url, "model": "test-model"}]})
        async with running(config) as d:
            for i in range(12):
                if i == 6:
                    primary.fail_completions(503, "down")
                tg.push_text(f"Part {i}: {part}", chat_id=42)
                await d.engine.wait_for_turns(i + 1, timeout=60)
            assert d.runner.budget.max_context_tokens == 4096
    assert tg.sent(42) == ["Noted (primary)."] * 6 + ["Noted (spare)."] * 6
    assert spare.context_refused == []


def test_a_fallbacks_assumed_window_never_shrinks_the_primarys_and_a_fallbacks_said_one_is_named():
    """The failing input: an Ollama fallback whose 4096 was only assumed (Ollama's default)
    sized every request to an OpenAI primary for 4096, with an info line in the log."""
    primary = Windows(CapabilityMemory(), "http://primary/v1", None, time.time)
    fallback = Windows(CapabilityMemory(), "http://fallback/v1", None, time.time)
    primary._known["big"] = LearnedWindow(131_072, "/v1/models")
    fallback._known["small"] = LearnedWindow(4096, "Ollama's default num_ctx", assumed=True)
    windows = WindowSet([(primary, ["big"]), (fallback, ["small"])])
    assert windows.smallest() == ("big", primary._known["big"], False)
    fallback._known["small"] = LearnedWindow(8192, "/props")
    assert windows.smallest() == ("small at http://fallback/v1", fallback._known["small"], True)
