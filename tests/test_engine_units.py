"""Plain unit tests for the engine's pure logic: loop limits, gate parsing, suppression, prompts."""

from __future__ import annotations

import pytest

from bumblebot.cognition.limits import max_steps
from bumblebot.cognition.notes import post_tool_nudge
from bumblebot.cognition.state import canonical_arguments, repeat_key


@pytest.mark.parametrize(
    ("rounds", "steps"), [(-3, 6), (0, 6), (4, 10), (16, 22), (19, 22), (100, 22)]
)
def test_step_cap_follows_the_spec(rounds, steps):
    assert max_steps(rounds) == steps


def test_canonical_arguments_ignore_key_order_and_spacing():
    assert canonical_arguments('{"b": 1, "a": 2}') == canonical_arguments('{"a":2,"b":1}')
    assert canonical_arguments("not json") == "not json"


def test_an_exact_repeat_differs_only_in_case_and_runs_of_whitespace():
    assert repeat_key("The plan:  buy milk.\n") == repeat_key("the PLAN: buy milk.")
    assert repeat_key("The plan: buy milk, eggs and bread.") != repeat_key("The plan: buy milk, eggs and rice.")
    assert repeat_key("at 5pm") != repeat_key("at 5 pm")


def test_post_tool_nudge_lists_failures_once_and_last_three_told():
    nudge = post_tool_nudge(["read_file", "read_file", "fetch_url"], ["a", "b", "c", "d"])
    assert "ready; failed: read_file, fetch_url." in nudge
    assert '"b"; "c"; "d"' in nudge and '"a"' not in nudge


@pytest.mark.parametrize(
    "message",
    [
        "This model's maximum context length is 8192 tokens",
        "request (9000 tokens) exceeds the available context size (8192 tokens)",  # llama.cpp
        "Input validation error: `inputs` tokens + `max_new_tokens` must be <= 4096",  # TGI
    ],
)
def test_context_length_errors_of_common_servers_are_recognised(message):
    from bumblebot.llm.completion import _CONTEXT_RE

    assert _CONTEXT_RE.search(message)
    assert not _CONTEXT_RE.search("tool_choice 'required' is not supported")
