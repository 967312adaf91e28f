"""The model client (bumblebot/llm/client.py): what it learns about an endpoint, and what it must not
take for a lesson. Real openai client, fake endpoint on 127.0.0.1."""

from __future__ import annotations

import json

from conftest import running, write_config
from fakes.openai_server import FakeOpenAI, error, is_aux, is_loop, text
from support import judges_say_done, loop_requests, say

from bumblebot.llm import ForcingFallback
from bumblebot.llm.capabilities import tool_choice_key

#: A request the router sends deliberate (the "research" cue): such turns ask for thinking.
DELIBERATE = "help me research the history of the bicycle and compare the sources"
REFUSAL = "Unsupported parameter: 'reasoning_effort' is not supported with this model."


async def finished(d, n: int = 1) -> dict:
    await d.engine.wait_for_turns(n)
    return (await d.store.recent_turns())[0]["trace"]


# -- thinking ------------------------------------------------------------------------------------


async def test_deliberate_turns_ask_for_thinking_and_reflex_turns_do_not(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(say("Hi!"), when=is_loop)
    llm.push(say("Here is the plan."), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("hi", chat_id=315)
        await finished(d)
        tg.push_text(DELIBERATE, chat_id=315)
        await finished(d, 2)
    reflex, deliberate = loop_requests(llm)
    assert "reasoning_effort" not in reflex and deliberate["reasoning_effort"] == "medium"
    assert not [r for r in llm.requests if is_aux(r) and "reasoning_effort" in r]  # judges never think


async def test_an_endpoint_that_refuses_thinking_is_asked_without_it_and_that_is_remembered(tmp_path, tg):
    async with FakeOpenAI(reject_reasoning_effort=True) as llm:
        judges_say_done(llm)
        llm.push(say("Here is the plan."), when=is_loop)
        llm.push(say("And here is more."), when=is_loop)
        async with running(write_config(tmp_path, llm, tg)) as d:
            tg.push_text(DELIBERATE, chat_id=316)
            await finished(d)
        async with running(write_config(tmp_path, llm, tg)) as d:  # after a restart
            tg.push_text("now research the history of the tandem and compare it", chat_id=316)
            await finished(d)
            remembered = await d.store.get_kv(f"llm.thinking:{llm.base_url}|test-model")
            forcing = await d.store.get_kv(tool_choice_key(llm.base_url))
    assert tg.sent(316) == ["Here is the plan.", "And here is more."]
    # refused once: the error names reasoning_effort, so it is not taken for a refusal of
    # tool_choice "required" (that cost two more requests and a strike against forcing)
    assert len(llm.rejected) == 1 and ForcingFallback.parse(forcing) is None
    sent = [r for r in loop_requests(llm) if r not in llm.rejected]
    assert len(sent) == 2 and all("reasoning_effort" not in r for r in sent)
    assert "reasoning_effort" in json.loads(remembered)["reason"]


async def test_a_passing_400_is_not_remembered_as_a_refusal_to_think(tmp_path, llm, tg):
    """A 400 from an upstream proxy ("Provider returned error") that the same request without
    thinking survived turned thinking off for a day."""
    judges_say_done(llm)
    llm.push(error(400, "Provider returned error"), when=is_loop)
    llm.push(error(400, "Provider returned error"), when=is_loop)  # the tool_choice=auto retry
    llm.push(say("Here is the plan."), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text(DELIBERATE, chat_id=502)
        await finished(d)
        remembered = await d.store.get_kv(f"llm.thinking:{llm.base_url}|test-model")
    assert tg.sent(502) == ["Here is the plan."] and remembered is None


async def test_an_outage_on_the_retry_without_thinking_is_waited_out(tmp_path, llm, tg):
    """A 503 on the retry was reported as the 400 refusal: "My language model refused the request"."""
    judges_say_done(llm)
    llm.push(error(400, REFUSAL), when=lambda r: is_loop(r) and "reasoning_effort" in r)
    llm.push(error(400, REFUSAL), when=lambda r: is_loop(r) and "reasoning_effort" in r)
    llm.push(error(503, "overloaded"), when=is_loop)
    llm.push(say("Here is the plan."), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text(DELIBERATE, chat_id=503)
        await finished(d)
    assert tg.sent(503)[-1] == "Here is the plan."
    assert not any("refused the request" in t for t in tg.sent(503))


async def test_prose_mentioning_the_tool_call_tag_does_not_turn_streaming_off(tmp_path, llm, tg):
    """"<tool_call>" anywhere in a streamed answer was taken for a broken stream: a second,
    whole request was paid for and streaming was switched off for a day."""
    judges_say_done(llm)
    llm.push(text("In Hermes templates a call is wrapped in <tool_call> tags, like XML."),
             when=lambda r: is_loop(r) and r.get("stream"))
    config = write_config(tmp_path, llm, tg, delivery={"streaming": "on", "stream_edit_interval_s": 0.2})
    async with running(config) as d:
        tg.push_text("how does Hermes mark a tool call?", chat_id=504)
        await finished(d)
        remembered = await d.store.get_kv(f"llm.stream:{llm.base_url}")
    assert remembered is None and len(loop_requests(llm)) == 1
    assert tg.shown(504) == ["In Hermes templates a call is wrapped in <tool_call> tags, like XML."]


async def test_a_call_in_template_markup_inside_a_streamed_answer_is_a_broken_stream(tmp_path, tg):
    async with FakeOpenAI() as llm:
        judges_say_done(llm)
        garbled = say("Hi!")
        garbled.stream_mode = "text_calls"  # the server streams the calls as <tool_call> text
        llm.push(garbled, when=lambda r: is_loop(r) and r.get("stream"))
        llm.push(say("Hi!"), when=is_loop)
        config = write_config(tmp_path, llm, tg, delivery={"streaming": "on", "stream_edit_interval_s": 0.2})
        async with running(config) as d:
            tg.push_text("hello there", chat_id=505)
            await finished(d)
            remembered = await d.store.get_kv(f"llm.stream:{llm.base_url}")
    assert tg.shown(505) == ["Hi!"]
    assert "as text" in json.loads(remembered)["reason"]


async def test_a_streamed_request_refused_for_its_thinking_costs_one_extra_request(tmp_path, tg):
    """A streamed request refused because of ``reasoning_effort`` was sent again whole (the
    same refusal), then without thinking: the error names the parameter, so it is not about
    streaming either."""
    async with FakeOpenAI(reject_reasoning_effort=True) as llm:
        judges_say_done(llm)
        llm.push(say("Here is how."), when=is_loop)
        config = write_config(tmp_path, llm, tg, delivery={"streaming": "on"})
        async with running(config) as d:
            tg.push_text(DELIBERATE, chat_id=317)
            await finished(d)
            streams = await d.store.get_kv(f"llm.stream:{llm.base_url}")
    assert len(llm.rejected) == 1 and streams is None
    assert tg.sent(317) == ["Here is how."]
