"""Plain unit tests for the engine's pure logic: loop limits, gate parsing, suppression, prompts."""

from __future__ import annotations

import pytest

from bumblebot.gate import CompletionGate, GateInput, parse_verdict, progress_only, user_demands_tools
from bumblebot.loop import canonical_arguments, max_steps, post_tool_nudge, repeats_said


@pytest.mark.parametrize(
    ("rounds", "steps"), [(-3, 6), (0, 6), (4, 10), (16, 22), (19, 22), (100, 22)]
)
def test_step_cap_follows_the_spec(rounds, steps):
    assert max_steps(rounds) == steps


def test_canonical_arguments_ignore_key_order_and_spacing():
    assert canonical_arguments('{"b": 1, "a": 2}') == canonical_arguments('{"a":2,"b":1}')
    assert canonical_arguments("not json") == "not json"


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


def test_progress_only_recognises_announcements_not_answers():
    assert progress_only("On it! Let me check that for you...")
    assert progress_only("ok, I'll write it now")
    assert not progress_only("The port is 8080.")
    assert not progress_only("")


def test_user_demands_tools_on_word_boundaries():
    assert user_demands_tools("please check the file and tell me")
    assert user_demands_tools("look it up")
    assert not user_demands_tools("I'm checking out, thanks")


def test_repeats_said_catches_echoes_and_pro_forma_only():
    said = ["the answer is 4"]
    assert repeats_said("The answer is 4.", said)
    assert repeats_said("done", said)
    assert not repeats_said("Also, 5 is prime.", said)
    assert not repeats_said("done", [])  # nothing was said: a "done" is the reply


def test_post_tool_nudge_lists_failures_once_and_last_three_told():
    nudge = post_tool_nudge(["read_file", "read_file", "fetch_url"], ["a", "b", "c", "d"])
    assert "ready; failed: read_file, fetch_url." in nudge
    assert '"b"; "c"; "d"' in nudge and '"a"' not in nudge


async def test_gate_fails_open_and_caps_continues():
    async def broken(messages):
        raise RuntimeError("judge down")

    async def garbage(messages):
        return "I think so?"

    base = GateInput(user_text="write a file", visible=["sure"], work_calls=0, work_ok=0)
    assert (await CompletionGate(broken).check(base)).done
    assert (await CompletionGate(garbage).check(base)).done
    capped = GateInput(user_text="x", visible=[], work_calls=0, work_ok=0, continues_so_far=2)
    assert (await CompletionGate(garbage).check(capped)).done


async def test_gate_routes_to_the_right_judge():
    asked = []

    async def judge(messages):
        asked.append(messages[0]["content"])
        return "DONE: fine"

    gate = CompletionGate(judge)
    grounded = await gate.check(GateInput(user_text="read it", visible=["ok"], work_calls=1, work_ok=1))
    adequacy = await gate.check(GateInput(user_text="hi", visible=["hey"], work_calls=0, work_ok=0))
    empty = await gate.check(GateInput(user_text="hi", visible=[], work_calls=0, work_ok=0))
    assert grounded.judge == "grounding" and adequacy.judge == "adequacy"
    assert not empty.done and empty.judge is None and len(asked) == 2


def test_strip_reasoning_keeps_a_tag_mentioned_mid_reply():
    from bumblebot.reasoning import strip_reasoning

    assert strip_reasoning("<think>plan</think>Hello") == "Hello"
    assert strip_reasoning("<think>cut off mid-thought") == ""
    mentioned = "In HTML you can write a <thinking> tag? No. Here is the full answer."
    assert strip_reasoning(mentioned) == mentioned


@pytest.mark.parametrize(
    "message",
    [
        "This model's maximum context length is 8192 tokens",
        "request (9000 tokens) exceeds the available context size (8192 tokens)",  # llama.cpp
        "Input validation error: `inputs` tokens + `max_new_tokens` must be <= 4096",  # TGI
    ],
)
def test_context_length_errors_of_common_servers_are_recognised(message):
    from bumblebot.llm import _CONTEXT_RE

    assert _CONTEXT_RE.search(message)
    assert not _CONTEXT_RE.search("tool_choice 'required' is not supported")
