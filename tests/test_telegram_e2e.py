"""End to end on Telegram: real python-telegram-bot and openai clients against the fakes."""

from __future__ import annotations

import asyncio

from conftest import running, write_config
from fakes.openai_server import is_aux, is_loop, text, tool_calls


async def test_say_then_end_turn_reaches_send_message_with_typing(tmp_path, llm, tg):
    llm.push(tool_calls(("say", {"text": "hey you"}), ("end_turn", {})), when=is_loop)
    llm.push(text("DONE: chat"), when=is_aux)
    async with running(write_config(tmp_path, llm, tg)):
        tg.push_text("hi", chat_id=1001)
        await tg.wait_for("sendMessage", predicate=lambda p: p.get("text") == "hey you")
        await llm.wait_for_requests(2)
    assert tg.sent(1001) == ["hey you"]
    assert [c for c in tg.calls if c.method == "sendChatAction" and c.params.get("action") == "typing"]
    loop_requests = [r for r in llm.requests if "tools" in r]
    assert loop_requests[0]["tool_choice"] == "required"
    assert loop_requests[0]["messages"][-1]["content"].endswith("hi")
    assert "[Turn context]" in loop_requests[0]["messages"][-1]["content"]
    assert not llm.violations and not llm.unscripted
