"""Delivery through the outbox: every message reaches the platform from an ``outbox`` row.

The row is written before the first send (by the turn, together with the assistant message
that shows it, or by :meth:`Delivery.send` for messages outside a turn). The text is split by
the adapter and sent chunk by chunk; the platform ids of sent chunks are recorded, so a retry
resumes after the last sent chunk and never repeats one. A row whose text was streamed has a
``preview_id``: its first chunk is an edit of that message (``Adapter.finish_preview``), not a
new one (``bumblebot/preview.py``). Each chunk carries an idempotency key
(``<database id>-<outbox id>.<chunk>``, the database id being random per data directory):
platforms that honour one (Discord's ``nonce`` with
``enforce_nonce``) drop a repeat sent after a crash. Transient failures are retried here (the
only retry loop for sends) with exponential backoff or the platform's ``retry_after``; a
message that still fails stays ``pending`` and the sweeper retries it later (and at start-up).
A permanent refusal marks it ``failed``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from bumblebot.adapter import Adapter, Typing
from bumblebot.errors import DeliveryFailed
from bumblebot.events import ChatRef, Platform
from bumblebot.store import OutboxEntry, Store
from bumblebot.toolkit import DeliveryReport

log = logging.getLogger(__name__)

#: Longest platform-requested wait honoured inline, seconds; longer ones leave the row pending.
MAX_INLINE_WAIT_S = 30.0


class Delivery:
    """Sends outbox messages through the registered adapters.

    Args:
        store: the database.
        attempts: send attempts per message before leaving it pending.
        base_delay_s: first backoff delay, doubled per attempt, seconds.
    """

    def __init__(self, store: Store, *, attempts: int = 3, base_delay_s: float = 0.5) -> None:
        self.store = store
        self.attempts = attempts
        self.base_delay_s = base_delay_s
        self._adapters: dict[Platform, Adapter] = {}
        self._lock = asyncio.Lock()
        self._in_flight: set[int] = set()
        self._prefix: str | None = None

    def register(self, adapter: Adapter) -> None:
        """Make ``adapter`` the route for its platform's messages."""
        self._adapters[adapter.platform] = adapter

    @contextlib.asynccontextmanager
    async def typing(self, chat: ChatRef, interval_s: float) -> AsyncIterator[Typing]:
        """A typing indicator in ``chat`` for the duration of the block (none if its platform
        is not connected); the handle pauses and resumes it."""
        adapter = self._adapters.get(chat.platform)
        if adapter is None:
            yield Typing()
            return
        async with adapter.typing(chat, interval_s) as handle:
            yield handle

    def preview_target(self, chat: ChatRef) -> tuple[Adapter, float] | None:
        """The adapter that can stream into ``chat`` and its least seconds between edits there,
        ``None`` when it cannot (not connected, or a platform without streamed messages)."""
        adapter = self._adapters.get(chat.platform)
        interval = adapter.stream_interval_s(chat) if adapter is not None else None
        return None if adapter is None or interval is None else (adapter, interval)

    async def preview_key(self, outbox_id: int) -> str:
        """The idempotency key of the preview send of outbox row ``outbox_id``."""
        if self._prefix is None:
            self._prefix = await self.store.instance_id()
        return f"{self._prefix}-{outbox_id}.p"

    async def send(self, conversation_id: int, chat: ChatRef, text: str) -> DeliveryReport:
        """Record ``text`` (outside any turn: a command's answer, a refusal) and deliver it."""
        return await self.deliver(await self.store.outbox_add(conversation_id, None, chat, text))

    async def deliver(self, entry: OutboxEntry, attempts: int | None = None) -> DeliveryReport:
        """Send an outbox row now, with retries; the row records every outcome."""
        self._in_flight.add(entry.id)
        try:
            return await self._attempts(entry, attempts or self.attempts)
        finally:
            self._in_flight.discard(entry.id)

    async def _attempts(self, entry: OutboxEntry, attempts: int) -> DeliveryReport:
        adapter = self._adapters.get(entry.chat.platform)
        if adapter is None:
            await self.store.outbox_progress(
                entry.id, status="pending", message_ids=entry.platform_message_ids, error="adapter not running"
            )
            return DeliveryReport(delivered=False, queued=True, error="platform not connected")
        if self._prefix is None:
            self._prefix = await self.store.instance_id()
        try:
            chunks = adapter.chunks(entry.text)
        except Exception as exc:  # a bug in splitting must not be retried for ever
            log.exception("cannot split outbox message %s for %s", entry.id, entry.chat.key)
            error = f"cannot split the message: {type(exc).__name__}"
            await self.store.outbox_progress(entry.id, status="failed", message_ids=entry.platform_message_ids, error=error)
            return DeliveryReport(delivered=False, error=error)
        sent = list(entry.platform_message_ids)
        error = ""
        for attempt in range(attempts):
            try:
                for index in range(len(sent), len(chunks)):
                    key = f"{self._prefix}-{entry.id}.{index}"
                    if index == 0 and entry.preview_id is not None:  # the streamed preview becomes it
                        sent.append(await adapter.finish_preview(entry.chat, entry.preview_id, chunks[0], key=key))
                    else:
                        sent.append(await adapter.send_chunk(entry.chat, chunks[index], key=key))
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

    async def retry_pending(self, only: set[int] | None = None) -> int:
        """One attempt at every pending outbox message (or those of ``only``, row ids), never
        at one being sent meanwhile. Returns how many were delivered."""
        delivered = 0
        async with self._lock:
            for listed in await self.store.outbox_pending():
                if only is not None and listed.id not in only:
                    continue
                if listed.chat.platform not in self._adapters or listed.id in self._in_flight:
                    continue
                entry = await self.store.outbox_entry(listed.id)  # the list may be stale by now
                if entry is None or entry.status != "pending" or entry.id in self._in_flight:
                    continue
                report = await self.deliver(entry, 1)
                delivered += int(report.delivered)
        return delivered
