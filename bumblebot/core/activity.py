"""The live event bus: what the daemon is doing now, for whoever watches (the operator's console).

The runtime publishes an :class:`Event` when a turn starts, at each step, each tool result,
each message it says, when the turn ends and when a message is queued; the operator's actions
(pause, resume, block, unblock, stop, reset, …) are published too. A watcher subscribes to one
conversation or to all of them and reads the events as they come (:class:`Subscription`, an
async iterator); :meth:`Activity.recent` gives the last events published, for a page that
opens in the middle of a turn.

Publishing never waits and never raises: every subscription has a queue of its own, bounded;
when a watcher falls behind and its queue is full, its oldest events are dropped and the next
event it reads carries ``data["dropped"]``, how many it missed. Every text in an event's data
is redacted (``redact``: the daemon's :class:`~bumblebot.core.redaction.Redactor`) before it
is kept or handed out, so no configured secret leaves through an event.

:data:`NO_ACTIVITY` is the default of every part that publishes: with no backlog and nobody
subscribed, publishing returns at once.

Event data per kind (keys):

* ``turn_started``: ``turn`` (id), ``route``, ``reason``, ``entries`` (how many messages it answers)
* ``step``: ``turn``, ``step`` (1-based), ``tool_calls`` (``[{"name", "arguments"}]``, the
  arguments a string cut to :data:`CUT` characters), ``content`` (cut), ``finish_reason``,
  ``usage`` (dict or ``None``)
* ``tool_result``: ``turn``, ``step``, ``name``, ``result`` (cut), ``ok``
* ``said``: ``turn``, ``text``
* ``turn_ended``: ``turn``, ``status``, ``stop`` (why it ended)
* ``queued``: ``waiting`` (messages waiting in the conversation)
* ``paused``, ``resumed``, ``blocked``, ``unblocked``, ``action``: ``by`` (``"operator"``),
  ``what``, and details
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

log = logging.getLogger(__name__)

KINDS = ("turn_started", "step", "tool_result", "said", "turn_ended", "queued",
         "paused", "resumed", "blocked", "unblocked", "action")
#: Texts in events (a step's content and arguments, a tool's result) are cut to this many characters.
CUT = 2000
#: Events one subscription holds before its oldest are dropped.
QUEUE_SIZE = 1000


def cut(text: str, limit: int = CUT) -> str:
    """``text`` cut to ``limit`` characters (with ``…`` at the end when it was longer)."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


@dataclass(frozen=True, slots=True)
class Event:
    """One thing that happened.

    Args:
        conversation: the conversation key (``"telegram:123"``).
        kind: one of :data:`KINDS`.
        data: JSON-serialisable, already redacted.
        at: when, epoch seconds.
        seq: increasing per :class:`Activity`.
    """

    conversation: str
    kind: str
    data: dict[str, Any]
    at: float
    seq: int


class Subscription:
    """The events of one conversation (or of all, ``conversation=None``) from the moment it was
    made: an async iterator, and an async context manager that closes it. Made by
    :meth:`Activity.subscribe`."""

    def __init__(self, activity: Activity, conversation: str | None, size: int) -> None:
        self._activity = activity
        self.conversation = conversation
        self._queue: collections.deque[Event] = collections.deque()
        self._size = max(1, size)
        self._dropped = 0
        self._ready = asyncio.Event()
        self.closed = False

    def _put(self, event: Event) -> None:
        if self.closed:
            return
        if len(self._queue) >= self._size:
            self._queue.popleft()
            self._dropped += 1
        self._queue.append(event)
        self._ready.set()

    def __aiter__(self) -> AsyncIterator[Event]:
        return self

    async def __anext__(self) -> Event:
        while not self._queue:
            if self.closed:
                raise StopAsyncIteration
            self._ready.clear()
            await self._ready.wait()
        event = self._queue.popleft()
        if self._dropped:  # the watcher learns how many it missed before this one
            event = replace(event, data={**event.data, "dropped": self._dropped})
            self._dropped = 0
        return event

    async def __aenter__(self) -> Subscription:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Unsubscribe: nothing more comes; a reader waiting gets the end of the iteration
        (after the events still queued)."""
        self.closed = True
        self._activity._unsubscribe(self)
        self._ready.set()


class Activity:
    """The bus (module docstring).

    Args:
        redact: applied to every string in an event's data (and its conversation key).
        backlog: how many of the last events :meth:`recent` keeps (all conversations together).
        queue_size: how many events a subscription holds before its oldest are dropped.
    """

    def __init__(
        self, redact: Callable[[str], str] = lambda s: s, backlog: int = 500, *, queue_size: int = QUEUE_SIZE,
    ) -> None:
        self._redact = redact
        self._backlog: collections.deque[Event] = collections.deque(maxlen=max(0, backlog))
        self._keeps = backlog > 0
        self._queue_size = queue_size
        self._subscriptions: list[Subscription] = []
        self._seq = itertools.count(1)

    @property
    def watched(self) -> bool:
        """Whether anything is kept or watched: publishers may skip building what nobody reads."""
        return self._keeps or bool(self._subscriptions)

    def publish(self, conversation: str, kind: str, **data: Any) -> None:
        """Hand an event to every subscription of ``conversation`` (and of all); never waits,
        never raises (a failure is logged and the event lost)."""
        if not self.watched:
            return
        try:
            if kind not in KINDS:
                raise ValueError(f"unknown activity kind {kind!r}")
            event = Event(self._redact(conversation), kind, _clean(data, self._redact), time.time(), next(self._seq))
            self._backlog.append(event)
            for subscription in list(self._subscriptions):
                if subscription.conversation is None or subscription.conversation == conversation:
                    subscription._put(event)
        except Exception:
            log.exception("activity event %s in %s lost", kind, conversation)

    def subscribe(self, conversation: str | None = None) -> Subscription:
        """Events of ``conversation`` (``None``: every conversation) from now on."""
        subscription = Subscription(self, conversation, self._queue_size)
        self._subscriptions.append(subscription)
        return subscription

    def recent(self, conversation: str | None = None) -> list[Event]:
        """The backlog (of ``conversation`` only, when given), oldest first."""
        return [e for e in self._backlog if conversation is None or e.conversation == conversation]

    def _unsubscribe(self, subscription: Subscription) -> None:
        if subscription in self._subscriptions:
            self._subscriptions.remove(subscription)


def _clean(value: Any, redact: Callable[[str], str]) -> Any:
    """``value`` as JSON holds it (tuples as lists, other objects as their ``str``), every
    string redacted."""
    if isinstance(value, str):
        return redact(value)
    if value is None or isinstance(value, bool | int | float):
        return value
    if isinstance(value, dict):
        return {redact(str(k)): _clean(v, redact) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_clean(v, redact) for v in value]
    return redact(str(value))


#: The default of every publisher: nothing kept, nobody subscribed, publishing costs nothing.
NO_ACTIVITY = Activity(backlog=0)
