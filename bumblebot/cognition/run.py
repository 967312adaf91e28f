"""What one run of the agent loop over a turn holds: its collaborators and what changes from
step to step. The loop (:mod:`.loop`), the tool calls of a step (:mod:`.calls`) and a resume
(:mod:`.resume`) share it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from bumblebot.cognition.gate import GateDecision
from bumblebot.cognition.limits import LoopLimits
from bumblebot.cognition.port import RequestBuilder, TurnPort
from bumblebot.cognition.speech import DeliveryRule, SayStream, Visible
from bumblebot.cognition.state import LoopState
from bumblebot.cognition.trace import LoopTrace, StopFlag, StopReason
from bumblebot.core.toolkit import ToolContext


@dataclass(slots=True)
class Run:
    """One run of the loop over a turn."""

    port: TurnPort
    requests: RequestBuilder
    limits: LoopLimits
    trace: LoopTrace
    state: LoopState
    rule: DeliveryRule
    visible: Visible
    stream: SayStream
    ctx: ToolContext
    work_tools: tuple[str, ...]
    used_ids: set[str]
    stop_reason: StopReason = StopReason.STEP_CAP
    flags: set[StopFlag] = field(default_factory=set)
    #: how the model ended its turn (``"end_turn"`` or ``"text"``), for the gate to judge
    ended_by: str | None = None
    nudge: str | None = None
    hit_length: bool = False
    length_stalls: int = 0
    gate_continues: int = 0
    #: the gate's last CONTINUE: what the turn still owes
    unmet: GateDecision | None = None
    #: the first completion was asked again once, for a burst
    restarted: bool = False
    #: when this run of the loop began (the loop's clock): how long the person has waited
    started: float = 0.0
    #: the last step tried to say more past the turn's message cap
    talked_past_cap: bool = False

    def call_context(self, call_id: str) -> ToolContext:
        """The tool context of one call of this turn."""
        return dataclasses.replace(self.ctx, call_id=call_id)
