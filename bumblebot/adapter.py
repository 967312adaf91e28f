"""The seam between the engine and a chat platform.

An adapter owns one platform SDK (``import telegram`` only under ``adapters/telegram/``,
``import discord`` only under ``adapters/discord/``). It turns platform events into
:class:`~bumblebot.events.Inbound` messages for ``Engine.submit`` and delivers what the engine
asks through :meth:`Adapter.send_chunk`. Retry policy lives in ``bumblebot/delivery.py``;
adapters only classify failures by raising :class:`~bumblebot.errors.DeliveryFailed`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Sequence
from typing import Any, ClassVar

from bumblebot.events import ChatRef, Platform

log = logging.getLogger(__name__)


class Adapter(ABC):
    """A platform connection.

    Lifecycle: ``start()`` connects and begins intake; ``stop_intake()`` stops intake only;
    ``stop()`` disconnects (idempotent).
    """

    platform: ClassVar[Platform]

    @abstractmethod
    async def start(self) -> None:
        """Connect and begin intake. Raises ``RuntimeError`` if already started."""

    async def stop_intake(self) -> None:
        """Stop accepting new platform events, but keep the connection for sending.

        Called first on shutdown, so that in-flight turns can still deliver their replies.
        """

    @abstractmethod
    async def stop(self) -> None:
        """Stop intake and disconnect. Safe to call twice."""

    @abstractmethod
    def chunks(self, text: str) -> Sequence[Any]:
        """Split ``text`` into messages within the platform's limit; never an empty chunk.

        A chunk is whatever :meth:`send_chunk` takes (a string, or text plus formatting).
        Splitting must be deterministic: a retry resumes after the chunks already sent.
        """

    @abstractmethod
    async def send_chunk(self, chat: ChatRef, chunk: Any) -> str:
        """Send one chunk; return the platform's message id.

        Raises:
            DeliveryFailed: with ``retryable`` and ``retry_after`` set by the platform's answer.
        """

    @abstractmethod
    async def send_typing(self, chat: ChatRef) -> None:
        """Show a typing indicator once (platforms expire it after ~5 s)."""

    @contextlib.asynccontextmanager
    async def typing(self, chat: ChatRef, interval_s: float = 4.5) -> AsyncIterator[None]:
        """Keep a typing indicator alive for the duration of the ``async with`` block."""

        async def refresh() -> None:
            while True:
                try:
                    await self.send_typing(chat)
                except Exception as exc:  # typing is cosmetic; never fail a turn for it
                    log.debug("typing indicator failed for %s: %s", chat.key, exc)
                await asyncio.sleep(interval_s)

        task = asyncio.create_task(refresh(), name=f"bumblebot:{chat.key}:typing")
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
