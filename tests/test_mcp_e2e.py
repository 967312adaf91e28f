"""MCP servers through the whole daemon: the real stdio MCP server of
``tests/fakes/mcp_server.py`` (the official SDK), the real python-telegram-bot and openai
clients against the fakes, real SQLite."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from conftest import running, write_config
from fakes.openai_server import is_loop, tool_calls
from support import contents, is_grounding_judge, judges_say_done, loop_requests, say

FAKE = Path(__file__).resolve().parent / "fakes" / "mcp_server.py"


def names(request: dict) -> list[str]:
    return [t["function"]["name"] for t in request.get("tools", [])]


async def test_an_mcp_tool_is_offered_called_grounds_the_gate_and_shows_in_the_trace(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(tool_calls(("fake__add", {"a": 19, "b": 23})), when=is_loop)
    llm.push(say("19 + 23 is 42"), when=is_loop)
    servers = {"fake": {"command": [sys.executable, str(FAKE)], "tools": ["add", "echo"]},
               "dead": {"command": [sys.executable, str(FAKE), "--exit-now", "3"]}}
    config = write_config(tmp_path, llm, tg, mcp={"servers": servers, "startup_wait_s": 10},
                          telegram={"allowed_user_ids": [1001]})
    async with running(config) as d:
        tg.push_text("please add 19 and 23 with your adding tool", chat_id=1001)
        await tg.wait_for("sendMessage")
        await d.engine.wait_for_turns(1)
        tg.push_text("/status", chat_id=1001)
        await tg.wait_for("sendMessage", n=2)
        trace = (await d.store.recent_turns(limit=1))[0]["trace"]
    first, second = loop_requests(llm)[:2]
    assert "fake__add" in names(first) and "fake__echo" in names(first)
    assert "fake__hang" not in names(first) and not [n for n in names(first) if n.startswith("dead__")]
    [result] = [m["content"] for m in second["messages"] if m["role"] == "tool"]
    assert "42" in result
    assert any(is_grounding_judge(r) and "fake__add (ok)" in contents(r) for r in llm.requests)  # a work tool
    assert [c["name"] for s in trace["steps"] for c in s["tool_calls"]][:1] == ["fake__add"]
    assert tg.sent(1001)[0] == "19 + 23 is 42"
    assert "MCP: " in tg.sent(1001)[1] and "fake connected" in tg.sent(1001)[1]
    log = " ".join(str(a) for a in d.mcp.status())
    assert "dead" in log


async def test_a_hanging_mcp_call_times_out_and_the_turn_goes_on(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(tool_calls(("fake__hang", {})), when=is_loop)
    llm.push(say("the tool did not answer in time"), when=is_loop)
    servers = {"fake": {"command": [sys.executable, str(FAKE)], "timeout_s": 1}}
    config = write_config(tmp_path, llm, tg, mcp={"servers": servers}, telegram={"allowed_user_ids": [1001]})
    async with running(config) as d:
        tg.push_text("please run your hang tool for me now", chat_id=1001)
        await tg.wait_for("sendMessage", timeout=20)
        await d.engine.wait_for_turns(1)
    [result] = [m["content"] for m in loop_requests(llm)[1]["messages"] if m["role"] == "tool"]
    assert "error" in json.loads(result) and "1" in json.loads(result)["error"]
    assert tg.sent(1001) == ["the tool did not answer in time"]


async def test_mcp_tools_are_not_offered_in_a_group_by_default(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(say("hello group"), when=is_loop)
    servers = {"fake": {"command": [sys.executable, str(FAKE)]}}
    config = write_config(tmp_path, llm, tg, mcp={"servers": servers}, telegram={"respond_in_groups": "always"})
    async with running(config) as d:
        tg.push_text("hi all", chat_id=-100500, chat_type="supergroup", user_id=7)
        await tg.wait_for("sendMessage")
        await d.engine.wait_for_turns(1)
    assert not [n for n in names(loop_requests(llm)[0]) if n.startswith("fake__")]


async def test_a_server_that_never_answers_its_handshake_gives_up_after_connect_timeout_s():
    """With protocol auto, a server that never answers its handshake is given up after
    connect_timeout_s (it once took about 15 s a try, whatever connect_timeout_s said)."""
    import time

    from bumblebot.core.mcp_settings import MCPSettings
    from tools.mcp_client import MCPManager
    from tools.mcp_records import ServerState

    settings = MCPSettings(servers={"mute": {"command": [sys.executable, "-c", "import time; time.sleep(60)"]}},
                           connect_timeout_s=1.5, startup_wait_s=20)
    manager = MCPManager(settings, retry_initial_s=30)
    started = time.monotonic()
    await manager.start()
    try:
        assert await manager.wait_settled()
        took = time.monotonic() - started
        [status] = manager.status()
    finally:
        await manager.stop()
    assert status.state is ServerState.RETRYING and took < 8
