"""What the loop knows of a turn: what the user asked, what reached them, which work tools
ran and how, the repeat guard, whether the model is looping. A function of the turn's
record: :meth:`LoopState.replay` rebuilds it after a crash with the same methods the live
loop uses, so the two can never disagree."""

from __future__ import annotations

import json
import os
from collections import deque
from collections.abc import Callable
from typing import Any

from bumblebot.cognition.gate import GateInput, Preview
from bumblebot.cognition.limits import REPEAT_LIMIT
from bumblebot.core.messages import Message
from bumblebot.core.textrules import strip_reasoning
from bumblebot.core.toolkit import ToolKind, ToolResult
from bumblebot.core.usage import answered, unanswered
from bumblebot.llm import ToolCall

#: Characters of a work tool's result the completion check sees, and how many results.
PREVIEW_CHARS = 280
PREVIEW_COUNT = 8
#: Calls whose outcome a resumed turn reads from their outbox row (linked by call id).
DELIVERIES = frozenset({"say", "send_file"})


def canonical_arguments(arguments: str) -> str:
    """A call's arguments as they compare: keys sorted, no spacing (the repeat guard and the
    looping count tell a call that is new from one that is not by them)."""
    try:
        return json.dumps(json.loads(arguments or "{}"), sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError):
        return arguments.strip()


def repeat_key(text: str) -> str:
    """What two messages must share to be the same message: their text with runs of
    whitespace made one space, case folded."""
    return " ".join(text.split()).casefold()


def say_text(arguments: str) -> str:
    """The text of a ``say`` call's arguments, without reasoning; ``""`` when it has none."""
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


def shown(call: ToolCall) -> str:
    """What a ``say`` or ``send_file`` call put before the user: the text; a file's caption
    and name."""
    if call.name == "say":
        return say_text(call.arguments)
    try:
        args = json.loads(call.arguments or "{}")
    except ValueError:
        return ""
    if not isinstance(args, dict):
        return ""
    caption = args.get("caption")
    return file_shown(strip_reasoning(caption) if isinstance(caption, str) else "", str(args.get("path") or ""))


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
        #: calls whose message the delivery rule counted as the user got it
        self._counted: set[str] = set()

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
                    step = (said_before, state.plan([api_call(c) for c in m.tool_calls]))
            elif m.role == "tool":
                call = state._calls.get(m.tool_call_id or "")
                if call is not None:
                    state.on_result(call, ToolResult(m.content, ok=m.ok is not False))
        close_step()
        return state

    def on_user(self, message: Message) -> None:
        self.user_texts.append(message.content)
        unanswered()  # a message of theirs not answered yet: the turn's requests go first again

    def on_assistant(self, message: Message) -> None:
        if message.note:
            return
        self.steps += 1
        if not message.tool_calls and message.content.strip():
            self.said(message.content)

    def said(self, text: str, *, call_id: str | None = None) -> None:
        """``text`` reached the user; ``call_id``: the call that delivered it (its result then
        does not count it again, in the words the model wrote before the text rules)."""
        if call_id is not None:
            self._counted.add(call_id)
        answered()  # the person has words: the turn's next requests no longer go before other chats'
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
        """Each call of one step with whether it may run (docs/cognition.md, "The agent loop"): a work tool
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
        if call.name in DELIVERIES and result.ok and call.id not in self._counted:
            text = shown(call)
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


def api_call(api: dict[str, Any]) -> ToolCall:
    """A recorded tool call (OpenAI form) as a :class:`ToolCall`."""
    fn = api.get("function") or {}
    return ToolCall(id=api.get("id") or "", name=fn.get("name") or "", arguments=fn.get("arguments") or "{}")
