"""Delivery through the outbox: every message the engine says is recorded before it is sent.

A message is written to the ``outbox`` table, split by the adapter, and sent chunk by chunk;
the platform ids of sent chunks are recorded, so a retry resumes after the last sent chunk and
never repeats one. Transient failures are retried here (the only retry loop for sends) with
exponential backoff or the platform's ``retry_after``; a message that still fails stays
``pending`` and the sweeper retries it later (and at start-up). A permanent refusal marks it
``failed``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

from bumblebot.adapter import Adapter
from bumblebot.errors import DeliveryFailed
from bumblebot.events import ChatRef, Platform
from bumblebot.store import OutboxEntry, Store
from bumblebot.toolkit import DeliveryReport

log = logging.getLogger(__name__)

#: Longest platform-requested wait honoured inline, seconds; longer ones leave the row pending.
MAX_INLINE_WAIT_S = 30.0


class Delivery:
    """Sends outbox messages through the adapters.

    Args:
        store: the database.
        adapters: the running adapters by platform (the engine's live mapping).
        attempts: send attempts per message before leaving it pending.
        base_delay_s: first backoff delay, doubled per attempt, seconds.
    """

    def __init__(
        self, store: Store, adapters: Mapping[Platform, Adapter], *, attempts: int = 3, base_delay_s: float = 0.5
    ) -> None:
        self.store = store
        self.adapters = adapters
        self.attempts = attempts
        self.base_delay_s = base_delay_s
        self._lock = asyncio.Lock()
        self._in_flight: set[int] = set()

    async def send(self, conversation_id: int, turn_id: int | None, chat: ChatRef, text: str) -> DeliveryReport:
        """Record ``text`` in the outbox and deliver it now (with retries)."""
        outbox_id = await self.store.outbox_add(conversation_id, turn_id, chat, text)
        entry = OutboxEntry(outbox_id, conversation_id, turn_id, chat, text, "pending", [], 0, None)
        return await self._deliver(entry, self.attempts)

    async def _deliver(self, entry: OutboxEntry, attempts: int) -> DeliveryReport:
        self._in_flight.add(entry.id)
        try:
            return await self._attempts(entry, attempts)
        finally:
            self._in_flight.discard(entry.id)

    async def _attempts(self, entry: OutboxEntry, attempts: int) -> DeliveryReport:
        adapter = self.adapters.get(entry.chat.platform)
        if adapter is None:
            await self.store.outbox_progress(
                entry.id, status="pending", message_ids=entry.platform_message_ids, error="adapter not running"
            )
            return DeliveryReport(delivered=False, queued=True, error="platform not connected")
        chunks = adapter.chunks(entry.text)
        sent = list(entry.platform_message_ids)
        error = ""
        for attempt in range(attempts):
            try:
                for chunk in chunks[len(sent):]:
                    sent.append(await adapter.send_chunk(entry.chat, chunk))
                    if len(chunks) > 1:  # a crash mid-message must not resend earlier chunks
                        await self.store.outbox_chunks_sent(entry.id, sent)
            except DeliveryFailed as exc:
                error = str(exc)
                if not exc.retryable:
                    log.warning("delivery to %s refused: %s", entry.chat.key, error)
                    await self.store.outbox_progress(entry.id, status="failed", message_ids=sent, error=error)
                    return DeliveryReport(delivered=False, error=error, chat_unreachable=exc.chat_unreachable)
                if attempt + 1 < attempts:
                    delay = exc.retry_after if exc.retry_after is not None else self.base_delay_s * 2**attempt
                    if delay > MAX_INLINE_WAIT_S:
                        break
                    await asyncio.sleep(delay)
                continue
            await self.store.outbox_progress(entry.id, status="sent", message_ids=sent)
            return DeliveryReport(delivered=True)
        log.warning("delivery to %s failed for now, will retry: %s", entry.chat.key, error)
        await self.store.outbox_progress(entry.id, status="pending", message_ids=sent, error=error)
        return DeliveryReport(delivered=False, queued=True, error=error)

    async def retry_pending(self) -> int:
        """One attempt at every pending outbox message. Returns how many were delivered."""
        delivered = 0
        async with self._lock:
            for listed in await self.store.outbox_pending():
                if listed.chat.platform not in self.adapters or listed.id in self._in_flight:
                    continue
                entry = await self.store.outbox_entry(listed.id)  # the list may be stale by now
                if entry is None or entry.status != "pending" or entry.id in self._in_flight:
                    continue
                report = await self._deliver(entry, 1)
                delivered += int(report.delivered)
        return delivered
