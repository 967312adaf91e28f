"""A turn's trace as it is saved at each checkpoint (:class:`TraceSnapshot`): what ``bumblebot
trace`` shows of it."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

from bumblebot.cognition.context import Requests
from bumblebot.cognition.limits import LoopLimits
from bumblebot.cognition.trace import LoopTrace
from bumblebot.runtime.conversation import Turn


@dataclasses.dataclass(slots=True)
class TraceSnapshot:
    """What a turn's trace holds at a checkpoint: its route, its limits, the loop's steps, and
    ``extra`` facts of how it ended. Called at each checkpoint; redacted (an endpoint error can
    echo a key back: "Incorrect API key provided: sk-…")."""

    turn: Turn
    limits: LoopLimits
    trace: LoopTrace
    compactions: list[dict[str, Any]]
    redact: Callable[[Any], Any]
    requests: Requests | None = None

    def __call__(self, **extra: Any) -> dict[str, Any]:
        state, trace, limits = self.turn.state, self.trace, self.limits
        out = {
            "route": state.route, "route_reason": state.route_reason,
            "classifier_label": state.classifier_label, "classifier_error": state.classifier_error,
            "classifier_usage": state.classifier_usage,
            "model": limits.model,
            "max_tokens": limits.max_tokens,
            "journal_ids": self.turn.journal_ids,
            "resumes": state.resumes,
            "outage_s": state.outage_s,
            "steps": trace.steps,
            "gate": trace.gate,
            "thoughts": trace.thoughts,
            "cuts": trace.cuts,
            "told": trace.told,
            "compactions": self.compactions + (self.requests.compactions if self.requests else []),
            "prompt_tokens": [s["prompt_tokens"] for s in trace.steps],
            "estimates": [s["estimate"] for s in trace.steps],
            **extra,
        }
        return self.redact(json.loads(json.dumps(out, default=str)))
