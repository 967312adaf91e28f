"""The request limiter: :class:`RequestSlots`, at most ``llm.max_concurrent_requests`` requests
in flight to one endpoint, with a turn's next request first in line.

A server that answers one request at a time (llama-cpp-python; llama.cpp with one slot) keeps
one prompt cached: the last it read. Steps of one turn repeat the request before them, so when
they follow each other the server reads only what is new (2 tokens instead of 1,442, seen on
llama-cpp-python), and when another chat's request comes between them it reads everything
again (10 to 20 s per request on two cores for SmolLM2-135M). So when a request ends while
others wait for a slot, the slot is held for :data:`AFFINITY_S` for the same conversation's next
request (the turn's next step, its completion check), at most :data:`MAX_IN_A_ROW` times in a
row, so that other chats are not starved; then it goes to the first waiting. Without
contention nothing is held, and nothing waits.
"""

from __future__ import annotations

import asyncio
import collections
from types import TracebackType

from bumblebot.core.usage import current_scope

#: Seconds a freed slot waits for the same conversation's next request while others wait:
#: a step's tool calls and the next request's building take milliseconds; a slow tool call
#: (a shell command) lets the slot go.
AFFINITY_S = 0.5
#: Requests of one conversation in a row that a slot is held for, at most (a turn's steps and
#: its completion check): then it goes to the first waiting.
MAX_IN_A_ROW = 16


class RequestSlots:
    """At most ``size`` requests in flight; used as ``async with slots:`` around one request, by
    the task whose :func:`~bumblebot.core.usage.current_scope` names the conversation it is for.

    Args:
        size: ``llm.max_concurrent_requests``.
        affinity_s: how long a freed slot waits for the same conversation (tests shorten it).
    """

    def __init__(self, size: int, *, affinity_s: float = AFFINITY_S) -> None:
        self.size = size
        self.affinity_s = affinity_s
        self._free = size
        self._waiting: collections.deque[tuple[str | None, asyncio.Future[None]]] = collections.deque()
        self._held_for: str | None = None  # the conversation a freed slot is held for
        self._hold: asyncio.TimerHandle | None = None
        self._last: str | None = None  # the conversation the last slot handed over went to
        self._in_a_row = 0

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    async def __aenter__(self) -> None:
        await self.acquire(current_scope().conversation)

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release(current_scope().conversation)

    async def acquire(self, owner: str | None) -> None:
        """Wait for a slot for a request of conversation ``owner`` (``None``: of no chat)."""
        if self._hold is not None and owner is not None and owner == self._held_for:
            self._end_hold()
            self._granted(owner)
            return
        if self._free > 0 and not self._waiting:
            self._free -= 1
            self._granted(owner)
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (owner, future)
        self._waiting.append(entry)
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release(owner)  # handed over as the waiter was cancelled: pass it on
            else:
                self._waiting.remove(entry)
            raise

    def release(self, owner: str | None) -> None:
        """A request of ``owner`` ended: its slot is held for ``owner``'s next request while
        others wait (module docstring), else handed to the first waiting, else freed."""
        if self._waiting and owner is not None and self._in_a_row < MAX_IN_A_ROW and self._hold is None:
            self._held_for = owner
            self._hold = asyncio.get_running_loop().call_later(self.affinity_s, self._hold_expired)
            return
        self._hand_over()

    def _hold_expired(self) -> None:
        self._hold = None
        self._held_for = None
        self._hand_over()

    def _end_hold(self) -> None:
        if self._hold is not None:
            self._hold.cancel()
        self._hold = None
        self._held_for = None

    def _hand_over(self) -> None:
        while self._waiting:
            owner, future = self._waiting.popleft()
            if not future.done():
                future.set_result(None)
                self._granted(owner)
                return
        self._free += 1

    def _granted(self, owner: str | None) -> None:
        self._in_a_row = self._in_a_row + 1 if owner is not None and owner == self._last else 1
        self._last = owner
