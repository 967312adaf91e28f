"""Agency tools: ``say``, ``think``, ``wait``, ``end_turn``.

They steer the running turn through :class:`bumblebot.core.toolkit.TurnControl` and never count
as grounding (docs/cognition.md, "The completion gate"). Outside a turn (``ctx.turn is None``) each returns
an error result. Because the engine forces ``tool_choice="required"`` (docs/cognition.md,
"The agent loop"), ``say`` is the only way the entity talks to the conversation.
"""

from __future__ import annotations

import asyncio
import math
from typing import Annotated

from pydantic import Field

from bumblebot.core.events import blank
from bumblebot.core.toolkit import ToolContext, ToolKind, ToolResult, TurnControl

from .definition import Tool, tool

__all__ = ["AGENCY_TOOLS", "MAX_WAIT_S", "end_turn", "say", "think", "wait"]

#: Upper bound of ``wait``, in seconds: a longer pause would hold the turn, and every
#: message waiting behind it in the conversation, for nothing.
MAX_WAIT_S = 15.0

_NO_TURN = "no turn is running"


def _turn(ctx: ToolContext) -> TurnControl | None:
    return ctx.turn


@tool(kind=ToolKind.AGENCY, brief="Send a chat message to the user (the only way to talk).")
async def say(
    ctx: ToolContext,
    text: Annotated[str, Field(description="The message to send, as you want it read")],
) -> ToolResult:
    """Send a message to the conversation now. This is the only way to talk to the user:
    plain text outside tool calls is never shown. If the result says "queued", delivery
    will be retried automatically, so do not send it again.

    Returns ``{"delivered": bool, "queued": bool, "error"?: str}``; ``ok`` is
    ``delivered or queued``.
    """
    turn = _turn(ctx)
    if turn is None:
        return ToolResult.error(_NO_TURN)
    if blank(text):  # invisible characters only: a message that shows nothing
        return ToolResult.error("nothing to say: text is empty")
    report = await turn.say(text, call_id=ctx.call_id)
    return report.as_result()


@tool(kind=ToolKind.AGENCY, brief="Write a private note nobody sees.", optional=True)
async def think(
    ctx: ToolContext,
    thought: Annotated[str, Field(description="A private note; never shown to the user")],
) -> ToolResult | str:
    """Write down a private thought (planning, doubts, what to do next). Nobody sees it."""
    turn = _turn(ctx)
    if turn is None:
        return ToolResult.error(_NO_TURN)
    turn.think(thought)
    return "noted"


@tool(kind=ToolKind.AGENCY, brief="Pause a few seconds.", optional=True)
async def wait(
    ctx: ToolContext,
    seconds: Annotated[
        float,
        Field(description=f"How long to wait, 0 to {MAX_WAIT_S:g} seconds", allow_inf_nan=False),
    ] = 3,
) -> str:
    """Pause for a few seconds before going on, e.g. to let something finish."""
    clamped = min(max(seconds, 0.0), MAX_WAIT_S)
    await asyncio.sleep(clamped)
    note = "" if math.isclose(clamped, seconds) else f" (asked for {seconds:g} s)"
    return f"waited {clamped:g} s{note}"


@tool(kind=ToolKind.AGENCY, brief="End your turn once the work is done and said.")
async def end_turn(
    ctx: ToolContext,
    summary: Annotated[str, Field(description="Optional private note on how the turn went")] = "",
) -> ToolResult | str:
    """End your turn once you have said everything and finished the work; call it last.
    Ending may be refused if the user's request was not done yet.
    """
    turn = _turn(ctx)
    if turn is None:
        return ToolResult.error(_NO_TURN)
    if summary.strip():
        turn.think(summary)
    turn.end_turn()
    return "ending turn"


#: The four agency tools, in the order they are offered.
AGENCY_TOOLS: tuple[Tool, ...] = (say, think, wait, end_turn)
