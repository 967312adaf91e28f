"""Knowledge tools (kind WORK): durable facts in ``<data_dir>/knowledge.md``.

``remember`` appends a section; ``recall`` searches the sections. Both go through
:class:`bumblebot.knowledge.KnowledgeFile`, which writes atomically, deduplicates titles
(case- and whitespace-insensitive) and never changes or duplicates ``[locked]`` sections.
The system prompt picks the change up on the next turn (its cache key covers the file).
"""

from __future__ import annotations

import asyncio
import re
from typing import Annotated

from pydantic import Field

from bumblebot.knowledge import KnowledgeFile, normalize_title
from bumblebot.toolkit import ToolContext, ToolKind, ToolResult

from .registry import Tool, tool

_WORD = re.compile(r"[^\W_]{3,}", re.UNICODE)
MAX_RECALL_SECTIONS = 5


def _file(ctx: ToolContext) -> KnowledgeFile:
    return KnowledgeFile(ctx.data_dir / "knowledge.md")


@tool(kind=ToolKind.WORK)
async def remember(
    ctx: ToolContext,
    title: Annotated[str, Field(description="Short section title, e.g. 'Alice's preferences'")],
    body: Annotated[str, Field(description="The facts to keep, in Markdown")],
) -> ToolResult:
    """Save a durable fact to knowledge.md so you still know it in later conversations."""
    knowledge = _file(ctx)
    added = await asyncio.to_thread(knowledge.append_sections, [(title, body)])
    if added:
        return ToolResult(f"saved section '{added[0]}'")
    existing = [s.title for s in knowledge.sections() if normalize_title(s.title) == normalize_title(title)]
    if existing or title.strip().lower().startswith("[locked]"):
        return ToolResult.error(f"a section titled '{title}' already exists or is locked; choose another title")
    return ToolResult.error("nothing saved: title and body must not be empty")


@tool(kind=ToolKind.WORK)
async def recall(
    ctx: ToolContext,
    query: Annotated[str, Field(description="Words to look for in knowledge.md")],
) -> ToolResult:
    """Search knowledge.md and return the best matching sections."""
    words = {w.lower() for w in _WORD.findall(query)}
    sections = await asyncio.to_thread(_file(ctx).sections)
    scored = []
    for s in sections:
        found = {w.lower() for w in _WORD.findall(f"{s.title} {s.body}")}
        score = len(words & found)
        if score:
            scored.append((score, s))
    scored.sort(key=lambda pair: -pair[0])
    if not scored:
        return ToolResult(f"no section of knowledge.md matches {query!r}")
    return ToolResult("\n\n".join(f"## {s.title}\n{s.body.strip()}" for _, s in scored[:MAX_RECALL_SECTIONS]))


KNOWLEDGE_TOOLS: tuple[Tool, ...] = (remember, recall)
