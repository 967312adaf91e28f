"""The loop's state (bumblebot/cognition/state.py): canonical arguments, exact repeats and the repeat guard."""

from __future__ import annotations

from bumblebot.cognition.state import LoopState, canonical_arguments, repeat_key
from bumblebot.core.toolkit import ToolKind


def test_canonical_arguments_ignore_key_order_and_spacing():
    assert canonical_arguments('{"b": 1, "a": 2}') == canonical_arguments('{"a":2,"b":1}')
    assert canonical_arguments("not json") == "not json"


def test_an_exact_repeat_differs_only_in_case_and_runs_of_whitespace():
    assert repeat_key("The plan:  buy milk.\n") == repeat_key("the PLAN: buy milk.")
    assert repeat_key("The plan: buy milk, eggs and bread.") != repeat_key("The plan: buy milk, eggs and rice.")
    assert repeat_key("at 5pm") != repeat_key("at 5 pm")


def _kind(name: str) -> ToolKind:
    return ToolKind.AGENCY if name in ("say", "think", "end_turn", "wait") else ToolKind.WORK


def test_the_same_work_tool_in_three_consecutive_steps_is_refused_from_the_third():
    """Spec, "Repeat guard": [say("checking"), fetch_url(u)] repeated for ever is refused from the
    third step."""
    from bumblebot.llm import ToolCall

    state = LoopState(_kind)
    step = lambda i: [ToolCall(f"s{i}", "say", '{"text": "checking"}'), ToolCall(f"f{i}", "fetch_url", '{"url": "u"}')]  # noqa: E731
    verdicts = [[allowed for call, allowed in state.plan(step(i)) if call.name == "fetch_url"][0] for i in range(4)]
    assert verdicts == [True, True, False, False]
    state.plan([ToolCall("r", "read_file", "{}")])  # another work tool breaks the streak
    assert state.plan([ToolCall("f9", "fetch_url", "{}")])[0][1]
    fan_out = state.plan([ToolCall(f"p{i}", "read_file", f'{{"path": "{i}"}}') for i in range(5)])
    assert all(allowed for _, allowed in fan_out)  # one step's fan-out is one decision
