"""The request slots of one endpoint: at most ``llm.max_concurrent_requests`` requests in flight,
and when they are all taken, the most urgent waiting request is sent next.

Urgency comes from the task sending the request (:func:`bumblebot.core.usage.urgency`): first the
requests of turns whose person has seen nothing yet, then the rest of the interactive work, then
background work (automations, autonomous turns). Requests of one urgency go in the order they
came. A turn's urgency is read when the slot frees, not when its request came: a message for a
turn that had answered makes the step it has waiting urgent again
(:func:`~bumblebot.core.usage.message_came`), and that step's successor takes the message in.
On a server that answers one request at a time (llama.cpp with one slot,
llama-cpp-python), with ``max_concurrent_requests: 1``, a new message's first step then waits
for the request in flight only, not for every step that the turns of other chats queued before
it. A turn that keeps calling tools after its first words yields to new messages; it is delayed
by them, never starved: they are only as many as the messages that come.

A server with one slot keeps one prompt cache: llama.cpp and llama-cpp-python reuse the part
of a prompt that repeats the one before, and any other chat's request in between throws it
away. So at ``max_concurrent_requests: 1`` the slot a turn of a waiting person used stays kept
for that turn for :data:`KEEP_S` after its request (a tool runs, the next step comes): its
next step, if the person still waits (else it queues as usual, or takes the slot when nobody
else waits), then reads only what is new, not the whole conversation again (on SmolLM2-135M on
two cores, 3,000 tokens took 58 s to read; the step after a quick tool call reads a few dozen).
The slot is released at once when the turn ends, after :data:`KEEP_S` when no request of
it came (a slow tool), and, while others wait, after :data:`KEEP_RUN` requests of the turn in
a row or :data:`KEEP_RUN_S` after the first of them ended (a model calling tool after tool
does not hold other chats' first words for long).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from types import TracebackType

from bumblebot.core.usage import (
    FIRST_WORDS,
    GaveUp,
    awaited_turn,
    give_up_event,
    urgency,
    when_ended,
)

#: Seconds a one-slot endpoint's slot stays kept for the next request of the turn that used it.
KEEP_S = 1.0
#: Requests of one turn in a row that may keep the slot while other requests wait for it...
KEEP_RUN = 4
#: ...and seconds after the first of them ended.
KEEP_RUN_S = 30.0


class RequestSlots:
    """``async with slots:`` around one request; waits for a free slot, most urgent first.

    Args:
        size: requests in flight at most (``llm.max_concurrent_requests``).
        keep_s: with one slot, seconds it stays kept for the next request of the turn that
            used it (the module's docstring); 0: never kept.
        clock: seconds, for :data:`KEEP_RUN_S`.
    """

    def __init__(self, size: int, keep_s: float = KEEP_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._free = size
        #: (urgency when it came, order, future, its turn): a turn's urgency is read again when a
        #: slot frees (a message that came for it makes it urgent while its request waits)
        self._waiting: list[tuple[int, int, asyncio.Future[None], object | None]] = []
        self._order = itertools.count()
        self._clock = clock
        self._keep_s = keep_s if size == 1 else 0.0
        #: the turn the slot is kept for, and the timer that releases it
        self._kept: tuple[object, asyncio.TimerHandle] | None = None
        #: the turn of the last requests, how many in a row, when the first of them ended
        self._run: tuple[object | None, int, float] = (None, 0, 0.0)

    @property
    def waiting(self) -> int:
        """Requests waiting for a slot."""
        return sum(1 for _, _, given, _ in self._waiting if not given.done())

    async def __aenter__(self) -> None:
        if self._kept is not None and self._kept[0] is awaited_turn():
            self._kept[1].cancel()  # the turn's next request: the slot it kept
            self._kept = None
            if not self.waiting or self._most_urgent()[0] >= urgency():
                return
            self._release()  # it has said something since: a new message's first words go first
        if self._free > 0 and not self.waiting:
            self._free -= 1
            return
        given: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append((urgency(), next(self._order), given, awaited_turn()))
        try:
            await self._given(given)
        except asyncio.CancelledError:
            if given.done() and not given.cancelled():
                self._release()  # given a slot as it was cancelled: pass it on
            raise  # else left in the list, done: dropped at the next release

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        turn, now = awaited_turn(), self._clock()
        same = self._run[0] is turn
        self._run = (turn, self._run[1] + 1 if same else 1, self._run[2] if same else now)
        short = self._run[1] < KEEP_RUN and now - self._run[2] < KEEP_RUN_S
        waited_on = turn is not None and urgency() == FIRST_WORDS
        if self._keep_s and kind is None and waited_on and (short or not self.waiting):
            timer = asyncio.get_running_loop().call_later(self._keep_s, self._unkeep, turn)
            self._kept = (turn, timer)
            when_ended(turn, lambda: self._unkeep(turn))
            return
        self._release()

    def _unkeep(self, turn: object) -> None:
        """The kept slot is released: ``turn`` ended, or sent nothing for :data:`KEEP_S`."""
        if self._kept is not None and self._kept[0] is turn:
            self._kept[1].cancel()
            self._kept = None
            self._release()

    @staticmethod
    async def _given(given: asyncio.Future[None]) -> None:
        """Wait for the slot, unless the block's :func:`~bumblebot.core.usage.unless` event is
        set first (then :class:`~bumblebot.core.usage.GaveUp`: the request is not sent)."""
        give_up = give_up_event()
        if give_up is None:
            await given
            return
        waiter = asyncio.ensure_future(give_up.wait())
        try:
            await asyncio.wait({given, waiter}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            # cancelled while waiting (a /stop, a shutdown): asyncio.wait leaves ``given``
            # pending, and a release would hand the slot to it for good
            if not given.done():
                given.cancel()
            raise
        finally:
            waiter.cancel()
        if not given.done():
            given.cancel()  # dropped at the next release
            raise GaveUp

    def _most_urgent(self) -> tuple[int, tuple[int, int, asyncio.Future[None], object | None]]:
        """The waiter a freed slot goes to, with its urgency now (there is one)."""
        live = [(w[0] if w[3] is None else urgency(w[3]), w) for w in self._waiting if not w[2].done()]
        return min(live, key=lambda u: (u[0], u[1][1]))

    def _release(self) -> None:
        self._waiting = [w for w in self._waiting if not w[2].done()]  # cancelled waiters keep no place
        if not self._waiting:
            self._free += 1
            return
        _, first = self._most_urgent()
        self._waiting.remove(first)
        first[2].set_result(None)
