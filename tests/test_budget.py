"""The context budget (bumblebot/cognition/budget.py): the token scale learned from an endpoint."""

from __future__ import annotations

from conftest import running, write_config
from support import chatty as _chatty
from support import tokenizer_fake


async def test_a_tokenizer_denser_than_the_estimate_is_learned_from_its_refusal(tmp_path, llm, tg):
    """A server counting 3 characters a token refuses requests from turn 5 on and reports no usage:
    the token scale is learned from its refusals, so the chat goes on."""
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
