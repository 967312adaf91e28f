"""Knowledge tools (kind WORK): durable facts, private to the conversation they come from.

``remember`` appends a section to the conversation's own file
(``<data_dir>/knowledge/<chat>.md``, :class:`bumblebot.cognition.knowledge.Memory`); ``recall`` searches
that file and the global ``<data_dir>/knowledge.md`` (the operator's, shared by every
conversation). A fact remembered in one chat never appears in another's prompt or recall.
Writes go through :class:`bumblebot.cognition.knowledge.KnowledgeFile`: atomic, titles deduplicated
(case- and whitespace-insensitive), ``[locked]`` sections never changed or duplicated.
"""

from __future__ import annotations

import asyncio
from typing import Annotated

from pydantic import Field

from bumblebot.cognition.knowledge import KnowledgeFile, Memory, Section, normalize_title, relevant
from bumblebot.core.toolkit import ToolContext, ToolKind, ToolResult

from .definition import Tool, tool

MAX_RECALL_SECTIONS = 5


def _own(ctx: ToolContext) -> KnowledgeFile:
    return Memory(ctx.data_dir).of(ctx.conversation)


def _searchable(ctx: ToolContext) -> list[Section]:
    """This conversation's sections, then the global ones (files that do not exist yet count
    as empty; nothing is created by a search)."""
    memory = Memory(ctx.data_dir)
    out: list[Section] = []
    for file in (memory.of(ctx.conversation), memory.shared):
        if file.path.exists():
            out += file.sections()
    return out


@tool(kind=ToolKind.WORK, brief="Save a durable fact for later conversations.")
async def remember(
    ctx: ToolContext,
    title: Annotated[str, Field(description="Short section title, e.g. 'Alice's preferences'")],
    body: Annotated[str, Field(description="The facts to keep, in Markdown")],
) -> ToolResult:
    """Save a durable fact about this conversation so you still know it in later turns here
    (it is kept for this chat only)."""
    knowledge, shared = _own(ctx), Memory(ctx.data_dir).shared
    key = normalize_title(title)
    locked = shared.path.exists() and any(s.locked and normalize_title(s.title) == key for s in shared.sections())
    added = [] if locked else await asyncio.to_thread(knowledge.append_sections, [(title, body)])
    if added:
        return ToolResult(f"saved section '{added[0]}'")
    existing = [s.title for s in knowledge.sections() if normalize_title(s.title) == key]
    if locked or existing or title.strip().lower().startswith("[locked]"):
        return ToolResult.error(f"a section titled '{title}' already exists or is locked; choose another title")
    return ToolResult.error("nothing saved: title and body must not be empty")


@tool(kind=ToolKind.WORK, brief="Search the saved facts.")
async def recall(
    ctx: ToolContext,
    query: Annotated[str, Field(description="Words to look for in the saved facts")],
) -> ToolResult:
    """Search the facts saved in this conversation and the shared knowledge; returns the
    best matching sections."""
    found = relevant(await asyncio.to_thread(_searchable, ctx), query, MAX_RECALL_SECTIONS)
    if not found:
        return ToolResult(f"no saved fact matches {query!r}")
    return ToolResult("\n\n".join(f"## {s.title}\n{s.body.strip()}" for s in found))


KNOWLEDGE_TOOLS: tuple[Tool, ...] = (remember, recall)
