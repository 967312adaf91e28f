"""The pieces of a step (bumblebot/cognition/steps.py): unique call ids and one budget for a step's tool results."""

from __future__ import annotations

from conftest import running, write_config
from fakes.openai_server import is_loop, tool_calls
from support import judges_say_done, loop_requests, say


async def test_a_server_that_reuses_tool_call_ids_still_works(tmp_path, llm, tg):
    """llama.cpp-style: every tool call carries the same id, within and across turns."""
    judges_say_done(llm)
    llm.push(tool_calls(("read_file", {"path": "a.txt"}, "SAMEID123")), when=is_loop)
    llm.push(tool_calls(("read_file", {"path": "b.txt"}, "SAMEID123")), when=is_loop)
    llm.push(tool_calls(("say", {"text": "a says A, b says B"}, "SAMEID123"), ("end_turn", {}, "SAMEID123")), when=is_loop)
    llm.push(tool_calls(("say", {"text": "again"}, "SAMEID123"), ("end_turn", {}, "SAMEID123")), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        (d.settings.workspace / "a.txt").write_text("A")
        (d.settings.workspace / "b.txt").write_text("B")
        tg.push_text("compare a.txt and b.txt", chat_id=17)
        await tg.wait_for("sendMessage")
        tg.push_text("once more", chat_id=17)
        await tg.wait_for("sendMessage", n=2)
    third = loop_requests(llm)[2]
    results = [m["content"] for m in third["messages"] if m["role"] == "tool"]
    assert any("A" in r for r in results) and any("B" in r for r in results)  # both results seen
    ids = [c["id"] for r in [loop_requests(llm)[3]] for m in r["messages"] for c in m.get("tool_calls") or ()]
    assert len(ids) == len(set(ids))
    assert tg.sent(17) == ["a says A, b says B", "again"]
    assert not llm.violations


async def test_parallel_big_tool_results_cannot_lock_the_conversation(tmp_path, llm, tg):
    """Four 10 kB files read in one step used to overflow every later request."""
    judges_say_done(llm)
    llm.push(tool_calls(*[("read_file", {"path": f"f{i}.txt"}) for i in range(4)]), when=is_loop)
    llm.push(say("read them"), when=is_loop)
    llm.push(say("still talking"), when=is_loop)
    config = write_config(tmp_path, llm, tg, cognition={"classifier": False, "max_context_tokens": 8192})
    async with running(config) as d:
        for i in range(4):
            (d.settings.workspace / f"f{i}.txt").write_text(str(i) * 10_000)
        tg.push_text("read all four files", chat_id=18)
        await tg.wait_for("sendMessage")
        tg.push_text("and now?", chat_id=18)
        await tg.wait_for("sendMessage", n=2)
    step_results = [m["content"] for m in loop_requests(llm)[1]["messages"] if m["role"] == "tool"]
    assert sum(len(r) for r in step_results) <= int(0.25 * 8192 * 4)
    assert tg.sent(18) == ["read them", "still talking"]
