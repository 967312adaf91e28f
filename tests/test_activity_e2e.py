"""The live event bus end to end: a daemon on the fakes publishes a turn as it is recorded
(started, each step with its tool calls, each result, what it said, its end) and no secret
ever leaves through an event."""

from __future__ import annotations

import asyncio
import json

from conftest import TOKEN, running, write_config
from fakes.openai_server import tool_calls
from support import judges_say_done, say

from bumblebot.core.activity import Event

OPENAI_KEY = "sk-test-key-not-real-000000"  # the key conftest.running gives the daemon


async def events_until_turn_ends(events, n: int = 1) -> list[Event]:
    seen: list[Event] = []
    async with asyncio.timeout(10):
        async for event in events:
            seen.append(event)
            if event.kind == "turn_ended" and (n := n - 1) == 0:
                return seen
    return seen


async def test_a_turn_publishes_its_steps_in_order_and_no_secret(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(tool_calls(("read_file", {"path": "notes.txt"}), content=f"let me look ({OPENAI_KEY})"))
    llm.push(say("The notes hold a token; I will not repeat it."))
    async with running(write_config(tmp_path, llm, tg)) as d:
        (d.settings.workspace / "notes.txt").write_text(f"telegram token: {TOKEN}\nkey: {OPENAI_KEY}\n")
        async with d.activity.subscribe("telegram:501") as events, d.activity.subscribe() as everything:
            tg.push_text("what is in notes.txt?", chat_id=501)
            seen = await events_until_turn_ends(events)
            all_seen = await events_until_turn_ends(everything)
    kinds = [e.kind for e in seen]
    assert kinds[0] == "queued" and seen[0].data["waiting"] == 1
    main = [e for e in seen if e.kind in ("turn_started", "step", "said", "turn_ended")]
    assert [e.kind for e in main] == ["turn_started", "step", "step", "said", "turn_ended"]
    started, read, speak, said, ended = main
    turn = started.data["turn"]
    assert all(e.data["turn"] == turn for e in main)
    assert started.data["route"] and started.data["entries"] == 1 and "reason" in started.data
    assert read.data["step"] == 1 and read.data["tool_calls"] == [{"name": "read_file", "arguments": '{"path": "notes.txt"}'}]
    assert read.data["finish_reason"] == "tool_calls" and isinstance(read.data["usage"], dict)
    assert [c["name"] for c in speak.data["tool_calls"]] == ["say", "end_turn"] and speak.data["step"] == 2
    [result] = [e for e in seen if e.kind == "tool_result" and e.data["name"] == "read_file"]
    assert result.data["step"] == 1 and result.data["ok"] is True and "[REDACTED]" in result.data["result"]
    assert kinds.index("tool_result") < kinds.index("step", kinds.index("step") + 1)  # the result before the next step
    assert said.data["text"] == "The notes hold a token; I will not repeat it."
    assert ended.data["status"] == "done" and ended.data["stop"]
    assert [e.seq for e in seen] == sorted(e.seq for e in seen)
    assert [e.seq for e in all_seen] == [e.seq for e in seen]  # one chat: every event is its own
    shown = json.dumps([[e.conversation, e.kind, e.data] for e in seen + d.activity.recent()])
    assert TOKEN not in shown and OPENAI_KEY not in shown and "[REDACTED]" in shown
