"""The knowledge tools through the registry, on real files: a conversation's facts are its own,
the global knowledge.md is shared (issue 9, privacy)."""

from __future__ import annotations

import json

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
