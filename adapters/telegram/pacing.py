"""Outgoing pace: one scheduler every call of an adapter to a chat goes through.

A burst of replies (twenty ``/help`` in a second, a long answer split in many messages, a
streamed preview edited while the final text goes out) must not become a burst of calls:
Telegram answers such bursts with 429s and, when they go on, with flood waits of hours
(Bot API FAQ, "My bot is hitting limits"). A :class:`Pacer`
gives each call its turn:

- calls to one chat go one at a time, in the order they asked (FIFO); a chat may take
  :attr:`PaceLimits.per_chat_burst` calls at once (a reply of a few chunks, a streamed
  preview and its final edit), then one per :attr:`PaceLimits.per_chat_interval_s` (a token
  bucket, refilled from the end of each call, so the spacing holds at the platform whatever
  the network's delay);
- calls to one group are at most :attr:`PaceLimits.group_per_minute` in any 60 s;
- calls to all chats together are at most :attr:`PaceLimits.global_per_second` in any 1 s
  (across chats no order is promised);
- after a 429, :meth:`Pacer.pause` holds every call to that chat until its ``retry_after``
  is over, and the refused call keeps its place: when it is tried again (with the same
  ``ticket``, as the delivery layer does after ``retry_after``) it goes before the calls that
  queued meanwhile. Nothing is dropped: a call waits, or (past its ``max_wait_s``) is refused
  with a retryable :class:`~bumblebot.core.errors.DeliveryFailed` that the delivery layer retries.

Calls that must never wait (the typing indicator) take no turn: they ask :meth:`Pacer.paused_for`
and are skipped while the chat is paused, so they never queue behind messages nor use up their
allowance. A streamed preview's edits are ``droppable``: skipped when other calls are queued.

The defaults are Telegram's published limits (Bot API FAQ, "My bot is hitting limits, how do I
avoid this?", https://core.telegram.org/bots/faq#my-bot-is-hitting-limits-how-do-i-avoid-this):
about one message a second in one chat, 20 messages a minute in one group, about 30 messages
a second overall. Discord's adapter has no pacer: discord.py keeps its own buckets per route
and waits out each 429 itself.

Pure asyncio: no platform import; every instant is loop time (``loop.time()``, seconds).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from bumblebot.core.errors import DeliveryFailed

#: Seconds of the group window (``group_per_minute``) and of the overall one (``global_per_second``).
GROUP_WINDOW_S = 60.0
GLOBAL_WINDOW_S = 1.0
#: The share of the overall window a droppable call (a streamed preview) may find in use and
#: still go: past it, the room left is kept for messages and final edits. A shown preview costs
#: its reply a second call (the final edit), so previews taking the window's last slots under
#: load would cut the replies a second can carry, and every reply would queue.
PREVIEW_SHARE = 0.5
#: After a 429, how long past the pause the turn stays kept for the refused call's retry,
#: seconds (the delivery layer retries as the pause ends); then the queue moves on without it.
HOLD_GRACE_S = 2.0
#: Chats tracked before idle ones are forgotten (the bound then doubles with the chats in use).
MIN_TRACKED = 256


@dataclass(frozen=True, slots=True)
class PaceLimits:
    """How fast an adapter may call a platform. Defaults: Telegram's published limits (Bot
    API FAQ, see the module docstring).

    Args:
        per_chat_interval_s: seconds per call to one chat, sustained (Telegram: "avoid sending
            more than one message per second" in a chat); ``0``: no per-chat limit.
        per_chat_burst: calls a chat that has been quiet may take at once before the interval
            applies (3: a reply in two or three chunks, or a streamed preview and its final
            edit, is not held back; twenty replies still go about a second apart).
        group_per_minute: most calls to one group in any 60 s (Telegram: 20).
        global_per_second: most calls to all chats together in any 1 s (Telegram: about 30).
    """

    per_chat_interval_s: float = 1.0
    per_chat_burst: int = 3
    group_per_minute: int = 20
    global_per_second: int = 30

    def __post_init__(self) -> None:
        if (self.per_chat_interval_s < 0 or self.per_chat_burst < 1 or self.group_per_minute < 1
                or self.global_per_second < 1):
            raise ValueError(f"pace limits must be positive: {self}")


@dataclass(slots=True)
class _Waiter:
    ticket: str | None
    granted: asyncio.Future[None]


@dataclass(slots=True)
class _Chat:
    """What the pacer knows of one chat."""

    queue: deque[_Waiter] = field(default_factory=deque)  # calls waiting for the turn, in order
    busy: bool = False  # a call has the turn
    spent: float = 0.0  # calls of the burst allowance in use (each one back per interval)
    spent_at: float = 0.0  # loop time ``spent`` was last brought up to date
    paused_until: float = 0.0  # loop time before which the platform asked for silence (a 429)
    sent: deque[float] = field(default_factory=deque)  # a group's recent call ends, oldest first
    held_for: str | None = None  # the ticket of a refused call whose retry gets the next turn
    held_until: float = 0.0
    wake: asyncio.TimerHandle | None = None  # re-grants the turn when a hold runs out

    def idle(self, now: float, interval_s: float) -> bool:
        """Nothing it remembers can hold a call any more: it may be forgotten."""
        window = self.sent[-1] + GROUP_WINDOW_S if self.sent else 0.0
        return (not self.busy and not self.queue and self.spent_now(now, interval_s) == 0
                and now >= max(self.paused_until, self.held_until, window))

    def spent_now(self, now: float, interval_s: float) -> float:
        """The burst allowance in use at ``now``: one call comes back per ``interval_s``."""
        if interval_s <= 0:
            return 0.0
        return max(0.0, self.spent - (now - self.spent_at) / interval_s)


class Pacer:
    """Gives each call to a chat its turn under :class:`PaceLimits` (module docstring).

    One pacer per adapter (per bot token: the platform's limits are per bot). Chats are named
    by ``chat_key``, a string unique within the adapter (Telegram: the chat id; a forum's
    topics share their group's limits, so they share its key). Memory stays bounded: a chat
    nothing can hold any more (no call waiting, spacing, pause and group window over) is
    forgotten.

    Args:
        limits: the platform's limits (default: Telegram's).
    """

    def __init__(self, limits: PaceLimits | None = None) -> None:
        self.limits = limits or PaceLimits()
        self._chats: dict[str, _Chat] = {}
        self._recent: deque[float] = deque()  # starts of the calls of the last second, oldest first
        self._waiting_overall = 0  # calls asleep until the overall window has room
        self._sweep_at = MIN_TRACKED

    @property
    def tracked(self) -> int:
        """How many chats the pacer holds state for (bounded by the chats in use lately)."""
        return len(self._chats)

    @contextlib.asynccontextmanager
    async def slot(
        self, chat_key: str, *, group: bool = False, ticket: str | None = None, max_wait_s: float | None = None,
        droppable: bool = False,
    ) -> AsyncIterator[None]:
        """Wait for the chat's turn, then make one call inside the ``async with`` block.

        The turn comes in the order callers asked (FIFO per chat), once the chat's spacing, its
        pause (:meth:`pause`), the group window (``group``) and the overall window allow; the
        next call to the chat is spaced from the end of the block. A block that raises after
        pausing the chat (a 429) keeps the next turn for its ``ticket`` until
        :data:`HOLD_GRACE_S` after the pause, so its retry goes first.

        Args:
            chat_key: the chat (see the class docstring).
            group: the chat is a group (``group_per_minute`` applies).
            ticket: names the call across its retries (the delivery layer's idempotency key);
                ``None``: a call that keeps no place after a 429.
            max_wait_s: longest wait once the call has its turn, seconds (``None``: as long
                as it takes); a longer one (a long pause, a full group window) is refused at
                once. The wait in the queue is not bounded, so that calls keep their order.
            droppable: a call that may be skipped (a streamed preview's edit: newer text
                follows): refused at once when another call to the chat has or waits for the
                turn, so it never queues behind messages.

        Raises:
            DeliveryFailed: (``retryable``; ``retry_after`` = seconds until the turn, when
                known) the turn is further away than ``max_wait_s``, or taken (``droppable``);
                nothing was sent.
        """
        loop = asyncio.get_running_loop()
        chat = self._chat(chat_key)
        if droppable and (chat.busy or chat.queue or (chat.held_for is not None and loop.time() < chat.held_until)):
            raise DeliveryFailed("another call to the chat goes first: skipped", retryable=True)
        await self._take_turn(chat, ticket)
        try:
            deadline = None if max_wait_s is None else loop.time() + max_wait_s
            await self._wait_limits(chat, group, deadline, droppable=droppable)
            paused_before = chat.paused_until
            try:
                yield
            except BaseException:
                pause = chat.paused_until - loop.time()
                # kept however long the pause: the delivery layer tries it again as it ends
                if ticket is not None and chat.paused_until > paused_before and pause > 0:
                    chat.held_for, chat.held_until = ticket, chat.paused_until + HOLD_GRACE_S
                raise
            finally:
                end = loop.time()  # the call counts from its end: the allowance refills from here
                chat.spent, chat.spent_at = chat.spent_now(end, self.limits.per_chat_interval_s) + 1.0, end
                if group:
                    chat.sent.append(end)
                    while len(chat.sent) > self.limits.group_per_minute:
                        chat.sent.popleft()
        finally:
            chat.busy = False
            self._grant(chat)

    def pause(self, chat_key: str, seconds: float) -> None:
        """Hold every call to the chat for ``seconds`` from now (a 429's ``retry_after``);
        a longer pause already in force stays."""
        if seconds <= 0:
            return
        chat = self._chat(chat_key)
        chat.paused_until = max(chat.paused_until, asyncio.get_running_loop().time() + seconds)

    def paused_for(self, chat_key: str) -> float:
        """Seconds the chat stays paused (``0.0``: not paused). For calls that never wait:
        the typing indicator is skipped while this is positive."""
        chat = self._chats.get(chat_key)
        if chat is None:
            return 0.0
        return max(0.0, chat.paused_until - asyncio.get_running_loop().time())

    # -- internals ----------------------------------------------------------------------------

    def _chat(self, chat_key: str) -> _Chat:
        chat = self._chats.get(chat_key)
        if chat is None:
            if len(self._chats) >= self._sweep_at:
                now = asyncio.get_running_loop().time()
                self._chats = {k: c for k, c in self._chats.items() if not c.idle(now, self.limits.per_chat_interval_s)}
                self._sweep_at = max(MIN_TRACKED, 2 * len(self._chats))
            chat = self._chats[chat_key] = _Chat()
        return chat

    async def _take_turn(self, chat: _Chat, ticket: str | None) -> None:
        """Queue for the chat's turn and wait for it (:meth:`_grant` hands it on)."""
        waiter = _Waiter(ticket, asyncio.get_running_loop().create_future())
        chat.queue.append(waiter)
        self._grant(chat)
        try:
            await waiter.granted
        except asyncio.CancelledError:
            if waiter.granted.done() and not waiter.granted.cancelled():  # granted, then cancelled
                chat.busy = False
                self._grant(chat)
            elif waiter in chat.queue:
                chat.queue.remove(waiter)
            raise

    def _grant(self, chat: _Chat) -> None:
        """Give the free turn to the first waiter, or to the refused call it is kept for."""
        while chat.queue and chat.queue[0].granted.done():  # cancelled meanwhile
            chat.queue.popleft()
        if chat.busy or not chat.queue:
            return
        loop = asyncio.get_running_loop()
        waiter = chat.queue[0]
        if chat.held_for is not None:
            if loop.time() < chat.held_until:
                kept = next((w for w in chat.queue if w.ticket == chat.held_for and not w.granted.done()), None)
                if kept is None:  # its retry has not come yet: nobody goes before it
                    if chat.wake is None:
                        chat.wake = loop.call_at(chat.held_until, self._hold_over, chat)
                    return
                waiter = kept
            chat.held_for = None
        chat.queue.remove(waiter)
        chat.busy = True
        waiter.granted.set_result(None)

    def _hold_over(self, chat: _Chat) -> None:
        chat.wake = None
        self._grant(chat)

    async def _wait_limits(self, chat: _Chat, group: bool, deadline: float | None, *, droppable: bool = False) -> None:
        """Sleep until every limit allows a call to ``chat``, then count it in the overall
        window (checked and counted with no pause in between: no other call slips in). A
        ``droppable`` call never waits for the overall window: when more than
        :data:`PREVIEW_SHARE` of it is in use, or other calls wait for room in it, the call is
        refused at once, so under load the calls that must get out (messages, final edits) have
        it, and previews are what gives way."""
        loop = asyncio.get_running_loop()
        limits = self.limits
        while True:
            now = loop.time()
            while self._recent and self._recent[0] + GLOBAL_WINDOW_S <= now:
                self._recent.popleft()
            ready = chat.paused_until
            over = chat.spent_now(now, limits.per_chat_interval_s) - (limits.per_chat_burst - 1)
            if over > 0:  # the burst is used up: the next call once one is back
                ready = max(ready, now + over * limits.per_chat_interval_s)
            if group and len(chat.sent) >= limits.group_per_minute:
                ready = max(ready, chat.sent[-limits.group_per_minute] + GROUP_WINDOW_S)
            used = len(self._recent)
            if droppable and (used >= limits.global_per_second * PREVIEW_SHARE or self._waiting_overall):
                raise DeliveryFailed("the overall window is busy: a preview gives way", retryable=True)
            # waiting for the overall window, not for its chat's spacing or pause: only then does
            # it hold previews back (a chat paused by a 429 must not stop previews everywhere)
            window_at = self._recent[-limits.global_per_second] + GLOBAL_WINDOW_S if used >= limits.global_per_second else 0.0
            for_window = window_at > max(ready, now)
            ready = max(ready, window_at)
            if ready <= now:
                self._recent.append(now)
                return
            if deadline is not None and ready > deadline:
                raise DeliveryFailed(
                    f"the chat's turn is {ready - now:.1f} s away: not sent, to be tried again",
                    retryable=True, retry_after=ready - now,
                )
            self._waiting_overall += for_window
            try:
                await asyncio.sleep(ready - now)  # then the limits are read again
            finally:
                self._waiting_overall -= for_window
