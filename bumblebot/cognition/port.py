"""The seams of one run of the agent loop: what it needs of the turn it runs
(:class:`TurnPort`, which ``bumblebot/runtime/io.py`` implements), and of the conversation's
requests (:class:`RequestBuilder`, ``bumblebot/cognition/context.py``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

from bumblebot.cognition.speech import DeliveryRule
from bumblebot.core.messages import Message
from bumblebot.core.toolkit import DeliveryReport, TurnControl
from bumblebot.llm import SayListener
from bumblebot.store import OutboxEntry


class TurnPort(TurnControl, Protocol):
    """The turn the loop runs, and what the agency tools call: one object.

    A ``say`` goes from the tool to the port, which asks the loop's :class:`DeliveryRule`
    whether it is delivered, records it in the turn's outbox and sends it. ``transcript`` is
    the turn's messages so far, the user message first; the loop never appends to it itself:
    it goes through :meth:`record` and :meth:`reply`, which write first.
    """

    transcript: list[Message]
    #: set by ``/stop``: the turn ends at once (the model call is aborted, running tools are
    #: cancelled; what was delivered stays)
    stop: asyncio.Event
    #: set when more messages of the burst the turn began with arrive (``cognition.debounce_s``)
    #: while its first completion is awaited; ``None`` for a turn that may not be asked again
    #: (resumed, scheduled)
    burst: asyncio.Event | None

    def begin(self, rule: DeliveryRule) -> None:
        """The loop starts: its delivery rule decides what of the model's messages goes out."""

    async def take_steering(self, *, burst: bool = False) -> list[Message]:
        """Messages that arrived during the turn (steer mode), already recorded in it.
        ``burst``: the rest of the burst the turn began with, whatever the mode."""

    def message_waiting(self) -> bool:
        """A message from a person waits for a turn in this turn's conversation."""

    def arrival(self) -> asyncio.Event:
        """An event set when the next message from a person comes for this conversation."""

    async def settle_burst(self) -> None:
        """Wait until the burst the turn began with is over (``cognition.debounce_s`` with no
        new message, at most ``DEBOUNCE_MAX_S``)."""

    async def record(self, message: Message) -> None:
        """Checkpoint an assistant message (before its tools run) or one tool result."""

    async def reply(self, message: Message, *, closing: str | None = None) -> DeliveryReport:
        """Deliver an assistant message of its own (a plain-text reply, a daemon note),
        recorded together with its outbox row. ``closing`` is the stop (``str(Stop)``) when
        this note ends the turn: a resumed turn then finishes instead of going on."""

    async def outbox(self) -> list[OutboxEntry]:
        """The messages this turn queued so far (to resume it)."""

    async def answered(self) -> None:
        """The model answered a completion (an outage, if there was one, is over)."""

    def on_say(self, clean: Callable[[str], str]) -> SayListener | None:
        """Where the text of ``say`` calls goes while a completion is streamed (shown in the
        chat as it is written, ``bumblebot/delivery/preview.py``); ``None``: nothing is streamed.
        ``clean`` is what of the raw text so far may be shown."""

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

    async def superseded(self) -> None:
        """Record, as the turn's end, that it ended at its message cap because a person's
        message came (``message_waiting``)."""

    async def stopped(self) -> None:
        """Record that the user stopped the turn (``/stop``), with what of it they saw, as the
        turn's end."""


class RequestBuilder(Protocol):
    """What the loop needs from the conversation: requests built from the turn's messages.

    ``build(nudge)`` returns the full message list for the next completion (system prompt,
    history, summary, this turn's messages with the preamble, the nudge) and its token
    estimate; compaction runs inside it when the estimate crosses the threshold.
    """

    #: the tool schemas every request of the turn offers
    tool_schemas: list[dict[str, Any]]

    async def build(self, nudge: str | None) -> tuple[list[dict[str, Any]], int]: ...

    async def shrink(self) -> None:
        """The endpoint said the prompt is too long: keep the turn's long input as a file (when
        the refusal taught a smaller window), else compact (or prune), before one retry."""

    def call_ids(self) -> set[str]:
        """Tool call ids already used in the conversation (new ones must differ)."""

    async def observe_usage(self, prompt_tokens: int | None, estimate: int) -> None:
        """The endpoint reported ``prompt_tokens`` for a request we estimated at ``estimate``."""

    async def observe_refusal(self, prompt_tokens: int | None) -> None:
        """The last request built was refused as too long; the endpoint counted ``prompt_tokens``."""
