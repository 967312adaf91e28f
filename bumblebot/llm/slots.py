"""The request slots of one endpoint: at most ``llm.max_concurrent_requests`` requests in flight,
and when they are all taken, the most urgent waiting request is sent next.

Urgency comes from the task sending the request (:func:`bumblebot.core.usage.urgency`): first the
requests of turns whose person has seen nothing yet, then the rest of the interactive work, then
background work (automations, autonomous turns). Requests of one urgency go in the order they
came. On a server that answers one request at a time (llama.cpp with one slot,
llama-cpp-python), with ``max_concurrent_requests: 1``, a new message's first step then waits
for the request in flight only, not for every step that the turns of other chats queued before
it. A turn that keeps calling tools after its first words yields to new messages; it is delayed
by them, never starved: they are only as many as the messages that come.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from types import TracebackType

from bumblebot.core.usage import urgency


class RequestSlots:
    """``async with slots:`` around one request; waits for a free slot, most urgent first."""

    def __init__(self, size: int) -> None:
        self._free = size
        self._waiting: list[tuple[int, int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    @property
    def waiting(self) -> int:
        """Requests waiting for a slot."""
        return sum(1 for _, _, given in self._waiting if not given.done())

    async def __aenter__(self) -> None:
        if self._free > 0 and not self.waiting:
            self._free -= 1
            return
        given: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting, (urgency(), next(self._order), given))
        try:
            await given
        except asyncio.CancelledError:
            if given.done() and not given.cancelled():
                self._release()  # given a slot as it was cancelled: pass it on
            raise  # else left in the heap, done: skipped when its turn comes

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._release()

    def _release(self) -> None:
        while self._waiting:
            _, _, given = heapq.heappop(self._waiting)
            if not given.done():
                given.set_result(None)
                return
        self._free += 1
