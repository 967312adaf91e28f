"""The bounds of one turn: its profile (model, token budget, thinking), how many steps and
messages it may take, and the numbers that tell a stalled or looping model from a working one."""

from __future__ import annotations

from dataclasses import dataclass

#: The same work tool in this many consecutive steps is refused (docs/cognition.md, "The agent loop").
REPEAT_LIMIT = 3
#: Length-limited completions in a row before the model is told to write long output to a
#: file; one more after that ends the turn (``budget``).
LENGTH_STALL_LIMIT = 3
#: Steps in a row that bring nothing new (no new message, no work call that is not a repeat)
#: before the loop stops: the model is looping.
IDLE_STEP_LIMIT = 3
#: Messages that arrive mid-turn are taken only while this many steps are left to answer them.
STEER_MIN_STEPS_LEFT = 2
#: A message is at most its step's token budget in characters, times this slack.
REPLY_SLACK = 1.25
MIN_REPLY_CHARS = 500
#: Minimum characters each result of a step keeps when the step's results share one budget.
MIN_RESULT_SHARE = 500


@dataclass(slots=True)
class LoopLimits:
    """One turn's profile (docs/cognition.md, "Routing") and bounds."""

    max_steps: int
    max_tokens: int
    model: str
    thinking: bool
    tool_timeout_s: float
    #: the most characters one step's tool results keep between them (a share of the window)
    max_tool_result_chars: int = 32768
    temperature: float | None = None
    #: at most this many messages reach the user per turn (``cognition.max_messages_per_turn``)
    max_messages: int = 4
    #: a reflex completion cut at ``max_tokens`` is asked again once with this budget
    escalate_tokens: int | None = None
    #: a scheduled or autonomous turn: it may end without a message (nothing is said for it)
    silent_ok: bool = False
    #: seconds after which a turn whose person has seen nothing names ``say`` as the tool of
    #: its next step (``cognition.first_words_s``; ``None``: never by time)
    first_words_s: float | None = None


def max_steps(rounds: int) -> int:
    """The step cap of a turn (docs/cognition.md, "The agent loop"): rounds clamped to [0, 16]; total steps
    ``max(6, min(25, 6 + rounds))``."""
    rounds = min(16, max(0, rounds))
    return max(6, min(25, 6 + rounds))


def reply_chars(limits: LoopLimits) -> int:
    """The longest message a step may say: its token budget, in characters, with slack for
    the estimate (some servers ignore ``max_tokens``)."""
    return max(MIN_REPLY_CHARS, int(limits.max_tokens * 4 * REPLY_SLACK))
