"""The completion gate (bumblebot/cognition/gate.py): it runs on every ending, in any language, and
decides from structure which judge to ask; no list of words decides anything."""

from __future__ import annotations

import json
from typing import Any

import pytest
from conftest import running, write_config
from fakes.openai_server import is_loop, text, tool_calls
from support import Gate, contents, is_adequacy_judge, is_grounding_judge, judges_say_done, say

from bumblebot.cognition.gate import CompletionGate, GateInput, parse_verdict
from bumblebot.cognition.state import LoopState
from bumblebot.core.messages import Message
from bumblebot.core.toolkit import ToolKind, ToolResult
from bumblebot.llm import ToolCall


class Judge:
    """Records what it was asked; answers ``reply``."""

    def __init__(self, reply: str = "DONE: fine") -> None:
        self.reply = reply
        self.asked: list[list[dict[str, Any]]] = []

    async def __call__(self, messages: list[dict[str, Any]]) -> str:
        self.asked.append(messages)
        return self.reply


def ending(**overrides: Any) -> GateInput:
    fields: dict[str, Any] = {
        "user_text": "hello Sam", "visible": ["Hi! Good to see you."], "work_calls": 0, "work_ok": 0,
        "work_tools": ("read_file", "write_file"),
    }
    fields.update(overrides)
    return GateInput(**fields)


@pytest.mark.parametrize(
    ("raw", "verdict", "reason"),
    [
        ("DONE: reports the port", True, "reports the port"),
        ("continue - the file is missing", False, "the file is missing"),
        ("**CONTINUE:** not grounded\nextra", False, "not grounded"),
        ("Done", True, ""),
        ("banana", None, "banana"),
        ("", None, ""),
    ],
)
def test_parse_verdict(raw, verdict, reason):
    assert parse_verdict(raw) == (verdict, reason)


@pytest.mark.parametrize("ended_by", ["end_turn", "text"])
async def test_a_chat_reply_is_judged_like_any_other_ending(ended_by):
    judge = Judge(reply="CONTINUE: the user asked for more")
    decision = await CompletionGate(judge).check(ending(ended_by=ended_by))
    assert not decision.done and decision.judge == "adequacy" and len(judge.asked) == 1


@pytest.mark.parametrize("reply", [
    "D'accord, je vais l'ajouter à ta liste !",  # French: no English cue could catch it
    "On it! Let me check.",
    "Pizza is great.",
])
async def test_without_work_every_reply_goes_to_the_adequacy_judge_whatever_its_words(reply):
    judge = Judge()
    decision = await CompletionGate(judge).check(ending(user_text="ajoute du lait à ma liste de courses", visible=[reply]))
    assert decision.done and decision.judge == "adequacy"
    assert reply in judge.asked[0][1]["content"]


@pytest.mark.parametrize("work_ok", [1, 0])  # a failed work call must be reported too
async def test_after_work_tools_the_grounding_judge_decides(work_ok):
    judge = Judge(reply="CONTINUE: the reply ignores the file")
    decision = await CompletionGate(judge).check(ending(work_calls=1, work_ok=work_ok))
    assert not decision.done and decision.judge == "grounding"
    assert "before it is final" in judge.asked[0][0]["content"]


async def test_structure_comes_first_and_costs_no_judge():
    judge = Judge()
    gate = CompletionGate(judge)
    silent = await gate.check(ending(visible=[]))
    assert not silent.done and silent.reason.startswith("no visible reply") and silent.nudge
    capped = await gate.check(ending(visible=[], continues_so_far=2))
    assert capped.done and "cap" in capped.reason
    quiet = await gate.check(ending(visible=[], silent_ok=True))
    assert quiet.done
    assert judge.asked == []


async def test_a_failing_or_unreadable_judge_lets_the_turn_end():
    async def broken(messages):
        raise RuntimeError("judge down")

    assert (await CompletionGate(broken).check(ending())).done
    assert (await CompletionGate(Judge("I think so?")).check(ending())).done


async def test_the_judge_sees_the_message_and_the_reply_not_the_history():
    judge = Judge()
    await CompletionGate(judge).check(ending(user_text="tell me a joke", visible=["Sure, here's one:", "Why…"]))
    system, user = judge.asked[0]
    assert len(judge.asked[0]) == 2 and system["role"] == "system"
    assert "tell me a joke" in user["content"] and "Sure, here's one:\nWhy…" in user["content"]
    assert len(system["content"]) + len(user["content"]) < 1600  # a few hundred tokens


async def test_the_nudge_names_only_the_work_tools_the_turn_offers():
    """A nudge once told the model to use run_command when no such tool was offered."""
    judge = Judge(reply="CONTINUE: nothing was added")
    decision = await CompletionGate(judge).check(ending(work_tools=("remember", "write_file")))
    assert "remember, write_file" in decision.nudge and "run_command" not in decision.nudge
    assert "remember, write_file" in judge.asked[0][1]["content"]
    bare = await CompletionGate(judge).check(ending(work_tools=()))
    assert "no tools" in bare.nudge and "write_file" not in bare.nudge


# -- the loop's side: what the gate is given -----------------------------------------------------


def _kind(name: str) -> ToolKind:
    return ToolKind.AGENCY if name in ("say", "think", "end_turn", "wait") else ToolKind.WORK


def test_a_message_steered_in_joins_what_the_judge_reads():
    state = LoopState(_kind)
    state.on_user(Message(role="user", content="hello Sam"))
    call = ToolCall("c1", "say", json.dumps({"text": "Hi!"}))
    state.plan([call])
    state.on_result(call, ToolResult('{"delivered": true}'))
    state.on_user(Message(role="user", content="and write it to notes.txt"))  # steered in
    inp = state.gate_input("end_turn", False, 0, work_tools=("write_file",))
    assert inp.user_text == "hello Sam\nand write it to notes.txt" and inp.visible == ["Hi!"]
    assert inp.work_tools == ("write_file",)


def test_a_replayed_turn_gives_the_gate_what_the_live_loop_did():
    """Resume rebuilds the state from the transcript: the same answer as the live loop."""
    call = {"id": "c1", "type": "function", "function": {"name": "say", "arguments": '{"text": "Hi!"}'}}
    transcript = [
        Message(role="user", content="hello Sam"),
        Message(role="assistant", tool_calls=[call]),
        Message(role="tool", content='{"delivered": true}', tool_call_id="c1", name="say", ok=True),
    ]
    inp = LoopState.replay(transcript, _kind).gate_input("end_turn", False, 0)
    assert inp.visible == ["Hi!"] and inp.work_calls == 0


# -- end to end: the real daemon, the real openai client, the fake endpoint -----------------------


async def test_a_reflex_chat_turn_is_judged_after_its_reply_is_on_screen(tmp_path, llm, tg):
    judge_called = Gate(text("DONE: a greeting"))
    llm.push(say("Hi Sam!"), when=is_loop)
    llm.push(judge_called, when=is_adequacy_judge)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("hello Sam", chat_id=70)
        await judge_called.entered.wait()
        assert tg.sent(70) == ["Hi Sam!"]  # on screen before the judge answers
        judge_called.release.set()
        await d.engine.wait_for_turns(1)
        trace = (await d.store.recent_turns())[0]["trace"]
    assert trace["route"] == "reflex" and [g["judge"] for g in trace["gate"]] == ["adequacy"]
    assert trace["stop_reason"] == "end_turn" and not llm.unscripted


async def test_a_reflex_turn_that_ran_a_work_tool_gets_the_grounding_judge(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(
        tool_calls(("read_file", {"path": "notes.txt"}), ("say", {"text": "Hi Sam! No notes yet."}), ("end_turn", {})),
        when=is_loop,
    )
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("hello Sam", chat_id=71)
        await tg.wait_for("sendMessage")
        await d.engine.wait_for_turns(1)
        trace = (await d.store.recent_turns())[0]["trace"]
    assert trace["route"] == "reflex"
    assert [g["judge"] for g in trace["gate"]] == ["grounding"]
    assert len([r for r in llm.requests if is_grounding_judge(r)]) == 1
    assert len(llm.requests) == 2 and not llm.unscripted


async def test_a_message_steered_into_a_reflex_turn_is_judged_with_it(tmp_path, llm, tg):
    """The router saw "hello Sam", not the steered request for work: the adequacy judge reads
    both, and sends the hollow promise back to work."""
    judges_say_done(llm)
    hang = Gate(tool_calls(("think", {"thought": "greet"})))  # step 1: nothing said yet
    llm.push(hang, when=is_loop)
    llm.push(say("Hi Sam! Milk, noted."), when=lambda r: is_loop(r) and "notes.txt" in contents(r))
    llm.push(
        tool_calls(("write_file", {"path": "notes.txt", "content": "milk\n"}), ("say", {"text": "Saved notes.txt."}),
                   ("end_turn", {})),
        when=lambda r: is_loop(r) and "was not done yet" in contents(r),
    )
    llm.push(text("CONTINUE: notes.txt was promised but not written"), when=is_adequacy_judge)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("hello Sam", chat_id=72)
        await hang.entered.wait()
        tg.push_text("also put milk in notes.txt", chat_id=72)
        await d.engine.wait_until(lambda: d.engine.progress.accepted >= 2)
        hang.release.set()
        await d.engine.wait_for_turns(1)
        trace = (await d.store.recent_turns())[0]["trace"]
        workspace = d.settings.workspace
    assert trace["route"] == "reflex"
    assert [g["judge"] for g in trace["gate"]] == ["adequacy", "grounding"]
    judged = [r for r in llm.requests if is_adequacy_judge(r)]
    assert len(judged) == 1 and "also put milk in notes.txt" in contents(judged[0])
    assert (workspace / "notes.txt").read_text() == "milk\n"
    assert tg.sent(72) == ["Hi Sam! Milk, noted.", "Saved notes.txt."]
    assert not llm.unscripted
