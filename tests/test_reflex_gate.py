"""A reflex chat turn ends without the adequacy judge (issue 11, "One request for a chat turn").

The router already decided that a reflex input is casual chat asking for no work, so the
completion gate does not ask the adequacy judge again. The cheap heuristics still apply first,
work tools still get the grounding judge, a demand for tools still gets it, a progress-only
reply still goes to a judge, and a message steered into the turn (which the router never saw)
brings the judge back. See docs/cognition.md, section 5.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from conftest import running, write_config
from fakes.openai_server import is_loop, text, tool_calls
from support import Gate, contents, is_adequacy_judge, is_grounding_judge, judges_say_done, say

from bumblebot.gate import CompletionGate, GateInput
from bumblebot.llm import ToolCall
from bumblebot.loop import LoopState
from bumblebot.messages import Message
from bumblebot.toolkit import ToolKind, ToolResult

REFLEX_SKIP = "reflex chat turn: no judge (router decided)"


class Judge:
    """Records what it was asked; answers ``reply``."""

    def __init__(self, reply: str = "DONE: fine") -> None:
        self.reply = reply
        self.asked: list[str] = []

    async def __call__(self, messages: list[dict[str, Any]]) -> str:
        self.asked.append(messages[0]["content"])
        return self.reply


def chat(**overrides: Any) -> GateInput:
    fields: dict[str, Any] = {
        "user_text": "hello Sam", "visible": ["Hi! Good to see you."], "work_calls": 0, "work_ok": 0,
        "chat_reflex": True,
    }
    fields.update(overrides)
    return GateInput(**fields)


# -- the gate -------------------------------------------------------------------------------------


@pytest.mark.parametrize("ended_by", ["end_turn", "text"])
async def test_a_reflex_chat_reply_ends_without_a_judge(ended_by):
    judge = Judge(reply="CONTINUE: would have sent it back")
    decision = await CompletionGate(judge).check(chat(ended_by=ended_by))
    assert decision.done and decision.judge is None and decision.reason == REFLEX_SKIP
    assert judge.asked == []


async def test_without_the_flag_the_same_reply_still_goes_to_the_adequacy_judge():
    judge = Judge(reply="CONTINUE: the user asked for more")
    decision = await CompletionGate(judge).check(chat(chat_reflex=False))
    assert not decision.done and decision.judge == "adequacy"
    assert len(judge.asked) == 1 and "used none successfully" in judge.asked[0]


@pytest.mark.parametrize("work_ok", [1, 0])  # a failed work call must be reported too
async def test_work_on_a_reflex_turn_still_gets_the_grounding_judge(work_ok):
    judge = Judge(reply="CONTINUE: the reply ignores the file")
    decision = await CompletionGate(judge).check(chat(work_calls=1, work_ok=work_ok))
    assert not decision.done and decision.judge == "grounding"
    assert len(judge.asked) == 1 and "before it is final" in judge.asked[0]


async def test_a_demand_for_tools_on_a_reflex_turn_still_gets_the_grounding_judge():
    judge = Judge(reply="CONTINUE: nothing was looked up")
    decision = await CompletionGate(judge).check(chat(user_text="hey, use your tools"))
    assert not decision.done and decision.judge == "grounding"
    assert len(judge.asked) == 1


async def test_a_progress_only_reflex_reply_is_not_skipped():
    judge = Judge(reply="CONTINUE: only promised")
    # an explicit end_turn after "On it!": the adequacy judge decides, as on any turn
    decision = await CompletionGate(judge).check(chat(visible=["On it! Let me check."]))
    assert not decision.done and decision.judge == "adequacy" and len(judge.asked) == 1
    # a plain-text ending: the cheap progress-only heuristic catches it first, with no judge
    decision = await CompletionGate(judge).check(chat(visible=["On it! Let me check."], ended_by="text"))
    assert not decision.done and decision.reason == "progress-only reply without work"
    assert len(judge.asked) == 1


async def test_the_cheap_heuristics_still_come_first_on_a_reflex_turn():
    judge = Judge()
    gate = CompletionGate(judge)
    silent = await gate.check(chat(visible=[]))
    assert not silent.done and silent.reason.startswith("no visible reply") and silent.nudge
    capped = await gate.check(chat(visible=[], continues_so_far=2))
    assert capped.done and "cap" in capped.reason
    assert judge.asked == []


# -- the loop's side: which turns are reflex chat turns for the gate ------------------------------


def _kind(name: str) -> ToolKind:
    return ToolKind.AGENCY if name in ("say", "think", "end_turn", "wait") else ToolKind.WORK


def test_gate_input_marks_a_reflex_turn_until_a_message_is_steered_into_it():
    state = LoopState(_kind)
    state.on_user(Message(role="user", content="hello Sam"))
    call = ToolCall("c1", "say", json.dumps({"text": "Hi!"}))
    state.plan([call])
    state.on_result(call, ToolResult('{"delivered": true}'))
    assert state.gate_input("end_turn", False, 0, reflex=True).chat_reflex
    assert not state.gate_input("end_turn", False, 0, reflex=False).chat_reflex
    assert not state.gate_input("end_turn", False, 0).chat_reflex  # deliberate unless told
    state.on_user(Message(role="user", content="and write it to notes.txt"))  # steered in
    steered = state.gate_input("end_turn", False, 0, reflex=True)
    assert not steered.chat_reflex
    assert steered.user_text == "hello Sam\nand write it to notes.txt"


def test_a_replayed_reflex_turn_is_still_a_reflex_chat_turn():
    """Resume rebuilds the state from the transcript: the same answer as the live loop."""
    call = {"id": "c1", "type": "function", "function": {"name": "say", "arguments": '{"text": "Hi!"}'}}
    transcript = [
        Message(role="user", content="hello Sam"),
        Message(role="assistant", tool_calls=[call]),
        Message(role="tool", content='{"delivered": true}', tool_call_id="c1", name="say", ok=True),
    ]
    state = LoopState.replay(transcript, _kind)
    inp = state.gate_input("end_turn", False, 0, reflex=True)
    assert inp.chat_reflex and inp.visible == ["Hi!"] and inp.work_calls == 0


# -- end to end: the real daemon, the real openai client, the fake endpoint -----------------------


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


async def test_a_message_steered_into_a_reflex_turn_brings_the_judge_back(tmp_path, llm, tg):
    """The router saw "hello Sam", not the steered request for work: the adequacy judge
    decides, and sends the hollow promise back to work."""
    judges_say_done(llm)
    hang = Gate(tool_calls(("think", {"thought": "greet"})))  # step 1: nothing said yet
    llm.push(hang, when=is_loop)
    # a real reply, not progress chatter: only the steered message keeps it from ending the turn
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


@pytest.mark.parametrize(("reply", "promises"), [
    ("Sure! I'll dig through your notes and get back to you.", True),
    ("Let me check that for you.", True),
    ("I will look into it.", True),
    ("Give me a sec.", True),
    ("Pizza is great. Put some extra cheese on it!", False),
    ("It is gonna rain tomorrow, take an umbrella.", False),
    ("I'll be honest: I love pizza.", False),
    ("I will always remember your party.", False),
    ("Sure, will do.", False),
    ("Let me know if you need anything else!", False),
])
def test_only_a_reply_that_promises_work_brings_the_judge_back(reply, promises):
    """Second review of issue 11: bare "on it", "gonna", "I'll" made everyday chat cost a
    judge request."""
    from bumblebot.gate import promises_work

    assert promises_work(reply) is promises
