"""This worker's place among the workers sharing one PostgreSQL store.

:class:`Membership` holds the leases (``bumblebot/store/leases.py``) of the conversations this
worker runs and of the cluster-wide roles it plays (``telegram.poller``, ``housekeeping``),
renews them every third of ``cluster.lease_s``, and reads the journal every
:data:`POLL_S` for work (:meth:`~bumblebot.runtime.ownership.OwnedConversations.collect`): a
message another worker journaled for a conversation held here, a conversation nobody holds.
A lease it fails to renew (taken over after this worker stalled, or the database unreachable
for a whole ``lease_s``) is given up at once: the conversation is dropped, the role stops.
On a clean stop every lease is released, so the other workers take over without waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable

from bumblebot.core.errors import STORE_FAILURES, StoreError
from bumblebot.runtime.ownership import HOUSEKEEPING_ROLE
from bumblebot.store import Store
from bumblebot.store.connection import Fence

log = logging.getLogger(__name__)

#: seconds between two reads of the journal for work another worker journaled
POLL_S = 0.25
CONVERSATION = "conversation:"
#: a conversation whose lease lapsed less than this many ``lease_s`` ago counts in the fair
#: share (a dead worker's, to be shared by the others)
SHARED_LAPSED = 10
#: the role of the one worker that polls Telegram's getUpdates and journals for all
TELEGRAM_POLLER = "telegram.poller"


def default_name() -> str:
    """``<host>-<pid>``: unique while the process lives."""
    return f"{socket.gethostname()}-{os.getpid()}"


class Membership:
    """The leases of worker ``name`` (the engine's :class:`~bumblebot.runtime.ownership.Ownership`).

    Args:
        store: the shared PostgreSQL store.
        name: this worker's name (``cluster.worker``).
        lease_s: how long a lease lasts unrenewed (``cluster.lease_s``).
        poll_s: how often the journal is read for work.
    """

    def __init__(self, store: Store, name: str, lease_s: float, *, poll_s: float = POLL_S) -> None:
        self.store = store
        self.name = name
        self.lease_s = lease_s
        self.poll_s = poll_s
        self.started_at = time.time()
        self._held: dict[str, int] = {}  # lease name -> token
        self._claiming: set[str] = set()
        self._roles: dict[str, asyncio.Event] = {}  # role lease -> set while held
        self._collect: Callable[[], Awaitable[None]] | None = None
        self._drop: Callable[..., Awaitable[None]] | None = None
        self._at_rest: Callable[[str], bool] | None = None
        self._renewed_at = time.monotonic()
        self._share = 1  # conversations a worker may hold before it leaves new ones to others
        self._seen: dict[str, float] = {}  # unheld conversations with work, since when
        self.role(HOUSEKEEPING_ROLE)  # every worker stands for it; one holds it

    # -- the engine's Ownership --------------------------------------------------------------

    def owns(self, key: str) -> bool:
        return CONVERSATION + key in self._held

    async def claim(self, key: str) -> bool:
        name = CONVERSATION + key
        if name in self._held or name in self._claiming or not self._fair(key):
            return False
        self._claiming.add(name)
        try:
            token = await self.store.acquire(name, self.name, self.lease_s)
        finally:
            self._claiming.discard(name)
        if token is None:
            return False
        self._held[name] = token
        self._seen.pop(key, None)
        log.info("%s: now runs %s (token %d)", self.name, key, token)
        return True

    def _fair(self, key: str) -> bool:
        """Whether to take conversation ``key`` now: while this worker holds no more than its
        share (the conversations held, plus one, over the live workers), or once the others left
        it unheld for a few reads of the journal (they are busier, or gone)."""
        first = self._seen.setdefault(key, time.monotonic())
        mine = sum(1 for name in self._held if name.startswith(CONVERSATION))
        return mine < self._share or time.monotonic() - first > 4 * self.poll_s

    def held(self) -> list[str]:
        return [name.removeprefix(CONVERSATION) for name in self._held if name.startswith(CONVERSATION)]

    async def give_up(self, key: str) -> None:
        name = CONVERSATION + key
        token = self._held.pop(name, None)
        if token is not None:
            with contextlib.suppress(StoreError, *STORE_FAILURES):  # else it lapses within lease_s
                await self.store.release(name, self.name, token)
            log.info("%s: let %s go (its actor found the lease lost)", self.name, key)

    def fence(self, key: str) -> Fence | None:
        token = self._held.get(CONVERSATION + key)
        return None if token is None else Fence(CONVERSATION + key, self.name, token, self.lease_s)

    # -- roles -------------------------------------------------------------------------------

    def leads(self, role: str) -> bool:
        return self.role(role).is_set()

    def role(self, name: str) -> asyncio.Event:
        """An event set while this worker holds the cluster-wide role ``name`` (one worker at
        a time: the Telegram poller, housekeeping); taken when free at each renewal."""
        return self._roles.setdefault(name, asyncio.Event())

    # -- the loop ----------------------------------------------------------------------------

    def bind(self, collect: Callable[[], Awaitable[None]], drop: Callable[..., Awaitable[None]],
             at_rest: Callable[[str], bool] | None = None) -> None:
        """The engine's ``collect``, ``drop`` and ``at_rest``."""
        self._collect, self._drop, self._at_rest = collect, drop, at_rest

    async def run(self) -> None:
        """Renew, take roles, read the journal for work; until cancelled."""
        next_renewal = 0.0
        while True:
            now = time.monotonic()
            if now >= next_renewal and await self._step(self._renew):
                next_renewal = now + self.lease_s / 3
                await self._step(self._shed)
            if self._collect is not None:
                await self._step(self._collect)
            if time.monotonic() - self._renewed_at > self.lease_s:
                await self._lose(list(self._held))  # held no longer for sure: others may have them
            await asyncio.sleep(self.poll_s)

    async def _step(self, step: Callable[[], Awaitable[None]]) -> bool:
        """Run one step of the loop; whether it went through (a failed one is tried again at
        the next turn of the loop, and never stops the others)."""
        try:
            await step()
        except (StoreError, *STORE_FAILURES) as exc:
            log.warning("%s: the store failed (%s); retrying", self.name, exc)
        except Exception:  # a bug must not end the renewals while the roles look held
            log.exception("%s: the cluster loop failed in %s; retrying", self.name, step.__name__)
        else:
            return True
        return False

    async def _renew(self) -> None:
        await self.store.heartbeat(self.name, socket.gethostname(), os.getpid(), self.started_at)
        renewing = dict(self._held)  # a claim made while this renews is not judged by it
        kept = dict(await self.store.renew(list(renewing), self.name, self.lease_s))
        self._renewed_at = time.monotonic()
        # the share counts a dead worker's conversations but not the dead worker: as its leases
        # lapse, the others take them at once, each its part (a worker renews every third of
        # lease_s: one unseen for two thirds is gone or stalled)
        live = max(1, sum(1 for w in await self.store.workers() if w.seen_ago < self.lease_s * 2 / 3))
        held = await self.store.live_leases(CONVERSATION, lapsed_s=SHARED_LAPSED * self.lease_s)
        self._share = -(-(held + 1) // live)  # ceil
        self._seen = {k: t for k, t in self._seen.items() if time.monotonic() - t < 60}
        await self._lose([name for name, token in renewing.items() if kept.get(name) != token and self._held.get(name) == token])
        for role, held in self._roles.items():
            if role not in self._held and (token := await self.store.acquire(role, self.name, self.lease_s)) is not None:
                self._held[role] = token
                log.info("%s: now the %s (token %d)", self.name, role, token)
                held.set()

    async def _shed(self) -> None:
        """Give up idle conversations held beyond one more than the share: a worker started
        again (or added) gets its part back as their next messages come, and a worker that
        dies later leaves fewer to take over."""
        if self._at_rest is None or self._drop is None:
            return
        mine = [name for name in self._held if name.startswith(CONVERSATION)]
        excess = len(mine) - (self._share + 1)
        for name in mine:
            key = name.removeprefix(CONVERSATION)
            if excess <= 0:
                break
            if not self._at_rest(key):
                continue
            token = self._held.pop(name)  # with the check, before any await: nothing new queues for it here
            excess -= 1
            await self._drop(key, released=True)
            with contextlib.suppress(StoreError, *STORE_FAILURES):  # else it lapses within lease_s
                await self.store.release(name, self.name, token)
            log.info("%s: gave %s up (over its share of %d)", self.name, key, self._share)

    async def _lose(self, names: list[str]) -> None:
        for name in names:
            self._held.pop(name, None)
            if name in self._roles:
                log.warning("%s: no longer the %s", self.name, name)
                self._roles[name].clear()
            elif self._drop is not None:
                await self._drop(name.removeprefix(CONVERSATION))

    async def leave(self) -> None:
        """Release every lease (a clean stop): the other workers take over at once."""
        for name, token in list(self._held.items()):
            with contextlib.suppress(StoreError, *STORE_FAILURES):
                await self.store.release(name, self.name, token)
        self._held.clear()
        for held in self._roles.values():
            held.clear()
