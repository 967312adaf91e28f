"""The bounded agent loop of one turn (spec, "Agent loop").

Each step sends one chat completion with every tool and tool forcing. Tool calls of a step run
concurrently (``asyncio.gather``), each under a timeout. Speaking is the ``say`` tool; ending
is ``end_turn``, which goes through the completion gate. Text the model writes alongside tool
calls is private reasoning and is never delivered. A plain-text answer (an endpoint that does
not enforce ``tool_choice``) is delivered as an implicit ``say`` unless it only repeats what
was already said.

**Checkpoints** (issue 8). Every step is recorded as it happens, through the :class:`TurnPort`:
the assistant message *before* its tools run, each tool result as soon as it completes, and
every message for the user in the outbox. What the loop knows of a turn (:class:`LoopState`:
what was said, which work tools ran, the repeat guard) is a function of that record, so a turn
resumed after a crash rebuilds it with :meth:`LoopState.replay` and goes on:

* a call whose result was recorded is never run again;
* a ``say`` that was cut off is answered from the outbox (delivered, queued, or never sent);
* any other call that was cut off gets a result saying it was interrupted and may or may not
  have taken effect; it is not silently run again;
* a step that had ended the turn (``end_turn``, or a plain-text reply) goes to the gate again,
  unless one of its ``say`` calls did not get out: then, as in a live step, the model is told
  and goes on.

Limits: tool continuation rounds are clamped to [0, 16]; steps are capped at
``max(6, min(25, 6 + rounds))``; a work tool called in three consecutive steps is refused from
the third (spec, "Repeat guard"); three steps in a row that bring nothing new stop a looping
model; after 3 consecutive length-limited completions the model is told to use ``write_file``.
A turn that ends with nothing said gets one tool-less try for a plain answer, then an honest
short message, never silence. A reflex turn ends at its first real reply.

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
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from difflib import SequenceMatcher
from typing import Any, Protocol, TypeVar

from bumblebot.compaction import cap_tool_result
from bumblebot.errors import ContextTooLong
from bumblebot.events import blank, storable_text
from bumblebot.gate import (
    MAX_GATE_CONTINUES,
    CompletionGate,
    GateDecision,
    GateInput,
    Preview,
    progress_only,
)
from bumblebot.llm import LLM, Completion, SayListener, ToolCall
from bumblebot.messages import Message, json_object, json_text, valid_arguments
from bumblebot.reasoning import strip_reasoning
from bumblebot.store import OutboxEntry
from bumblebot.toolkit import DeliveryReport, Toolbox, ToolContext, ToolKind, ToolResult

log = logging.getLogger(__name__)
_T = TypeVar("_T")

PREVIEW_CHARS = 280
PREVIEW_COUNT = 8
#: The same work tool in this many consecutive steps is refused (spec, "Repeat guard").
REPEAT_LIMIT = 3
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
STEP_CAP_MESSAGE = (
    "I had to stop here: this took more steps than I'm allowed in one turn. "
    "Tell me to continue and I'll pick it up from where I stopped."
)
NO_REPLY_MESSAGE = "Sorry, I couldn't put an answer together this time. Could you say that again?"
LOOPING_MESSAGE = "Sorry, I got stuck on that and couldn't answer. Could you put it another way?"
UNFINISHED_MESSAGE = "Sorry, I didn't get that done this time{why}. Tell me if I should try again."
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
    """``text`` only repeats what was already delivered, or is a pro-forma "done" or closing
    filler ("Anything else I can help with?") after something was said.

    A repeat is judged on words (lowercased, outer punctuation dropped): the text's words
    appear in that order within something said, or match it at difflib ratio
    :data:`NEAR_DUPLICATE` or more, where no word that differs carries a digit ("at 5pm" and
    "at 6pm" are different facts).
    """
    norm = _norm(text)
    if not norm:
        return True
    if said and (norm.strip(" .!") in {p.strip(" .!") for p in _PRO_FORMA} or _FILLER.match(norm)):
        return True
    words = _words(text)
    if not words or not said:
        return not words and bool(said)
    key = "\x00" + "\x00".join(words) + "\x00"
    for earlier in said:
        other = _words(earlier)
        if key in "\x00" + "\x00".join(other) + "\x00" or _near(words, other):
            return True
    return False


#: Word-level similarity at or above which two messages are the same message.
NEAR_DUPLICATE = 0.85
#: Words compared for near-duplicates (difflib is quadratic in the worst case, on the loop).
SIMILARITY_WORDS = 400
_OUTER_PUNCTUATION = "\"'`.,;:!?()[]{}<>«»“”‘’…-–—*_~"


def _words(text: str) -> list[str]:
    out = []
    for token in text.lower().split()[:SIMILARITY_WORDS]:
        token = token.strip(_OUTER_PUNCTUATION)
        if token:
            out.append(token)
    return out


def _near(a: list[str], b: list[str]) -> bool:
    if 2 * min(len(a), len(b)) < NEAR_DUPLICATE * (len(a) + len(b)):
        return False
    if any(any(c.isdigit() for c in w) for w in set(a) ^ set(b)):
        return False
    matcher = SequenceMatcher(None, a, b, autojunk=False)
    return matcher.quick_ratio() >= NEAR_DUPLICATE and matcher.ratio() >= NEAR_DUPLICATE


#: Words of a message that only says work is under way ("Good question! Let me think.").
_PROGRESS_CUES = (
    "let me", "let's see", "one moment", "one sec", "just a moment", "give me a", "hold on",
    "hang on", "on it", "checking", "looking into", "looking it up", "thinking", "working on",
    "i'll", "i will", "i'm going to", "bear with me",
)
#: Cues that announce work only when they open the message ("I'll check"), not when they close
#: an answer ("I'm great! I'll be around all day.").
_FUTURE_CUES = frozenset({"i'll", "i will", "i'm going to"})
#: A message longer than this is content, whatever cue it has.
PROGRESS_NOTE_CHARS = 100


def progress_note(text: str) -> bool:
    """``text`` only says work is under way: the gate's progress-only check, or a short
    message with a progress cue (:data:`_PROGRESS_CUES`). Linear in the text."""
    if progress_only(text):
        return True
    norm = _norm(text).replace("let me know", "")
    if len(norm) > PROGRESS_NOTE_CHARS:
        return False
    # the cue opens the message or its last sentence ("Good question! Let me check."): an
    # answer that merely contains "I'll" somewhere ("I'm great! I'll be around") is content
    last = _SENTENCE_END.split(norm.rstrip(" .!"))[-1].lstrip(" \"'*-")
    if any(norm.lstrip(" \"'*-").startswith(cue) for cue in _PROGRESS_CUES):
        return True
    # a closing "Let me check." after a greeting is a note; a closing "I'll be around" is not
    return any(last.startswith(cue) for cue in _PROGRESS_CUES if cue not in _FUTURE_CUES)


def _say_text(arguments: str) -> str:
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return ""
    text = value.get("text") if isinstance(value, dict) else None
    return strip_reasoning(text) if isinstance(text, str) else ""


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
    #: a reflex turn: a step that said something and ran no work tool ends the turn
    one_reply: bool = False
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
    """What a run of the loop did, for ``bumblebot trace`` (steps of earlier runs included)."""

    steps: list[dict[str, Any]] = field(default_factory=list)
    gate: list[dict[str, Any]] = field(default_factory=list)
    thoughts: list[str] = field(default_factory=list)


@dataclass(slots=True)
class LoopResult:
    messages: list[Message]
    stop_reason: str
    delivered: list[str]


class TurnPort(Protocol):
    """What the loop needs of the turn it runs (``bumblebot.turn`` implements it).

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

    def on_say(self) -> SayListener | None:
        """Where the text of ``say`` calls goes while a completion is streamed (shown in the
        chat as it is written, ``bumblebot/preview.py``); ``None``: nothing is streamed."""
        return None

    def bind_say(self, index: int, call_id: str) -> None:
        """The ``say`` streamed at position ``index`` is the recorded call ``call_id``: its
        delivery takes the streamed message over."""

    async def settle_previews(self) -> None:
        """The step is over: streamed text no ``say`` took over is taken down."""

    def waiting(self) -> None:
        """The turn waits on the model again (the typing indicator shows)."""

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
        self.steps = 0
        self.work_calls = 0
        self.work_ok = 0
        self.previews: deque[Preview] = deque(maxlen=PREVIEW_COUNT)
        #: work tool -> consecutive steps it was called in (the repeat guard)
        self._streak: dict[str, int] = {}
        self._calls: dict[str, ToolCall] = {}
        #: (tool, canonical arguments) of every work call that ran this turn
        self._ran: set[tuple[str, str]] = set()
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
            self._said(message.content)

    def _said(self, text: str) -> None:
        if _norm(text) not in {_norm(t) for t in self.delivered}:
            self.delivered.append(text)

    def already_said(self, text: str) -> bool:
        return _norm(text) in {_norm(t) for t in self.delivered}

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
            plan.append((call, self._streak.get(call.name, 0) < REPEAT_LIMIT or call.name not in work))
        return plan

    def step_done(self, said_before: int, ran: list[tuple[ToolCall, bool]], *, cut: bool = False) -> None:
        """Count a step that brought nothing new (nothing said, no work call that ran with new
        arguments): :data:`IDLE_STEP_LIMIT` of them in a row mean the model is looping. A step
        cut at the token budget (``cut``) is trying, not looping, and a step that ends the turn
        is the completion gate's to judge: both are left out."""
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
        if call.name == "say" and result.ok:
            text = _say_text(call.arguments)
            if text:
                self._said(text)
        if self._kind(call.name) is ToolKind.WORK:
            self.work_calls += 1
            self.work_ok += int(result.ok)
            self.previews.append(Preview(call.name, result.ok, result.content[:PREVIEW_CHARS]))

    def gate_input(
        self, ended_by: str, hit_length: bool, continues: int, *, reflex: bool = False, silent_ok: bool = False
    ) -> GateInput:
        """What the gate judges. ``reflex``: the router sent the turn to reflex; it stays a
        reflex chat turn for the gate only while no mid-turn message joined the input the
        router saw (a steered "and write it to a file" was never routed)."""
        return GateInput(
            user_text="\n".join(self.user_texts),
            visible=list(self.delivered),
            work_calls=self.work_calls,
            work_ok=self.work_ok,
            previews=list(self.previews),
            ended_by=ended_by,
            last_hit_length=hit_length,
            continues_so_far=continues,
            chat_reflex=reflex and len(self.user_texts) == 1,
            silent_ok=silent_ok,
        )


def _call(api: dict[str, Any]) -> ToolCall:
    fn = api.get("function") or {}
    return ToolCall(id=api.get("id") or "", name=fn.get("name") or "", arguments=fn.get("arguments") or "{}")


class TurnState:
    """The running turn as agency tools see it (:class:`bumblebot.toolkit.TurnControl`)."""

    def __init__(self, port: TurnPort, state: LoopState, thoughts: list[str], max_messages: int) -> None:
        self._port = port
        self._state = state
        self._max_messages = max_messages
        self._order = asyncio.Lock()  # FIFO: several say() calls of one step keep call order
        self.thoughts = thoughts
        self.end_requested = False
        #: a say of the current step did not get out (the turn must not end on it)
        self.lost = False
        #: the platform refused a message for good (blocked bot, deleted chat): talking on is futile
        self.undeliverable: str | None = None

    async def say(self, text: str, *, call_id: str | None = None) -> DeliveryReport:
        """Deliver a ``say``: not at all when it (nearly) repeats what this turn said, or when
        the turn already sent :attr:`LoopLimits.max_messages` messages (issue 9)."""
        text = for_the_user(text)
        if not text:
            return DeliveryReport(
                delivered=False, dropped="not sent: nothing left after removing reasoning and engine notes"
            )
        if self.undeliverable:
            return DeliveryReport(delivered=False, error=self.undeliverable)
        async with self._order:  # checked under the lock: two equal says of one step count too
            said = self._state.delivered
            if said and repeats_said(text, said):
                return DeliveryReport(delivered=True, duplicate=True)
            if len(said) >= self._max_messages:
                return DeliveryReport(
                    delivered=False,
                    dropped=f"not sent: this turn already sent {len(said)} messages, the most it may; "
                    "stop talking and call end_turn",
                )
            report = await self._port.say(text, tool_call_id=call_id)
            if report.ok:
                self._state._said(text)
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
        """A file for the user (``send_file``); its caption is cleaned like a ``say``. In call
        order with the step's ``say`` calls (the order lock is taken before anything else)."""
        if self.undeliverable:
            return DeliveryReport(delivered=False, error=self.undeliverable)
        async with self._order:
            report = await self._port.send_file(str(path), for_the_user(caption) if caption else "", tool_call_id=call_id)
        self._note_unreachable(report)
        return report

    def _note_unreachable(self, report: DeliveryReport) -> None:
        if report.chat_unreachable:
            self.undeliverable = report.error or "the platform refused the message"

    def end_turn(self) -> None:
        self.end_requested = True

    def think(self, thought: str) -> None:
        self.thoughts.append(thought)


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
    parallel calls must not overflow the window between them (field-bugs.md item 12). Results
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
        state = LoopState.replay(port.transcript, self.toolbox.kind)
        turn = TurnState(port, state, trace.thoughts, limits.max_messages)
        ctx = ToolContext(
            workspace=self.tool_context.workspace, data_dir=self.tool_context.data_dir, turn=turn,
            conversation=conversation, extras=self.tool_context.extras,
        )
        length_stalls = gate_continues = 0
        stop_reason = "step_cap"
        unmet: GateDecision | None = None  # the gate's last CONTINUE: what the turn still owes
        schemas = requests.tool_schemas
        used_ids = requests.call_ids()
        interrupted = await self._lost_work(port)  # a crash cut off a step that lost something: redone
        ended_by, nudge = await self._close_interrupted(port, state)
        hit_length = False
        listener = port.on_say()
        previewing: set[int] = set()  # says of the completion being streamed that are shown

        def on_say(index: int, text: str) -> None:
            # nothing is shown that could not be sent (the turn's message cap, counting the
            # says of this completion shown before this one)
            if listener is None or turn.undeliverable:
                return
            if index not in previewing:
                if len(state.delivered) + len(previewing) >= limits.max_messages:
                    return
                previewing.add(index)
            listener(index, text)

        stop = port.stop
        restarted = False  # the first completion was asked again once, for a burst
        while True:
            if stop.is_set():
                stop_reason = "stopped"
                break
            if ended_by is not None:  # the model ended its turn: may it?
                capped = gate_continues >= MAX_GATE_CONTINUES
                try:
                    decision = await _unless_stopped(
                        stop, self.gate.check(state.gate_input(
                            ended_by, hit_length, gate_continues, reflex=limits.one_reply, silent_ok=limits.silent_ok
                        ))
                    )
                except Stopped:
                    stop_reason = "stopped"
                    break
                trace.gate.append(_gate_entry(len(trace.steps), decision))
                if decision.done:
                    stop_reason = "end_turn" if ended_by == "end_turn" else "final_reply"
                    if capped and unmet is not None and state.work_ok == 0 and state.delivered:
                        stop_reason += "+unfinished"  # only promises were said: say so (issue 9)
                    break
                gate_continues += 1
                unmet = decision
                nudge = decision.nudge
                if ended_by == "text" and length_stalls >= LENGTH_STALL_LIMIT:
                    nudge = (nudge or "") + " " + LENGTH_ADVICE
                ended_by = None
            if state.steps >= limits.max_steps:
                break
            if state.idle_steps >= IDLE_STEP_LIMIT:
                stop_reason = "looping"  # no need to wait for the step cap
                break
            if turn.undeliverable:
                stop_reason = "undeliverable"  # e.g. the user blocked the bot: stop spending tokens
                break
            if limits.max_steps - state.steps >= STEER_MIN_STEPS_LEFT:
                # later messages wait for the next turn: this one must keep steps to answer them
                for steer in await port.take_steering():
                    state.on_user(steer)
                    nudge = None
            request, estimate = await requests.build(nudge)
            port.waiting()
            previewing.clear()
            # the first completion of a turn that began at once may be asked again when the
            # burst it began with goes on (cognition.debounce_s): it has shown nothing yet
            burst = port.burst if not trace.steps and not restarted and not state.delivered else None
            try:
                completion = await _unless_stopped(stop, self._complete_fitting(
                    request, nudge, requests, schemas, limits, on_say if listener is not None else None
                ), burst=burst, may_restart=lambda: not previewing)
            except Stopped:
                stop_reason = "stopped"
                break
            except Burst:
                restarted = True
                try:
                    await _unless_stopped(stop, port.settle_burst())
                except Stopped:
                    stop_reason = "stopped"
                    break
                for steer in await port.take_steering(burst=True):
                    state.on_user(steer)
                nudge = None
                continue
            except ContextTooLong:
                if not state.delivered:
                    raise  # nothing got through: the turn fails with the "too long" note
                # the turn's own steps filled the window after it had answered: stop here; the
                # next turn starts from compacted history (issue 9)
                stop_reason = "context_full"
                break
            step = StepTrace(
                step=len(trace.steps) + 1,
                finish_reason=completion.finish_reason,
                prompt_tokens=completion.prompt_tokens,
                completion_tokens=completion.completion_tokens,
                estimate=estimate,
                tool_choice=completion.tool_choice,
            )
            await port.answered()
            await requests.observe_usage(completion.prompt_tokens, estimate)
            if _cut_short(completion) and limits.escalate_tokens and limits.escalate_tokens > limits.max_tokens:
                # a reply cut by the reflex budget: ask again once with the deliberate one,
                # before anything of it is run or delivered (issue 9)
                limits.max_tokens, limits.escalate_tokens = limits.escalate_tokens, None
                try:
                    completion = await _unless_stopped(
                        stop, self._complete(request, schemas, limits, on_say if listener is not None else None)
                    )
                except Stopped:
                    stop_reason = "stopped"
                    break
                step.finish_reason, step.escalated = completion.finish_reason, True
                step.completion_tokens = completion.completion_tokens
            trace.steps.append(_fields(step))
            hit_length = completion.hit_length
            length_stalls = length_stalls + 1 if hit_length else 0
            nudge = None
            said_before = len(state.delivered)

            if completion.tool_calls:
                fitted = [_fit_call(_unique_id(c, used_ids), limits) for c in completion.tool_calls]
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
                turn.lost = False
                failed = await self._run_calls(port, state, plan, ctx, limits, step, unusable)
                await port.settle_previews()
                state.step_done(said_before, plan, cut=hit_length)
                said_now = state.delivered[said_before:]
                # "On it!" is a promise, not the reply: the turn goes on (the gate's own check);
                # the first step after a crash redoes the step it cut off, whose work is done
                # already: saying again what did not get out is not the end of the turn
                redo, interrupted = interrupted, False
                if limits.one_reply and said_now and not redo and not all(
                    progress_only(t) for t in said_now
                ) and not any(allowed and self.toolbox.kind(call.name) is ToolKind.WORK for call, allowed in plan):
                    turn.end_requested = True  # a reflex turn is one reply (docs/cognition.md)
                if limits.one_reply and len(state.delivered) >= limits.max_messages:
                    turn.end_requested = True  # nothing more can be said: a reflex turn is over
                if turn.end_requested:
                    turn.end_requested = False
                    if not turn.lost:  # a message that did not get out must not end the turn
                        ended_by = "end_turn"
                        continue
                nudge = post_tool_nudge(failed, state.delivered)
                if length_stalls >= LENGTH_STALL_LIMIT:
                    nudge += " " + LENGTH_ADVICE
                continue

            # A completion without tool calls: the endpoint did not force tools.
            await port.settle_previews()  # a say streamed before an escalation asked again
            text = _fit_text(for_the_user(completion.content.strip()), limits)
            text = "" if blank(text) else storable_text(text)
            capped = len(state.delivered) >= limits.max_messages
            if text and not turn.undeliverable and not capped and not self._suppressed(text, state):
                await turn.reply(text)  # recorded with its outbox row; counts the step
            else:
                state.steps += 1
                if text:
                    step.tool_calls.append({"name": "(final reply)", "suppressed": True})
            state.step_done(said_before, [], cut=hit_length)
            ended_by = "text"

        if stop_reason == "stopped":
            await port.stopped()  # what was delivered stays; nothing more is said
            return LoopResult(messages=port.transcript, stop_reason=stop_reason, delivered=list(state.delivered))
        if limits.silent_ok and not state.delivered:
            # a scheduled or autonomous turn that said nothing: silence is its answer
            return LoopResult(messages=port.transcript, stop_reason=stop_reason + "+silent", delivered=[])
        if not state.delivered and stop_reason in ("step_cap", "looping", "end_turn", "final_reply") and not turn.undeliverable:
            # nothing reached the user: ask once more, without tools, for a plain answer
            text = await self._last_chance(requests, limits)
            if text:
                await turn.reply(text)
                stop_reason += "+last_chance"
        if (
            stop_reason in ("step_cap", "looping") and state.delivered and state.work_ok == 0
            and all(progress_note(t) for t in state.delivered)
        ):
            stop_reason += "+unfinished"  # only promises got out before it stopped (issue 9 review)
            unmet = unmet or GateDecision(done=False, reason="", nudge=None, judge=None)
        note = None
        if stop_reason.endswith("+unfinished") and unmet is not None:
            note = UNFINISHED_MESSAGE.format(why=f" ({_clip(unmet.reason, 120)})" if unmet.reason else "")
        elif stop_reason in ("step_cap", "looping") and not state.delivered:
            # only when nothing got through: what was said stands
            note = STEP_CAP_MESSAGE if stop_reason == "step_cap" else LOOPING_MESSAGE
        elif stop_reason not in ("undeliverable", "step_cap", "looping") and not state.delivered:
            stop_reason += "+fallback"
            note = NO_REPLY_MESSAGE
        if note is not None:
            # recorded, and marked as the end: the next turn knows what the user saw, and a
            # crash from here on finishes the turn instead of sending the note again
            await turn.reply(note, note=True, closing=stop_reason)
        return LoopResult(messages=port.transcript, stop_reason=stop_reason, delivered=list(state.delivered))

    async def _last_chance(self, requests: RequestBuilder, limits: LoopLimits) -> str:
        """One tool-less completion asking for a plain answer, for a turn about to end with
        nothing said (a weak model that only looped on tools); ``""`` when that fails too."""
        try:
            request, _ = await requests.build(LAST_CHANCE_NUDGE)
            # without the tool rounds: a weak model shown them only writes another call as text,
            # and some servers refuse tool messages in a request that offers no tools
            request = _plain_conversation(request)
            completion = await self.llm.complete(
                request, model=limits.model, max_tokens=min(limits.max_tokens, LAST_CHANCE_MAX_TOKENS),
                temperature=limits.temperature,
            )
        except Exception as exc:  # the honest note is sent instead
            log.info("last-chance reply failed: %s", exc)
            return ""
        text = for_the_user(completion.content.strip())
        return text if len(text) <= LAST_CHANCE_MAX_TOKENS * 4 else text[: LAST_CHANCE_MAX_TOKENS * 4 - 1].rstrip() + "…"

    @staticmethod
    def _suppressed(text: str, state: LoopState) -> bool:
        """Spec, "Intermediate delivery": a plain-text final reply after ``say``. With no work
        tool in the turn, the model already answered through ``say``: the final text is dropped,
        unless every ``say`` was only a progress note ("On it!"), then the text is the answer.
        After work tools, only a reply that repeats what was said (or closing filler) is
        dropped; new content is never lost."""
        if not state.delivered:
            return False
        if state.work_calls == 0 and not all(progress_note(t) for t in state.delivered):
            return True
        return repeats_said(text, state.delivered)

    async def _complete_fitting(
        self,
        request: list[dict[str, Any]],
        nudge: str | None,
        requests: RequestBuilder,
        schemas: list[dict[str, Any]],
        limits: LoopLimits,
        on_say: SayListener | None = None,
    ) -> Completion:
        """One completion; a context-length refusal compacts (or prunes) and retries once."""
        try:
            return await self._complete(request, schemas, limits, on_say)
        except ContextTooLong as exc:
            # spec/issue: compact (or prune) and retry once; a second refusal ends the turn
            await requests.observe_refusal(exc.prompt_tokens)  # estimates were low: learn now
            await requests.shrink()
            request, _ = await requests.build(nudge)
            return await self._complete(request, schemas, limits, on_say)

    async def _run_calls(
        self,
        port: TurnPort,
        state: LoopState,
        plan: list[tuple[ToolCall, bool]],
        ctx: ToolContext,
        limits: LoopLimits,
        step: StepTrace,
        unusable: dict[str, str] | None = None,
    ) -> list[str]:
        """Run a step's calls concurrently, recording each result as it completes; returns the
        names of the calls that failed. A call in ``unusable`` (id -> why) is not run: its
        result is that error."""
        budget = _StepBudget(limits.max_tool_result_chars, len(plan))
        unusable = unusable or {}

        async def one(call: ToolCall, allowed: bool) -> tuple[ToolResult, float]:
            call_ctx = ToolContext(
                workspace=ctx.workspace, data_dir=ctx.data_dir, turn=ctx.turn,
                conversation=ctx.conversation, call_id=call.id, extras=ctx.extras,
            )
            if call.id in unusable:
                result, seconds = ToolResult.error(unusable[call.id]), 0.0
            elif call.name in UNTIMED:  # a delivery is never cut off halfway (see _execute)
                result, seconds = await self._execute(call, allowed, call_ctx, limits)
            else:
                try:
                    result, seconds = await _unless_stopped(port.stop, self._execute(call, allowed, call_ctx, limits))
                except Stopped:
                    result, seconds = ToolResult.error(STOPPED_RESULT), 0.0
            result = budget.fit(result)
            await port.record(
                Message(role="tool", content=result.content, tool_call_id=call.id, name=call.name, ok=result.ok)
            )
            return result, seconds

        results = await _all_or_none([one(c, allowed) for c, allowed in plan])
        failed: list[str] = []
        for (call, _), (result, seconds) in zip(plan, results, strict=True):
            step.tool_calls.append(
                {"name": call.name, "ok": result.ok, "seconds": round(seconds, 3), "kind": str(self.toolbox.kind(call.name))}
            )
            state.on_result(call, result)
            if not result.ok:
                failed.append(call.name)
        return failed

    async def _lost_work(self, port: TurnPort) -> bool:
        """A crash cut off a step that lost something: a work call, or a ``say`` that never got
        out (a say already sent lost nothing)."""
        open_calls = [_call(c) for c in _open_calls(port.transcript)]
        if not open_calls:
            return False
        sent = {e.tool_call_id for e in await port.outbox() if e.tool_call_id and e.status == "sent"}
        return any(
            self.toolbox.kind(c.name) is ToolKind.WORK or (c.name == "say" and c.id not in sent) for c in open_calls
        )

    async def _close_interrupted(self, port: TurnPort, state: LoopState) -> tuple[str | None, str | None]:
        """Resume: give the calls a crash cut off a result, and say what the last recorded
        step asks for next: ``("end_turn" | "text", None)`` when it had ended the turn (the
        gate decides again), ``(None, nudge)`` after a tool round, ``(None, None)`` otherwise."""
        closed = await self._close_open_calls(port, ToolResult.error(INTERRUPTED), state)
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
        return None, post_tool_nudge(failed, state.delivered)

    async def abandon(self, port: TurnPort, reason: str) -> None:
        """The turn ends without the loop (a bug stopped it mid-step, or it is given up after
        repeated crashes): give its cut-off calls a result, so the history stays a valid
        sequence. A ``say`` gets what its delivery did; a work call ``not completed: <reason>``."""
        await self._close_open_calls(port, ToolResult.error(f"not completed: {reason}"))

    async def _close_open_calls(self, port: TurnPort, other: ToolResult, state: LoopState | None = None) -> int:
        """Record a result for each call of the transcript that has none; returns how many."""
        open_calls = [_call(c) for c in _open_calls(port.transcript)]
        if not open_calls:
            return 0
        sent = {e.tool_call_id: e for e in await port.outbox() if e.tool_call_id}
        for call in open_calls:
            if call.name in DELIVERIES:
                result = _delivery_of(sent.get(call.id)).as_result()
            elif call.name in _COMPLETED_ON_RESUME:
                result = ToolResult(_COMPLETED_ON_RESUME[call.name])
            else:
                result = other
            await port.record(Message(role="tool", content=result.content, tool_call_id=call.id, name=call.name, ok=result.ok))
            if state is not None:
                state.on_result(call, result)
        return len(open_calls)

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

    async def _execute(
        self, call: ToolCall, run: bool, ctx: ToolContext, limits: LoopLimits
    ) -> tuple[ToolResult, float]:
        started = time.monotonic()
        if not run:
            return (
                ToolResult.error(
                    f"Not executed: {call.name} already ran in your last {REPEAT_LIMIT - 1} steps, and "
                    "the same tool a third time in a row is refused. Use the results above, try a "
                    "different tool, or tell the user what you found and call end_turn."
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


#: The result of a tool call ``/stop`` cut off.
STOPPED_RESULT = "Stopped: the user stopped this turn (/stop) before the call finished."
#: What history keeps of a stopped turn, after what the user saw of it.
STOPPED_NOTE = "[The user stopped this turn with /stop; it ended here.]"

#: The last try is a short plain answer (servers that ignore ``max_tokens`` are cut to it).
LAST_CHANCE_MAX_TOKENS = 512
LAST_CHANCE_NUDGE = (
    "[Same turn] No tools now. Write your answer to the user's last message as plain text."
)

LENGTH_ADVICE = (
    "Your last replies hit the length limit three times in a row. Put long output in a file with "
    "write_file, then say() a short summary and where the file is."
)


#: Words of the engine's own notes (:func:`post_tool_nudge`, the gate's nudges) that a weak
#: model copies into what it says; a sentence holding one never reaches the user.
_ENGINE_ECHO = re.compile(
    r"\[same turn\]|\[turn context\]|tool results are ready(?:\.(?:\s|$)|;)|already told the user \(do not repeat\)"
    r"|call more tools, say\(\)|no tools now\.|write your answer to the user's last message",
    re.IGNORECASE,
)
#: Splits text into sentences, keeping each separator (so line breaks survive).
_SENTENCE_END = re.compile(r"(?<=[.!?])([ \t]+)")
#: The few character references models emit in chat text (a doubled ``&amp;`` first).
_HTML_REF = re.compile(r"&(?:amp;)?(#39|#x27|#34|quot|apos|amp);")
_HTML_CHARS = {"#39": "'", "#x27": "'", "#34": '"', "quot": '"', "apos": "'", "amp": "&"}


#: Plain text that is a tool call in disguise (``functions.list_directory: { }``, a
#: ``<tool_call>`` block, a bare ``{"name": …}`` object): never an answer for the user.
_CALL_AS_TEXT = re.compile(r"^\s*(?:functions\.\w+\s*[:(]|<tool_call>|\{\s*\"(?:name|function)\"\s*:)", re.IGNORECASE)


def for_the_user(text: str) -> str:
    """``text`` as it may reach the user: reasoning removed, a tool call written out as text
    dropped whole, sentences that echo the engine's notes ("[Same turn] Tool results are
    ready…", copied by weak models) dropped, and HTML character references some models emit
    (``I&#39;m``) decoded outside code. Linear time."""
    text = strip_reasoning(text)
    if "&" in text and "`" not in text:
        # first: an echo may come encoded (user&#39;s). Only the references models emit, and
        # not in URLs ("?a=1&copy=2" must stay as it is)
        text = " ".join(
            word if "://" in word else _HTML_REF.sub(lambda m: _HTML_CHARS[m.group(1)], word)
            for word in text.split(" ")
        )
    if _CALL_AS_TEXT.match(text):
        return ""
    if _ENGINE_ECHO.search(text):
        lines, fenced = [], False
        for line in text.split("\n"):
            if line.lstrip().startswith("```"):
                fenced = not fenced
            if fenced or not _ENGINE_ECHO.search(line):
                lines.append(line)
                continue
            parts = _SENTENCE_END.split(line)  # sentence, separator, sentence, …
            kept = [parts[i] + (parts[i + 1] if i + 1 < len(parts) else "")
                    for i in range(0, len(parts), 2) if not _ENGINE_ECHO.search(parts[i])]
            if kept:
                lines.append("".join(kept).rstrip())  # an echo-only line goes entirely
        text = "\n".join(lines).strip()
    return text


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
    return call if new_id == call.id else ToolCall(id=new_id, name=call.name, arguments=call.arguments)


def _reply_chars(limits: LoopLimits) -> int:
    """The longest message a step may say: its token budget, in characters, with slack for
    the estimate (some servers ignore ``max_tokens``)."""
    return max(MIN_REPLY_CHARS, int(limits.max_tokens * 4 * REPLY_SLACK))


def _fit_text(text: str, limits: LoopLimits) -> str:
    limit = _reply_chars(limits)
    return text if len(text) <= limit else text[: limit - 1].rstrip() + "…"


def _fit_call(call: ToolCall, limits: LoopLimits) -> tuple[ToolCall, str | None]:
    """The call as it is recorded and run, and why it cannot run (``None``: it can).

    Arguments that are not a JSON object (garbage, or cut off at the token budget) are recorded
    as ``{}`` and the call is not run: strict endpoints (vLLM) refuse a history holding invalid
    arguments for every later request, and a server that ignored ``max_tokens`` must not grow
    the transcript past the window with them. A ``say`` longer than the step's budget allowed
    is cut to it before it is recorded or sent: one reply must not outgrow the window.
    """
    try:
        args = json_object(call.arguments)
    except ValueError as exc:
        problem = str(exc)
    else:
        if call.name == "say" and isinstance(args.get("text"), str):
            # history never keeps reasoning, nor a lone surrogate (no store or request takes one)
            clean = storable_text(_fit_text(strip_reasoning(args["text"]), limits))
            if clean != args["text"]:
                args["text"] = clean
                return ToolCall(id=call.id, name=call.name, arguments=json_text(args)), None
        return call, None
    error = (
        f"Not run: the arguments of {call.name} were {problem}; they began {_clip(call.arguments, 80)!r}. "
        "Call it again with a JSON object of its parameters, and keep it short."
    )
    return ToolCall(id=call.id, name=call.name, arguments="{}"), error


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
