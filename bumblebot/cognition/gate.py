"""The completion gate: may the agent loop end this turn?

Spec, "Completion gate". The gate runs on every ending of a turn answering a person: an
``end_turn`` call, or a plain-text reply from an endpoint that does not force tools; reflex
chat turns included. It judges **all user-visible text of the turn** (everything delivered by
``say`` plus the final reply). Only *work* tools count for grounding; agency tools (``say``,
``think``, ``wait``, ``end_turn``) do not. Order:

1. structure: nothing visible at all is never an answer (a scheduled or autonomous turn may
   stay silent);
2. work tools ran (even if they all failed: the reply must then report the failure): the
   **grounding judge** (reflex model, ``DONE:``/``CONTINUE:``) checks that the visible reply
   reflects the tool results;
3. no work tool ran: the **action-adequacy judge** decides, from intent and in any language
   or tone, whether tangible work was asked for and only promised. This runs on ``end_turn``
   too, and on reflex chat turns, where it costs the user nothing: by then the reply is on
   screen.

No list of words decides anything here. Judges see the user's message and what was delivered
(not the history), so a check costs a few hundred tokens; they see no tools. A judge that
errors or answers anything but ``DONE``/``CONTINUE`` lets the turn end (fail-open), and the
loop caps gate continues, so every turn ends.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from bumblebot.core.usage import Usage, tallied

#: A judge is called with chat messages and returns the raw completion text.
Judge = Callable[[list[dict[str, Any]]], Awaitable[str]]

MAX_GATE_CONTINUES = 2
#: Work tools named in a nudge (an MCP server may offer dozens).
NUDGE_TOOLS = 6


@dataclass(frozen=True, slots=True)
class Preview:
    """First 280 characters of a work tool's result (the last 8 are kept for the gate)."""

    tool: str
    ok: bool
    text: str


@dataclass(slots=True)
class GateInput:
    user_text: str
    visible: list[str]
    work_calls: int
    work_ok: int
    previews: list[Preview] = field(default_factory=list)
    ended_by: str = "end_turn"  # or "text"
    last_hit_length: bool = False
    continues_so_far: int = 0
    #: a scheduled or autonomous turn: ending without a message is an answer
    silent_ok: bool = False
    #: the work tools this turn offers (named in the adequacy judge's prompt and its nudge)
    work_tools: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class GateDecision:
    done: bool
    reason: str
    judge: str | None = None  # "grounding", "adequacy" or None (structure)
    nudge: str | None = None
    raw: str | None = None
    #: what the judge's request used, as the meter recorded it (empty: none made or counted)
    usage: tuple[tuple[Usage, float | None], ...] = ()


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def grounding_messages(inp: GateInput) -> list[dict[str, Any]]:
    previews = "\n".join(
        f"- {p.tool} ({'ok' if p.ok else 'FAILED'}): {_clip(p.text, 220)}" for p in inp.previews
    ) or "(no tool results)"
    return [
        {
            "role": "system",
            "content": "You check an assistant's reply before it is final. Answer with exactly one line "
            "starting with DONE: or CONTINUE: followed by a short reason. CONTINUE when the visible "
            "reply ignores or contradicts the tool results, is only a thin acknowledgement, or does not "
            "tell the user what the tools found (or that they failed). DONE when it reports the results.",
        },
        {
            "role": "user",
            "content": f"User asked:\n{_clip(inp.user_text, 1200)}\n\nTool results:\n{previews}\n\n"
            f"Visible reply to the user:\n{_clip(chr(10).join(inp.visible), 1500)}",
        },
    ]


def adequacy_messages(inp: GateInput) -> list[dict[str, Any]]:
    tools = ", ".join(inp.work_tools) if inp.work_tools else "none"
    return [
        {
            "role": "system",
            "content": "You check whether an assistant delivered what the user asked for. It used no work "
            "tool successfully this turn. Judge by intent, in any language or tone. If the user asked for "
            "tangible work its tools could do (a file, a command run, live data, a lookup, something to "
            "keep) and the reply only promised, announced or hand-waved it, answer CONTINUE: <what is "
            "missing>. If the user only chatted, asked something answerable from knowledge, or the reply "
            "delivers what was asked (or honestly explains why it cannot), answer DONE: <reason>. One "
            "line, starting with DONE: or CONTINUE:.",
        },
        {
            "role": "user",
            "content": f"The assistant's work tools: {_clip(tools, 400)}\n\nUser wrote:\n{_clip(inp.user_text, 1200)}\n\n"
            f"Everything the assistant showed the user this turn:\n{_clip(chr(10).join(inp.visible), 2000)}",
        },
    ]


def parse_verdict(raw: str) -> tuple[bool | None, str]:
    """``(True, reason)`` for DONE, ``(False, reason)`` for CONTINUE, ``(None, raw)`` otherwise."""
    text = raw.strip().strip("*`\"' ")
    m = re.match(r"^(DONE|CONTINUE)\b[\s*_:\-–]*(.*)", text, re.IGNORECASE | re.DOTALL)
    if not m:
        return None, raw.strip()
    return m.group(1).upper() == "DONE", m.group(2).strip().splitlines()[0] if m.group(2).strip() else ""


class CompletionGate:
    """Decides whether a turn may end. ``judge`` sends tool-less requests to the reflex model."""

    def __init__(self, judge: Judge) -> None:
        self._judge = judge

    async def check(self, inp: GateInput) -> GateDecision:
        if inp.continues_so_far >= MAX_GATE_CONTINUES:
            return GateDecision(True, f"gate continue cap ({MAX_GATE_CONTINUES}) reached")
        visible = "\n".join(t for t in inp.visible if t.strip())
        if not visible.strip() and inp.silent_ok:
            return GateDecision(True, "nothing to say: a scheduled or autonomous turn may stay silent")
        if not visible.strip():
            why = "the last completion hit the length limit" if inp.last_hit_length else "nothing was said"
            return GateDecision(
                False,
                f"no visible reply ({why})",
                nudge="You have not said anything to the user in this turn. Call say() with your reply "
                "(keep it within the length budget), then end_turn().",
            )
        if inp.work_calls > 0:
            return await self._ask("grounding", grounding_messages(inp), inp)
        return await self._ask("adequacy", adequacy_messages(inp), inp)

    async def _ask(self, name: str, messages: list[dict[str, Any]], inp: GateInput) -> GateDecision:
        with tallied() as used:
            decision = await self._verdict(name, messages, inp)
        return dataclasses.replace(decision, usage=tuple(used))

    async def _verdict(self, name: str, messages: list[dict[str, Any]], inp: GateInput) -> GateDecision:
        try:
            raw = await self._judge(messages)
        except Exception as exc:  # a failing judge never blocks the turn
            return GateDecision(True, f"{name} judge failed ({type(exc).__name__}); ending", judge=name)
        verdict, reason = parse_verdict(raw)
        if verdict is None:
            return GateDecision(True, f"{name} judge answer unreadable; ending", judge=name, raw=raw)
        if verdict:
            return GateDecision(True, reason or "done", judge=name, raw=raw)
        if name == "grounding":
            nudge = (
                f'Your reply to the user does not yet reflect the tool results (the check says: "{reason}"). Tell the user '
                "what the tools actually returned, with say(), then end_turn()."
            )
        elif inp.work_tools:
            named = ", ".join(inp.work_tools[:NUDGE_TOOLS]) + (", ..." if len(inp.work_tools) > NUDGE_TOOLS else "")
            nudge = (
                f'The user asked for real work that was not done yet (the check says: "{reason}"). Do it now with your work '
                f"tools ({named}), then say() the result and end_turn(). If it truly cannot be done, say "
                "so plainly."
            )
        else:
            nudge = (
                f'The user asked for something not done yet (the check says: "{reason}"). You have no tools for it: say() '
                "plainly what you can and cannot do, then end_turn()."
            )
        return GateDecision(False, reason or "continue", judge=name, nudge=nudge, raw=raw)
