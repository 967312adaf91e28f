"""The live event bus: what turns and the operator do, as it happens (stand-in of the web
branch; the engine branch's module replaces it at merge, same interface)."""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

KINDS = ("turn_started", "step", "tool_result", "said", "turn_ended", "queued",
         "paused", "resumed", "blocked", "unblocked", "action")
QUEUE = 1000


@dataclass(frozen=True, slots=True)
class Event:
    conversation: str
    kind: str
    data: dict[str, Any]
    at: float
    seq: int


class Subscription:
    def __init__(self, activity: Activity, conversation: str | None) -> None:
        self._activity, self.conversation = activity, conversation
        self._queue: collections.deque[Event] = collections.deque(maxlen=QUEUE)
        self._ready = asyncio.Event()
        self._closed = False

    def _put(self, event: Event) -> None:
        self._queue.append(event)
        self._ready.set()

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Event]:
        while not self._closed:
            while self._queue:
                yield self._queue.popleft()
            self._ready.clear()
            await self._ready.wait()

    async def __aenter__(self) -> Subscription:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._closed = True
        self._ready.set()
        self._activity._subs.discard(self)


class Activity:
    def __init__(self, redact: Callable[[str], str] = lambda s: s, backlog: int = 500) -> None:
        self._redact = redact
        self._backlog: collections.deque[Event] = collections.deque(maxlen=backlog)
        self._subs: set[Subscription] = set()
        self._seq = 0

    def publish(self, conversation: str, kind: str, **data: Any) -> None:
        self._seq += 1
        event = Event(conversation, kind, data, time.time(), self._seq)
        self._backlog.append(event)
        for sub in list(self._subs):
            if sub.conversation is None or sub.conversation == conversation:
                sub._put(event)

    def subscribe(self, conversation: str | None = None) -> Subscription:
        sub = Subscription(self, conversation)
        self._subs.add(sub)
        return sub

    def recent(self, conversation: str | None = None) -> list[Event]:
        return [e for e in self._backlog if conversation is None or e.conversation == conversation]


NO_ACTIVITY = Activity(backlog=1)
