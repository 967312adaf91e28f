"""What a model request used, as the model client reads it from the endpoint's answer (whole or
streamed; cached and reasoning tokens), asks for it (``stream_options``, dropped for an endpoint
that refuses it) and records it through the ledger into the ``usage`` table; transcriptions too.
Real openai client against the fake endpoint on 127.0.0.1, real SQLite."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from fakes.openai_server import FakeOpenAI, Reply, text, tool_calls

from bumblebot.core.errors import MediaError, SpendingLimitReached
from bumblebot.core.settings import LLMSettings, VoiceSettings
from bumblebot.core.usage import scoped
from bumblebot.llm import LLM, CapabilityMemory
from bumblebot.llm.capabilities import stream_usage_key
from bumblebot.llm.speech import Speech
from bumblebot.runtime.ledger import Ledger
from bumblebot.store import Store

SAY = [{"type": "function", "function": {"name": "say", "parameters": {"type": "object", "properties": {}}}}]
HI = [{"role": "user", "content": "hi there"}]
DETAILS = {"prompt_tokens": 1200, "completion_tokens": 90,
           "prompt_tokens_details": {"cached_tokens": 1024}, "completion_tokens_details": {"reasoning_tokens": 40}}
COLUMNS = ("conversation, sender, kind, background, model, requests, prompt_tokens, cached_tokens,"
           " completion_tokens, reasoning_tokens, estimated, audio_seconds, cost, priced")


@contextlib.asynccontextmanager
async def metered(tmp_path: Path, fake: FakeOpenAI, **prices: Any) -> AsyncIterator[tuple[LLM, Store]]:
    """An LLM client whose meter is a real ledger over a real store (capabilities in its kv)."""
    async with Store(tmp_path / "bumblebot.db") as store:
        settings = LLMSettings(model="m", max_retries=0, prices=prices)
        llm = LLM(
            settings, base_url=fake.base_url, api_key="k", meter=Ledger(store, settings.prices),
            capabilities=CapabilityMemory(store.get_kv, store.set_kv, store.delete_kv),
        )
        try:
            yield llm, store
        finally:
            await llm.aclose()


async def rows(store: Store) -> list[dict[str, Any]]:
    found = await store._all(f"SELECT {COLUMNS} FROM usage ORDER BY kind, model")
    return [dict(zip([c.strip() for c in COLUMNS.split(",")], row, strict=True)) for row in found]


async def test_a_whole_answer_records_its_prompt_cached_completion_and_reasoning_tokens(tmp_path):
    async with FakeOpenAI() as fake, metered(tmp_path, fake) as (llm, store):
        fake.push(text("hello", usage=DETAILS))
        with scoped(conversation="telegram:5", sender="55", kind="turn"):
            completion = await llm.complete(HI, max_tokens=64)
        [row] = await rows(store)
    assert (completion.cached_tokens, completion.reasoning_tokens) == (1024, 40)
    assert completion.usage is not None and completion.usage.cached == 1024 and not completion.usage.estimated
    assert row["conversation"] == "telegram:5" and row["sender"] == "55" and row["kind"] == "turn"
    assert (row["prompt_tokens"], row["cached_tokens"], row["completion_tokens"], row["reasoning_tokens"]) == (1200, 1024, 90, 40)
    assert (row["requests"], row["estimated"], row["priced"], row["cost"]) == (1, 0, 0, 0.0)  # no price: counted, not priced


async def test_a_streamed_answer_asks_for_usage_and_records_it(tmp_path):
    async with FakeOpenAI() as fake, metered(tmp_path, fake) as (llm, store):
        fake.push(tool_calls(("say", {"text": "streamed words"}), usage=DETAILS))
        heard: list[str] = []
        completion = await llm.complete(HI, max_tokens=64, tools=SAY, on_say=lambda i, t: heard.append(t))
        [row] = await rows(store)
    assert completion.streamed and "".join(heard) == "streamed words"
    assert fake.requests[0]["stream_options"] == {"include_usage": True}
    assert (completion.prompt_tokens, completion.cached_tokens, completion.reasoning_tokens) == (1200, 1024, 40)
    assert (row["prompt_tokens"], row["cached_tokens"], row["completion_tokens"], row["reasoning_tokens"]) == (1200, 1024, 90, 40)
    assert row["estimated"] == 0 and row["kind"] == "other" and row["conversation"] == ""  # no scope set: nobody's


async def test_an_endpoint_that_reports_no_usage_gets_an_estimate_marked_as_one(tmp_path):
    async with FakeOpenAI() as fake, metered(tmp_path, fake) as (llm, store):
        reply = text("an answer of a few words")
        reply.report_usage = False
        fake.push(reply)
        completion = await llm.complete([{"role": "user", "content": "x" * 400}], max_tokens=64)
        [row] = await rows(store)
    assert completion.prompt_tokens is None and completion.usage is not None and completion.usage.estimated
    assert row["estimated"] == 1 and row["requests"] == 1
    assert row["prompt_tokens"] >= 100 and row["completion_tokens"] > 0  # 400 characters of prompt, ~4 per token
    assert row["cached_tokens"] == 0 and row["reasoning_tokens"] == 0


async def test_an_endpoint_refusing_stream_options_is_asked_again_without_it_and_that_is_remembered(tmp_path):
    async with FakeOpenAI(reject_stream_options=400) as fake:
        fake.push(tool_calls(("say", {"text": "first"})))
        fake.push(tool_calls(("say", {"text": "second"})))
        async with metered(tmp_path, fake) as (llm, store):
            first = await llm.complete(HI, max_tokens=64, tools=SAY, on_say=lambda i, t: None)
            remembered = await store.get_kv(stream_usage_key(fake.base_url))
        async with metered(tmp_path, fake) as (llm, store):  # a restart: the lesson is in the store
            second = await llm.complete(HI, max_tokens=64, tools=SAY, on_say=lambda i, t: None)
            assert not await llm.streams_usage() and await llm.streams()
            [row] = await rows(store)
    assert [c.arguments for c in first.tool_calls + second.tool_calls] == ['{"text": "first"}', '{"text": "second"}']
    assert first.streamed and second.streamed  # streaming itself was never given up
    assert len(fake.rejected) == 1 and len(fake.requests) == 3  # refused once, answered, then asked plainly at once
    assert ["stream_options" in r for r in fake.requests] == [True, False, False]
    assert "stream_options" in json.loads(remembered)["reason"]
    # without the ask the stream carries no usage: both requests are counted at the estimate
    assert (row["requests"], row["estimated"]) == (2, 2)


async def test_a_price_table_gives_each_request_its_cost(tmp_path):
    prices = {"m": {"input": 2.0, "cached_input": 0.5, "output": 8.0}}
    async with FakeOpenAI() as fake, metered(tmp_path, fake, **prices) as (llm, store):
        fake.push(text("priced", usage=DETAILS))
        fake.push(text("priced again", usage=DETAILS))
        first = await llm.complete(HI, max_tokens=64)
        await llm.complete(HI, max_tokens=64)
        fake.push(text("unpriced", usage=DETAILS))
        other = await llm.complete(HI, model="other-model", max_tokens=64)
        priced, unpriced = await rows(store)
    each = ((1200 - 1024) * 2.0 + 1024 * 0.5 + 90 * 8.0) / 1_000_000
    assert first.cost is not None and abs(first.cost - each) < 1e-12
    assert (priced["model"], priced["requests"], priced["priced"]) == ("m", 2, 2)
    assert abs(priced["cost"] - 2 * each) < 1e-12
    assert other.cost is None and (unpriced["model"], unpriced["priced"], unpriced["cost"]) == ("other-model", 0, 0.0)


async def test_transcriptions_record_the_seconds_or_tokens_the_endpoint_reports_else_the_length_given(tmp_path):
    async with FakeOpenAI() as fake, Store(tmp_path / "bumblebot.db") as store:
        settings = LLMSettings(prices={"whisper-1": {"audio_minute": 0.006}})
        speech = Speech(settings, VoiceSettings(), base_url=fake.base_url, api_key="k",
                        meter=Ledger(store, settings.prices))
        try:
            with scoped(conversation="telegram:9", sender="99", kind="turn"):
                fake.transcript_usage = {"type": "duration", "seconds": 30}
                assert await speech.transcribe(b"OggS" + b"\0" * 50, name="v.ogg", mime="audio/ogg", seconds=31) == "fake transcript"
                fake.transcript_usage = {"type": "tokens", "input_tokens": 70, "output_tokens": 12, "total_tokens": 82}
                await speech.transcribe(b"OggS" + b"\0" * 50, name="v.ogg", mime="audio/ogg")
                fake.transcript_usage = None
                await speech.transcribe(b"OggS" + b"\0" * 50, name="v.ogg", mime="audio/ogg", seconds=60)
        finally:
            await speech.aclose()
        [row] = await rows(store)
    assert (row["conversation"], row["sender"], row["kind"], row["model"]) == ("telegram:9", "99", "transcription", "whisper-1")
    assert (row["requests"], row["prompt_tokens"], row["completion_tokens"], row["estimated"]) == (3, 70, 12, 1)
    assert row["audio_seconds"] == 90.0  # 30 reported, none with tokens, 60 as the platform gave
    # per minute where the length is known (30 s and 60 s); the token-counted one has no token price
    assert row["priced"] == 2 and abs(row["cost"] - 1.5 * 0.006) < 1e-12


IMAGE = [{"role": "user", "content": [
    {"type": "text", "text": "what is this?"},
    {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 400}},
]}]


async def test_an_answer_without_the_images_it_refused_records_the_usage_it_reported(tmp_path):
    """The endpoint refused the images and answered without them: what it reported is recorded
    (not an estimate); the answer is kept out of the token scale (its prompt is not the one
    estimated)."""
    async with FakeOpenAI() as fake, metered(tmp_path, fake) as (llm, store):
        fake.reject_images()
        fake.push(text("A cat, I guess.", usage={"prompt_tokens": 777, "completion_tokens": 5}))
        completion = await llm.complete(IMAGE, max_tokens=50)
        [row] = await rows(store)
    assert completion.usage is not None and not completion.usage.estimated
    assert (row["prompt_tokens"], row["completion_tokens"], row["estimated"]) == (777, 5, 0)
    assert completion.prompt_tokens == 777 and completion.sample_tokens is None


async def test_an_answer_that_read_the_image_as_text_records_the_usage_it_reported(tmp_path):
    """A server without a vision projector tokenizes a 30 KB data URL as text: 22,766 prompt
    tokens, billed as such; recorded so, and kept out of the token scale."""
    big = [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64," + "Q" * 30000}},
    ]}]
    async with FakeOpenAI() as fake, metered(tmp_path, fake) as (llm, store):
        fake.push(text("Looks like text soup.", usage={"prompt_tokens": 22766, "completion_tokens": 6}))
        completion = await llm.complete(big, max_tokens=50)
        [row] = await rows(store)
    assert (row["prompt_tokens"], row["completion_tokens"], row["estimated"]) == (22766, 6, 0)
    assert completion.sample_tokens is None


async def test_a_garbled_stream_asked_again_whole_records_both_answered_requests(tmp_path):
    broken = Reply(message={"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "say", "arguments": '{"text": "hi'}}]},
        finish_reason="tool_calls", usage={"prompt_tokens": 400, "completion_tokens": 9})
    async with FakeOpenAI() as fake, metered(tmp_path, fake) as (llm, store):
        fake.push(broken)
        fake.push(tool_calls(("say", {"text": "hi"}), usage={"prompt_tokens": 400, "completion_tokens": 8}))
        with scoped(conversation="telegram:5", sender="55", kind="turn"):
            completion = await llm.complete(HI, max_tokens=50, tools=SAY, on_say=lambda i, t: None)
        [row] = await rows(store)
        requests = len(fake.requests)
    assert completion.tool_calls[0].arguments == '{"text": "hi"}'
    assert requests == 2 and row["requests"] == 2 and row["sender"] == "55"
    assert (row["prompt_tokens"], row["completion_tokens"]) == (800, 17)


async def test_a_voice_reply_is_counted_as_speech_for_the_turn_it_answers(tmp_path):
    async with FakeOpenAI() as fake, Store(tmp_path / "bumblebot.db") as store:
        settings = LLMSettings(prices={"tts-1": {"input": 60.0, "output": 0.0}})
        speech = Speech(settings, VoiceSettings(), base_url=fake.base_url, api_key="k", meter=Ledger(store, settings.prices))
        try:
            with scoped(conversation="telegram:9", sender="99", kind="turn"):
                await speech.synthesize("Noted: **milk**, and eggs.", tmp_path / "v.ogg")
        finally:
            await speech.aclose()
        [row] = await rows(store)
    assert (row["conversation"], row["sender"], row["kind"], row["model"]) == ("telegram:9", "99", "speech", "tts-1")
    assert row["requests"] == 1 and row["prompt_tokens"] > 0 and row["estimated"] == 1
    assert row["priced"] == 1 and abs(row["cost"] - row["prompt_tokens"] * 60.0 / 1_000_000) < 1e-12


class Refusing:
    async def admit(self, scope: Any, model: str) -> None:
        raise SpendingLimitReached("your daily limit of 10 tokens", resets_at=time.time() + 5 * 3600 + 90)

    async def record(self, scope: Any, usage: Any) -> None:
        raise AssertionError("a refused request is not recorded")


async def test_a_refused_transcription_says_the_limit_and_when_it_resets_and_a_refused_voice_reply_is_not_made(tmp_path):
    async with FakeOpenAI() as fake:
        speech = Speech(LLMSettings(), VoiceSettings(), base_url=fake.base_url, api_key="k", meter=Refusing())
        try:
            with pytest.raises(MediaError) as heard:
                await speech.transcribe(b"OggS" + b"\0" * 50, name="v.ogg", mime="audio/ogg")
            with pytest.raises(MediaError) as spoken:
                await speech.synthesize("Noted.", tmp_path / "v.ogg")
        finally:
            await speech.aclose()
        assert fake.transcriptions == [] and fake.speech_requests == []
    assert str(heard.value) == "your daily limit of 10 tokens is reached; it resets at 00:00 UTC, in 5 h 1 min"
    assert not heard.value.retryable and not spoken.value.retryable and not (tmp_path / "v.ogg").exists()
