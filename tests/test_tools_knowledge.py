"""The knowledge tools through the registry, on real files: a conversation's facts are its own,
the global knowledge.md is shared."""

from __future__ import annotations

import json
from typing import Any

from conftest import running, write_config
from fakes.openai_server import Reply, is_loop, text, tool_calls
from support import contents, judges_say_done, loop_requests, say, tool_result

from bumblebot.cognition.knowledge import Memory
from bumblebot.core.toolkit import ToolContext
from tools import build_registry


def context(tmp_path, conversation="telegram:1"):
    return ToolContext(workspace=tmp_path / "ws", data_dir=tmp_path, conversation=conversation)


async def test_remember_appends_to_the_conversation_and_refuses_duplicates_and_locked(tmp_path):
    (tmp_path / "knowledge.md").write_text("# Knowledge\n\n## [locked] About yourself\nYou are Bumble.\n")
    registry = build_registry(workspace=tmp_path / "ws")
    ctx = context(tmp_path)
    saved = await registry.execute("remember", json.dumps({"title": "Pets", "body": "Cat: Miso"}), ctx)
    again = await registry.execute("remember", json.dumps({"title": " pets ", "body": "Dog"}), ctx)
    locked = await registry.execute("remember", json.dumps({"title": "About yourself", "body": "x"}), ctx)
    own = Memory(tmp_path).of("telegram:1").path.read_text()
    assert saved.ok and not again.ok and not locked.ok
    assert own.count("## Pets") == 1 and "Cat: Miso" in own and "Dog" not in own
    assert (tmp_path / "knowledge.md").read_text() == "# Knowledge\n\n## [locked] About yourself\nYou are Bumble.\n"


async def test_recall_finds_own_and_shared_facts_and_never_another_chats(tmp_path):
    (tmp_path / "knowledge.md").write_text("# Knowledge\n\n## Bakery\nThe bakery opens at 7.\n")
    registry = build_registry(workspace=tmp_path / "ws")
    await registry.execute("remember", json.dumps({"title": "Pets", "body": "Cat: Miso"}), context(tmp_path, "telegram:1"))
    mine = await registry.execute("recall", json.dumps({"query": "what is the cat called"}), context(tmp_path, "telegram:1"))
    theirs = await registry.execute("recall", json.dumps({"query": "what is the cat called"}), context(tmp_path, "discord:9"))
    shared = await registry.execute("recall", json.dumps({"query": "when does the bakery open"}), context(tmp_path, "discord:9"))
    assert mine.ok and "Miso" in mine.content and "bakery" not in mine.content
    assert "Miso" not in theirs.content and "no saved fact" in theirs.content
    assert "opens at 7" in shared.content
    assert not Memory(tmp_path).of("discord:9").path.exists()  # a search creates nothing


# -- through the whole daemon ------------------------------------------------------------------


def _last_user(request: dict[str, Any]) -> str:
    return [m["content"] for m in request["messages"] if m["role"] == "user"][-1]


async def test_a_fact_remembered_in_one_chat_never_reaches_another(tmp_path, llm, tg):
    """A fact remembered in one chat goes into that conversation's prompt only, never into another
    chat's; the global knowledge.md reaches every conversation."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "knowledge.md").write_text("# Knowledge\n\n## Opening hours\nThe shop opens at 9.\n")
    judges_say_done(llm)

    def model(request: dict[str, Any]) -> Reply:
        if "please remember" in _last_user(request) and not tool_result(request, "remember"):
            return tool_calls(("remember", {"title": "Door", "body": "Ada's door code is 4711"}), ("say", {"text": "noted"}))
        return say("ok")

    llm.default = lambda r: model(r) if is_loop(r) else text("DONE: fine")
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("please remember: my door code is 4711", chat_id=101)
        await d.engine.wait_for_turns(1)
        tg.push_text("what is Ada's door code?", chat_id=202)
        tg.push_text("and the door code again?", chat_id=101)
        await d.engine.wait_for_turns(3)
    by_chat = {101: [], 202: []}
    for request in loop_requests(llm):
        for chat in by_chat:
            if f"id {chat})" in contents(request):
                by_chat[chat].append(contents(request))
    assert by_chat[202] and not any("4711" in c for c in by_chat[202])  # never seen elsewhere
    assert "Ada's door code is 4711" in by_chat[101][-1]  # the own chat knows it next turn
    assert all("The shop opens at 9." in c for c in by_chat[101] + by_chat[202])  # global: everywhere
    assert "4711" not in (tmp_path / "data" / "knowledge.md").read_text()
