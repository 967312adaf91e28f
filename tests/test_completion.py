"""One completion request (bumblebot/llm/completion.py): context-length refusals of common servers."""

from __future__ import annotations

import pytest


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
