"""The cognition pipeline end to end (routing, the loop, the gate): scripted model, real clients,
real SQLite.

Each test asserts the requests the engine sends and what reaches the platform.
"""

from __future__ import annotations

import asyncio
import sqlite3

from conftest import running, write_config
from fakes.openai_server import error, is_aux, is_loop, text, tool_calls
from support import (
    UNCLEAR,
    Gate,
    contents,
    is_adequacy_judge,
    is_classifier,
    is_grounding_judge,
    is_loop_with,
    judges_say_done,
    loop_requests,
    say,
)

from bumblebot.core.toolkit import ToolContext, ToolKind

THINKING = {"thinking": {"mode": "reasoning_effort", "reasoning_effort": "high"}}


def config(tmp_path, llm, tg, **cognition):
    cog = {"classifier": True, **cognition}
    return write_config(tmp_path, llm, tg, cognition=cog, llm={
        "base_url": llm.base_url, "model": "test-model", "reflex_model": "reflex-model",
        "max_retries": 0, "timeout_s": 10, **THINKING,
    })


def no_violations(llm):
    assert not llm.violations, llm.violations[0][0]
    assert not llm.unscripted


async def test_hi_is_reflex_without_classifier(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(say("hey!"), when=is_loop)
    async with running(config(tmp_path, llm, tg)) as d:
        tg.push_text("hi", chat_id=1)
        await tg.wait_for("sendMessage")
        await d.engine.wait_for_turns(1)
        trace = (await d.store.recent_turns())[0]["trace"]
    assert not [r for r in llm.requests if is_classifier(r)]
    assert len(loop_requests(llm)) == 1 and len([r for r in llm.requests if is_adequacy_judge(r)]) == 1
    first = loop_requests(llm)[0]
    assert first["max_tokens"] == 512 and first["model"] == "reflex-model"
    assert "reasoning_effort" not in first  # thinking off on reflex
    assert trace["route"] == "reflex"
    no_violations(llm)


async def test_a_plain_greeting_makes_one_turn_request_and_one_small_check(tmp_path, llm, tg):
    """A greeting with a name is reflex by the heuristic (no classifier): one completion,
    then the completion check, which reads only the message and the reply."""
    judges_say_done(llm)
    llm.push(say("Hi! I'm doing well, thanks."), when=is_loop)
    async with running(config(tmp_path, llm, tg)) as d:
        tg.push_text("hello Sam", chat_id=1)
        await tg.wait_for("sendMessage")
        await d.engine.wait_for_turns(1)
        trace = (await d.store.recent_turns())[0]["trace"]
    loop, judge = llm.requests
    assert loop_requests(llm) == [loop] and is_adequacy_judge(judge)
    assert "hello Sam" in contents(judge) and "# Who you are" not in contents(judge)  # no history, no prompt
    assert tg.sent(1) == ["Hi! I'm doing well, thanks."]
    assert trace["route"] == "reflex" and trace["route_reason"].startswith("greeting:")
    assert [(g["done"], g["judge"]) for g in trace["gate"]] == [(True, "adequacy")]
    assert trace["stop_reason"] == "end_turn"
    no_violations(llm)


async def test_a_brief_chat_question_and_a_deliberate_turn_both_get_their_check(
    tmp_path, llm, tg
):
    """A brief chat question (reflex, "brief") costs one completion and its check; a
    deliberate turn in the same chat, answered without work tools, gets the same judge."""
    judges_say_done(llm)
    llm.push(say("Tea, mostly."), when=is_loop_with("coffee or tea"))
    llm.push(say("Let's plan it step by step."), when=is_loop_with("how bees communicate"))
    async with running(config(tmp_path, llm, tg)) as d:
        tg.push_text("do you prefer coffee or tea?", chat_id=1)
        await tg.wait_for("sendMessage")
        await d.engine.wait_for_turns(1)
        assert len(llm.requests) == 2
        tg.push_text("help me research how bees communicate", chat_id=1)
        await tg.wait_for("sendMessage", n=2)
        await d.engine.wait_for_turns(2)
        second, first = [t["trace"] for t in await d.store.recent_turns()][:2]
    assert first["route"] == "reflex" and first["route_reason"].startswith("brief:")
    assert second["route"] == "deliberate" and second["route_reason"].startswith("research:")
    judges = [r for r in llm.requests if is_adequacy_judge(r)]
    assert len(judges) == 2 and "how bees communicate" in contents(judges[1])
    assert [g["judge"] for g in first["gate"]] == [g["judge"] for g in second["gate"]] == ["adequacy"]
    assert len(llm.requests) == 4  # each turn: its loop request and its check
    no_violations(llm)


async def test_long_technical_question_is_deliberate_with_thinking(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(say("here is how"), when=is_loop)
    question = (
        "My python asyncio service deadlocks when two tasks await the same lock inside a "
        "finally block after a cancellation; how do I debug which coroutine holds it? "
        "Here is the traceback from the staging server logs, it mentions TimeoutError."
    )
    async with running(config(tmp_path, llm, tg)):
        tg.push_text(question, chat_id=1)
        await tg.wait_for("sendMessage")
        await llm.wait_for_requests(2)
    assert not [r for r in llm.requests if is_classifier(r)]
    first = loop_requests(llm)[0]
    assert first["max_tokens"] == 2048 and first["model"] == "test-model"
    assert first["reasoning_effort"] == "high"
    no_violations(llm)


async def test_uncertain_input_asks_the_classifier_once(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(text("CHAT"), when=is_classifier)
    llm.push(say("a fruit, botanically"), when=is_loop)
    async with running(config(tmp_path, llm, tg)) as d:
        tg.push_text(UNCLEAR, chat_id=1)
        await tg.wait_for("sendMessage")
        await d.engine.wait_for_turns(1)
        trace = (await d.store.recent_turns())[0]["trace"]
    classifier = [r for r in llm.requests if is_classifier(r)]
    assert len(classifier) == 1
    assert classifier[0]["max_tokens"] == 8 and classifier[0]["temperature"] == 0.2
    assert "tools" not in classifier[0]
    assert loop_requests(llm)[0]["max_tokens"] == 512  # CHAT stays reflex
    assert trace["classifier_label"] == "CHAT"
    assert len(llm.requests) == 3  # classifier, loop and the check


async def test_failed_classifier_goes_deliberate(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(error(500, "classifier down"), when=is_classifier)
    llm.push(say("let me think"), when=is_loop)
    async with running(config(tmp_path, llm, tg)):
        tg.push_text(UNCLEAR, chat_id=1)
        await tg.wait_for("sendMessage")
    assert len([r for r in llm.requests if is_classifier(r)]) == 1
    assert loop_requests(llm)[0]["max_tokens"] == 2048


async def test_teased_deliverable_is_sent_back_to_work_by_the_adequacy_judge(tmp_path, llm, tg):
    llm.push(say("on it"), when=is_loop)
    llm.push(text("CONTINUE: the file hello.py was promised but not written"), when=is_adequacy_judge)
    llm.push(
        tool_calls(
            ("write_file", {"path": "hello.py", "content": "print('hi')\n"}),
            ("say", {"text": "done: hello.py prints hi"}),
            ("end_turn", {}),
        ),
        when=is_loop_with("hello.py was promised"),
    )
    llm.push(text("DONE: the file was written and reported"), when=is_grounding_judge)
    async with running(config(tmp_path, llm, tg)) as d:
        tg.push_text("write hello.py that prints hi", chat_id=1)
        await tg.wait_for("sendMessage", n=2)
        await d.engine.wait_for_turns(1)
        workspace = d.settings.workspace
        trace = (await d.store.recent_turns())[0]["trace"]
    assert (workspace / "hello.py").read_text() == "print('hi')\n"
    assert tg.sent(1) == ["on it", "done: hello.py prints hi"]
    second = loop_requests(llm)[1]
    assert "hello.py was promised" in second["messages"][-1]["content"]  # the nudge names the reason
    assert [g["judge"] for g in trace["gate"]] == ["adequacy", "grounding"]
    assert [g["done"] for g in trace["gate"]] == [False, True]
    assert trace["stop_reason"] == "end_turn"
    db = sqlite3.connect(d.settings.db_path)
    stored = "\n".join(r[0] for r in db.execute("SELECT content FROM messages"))
    assert "hello.py was promised" not in stored  # nudges are never stored as user messages
    assert llm.pending == 0
    no_violations(llm)


async def test_reply_ignoring_tool_results_is_grounded_by_the_judge(tmp_path, llm, tg):
    llm.push(tool_calls(("read_file", {"path": "config.txt"})), when=is_loop)
    llm.push(say("all good!"), when=is_loop)
    llm.push(text("CONTINUE: the reply does not mention the port 8080 from the file"), when=is_grounding_judge)
    llm.push(say("the port is 8080"), when=is_loop_with("port 8080 from the file"))
    llm.push(text("DONE: reports the port"), when=is_grounding_judge)
    async with running(config(tmp_path, llm, tg)) as d:
        (d.settings.workspace / "config.txt").write_text("port=8080\n")
        tg.push_text("what port is set in config.txt?", chat_id=1)
        await tg.wait_for("sendMessage", n=2)
        await d.engine.wait_for_turns(1)
    assert tg.sent(1) == ["all good!", "the port is 8080"]
    assert llm.pending == 0
    grounding = [r for r in llm.requests if is_grounding_judge(r)][0]
    assert "port=8080" in contents(grounding) and "tools" not in grounding  # judges see no tools
    no_violations(llm)


async def test_parallel_tool_calls_overlap_and_results_keep_call_order(tmp_path, llm, tg):
    judges_say_done(llm)
    barrier = asyncio.Barrier(2)
    llm.push(
        tool_calls(("rendezvous", {"tag": "first"}, "call_A"), ("rendezvous", {"tag": "second"}, "call_B")),
        when=is_loop,
    )
    llm.push(say("both met"), when=is_loop)
    async with running(config(tmp_path, llm, tg)) as d:

        @d.toolbox.tool(kind=ToolKind.WORK, timeout_s=5)
        async def rendezvous(ctx: ToolContext, tag: str) -> str:
            """Wait until a second call arrives (proves the calls run at the same time)."""
            await barrier.wait()
            return f"met:{tag}"

        tg.push_text("run both", chat_id=1)
        await tg.wait_for("sendMessage")
    second = loop_requests(llm)[1]["messages"]
    results = [(m["tool_call_id"], m["content"]) for m in second if m["role"] == "tool"]
    assert results == [("call_A", "met:first"), ("call_B", "met:second")]
    no_violations(llm)


async def test_same_call_a_third_time_in_a_row_is_not_executed(tmp_path, llm, tg):
    judges_say_done(llm)
    runs: list[str] = []
    for _ in range(3):
        llm.push(tool_calls(("counter", {"key": "x"})), when=is_loop)
    llm.push(say("stopping"), when=is_loop)
    async with running(config(tmp_path, llm, tg)) as d:

        @d.toolbox.tool(kind=ToolKind.WORK)
        async def counter(ctx: ToolContext, key: str) -> str:
            """Count a call."""
            runs.append(key)
            return f"run {len(runs)}"

        tg.push_text("count", chat_id=1)
        await tg.wait_for("sendMessage")
    assert runs == ["x", "x"]
    fourth = loop_requests(llm)[3]["messages"]
    last_result = [m for m in fourth if m["role"] == "tool"][-1]["content"]
    assert "Not executed" in last_result and "counter" in last_result
    no_violations(llm)


async def test_text_beside_tool_calls_is_private_and_repeated_final_is_not_resent(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(tool_calls(("say", {"text": "the answer is 4"}), content="let me think... secret reasoning"), when=is_loop)
    llm.push(text("The answer  is 4"), when=is_loop)  # a plain final that repeats the say exactly
    async with running(config(tmp_path, llm, tg)):
        tg.push_text("Explain step by step how Python computes 2+2 and what the result is.", chat_id=1)
        await tg.wait_for("sendMessage")
        await llm.wait_for_requests(3)
    assert tg.sent(1) == ["the answer is 4"]
    assert not any("secret reasoning" in t for t in tg.sent())


async def test_judge_that_fails_or_answers_garbage_still_ends_the_turn(tmp_path, llm, tg):
    llm.push(say("first"), when=is_loop)
    llm.push(error(500, "judge exploded"), when=is_aux)
    llm.push(say("second"), when=is_loop)
    llm.push(text("banana"), when=is_aux)
    async with running(config(tmp_path, llm, tg, classifier=False)) as d:
        tg.push_text("please summarise the meeting", chat_id=1)
        await tg.wait_for("sendMessage")
        tg.push_text("and the other one too please", chat_id=1)
        await tg.wait_for("sendMessage", n=2)
        await d.engine.wait_for_turns(2)
        turns = await d.store.recent_turns()
    assert tg.sent(1) == ["first", "second"]
    assert {t["trace"]["stop_reason"] for t in turns} == {"end_turn"}
    assert len(loop_requests(llm)) == 2  # no extra loop step was forced by a broken judge


async def test_step_cap_ends_with_an_honest_message(tmp_path, llm, tg):
    judges_say_done(llm)
    for i in range(6):  # real work, new each step (alternating tools), but never a word
        step = ("read_file", {"path": f"f{i}.txt"}) if i % 2 else ("list_directory", {"path": f"d{i}"})
        llm.push(tool_calls(step), when=is_loop)
    async with running(config(tmp_path, llm, tg, tool_continuation_rounds=0)) as d:
        tg.push_text("ponder forever", chat_id=1)
        await tg.wait_for("sendMessage")
        await d.engine.wait_for_turns(1)
        trace = (await d.store.recent_turns())[0]["trace"]
    assert len(loop_requests(llm)) == 6  # max(6, min(25, 6 + 0))
    assert "more steps than I'm allowed" in tg.sent(1)[0]
    assert trace["stop_reason"] == "step_cap"


async def test_a_looping_model_is_stopped_before_the_step_cap(tmp_path, llm, tg):
    """Three steps in a row that bring nothing new end the turn at once."""
    judges_say_done(llm)
    for i in range(6):
        llm.push(tool_calls(("think", {"thought": f"hmm {i}"})), when=is_loop)
    async with running(config(tmp_path, llm, tg, tool_continuation_rounds=0)) as d:
        tg.push_text("ponder forever", chat_id=1)
        await tg.wait_for("sendMessage")
        await d.engine.wait_for_turns(1)
        trace = (await d.store.recent_turns())[0]["trace"]
    assert len(loop_requests(llm)) == 3
    assert "got stuck" in tg.sent(1)[0]  # nothing got through: say so
    assert trace["stop_reason"] == "looping"


async def test_a_turn_that_said_something_and_hit_the_cap_says_once_that_it_stopped(tmp_path, llm, tg):
    """What the model said stands, and the user is told the turn stopped at the cap (not
    left to guess whether more is coming); the model gave no closing words, so the plain note."""
    from bumblebot.cognition.notes import STEP_CAP_MESSAGE

    judges_say_done(llm)
    llm.push(say("Here is what I found so far: it is sunny.", end=False), when=is_loop)
    for i in range(5):
        step = ("read_file", {"path": f"f{i}.txt"}) if i % 2 else ("list_directory", {"path": f"d{i}"})
        llm.push(tool_calls(step), when=is_loop)
    async with running(config(tmp_path, llm, tg, tool_continuation_rounds=0)) as d:
        tg.push_text("dig deeper into the files", chat_id=1)
        await d.engine.wait_for_turns(1)
        trace = (await d.store.recent_turns())[0]["trace"]
    assert tg.sent(1) == ["Here is what I found so far: it is sunny.", STEP_CAP_MESSAGE]
    assert trace["stop_reason"] == "step_cap" and trace["told"] == "note"


async def test_three_length_stalls_bring_the_write_file_advice(tmp_path, llm, tg):
    judges_say_done(llm)
    for i in range(3):
        llm.push(tool_calls(("think", {"thought": f"part {i}"}), finish_reason="length"), when=is_loop)
    llm.push(say("summary in notes.md"), when=is_loop)
    async with running(config(tmp_path, llm, tg)):
        tg.push_text("write me a very long essay about bees and their ecology in detail", chat_id=1)
        await tg.wait_for("sendMessage")
    requests = loop_requests(llm)
    assert "write_file" in requests[3]["messages"][-1]["content"]
    assert "write_file" not in requests[2]["messages"][-1]["content"]
    assert not any("length limit" in t for t in tg.sent())


async def test_post_tool_nudge_names_failures_and_only_delivered_messages(tmp_path, llm, tg):
    from fakes.telegram_server import bad_request_body

    judges_say_done(llm)
    llm.push(tool_calls(("say", {"text": "alpha"}), ("read_file", {"path": "missing.txt"})), when=is_loop)
    llm.push(tool_calls(("say", {"text": "beta is refused"})), when=is_loop)
    llm.push(say("gamma"), when=is_loop)
    async with running(config(tmp_path, llm, tg)):
        tg.push_text("go", chat_id=1)
        await tg.wait_for("sendMessage")
        tg.fail_next("sendMessage", 400, bad_request_body("can't parse entities: unsupported start tag"))
        await tg.wait_for("sendMessage", n=3)
    requests = loop_requests(llm)
    nudge1 = requests[1]["messages"][-1]["content"]
    assert "failed: read_file" in nudge1 and '"alpha"' in nudge1
    nudge2 = requests[2]["messages"][-1]["content"]
    assert "beta" not in nudge2 and '"alpha"' in nudge2  # a failed say is not "already told"


async def test_message_during_a_turn_steers_at_the_next_step(tmp_path, llm, tg):
    judges_say_done(llm)
    slow = Gate(tool_calls(("think", {"thought": "working"})))
    llm.push(slow, when=is_loop)
    llm.push(say("ok, blue it is"), when=is_loop_with("actually make it blue"))
    async with running(config(tmp_path, llm, tg)) as d:
        tg.push_text("paint the fence red", chat_id=1)
        await asyncio.wait_for(slow.entered.wait(), 5)
        tg.push_text("actually make it blue", chat_id=1)
        await tg.wait_for("getUpdates", predicate=lambda p: int(p.get("offset", 0)) >= tg.next_update_id)
        await d.engine.wait_until(lambda: d.engine.progress.accepted == 2)
        slow.release.set()
        await tg.wait_for("sendMessage")
        await d.engine.wait_for_turns(1)
        turns = await d.store.recent_turns()
        pending = await d.store.pending_inbound()
    assert tg.sent(1) == ["ok, blue it is"]
    assert len(turns) == 1 and pending == []
    second = loop_requests(llm)[1]["messages"]
    roles = [m["role"] for m in second[-3:]]
    assert roles == ["assistant", "tool", "user"]  # after the tool batch, so pairs stay intact
    no_violations(llm)


async def test_trace_command_shows_why_a_turn_ended(tmp_path, llm, tg, capsys):
    from bumblebot.app.cli import main

    judges_say_done(llm)
    llm.push(tool_calls(("read_file", {"path": "nope.txt"})), when=is_loop)
    llm.push(say("that file does not exist"), when=is_loop)
    cfg = config(tmp_path, llm, tg)
    async with running(cfg):
        tg.push_text("read nope.txt", chat_id=77)
        await tg.wait_for("sendMessage")
    code = await asyncio.to_thread(main, ["--config", str(cfg), "trace", "--chat", "telegram:77"])
    out = capsys.readouterr().out
    assert code == 0
    assert "route=deliberate" in out and "stop=end_turn" in out
    assert "read_file!" in out  # failed tool call marked
    assert "gate@2: DONE (grounding)" in out
