"""Messages as stored and sent (bumblebot/core/messages.py): old tool calls are healed when read back."""

from __future__ import annotations

import json

from conftest import running, write_config
from fakes.openai_server import is_loop
from support import db, judges_say_done, loop_requests, say


async def test_a_history_poisoned_by_an_older_version_is_sent_with_sound_arguments(tmp_path, llm, tg):
    """A conversation whose history already holds broken arguments (recorded before this fix)
    is not stuck: every request carries them as ``{}``."""
    judges_say_done(llm)
    llm.push(say("First answer."), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as daemon:
        tg.push_text("hello", chat_id=165)
        await daemon.engine.wait_for_turns(1)
    conn = db(tmp_path)
    (row_id, calls) = conn.execute("SELECT id, tool_calls FROM messages WHERE tool_calls IS NOT NULL").fetchone()
    poisoned = json.loads(calls)
    poisoned[0]["function"]["arguments"] = '{"text": "First ans'  # cut off: what an old version kept
    conn.execute("UPDATE messages SET tool_calls=? WHERE id=?", (json.dumps(poisoned), row_id))
    conn.commit()
    llm.push(say("Second answer."), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as daemon:
        tg.push_text("again", chat_id=165)
        await daemon.engine.wait_for_turns(1)
    assert tg.sent(165)[-1] == "Second answer."
    assert llm.violations == []
    sent_calls = [c for m in loop_requests(llm)[-1]["messages"] for c in m.get("tool_calls") or ()]
    assert sent_calls[0]["function"]["arguments"] == "{}"
