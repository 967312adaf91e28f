"""The bounded agent loop of one turn (spec, "Agent loop").

Each step sends one chat completion with every tool and tool forcing. Tool calls of a step run
concurrently, each under a timeout. Speaking is the ``say`` tool; ending is ``end_turn``, which
goes through the completion gate. Text the model writes alongside tool calls is private
reasoning and is never delivered. A plain-text answer (an endpoint that does not enforce
``tool_choice``) is the model's last word: it is delivered, and the gate judges the ending.

**The model decides when its turn is over.** A turn ends when the model calls ``end_turn``
(or answers in plain text) and the completion gate accepts; otherwise only at a limit: the
step cap, a model that repeats itself without progress (``looping``), replies that keep
hitting the token budget (``budget``), a full window, or ``/stop``. Delivering a ``say`` never
ends a turn. A turn that stops at a limit tells the user so once, in words the model is asked
for (in the user's language), or a plain note when it cannot give them.

**Delivery.** Every ``say`` is delivered as written, except an exact repeat (same text after
whitespace and case normalisation) of a message already delivered in this turn, and except
past the turn's message cap, which the model is told. Only the text rules of
:mod:`bumblebot.core.textrules` remove anything (reasoning, a call written as text, the engine's own
notes echoed); every removal is recorded in the trace. A say that will not be delivered is
never streamed as a preview.

**Checkpoints.** Every step is recorded as it happens, through the :class:`TurnPort`: the
assistant message *before* its tools run, each tool result as soon as it completes, and every
message for the user in the outbox. What the loop knows of a turn (:class:`LoopState`) is a
function of that record, so a turn resumed after a crash rebuilds it with
:meth:`LoopState.replay` and goes on:

* a call whose result was recorded is never run again;
* a ``say`` (or ``send_file``) cut off before it reached the outbox is delivered as recorded
  (nothing of it was sent: there is no outbox row), one that reached it is answered from its
  row (delivered, queued, or refused);
* any other call that was cut off gets a result saying it was interrupted and may or may not
  have taken effect; it is not silently run again;
* a step that had ended the turn goes to the gate again.

Limits: tool continuation rounds are clamped to [0, 16]; steps are capped at
``max(6, min(25, 6 + rounds))``; a work tool called in three consecutive steps is refused from
the third (spec, "Repeat guard"); three steps in a row that bring nothing new stop a looping
model; after 3 consecutive length-limited completions the model is told to write long output
to a file (or to say less at a time), and a fourth stops the turn.

Internal nudges (post-tool, gate) live only in the request of the next step: they are never
stored as if the user had written them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import time
import uuid
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from bumblebot.cognition.compaction import cap_tool_result
from bumblebot.core.errors import ContextTooLong
from bumblebot.core.events import blank, storable_text
from bumblebot.cognition.gate import MAX_GATE_CONTINUES, CompletionGate, GateDecision, GateInput, Preview
from bumblebot.llm import LLM, Completion, SayListener, ToolCall
from bumblebot.core.messages import Message, json_object, json_text, valid_arguments
from bumblebot.store import OutboxEntry
from bumblebot.core.textrules import TURN_CONTEXT, EchoFilter, call_as_text, may_be_call, shown_so_far, strip_reasoning
from bumblebot.core.toolkit import DeliveryReport, Toolbox, ToolContext, ToolKind, ToolResult

log = logging.getLogger(__name__)
_T = TypeVar("_T")

PREVIEW_CHARS = 280
PREVIEW_COUNT = 8
#: The same work tool in this many consecutive steps is refused (spec, "Repeat guard").
REPEAT_LIMIT = 3
#: Length-limited completions in a row before the model is told to write long output to a
#: file; one more after that ends the turn (``budget``).
LENGTH_STALL_LIMIT = 3
#: Steps in a row that bring nothing new (no new message, no work call that is not a repeat)
#: before the loop stops: the model is looping.
IDLE_STEP_LIMIT = 3
#: Tools not run under the tool timeout: ``say`` is bounded by the delivery policy itself.
UNTIMED = frozenset({"say", "send_file"})
#: Calls whose outcome a resumed turn reads from their outbox row (linked by call id).
DELIVERIES = frozenset({"say", "send_file"})
#: Side-effect free agency tools: a call cut off by a crash is simply completed on resume.
_COMPLETED_ON_RESUME = {"end_turn": "ending turn", "think": "noted", "wait": "waited 0 s (interrupted)"}
#: A message is at most its step's token budget in characters, times this slack.
REPLY_SLACK = 1.25
MIN_REPLY_CHARS = 500
#: Messages that arrive mid-turn are taken only while this many steps are left to answer them.
STEER_MIN_STEPS_LEFT = 2
#: Minimum characters each result of a step keeps when the step's results share one budget.
MIN_RESULT_SHARE = 500

INTERRUPTED = (
    "Interrupted: the daemon restarted while this call was running. It may or may not have "
    "taken effect; check before you repeat it."
)
NEVER_SENT = "interrupted before it was sent; it was not delivered"

#: Plain notes, for when the model cannot give the words itself (it failed, the window is full).
STEP_CAP_MESSAGE = (
    "I had to stop here: this took more steps than I'm allowed in one turn. "
    "Tell me to continue and I'll pick it up from where I stopped."
)
LOOPING_MESSAGE = "Sorry, I got stuck on that and couldn't finish. Could you put it another way?"
BUDGET_MESSAGE = "Sorry, my answer kept running past the length I'm allowed, so I stopped. Ask me for a shorter part?"
CONTEXT_FULL_MESSAGE = (
    "I had to stop here: this conversation filled my memory. Tell me to continue and I'll go on from a summary."
)
NO_REPLY_MESSAGE = "Sorry, I couldn't put an answer together this time. Could you say that again?"
UNFINISHED_MESSAGE = "Sorry, I didn't get that done this time{why}. Tell me if I should try again."

#: Why a turn stopped at a limit, as the model is told when asked for its closing words.
_LIMIT_WHY = {
    "step_cap": "you used every step one turn may take",
    "looping": "your last steps repeated themselves without progress",
    "budget": "your replies kept running past the length limit",
}
_LIMIT_NOTES = {"step_cap": STEP_CAP_MESSAGE, "looping": LOOPING_MESSAGE, "budget": BUDGET_MESSAGE}


def max_steps(rounds: int) -> int:
    """Spec: rounds clamped to [0, 16]; total steps ``max(6, min(25, 6 + rounds))``."""
    rounds = min(16, max(0, rounds))
    return max(6, min(25, 6 + rounds))


def canonical_arguments(arguments: str) -> str:
    try:
        return json.dumps(json.loads(arguments or "{}"), sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError):
        return arguments.strip()


def repeat_key(text: str) -> str:
    """What two messages must share to be the same message: their text with runs of
    whitespace made one space, case folded."""
    return " ".join(text.split()).casefold()


def _say_text(arguments: str) -> str:
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return ""
    text = value.get("text") if isinstance(value, dict) else None
    return strip_reasoning(text) if isinstance(text, str) else ""


def file_shown(caption: str, path: str) -> str:
    """What a file sent to the chat shows, as the completion check and the repeat rule read
    it: its caption and its name."""
    name = os.path.basename(path)
    return f"{caption}\n[file {name}]".strip() if name else caption


def _shown(call: ToolCall) -> str:
    """What a ``say`` or ``send_file`` call put before the user: the text; a file's caption
    and name."""
    if call.name == "say":
        return _say_text(call.arguments)
    try:
        args = json.loads(call.arguments or "{}")
    except ValueError:
        return ""
    if not isinstance(args, dict):
        return ""
    caption = args.get("caption")
    return file_shown(strip_reasoning(caption) if isinstance(caption, str) else "", str(args.get("path") or ""))


@dataclass(slots=True)
class LoopLimits:
    max_steps: int
    max_tokens: int
    model: str
    thinking: bool
    tool_timeout_s: float
    max_tool_result_chars: int = 32768
    temperature: float | None = None
    #: at most this many messages reach the user per turn (``cognition.max_messages_per_turn``)
    max_messages: int = 4
    #: a reflex completion cut at ``max_tokens`` is asked again once with this budget
    escalate_tokens: int | None = None
    #: a scheduled or autonomous turn: it may end without a message (nothing is said for it)
    silent_ok: bool = False


@dataclass(slots=True)
class StepTrace:
    step: int
    finish_reason: str
    prompt_tokens: int | None
    estimate: int
    completion_tokens: int | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: str | None = None
    escalated: bool = False


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
    #: how a turn that stopped at a limit told the user: in the model's words, or a plain note
    told: str | None = None

    def cut(self, rule: str, *, call: str | None = None, chars: int | None = None) -> None:
        entry: dict[str, Any] = {"step": len(self.steps), "rule": rule}
        if call:
            entry["call"] = call
        if chars is not None:
            entry["chars"] = chars
        self.cuts.append(entry)


@dataclass(slots=True)
class LoopResult:
    messages: list[Message]
    stop_reason: str
    delivered: list[str]


class TurnPort(Protocol):
    """What the loop needs of the turn it runs (``bumblebot.runtime.turn`` implements it).

    ``transcript`` is the turn's messages so far, the user message first; the loop never
    appends to it itself: it goes through :meth:`record` and :meth:`reply`, which write first.
    """

    transcript: list[Message]
    #: set by ``/stop``: the turn ends at once (the model call is aborted, running tools are
    #: cancelled; what was delivered stays)
    stop: asyncio.Event

    #: set when more messages of the burst the turn began with arrive (``cognition.debounce_s``)
    #: while its first completion is awaited; ``None`` for a turn that may not be asked again
    #: (resumed, scheduled)
    burst: asyncio.Event | None

    async def take_steering(self, *, burst: bool = False) -> list[Message]:
        """Messages that arrived during the turn (steer mode), already recorded in it.
        ``burst``: the rest of the burst the turn began with, whatever the mode."""

    async def settle_burst(self) -> None:
        """Wait until the burst the turn began with is over (``cognition.debounce_s`` with no
        new message, at most ``DEBOUNCE_MAX_S``)."""

    async def record(self, message: Message) -> None:
        """Checkpoint an assistant message (before its tools run) or one tool result."""

    async def say(self, text: str, *, tool_call_id: str | None) -> DeliveryReport:
        """Deliver the text of a ``say`` call (the call itself is already recorded)."""

    async def send_file(self, path: str, caption: str, *, tool_call_id: str | None) -> DeliveryReport:
        """Deliver a file (``send_file``) with its caption through the outbox: as a photo when
        it is an image the platform takes as one, else as a document."""

    async def reply(self, message: Message, *, closing: str | None = None) -> DeliveryReport:
        """Deliver an assistant message of its own (a plain-text reply, a daemon note),
        recorded together with its outbox row. ``closing`` is the stop reason when this note
        ends the turn: a resumed turn then finishes instead of going on."""

    async def outbox(self) -> list[OutboxEntry]:
        """The messages this turn queued so far (to resume it)."""

    async def answered(self) -> None:
        """The model answered a completion (an outage, if there was one, is over)."""

    def on_say(self, clean: Callable[[str], str]) -> SayListener | None:
        """Where the text of ``say`` calls goes while a completion is streamed (shown in the
        chat as it is written, ``bumblebot/delivery/preview.py``); ``None``: nothing is streamed.
        ``clean`` is what of the raw text so far may be shown."""
        return None

    def bind_say(self, index: int, call_id: str) -> None:
        """The ``say`` streamed at position ``index`` is the recorded call ``call_id``: its
        delivery takes the streamed message over."""

    async def settle_previews(self) -> None:
        """The step is over: streamed text no ``say`` took over is taken down."""

    def restart_previews(self) -> None:
        """The completion is asked again: what it streams next starts the shown messages over."""

    def waiting(self) -> None:
        """The turn waits on the model again (the typing indicator shows)."""

    def judging(self) -> None:
        """The reply is on screen and the completion check runs (no typing indicator)."""

    async def stopped(self) -> None:
        """Record that the user stopped the turn (``/stop``), with what of it they saw, as the
        turn's end."""



class LoopState:
    """What the loop knows of a turn; rebuilt from the transcript by :meth:`replay` (resume)
    and updated by the same methods while the loop runs, so the two can never disagree."""

    def __init__(self, kind: Callable[[str], ToolKind | None]) -> None:
        self._kind = kind
        self.user_texts: list[str] = []
        self.delivered: list[str] = []
        self._delivered_keys: set[str] = set()
        self.steps = 0
        self.work_calls = 0
        self.work_ok = 0
        self.previews: deque[Preview] = deque(maxlen=PREVIEW_COUNT)
        #: work tool -> consecutive steps it was called in (the repeat guard)
        self._streak: dict[str, int] = {}
        self._calls: dict[str, ToolCall] = {}
        #: (tool, canonical arguments) of every work call that ran this turn
        self._ran: set[tuple[str, str]] = set()
        #: call id -> whether the repeat guard let it run
        self.allowed: dict[str, bool] = {}
        self.idle_steps = 0

    @classmethod
    def replay(cls, transcript: list[Message], kind: Callable[[str], ToolKind | None]) -> LoopState:
        state = cls(kind)
        step: tuple[int, list[tuple[ToolCall, bool]]] | None = None  # (said before, plan)

        def close_step() -> None:
            nonlocal step
            if step is not None:  # as the live loop does after a step's results
                state.step_done(*step)
                step = None

        for m in transcript:
            if m.role == "user":
                close_step()
                state.on_user(m)
            elif m.role == "assistant":
                close_step()
                said_before = len(state.delivered)
                state.on_assistant(m)
                if m.tool_calls:
                    step = (said_before, state.plan([_call(c) for c in m.tool_calls]))
            elif m.role == "tool":
                call = state._calls.get(m.tool_call_id or "")
                if call is not None:
                    state.on_result(call, ToolResult(m.content, ok=m.ok is not False))
        close_step()
        return state

    def on_user(self, message: Message) -> None:
        self.user_texts.append(message.content)

    def on_assistant(self, message: Message) -> None:
        if message.note:
            return
        self.steps += 1
        if not message.tool_calls and message.content.strip():
            self.said(message.content)

    def said(self, text: str) -> None:
        key = repeat_key(text)
        if key not in self._delivered_keys:
            self._delivered_keys.add(key)
            self.delivered.append(text)

    def already_said(self, text: str) -> bool:
        """``text`` is an exact repeat of a message delivered in this turn (:func:`repeat_key`)."""
        return repeat_key(text) in self._delivered_keys

    def may_still_repeat(self, text: str) -> bool:
        """``text``, a message still being written, is so far the beginning of one delivered
        in this turn: it may yet turn out to be an exact repeat."""
        key = repeat_key(text)
        return any(done.startswith(key) for done in self._delivered_keys)

    def plan(self, calls: list[ToolCall]) -> list[tuple[ToolCall, bool]]:
        """Each call of one step with whether it may run (spec, "Repeat guard"): a work tool
        called in :data:`REPEAT_LIMIT` consecutive steps is refused from the third on. Steps
        with agency tools only (``say``, ``think``) do not break the streak; a step with other
        work tools does. Several calls of one tool in one step (a fan-out) are one decision and
        count once."""
        work = {c.name for c in calls if self._kind(c.name) is ToolKind.WORK}
        if work:
            self._streak = {name: self._streak.get(name, 0) + 1 for name in work}
        plan = []
        for call in calls:
            self._calls[call.id] = call
            allowed = self.allowed[call.id] = self._streak.get(call.name, 0) < REPEAT_LIMIT or call.name not in work
            plan.append((call, allowed))
        return plan

    def step_done(self, said_before: int, ran: list[tuple[ToolCall, bool]], *, cut: bool = False) -> None:
        """Count a step that brought nothing new (nothing delivered, no work call that ran with
        new arguments): :data:`IDLE_STEP_LIMIT` of them in a row mean the model is looping. A
        step cut at the token budget (``cut``) is trying, not looping, and a step that ends
        the turn is the completion gate's to judge: both are left out."""
        if cut or any(call.name == "end_turn" for call, _ in ran):
            return
        fresh = False
        for call, allowed in ran:
            if allowed and self._kind(call.name) is ToolKind.WORK:
                key = (call.name, canonical_arguments(call.arguments))
                fresh = fresh or key not in self._ran
                self._ran.add(key)
        self.idle_steps = 0 if fresh or len(self.delivered) > said_before else self.idle_steps + 1

    def on_result(self, call: ToolCall, result: ToolResult) -> None:
        if call.name in DELIVERIES and result.ok:
            text = _shown(call)
            if text:
                self.said(text)
        if self._kind(call.name) is ToolKind.WORK:
            self.work_calls += 1
            self.work_ok += int(result.ok)
            self.previews.append(Preview(call.name, result.ok, result.content[:PREVIEW_CHARS]))

    def gate_input(
        self, ended_by: str, hit_length: bool, continues: int, *, silent_ok: bool = False,
        work_tools: tuple[str, ...] = (),
    ) -> GateInput:
        """What the gate judges."""
        return GateInput(
            user_text="\n".join(self.user_texts),
            visible=list(self.delivered),
            work_calls=self.work_calls,
            work_ok=self.work_ok,
            previews=list(self.previews),
            ended_by=ended_by,
            last_hit_length=hit_length,
            continues_so_far=continues,
            silent_ok=silent_ok,
            work_tools=work_tools,
        )


def _call(api: dict[str, Any]) -> ToolCall:
    fn = api.get("function") or {}
    return ToolCall(id=api.get("id") or "", name=fn.get("name") or "", arguments=fn.get("arguments") or "{}")


class Visible:
    """What of the model's text may reach the user, by the text rules
    (:mod:`bumblebot.core.textrules`): reasoning, the engine's own notes echoed, and a tool call
    written as text are removed, each removal recorded in the trace."""

    def __init__(self, tools: frozenset[str], trace: LoopTrace) -> None:
        self.tools = tools
        self.echoes = EchoFilter([TURN_CONTEXT])
        self._trace = trace

    def __call__(self, text: str, *, call: str | None = None) -> str:
        out = strip_reasoning(text)
        if out != text.strip():
            self._trace.cut("reasoning", call=call, chars=len(text) - len(out))
        echoed = self.echoes(out)
        if echoed != out:
            self._trace.cut("engine_echo", call=call, chars=len(out) - len(echoed))
        if echoed and call_as_text(echoed, self.tools):
            self._trace.cut("call_as_text", call=call, chars=len(echoed))
            return ""
        return echoed

    def preview(self, raw: str) -> str:
        """What of a say still being written may be shown: no reasoning, not even one whose
        block is still open, no sentence copied from the engine's notes, not even one still
        being written (no trace: the final text is judged, and recorded, when the call is
        complete)."""
        return self.echoes.partial(shown_so_far(raw))


class TurnState:
    """The running turn as agency tools see it (:class:`bumblebot.core.toolkit.TurnControl`)."""

    def __init__(
        self, port: TurnPort, state: LoopState, trace: LoopTrace, max_messages: int, visible: Visible
    ) -> None:
        self._port = port
        self._state = state
        self._trace = trace
        self._max_messages = max_messages
        self._visible = visible
        self._order = asyncio.Lock()  # FIFO: several say() calls of one step keep call order
        self.thoughts = trace.thoughts
        self.end_requested = False
        #: a say of the current step did not get out (the turn must not end on it)
        self.lost = False
        #: the platform refused a message for good (blocked bot, deleted chat): talking on is futile
        self.undeliverable: str | None = None

    async def say(self, text: str, *, call_id: str | None = None) -> DeliveryReport:
        """Deliver a ``say`` as written; not an exact repeat of a message this turn delivered,
        and nothing past :attr:`LoopLimits.max_messages` messages."""
        text = self._visible(text, call=call_id)
        if not text:
            return DeliveryReport(
                delivered=False, dropped="not sent: nothing left after removing reasoning and engine notes"
            )
        if self.undeliverable:
            return DeliveryReport(delivered=False, error=self.undeliverable)
        async with self._order:  # checked under the lock: two equal says of one step count too
            if self._state.already_said(text):
                self._trace.cut("exact_repeat", call=call_id, chars=len(text))
                return DeliveryReport(delivered=True, duplicate=True)
            said = len(self._state.delivered)
            if said >= self._max_messages:
                self._trace.cut("message_cap", call=call_id, chars=len(text))
                return DeliveryReport(
                    delivered=False,
                    dropped=f"not sent: this turn already sent {said} messages, the most it may; "
                    "stop talking and call end_turn",
                )
            report = await self._port.say(text, tool_call_id=call_id)
            if report.ok:
                self._state.said(text)
            else:
                self.lost = True
        self._note_unreachable(report)
        return report

    async def reply(self, text: str, *, note: bool = False, closing: str | None = None) -> DeliveryReport:
        """A message of its own: a plain-text reply (counts as said) or a daemon note."""
        message = Message(role="assistant", content=text, note=note)
        report = await self._port.reply(message, closing=closing)
        self._state.on_assistant(message)
        self._note_unreachable(report)
        return report

    async def send_file(self, path: Any, caption: str, *, call_id: str | None = None) -> DeliveryReport:
        """A file for the user (``send_file``); its caption is cleaned like a ``say``. A file
        is a message: the exact-repeat rule and the turn's message cap apply to it as to a
        ``say``. In call order with the step's ``say`` calls (the order lock is taken before
        anything else)."""
        if self.undeliverable:
            return DeliveryReport(delivered=False, error=self.undeliverable)
        async with self._order:
            clean = self._visible(caption, call=call_id) if caption else ""
            shown = file_shown(clean, str(path))
            if self._state.already_said(shown):
                self._trace.cut("exact_repeat", call=call_id, chars=len(shown))
                return DeliveryReport(delivered=True, duplicate=True)
            said = len(self._state.delivered)
            if said >= self._max_messages:
                self._trace.cut("message_cap", call=call_id, chars=len(shown))
                return DeliveryReport(
                    delivered=False,
                    dropped=f"not sent: this turn already sent {said} messages, the most it may; call end_turn",
                )
            report = await self._port.send_file(str(path), clean, tool_call_id=call_id)
            if report.ok:
                self._state.said(shown)
            else:
                self.lost = True
        self._note_unreachable(report)
        return report

    def _note_unreachable(self, report: DeliveryReport) -> None:
        if report.chat_unreachable:
            self.undeliverable = report.error or "the platform refused the message"

    def end_turn(self) -> None:
        self.end_requested = True

    def think(self, thought: str) -> None:
        self.thoughts.append(thought)


class _SayStream:
    """Which ``say`` calls of the completion being streamed are shown as they are written.

    A say is previewed only when it will be delivered as far as can be told: the turn's
    message cap leaves room for it (counting the says of this completion shown before it), it
    is not (yet) the beginning of a message already delivered in this turn, nor of one shown
    earlier in this completion (an exact repeat is never delivered, so it must never flash
    up), and it cannot still turn out to be a tool call written as text. Until then its text
    is held; once it may show, all of it goes to the preview at once and the rest as it comes.
    Calls stream one after another: when a later say starts to show, an earlier one still
    held is complete, and it shows first if it will be delivered (messages keep call order)."""

    def __init__(self, port: TurnPort, state: LoopState, limits: LoopLimits, turn: TurnState, visible: Visible) -> None:
        self._listener = port.on_say(visible.preview)
        self._state = state
        self._limits = limits
        self._turn = turn
        self._visible = visible
        self._texts: dict[int, str] = {}  # the raw text of each say of the completion so far
        self.shown: set[int] = set()

    @property
    def listener(self) -> SayListener | None:
        return None if self._listener is None else self

    def reset(self) -> None:
        self._texts.clear()
        self.shown.clear()

    def __call__(self, index: int, text: str) -> None:
        if self._listener is None or self._turn.undeliverable:
            return
        self._texts[index] = self._texts.get(index, "") + text
        if index in self.shown:
            self._listener(index, text)
            return
        visible = self._visible.preview(self._texts[index])
        if self._held(index, visible) or may_be_call(visible, self._visible.tools):
            return
        for earlier in sorted(i for i in self._texts if i < index and i not in self.shown):
            done = self._visible.preview(self._texts[earlier])  # complete: a later call is streaming
            if not self._held(earlier, done, complete=True) and not call_as_text(done, self._visible.tools):
                self._show(earlier)
        if not self._held(index, visible):
            self._show(index)

    def _held(self, index: int, visible: str, *, complete: bool = False) -> bool:
        """``visible`` (the say at ``index``, so far or ``complete``) may not show: nothing to
        show, no room under the cap, or it repeats (or, still growing, may yet repeat) a
        delivered message or one shown before it."""
        if not visible or len(self._state.delivered) + len(self.shown) >= self._limits.max_messages:
            return True
        if self._state.already_said(visible) or (not complete and self._state.may_still_repeat(visible)):
            return True
        key = repeat_key(visible)
        for other in self.shown:
            if other < index:
                shown = repeat_key(self._visible.preview(self._texts[other]))
                if shown == key or (not complete and shown.startswith(key)):
                    return True
        return False

    def _show(self, index: int) -> None:
        self.shown.add(index)
        self._listener(index, self._texts[index])


class RequestBuilder:
    """What the loop needs from the conversation: requests built from the turn's messages.

    ``build(nudge)`` returns the full message list for the next completion (system prompt,
    history, summary, this turn's messages with the preamble, the nudge) and its token
    estimate; compaction runs inside it when the estimate crosses the threshold.
    """

    #: the tool schemas every request of the turn offers
    tool_schemas: list[dict[str, Any]] = []

    async def build(self, nudge: str | None) -> tuple[list[dict[str, Any]], int]:
        raise NotImplementedError

    async def shrink(self) -> None:
        """The endpoint said the prompt is too long: compact (or prune) before one retry."""

    def call_ids(self) -> set[str]:
        """Tool call ids already used in the conversation (new ones must differ)."""
        return set()

    async def observe_usage(self, prompt_tokens: int | None, estimate: int) -> None:
        """The endpoint reported ``prompt_tokens`` for a request we estimated at ``estimate``."""

    async def observe_refusal(self, prompt_tokens: int | None) -> None:
        """The last request built was refused as too long; the endpoint counted ``prompt_tokens``."""


class _StepBudget:
    """One step's results share ``max_tool_result_chars`` (each is already capped alone):
    parallel calls must not overflow the window between them. Results
    are fitted as they complete, so each can be recorded at once."""

    def __init__(self, budget: int, calls: int) -> None:
        self._left = budget
        self._waiting = calls

    def fit(self, result: ToolResult) -> ToolResult:
        self._waiting -= 1
        allowed = max(MIN_RESULT_SHARE, self._left - MIN_RESULT_SHARE * self._waiting)
        if len(result.content) > allowed:
            result = ToolResult(cap_tool_result(result.content, allowed), ok=result.ok)
        self._left = max(0, self._left - len(result.content))
        return result


class Stopped(Exception):
    """``/stop`` came while the loop waited (:func:`_unless_stopped`)."""


class Burst(Exception):
    """More messages of a burst came while the turn's first completion was awaited
    (:func:`_unless_stopped` with ``burst``): it was aborted, to be asked again with them."""


async def _unless_stopped(
    stop: asyncio.Event, coro: Coroutine[Any, Any, _T], *,
    burst: asyncio.Event | None = None, may_restart: Callable[[], bool] = lambda: True,
) -> _T:
    """Await ``coro`` unless ``stop`` is set first: then it is cancelled (an HTTP request is
    aborted, a tool's process is stopped the way its timeout stops it) and :class:`Stopped`
    is raised. A ``coro`` that completes as the stop comes keeps its result.

    ``burst`` (the turn's first completion): when it is set and ``may_restart()`` (nothing of
    the completion is on screen yet), ``coro`` is cancelled the same way and :class:`Burst`
    raised; otherwise it is cleared and the wait goes on."""
    if stop.is_set():
        coro.close()
        raise Stopped
    task = asyncio.ensure_future(coro)
    restart = False
    while True:
        waiters = [asyncio.ensure_future(stop.wait())]
        if burst is not None:
            waiters.append(asyncio.ensure_future(burst.wait()))
        try:
            await asyncio.wait({task, *waiters}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # we are cancelled ourselves (a shutdown): so is the call
            task.cancel()
            raise
        finally:
            for waiter in waiters:
                waiter.cancel()
        if task.done():
            return task.result()
        if stop.is_set() or burst is None:
            break
        burst.clear()
        if may_restart():
            restart = True
            break
        burst = None  # something is shown already: the new messages wait for the next step
    task.cancel()
    try:
        return await task  # it may finish anyway, catching the cancellation
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise  # a shutdown came meanwhile
    except Exception as exc:  # what the cancelled call raised on its way out
        log.debug("a call stopped by /stop raised %s", type(exc).__name__)
    raise Burst if restart else Stopped


async def _all_or_none(coros: list[Coroutine[Any, Any, _T]]) -> list[_T]:
    """Run ``coros`` concurrently; their results in order. When one raises (a result that
    could not be recorded), the others are cancelled and waited for before its error is
    raised: no tool goes on running after the turn has failed, to record a result after the
    turn was told it did not complete (``asyncio.gather`` leaves them running)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        pending = [t for t in tasks if not t.done()]
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)
    for task in tasks:
        if not task.cancelled() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]
    return [t.result() for t in tasks]


@dataclass(slots=True)
class _Run:
    """One run of the loop over a turn: its collaborators and what changes from step to step."""

    port: TurnPort
    requests: RequestBuilder
    limits: LoopLimits
    trace: LoopTrace
    state: LoopState
    turn: TurnState
    visible: Visible
    stream: _SayStream
    ctx: ToolContext
    work_tools: tuple[str, ...]
    used_ids: set[str]
    stop_reason: str = "step_cap"
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


class AgentLoop:
    """Runs one turn. Collaborators come in through the constructor."""

    def __init__(self, *, llm: LLM, toolbox: Toolbox, gate: CompletionGate, tool_context: ToolContext) -> None:
        self.llm = llm
        self.toolbox = toolbox
        self.gate = gate
        self.tool_context = tool_context

    async def run(
        self, port: TurnPort, requests: RequestBuilder, limits: LoopLimits, trace: LoopTrace, *, conversation: str = ""
    ) -> LoopResult:
        """Run (or resume) the turn whose record ``port.transcript`` is.

        Args:
            trace: filled in as the loop goes (the caller saves it with the turn).
            conversation: a readable conversation key, for tools' logs.

        Raises:
            ModelError: the endpoint failed (after the one retry on a context-length refusal);
                every step before it is recorded, so the turn can be resumed later.
        """
        run = self._start(port, requests, limits, trace, conversation)
        run.ended_by, run.nudge = await self._close_interrupted(run)
        while await self._step(run):
            pass
        return await self._close(run)

    def _start(
        self, port: TurnPort, requests: RequestBuilder, limits: LoopLimits, trace: LoopTrace, conversation: str
    ) -> _Run:
        names = [s["function"]["name"] for s in requests.tool_schemas if isinstance(s.get("function"), dict)]
        state = LoopState.replay(port.transcript, self.toolbox.kind)
        visible = Visible(frozenset(names), trace)
        turn = TurnState(port, state, trace, limits.max_messages, visible)
        ctx = ToolContext(
            workspace=self.tool_context.workspace, data_dir=self.tool_context.data_dir, turn=turn,
            conversation=conversation, extras=self.tool_context.extras,
        )
        return _Run(
            port=port, requests=requests, limits=limits, trace=trace, state=state, turn=turn, visible=visible,
            stream=_SayStream(port, state, limits, turn, visible), ctx=ctx,
            work_tools=tuple(n for n in names if self.toolbox.kind(n) is ToolKind.WORK),
            used_ids=requests.call_ids(),
        )

    async def _step(self, run: _Run) -> bool:
        """One round: judge an ending, check the limits, take what arrived meanwhile, ask the
        model, act on its answer. ``False`` when the turn is over (``run.stop_reason`` says why)."""
        if run.port.stop.is_set():
            run.stop_reason = "stopped"
            return False
        if run.ended_by is not None and await self._gate(run):
            return False
        limit = self._limit(run)
        if limit is not None:
            run.stop_reason = limit
            return False
        if (run.limits.max_steps - run.state.steps >= STEER_MIN_STEPS_LEFT
                and len(run.state.delivered) < run.limits.max_messages):
            # later messages wait for the next turn: this one must keep steps, and room under
            # its message cap, to answer them
            for steer in await run.port.take_steering():
                run.state.on_user(steer)
                run.nudge = None
        try:
            completion = await self._ask(run)
        except Stopped:
            run.stop_reason = "stopped"
            return False
        except ContextTooLong:
            if not run.state.delivered:
                raise  # nothing got through: the turn fails with the "too long" note
            # the turn's own steps filled the window after it had answered: stop here; the
            # next turn starts from compacted history
            run.stop_reason = "context_full"
            return False
        if completion is None:  # a burst went on: asked again with all of it
            return True
        if completion.tool_calls:
            await self._act(run, completion)
        else:
            await self._answer(run, completion)
        return True

    async def _gate(self, run: _Run) -> bool:
        """The model ended its turn: may it? ``True`` when the turn is over."""
        ended_by, run.ended_by = run.ended_by, None
        run.port.judging()
        try:
            decision = await _unless_stopped(run.port.stop, self.gate.check(run.state.gate_input(
                ended_by or "end_turn", run.hit_length, run.gate_continues,
                silent_ok=run.limits.silent_ok, work_tools=run.work_tools,
            )))
        except Stopped:
            run.stop_reason = "stopped"
            return True
        run.trace.gate.append(_gate_entry(len(run.trace.steps), decision))
        if decision.done:
            run.stop_reason = "end_turn" if ended_by == "end_turn" else "final_reply"
            capped = run.gate_continues >= MAX_GATE_CONTINUES
            if capped and run.unmet is not None and run.state.work_ok == 0 and run.state.delivered:
                run.stop_reason += "+unfinished"  # the check found it undone to the end: say so
            return True
        run.gate_continues += 1
        run.unmet = decision
        run.nudge = decision.nudge
        if ended_by == "text" and run.length_stalls >= LENGTH_STALL_LIMIT:
            run.nudge = (run.nudge or "") + " " + self._length_advice(run)
        return False

    @staticmethod
    def _limit(run: _Run) -> str | None:
        """The limit the turn has reached, if any (it stops there)."""
        if run.state.steps >= run.limits.max_steps:
            return "step_cap"
        if run.state.idle_steps >= IDLE_STEP_LIMIT:
            return "looping"  # no need to wait for the step cap
        if run.length_stalls > LENGTH_STALL_LIMIT:
            return "budget"  # told to write less at a time, and still cut
        if run.turn.undeliverable:
            return "undeliverable"  # e.g. the user blocked the bot: stop spending tokens
        return None

    async def _ask(self, run: _Run) -> Completion | None:
        """The step's completion (a reflex reply cut by its budget asked again once with the
        deliberate one); ``None`` when more messages of the burst the turn began with came
        while its first completion was awaited: it was aborted, and the rest of the burst
        taken in."""
        stop, limits = run.port.stop, run.limits
        request, estimate = await run.requests.build(run.nudge)
        if run.nudge:
            run.visible.echoes.add(run.nudge)
        run.port.waiting()
        run.stream.reset()
        # the first completion of a turn that began at once may be asked again when the
        # burst it began with goes on (cognition.debounce_s): it has shown nothing yet
        first = not run.trace.steps and not run.restarted and not run.state.delivered
        try:
            completion = await _unless_stopped(stop, self._complete_fitting(
                request, run.nudge, run.requests, limits, run.stream.listener
            ), burst=run.port.burst if first else None, may_restart=lambda: not run.stream.shown)
        except Burst:
            run.restarted = True
            await _unless_stopped(stop, run.port.settle_burst())
            for steer in await run.port.take_steering(burst=True):
                run.state.on_user(steer)
            run.nudge = None
            return None
        step = StepTrace(
            step=len(run.trace.steps) + 1,
            finish_reason=completion.finish_reason,
            prompt_tokens=completion.prompt_tokens,
            completion_tokens=completion.completion_tokens,
            estimate=estimate,
            tool_choice=completion.tool_choice,
        )
        await run.port.answered()
        await run.requests.observe_usage(completion.prompt_tokens, estimate)
        if _cut_short(completion) and limits.escalate_tokens and limits.escalate_tokens > limits.max_tokens:
            # a reply cut by the reflex budget: ask again once with the deliberate one, before
            # anything of it is run or delivered
            limits.max_tokens, limits.escalate_tokens = limits.escalate_tokens, None
            run.port.restart_previews()  # the new text takes the shown messages over
            run.stream.reset()
            completion = await _unless_stopped(stop, self._complete(request, run.requests.tool_schemas, limits, run.stream.listener))
            step.finish_reason, step.escalated = completion.finish_reason, True
            step.completion_tokens = completion.completion_tokens
        run.trace.steps.append(_fields(step))
        run.hit_length = completion.hit_length
        run.length_stalls = run.length_stalls + 1 if run.hit_length else 0
        run.nudge = None
        return completion

    async def _act(self, run: _Run, completion: Completion) -> None:
        """A step with tool calls: record it, run the calls, and decide what the model is told
        next (or that it ended its turn)."""
        state, port = run.state, run.port
        said_before = len(state.delivered)
        fitted = [self._fit_call(_unique_id(c, run.used_ids), run) for c in completion.tool_calls]
        calls = [call for call, _ in fitted]
        unusable = {call.id: error for call, error in fitted if error is not None}
        # text of only invisible characters is no text (strict endpoints refuse it)
        content = "" if blank(completion.content) else storable_text(completion.content)
        message = Message(role="assistant", content=content, tool_calls=[c.to_api() for c in calls])
        await port.record(message)  # before any side effect: a crash from here on is resumable
        state.on_assistant(message)
        for streamed, call in zip(completion.tool_calls, calls, strict=True):
            if streamed.index is not None and call.name == "say" and call.id not in unusable:
                port.bind_say(streamed.index, call.id)
        plan = state.plan(calls)
        run.turn.lost = False
        failed = await self._run_calls(run, plan, unusable)
        await port.settle_previews()
        state.step_done(said_before, plan, cut=run.hit_length)
        if run.turn.end_requested:
            run.turn.end_requested = False
            if not run.turn.lost:  # a message that did not get out must not end the turn
                run.ended_by = "end_turn"
                return
        run.nudge = post_tool_nudge(failed, state.delivered)
        if run.length_stalls >= LENGTH_STALL_LIMIT:
            run.nudge += " " + self._length_advice(run)

    async def _answer(self, run: _Run, completion: Completion) -> None:
        """A completion without tool calls (the endpoint did not force tools): the model's
        last word. It is delivered as any say would be, and the gate judges the ending."""
        state = run.state
        await run.port.settle_previews()  # a say streamed before an escalation asked again
        said_before = len(state.delivered)
        text = self._fit_text(run.visible(completion.content), run)
        text = "" if blank(text) else storable_text(text)
        if text and state.already_said(text):
            run.trace.cut("exact_repeat", chars=len(text))
            text = ""
        elif text and len(state.delivered) >= run.limits.max_messages:
            run.trace.cut("message_cap", chars=len(text))
            text = ""
        if text and not run.turn.undeliverable:
            await run.turn.reply(text)  # recorded with its outbox row; counts the step
        else:
            state.steps += 1
        state.step_done(said_before, [], cut=run.hit_length)
        run.ended_by = "text"

    async def _close(self, run: _Run) -> LoopResult:
        """The loop is over: say what the user must still be told, once.

        A turn with nothing delivered gets one tool-less try for a plain answer, whether the
        model ended it or it stopped at a limit (a weak model that only loops on tools can
        still answer in plain text), then an honest note. A turn that said something and then
        stopped at a limit (or that the check found undone to the end) gets closing words: the
        model is asked, without tools, to tell the user in their language what it did and what
        is left; a plain note when it cannot. Nothing is added past the turn's message cap (it
        counts every message the user gets), to an automation's turn (nobody is waiting for an
        apology), nor to a chat the platform refuses."""
        state, stop_reason = run.state, run.stop_reason
        if stop_reason == "stopped":
            await run.port.stopped()  # what was delivered stays; nothing more is said
            return self._result(run, stop_reason)
        if run.limits.silent_ok:
            # a scheduled or autonomous turn: silence is an answer, and nobody awaits an apology
            return self._result(run, stop_reason if state.delivered else stop_reason + "+silent")
        if stop_reason == "undeliverable" or len(state.delivered) >= run.limits.max_messages:
            return self._result(run, stop_reason)
        limit = stop_reason in _LIMIT_WHY
        if not state.delivered and (limit or stop_reason in ("end_turn", "final_reply")):
            text = await self._plain_words(run, LAST_CHANCE_NUDGE, LAST_CHANCE_MAX_TOKENS)
            if text:
                await run.turn.reply(text)
                return self._result(run, stop_reason + "+last_chance")
            stop_reason += "" if limit else "+fallback"
            run.trace.told = "note"
            note = _LIMIT_NOTES[run.stop_reason] if limit else NO_REPLY_MESSAGE
            await run.turn.reply(note, note=True, closing=stop_reason)
            return self._result(run, stop_reason)
        if stop_reason == "context_full":
            run.trace.told = "note"
            await run.turn.reply(CONTEXT_FULL_MESSAGE, note=True, closing=stop_reason)  # the window has no room to ask
            return self._result(run, stop_reason)
        if stop_reason.endswith("+unfinished"):
            reason = _clip(run.unmet.reason, 120) if run.unmet and run.unmet.reason else ""
            why = f"a check found the request not done yet: {reason}" if reason else "a check found the request not done yet"
            note = UNFINISHED_MESSAGE.format(why=f" ({reason})" if reason else "")
            return self._result(run, await self._closing_words(run, stop_reason, why, note))
        if limit:
            why, note = _LIMIT_WHY[stop_reason], _LIMIT_NOTES[stop_reason]
            return self._result(run, await self._closing_words(run, stop_reason, why, note))
        return self._result(run, stop_reason)

    async def _closing_words(self, run: _Run, stop_reason: str, why: str, note: str) -> str:
        """Tell the user once why the turn stopped: in the model's words when it gives new
        ones, else ``note`` (the trace's ``told`` says which). Recorded as the turn's end (a
        crash from here on finishes the turn instead of saying it again)."""
        text = await self._plain_words(run, CLOSING_NUDGE.format(why=why), CLOSING_MAX_TOKENS)
        if text and not run.state.already_said(text):
            run.trace.told = "model"
            await run.turn.reply(text, closing=stop_reason)
        else:
            run.trace.told = "note"
            await run.turn.reply(note, note=True, closing=stop_reason)
        return stop_reason

    @staticmethod
    def _result(run: _Run, stop_reason: str) -> LoopResult:
        return LoopResult(messages=run.port.transcript, stop_reason=stop_reason, delivered=list(run.state.delivered))

    async def _plain_words(self, run: _Run, nudge: str, max_tokens: int) -> str:
        """One tool-less completion with ``nudge``, its text as it may reach the user; ``""``
        when it fails or says nothing usable."""
        limits = run.limits
        try:
            request, _ = await run.requests.build(nudge)
            run.visible.echoes.add(nudge)
            # without the tool rounds: a weak model shown them only writes another call as text,
            # and some servers refuse tool messages in a request that offers no tools
            completion = await self.llm.complete(
                _plain_conversation(request), model=limits.model, max_tokens=min(limits.max_tokens, max_tokens),
                temperature=limits.temperature,
            )
        except Exception as exc:  # the plain note is sent instead
            log.info("a tool-less reply failed: %s", exc)
            return ""
        text = run.visible(completion.content)
        if len(text) > max_tokens * 4:
            run.trace.cut("say_budget", chars=len(text) - max_tokens * 4)
            text = text[: max_tokens * 4 - 1].rstrip() + "…"
        return "" if blank(text) else storable_text(text)

    def _length_advice(self, run: _Run) -> str:
        return LENGTH_ADVICE_FILE if "write_file" in run.visible.tools else LENGTH_ADVICE

    async def _complete_fitting(
        self,
        request: list[dict[str, Any]],
        nudge: str | None,
        requests: RequestBuilder,
        limits: LoopLimits,
        on_say: SayListener | None = None,
    ) -> Completion:
        """One completion; a context-length refusal compacts (or prunes) and retries once."""
        try:
            return await self._complete(request, requests.tool_schemas, limits, on_say)
        except ContextTooLong as exc:
            # compact (or prune) and retry once; a second refusal ends the turn
            await requests.observe_refusal(exc.prompt_tokens)  # estimates were low: learn now
            await requests.shrink()
            request, _ = await requests.build(nudge)
            return await self._complete(request, requests.tool_schemas, limits, on_say)

    async def _run_calls(self, run: _Run, plan: list[tuple[ToolCall, bool]], unusable: dict[str, str]) -> list[str]:
        """Run a step's calls concurrently, recording each result as it completes; returns the
        names of the calls that failed. A call in ``unusable`` (id -> why) is not run: its
        result is that error."""
        budget = _StepBudget(run.limits.max_tool_result_chars, len(plan))
        ctx, port = run.ctx, run.port
        step = run.trace.steps[-1]

        async def one(call: ToolCall, allowed: bool) -> tuple[ToolResult, float]:
            call_ctx = ToolContext(
                workspace=ctx.workspace, data_dir=ctx.data_dir, turn=ctx.turn,
                conversation=ctx.conversation, call_id=call.id, extras=ctx.extras,
            )
            if call.id in unusable:
                result, seconds = ToolResult.error(unusable[call.id]), 0.0
            elif call.name in UNTIMED:  # a delivery is never cut off halfway (see _execute)
                result, seconds = await self._execute(call, allowed, call_ctx, run)
            else:
                try:
                    result, seconds = await _unless_stopped(port.stop, self._execute(call, allowed, call_ctx, run))
                except Stopped:
                    result, seconds = ToolResult.error(STOPPED_RESULT), 0.0
            fitted = budget.fit(result)
            if fitted is not result:
                run.trace.cut("result_cap", call=call.id, chars=len(result.content) - len(fitted.content))
            await port.record(
                Message(role="tool", content=fitted.content, tool_call_id=call.id, name=call.name, ok=fitted.ok)
            )
            return fitted, seconds

        results = await _all_or_none([one(c, allowed) for c, allowed in plan])
        failed: list[str] = []
        for (call, _), (result, seconds) in zip(plan, results, strict=True):
            step["tool_calls"].append(
                {"name": call.name, "ok": result.ok, "seconds": round(seconds, 3), "kind": str(self.toolbox.kind(call.name))}
            )
            run.state.on_result(call, result)
            if not result.ok:
                failed.append(call.name)
        return failed

    async def _close_interrupted(self, run: _Run) -> tuple[str | None, str | None]:
        """Resume: give the calls a crash cut off a result, and say what the last recorded
        step asks for next: ``("end_turn" | "text", None)`` when it had ended the turn (the
        gate decides again), ``(None, nudge)`` after a tool round, ``(None, None)`` otherwise.
        A ``say`` or ``send_file`` that never reached the outbox is delivered now, as recorded."""
        port = run.port
        closed = await self._close_open_calls(port, ToolResult.error(INTERRUPTED), run)
        if closed:
            log.info("resumed a turn: %d interrupted call(s) closed", closed)
        last = port.transcript[-1]
        if last.role == "assistant" and not last.tool_calls and not last.note:
            return "text", None
        if last.role != "tool":
            return None, None
        block = _last_block(port.transcript)
        failed = [m.name or "" for m in block[1:] if m.ok is False]
        ended = any(_call(c).name == "end_turn" for c in block[0].tool_calls or ())
        if ended and not any(_lost(m) for m in block[1:]):
            return "end_turn", None
        return None, post_tool_nudge(failed, run.state.delivered)

    async def abandon(self, port: TurnPort, reason: str) -> None:
        """The turn ends without the loop (a bug stopped it mid-step, or it is given up after
        repeated crashes): give its cut-off calls a result, so the history stays a valid
        sequence. A ``say`` gets what its delivery did (nothing new is sent); a work call
        ``not completed: <reason>``."""
        await self._close_open_calls(port, ToolResult.error(f"not completed: {reason}"))

    async def _close_open_calls(self, port: TurnPort, other: ToolResult, run: _Run | None = None) -> int:
        """Record a result for each call of the transcript that has none; returns how many.
        With ``run`` (a resume), a delivery with no outbox row is made now."""
        open_calls = [_call(c) for c in _open_calls(port.transcript)]
        if not open_calls:
            return 0
        rows = {e.tool_call_id: e for e in await port.outbox() if e.tool_call_id}
        for call in open_calls:
            if call.name in DELIVERIES and run is not None and call.id not in rows:
                # the repeat guard decided when the step was recorded
                allowed = run.state.allowed.get(call.id, True)
                result = await self._deliver_recorded(call, run) if allowed else _refused(call)
            elif call.name in DELIVERIES:
                result = _delivery_of(rows.get(call.id)).as_result()
            elif call.name in _COMPLETED_ON_RESUME:
                result = ToolResult(_COMPLETED_ON_RESUME[call.name])
            else:
                result = other
            await port.record(Message(role="tool", content=result.content, tool_call_id=call.id, name=call.name, ok=result.ok))
            if run is not None:
                run.state.on_result(call, result)
        return len(open_calls)

    async def _deliver_recorded(self, call: ToolCall, run: _Run) -> ToolResult:
        """A ``say`` or ``send_file`` recorded before a crash that never reached the outbox:
        nothing of it was sent, so it is delivered now, exactly as recorded."""
        if call.name == "say":
            text = _say_text(call.arguments)
            if not text:
                return ToolResult.error("nothing to say: text is empty")
            return (await run.turn.say(text, call_id=call.id)).as_result()
        ctx = run.ctx
        call_ctx = ToolContext(
            workspace=ctx.workspace, data_dir=ctx.data_dir, turn=ctx.turn, conversation=ctx.conversation,
            call_id=call.id, extras=ctx.extras,
        )
        return await self.toolbox.execute(call.name, call.arguments, call_ctx)

    async def _complete(
        self, request: list[dict[str, Any]], schemas: list[dict[str, Any]], limits: LoopLimits,
        on_say: SayListener | None = None,
    ) -> Completion:
        return await self.llm.complete(
            request,
            model=limits.model,
            max_tokens=limits.max_tokens,
            temperature=limits.temperature,
            tools=schemas,
            thinking=limits.thinking,
            on_say=on_say,
        )

    async def _execute(self, call: ToolCall, run_it: bool, ctx: ToolContext, run: _Run) -> tuple[ToolResult, float]:
        started = time.monotonic()
        limits = run.limits
        if not run_it:
            return _refused(call), 0.0
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

    def _fit_text(self, text: str, run: _Run, call: str | None = None) -> str:
        limit = _reply_chars(run.limits)
        if len(text) <= limit:
            return text
        run.trace.cut("say_budget", call=call, chars=len(text) - limit + 1)
        return text[: limit - 1].rstrip() + "…"

    def _fit_call(self, call: ToolCall, run: _Run) -> tuple[ToolCall, str | None]:
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
        else:
            if call.name == "say" and isinstance(args.get("text"), str):
                raw = args["text"]
                reasoned = strip_reasoning(raw)
                if reasoned != raw.strip():
                    run.trace.cut("reasoning", call=call.id, chars=len(raw) - len(reasoned))
                # history never keeps reasoning, nor a lone surrogate (no store or request takes one)
                clean = storable_text(self._fit_text(reasoned, run, call.id))
                if clean != raw:
                    args["text"] = clean
                    return ToolCall(id=call.id, name=call.name, arguments=json_text(args)), None
            return call, None
        error = (
            f"Not run: the arguments of {call.name} were {problem}; they began {_clip(call.arguments, 80)!r}. "
            "Call it again with a JSON object of its parameters, and keep it short."
        )
        return ToolCall(id=call.id, name=call.name, arguments="{}"), error


#: The result of a tool call ``/stop`` cut off.
STOPPED_RESULT = "Stopped: the user stopped this turn (/stop) before the call finished."
#: What history keeps of a stopped turn, after what the user saw of it.
STOPPED_NOTE = "[The user stopped this turn with /stop; it ended here.]"

#: The last try is a short plain answer (servers that ignore ``max_tokens`` are cut to it).
LAST_CHANCE_MAX_TOKENS = 512
LAST_CHANCE_NUDGE = (
    "[Same turn] No tools now. Write your answer to the user's last message as plain text."
)
#: Closing words are a sentence or two.
CLOSING_MAX_TOKENS = 160
CLOSING_NUDGE = (
    "[Same turn] No tools now: your turn is over ({why}). Write to the user, in the language they "
    "wrote in, a short plain message: your answer if you have one; otherwise honestly what you did, "
    "what is left, and that they can ask you to go on."
)

LENGTH_ADVICE_FILE = (
    "Your last replies hit the length limit three times in a row. Put long output in a file with "
    "write_file, then say() a short summary and where the file is."
)
LENGTH_ADVICE = (
    "Your last replies hit the length limit three times in a row. Say less at a time: several "
    "short say() calls instead of one long one."
)


def _plain_conversation(request: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``request`` without tool rounds, for a tool-less request: what ``say`` delivered becomes
    plain assistant text, other calls and all results go, and neighbours of one role are
    merged (templates that demand alternation, Mistral and Gemma, refuse two in a row)."""
    out: list[dict[str, Any]] = []
    for m in request:
        if m["role"] == "tool":
            continue
        if m.get("tool_calls"):
            said = [_say_text(c["function"].get("arguments") or "") for c in m["tool_calls"]
                    if c.get("function", {}).get("name") == "say"]
            if not any(said):
                continue
            m = {"role": "assistant", "content": "\n\n".join(t for t in said if t)}
        last = out[-1] if out else None
        if (last is not None and last["role"] == m["role"] and m["role"] in ("user", "assistant")
                and isinstance(last.get("content"), str) and isinstance(m.get("content"), str)):
            out[-1] = {**last, "content": f"{last['content']}\n\n{m['content']}"}
        else:
            out.append(m)
    return out


def post_tool_nudge(failed: list[str], delivered: list[str]) -> str:
    """The short note after a tool round (spec, "Post-tool nudge")."""
    # failures share the marked sentence: a weak model that echoes it echoes the marker too
    failures = f"; failed: {', '.join(dict.fromkeys(failed))}" if failed else ""
    parts = [f"[Same turn] Tool results are ready{failures}."]
    if delivered:
        told = "; ".join(f'"{_clip(t, 80)}"' for t in delivered[-3:])
        parts.append(f"Already told the user (do not repeat): {told}.")
    parts.append("Next: call more tools, say() to talk to the user, or end_turn() when done.")
    return " ".join(parts)


def _refused(call: ToolCall) -> ToolResult:
    """The result of a call the repeat guard refused."""
    return ToolResult.error(
        f"Not executed: {call.name} already ran in your last {REPEAT_LIMIT - 1} steps, and the same tool "
        "a third time in a row is refused. Use the results above, try a different tool, or tell the "
        "user what you found and call end_turn."
    )


def _delivery_of(entry: OutboxEntry | None) -> DeliveryReport:
    """What became of a ``say`` or ``send_file`` whose call a crash cut off, from its outbox row."""
    if entry is None:
        return DeliveryReport(delivered=False, error=NEVER_SENT)
    if entry.status == "sent":
        return DeliveryReport(delivered=True)
    if entry.status == "pending":
        return DeliveryReport(delivered=False, queued=True)
    return DeliveryReport(delivered=False, error=entry.last_error or "the platform refused the message")


def _last_block(transcript: list[Message]) -> list[Message]:
    """The last assistant message with tool calls and the results after it."""
    start = len(transcript)
    while start > 0 and transcript[start - 1].role == "tool":
        start -= 1
    return transcript[start - 1 :] if start > 0 else []


def _open_calls(transcript: list[Message]) -> list[dict[str, Any]]:
    """Calls of the last step that have no result (a crash cut them off)."""
    block = _last_block(transcript)
    if not block or block[0].role != "assistant" or not block[0].tool_calls:
        return []
    answered = {m.tool_call_id for m in block[1:]}
    return [c for c in block[0].tool_calls if c.get("id") not in answered]


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
    return call if new_id == call.id else ToolCall(id=new_id, name=call.name, arguments=call.arguments, index=call.index)


def _reply_chars(limits: LoopLimits) -> int:
    """The longest message a step may say: its token budget, in characters, with slack for
    the estimate (some servers ignore ``max_tokens``)."""
    return max(MIN_REPLY_CHARS, int(limits.max_tokens * 4 * REPLY_SLACK))


def _cut_short(completion: Completion) -> bool:
    """The completion stopped at ``max_tokens`` with a reply that cannot be used as it is:
    plain text cut mid-way, or a tool call whose arguments are not a whole JSON object."""
    if not completion.hit_length:
        return False
    if not completion.tool_calls:
        return True
    return not all(valid_arguments(call.arguments) for call in completion.tool_calls)


def _lost(result: Message) -> bool:
    """A ``say`` result that reports a message that did not get out (not one the engine
    dropped on purpose: a repeat or past the turn's message limit)."""
    if result.name != "say" or result.ok is not False:
        return False
    try:
        payload = json.loads(result.content)
    except ValueError:
        return True
    return not (isinstance(payload, dict) and payload.get("dropped"))


def _clip(text: str, n: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "…"


def _fields(obj: Any) -> dict[str, Any]:
    return {name: getattr(obj, name) for name in obj.__slots__}


def _gate_entry(step: int, decision: GateDecision) -> dict[str, Any]:
    return {"step": step, "done": decision.done, "reason": decision.reason, "judge": decision.judge}
