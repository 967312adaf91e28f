"""The bounded agent loop of one turn (spec, "Agent loop").

Each step sends one chat completion with every tool and tool forcing. Tool calls of a step run
concurrently (``asyncio.gather``), each under a timeout, and their results are appended in call
order with matching ids. Speaking is the ``say`` tool; ending is ``end_turn``, which goes
through the completion gate. Text the model writes alongside tool calls is private reasoning and
is never delivered. A plain-text answer (an endpoint that does not enforce ``tool_choice``) is
delivered as an implicit ``say`` unless it only repeats what was already said.

Limits: tool continuation rounds are clamped to [0, 16]; steps are capped at
``max(6, min(25, 6 + rounds))``; the same call (tool and arguments) may not run a third time in a
row; after 3 consecutive length-limited completions the model is told to use ``write_file``.
Hitting a cap ends the turn with an honest short message, never silence.

Internal nudges (post-tool, gate) live only in the request of the next step: they are never
stored as if the user had written them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from difflib import SequenceMatcher
from typing import Any

from bumblebot.compaction import cap_tool_result
from bumblebot.errors import ContextTooLong
from bumblebot.gate import CompletionGate, GateInput, Preview
from bumblebot.llm import LLM, Completion, ToolCall, strip_reasoning
from bumblebot.messages import Message
from bumblebot.toolkit import DeliveryReport, ToolContext, Toolbox, ToolKind, ToolResult

log = logging.getLogger(__name__)

PREVIEW_CHARS = 280
PREVIEW_COUNT = 8
REPEAT_LIMIT = 3
LENGTH_STALL_LIMIT = 3
UNGUARDED = frozenset({"end_turn"})
#: Tools not run under the tool timeout: ``say`` is bounded by the delivery policy itself.
UNTIMED = frozenset({"say"})

STEP_CAP_MESSAGE = (
    "I had to stop here: this took more steps than I'm allowed in one turn. "
    "Tell me to continue and I'll pick it up from where I stopped."
)
NO_REPLY_MESSAGE = "Sorry, I couldn't put an answer together this time. Could you say that again?"
_PRO_FORMA = frozenset({"done", "done.", "ok", "ok.", "okay", "okay.", "sure", "got it", "✅", "👍", "all done", "all done."})


def max_steps(rounds: int) -> int:
    """Spec: rounds clamped to [0, 16]; total steps ``max(6, min(25, 6 + rounds))``."""
    rounds = min(16, max(0, rounds))
    return max(6, min(25, 6 + rounds))


def canonical_arguments(arguments: str) -> str:
    try:
        return json.dumps(json.loads(arguments or "{}"), sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError):
        return arguments.strip()


def _norm(text: str) -> str:
    return " ".join(text.lower().split())


_FILLER = re.compile(
    r"^(is there )?anything else( i can (help|do)[^?]*)?\??$|^let me know if[^.!?]*[.!?]?$"
    r"|^(i )?hope (this|that) helps[.!]?$|^(feel free to ask|happy to help)[^.!?]*[.!?]?$",
    re.IGNORECASE,
)


def repeats_said(text: str, said: list[str]) -> bool:
    """``text`` only repeats what ``say`` already delivered, or is a pro-forma "done" or closing
    filler ("Anything else I can help with?") after something was said."""
    norm = _norm(text)
    if not norm:
        return True
    if said and (norm.strip(" .!") in {p.strip(" .!") for p in _PRO_FORMA} or _FILLER.match(norm)):
        return True
    joined = " ".join(_norm(s) for s in said)
    if not joined:
        return False
    if norm in joined:
        return True
    candidates = [_norm(s) for s in said] + [joined]
    return any(SequenceMatcher(None, norm, c).ratio() >= 0.85 for c in candidates)


@dataclass(slots=True)
class LoopLimits:
    max_steps: int
    max_tokens: int
    model: str
    thinking: bool
    tool_timeout_s: float
    max_tool_result_chars: int = 32768
    temperature: float | None = None


@dataclass(slots=True)
class StepTrace:
    step: int
    finish_reason: str
    prompt_tokens: int | None
    estimate: int
    completion_tokens: int | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: str | None = None


@dataclass(slots=True)
class LoopResult:
    messages: list[Message]
    stop_reason: str
    steps: list[StepTrace]
    gate: list[dict[str, Any]]
    delivered: list[str]
    thoughts: list[str]


class TurnState:
    """Per-turn state; implements :class:`bumblebot.toolkit.TurnControl` for the agency tools."""

    def __init__(self, deliver: Callable[[str], Awaitable[DeliveryReport]]) -> None:
        self._deliver = deliver
        self._order = asyncio.Lock()  # FIFO: several say() calls of one step keep call order
        self.delivered: list[str] = []
        self.thoughts: list[str] = []
        self.end_requested = False
        #: the platform refused a message for good (blocked bot, deleted chat): talking on is futile
        self.undeliverable: str | None = None

    async def say(self, text: str) -> DeliveryReport:
        text = strip_reasoning(text)  # reasoning never reaches the user, on any path
        if not text:
            return DeliveryReport(delivered=False, error="nothing to say after removing reasoning")
        if self.undeliverable:
            return DeliveryReport(delivered=False, error=self.undeliverable)
        async with self._order:  # checked under the lock: two equal says of one step count too
            if _norm(text) in {_norm(t) for t in self.delivered}:
                return DeliveryReport(delivered=True, duplicate=True)
            report = await self._deliver(text)
            if report.delivered or report.queued:
                self.delivered.append(text)
        if report.chat_unreachable:
            self.undeliverable = report.error or "the platform refused the message"
        return report

    def end_turn(self) -> None:
        self.end_requested = True

    def think(self, thought: str) -> None:
        self.thoughts.append(thought)


class RequestBuilder:
    """What the loop needs from the conversation: requests built from the turn's messages.

    ``build(turn_messages, nudge)`` returns the full message list for the next completion
    (system prompt, history, summary, this turn's messages with the preamble, the nudge) and
    its token estimate; compaction runs inside it when the estimate crosses the threshold.
    ``take_steering()`` returns user messages that arrived during the turn (steer mode) with
    their journal ids.
    """

    async def build(self, turn_messages: list[Message], nudge: str | None) -> tuple[list[dict[str, Any]], int]:
        raise NotImplementedError

    def take_steering(self) -> list[tuple[Message, list[int]]]:
        return []

    async def shrink(self, turn_messages: list[Message]) -> None:
        """The endpoint said the prompt is too long: compact (or prune) before one retry."""

    def call_ids(self) -> set[str]:
        """Tool call ids already used in the conversation (new ones must differ)."""
        return set()

    def observe_usage(self, prompt_tokens: int | None, estimate: int) -> None:
        """The endpoint reported ``prompt_tokens`` for a request we estimated at ``estimate``."""


class AgentLoop:
    """Runs one turn. Collaborators come in through the constructor."""

    def __init__(self, *, llm: LLM, toolbox: Toolbox, gate: CompletionGate, tool_context: ToolContext) -> None:
        self.llm = llm
        self.toolbox = toolbox
        self.gate = gate
        self.tool_context = tool_context

    async def run(
        self,
        *,
        user_message: Message,
        requests: RequestBuilder,
        limits: LoopLimits,
        deliver: Callable[[str], Awaitable[DeliveryReport]],
        transcript: list[Message] | None = None,
        conversation: str = "",
    ) -> LoopResult:
        """Run the turn that ``user_message`` starts.

        Args:
            transcript: the list the turn's messages are appended to as they happen (it must
                start with ``user_message``); if the loop raises, it holds everything up to the
                failure as a valid sequence, so the caller can still store what happened.

        Raises:
            ModelError: the endpoint failed (after the one retry on a context-length refusal).
        """
        state = TurnState(deliver)
        ctx = ToolContext(
            workspace=self.tool_context.workspace,
            data_dir=self.tool_context.data_dir,
            turn=state,
            conversation=conversation,
            extras=self.tool_context.extras,
        )
        turn: list[Message] = transcript if transcript is not None else [user_message]
        user_texts = [user_message.content]
        steps: list[StepTrace] = []
        gate_log: list[dict[str, Any]] = []
        previews: deque[Preview] = deque(maxlen=PREVIEW_COUNT)
        work_calls = work_ok = 0
        repeat_key: tuple[str, str] | None = None
        repeat_count = 0
        length_stalls = 0
        gate_continues = 0
        nudge: str | None = None
        stop_reason = "step_cap"
        schemas = self.toolbox.schemas()
        used_ids = requests.call_ids()

        while len(steps) < limits.max_steps:
            if state.undeliverable:
                stop_reason = "undeliverable"  # e.g. the user blocked the bot: stop spending tokens
                break
            for steer, _ in requests.take_steering():
                turn.append(steer)
                user_texts.append(steer.content)
                nudge = None
            request, estimate = await requests.build(turn, nudge)
            try:
                completion: Completion = await self._complete(request, schemas, limits)
            except ContextTooLong:
                # spec/issue: compact (or prune) and retry once; a second refusal ends the turn
                await requests.shrink(turn)
                request, estimate = await requests.build(turn, nudge)
                completion = await self._complete(request, schemas, limits)
            trace = StepTrace(
                step=len(steps) + 1,
                finish_reason=completion.finish_reason,
                prompt_tokens=completion.prompt_tokens,
                completion_tokens=completion.completion_tokens,
                estimate=estimate,
                tool_choice=completion.tool_choice,
            )
            steps.append(trace)
            requests.observe_usage(completion.prompt_tokens, estimate)
            length_stalls = length_stalls + 1 if completion.hit_length else 0
            nudge = None

            if completion.tool_calls:
                calls = [_unique_id(c, used_ids) for c in completion.tool_calls]
                turn.append(
                    Message(role="assistant", content=completion.content, tool_calls=[c.to_api() for c in calls])
                )
                plan: list[tuple[ToolCall, bool]] = []
                for call in calls:
                    key = (call.name, canonical_arguments(call.arguments))
                    if call.name in UNGUARDED:
                        plan.append((call, True))
                        continue
                    repeat_count = repeat_count + 1 if key == repeat_key else 1
                    repeat_key = key
                    plan.append((call, repeat_count < REPEAT_LIMIT))
                results = await asyncio.gather(*(self._execute(c, run, ctx, limits) for c, run in plan))
                results = _cap_step(results, limits.max_tool_result_chars)
                failed: list[str] = []
                for (call, _), (result, seconds) in zip(plan, results, strict=True):
                    kind = self.toolbox.kind(call.name)
                    turn.append(Message(role="tool", content=result.content, tool_call_id=call.id, name=call.name))
                    trace.tool_calls.append(
                        {"name": call.name, "ok": result.ok, "seconds": round(seconds, 3), "kind": str(kind)}
                    )
                    if not result.ok:
                        failed.append(call.name)
                    if kind is ToolKind.WORK:
                        work_calls += 1
                        work_ok += int(result.ok)
                        previews.append(Preview(call.name, result.ok, result.content[:PREVIEW_CHARS]))
                if state.end_requested:
                    state.end_requested = False
                    decision = await self.gate.check(
                        GateInput(
                            user_text="\n".join(user_texts),
                            visible=state.delivered,
                            work_calls=work_calls,
                            work_ok=work_ok,
                            previews=list(previews),
                            ended_by="end_turn",
                            last_hit_length=completion.hit_length,
                            continues_so_far=gate_continues,
                        )
                    )
                    gate_log.append(_gate_entry(trace.step, decision))
                    if decision.done:
                        stop_reason = "end_turn"
                        break
                    gate_continues += 1
                    nudge = decision.nudge
                    continue
                nudge = post_tool_nudge(failed, state.delivered)
                if length_stalls >= LENGTH_STALL_LIMIT:
                    nudge += " " + LENGTH_ADVICE
                continue

            # A completion without tool calls: the endpoint did not force tools.
            text = completion.content.strip()
            if text:
                # spec, "Intermediate delivery": a final reply that only echoes what say() already
                # delivered (or is closing filler) is suppressed; new content is never dropped
                if state.delivered and repeats_said(text, state.delivered):
                    # not shown, so not stored as if the user had seen it
                    trace.tool_calls.append({"name": "(final reply)", "suppressed": True})
                else:
                    await state.say(text)
                    turn.append(Message(role="assistant", content=text))
            decision = await self.gate.check(
                GateInput(
                    user_text="\n".join(user_texts),
                    visible=state.delivered,
                    work_calls=work_calls,
                    work_ok=work_ok,
                    previews=list(previews),
                    ended_by="text",
                    last_hit_length=completion.hit_length,
                    continues_so_far=gate_continues,
                )
            )
            gate_log.append(_gate_entry(trace.step, decision))
            if decision.done:
                stop_reason = "final_reply"
                break
            gate_continues += 1
            nudge = decision.nudge
            if length_stalls >= LENGTH_STALL_LIMIT:
                nudge = (nudge or "") + " " + LENGTH_ADVICE

        note = None
        if stop_reason == "step_cap":
            note = STEP_CAP_MESSAGE
        elif stop_reason != "undeliverable" and not state.delivered:
            stop_reason += "+fallback"
            note = NO_REPLY_MESSAGE
        if note is not None:
            await state.say(note)
            turn.append(Message(role="assistant", content=note))  # next turn knows what was said
        return LoopResult(
            messages=turn,
            stop_reason=stop_reason,
            steps=steps,
            gate=gate_log,
            delivered=list(state.delivered),
            thoughts=list(state.thoughts),
        )

    async def _complete(self, request: list[dict[str, Any]], schemas: list[dict[str, Any]], limits: LoopLimits) -> Completion:
        return await self.llm.complete(
            request,
            model=limits.model,
            max_tokens=limits.max_tokens,
            temperature=limits.temperature,
            tools=schemas,
            thinking=limits.thinking,
        )

    async def _execute(
        self, call: ToolCall, run: bool, ctx: ToolContext, limits: LoopLimits
    ) -> tuple[ToolResult, float]:
        started = time.monotonic()
        if not run:
            return (
                ToolResult.error(
                    f"Not executed: you already called {call.name} with exactly these arguments "
                    f"{REPEAT_LIMIT - 1} times in a row. Its result is above; use it, try something "
                    "different, or tell the user and end_turn."
                ),
                0.0,
            )
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
            # one huge result must not brick the session (field-bugs.md item 12)
            result = ToolResult(cap_tool_result(result.content, limits.max_tool_result_chars), ok=result.ok)
        return result, time.monotonic() - started


LENGTH_ADVICE = (
    "Your last replies hit the length limit three times in a row. Put long output in a file with "
    "write_file, then say() a short summary and where the file is."
)


def post_tool_nudge(failed: list[str], delivered: list[str]) -> str:
    """The short note after a tool round (spec, "Post-tool nudge")."""
    parts = ["[Same turn] Tool results are ready."]
    if failed:
        parts.append("Failed: " + ", ".join(dict.fromkeys(failed)) + ".")
    if delivered:
        told = "; ".join(f'"{_clip(t, 80)}"' for t in delivered[-3:])
        parts.append(f"Already told the user (do not repeat): {told}.")
    parts.append("Next: call more tools, say() to talk to the user, or end_turn() when done.")
    return " ".join(parts)


def _cap_step(results: list[tuple[ToolResult, float]], budget: int) -> list[tuple[ToolResult, float]]:
    """Keep one step's results within ``budget`` characters together (each is already capped
    alone): parallel calls must not overflow the window between them (field-bugs.md item 12)."""
    total = sum(len(r.content) for r, _ in results)
    if total <= budget:
        return results
    share = max(500, budget // len(results))
    return [
        (ToolResult(cap_tool_result(r.content, share), ok=r.ok) if len(r.content) > share else r, t)
        for r, t in results
    ]


_ALNUM9 = re.compile(r"^[A-Za-z0-9]{9}$")


def _unique_id(call: ToolCall, used: set[str]) -> ToolCall:
    """``call`` with an id not used before in this conversation.

    Some servers (llama.cpp among them) reuse one id for every call; a repeated id would make
    the history an invalid sequence. A replacement keeps the original's shape when it is the
    9-character alphanumeric form some APIs (Mistral) insist on.
    """
    new_id = call.id
    while new_id in used:
        token = uuid.uuid4().hex
        new_id = token[:9] if _ALNUM9.match(call.id) else f"call_{token[:24]}"
    used.add(new_id)
    return call if new_id == call.id else ToolCall(id=new_id, name=call.name, arguments=call.arguments)


def _clip(text: str, n: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "…"


def _gate_entry(step: int, decision: Any) -> dict[str, Any]:
    return {"step": step, "done": decision.done, "reason": decision.reason, "judge": decision.judge}
