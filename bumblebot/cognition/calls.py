"""The tool calls of one step: fitting what the model wrote into what can be recorded and run,
running the calls together (each under its timeout, unless ``/stop`` comes first), and
recording each result as soon as it completes."""

from __future__ import annotations

import asyncio
import time

from bumblebot.cognition.compaction import cap_tool_result
from bumblebot.cognition.limits import reply_chars
from bumblebot.cognition.notes import STOPPED_RESULT, clip, refused
from bumblebot.cognition.run import Run
from bumblebot.cognition.state import say_text
from bumblebot.cognition.steps import UNTIMED, StepBudget, Stopped, all_or_none, unless_stopped
from bumblebot.core.events import storable_text
from bumblebot.core.messages import Message, json_object, json_text, loose_object
from bumblebot.core.textrules import strip_reasoning
from bumblebot.core.toolkit import Toolbox, ToolContext, ToolResult
from bumblebot.llm import ToolCall


class Calls:
    """Runs the calls of a step with the toolbox it is given."""

    def __init__(self, toolbox: Toolbox) -> None:
        self.toolbox = toolbox

    async def run_step(self, run: Run, plan: list[tuple[ToolCall, bool]], unusable: dict[str, str]) -> list[str]:
        """Run a step's calls concurrently, recording each result as it completes; returns the
        names of the calls that failed. A call in ``unusable`` (id -> why) is not run: its
        result is that error. ``plan`` pairs each call with whether the repeat guard lets it run."""
        budget = StepBudget(run.limits.max_tool_result_chars, len(plan))
        port = run.port
        step = run.trace.steps[-1]

        async def one(call: ToolCall, allowed: bool) -> tuple[ToolResult, float]:
            ctx = run.call_context(call.id)
            if call.id in unusable:
                result, seconds = ToolResult.error(unusable[call.id]), 0.0
            elif call.name in UNTIMED:  # a delivery is never cut off halfway (see execute)
                result, seconds = await self.execute(call, allowed, ctx, run)
            else:
                try:
                    result, seconds = await unless_stopped(port.stop, self.execute(call, allowed, ctx, run))
                except Stopped:
                    result, seconds = ToolResult.error(STOPPED_RESULT), 0.0
            fitted = budget.fit(result)
            if fitted is not result:
                run.trace.cut("result_cap", call=call.id, chars=len(result.content) - len(fitted.content))
            await port.record(
                Message(role="tool", content=fitted.content, tool_call_id=call.id, name=call.name, ok=fitted.ok)
            )
            return fitted, seconds

        results = await all_or_none([one(c, allowed) for c, allowed in plan])
        failed: list[str] = []
        for (call, _), (result, seconds) in zip(plan, results, strict=True):
            step["tool_calls"].append(
                {"name": call.name, "ok": result.ok, "seconds": round(seconds, 3), "kind": str(self.toolbox.kind(call.name))}
            )
            run.state.on_result(call, result)
            if not result.ok:
                failed.append(call.name)
        return failed

    async def execute(self, call: ToolCall, run_it: bool, ctx: ToolContext, run: Run) -> tuple[ToolResult, float]:
        """One call's result and the seconds it took; a refusal when ``run_it`` is false."""
        started = time.monotonic()
        limits = run.limits
        if not run_it:
            return refused(call.name), 0.0
        if call.name in UNTIMED:
            # delivery bounds itself (a few attempts, each wait capped); cancelling it midway
            # would leave the message pending for the sweeper while the model, told it failed,
            # says it again: the user would get it twice
            result = await self.toolbox.execute(call.name, call.arguments, ctx)
        else:
            timeout = self.toolbox.timeout_s(call.name) or limits.tool_timeout_s
            try:
                result = await asyncio.wait_for(self.toolbox.execute(call.name, call.arguments, ctx), timeout)
            except TimeoutError:
                result = ToolResult.error(f"{call.name} timed out after {timeout:g} s")
        if len(result.content) > limits.max_tool_result_chars:
            # one huge result must not brick the session
            run.trace.cut("result_cap", call=call.id, chars=len(result.content) - limits.max_tool_result_chars)
            result = ToolResult(cap_tool_result(result.content, limits.max_tool_result_chars), ok=result.ok)
        return result, time.monotonic() - started

    async def deliver_recorded(self, call: ToolCall, run: Run) -> ToolResult:
        """A ``say`` or ``send_file`` recorded before a crash that never reached the outbox:
        nothing of it was sent, so it is delivered now, exactly as recorded."""
        if call.name == "say":
            text = say_text(call.arguments)
            if not text:
                return ToolResult.error("nothing to say: text is empty")
            return (await run.port.say(text, call_id=call.id)).as_result()
        return await self.toolbox.execute(call.name, call.arguments, run.call_context(call.id))


def fit_text(text: str, run: Run, call: str | None = None) -> str:
    """``text`` cut to what one reply may hold under the step's token budget (the cut is traced)."""
    limit = reply_chars(run.limits)
    if len(text) <= limit:
        return text
    run.trace.cut("say_budget", call=call, chars=len(text) - limit + 1)
    return text[: limit - 1].rstrip() + "…"


def fit_call(call: ToolCall, run: Run) -> tuple[ToolCall, str | None]:
    """The call as it is recorded and run, and why it cannot run (``None``: it can).

    Arguments that are not a JSON object (garbage, or cut off at the token budget) are
    recorded as ``{}`` and the call is not run: strict endpoints (vLLM) refuse a history
    holding invalid arguments for every later request, and a server that ignored
    ``max_tokens`` must not grow the transcript past the window with them. A ``say`` keeps
    no reasoning, and one longer than the step's budget allowed is cut to it before it is
    recorded or sent: one reply must not outgrow the window.
    """
    try:
        args = json_object(call.arguments)
    except ValueError as exc:
        problem = str(exc)
        loose = loose_object(call.arguments)  # a line break written raw in a string: escaped
        if loose is not None:
            return fit_call(ToolCall(id=call.id, name=call.name, arguments=json_text(loose)), run)
    else:
        if call.name == "say" and isinstance(args.get("text"), str):
            raw = args["text"]
            reasoned = strip_reasoning(raw)
            if reasoned != raw.strip():
                run.trace.cut("reasoning", call=call.id, chars=len(raw) - len(reasoned))
            # history never keeps reasoning, nor a lone surrogate (no store or request takes one)
            clean = storable_text(fit_text(reasoned, run, call.id))
            if clean != raw:
                args["text"] = clean
                return ToolCall(id=call.id, name=call.name, arguments=json_text(args)), None
        return call, None
    error = (
        f"Not run: the arguments of {call.name} were {problem}; they began {clip(call.arguments, 80)!r}. "
        "Call it again with a JSON object of its parameters, and keep it short."
    )
    return ToolCall(id=call.id, name=call.name, arguments="{}"), error
