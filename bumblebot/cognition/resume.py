"""Picking a turn up where a crash (or a bug) left it.

What the loop knows of a turn is a function of its record, so a resumed turn rebuilds its
state from the transcript (:meth:`LoopState.replay`) and closes what the crash cut off:

* a call whose result was recorded is never run again;
* a ``say`` (or ``send_file``) cut off before it reached the outbox is delivered as recorded
  (nothing of it was sent: there is no outbox row), one that reached it is answered from its
  row (delivered, queued, or refused);
* any other call that was cut off gets a result saying it was interrupted and may or may not
  have taken effect; it is not silently run again;
* a step that had ended the turn goes to the gate again.
"""

from __future__ import annotations

import logging

from bumblebot.cognition.calls import Calls
from bumblebot.cognition.notes import INTERRUPTED, post_tool_nudge, refused
from bumblebot.cognition.port import TurnPort
from bumblebot.cognition.run import Run
from bumblebot.cognition.state import DELIVERIES, api_call
from bumblebot.cognition.steps import COMPLETED_ON_RESUME, delivery_of, last_block, lost, open_calls
from bumblebot.core.messages import Message
from bumblebot.core.toolkit import ToolResult

log = logging.getLogger(__name__)


async def close_interrupted(run: Run, calls: Calls) -> tuple[str | None, str | None]:
    """Give the calls a crash cut off a result, and say what the last recorded step asks for
    next: ``("end_turn" | "text", None)`` when it had ended the turn (the gate decides again),
    ``(None, nudge)`` after a tool round, ``(None, None)`` otherwise."""
    port = run.port
    closed = await close_open_calls(port, ToolResult.error(INTERRUPTED), run, calls)
    if closed:
        log.info("resumed a turn: %d interrupted call(s) closed", closed)
    last = port.transcript[-1]
    if last.role == "assistant" and not last.tool_calls and not last.note:
        return "text", None
    if last.role != "tool":
        return None, None
    block = last_block(port.transcript)
    failed = [m.name or "" for m in block[1:] if m.ok is False]
    ended = any(api_call(c).name == "end_turn" for c in block[0].tool_calls or ())
    if ended and not any(lost(m) for m in block[1:]):
        return "end_turn", None
    return None, post_tool_nudge(failed, run.state.delivered)


async def close_open_calls(port: TurnPort, other: ToolResult, run: Run | None = None, calls: Calls | None = None) -> int:
    """Record a result for each call of the transcript that has none; returns how many. With
    ``run`` and ``calls`` (a resume), a delivery with no outbox row is made now; without them
    (the turn is given up) nothing new is sent and a work call gets ``other``."""
    cut_off = [api_call(c) for c in open_calls(port.transcript)]
    if not cut_off:
        return 0
    rows = {e.tool_call_id: e for e in await port.outbox() if e.tool_call_id}
    for call in cut_off:
        if call.name in DELIVERIES and run is not None and calls is not None and call.id not in rows:
            # the repeat guard decided when the step was recorded
            allowed = run.state.allowed.get(call.id, True)
            result = await calls.deliver_recorded(call, run) if allowed else refused(call.name)
        elif call.name in DELIVERIES:
            result = delivery_of(rows.get(call.id)).as_result()
        elif call.name in COMPLETED_ON_RESUME:
            result = ToolResult(COMPLETED_ON_RESUME[call.name])
        else:
            result = other
        await port.record(Message(role="tool", content=result.content, tool_call_id=call.id, name=call.name, ok=result.ok))
        if run is not None:
            run.state.on_result(call, result)
    return len(cut_off)
