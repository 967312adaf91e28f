"""What one turn did, as ``bumblebot trace`` and the operator read it: its steps, the completion
check's verdicts, every text the engine cut, why the turn stopped."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from bumblebot.cognition.gate import GateDecision
from bumblebot.core.messages import Message
from bumblebot.core.usage import Usage


class StopReason(StrEnum):
    """Why a turn ended."""

    #: the model called ``end_turn`` and the completion check let it end
    END_TURN = "end_turn"
    #: the model answered in plain text (an endpoint that does not force tools) and the check let it end
    FINAL_REPLY = "final_reply"
    STEP_CAP = "step_cap"
    #: three steps in a row brought nothing new
    LOOPING = "looping"
    #: the replies kept running past the token budget
    BUDGET = "budget"
    #: the turn's own steps filled the window after it had answered
    CONTEXT_FULL = "context_full"
    #: the platform refuses every message to the chat (the bot was blocked)
    UNDELIVERABLE = "undeliverable"
    #: ``/stop``
    STOPPED = "stopped"
    #: at its message cap, with a person's message waiting for a turn of its own
    MESSAGE_WAITING = "message_waiting"
    # ended by the turn's runner, not the loop
    MODEL_ERROR = "model_error"
    MODEL_UNREACHABLE = "model_unreachable"
    #: a spending limit (``limits``) refused the turn's next model request
    SPENDING_LIMIT = "spending_limit"
    RESUME_CAP = "resume_cap"
    CRASH = "crash"
    FILES_UNUSABLE = "files_unusable"
    NOTHING_TO_RESUME = "nothing_to_resume"

    @property
    def limit(self) -> bool:
        """The turn stopped at a limit, not because the model ended it."""
        return self in (StopReason.STEP_CAP, StopReason.LOOPING, StopReason.BUDGET)


class StopFlag(StrEnum):
    """How a turn's end went."""

    #: the check still found the request undone when its continues ran out
    UNFINISHED = "unfinished"
    #: nothing was said; the answer came from the tool-less try for a plain answer
    LAST_CHANCE = "last_chance"
    #: nothing was said, and the plain try gave nothing either: the plain note answered
    FALLBACK = "fallback"
    #: a scheduled or autonomous turn that said nothing (its answer)
    SILENT = "silent"


@dataclass(frozen=True, slots=True)
class Stop:
    """Why a turn ended, and how."""

    reason: StopReason
    flags: frozenset[StopFlag] = frozenset()

    def __str__(self) -> str:
        return "+".join([self.reason.value, *sorted(self.flags)])

    def flagged(self, flag: StopFlag) -> Stop:
        return Stop(self.reason, self.flags | {flag})

    @classmethod
    def parse(cls, text: str) -> Stop:
        """The stop a trace or a turn's state recorded as text (``str(stop)``)."""
        reason, *flags = text.split("+")
        return cls(StopReason(reason), frozenset(StopFlag(f) for f in flags))


@dataclass(slots=True)
class StepTrace:
    """One step of the loop. ``prompt_tokens`` and ``completion_tokens`` are as the endpoint
    reported them (``None``: not reported, or not a sample of the token scale); ``usage`` is
    what its model requests used as the usage table counts them (:func:`step_usage`)."""

    step: int
    finish_reason: str
    prompt_tokens: int | None
    estimate: int
    completion_tokens: int | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: str | None = None
    escalated: bool = False
    #: the endpoint (base URL) that answered, and its model (a fallback's, when it answered)
    endpoint: str | None = None
    model: str | None = None
    usage: dict[str, Any] | None = None
    #: the share of the previous request the same endpoint and model answered in the
    #: conversation that this one repeats as a prefix (``Prefixes``); ``None`` for the first
    repeated: float | None = None
    #: the client cut the completion at its budget (``Cut.as_dict``: by tokens or at its
    #: deadline, the budget, the seconds, the speed the deadline assumed); ``None``: not cut
    cut: dict[str, Any] | None = None

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}


def step_usage(usage: Usage | None, cost: float | None, earlier: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """A step's usage in the trace: ``prompt``, ``cached``, ``completion`` and ``reasoning``
    tokens, ``estimated`` (the endpoint reported nothing) and ``cost`` (only when priced), added
    to ``earlier`` (the step was asked again with a larger budget)."""
    if usage is None:
        return earlier
    out = {
        "prompt": usage.prompt, "cached": usage.cached, "completion": usage.completion,
        "reasoning": usage.reasoning, "estimated": usage.estimated,
    }
    if cost is not None:
        out["cost"] = cost
    if earlier:
        for key in ("prompt", "cached", "completion", "reasoning"):
            out[key] += int(earlier.get(key) or 0)
        out["estimated"] = out["estimated"] or bool(earlier.get("estimated"))
        if "cost" in earlier or "cost" in out:
            out["cost"] = float(earlier.get("cost") or 0.0) + (cost or 0.0)
    return out


def requests_usage(used: Iterable[tuple[Usage, float | None]]) -> dict[str, Any] | None:
    """What several requests used together (a judge's, the classifier's, a compaction's
    summaries), as :func:`step_usage` shows a step's, with how many ``requests`` and the
    ``cuts`` of those the client cut at their budget (when any); ``None``: none."""
    out: dict[str, Any] | None = None
    count = 0
    cuts: list[dict[str, Any]] = []
    for usage, cost in used:
        out, count = step_usage(usage, cost, out), count + 1
        cuts += [usage.cut] if usage.cut else []
    if out is None:
        return None
    return {**out, "requests": count, **({"cuts": cuts} if cuts else {})}


@dataclass(slots=True)
class LoopTrace:
    """What a run of the loop did, for ``bumblebot trace`` (steps of earlier runs included).

    ``cuts``: every text the engine removed or did not deliver, with the rule that did it
    (``reasoning``, ``engine_echo``, ``call_as_text``, ``exact_repeat``, ``message_cap``,
    ``say_budget``, ``result_cap``) and the step it happened in. ``told``: how a turn that
    stopped at a limit told the user (``"model"``: in the model's words; ``"note"``: a plain
    note), ``None`` when it did not have to."""

    steps: list[dict[str, Any]] = field(default_factory=list)
    gate: list[dict[str, Any]] = field(default_factory=list)
    thoughts: list[str] = field(default_factory=list)
    cuts: list[dict[str, Any]] = field(default_factory=list)
    told: str | None = None

    def cut(self, rule: str, *, call: str | None = None, chars: int | None = None) -> None:
        entry: dict[str, Any] = {"step": len(self.steps), "rule": rule}
        if call:
            entry["call"] = call
        if chars is not None:
            entry["chars"] = chars
        self.cuts.append(entry)

    def judged(self, decision: GateDecision) -> None:
        entry = {"step": len(self.steps), "done": decision.done, "reason": decision.reason, "judge": decision.judge}
        if decision.usage:
            entry["usage"] = requests_usage(decision.usage)
        self.gate.append(entry)


@dataclass(slots=True)
class LoopResult:
    messages: list[Message]
    stop: Stop
    delivered: list[str]
