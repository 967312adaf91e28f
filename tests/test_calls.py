"""A step's tool calls (bumblebot/cognition/calls.py): arguments fitted into what can be recorded, run and sent."""

from __future__ import annotations

import json

from conftest import running, write_config
from fakes.openai_server import Reply, is_loop, tool_calls
from support import db, judges_say_done, loop_requests, say, tool_result, tool_results


def _call(name: str, arguments: str, *, end: bool = False) -> Reply:
    calls = [{"id": "call_nan", "type": "function", "function": {"name": name, "arguments": arguments}}]
    if end:
        calls.append({"id": "call_end", "type": "function", "function": {"name": "end_turn", "arguments": "{}"}})
    return Reply(message={"role": "assistant", "content": None, "tool_calls": calls}, finish_reason="tool_calls")


# -- arguments that are not a JSON object ------------------------------------------------------


async def test_tool_call_arguments_with_nan_are_stored_as_valid_json_and_the_model_told(tmp_path, llm, tg):
    """The failing input: ``{"text": NaN}`` reads as an object in Python but is not JSON; stored
    as it was, a strict endpoint (vLLM) refused every later request of the conversation."""
    judges_say_done(llm)
    llm.push(_call("say", '{"text": NaN}'), when=is_loop)
    llm.push(say("Sorry, here it is."), when=is_loop)
    llm.push(say("Still here."), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as daemon:
        tg.push_text("hi there", chat_id=164)
        await daemon.engine.wait_for_turns(1)
        tg.push_text("and again", chat_id=164)
        await daemon.engine.wait_for_turns(2)
    assert tg.sent(164) == ["Sorry, here it is.", "Still here."]
    assert llm.violations == []  # no request was refused
    second = loop_requests(llm)[1]
    [told] = tool_result(second, "say")[:1]
    assert "NaN is not a JSON value" in told["error"]  # the model is told why
    for (calls,) in db(tmp_path).execute("SELECT tool_calls FROM messages WHERE tool_calls IS NOT NULL"):
        for call in json.loads(calls):
            json.loads(call["function"]["arguments"], parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))


async def test_garbage_arguments_are_not_run_and_never_stored(tmp_path, llm, tg):
    """Regression (real SmolLM2 run): a server that ignored max_tokens returned a say of ~1,900
    tokens of broken JSON; it stayed in the transcript, and the next step was over the window.
    Strict endpoints (vLLM) also refuse every later request of a history with such arguments."""
    judges_say_done(llm)
    garbage = '{"text": "' + "la " * 3000  # cut off mid-string: not JSON
    llm.push(Reply(message={"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_bad", "type": "function", "function": {"name": "say", "arguments": garbage}},
        {"id": "call_list", "type": "function", "function": {"name": "list_directory", "arguments": "[1, 2]"}},
    ]}, finish_reason="tool_calls"), when=is_loop)
    llm.push(say("Here is the real answer."), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("tell me something", chat_id=91)
        await d.engine.wait_for_turns(1)
    assert tg.sent(91) == ["Here is the real answer."]
    second = loop_requests(llm)[1]
    [bad_say] = tool_result(second, "say")[:1]
    assert "not valid JSON" in bad_say["error"] and "la la" in bad_say["error"]
    assert "a JSON list, not an object" in tool_result(second, "list_directory")[0]["error"]
    assert "la " * 40 not in json.dumps(second["messages"])  # the quote in the error is 80 characters
    import sqlite3

    stored = sqlite3.connect(tmp_path / "data" / "bumblebot.db").execute(
        "SELECT tool_calls FROM messages WHERE tool_calls IS NOT NULL").fetchall()
    for (calls,) in stored:
        for call in json.loads(calls):
            assert isinstance(json.loads(call["function"]["arguments"]), dict)


async def test_a_say_with_a_line_break_written_raw_is_delivered_and_stored_escaped(tmp_path, llm, tg):
    """SmolLM2-135M on llama-cpp-python wrote line breaks raw inside a say's text: "Invalid
    control character", the say not run, and the model saying it again at a minute a step."""
    judges_say_done(llm)
    raw = '{ "text": "Hello, I am Bob!\nHow are you?"}'  # a real line break inside the JSON string
    llm.push(Reply(message={"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_raw", "type": "function", "function": {"name": "say", "arguments": raw}},
        {"id": "call_end", "type": "function", "function": {"name": "end_turn", "arguments": "{}"}},
    ]}, finish_reason="tool_calls"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("how are you today?", chat_id=92)
        await d.engine.wait_for_turns(1)
    assert tg.sent(92) == ["Hello, I am Bob!\nHow are you?"]
    [(calls,)] = db(tmp_path).execute("SELECT tool_calls FROM messages WHERE tool_calls IS NOT NULL").fetchall()
    assert json.loads(json.loads(calls)[0]["function"]["arguments"]) == {"text": "Hello, I am Bob!\nHow are you?"}


# -- reasoning and lone surrogates in a say ----------------------------------------------------


async def test_reasoning_inside_say_arguments_is_never_delivered(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(say("<think>the user is annoying, humor them</think>Sure, happy to help!"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)):
        tg.push_text("help?", chat_id=10)
        await tg.wait_for("sendMessage")
    assert tg.sent(10) == ["Sure, happy to help!"]


async def test_reasoning_inside_say_is_never_stored(tmp_path, llm, tg):
    import sqlite3

    judges_say_done(llm)
    llm.push(tool_calls(("say", {"text": "<think>the user is Ada, secret plan</think>Hello!"}), ("end_turn", {})),
             when=is_loop)
    llm.push(tool_calls(("say", {"text": "The user wants X.</think>Here you go!"}), ("end_turn", {})), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("hello there friend", chat_id=83)
        await d.engine.wait_for_turns(1)
        tg.push_text("give me X", chat_id=83)
        await d.engine.wait_for_turns(2)
    assert tg.sent(83) == ["Hello!", "Here you go!"]
    stored = json.dumps(sqlite3.connect(tmp_path / "data" / "bumblebot.db").execute(
        "SELECT content, tool_calls FROM messages").fetchall())
    assert "secret plan" not in stored and "The user wants X" not in stored


async def test_a_say_whose_text_holds_a_lone_surrogate_after_reasoning_is_cut_does_not_poison_the_chat(tmp_path, llm, tg):
    """The failing input: {"text": "<think>x</think>hi \\ud800 there"}. Cutting the reasoning once
    re-wrote the arguments with a raw lone surrogate, and the outbox insert failed, and every later
    request too; the surrogate reaches the chat as U+FFFD, and the next turn (after a restart) is fine."""
    judges_say_done(llm)
    llm.push(_call("say", '{"text": "<think>x</think>hi \\ud800 there"}', end=True), when=is_loop)
    llm.push(say("Next turn is fine."), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as daemon:
        tg.push_text("hi there", chat_id=183)
        await daemon.engine.wait_for_turns(1, timeout=15)
    async with running(write_config(tmp_path, llm, tg)) as daemon:  # and after a restart
        tg.push_text("after a restart", chat_id=183)
        await daemon.engine.wait_for_turns(1, timeout=15)
    assert tg.sent(183) == ["hi \ufffd there", "Next turn is fine."]
    assert llm.violations == []


async def test_a_work_call_whose_arguments_hold_a_lone_surrogate_runs_with_u_fffd(tmp_path, llm, tg):
    """``{"content": "a\\ud800b"}``: the file write failed on the surrogate (UTF-8 has none),
    and the arguments kept it for every later request of the turn."""
    judges_say_done(llm)
    llm.push(_call("write_file", '{"path": "odd.txt", "content": "a\\ud800b"}'), when=is_loop)
    llm.push(say("written"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as daemon:
        tg.push_text("please write the odd character into a file called odd.txt", chat_id=184)
        await daemon.engine.wait_for_turns(1)
    assert (tmp_path / "data" / "workspace" / "odd.txt").read_text() == "a\ufffdb"
    [result] = tool_results(loop_requests(llm)[1])
    assert result == "wrote 5 bytes to odd.txt" and tg.sent(184) == ["written"] and not llm.violations


# -- a say is never cut off by the tool timeout ------------------------------------------------


async def test_a_rate_limited_say_outlasting_the_tool_timeout_is_not_cut_off(tmp_path, llm, tg):
    """Regression: the tool timeout cancelled a say waiting out a 429; the row stayed pending
    for the sweeper while the model, told it failed, said it again (delivered twice)."""
    from fakes.telegram_server import retry_after_body

    judges_say_done(llm)
    llm.push(tool_calls(("say", {"text": "Part two."})), when=is_loop)
    llm.push(say("Part two."), when=is_loop)  # what a model does when told the say failed
    tg.fail_next("sendMessage", 429, retry_after_body(2))
    config = write_config(tmp_path, llm, tg, cognition={"classifier": False, "tool_timeout_s": 1})
    async with running(config) as d:
        tg.push_text("Explain in detail, step by step, how the build pipeline in the repo works.", chat_id=27)  # deliberate: a reflex turn ends at its first say
        await d.engine.wait_for_turns(1, timeout=20)
        pending = await d.store.outbox_pending()
    result = [m["content"] for m in loop_requests(llm)[1]["messages"] if m["role"] == "tool"][0]
    assert '"delivered": true' in result
    assert pending == []
    assert [t for t in tg.sent(27)] == ["Part two.", "Part two."]  # the 429'd attempt + one delivery
    assert len([c for c in tg.calls if c.method == "sendMessage"]) == 2
