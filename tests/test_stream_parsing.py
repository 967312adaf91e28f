"""Reading a say's text out of streamed argument fragments (bumblebot/llm/streaming.py), and the
LLM client's streaming and its fallbacks, through the real openai client against the fake."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from collections.abc import AsyncIterator

import pytest
from fakes.openai_server import FakeOpenAI, Reply, text, tool_calls

from bumblebot.core.errors import ModelTimeout, ModelUnavailable
from bumblebot.core.settings import LLMSettings
from bumblebot.llm import LLM, CapabilityMemory
from bumblebot.llm.streaming import JsonStringField

SAY = [{"type": "function", "function": {"name": "say", "parameters": {"type": "object", "properties": {}}}}]

DOCUMENTS = [
    {"text": 'hello "world" ünïcode 😀 \\ / \n\ttab \u2028'},
    {"other": {"text": "nested, not this"}, "text": "this one"},
    {"a": [1, {"text": "in a list"}], "b": "x:y,z", "text": "after others"},
    {"texts": "similar key", "text": "exact key"},
    {"text": ""},
]


@pytest.mark.parametrize("document", DOCUMENTS)
@pytest.mark.parametrize("ascii_only", [True, False])
def test_the_field_is_decoded_whatever_the_fragment_boundaries(document, ascii_only):
    raw = json.dumps(document, ensure_ascii=ascii_only)
    rng = random.Random(7)
    for _ in range(40):
        reader, i = JsonStringField("text"), 0
        added = []
        while i < len(raw):
            n = rng.randint(1, 6)
            added.append(reader.feed(raw[i : i + n]))
            i += n
        assert reader.value == document["text"] and reader.complete
        # each fragment reports only what it added: the pieces make the value, in order
        assert "".join(added) == document["text"]


@pytest.mark.parametrize("raw", ['{"text": 5}', '{"other": "x"}', '["text", "x"]', "garbage", '{"text": "cut'])
def test_no_text_or_a_cut_value_gives_what_is_there(raw):
    reader = JsonStringField("text")
    reader.feed(raw)
    assert reader.value == ("cut" if raw.endswith('"cut') else "")


def test_reading_is_linear_in_the_input():
    reader = JsonStringField("text")
    reader.feed('{"text": "')
    for _ in range(20000):
        reader.feed("ab\\n")
    assert len(reader.value) == 60000


@contextlib.asynccontextmanager
async def llm_for(fake: FakeOpenAI, **settings) -> AsyncIterator[LLM]:
    llm = LLM(LLMSettings(model="m", max_retries=0, **settings), base_url=fake.base_url, api_key="k", capabilities=CapabilityMemory())
    try:
        yield llm
    finally:
        await llm.aclose()


async def test_say_text_is_reported_as_it_grows_and_the_completion_is_the_same():
    async with FakeOpenAI() as fake:
        words = "one two three four five six seven eight nine ten"
        fake.push(tool_calls(("think", {"thought": "x"}), ("say", {"text": words}), ("end_turn", {})))
        async with llm_for(fake) as llm:
            heard: list[tuple[int, str]] = []
            completion = await llm.complete([{"role": "user", "content": "hi"}], max_tokens=64, tools=SAY, on_say=lambda i, t: heard.append((i, t)))
            assert completion.streamed and fake.streamed == 1
            assert [c.name for c in completion.tool_calls] == ["think", "say", "end_turn"]
            assert json.loads(completion.tool_calls[1].arguments) == {"text": words}
            assert {i for i, _ in heard} == {1} and "".join(t for _, t in heard) == words and len(heard) > 3
            assert completion.tool_calls[1].index == 1
            assert completion.prompt_tokens is not None  # the usage chunk was read


@pytest.mark.parametrize("mode", ["repeat_args", "text_calls"])
async def test_an_endpoint_that_garbles_streamed_tool_calls_gets_whole_requests(mode):
    async with FakeOpenAI() as fake:
        good = {"text": "a sound answer"}

        def answer(request):
            reply = tool_calls(("say", good))
            reply.stream_mode = mode
            return reply

        fake.default = answer
        async with llm_for(fake) as llm:
            first = await llm.complete([{"role": "user", "content": "hi"}], max_tokens=64, tools=SAY, on_say=lambda i, t: None)
            assert json.loads(first.tool_calls[0].arguments) == good and not first.streamed
            assert "broken" in (await llm.stream_fallback() or "")
            second = await llm.complete([{"role": "user", "content": "hi"}], max_tokens=64, tools=SAY, on_say=lambda i, t: None)
            assert json.loads(second.tool_calls[0].arguments) == good
            assert [bool(r.get("stream")) for r in fake.requests] == [True, False, False]


async def test_a_model_that_writes_broken_calls_does_not_turn_streaming_off():
    async with FakeOpenAI() as fake:
        broken = Reply(message={"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "say", "arguments": '{"text": "cut'}}]})
        fake.default = lambda request: broken
        async with llm_for(fake) as llm:
            for _ in range(5):
                completion = await llm.complete([{"role": "user", "content": "hi"}], max_tokens=64, tools=SAY, on_say=lambda i, t: None)
                assert completion.tool_calls[0].arguments == '{"text": "cut'
            assert await llm.stream_fallback() is None
            # three checks with a whole request found the same mess; then no more are paid for
            assert sum(1 for r in fake.requests if not r.get("stream")) == 3
            assert sum(1 for r in fake.requests if r.get("stream")) == 5


async def test_a_stream_that_breaks_off_is_an_outage():
    async with FakeOpenAI() as fake:
        reply = tool_calls(("say", {"text": "this will not arrive in full"}))
        reply.stream_cut_after = 4
        fake.push(reply)
        async with llm_for(fake) as llm:
            with pytest.raises(ModelUnavailable):
                await llm.complete([{"role": "user", "content": "hi"}], max_tokens=64, tools=SAY, on_say=lambda i, t: None)


async def test_requests_in_flight_are_capped_by_max_concurrent_requests():
    async with FakeOpenAI() as fake:
        in_flight = peak = 0
        release = asyncio.Event()
        arrived = asyncio.Condition()

        async def slow(request):
            nonlocal in_flight, peak
            in_flight += 1
            peak = max(peak, in_flight)
            async with arrived:
                arrived.notify_all()
            await release.wait()
            in_flight -= 1
            return text("ok")

        fake.default = slow
        async with llm_for(fake, max_concurrent_requests=3) as llm:
            calls = [asyncio.create_task(llm.text([{"role": "user", "content": "hi"}], max_tokens=4, temperature=0)) for _ in range(8)]
            async with arrived:
                await asyncio.wait_for(arrived.wait_for(lambda: in_flight == 3), 5)
            await fake.wait_for_requests(3)
            assert len(fake.requests) == 3  # the other five wait for a slot, not at the server
            release.set()
            assert await asyncio.gather(*calls) == ["ok"] * 8
            assert peak == 3


# -- regressions, each with its failing input ------------------------------------------------


async def test_a_stream_dropped_after_its_headers_is_answered_whole_and_remembered_after_three():
    """llama-cpp-python's server sends its headers, then drops a stream it cannot serve; the
    openai client reports that as a connection error while reading. Each turn is answered with
    a whole request, and after three in a row the endpoint gets whole requests only."""
    async with FakeOpenAI() as fake:
        def answer(request):
            reply = tool_calls(("say", {"text": "answered whole"}))
            reply.stream_cut_after = 0
            return reply

        fake.default = answer
        async with llm_for(fake) as llm:
            for attempt in range(1, 5):
                completion = await llm.complete([{"role": "user", "content": "hi"}], max_tokens=64, tools=SAY, on_say=lambda i, t: None)
                assert json.loads(completion.tool_calls[0].arguments) == {"text": "answered whole"}
                remembered = await llm.stream_fallback()
                assert (remembered is not None) == (attempt >= 3), attempt
        assert [bool(r.get("stream")) for r in fake.requests] == [True, False] * 3 + [False]


async def test_a_slow_first_byte_is_a_timeout_not_an_endpoint_that_cannot_stream():
    async with FakeOpenAI() as fake:
        fake.default = lambda request: Reply(message={"role": "assistant", "content": "late"}, delay=1.5)
        async with llm_for(fake, timeout_s=0.5) as llm:
            with pytest.raises(ModelTimeout):
                await llm.complete([{"role": "user", "content": "hi"}], max_tokens=8, tools=SAY, on_say=lambda i, t: None)
            assert await llm.stream_fallback() is None
        assert all(r.get("stream") for r in fake.requests)  # never sent again whole


async def test_one_passing_502_on_a_stream_does_not_turn_streaming_off():
    from fakes.openai_server import error

    async with FakeOpenAI() as fake:
        fake.push(error(502, "bad gateway"), when=lambda r: bool(r.get("stream")))
        fake.default = lambda request: tool_calls(("say", {"text": "fine"}))
        async with llm_for(fake) as llm:
            first = await llm.complete([{"role": "user", "content": "hi"}], max_tokens=8, tools=SAY, on_say=lambda i, t: None)
            second = await llm.complete([{"role": "user", "content": "hi"}], max_tokens=8, tools=SAY, on_say=lambda i, t: None)
            assert first.tool_calls and second.streamed
            assert await llm.stream_fallback() is None


async def test_an_endpoint_like_llama_cpp_python_gets_answers_from_the_first_request():
    """The real llama-cpp-python server (chatml-function-calling): a streamed request with
    tool_choice "required" ends after its headers with no data, a whole one fails with a bare 500, and
    a streamed "auto" one comes back empty; only whole "auto" requests work. Every call must
    still come back with the model's tool call (a real-model run answered nothing at all)."""
    from fakes.openai_server import error

    async with FakeOpenAI() as fake:
        def answer(request):
            reply = tool_calls(("say", {"text": "hello from the small model"}))
            if request.get("tool_choice") == "required":
                if not request.get("stream"):
                    return error(500, "")
                reply.stream_empty_body = True
            elif request.get("stream"):
                reply.stream_mode = "empty"
            return reply

        fake.default = answer
        async with llm_for(fake) as llm:
            for _ in range(4):
                completion = await llm.complete([{"role": "user", "content": "hi"}], max_tokens=64, tools=SAY, on_say=lambda i, t: None)
                assert json.loads(completion.tool_calls[0].arguments) == {"text": "hello from the small model"}
            assert await llm.stream_fallback() is not None
        # once learned, each request is one whole request (forcing is left to its own 3 strikes)
        assert not fake.requests[-1].get("stream")


async def test_an_endpoint_that_streams_empty_answers_gets_whole_requests_after_three():
    """One empty sample (a stream of only reasoning, an unlucky
    draw) must not turn streaming off for a day; an endpoint that streams every call as
    nothing (llama-cpp-python) is switched to whole requests after three in a row."""
    async with FakeOpenAI() as fake:
        def answer(request):
            reply = tool_calls(("say", {"text": "a sound answer"}))
            reply.stream_mode = "empty"
            return reply

        fake.default = answer
        async with llm_for(fake) as llm:
            for attempt in range(1, 5):
                completion = await llm.complete([{"role": "user", "content": "hi"}], max_tokens=64, tools=SAY, on_say=lambda i, t: None)
                assert json.loads(completion.tool_calls[0].arguments) == {"text": "a sound answer"}
                assert (await llm.stream_fallback() is not None) == (attempt >= 3), attempt
        assert [bool(r.get("stream")) for r in fake.requests] == [True, False] * 3 + [False]


async def test_a_dropped_stream_whose_whole_request_fails_too_is_no_strike():
    """An outage (streams dropped, whole requests answered 503) is not remembered as "cannot
    stream" (it once was, after three calls)."""
    from fakes.openai_server import error

    async with FakeOpenAI() as fake:
        def answer(request):
            if not request.get("stream"):
                return error(503, "overloaded")
            reply = text("never")
            reply.stream_empty_body = True
            return reply

        fake.default = answer
        async with llm_for(fake) as llm:
            for _ in range(4):
                with pytest.raises(ModelUnavailable):
                    await llm.complete([{"role": "user", "content": "hi"}], max_tokens=8, tools=SAY, on_say=lambda i, t: None)
            assert await llm.stream_fallback() is None


async def test_a_dropped_stream_whose_whole_request_gets_a_500_is_a_strike():
    """The real llama-cpp-python server answers a whole forced request with a bare 500 and
    drops the streamed one: that endpoint is up, and after three it gets whole requests."""
    from fakes.openai_server import error

    async with FakeOpenAI() as fake:
        def answer(request):
            if not request.get("stream"):
                return error(500, "")
            reply = text("never")
            reply.stream_empty_body = True
            return reply

        fake.default = answer
        async with llm_for(fake) as llm:
            for _ in range(3):
                with pytest.raises(ModelUnavailable):
                    await llm.complete([{"role": "user", "content": "hi"}], max_tokens=8, on_say=lambda i, t: None)
            assert await llm.stream_fallback() is not None
