"""Cognition that holds up with real models (issue 9): small windows, chatty and weak models,
long tool turns, reasoning, budget escalation.

End-to-end tests run the daemon in process with the real python-telegram-bot and openai
clients against the fakes; the fake endpoints here behave like the servers that bite: one
refuses any request over its window, one cuts replies at ``max_tokens``, one leaks reasoning.
"""

from __future__ import annotations

import json
from typing import Any

from conftest import running, write_config
from fakes.openai_server import Reply, error, is_aux, is_last_chance, is_loop, text, tool_calls
from support import contents, judges_say_done, loop_requests, say, tool_result

from bumblebot.cognition.state import LoopState
from bumblebot.core.messages import estimate_text_tokens, estimate_tools
from bumblebot.core.textrules import strip_reasoning
from bumblebot.core.toolkit import ToolKind


def window_fake(window: int, reply: Any) -> Any:
    """An endpoint with a ``window``-token context (our estimate of its request, prompt plus
    ``max_tokens``, as vLLM and llama.cpp count): bigger requests get the 400 a real server
    sends; the others get ``reply(request)``."""

    def endpoint(request: dict[str, Any]) -> Reply:
        prompt = len(json.dumps(request["messages"])) // 4 + len(json.dumps(request.get("tools", []))) // 4
        if prompt + int(request.get("max_tokens", 0)) > window:
            return error(400, f"This model's maximum context length is {window} tokens")
        return reply(request)

    return endpoint


def _last_user(request: dict[str, Any]) -> str:
    return [m["content"] for m in request["messages"] if m["role"] == "user"][-1]


# -- small windows ---------------------------------------------------------------------------


async def test_the_fixed_part_fits_a_quarter_of_a_4k_window(tmp_path, llm, tg):
    config = write_config(tmp_path, llm, tg, cognition={"classifier": False, "max_context_tokens": 4096})
    async with running(config) as d:
        _, prompt, schemas = d.runner.fixed_part()
        full = estimate_text_tokens(d.runner.prompts.system_prompt(0)) + estimate_tools(d.toolbox.schemas(0))
    fixed = estimate_text_tokens(prompt) + 10 + estimate_tools(schemas)
    assert fixed <= 4096 // 4 < full  # compacted, and it had to be
    names = {s["function"]["name"] for s in schemas}
    assert {"say", "end_turn", "read_file", "write_file", "remember"} <= names


async def test_ten_turns_at_a_4096_window_keep_going(tmp_path, llm, tg):
    """Issue 9: by the third message a 4k chat died of "too long"; here ten long turns go
    through compaction against a server that refuses anything over its window."""
    from bumblebot.cognition.compaction import SUMMARY_HEADINGS

    summary = "\n".join(f"## {h}\n- the user keeps asking to be told more about it" for h in SUMMARY_HEADINGS)

    def reply(request: dict[str, Any]) -> Reply:
        if is_aux(request):
            if "durable facts" in contents(request):
                return text("[]")
            if "You compact the history" in contents(request):
                return text(summary)
            return text("DONE: fine")
        return say("Here is a long answer. " + "words " * 90)

    llm.default = window_fake(4096, reply)
    config = write_config(tmp_path, llm, tg, cognition={"classifier": False, "max_context_tokens": 4096})
    async with running(config) as d:
        for i in range(10):
            tg.push_text(f"question {i}: " + "tell me more about it " * 40, chat_id=91)
            await d.engine.wait_for_turns(i + 1, timeout=20)
    refused = [r for r in llm.request_log if r.status == 400]
    assert refused == [], [(len(json.dumps(r.body["messages"])) // 4, r.body.get("max_tokens"), "tools" in r.body) for r in refused]
    sent = tg.sent(91)
    assert len(sent) == 10 and all(t.startswith("Here is a long answer") for t in sent)
    assert [r for r in llm.requests if "You compact the history" in contents(r)]  # it compacted


async def test_an_eight_step_tool_turn_fits_a_32k_window(tmp_path, llm, tg):
    """Issue 9: a turn reading eight 16,000-character documents overflowed a 32k window; the
    turn's own older tool results are cleared now, so every request fits. (Files and pages
    alternate: the same work tool in three steps in a row is refused by the repeat guard.)"""
    from aiohttp import web

    workspace = tmp_path / "data" / "workspace"
    workspace.mkdir(parents=True)
    for i in range(0, 8, 2):
        (workspace / f"f{i}.txt").write_text(f"file {i} line " * 1140)  # ~16,000 characters each
    app = web.Application()
    app.router.add_get("/p{n}", lambda r: web.Response(text=f"page {r.match_info['n']} text " * 1140))
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    site = f"http://127.0.0.1:{runner.addresses[0][1]}"
    steps = [tool_calls(("read_file", {"path": f"f{i}.txt"})) if i % 2 == 0
             else tool_calls(("fetch_url", {"url": f"{site}/p{i}"})) for i in range(8)]
    script = iter([*steps, say("read all eight")])
    llm.default = window_fake(32768, lambda r: next(script) if is_loop(r) else text("DONE: fine"))
    config = write_config(
        tmp_path, llm, tg, cognition={"classifier": False, "max_context_tokens": 32768},
        tools={"web": {"allow_private": True}},
    )
    async with running(config) as d:
        tg.push_text("read the eight files f0.txt to f7.txt and tell me about them", chat_id=92)
        await d.engine.wait_for_turns(1, timeout=30)
        trace = (await d.store.recent_turns())[0]["trace"]
    await runner.cleanup()
    assert [r.status for r in llm.request_log if r.status != 200] == []
    assert tg.sent(92) == ["read all eight"]
    assert any(c.get("in_turn") for c in trace["compactions"])  # its own results were cleared


# -- chatty and weak models ------------------------------------------------------------------


async def test_a_turn_sends_at_most_four_messages_and_the_model_is_told(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(say(*[f"message number {i}" for i in range(6)]), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("talk a lot", chat_id=93)
        await d.engine.wait_for_turns(1)
    assert tg.sent(93) == [f"message number {i}" for i in range(4)]
    [(results,)] = __import__("sqlite3").connect(tmp_path / "data" / "bumblebot.db").execute(
        "SELECT group_concat(content, '|') FROM messages WHERE role='tool' AND name='say'").fetchall()
    assert results.count('"dropped": true') == 2 and "end_turn" in results  # the model is told why


async def test_a_reworded_message_is_the_model_s_to_send(tmp_path, llm, tg):
    """Only an exact repeat is held back: a near-identical message may be a correction."""
    judges_say_done(llm)
    llm.push(tool_calls(("say", {"text": "Sure, I can help with that."})), when=is_loop)
    llm.push(say("Sure, I can help you with that!"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("can you help?", chat_id=94)
        await d.engine.wait_for_turns(1)
    assert tg.sent(94) == ["Sure, I can help with that.", "Sure, I can help you with that!"]


async def test_a_plain_final_text_that_repeats_a_say_exactly_is_not_sent_again(tmp_path, llm, tg):
    """An endpoint not forcing tools: the model's plain last word repeats what it said (case
    and spacing aside), so it is not sent twice; a different last word would be."""
    judges_say_done(llm)
    llm.push(tool_calls(("say", {"text": "Hey! I'm good, thanks"})), when=is_loop)
    llm.push(text("hey!  I'm good,\nthanks"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("how are you?", chat_id=95)
        await d.engine.wait_for_turns(1)
        trace = (await d.store.recent_turns())[0]["trace"]
    assert tg.sent(95) == ["Hey! I'm good, thanks"]
    assert [c["rule"] for c in trace["cuts"]] == ["exact_repeat"]


async def test_the_final_text_is_sent_when_say_only_carried_a_progress_note(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(tool_calls(("say", {"text": "One moment, let me think."})), when=is_loop)
    llm.push(text("The capital of Australia is Canberra."), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("capital of Australia?", chat_id=96)
        await d.engine.wait_for_turns(1)
    assert tg.sent(96) == ["One moment, let me think.", "The capital of Australia is Canberra."]


async def test_hollow_promises_end_with_an_honest_message(tmp_path, llm, tg):
    """Issue 9 defect 7: say("On it!") then two gate continues, then the gate failed open
    and the user got only the promise."""

    def judge(request: dict[str, Any]) -> Reply:
        if is_last_chance(request):
            return error(500, "no closing words from this model")
        if is_aux(request):
            return text("CONTINUE: the file was never written")
        return say("On it!")

    llm.default = judge
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("write hello.py that prints hi", chat_id=97)
        await d.engine.wait_for_turns(1)
        trace = (await d.store.recent_turns())[0]["trace"]
    sent = tg.sent(97)
    assert sent[0] == "On it!" and "didn't get that done" in sent[-1] and "never written" in sent[-1]
    assert len(sent) == 2 and (trace["stop_reason"], trace["stop_flags"]) == ("end_turn", ["unfinished"])
    assert trace["told"] == "note"


async def test_a_say_cut_by_the_reflex_budget_is_asked_again_with_the_deliberate_one(tmp_path, llm, tg):
    """Issue 9 defect 8: a say cut at the reflex budget failed as invalid JSON."""
    judges_say_done(llm)
    cut = Reply(message={"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "say", "arguments": '{"text": "Hi! So, abo'}}]},
        finish_reason="length")
    llm.push(cut, when=is_loop)
    llm.push(say("Hi! So, about that: here is the whole answer."), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("hi", chat_id=98)  # a greeting: reflex
        await d.engine.wait_for_turns(1)
    first, second = loop_requests(llm)[:2]
    assert first["max_tokens"] == 512 and second["max_tokens"] == 2048
    assert first["messages"] == second["messages"]  # the same request, nothing run in between
    assert tg.sent(98) == ["Hi! So, about that: here is the whole answer."]
    import sqlite3

    [(trace,)] = sqlite3.connect(tmp_path / "data" / "bumblebot.db").execute("SELECT trace FROM turns").fetchall()
    step = json.loads(trace)["steps"][0]
    assert step["escalated"] is True and step["finish_reason"] == "tool_calls"  # regression: traced before the retry


# -- repeat guard and reasoning ----------------------------------------------------------------


def _kind(name: str) -> ToolKind:
    return ToolKind.AGENCY if name in ("say", "think", "end_turn", "wait") else ToolKind.WORK


def test_the_same_work_tool_in_three_consecutive_steps_is_refused_from_the_third():
    """Spec, "Repeat guard"; issue 9 defect 4: [say("checking"), fetch_url(u)] repeated for ever."""
    from bumblebot.llm import ToolCall

    state = LoopState(_kind)
    step = lambda i: [ToolCall(f"s{i}", "say", '{"text": "checking"}'), ToolCall(f"f{i}", "fetch_url", '{"url": "u"}')]  # noqa: E731
    verdicts = [[allowed for call, allowed in state.plan(step(i)) if call.name == "fetch_url"][0] for i in range(4)]
    assert verdicts == [True, True, False, False]
    state.plan([ToolCall("r", "read_file", "{}")])  # another work tool breaks the streak
    assert state.plan([ToolCall("f9", "fetch_url", "{}")])[0][1]
    fan_out = state.plan([ToolCall(f"p{i}", "read_file", f'{{"path": "{i}"}}') for i in range(5)])
    assert all(allowed for _, allowed in fan_out)  # one step's fan-out is one decision


async def test_reasoning_before_a_lone_closing_tag_reaches_neither_user_nor_history(tmp_path, llm, tg):
    """Issue 9 defect 3: templates that pre-fill <think> return "…reasoning…</think>answer"."""
    import sqlite3

    judges_say_done(llm)
    llm.push(tool_calls(("say", {"text": "The user wants X.</think>Here you go!"}), ("end_turn", {}),
                        content="secret plan</think>"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("give me X", chat_id=99)
        await d.engine.wait_for_turns(1)
    assert tg.sent(99) == ["Here you go!"]
    stored = "\n".join(r[0] for r in sqlite3.connect(tmp_path / "data" / "bumblebot.db").execute(
        "SELECT content || coalesce(tool_calls, '') FROM messages"))
    assert "secret plan" not in stored
    assert strip_reasoning("thinking…</think>answer") == "answer"


async def test_group_routing_reads_the_words_not_the_speaker(tmp_path, llm, tg):
    """Issue 9 defect 9: "[Python Fan]: hey" was routed as code."""
    from bumblebot.core.events import ChatKind, ChatRef, Inbound, Platform
    from bumblebot.store import JournalEntry

    config = write_config(tmp_path, llm, tg, cognition={"classifier": True})
    async with running(config) as d:
        entry = JournalEntry(1, Inbound(ChatRef(Platform.DISCORD, "5"), "1", "7", "Python Fan", "hey", ChatKind.GROUP), "pending")
        state = await d.runner.preparer.start_state([entry])
    assert state.route == "reflex" and llm.requests == []  # no classifier call either


# -- memory privacy ------------------------------------------------------------------------------


async def test_a_fact_remembered_in_one_chat_never_reaches_another(tmp_path, llm, tg):
    """Issue 9 defect 10: facts remembered in one chat went into every conversation's prompt."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "knowledge.md").write_text("# Knowledge\n\n## Opening hours\nThe shop opens at 9.\n")
    judges_say_done(llm)

    def model(request: dict[str, Any]) -> Reply:
        if "please remember" in _last_user(request) and not tool_result(request, "remember"):
            return tool_calls(("remember", {"title": "Door", "body": "Ada's door code is 4711"}), ("say", {"text": "noted"}))
        return say("ok")

    llm.default = lambda r: model(r) if is_loop(r) else text("DONE: fine")
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("please remember: my door code is 4711", chat_id=101)
        await d.engine.wait_for_turns(1)
        tg.push_text("what is Ada's door code?", chat_id=202)
        tg.push_text("and the door code again?", chat_id=101)
        await d.engine.wait_for_turns(3)
    by_chat = {101: [], 202: []}
    for request in loop_requests(llm):
        for chat in by_chat:
            if f"id {chat})" in contents(request):
                by_chat[chat].append(contents(request))
    assert by_chat[202] and not any("4711" in c for c in by_chat[202])  # never seen elsewhere
    assert "Ada's door code is 4711" in by_chat[101][-1]  # the own chat knows it next turn
    assert all("The shop opens at 9." in c for c in by_chat[101] + by_chat[202])  # global: everywhere
    assert "4711" not in (tmp_path / "data" / "knowledge.md").read_text()


# -- garbage and overlong output ---------------------------------------------------------------


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


async def test_a_turn_that_fills_the_window_after_answering_says_it_stopped(tmp_path, llm, tg):
    """Regression (real SmolLM2 run): a turn that had answered, then kept going until the
    window was full, told the user "this conversation got too long, send /reset" after its
    answer. It stopped without the model ending it: the user is told so, and that the next
    message goes on."""
    from bumblebot.cognition.notes import CONTEXT_FULL_MESSAGE

    judges_say_done(llm)
    llm.push(tool_calls(("say", {"text": "Done: notes.txt has your list."})), when=is_loop)
    llm.push(error(400, "This model's maximum context length is 4096 tokens"), when=is_loop)
    llm.push(error(400, "This model's maximum context length is 4096 tokens"), when=is_loop)
    llm.push(say("Next answer."), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("make my notes file", chat_id=92)  # deliberate ("file"): it goes on after its say
        await d.engine.wait_for_turns(1)
        tg.push_text("and now?", chat_id=92)
        await d.engine.wait_for_turns(2)
    assert tg.sent(92) == ["Done: notes.txt has your list.", CONTEXT_FULL_MESSAGE, "Next answer."]
    import sqlite3

    rows = sqlite3.connect(tmp_path / "data" / "bumblebot.db").execute(
        "SELECT status, json_extract(trace, '$.stop_reason') FROM turns ORDER BY id").fetchall()
    assert rows[0] == ("done", "context_full")


# -- what the real SmolLM2 run showed: floods, echoed engine notes, tool loops ------------------


async def test_a_model_that_never_ends_its_turn_is_bounded_by_the_message_cap(tmp_path, llm, tg):
    """What the real SmolLM2 run showed: "hi" got greeting after greeting, one per step; the
    model never called end_turn. A delivered message does not end a turn, so the turn's
    message cap bounds it: the model is told, and the turn stops when it brings nothing new."""
    judges_say_done(llm)
    greetings = iter(["Hello Alice, how are you today?", "How are you today, Alice?", "Hello again!", "Hi!"])
    llm.default = lambda r: tool_calls(("say", {"text": next(greetings, "Hi!")})) if is_loop(r) else text("DONE: fine")
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("hi", chat_id=93)
        await d.engine.wait_for_turns(1)
        trace = (await d.store.recent_turns())[0]["trace"]
    greeted = ["Hello Alice, how are you today?", "How are you today, Alice?", "Hello again!", "Hi!"]
    assert tg.sent(93) == greeted  # the cap counts every message: no stop note past it
    assert trace["stop_reason"] == "looping" and trace["told"] is None and len(loop_requests(llm)) == 7
    assert {c["rule"] for c in trace["cuts"]} == {"exact_repeat"}


async def test_a_model_that_only_loops_on_tools_still_gets_a_plain_answer_out(tmp_path, llm, tg):
    """Regression (real run): "hello there!" got "Sorry, I got stuck" after the model listed an
    empty directory four times; one tool-less request gets the answer out instead."""
    from fakes.openai_server import is_last_chance

    llm.push(text("Hello! Nice to meet you."), when=is_last_chance)
    llm.default = lambda r: tool_calls(("list_directory", {"path": "."})) if is_loop(r) else text("DONE: fine")
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("hello there!", chat_id=94)
        await d.engine.wait_for_turns(1)
    assert tg.sent(94) == ["Hello! Nice to meet you."]
    [last] = [r for r in llm.requests if is_last_chance(r)]
    assert "tools" not in last and "tool_choice" not in last
    assert not [m for m in last["messages"] if m["role"] == "tool" or m.get("tool_calls")]


async def test_a_last_try_that_only_writes_a_call_as_text_is_not_sent(tmp_path, llm, tg):
    """Regression (real run): the tool-less last try answered "functions.list_directory: { }",
    which reached the user."""
    from fakes.openai_server import is_last_chance

    from bumblebot.cognition.notes import LOOPING_MESSAGE

    llm.push(text("functions.list_directory: { }"), when=is_last_chance)
    llm.default = lambda r: tool_calls(("list_directory", {"path": "."})) if is_loop(r) else text("DONE: fine")
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("hello there!", chat_id=95)
        await d.engine.wait_for_turns(1)
    assert tg.sent(95) == [LOOPING_MESSAGE]


# -- issue 9 review: long messages, denser tokenizers, reasoning in arguments, promises -------


def tokenizer_fake(window: int, reply: Any, chars_per_token: float) -> Any:
    """A server whose tokenizer counts ``chars_per_token`` characters a token: it refuses a
    prompt plus ``max_tokens`` over ``window`` the way vLLM words it, and reports honest usage."""
    import time as _time

    def endpoint(request: dict[str, Any]) -> Reply:
        prompt = int((len(json.dumps(request["messages"])) + len(json.dumps(request.get("tools", [])))) / chars_per_token)
        asked = int(request.get("max_tokens", 0))
        if prompt + asked > window:
            return error(400, f"This model's maximum context length is {window} tokens. However, you requested "
                              f"{prompt + asked} tokens ({prompt} in the messages, {asked} in the completion).")
        answer = reply(request)
        message = dict(answer.message or {})
        if not message.get("tool_calls"):
            message.pop("tool_calls", None)
        return Reply(body={
            "id": "chatcmpl-t", "object": "chat.completion", "created": int(_time.time()), "model": request["model"],
            "choices": [{"index": 0, "message": message, "finish_reason": answer.finish_reason, "logprobs": None}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": 10, "total_tokens": prompt + 10},
        })

    return endpoint


def _chatty(answer: str) -> Any:
    from bumblebot.cognition.compaction import SUMMARY_HEADINGS

    summary = "\n".join(f"## {h}\n- the user keeps telling me about the garden" for h in SUMMARY_HEADINGS)

    def reply(request: dict[str, Any]) -> Reply:
        if is_aux(request):
            if "durable facts" in contents(request):
                return text("[]")
            if "You compact the history" in contents(request):
                return text(summary)
            return text("DONE: fine")
        return say(answer)

    return reply


async def test_long_messages_at_a_4096_window_keep_going(tmp_path, llm, tg):
    """Regression (review): 1,500-2,000-character messages at 4096 died of "too long": the
    protected head and tail left no middle to summarise."""
    llm.default = tokenizer_fake(4096, _chatty("Nice garden! " * 20), 4.0)
    config = write_config(tmp_path, llm, tg, cognition={"classifier": False, "max_context_tokens": 4096})
    async with running(config) as d:
        for i in range(8):
            tg.push_text(f"m{i} " + ("garden tomatoes basil " * 200)[:2000], chat_id=81)
            await d.engine.wait_for_turns(i + 1, timeout=30)
    sent = tg.sent(81)
    assert len(sent) == 8 and all(t.startswith("Nice garden!") for t in sent), sent


async def test_a_tokenizer_denser_than_the_estimate_is_learned_from_its_refusal(tmp_path, llm, tg):
    """Regression (review): a server counting 3 characters a token refused every request from
    turn 5 on; with no usage to learn from, the chat stayed dead."""
    llm.default = tokenizer_fake(4096, _chatty("Köln ist alt. " * 30), 3.0)
    config = write_config(tmp_path, llm, tg, cognition={"classifier": False, "max_context_tokens": 4096})
    async with running(config) as d:
        for i in range(10):
            text_ = f"Frage {i}: " + "Erzähl mir mehr über die Geschichte der Stadt Köln und ihre Brücken. " * 8
            tg.push_text(text_, chat_id=82)
            await d.engine.wait_for_turns(i + 1, timeout=30)
        scale = d.runner.budget.scale
    assert not any("too long" in t for t in tg.sent(82)) and len(tg.sent(82)) == 10
    assert scale > 1.3


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


async def test_promises_that_end_by_looping_get_the_honest_message(tmp_path, llm, tg):
    """Regression (review): a turn that only promised and then looped ended without saying the
    work was not done."""
    from bumblebot.cognition.notes import LOOPING_MESSAGE

    def reply(request: dict[str, Any]) -> Reply:
        if is_last_chance(request):
            return error(500, "no closing words from this model")
        if is_aux(request):
            return text("CONTINUE: the file was never written")
        return tool_calls(("say", {"text": "On it! Writing the file now."}))  # repeats, never ends

    llm.default = reply
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("write hello.py that prints hi", chat_id=84)
        await d.engine.wait_for_turns(1)
    sent = tg.sent(84)
    assert sent == ["On it! Writing the file now.", LOOPING_MESSAGE]


# -- second review of the fixes ------------------------------------------------------------------


def test_user_text_keeps_urls_test_names_and_plain_sentences():
    from bumblebot.cognition.notes import post_tool_nudge
    from bumblebot.core.textrules import EchoFilter

    nudge = post_tool_nudge(["read_file"], ["hi"])
    echoes = EchoFilter([nudge])
    url = "see https://x.com/?q=x&region=us&copy=2 ok"
    assert echoes(url) == url  # html.unescape once turned "&region" and "&copy" into symbols
    for kept in ("Failed: test_login, test_logout.", "Same turn, different story: I fixed it.",
                 "Tool results are ready: 3 files, a.py b.py c.py", "line one  \nline two",
                 "```\n[Same turn] Tool results are ready.\n```"):
        assert echoes(kept) == kept
    assert echoes(nudge) == ""  # failures ride in the marked sentence


async def test_a_reflex_promise_is_not_the_reply(tmp_path, llm, tg):
    """Regression (second review): the one-reply rule ended "hi" at say("On it!") whenever the
    judge said DONE."""
    judges_say_done(llm)
    llm.push(tool_calls(("say", {"text": "On it!"})), when=is_loop)
    llm.push(say("Hi there, hello!"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("hi", chat_id=85)
        await d.engine.wait_for_turns(1)
    assert tg.sent(85) == ["On it!", "Hi there, hello!"]


async def test_the_last_try_keeps_what_was_said_and_alternates_roles(tmp_path, llm, tg):
    """Regression (second review): the last try dropped every earlier answer given by say and
    sent three user messages in a row, which alternation-strict templates refuse."""
    from fakes.openai_server import is_last_chance

    judges_say_done(llm)
    llm.push(say("First answer."), when=is_loop)
    llm.push(text("Plain answer."), when=is_last_chance)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("hello there!", chat_id=86)
        await d.engine.wait_for_turns(1)
        llm.default = lambda r: tool_calls(("list_directory", {"path": "."})) if is_loop(r) else (
            error(500, "unscripted") if is_last_chance(r) else text("DONE: fine"))
        llm.push(text("Plain answer."), when=is_last_chance)
        tg.push_text("and now?", chat_id=86)
        await d.engine.wait_for_turns(2)
    assert tg.sent(86) == ["First answer.", "Plain answer."]
    [last] = [r for r in llm.requests if is_last_chance(r)]
    roles = [m["role"] for m in last["messages"]]
    assert all(a != b for a, b in zip(roles[1:], roles[2:])), roles  # user and assistant alternate
    assert any(m["role"] == "assistant" and "First answer." in m["content"] for m in last["messages"])


async def test_the_turn_after_a_too_long_one_is_answered(tmp_path, llm, tg):
    """Regression (second review): the forced pass kept the oversized message in its protected
    tail, so the next turn was refused too."""
    llm.default = tokenizer_fake(4096, _chatty("Answer. " + "w " * 40), 4.0)
    config = write_config(tmp_path, llm, tg, cognition={"classifier": False, "max_context_tokens": 4096})
    async with running(config) as d:
        for i in range(4):
            tg.push_text(f"q{i} " + "tell me more " * 60, chat_id=87)
            await d.engine.wait_for_turns(i + 1, timeout=20)
        # just under the 40% of the window that would be kept as a file (issue 16)
        tg.push_text("big " + "lorem ipsum dolor " * 360, chat_id=87)
        await d.engine.wait_for_turns(5, timeout=30)
        tg.push_text("short follow-up", chat_id=87)
        await d.engine.wait_for_turns(6, timeout=30)
    assert "too long" in tg.sent(87)[4] and tg.sent(87)[5].startswith("Answer.")
