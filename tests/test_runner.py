"""Running a turn (bumblebot/runtime/runner.py): the fixed part of every request, a turn the model
fails, and the model of a scheduled turn."""

from __future__ import annotations

import asyncio
import sqlite3

from conftest import running, write_config
from fakes.openai_server import error, is_loop, tool_calls
from support import Gate, contents, judges_say_done, loop_requests, say

from bumblebot.core.messages import estimate_text_tokens, estimate_tools


async def test_the_fixed_part_fits_a_quarter_of_a_4k_window(tmp_path, llm, tg):
    config = write_config(tmp_path, llm, tg, cognition={"classifier": False, "max_context_tokens": 4096})
    async with running(config) as d:
        _, prompt, schemas = d.runner.fixed_part()
        full = estimate_text_tokens(d.runner.prompts.system_prompt(0)) + estimate_tools(d.toolbox.schemas(0))
    fixed = estimate_text_tokens(prompt) + 10 + estimate_tools(schemas)
    assert fixed <= 4096 // 4 < full  # compacted, and it had to be
    names = {s["function"]["name"] for s in schemas}
    assert {"say", "end_turn", "read_file", "write_file", "remember"} <= names


async def test_mid_turn_message_is_kept_when_the_model_then_fails(tmp_path, llm, tg):
    judges_say_done(llm)
    slow = Gate(tool_calls(("think", {"thought": "working"})))
    llm.push(slow, when=is_loop)
    for _ in range(2):  # refused with tool_choice=required, then again with auto
        llm.push(error(400, "bad request from the endpoint"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("start something", chat_id=3)
        await asyncio.wait_for(slow.entered.wait(), 5)
        tg.push_text("also this detail", chat_id=3)
        await d.engine.wait_until(lambda: d.engine.progress.accepted == 2)
        slow.release.set()
        await d.engine.wait_for_turns(1)
        pending = await d.store.pending_inbound()
    assert pending == []
    db = sqlite3.connect(tmp_path / "data" / "bumblebot.db")
    stored = [r[0] for r in db.execute("SELECT content FROM messages WHERE role='user' ORDER BY id")]
    assert stored == ["start something", "also this detail"]
    roles = [r[0] for r in db.execute("SELECT role FROM messages ORDER BY id")]
    assert roles == ["user", "assistant", "tool", "user", "assistant"]  # partial turn + the note
    assert "refused the request (400)" in tg.sent(3)[0]
    assert db.execute("SELECT DISTINCT status FROM journal").fetchall() == [("failed",)]


async def test_a_scheduled_task_runs_on_the_background_model_and_a_chat_on_the_usual_ones(tmp_path, llm, tg):
    judges_say_done(llm)

    def scheduled(request: dict) -> bool:
        return is_loop(request) and "[Scheduled task #" in contents(request)

    llm.push(tool_calls(("schedule_task", {"when": "in 1 seconds", "task": "Remind the user to drink water."})),
             when=lambda r: is_loop(r) and not scheduled(r))
    llm.push(say("Reminder set."), when=lambda r: is_loop(r) and not scheduled(r))
    llm.push(say("Time for some water!"), when=scheduled)
    config = write_config(tmp_path, llm, tg, llm={"background_model": "cheap-model"})
    async with running(config) as d:
        tg.push_text("remind me in a second to drink water, please", chat_id=7)
        await tg.wait_for("sendMessage", n=2, timeout=10)  # the second message is the task's
        await d.engine.wait_for_turns(2)
        chat, task = [t["trace"] for t in reversed(await d.store.recent_turns(limit=2))]
    assert tg.sent(7) == ["Reminder set.", "Time for some water!"]
    assert {r["model"] for r in loop_requests(llm) if scheduled(r)} == {"cheap-model"}
    assert {r["model"] for r in loop_requests(llm) if not scheduled(r)} <= {"test-model", "reflex-model"}
    assert task["model"] == "cheap-model" and {s["model"] for s in task["steps"]} == {"cheap-model"}
    assert chat["model"] in ("test-model", "reflex-model")
