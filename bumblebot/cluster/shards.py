"""Discord's gateway shards split across the workers: each shard on one worker at a time.

Shard ``n`` of ``discord.shard_count`` is held through the lease ``discord.shard:<n>``. Every
third of ``cluster.lease_s`` a worker renews the shards it holds, saves where each would be
resumed (its checkpoint, in the store under the lease's name), and balances: it takes free
shards while it holds fewer than its share (the shards over the workers taking part, rounded
up), and gives up shards it holds beyond it (a worker added or started again gets its part). A shard
given up, or left by a clean stop, is closed keeping its gateway session resumable and its
checkpoint saved; a dead worker's shard lapses after ``lease_s`` and is taken by another, which
resumes the dead worker's session from the checkpoint to take the messages it missed
(:mod:`adapters.discord.shards`). A shard whose lease could not be renewed is closed at once
and its checkpoint left alone: another worker may hold it already.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from typing import Any, Protocol

from bumblebot.core.errors import STORE_FAILURES, StoreError

log = logging.getLogger(__name__)

SHARD = "discord.shard:"
#: the lease each worker taking part in the shards holds while it does
MEMBER = "discord.shards.worker:"
#: the longest a worker whose shards could not be opened leaves them to the others, seconds
REST_MAX_S = 600.0


class ShardHost(Protocol):
    """The Discord adapter, as the shards' leases see it."""

    async def open_shard(self, shard: int, resume: dict[str, Any] | None = None) -> None:
        """Connect ``shard``, first taking what the session of checkpoint ``resume`` missed."""

    async def close_shard(self, shard: int) -> dict[str, Any] | None:
        """Close ``shard`` keeping its session resumable; its checkpoint."""

    def checkpoint(self, shard: int) -> dict[str, Any] | None:
        """Where the next holder of ``shard`` would resume (``None``: nothing to save yet)."""


class Membership(Protocol):
    """What the shards' leases need of :class:`~bumblebot.cluster.membership.Membership`."""

    store: Any
    name: str
    lease_s: float


class ShardLeases:
    """The shards worker ``membership.name`` runs, of ``count``, on ``host``."""

    def __init__(self, membership: Membership, count: int, host: ShardHost) -> None:
        self.membership = membership
        self.store = membership.store
        self.count = count
        self.host = host
        self.held: dict[int, int] = {}  # shard -> lease token
        self._opening: dict[int, asyncio.Task[None]] = {}
        self._saved: dict[int, dict[str, Any]] = {}
        self._member: int | None = None  # the token of this worker's lease among the shards' workers
        self._failures = 0  # shards that could not be opened here, in a row
        self._resting_until = 0.0  # till then this worker takes no shard and counts in no share
        self._renewed_at = time.monotonic()

    @property
    def lease_s(self) -> float:
        return self.membership.lease_s

    @property
    def name(self) -> str:
        return self.membership.name

    async def run(self) -> None:
        """Renew, save and balance every third of ``lease_s``; until cancelled."""
        while True:
            try:
                await self.balance()
            except (StoreError, *STORE_FAILURES) as exc:
                log.warning("%s: the store failed while renewing Discord's shards (%s); retrying", self.name, exc)
                if time.monotonic() - self._renewed_at > self.lease_s * 2 / 3:
                    for shard in list(self.held):  # before the leases run out: never two holders at once
                        await self._close(shard, save=False)
            except Exception:  # a bug must not end the renewals while the shards look held
                log.exception("%s: balancing Discord's shards failed; retrying", self.name)
            await asyncio.sleep(self.lease_s / 3)

    async def balance(self) -> None:
        if time.monotonic() < self._resting_until:  # its shards failed to open here: the others take them
            await self.leave()
            return
        workers = await self._workers()  # renewed first: a dead worker's lapses before its shards
        renewing = dict(self.held)
        kept = dict(await self.store.renew([SHARD + str(n) for n in renewing], self.name, self.lease_s))
        self._renewed_at = time.monotonic()
        for shard, token in renewing.items():
            if kept.get(SHARD + str(shard)) != token and self.held.get(shard) == token:
                log.warning("%s: Discord shard %d was taken over; closing it here", self.name, shard)
                await self._close(shard, save=False)
        for shard in list(self.held):
            await self._save(shard)
        share = -(-self.count // workers)  # ceil
        for shard in sorted(self.held, reverse=True)[: max(0, len(self.held) - share)]:
            await self._close(shard, save=True)
            log.info("%s: gave Discord shard %d up (over its share of %d)", self.name, shard, share)
        free = [n for n in range(self.count) if n not in self.held]
        random.shuffle(free)  # workers starting together do not all reach for shard 0 first
        for shard in free:
            if len(self.held) >= share:
                break
            token = await self.store.acquire(SHARD + str(shard), self.name, self.lease_s)
            if token is not None:
                self.held[shard] = token
                self._opening[shard] = asyncio.create_task(self._open(shard), name=f"bumblebot:shard:{shard}")

    async def _workers(self) -> int:
        """The workers taking part in the shards now, this one included. Each holds a lease of
        its own among them, renewed with its shards: a worker that stopped releases it, a dead
        one's lapses with its shards, and a worker without Discord never counts."""
        lease = MEMBER + self.name
        if self._member is None or not await self.store.renew([lease], self.name, self.lease_s):
            self._member = await self.store.acquire(lease, self.name, self.lease_s)
        return max(1, await self.store.live_leases(MEMBER))

    async def _open(self, shard: int) -> None:
        raw = await self.store.get_kv(SHARD + str(shard))
        resume = json.loads(raw) if raw else None
        log.info("%s: now runs Discord shard %d%s", self.name, shard, " (resuming its last session)" if resume else "")
        try:
            await self.host.open_shard(shard, resume)
            self._failures = 0
        except Exception as exc:  # noqa: BLE001 - never a lease renewed for a shard nobody runs
            self._failures += 1
            rest = min(REST_MAX_S, self.lease_s * 2 ** self._failures)
            self._resting_until = time.monotonic() + rest
            log.error("%s: Discord shard %d cannot be opened (%s: %s); leaving the shards to the other workers "
                      "for %.0f s", self.name, shard, type(exc).__name__, exc, rest)
            await self.host.close_shard(shard)
            token = self.held.pop(shard, None)
            if token is not None:
                with contextlib.suppress(StoreError, *STORE_FAILURES):
                    await self.store.release(SHARD + str(shard), self.name, token)
        finally:
            self._opening.pop(shard, None)

    async def _save(self, shard: int) -> None:
        checkpoint = self.host.checkpoint(shard)
        if checkpoint is not None and checkpoint != self._saved.get(shard):
            await self.store.set_kv(SHARD + str(shard), json.dumps(checkpoint))
            self._saved[shard] = checkpoint

    async def _close(self, shard: int, *, save: bool) -> None:
        """Close ``shard`` here; with ``save``, its checkpoint is saved and its lease released
        (a clean handover), else both are left (another worker may hold it already)."""
        token = self.held.pop(shard, None)
        opening = self._opening.pop(shard, None)
        if opening is not None:
            opening.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await opening
        checkpoint = await self.host.close_shard(shard)
        self._saved.pop(shard, None)
        if not save or token is None:
            return
        with contextlib.suppress(StoreError, *STORE_FAILURES):  # else the lease lapses, and the last save stands
            if checkpoint is not None:
                await self.store.set_kv(SHARD + str(shard), json.dumps(checkpoint))
            await self.store.release(SHARD + str(shard), self.name, token)

    async def leave(self) -> None:
        """Close every shard held here, saved and released, and leave the shards' workers: the
        others take them at their next balance."""
        for shard in list(self.held):
            await self._close(shard, save=True)
        await self._leave_members()

    async def _leave_members(self) -> None:
        if self._member is not None:
            with contextlib.suppress(StoreError, *STORE_FAILURES):
                await self.store.release(MEMBER + self.name, self.name, self._member)
            self._member = None
