"""Every model request bounded by its budget (bumblebot/llm/pace.py): a stream cut past it, a
whole request at its learned deadline, the speeds measured and remembered, the models seen
writing past ``max_tokens``. Real openai client against the fake endpoint on 127.0.0.1, real
SQLite files for the daemon's runs."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from conftest import running, write_config
from fakes.openai_server import FakeOpenAI, is_loop, text
from support import is_adequacy_judge, judges_say_done, loop_requests, say

from bumblebot.core.settings import FallbackSettings, LLMSettings
from bumblebot.store import Store
from bumblebot.llm import LLM, CapabilityMemory, build_endpoints
from bumblebot.llm import pace as pace_module
from bumblebot.llm.overruns import MAX_STRING_CHARS, OVERRUN_RETRY_S, Overruns, bounded_tools, overran, overrun_key
from bumblebot.llm.pace import Cut, Pace, Speed, TokenCount, prompt_size, speed_key

SAY = {
    "type": "function",
    "function": {
        "name": "say", "description": "Say something.",
        "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
    },
}
RAMBLE = "and then the cat sat down again " * 40  # 1,280 characters: about 320 tokens


def llm_for(server: FakeOpenAI, memory: CapabilityMemory | None = None) -> LLM:
    return LLM(LLMSettings(model="test-model", max_retries=0, timeout_s=10), base_url=server.base_url,
               api_key="sk-test", capabilities=memory or CapabilityMemory())


# -- the parts -------------------------------------------------------------------------------------


def test_only_a_model_seen_overrunning_gets_a_deadline_from_its_speed():
    speed = Speed(writing=50.0, reading=500.0, samples=10, writing_measured=True)
    expected = 1000 / 500.0 + 512 / 50.0  # 12.24 s to read the prompt and write the whole budget
    assert speed.expected_s(1000, 512) == pytest.approx(expected)
    assert speed.deadline(1000, 512) is None  # llm.timeout_s bounds it: a hang is an outage
    tight = Speed(writing=50.0, reading=500.0, samples=10, overruns=True)
    assert tight.deadline(1000, 512) == pytest.approx(pace_module.FLOOR_S + pace_module.SLACK * expected)
    assert "not measured yet" in Speed().describe() and "50 tokens/s writing" in speed.describe()
    # answers too short to time (a fast endpoint, check's 64 tokens): the assumed speed is said so
    assert "writing not timed yet" in Speed(reading=2868.0, samples=1).describe()


def test_a_stream_is_past_its_budget_when_both_its_chunks_and_its_text_are():
    count = TokenCount(budget=8)  # past it: more than 8 x 1.25 + 16 = 26 tokens by either count
    assert not any(count.add("word") for _ in range(26))  # a server whose count differs a little
    assert count.add("word")  # the 27th token of 4 characters is past it
    # a server sending a token in several chunks is cut by neither count early
    chars = TokenCount(budget=8)
    assert not any(chars.add("a") for _ in range(107))
    assert chars.add("a")  # 108 characters: 27 tokens by the estimate
    # nor one writing long tokens (a line of dashes is a token or two, not 4 characters each)
    dashes = TokenCount(budget=8)
    assert not any(dashes.add("-" * 64) for _ in range(26))


def test_writing_past_the_budget_is_told_from_counts_that_differ_a_little():
    assert not overran(530, 512, estimated=False)  # a server and its tokenizer differ a little
    assert overran(1670, 512, estimated=False)  # llama-cpp-python inside a tool call's arguments
    assert not overran(900, 512, estimated=True)  # the estimate is rough: only double counts
    assert overran(1100, 512, estimated=True)


def test_bounded_tools_put_the_budget_on_each_free_string_argument():
    tools = [SAY, {"type": "function", "function": {"name": "pick", "parameters": {"type": "object", "properties": {
        "colour": {"type": "string", "enum": ["red", "blue"]},
        "notes": {"type": "array", "items": {"type": "string"}},
        "size": {"type": "integer"},
        "short": {"type": "string", "maxLength": 10},
    }}}}]
    bounded = bounded_tools(tools, 100)
    assert bounded[0]["function"]["parameters"]["properties"]["text"] == {"type": "string", "maxLength": 100}
    props = bounded[1]["function"]["parameters"]["properties"]
    assert "maxLength" not in props["colour"] and props["short"]["maxLength"] == 10
    assert props["notes"]["items"]["maxLength"] == 100 and props["size"] == {"type": "integer"}
    assert "maxLength" not in SAY["function"]["parameters"]["properties"]["text"]  # the schemas given stay as they were
    # one bound for every budget from 500 tokens up: turns of either budget send the same schemas,
    # and none a grammar parser refuses (llama-cpp-python's server died of a maxLength of 1,024)
    assert bounded_tools(tools, 512) == bounded_tools(tools, 2048)
    # a character a token: SmolLM2-135M ran away with 816 random characters in 770 tokens
    # under the bound of 800 characters, on a budget of 512 tokens
    assert bounded_tools(tools, 512)[0]["function"]["parameters"]["properties"]["text"]["maxLength"] == 500


def test_the_prompt_size_counts_text_calls_and_images_without_making_json():
    messages = [
        {"role": "system", "content": "x" * 400},
        {"role": "user", "content": [{"type": "text", "text": "y" * 40}, {"type": "image_url", "image_url": {"url": "data:…"}}]},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "say", "arguments": "z" * 80}}]},
    ]
    assert prompt_size(messages) == (400 + 40 + 4000 + 80) // 4


async def test_speeds_are_the_fastest_writing_and_the_slow_quarter_of_reading_and_are_remembered():
    saved: dict[str, str] = {}

    async def load(key: str) -> str | None:
        return saved.get(key)

    async def save(key: str, value: str) -> None:
        saved[key] = value

    memory = CapabilityMemory(load, save)
    pace = Pace(memory, "http://x/v1")
    # whole answers: writing is a lower bound (tokens over the whole time); reading too
    for written, seconds in ((20, 10.0), (400, 10.0), (30, 1.0)):
        bound = await pace.bound("m", [{"role": "user", "content": "p" * 4000}], 512, "tools")
        bound.started, bound.ended = 100.0, 100.0 + seconds
        await pace.observe("m", written, bound, streamed=False)
    speed = await pace.speed("m", "tools")
    assert speed.writing == pytest.approx(40.0)  # 400 tokens in 10 s: short answers do not slow it
    assert speed.reading == pytest.approx(100.0)  # the slow quarter: 1,000 prompt tokens in 10 s
    assert speed.samples == 3
    assert (await pace.speed("m", "text")).samples == 0  # requests without tools are measured apart
    # the first sample was saved at once; a new process reads it back
    assert json.loads(saved[speed_key("http://x/v1", "m", "tools")])["writing"]
    again = Pace(CapabilityMemory(load, save), "http://x/v1")
    assert (await again.speed("m", "tools")).samples >= 1


async def test_writing_too_short_to_time_teaches_no_speed():
    memory = CapabilityMemory()
    pace = Pace(memory, "e")
    # a proxy that buffers a stream and sends it at once; an answer served from a cache
    bound = await pace.bound("m", [{"role": "user", "content": "p" * 2000}], 256, "text")
    bound.started, bound.first, bound.ended = 10.0, 11.0, 11.01
    await pace.observe("m", 300, bound, streamed=True)
    bound.started, bound.ended = 10.0, 10.05
    await pace.observe("m", 300, bound, streamed=False)
    assert (await pace.speed("m")).writing == pace_module.DEFAULT_WRITING


async def test_tool_requests_read_at_the_speed_measured_without_tools_until_they_measure_their_own():
    memory = CapabilityMemory()
    pace = Pace(memory, "e")
    bound = await pace.bound("m", [{"role": "user", "content": "p" * 4000}], 64, "text")
    bound.started, bound.ended = 10.0, 12.0  # bumblebot check's request: 1,000 prompt tokens in 2 s
    await pace.observe("m", 10, bound, streamed=False)
    assert (await pace.speed("m", "tools")).reading == pytest.approx(500.0)  # not the assumed 50
    tools = await pace.bound("m", [{"role": "user", "content": "p" * 4000}], 64, "tools")
    tools.started, tools.ended = 10.0, 20.0  # with tools: 1,000 in 10 s, its own from now on
    await pace.observe("m", 10, tools, streamed=False)
    assert (await pace.speed("m", "tools")).reading == pytest.approx(100.0)


async def test_a_stream_measures_reading_until_its_first_token_and_writing_after_it():
    memory = CapabilityMemory()
    pace = Pace(memory, "e")
    bound = await pace.bound("m", [{"role": "user", "content": "p" * 2000}], 256, "text")
    bound.started, bound.first, bound.ended = 10.0, 11.0, 13.0
    await pace.observe("m", 201, bound, streamed=True)
    speed = await pace.speed("m")
    assert speed.reading == pytest.approx(500.0) and speed.writing == pytest.approx(100.0)


async def test_an_overrun_is_remembered_for_a_week_then_trusted_again():
    memory = CapabilityMemory()
    now = [1000.0]
    overruns = Overruns(memory, "e", clock=lambda: now[0])
    assert not await overruns.seen("m")
    await overruns.saw("m", "wrote 1670 tokens with max_tokens 512")
    assert await overruns.seen("m") and "1670" in (await overruns.reason("m") or "")
    assert json.loads(await memory.get(overrun_key("e", "m")) or "{}")["since"] == 1000.0
    now[0] += OVERRUN_RETRY_S
    assert not await overruns.seen("m") and await memory.get(overrun_key("e", "m")) is None


def test_a_cut_says_what_it_was_cut_by():
    by_tokens = Cut("tokens", 64, 1.234, written=65)
    assert by_tokens.as_dict() == {"by": "tokens", "budget": 64, "elapsed_s": 1.23, "written": 65}
    at_deadline = Cut("deadline", 512, 31.0, deadline_s=30.96, writing=48.04)
    assert at_deadline.as_dict() == {"by": "deadline", "budget": 512, "elapsed_s": 31.0, "deadline_s": 30.96,
                                     "writing": 48.0}
    assert "30.96" not in at_deadline.describe() and "31.0 s deadline" in at_deadline.describe()


# -- through the client --------------------------------------------------------------------------


async def test_a_stream_writing_tool_arguments_past_the_budget_is_cut_and_the_server_stops():
    async with FakeOpenAI(tokens_per_s=4000) as server:
        reply = say(RAMBLE, end=False)
        reply.stream_chars = 4  # a token a chunk, as llama.cpp streams
        server.push(reply)
        llm = llm_for(server)
        heard: list[str] = []
        completion = await llm.complete(
            [{"role": "user", "content": "tell me about the cat"}], max_tokens=64, tools=[SAY],
            on_say=lambda index, part: heard.append(part),
        )
        await server.stream_abandoned.wait()  # the connection was closed: the server stopped there
        assert completion.finish_reason == "length" and completion.hit_length
        # past it: more than 64 x 1.25 + 16 = 96 tokens, by the chunks and by the text
        assert completion.cut is not None and completion.cut.by == "tokens" and completion.cut.written == 97
        assert completion.tool_calls[0].name == "say"
        assert len(completion.tool_calls[0].arguments) == 97 * 4  # what came until the cut
        assert "".join(heard) and RAMBLE.startswith("".join(heard))
        assert completion.usage is not None and completion.usage.completion == 97
        # the model is remembered as one that writes past its budget: its tool requests now carry
        # the budget as each string argument's maxLength, for a server with a grammar to enforce
        assert await llm.overruns.seen("test-model")
        server.push(say("short", end=False))
        await llm.complete([{"role": "user", "content": "again"}], max_tokens=64, tools=[SAY])
        sent = server.requests[-1]["tools"][0]["function"]["parameters"]["properties"]["text"]
        assert sent["maxLength"] == 64  # a character a token
        await llm.aclose()


async def test_a_stream_that_stops_at_its_budget_is_never_cut():
    async with FakeOpenAI() as server:
        budget = len(json.dumps({"text": "word " * 16})) // 4  # every chunk of it is one token
        reply = say("word " * 16, end=False, usage={"completion_tokens": budget})
        reply.stream_chars = 4
        server.push(reply)
        llm = llm_for(server)
        completion = await llm.complete([{"role": "user", "content": "hi"}], max_tokens=budget, tools=[SAY],
                                        on_say=lambda index, part: None)
        assert completion.cut is None and completion.finish_reason == "tool_calls"
        assert not await llm.overruns.seen("test-model") and server.streams_abandoned == 0
        await llm.aclose()


async def test_reasoning_past_the_budget_is_not_taken_for_an_overrun():
    async with FakeOpenAI() as server:
        llm = llm_for(server)
        # reported reasoning is left out: some servers do not count it against max_tokens
        server.push(text("fine", usage={"completion_tokens": 900, "completion_tokens_details": {"reasoning_tokens": 880}}))
        await llm.complete([{"role": "user", "content": "think first"}], max_tokens=64)
        # a request that asked for thinking says nothing of overruns, whatever it reports
        server.push(text("fine", usage={"completion_tokens": 900}))
        await llm.complete([{"role": "user", "content": "think hard"}], max_tokens=64, thinking=True)
        assert "reasoning_effort" in server.requests[-1]
        assert not await llm.overruns.seen("test-model")
        server.push(text("fine", usage={"completion_tokens": 900}))  # the same answer, not asked to think
        await llm.complete([{"role": "user", "content": "plain"}], max_tokens=64)
        assert await llm.overruns.seen("test-model")
        await llm.aclose()


async def test_a_whole_answer_four_times_its_budget_ends_at_the_learned_deadline(monkeypatch):
    monkeypatch.setattr(pace_module, "FLOOR_S", 0.1)  # the floor for a connection: none needed on 127.0.0.1
    budget = 40
    async with FakeOpenAI(tokens_per_s=100) as server:
        four_times = "x" * (budget * 4 * 4)  # a server that ignores max_tokens: 4x the budget, 1.6 s at its pace
        llm = llm_for(server)
        server.push(text(four_times))
        started = time.monotonic()
        first = await llm.complete([{"role": "user", "content": "hi"}], max_tokens=budget)
        assert first.cut is None and time.monotonic() - started >= 1.6  # a trusted endpoint: not cut yet
        assert await llm.overruns.seen("test-model")  # its usage showed 160 tokens for a budget of 40
        speed = await llm.pace.speed("test-model", overruns=True)
        assert 80 <= speed.writing <= 100  # learned from that answer
        server.push(text(four_times))
        started = time.monotonic()
        cut = await llm.complete([{"role": "user", "content": "hi again"}], max_tokens=budget)
        elapsed = time.monotonic() - started
        assert cut.finish_reason == "length" and cut.content == "" and cut.cut is not None
        assert cut.cut.by == "deadline" and cut.cut.writing == pytest.approx(speed.writing)
        # at the budget: the deadline (the floor and 1.5 x the prompt and 40 tokens at ~90 tokens/s)
        assert cut.cut.deadline_s < 1.2 and elapsed < 1.4 and cut.cut.elapsed_s == pytest.approx(cut.cut.deadline_s, abs=0.1)
        assert cut.usage is not None and cut.usage.completion == budget and cut.usage.estimated
        await llm.aclose()


async def test_a_fast_endpoint_that_honours_max_tokens_is_never_cut():
    async with FakeOpenAI(tokens_per_s=800) as server:
        llm = llm_for(server)
        for n in range(5):
            server.push(text("word " * 400))  # 500 tokens at 800 tokens/s, within a budget of 600
            completion = await llm.complete([{"role": "user", "content": f"question {n} " * 40}], max_tokens=600)
            assert completion.cut is None
        assert not await llm.overruns.seen("test-model")
        speed = await llm.pace.speed("test-model")
        assert speed.samples == 5 and 600 <= speed.writing <= 800
        assert speed.deadline(10, 600) is None  # it never wrote past its budget: no deadline of ours
        await llm.aclose()


async def seed(llm: LLM, writing: float, reading: float = 100000.0, model: str = "test-model") -> None:
    """What an earlier run measured of ``model`` (both kinds of request)."""
    for kind in ("text", "tools"):
        await llm.capabilities.set(speed_key(llm.memory_key, model, kind),
                                   json.dumps({"reading": [reading], "writing": [writing]}))


async def test_an_honest_stream_of_two_chunks_a_token_is_never_cut():
    async with FakeOpenAI() as server:
        budget = len(json.dumps({"text": "word " * 16})) // 4  # 23 tokens of 4 characters
        reply = say("word " * 16, end=False, usage={"completion_tokens": budget})
        reply.stream_chars = 2  # each token in two chunks
        server.push(reply)
        llm = llm_for(server)
        completion = await llm.complete([{"role": "user", "content": "hi"}], max_tokens=budget, tools=[SAY],
                                        on_say=lambda index, part: None)
        assert completion.cut is None and not await llm.overruns.seen("test-model")
        await llm.aclose()


async def test_a_hung_endpoint_times_out_and_fails_over_rather_than_being_cut():
    release = asyncio.Event()

    async def hang(body: dict) -> object:
        await release.wait()
        return text("too late")

    async with FakeOpenAI() as primary, FakeOpenAI(models=("big-fallback",)) as fallback:
        settings = LLMSettings(model="test-model", max_retries=0, timeout_s=2,
                               fallbacks=[FallbackSettings(base_url=fallback.base_url, model="big-fallback")])
        endpoints = build_endpoints(settings, base_url=primary.base_url, api_key="sk", key_of=lambda name: None)
        await seed(endpoints.primary, writing=200.0)  # a fast hosted endpoint, measured: its deadline < 2 s
        primary.push(hang)
        fallback.default = lambda body: text("answered by the fallback")
        try:
            answer = await endpoints.complete([{"role": "user", "content": "hello"}], max_tokens=64)
        finally:
            release.set()
            await endpoints.aclose()
        # a model never seen overrunning has no deadline of ours: a timeout, and the fallback answers
        assert answer.content == "answered by the fallback" and answer.cut is None


async def test_honest_requests_queued_at_a_one_slot_server_are_not_cut(monkeypatch):
    monkeypatch.setattr(pace_module, "FLOOR_S", 0.1)
    budget = 40
    slot = asyncio.Lock()

    async def one_at_a_time(body: dict) -> object:
        async with slot:  # llama.cpp --parallel 1, Ollama with one slot: the server queues
            await asyncio.sleep(0.2)  # writes its whole budget at 200 tokens/s, and stops there
            return text("w" * 10, usage={"completion_tokens": budget})

    async with FakeOpenAI() as server:
        llm = llm_for(server)
        await seed(llm, writing=200.0)  # a model seen overrunning once: tight deadlines of 0.4 s
        await llm.overruns.saw("test-model", "earlier")
        server.default = one_at_a_time
        answers = await asyncio.gather(*(
            llm.complete([{"role": "user", "content": f"q{n}"}], max_tokens=budget) for n in range(6)))
        await llm.aclose()
        # each request in flight ahead of one stretches its deadline: none is cut
        assert [a.cut for a in answers if a.cut is not None] == []


async def test_a_small_request_queued_behind_a_big_one_at_a_one_slot_server_is_not_cut(monkeypatch):
    monkeypatch.setattr(pace_module, "FLOOR_S", 0.1)
    slot = asyncio.Lock()

    async def one_at_a_time(body: dict) -> object:
        budget = body["max_tokens"]
        async with slot:  # writes its whole budget at 1,000 tokens/s, one request at a time
            await asyncio.sleep(budget / 1000)
        return text("w" * 10, usage={"completion_tokens": budget})

    async with FakeOpenAI() as server:
        llm = llm_for(server)
        await seed(llm, writing=1000.0)
        await llm.overruns.saw("test-model", "earlier")  # tight deadlines
        server.default = one_at_a_time
        big = asyncio.ensure_future(llm.complete([{"role": "user", "content": "a long step"}], max_tokens=1000))
        while llm.pace.flight.count < 1:
            await asyncio.sleep(0)
        # a judge's 20 tokens wait a second behind the step's 1,000: its own deadline is 0.13 s
        small = await llm.complete([{"role": "user", "content": "judge it"}], max_tokens=20)
        assert small.cut is None and (await big).cut is None
        assert llm.pace.flight.count == 0 and llm.pace.flight.ahead_s == 0.0
        await llm.aclose()


async def test_a_deadline_past_the_timeout_ends_the_request_as_a_cut_sent_once(monkeypatch):
    monkeypatch.setattr(pace_module, "FLOOR_S", 0.1)
    async with FakeOpenAI(tokens_per_s=100) as server:
        llm = LLM(LLMSettings(model="test-model", max_retries=1, timeout_s=1), base_url=server.base_url,
                  api_key="sk-test", capabilities=CapabilityMemory())
        await seed(llm, writing=100.0)
        await llm.overruns.saw("test-model", "earlier")
        server.push(text("x" * 1600))  # 400 tokens for a budget of 100: 4 s at 100 tokens/s
        cut = await llm.complete([{"role": "user", "content": "hi"}], max_tokens=100)
        # the deadline (0.1 + 1.5 x 1 s) ends it, not the 1 s timeout (an outage); and the client did
        # not send the runaway again to a server still writing the first
        assert cut.cut is not None and cut.cut.by == "deadline" and cut.cut.deadline_s > 1
        assert len(server.requests) == 1
        await llm.aclose()


async def test_a_thinking_stream_teaches_no_writing_speed():
    async with FakeOpenAI(tokens_per_s=100) as server:
        reply = text("an answer after thinking " * 4, usage={"completion_tokens": 400,
                                                         "completion_tokens_details": {"reasoning_tokens": 300}})
        server.push(reply)
        llm = llm_for(server)
        await llm.complete([{"role": "user", "content": "think " * 100}], max_tokens=512, on_say=lambda i, t: None)
        speed = await llm.pace.speed("test-model")
        # 400 tokens over the answer's time alone would be a pace no server has
        assert speed.samples == 1 and not speed.writing_measured
        await llm.aclose()


async def test_a_stream_whose_close_fails_keeps_no_place_in_flight(monkeypatch):
    import openai

    async with FakeOpenAI() as server:
        server.push(text("hello there"))
        llm = llm_for(server)

        async def broken_close(self: object) -> None:
            raise RuntimeError("reset while closing")

        monkeypatch.setattr(openai.AsyncStream, "close", broken_close)
        with pytest.raises(RuntimeError):
            await llm.complete([{"role": "user", "content": "hi"}], max_tokens=64, on_say=lambda i, t: None)
        assert llm.pace.flight.count == 0
        await llm.aclose()


def test_bounded_tools_keep_every_string_under_what_llama_cpp_python_survives():
    from tools.registry import Registry
    from tools.sending import SENDING_TOOLS

    [send_file] = Registry(SENDING_TOOLS).schemas()
    # a grammar repeating a character 1,024 times kills llama-cpp-python 0.3.36's server
    assert send_file["function"]["parameters"]["properties"]["caption"]["maxLength"] <= 1000
    [bounded] = bounded_tools([send_file], 512)
    assert bounded["function"]["parameters"]["properties"]["caption"]["maxLength"] == MAX_STRING_CHARS
    optional = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "maybe": {"type": ["string", "null"]}, "either": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    }}}}
    props = bounded_tools([optional], 16)[0]["function"]["parameters"]["properties"]
    assert props["maybe"]["maxLength"] == 16 and props["either"]["anyOf"][0]["maxLength"] == 16


# -- a turn --------------------------------------------------------------------------------------


def ramble_then_answer(llm: FakeOpenAI, *, stream_chars: int = 6) -> None:
    """A model whose first step writes past any small budget in a say, then answers briefly."""
    judges_say_done(llm)
    first = say(RAMBLE * 2, end=False)
    first.stream_chars = stream_chars
    llm.push(first, when=is_loop)
    llm.push(say("Short answer: the cat sat."), when=is_loop)


async def test_a_turn_whose_stream_runs_past_the_budget_goes_on_and_answers(tmp_path, tg):
    async with FakeOpenAI(tokens_per_s=4000) as llm:
        ramble_then_answer(llm, stream_chars=4)
        config = write_config(tmp_path, llm, tg, delivery={"streaming": "on", "stream_edit_interval_s": 0.2},
                              cognition={"classifier": False, "debounce_s": 0, "reflex_max_tokens": 48,
                                         "deliberate_max_tokens": 96})
        async with running(config) as d:
            tg.push_text("tell me about the cat", chat_id=2701)
            await d.engine.wait_for_turns(1)
            trace = (await d.store.recent_turns())[0]["trace"]
        # the cut say's preview is taken back, as after any cut call: one message, the answer
        assert tg.shown(2701) == ["Short answer: the cat sat."]
        first, second = trace["steps"][:2]
        assert first["finish_reason"] == "length" and first["cut"]["by"] == "tokens" and first["cut"]["budget"] == 48
        assert not first["escalated"]  # not asked again with a larger budget: this server would only run longer
        assert second["cut"] is None
        requests = loop_requests(llm)
        assert len(requests) == 2 and requests[1]["max_tokens"] == 48
        assert llm.streams_abandoned == 1


async def test_a_turn_whose_whole_step_outlasts_its_deadline_goes_on_and_answers(tmp_path, tg, monkeypatch, capsys):
    from bumblebot.app.cli import main

    monkeypatch.setattr(pace_module, "FLOOR_S", 0.2)
    async with FakeOpenAI(tokens_per_s=400) as llm:
        config = write_config(tmp_path, llm, tg, cognition={"classifier": False, "debounce_s": 0,
                                                            "reflex_max_tokens": 48, "deliberate_max_tokens": 96})
        # what an earlier run learned: this model writes past its budget, at about 400 tokens/s
        (tmp_path / "data").mkdir()
        async with Store(tmp_path / "data" / "bumblebot.db") as store:
            await store.set_kv(overrun_key(llm.base_url, "reflex-model"),
                               json.dumps({"reason": "earlier", "since": time.time()}))
            for kind in ("tools", "text"):
                await store.set_kv(speed_key(llm.base_url, "reflex-model", kind),
                                   json.dumps({"reading": [5000.0], "writing": [400.0]}))
        ramble_then_answer(llm)
        llm.push(text(RAMBLE * 2), when=is_adequacy_judge)  # the completion check rambles too
        async with running(config) as d:
            tg.push_text("tell me about the cat", chat_id=2702)
            await d.engine.wait_for_turns(1)
            trace = (await d.store.recent_turns())[0]["trace"]
        assert tg.shown(2702) == ["Short answer: the cat sat."]
        first = trace["steps"][0]
        assert first["finish_reason"] == "length" and first["cut"]["by"] == "deadline"
        assert first["cut"]["budget"] == 48 and first["cut"]["writing"] == 400.0
        assert first["cut"]["elapsed_s"] < 2.0  # the ramble takes about 5 s at 400 tokens/s
        loop = loop_requests(llm)
        # each string argument carried the budget as its maxLength
        say_tool = next(t for t in loop[0]["tools"] if t["function"]["name"] == "say")
        assert say_tool["function"]["parameters"]["properties"]["text"]["maxLength"] == 48
        # the judge was bounded the same way: cut at its deadline, shown with its verdict
        [verdict] = [v for v in trace["gate"] if v.get("judge") == "adequacy"]
        assert verdict["usage"]["cuts"][0]["by"] == "deadline"
        assert await asyncio.to_thread(main, ["--config", str(config), "trace", "--chat", "telegram:2702"]) == 0
        out = capsys.readouterr().out
        assert "step 1: finish=length" in out and "cut=deadline" in out and "budget 48 tokens at 400.0 tokens/s" in out
