"""What the model says, on its way to the user: the text rules, the delivery rule, and which
``say`` being streamed may show yet.

* :class:`Visible`: the text rules of :mod:`bumblebot.core.textrules` (reasoning, the engine's
  own notes echoed, a tool call written as text), each removal recorded in the trace.
* :class:`DeliveryRule`: every message is delivered as written, except an exact repeat of one
  this turn delivered and past the turn's message cap. The turn port asks it before it
  records and sends a message and tells it what became of it.
* :class:`SayStream`: a ``say`` that will not be delivered is never previewed.
"""

from __future__ import annotations

import asyncio
import dataclasses

from bumblebot.cognition.limits import LoopLimits
from bumblebot.cognition.state import LoopState, file_shown, repeat_key
from bumblebot.cognition.trace import LoopTrace
from bumblebot.core.textrules import (
    TURN_CONTEXT,
    EchoFilter,
    call_as_text,
    may_be_call,
    shown_so_far,
    strip_reasoning,
)
from bumblebot.core.toolkit import DeliveryReport
from bumblebot.llm import SayListener


#: What a say that was all a tool call written as text is told: how to call the tool, and how
#: to show such a call when the user asked to see one.
CALL_AS_TEXT_DROPPED = (
    "not sent: the text is a tool call written out; call the tool itself instead, or, to show "
    "the user an example of a call, put it in a code block"
)


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


class DeliveryRule:
    """Whether a message of the model's reaches the user (the delivery rule), and what the
    agency tools tell of the turn.

    Every ``say`` and ``send_file`` is delivered as written (after the text rules), except an
    exact repeat of a message this turn delivered (:func:`~bumblebot.cognition.state.repeat_key`)
    and past the turn's message cap; the model is told either way. :attr:`order` keeps several
    messages of one step in call order (the port holds it while it records and sends)."""

    def __init__(self, state: LoopState, trace: LoopTrace, max_messages: int, visible: Visible) -> None:
        self._state = state
        self._trace = trace
        self._max_messages = max_messages
        self._visible = visible
        self.order = asyncio.Lock()
        self.thoughts = trace.thoughts
        #: the model called ``end_turn`` in the current step
        self.end_requested = False
        #: a message of the current step did not get out (the turn must not end on it)
        self.lost = False
        #: the platform refused a message for good (blocked bot, deleted chat): talking on is futile
        self.undeliverable: str | None = None

    def admit_say(self, text: str, call_id: str | None) -> tuple[str, DeliveryReport | None]:
        """The text a ``say`` delivers, and the report that answers it instead when it is not
        delivered (call it holding :attr:`order`)."""
        text = self._visible(text, call=call_id)
        if not text:
            last = self._trace.cuts[-1] if self._trace.cuts else {}
            as_call = last.get("rule") == "call_as_text" and last.get("call") == call_id
            return "", DeliveryReport(delivered=False, dropped=CALL_AS_TEXT_DROPPED if as_call else (
                "not sent: nothing left after removing reasoning and engine notes"
            ))
        if self.undeliverable:
            return "", DeliveryReport(delivered=False, error=self.undeliverable)
        return text, self._held_back(text, call_id)

    def admit_file(self, caption: str, path: str, call_id: str | None) -> tuple[str, str, DeliveryReport | None]:
        """A file's cleaned caption, what it shows (caption and name), and the report that
        answers it instead when it is not delivered. A file is a message like any other."""
        if self.undeliverable:
            return "", "", DeliveryReport(delivered=False, error=self.undeliverable)
        clean = self._visible(caption, call=call_id) if caption else ""
        shown = file_shown(clean, path)
        return clean, shown, self._held_back(shown, call_id)

    def _held_back(self, shown: str, call_id: str | None) -> DeliveryReport | None:
        if self._state.already_said(shown):
            self._trace.cut("exact_repeat", call=call_id, chars=len(shown))
            return DeliveryReport(delivered=True, duplicate=True)
        said = len(self._state.delivered)
        if said >= self._max_messages:
            self._trace.cut("message_cap", call=call_id, chars=len(shown))
            return DeliveryReport(
                delivered=False,
                dropped=f"not sent: this turn already sent {said} messages, the most it may; "
                "stop talking and call end_turn",
            )
        return None

    def sent(self, shown: str, report: DeliveryReport, *, call_id: str | None = None) -> DeliveryReport:
        """What became of a message the port recorded and sent: ``shown`` is the text as the
        user got it (after the text rules), counted once for its call. Returns the report the
        model gets: with the messages left, when one or none is."""
        self.reached(report)
        if not report.ok:
            self.lost = True
            return report
        self._state.said(shown, call_id=call_id)
        left = self._max_messages - len(self._state.delivered)
        return dataclasses.replace(report, left=max(0, left)) if left <= 1 else report

    def reached(self, report: DeliveryReport) -> None:
        """Any message's delivery: the platform may have said the chat cannot be reached."""
        if report.chat_unreachable:
            self.undeliverable = report.error or "the platform refused the message"

    def end_turn(self) -> None:
        self.end_requested = True

    def think(self, thought: str) -> None:
        self.thoughts.append(thought)


class SayStream:
    """Which ``say`` calls of the completion being streamed are shown as they are written.

    A say is previewed only when it will be delivered as far as can be told: the turn's
    message cap leaves room for it (counting the says of this completion shown before it), it
    is not (yet) the beginning of a message already delivered in this turn, nor of one shown
    earlier in this completion (an exact repeat is never delivered, so it must never flash
    up), and it cannot still turn out to be a tool call written as text. Until then its text
    is held; once it may show, all of it goes to the preview at once and the rest as it comes.
    Calls stream one after another: when a later say starts to show, an earlier one still
    held is complete, and it shows first if it will be delivered (messages keep call order)."""

    def __init__(
        self, listener: SayListener | None, state: LoopState, limits: LoopLimits, rule: DeliveryRule, visible: Visible
    ) -> None:
        self._listener = listener
        self._state = state
        self._limits = limits
        self._rule = rule
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
        if self._listener is None or self._rule.undeliverable:
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
        assert self._listener is not None
        self._listener(index, self._texts[index])
