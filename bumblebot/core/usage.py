"""What a model request used, whom it was for, and the meter that counts it.

Every request to a model endpoint (turns, automations, judges, the classifier, summaries,
transcriptions) is *admitted* by the meter before it is sent and *recorded* after it was
answered. The meter (``bumblebot.runtime.ledger`` in the daemon) keeps the totals, prices them
and enforces the spending limits; the model client only calls it.

Whom a request is for is the :class:`Scope` of the task sending it: a context variable, set by
whoever starts the work (a turn sets its conversation and sender; a judge or a summary narrows
the kind with :func:`scoped`). asyncio copies the context into each task it creates, so a
request made anywhere below a turn is counted for that turn's chat without every layer passing
the chat down. What requests used flows back up the same way where a caller asks for it
(:func:`tallied`: a judge's or a summary's usage, for the turn's trace).
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

#: The kinds of request a scope may name (``bumblebot usage`` groups by them).
KINDS = (
    "turn", "automation", "autonomous", "judge", "classifier", "summary", "transcription", "speech", "check", "other",
)
#: Kinds of background work: nobody wrote; counted against ``limits.background`` too.
BACKGROUND_KINDS = frozenset({"automation", "autonomous"})


@dataclass(frozen=True, slots=True)
class Scope:
    """Whom a model request is for.

    Args:
        conversation: the conversation key (``telegram:123``), ``None`` outside any chat.
        sender: the platform user id of the person the turn answers, ``None`` when nobody wrote.
        kind: one of :data:`KINDS`.
        background: the request serves background work (an automation or an autonomous turn,
            and the judges and summaries such a turn makes).
    """

    conversation: str | None = None
    sender: str | None = None
    kind: str = "other"
    background: bool = False


@dataclass(frozen=True, slots=True)
class Usage:
    """What one answered request used, as the endpoint reported it (or as estimated).

    Args:
        endpoint: the base URL that answered.
        model: the model asked.
        prompt: prompt tokens, cached ones included.
        cached: prompt tokens the endpoint served from its cache
            (``usage.prompt_tokens_details.cached_tokens``).
        completion: completion tokens, reasoning included.
        reasoning: reasoning tokens (``usage.completion_tokens_details.reasoning_tokens``).
        estimated: the endpoint reported no usage; the counts are Bumblebot's estimate.
        seconds: audio seconds of a transcription (priced per minute), else 0.
        cut: the client cut the request at its budget (``bumblebot.llm.pace.Cut.as_dict``), for
            the trace; ``None``: it was not.
    """

    endpoint: str
    model: str
    prompt: int = 0
    cached: int = 0
    completion: int = 0
    reasoning: int = 0
    estimated: bool = False
    seconds: float = 0.0
    cut: dict[str, Any] | None = None

    @property
    def total(self) -> int:
        return self.prompt + self.completion


class Meter(Protocol):
    """Counts model requests and may refuse one (``bumblebot.runtime.ledger.Ledger``)."""

    async def admit(self, scope: Scope, model: str) -> None:
        """Called before a request is sent.

        Raises:
            SpendingLimitReached: a limit covering ``scope`` is reached; send nothing.
        """

    async def record(self, scope: Scope, usage: Usage) -> float | None:
        """Called once a request was answered, with what it used; returns what it cost at the
        configured prices (``llm.prices``), ``None`` when its model has no price."""


class _NoMeter:
    """Counts nothing and refuses nothing (tests, ``bumblebot check``)."""

    async def admit(self, scope: Scope, model: str) -> None:
        return None

    async def record(self, scope: Scope, usage: Usage) -> float | None:
        return None


NO_METER: Meter = _NoMeter()

_SCOPE: contextvars.ContextVar[Scope] = contextvars.ContextVar("bumblebot_usage_scope", default=Scope())


def current_scope() -> Scope:
    """The scope of the running task (``Scope()`` when nothing set one)."""
    return _SCOPE.get()


@contextmanager
def scoped(**changes: object) -> Iterator[Scope]:
    """Run the block under the current scope with ``changes`` (``kind="judge"``, or a whole
    turn's ``conversation``/``sender``/``kind``/``background``), restored after it."""
    scope = dataclasses.replace(_SCOPE.get(), **changes)  # type: ignore[arg-type]
    token = _SCOPE.set(scope)
    try:
        yield scope
    finally:
        _SCOPE.reset(token)


def rescope(**changes: object) -> Scope:
    """Change the running task's scope with ``changes`` for the rest of the :func:`scoped`
    block it runs in (which restores the scope before it when it ends): a message from another
    person taken into a running turn makes its next requests theirs."""
    scope = dataclasses.replace(_SCOPE.get(), **changes)  # type: ignore[arg-type]
    _SCOPE.set(scope)
    return scope


class _Awaited:
    """A turn a person waits on; ``answered`` once it said something to them; ``ended`` called
    when it is over (:func:`when_ended`)."""

    __slots__ = ("answered", "ended")

    def __init__(self) -> None:
        self.answered = False
        self.ended: list[Callable[[], None]] = []


_AWAITED: contextvars.ContextVar[_Awaited | None] = contextvars.ContextVar("bumblebot_awaited", default=None)

#: :func:`urgency` of the requests of a turn whose person has seen nothing of it yet (since
#: their latest message)
FIRST_WORDS = 0
#: of the other requests of people's turns, and of work outside any turn (summaries, ``check``)
INTERACTIVE = 1
#: of background work: automations, autonomous turns (:attr:`Scope.background`)
BACKGROUND = 2


#: The running turn of each conversation a person waits on (:func:`awaited` with its key), for
#: :func:`message_came`: the one place outside a turn's task that reaches it.
_RUNNING: dict[str, _Awaited] = {}


@contextmanager
def awaited(conversation: str | None = None) -> Iterator[None]:
    """Run the block as a turn a person is waiting on (in ``conversation``): its requests are
    :data:`FIRST_WORDS` until :func:`answered` is called in it."""
    if _AWAITED.get() is not None:  # the same turn, entered again (run, then its steps)
        yield
        return
    turn = _Awaited()
    token = _AWAITED.set(turn)
    if conversation is not None:
        _RUNNING[conversation] = turn
    try:
        yield
    finally:
        _AWAITED.reset(token)
        if conversation is not None and _RUNNING.get(conversation) is turn:
            del _RUNNING[conversation]
        for callback in turn.ended:
            callback()


class GaveUp(asyncio.CancelledError):
    """A request still waiting for a slot was given up (:func:`unless`): it was never sent.
    A cancellation, so that no error handling on its way up takes it for a failure of the
    endpoint."""


_GIVE_UP: contextvars.ContextVar[asyncio.Event | None] = contextvars.ContextVar("bumblebot_give_up", default=None)


@contextmanager
def unless(event: asyncio.Event) -> Iterator[None]:
    """Run the block's model requests only while ``event`` is not set: one still waiting for a
    slot when it is set raises :class:`GaveUp` (``bumblebot.llm.slots``); one already sent is
    answered (a server answering one at a time would go on with it anyway)."""
    token = _GIVE_UP.set(event)
    try:
        yield
    finally:
        _GIVE_UP.reset(token)


def give_up_event() -> asyncio.Event | None:
    """The event of the innermost :func:`unless` block, if any."""
    return _GIVE_UP.get()


def message_came(conversation: str) -> None:
    """A person's message came for ``conversation`` while its turn runs: the turn's requests go
    first again at once, a request of it already waiting for a slot included (it takes the
    message in at its next step; :func:`unanswered` then keeps it so)."""
    if (turn := _RUNNING.get(conversation)) is not None:
        turn.answered = False


def answered() -> None:
    """The running turn said something to its person (a message reached the outbox): its next
    requests no longer go before other chats' (no-op outside :func:`awaited`)."""
    if (turn := _AWAITED.get()) is not None:
        turn.answered = True


def unanswered() -> None:
    """A new message of the person came into the running turn (taken in mid-turn): its next
    requests go first again until it says something (no-op outside :func:`awaited`)."""
    if (turn := _AWAITED.get()) is not None:
        turn.answered = False


def awaited_turn() -> object | None:
    """The turn a person waits on that the running task serves (the same object for all its
    requests), ``None`` outside one and in background work."""
    return None if _SCOPE.get().background else _AWAITED.get()


def when_ended(turn: object, callback: Callable[[], None]) -> None:
    """Call ``callback`` once ``turn`` (from :func:`awaited_turn`) is over."""
    if isinstance(turn, _Awaited):
        turn.ended.append(callback)


def urgency(turn: object | None = None) -> int:
    """How soon the running task's next model request should be sent when requests queue for an
    endpoint (``bumblebot.llm.slots``): lower first. With ``turn`` (from :func:`awaited_turn`),
    that turn's urgency now (it changes as it answers and as messages come)."""
    if turn is None:
        if _SCOPE.get().background:
            return BACKGROUND
        turn = _AWAITED.get()
    return FIRST_WORDS if isinstance(turn, _Awaited) and not turn.answered else INTERACTIVE


#: What each request of the innermost :func:`tallied` block used, and its cost.
Tally = list[tuple[Usage, float | None]]
_TALLY: contextvars.ContextVar[Tally | None] = contextvars.ContextVar("bumblebot_usage_tally", default=None)


@contextmanager
def tallied() -> Iterator[Tally]:
    """Collect what the requests made in the block use, as the meter records them (a judge's,
    the classifier's, a compaction's summaries: for the turn's trace). Tasks the block starts
    add to the same list; a block inside it collects its own instead."""
    found: Tally = []
    token = _TALLY.set(found)
    try:
        yield found
    finally:
        _TALLY.reset(token)


def tally(usage: Usage, cost: float | None) -> None:
    """The meter recorded a request: added to the innermost :func:`tallied` block, if any."""
    found = _TALLY.get()
    if found is not None:
        found.append((usage, cost))
