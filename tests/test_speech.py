"""The delivery rule (bumblebot/cognition/speech.py): says go out as written, in call order, up to the message cap."""

from __future__ import annotations

import json
import sqlite3

from conftest import running, write_config
from fakes.openai_server import is_loop, tool_calls
from support import judges_say_done, loop_requests, say, tool_results


async def test_say_calls_of_one_step_arrive_in_call_order(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(tool_calls(*[("say", {"text": f"part {i}"}) for i in range(5)], ("end_turn", {})), when=is_loop)
    config = write_config(tmp_path, llm, tg, cognition={"classifier": False, "max_messages_per_turn": 5})
    async with running(config):
        tg.push_text("count to five", chat_id=4)
        await tg.wait_for("sendMessage", n=5)
    assert tg.sent(4) == [f"part {i}" for i in range(5)]


async def test_the_same_say_twice_in_one_step_reaches_the_user_once(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(say("Hello!", "Hello!"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("hi", chat_id=20)
        await tg.wait_for("sendMessage")
        await d.engine.wait_for_turns(1)
    assert tg.sent(20) == ["Hello!"]


async def test_the_same_say_in_two_steps_reaches_the_user_once(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(tool_calls(("say", {"text": "Hello there!"})), when=is_loop)
    llm.push(say("hello  there!"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("Explain in detail, step by step, how the build pipeline in the repo works.", chat_id=15)  # deliberate: a reflex turn ends at its first say
        await tg.wait_for("sendMessage")
        await d.engine.wait_for_turns(1)
    assert tg.sent(15) == ["Hello there!"]
    # the second say's result tells the model why nothing was sent
    db = sqlite3.connect(tmp_path / "data" / "bumblebot.db")
    assert any("not sent again" in r[0] for r in db.execute("SELECT content FROM messages WHERE role='tool'"))


async def test_a_reworded_message_is_the_model_s_to_send(tmp_path, llm, tg):
    """Only an exact repeat is held back: a near-identical message may be a correction."""
    judges_say_done(llm)
    llm.push(tool_calls(("say", {"text": "Sure, I can help with that."})), when=is_loop)
    llm.push(say("Sure, I can help you with that!"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("can you help?", chat_id=94)
        await d.engine.wait_for_turns(1)
    assert tg.sent(94) == ["Sure, I can help with that.", "Sure, I can help you with that!"]


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


async def test_a_blocked_bot_stops_the_turn_instead_of_retrying_say(tmp_path, llm, tg):
    judges_say_done(llm)
    for _ in range(4):
        llm.push(tool_calls(("say", {"text": "are you there?"})), when=is_loop)
    tg.fail_next("sendMessage", 403, {"ok": False, "error_code": 403, "description": "Forbidden: bot was blocked by the user"})
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("hi", chat_id=16)
        await d.engine.wait_for_turns(1)
        trace = (await d.store.recent_turns())[0]["trace"]
    assert len([c for c in tg.calls if c.method == "sendMessage"]) == 1
    assert len(loop_requests(llm)) == 1 and trace["stop_reason"] == "undeliverable"


async def test_a_say_the_text_rules_trimmed_counts_once_against_the_message_cap(tmp_path, llm, tg):
    """A say that copied an engine note is delivered trimmed, and counted once: its call's
    result once counted it again in the words the model wrote, so the fourth message of the turn
    was dropped as past the cap of four."""
    judges_say_done(llm)
    llm.push(tool_calls(("read_file", {"path": "a.md"})), when=is_loop)
    llm.push(tool_calls(("say", {"text": "[Same turn] Tool results are ready; failed: read_file. The file does not exist."})),
             when=is_loop)
    llm.push(tool_calls(("say", {"text": "Fact A."})), when=is_loop)
    llm.push(tool_calls(("say", {"text": "Fact B."})), when=is_loop)
    llm.push(say("Fact C."), when=is_loop)
    async with running(write_config(tmp_path, llm, tg, cognition={"max_messages_per_turn": 4})) as d:
        tg.push_text("read a.md and give me three facts", chat_id=12)
        await d.engine.wait_for_turns(1)
    assert tg.sent(12) == ["The file does not exist.", "Fact A.", "Fact B.", "Fact C."]


async def test_a_say_that_is_a_call_written_out_is_told_so_and_its_code_block_version_arrives(tmp_path, llm, tg):
    """A say that is all a call of an offered tool written as JSON is not delivered (a weak
    model writes its calls that way), and the model is told why and how to show one: in a code
    block, which arrives as written. It was once told "nothing left after removing reasoning"."""

    judges_say_done(llm)
    call = '{"name": "read_file", "arguments": {"path": "notes.md"}}'
    block = f"```json\n{call}\n```"
    llm.push(tool_calls(("say", {"text": call})), when=is_loop)
    llm.push(say(block), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("show me, as raw JSON, a function call that reads notes.md with read_file", chat_id=13)
        await d.engine.wait_for_turns(1)
    assert tg.sent(13) == [call]  # the code block, shown as code (its fence is formatting)
    told = [r for r in tool_results(loop_requests(llm)[1]) if "not sent" in r]
    assert told and "code block" in told[0]


async def test_the_model_is_told_when_one_message_is_left_so_it_can_say_what_remains(tmp_path, llm, tg):
    """"Eight fun facts, one message each" at a cap of four: four arrived and the turn ended
    with no word why, as the model only learnt of the cap when its fifth was dropped."""
    judges_say_done(llm)
    for i in range(1, 4):
        llm.push(tool_calls(("say", {"text": f"Fact {i}."})), when=is_loop)
    llm.push(say("Fact 4. That's all I can send at once: ask me for the other four!"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg, cognition={"max_messages_per_turn": 4})) as d:
        tg.push_text("tell me eight fun facts, one message each", chat_id=14)
        await d.engine.wait_for_turns(1)
    results = [json.loads(r) for r in tool_results(loop_requests(llm)[3])]
    assert [r.get("messages_left") for r in results] == [None, None, 1]
    assert "one message left" in results[-1]["note"]
    assert tg.sent(14)[-1].startswith("Fact 4.")
