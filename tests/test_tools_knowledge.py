"""The knowledge tools through the registry, on a real knowledge.md."""

from __future__ import annotations

import json

from tools import build_registry

from bumblebot.toolkit import ToolContext


async def test_remember_appends_and_refuses_duplicates_and_locked(tmp_path):
    (tmp_path / "knowledge.md").write_text("# Knowledge\n\n## [locked] About yourself\nYou are Bumble.\n")
    registry = build_registry(workspace=tmp_path / "ws")
    ctx = ToolContext(workspace=tmp_path / "ws", data_dir=tmp_path)
    saved = await registry.execute("remember", json.dumps({"title": "Pets", "body": "Cat: Miso"}), ctx)
    again = await registry.execute("remember", json.dumps({"title": " pets ", "body": "Dog"}), ctx)
    locked = await registry.execute("remember", json.dumps({"title": "About yourself", "body": "x"}), ctx)
    text = (tmp_path / "knowledge.md").read_text()
    assert saved.ok and not again.ok and not locked.ok
    assert text.count("## Pets") == 1 and "Cat: Miso" in text and "Dog" not in text
    assert "## [locked] About yourself\nYou are Bumble." in text


async def test_recall_finds_matching_sections(tmp_path):
    (tmp_path / "knowledge.md").write_text("# Knowledge\n\n## Pets\nCat: Miso\n\n## Work\nBakery shifts\n")
    registry = build_registry(workspace=tmp_path / "ws")
    ctx = ToolContext(workspace=tmp_path / "ws", data_dir=tmp_path)
    hit = await registry.execute("recall", json.dumps({"query": "what is the cat called"}), ctx)
    miss = await registry.execute("recall", json.dumps({"query": "zebra"}), ctx)
    assert hit.ok and "Miso" in hit.content and "Bakery" not in hit.content
    assert "no section" in miss.content
