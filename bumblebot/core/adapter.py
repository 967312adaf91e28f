"""The seam between the engine and a chat platform, in both directions.

An adapter owns one platform SDK (``import telegram`` only under ``adapters/telegram/``,
``import discord`` only under ``adapters/discord/``). It turns platform events into
:class:`~bumblebot.core.events.Inbound` messages and hands them to the engine through the narrow
:class:`Intake` interface, and it delivers what the engine says through
:meth:`Adapter.send_chunk`. Retry policy lives in ``bumblebot/delivery/outbox.py``; adapters only
classify failures by raising :class:`~bumblebot.core.errors.DeliveryFailed`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol

from bumblebot.core.errors import DeliveryFailed, MediaError
from bumblebot.core.events import Attachment, ChatRef, Inbound, Platform

#: The one reply to a file over the platform's download limit (nothing is downloaded).
TOO_BIG_TEXT = (
    "That file is too big for me: I can fetch files up to {limit} here, and {name} is {size}. "
    "Could you send a smaller one, or paste the part that matters?"
)

#: How a file is sent: a photo (shown inline), a document (a file to download), a voice message.
FileKind = Literal["photo", "document", "voice"]

log = logging.getLogger(__name__)

class Intake(Protocol):
    """What an adapter may ask of the engine (``bumblebot.runtime.engine.Engine`` implements it).

    Every method that takes an :class:`Inbound` journals it first, so a message the platform
    delivers twice (a Telegram update after a restart, a Discord RESUME replay) is handled once.
    ``kv`` values (Telegram's next update offset) are written in the same transaction.
    """

    @property
    def accepting(self) -> bool:
        """``False`` once the engine stops: an adapter must not acknowledge more updates."""

    @property
    def entity_name(self) -> str:
        """The entity's name, for greetings and the console prompt."""

    async def submit(self, inbound: Inbound, *, kv: dict[str, str] | None = None) -> bool:
        """A message for the entity: a turn answers it. ``False`` for a duplicate."""

    async def command(
        self, inbound: Inbound, name: str, *, kv: dict[str, str] | None = None, manager: bool = False
    ) -> str | None:
        """Run ``/name``; returns the answer to show, ``None`` for a duplicate. ``manager``: the
        sender manages this shared chat (an admin, or allowlisted), as the adapter found out when
        :func:`~bumblebot.core.commands.asks_manager` says it matters."""

    async def answer(self, inbound: Inbound, text: str | None, *, kv: dict[str, str] | None = None) -> bool:
        """Handle a message without a turn: reply ``text`` (``None``: no reply). ``False`` for a
        duplicate."""

    async def observe(self, inbound: Inbound, *, kv: dict[str, str] | None = None) -> bool:
        """A group message not addressed to the bot: no turn, no reply, but the next turn there
        may see it as background. ``False`` for a duplicate."""

    async def edit(self, inbound: Inbound) -> bool:
        """The person edited a message: ``inbound`` is it as it reads now (same chat and
        ``message_id``, the new text and files). It replaces the message if no turn has taken
        it yet (``True``); an edit that comes later is ignored (``False``): the turn answered
        what was first written. Nothing is journaled for the edit itself."""

    async def move_chat(self, old: ChatRef, new: ChatRef) -> bool:
        """The chat ``old`` continues at ``new`` (Telegram group → supergroup migration)."""

    async def refuse_once(self, inbound: Inbound, text: str, *, kv: dict[str, str] | None = None) -> None:
        """A sender outside the allowlist: ``text`` is sent at most once per sender and platform;
        later messages are only journaled."""

    async def reply(self, chat: ChatRef, text: str) -> None:
        """Send ``text`` to ``chat`` through the outbox (a command's answer)."""

    async def cursor(self, key: str) -> str | None:
        """A durable value of the adapter's own (Telegram: the next update offset)."""

    async def set_cursor(self, key: str, value: str) -> None:
        """Store a value for :meth:`cursor`."""


class Typing:
    """A typing indicator being kept alive: paused while the first words of a reply are on
    screen (typing shows only until the first words), resumed when the turn waits on the
    model again."""

    def __init__(self) -> None:
        self._running = asyncio.Event()
        self._running.set()
        self._paused = asyncio.Event()

    @property
    def paused(self) -> bool:
        return not self._running.is_set()

    def pause(self) -> None:
        self._running.clear()
        self._paused.set()

    def resume(self) -> None:
        if self.paused:
            self._paused.clear()
            self._running.set()

    async def wait_resumed(self) -> None:
        await self._running.wait()

    async def wait_paused(self, timeout: float) -> None:
        """Sleep ``timeout`` seconds, or less if paused meanwhile."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._paused.wait(), timeout)


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
    async def send_chunk(self, chat: ChatRef, chunk: Any, *, key: str) -> str:
        """Send one chunk; return the platform's message id.

        ``key`` is unique per chunk and the same on every retry of it (``<outbox id>.<index>``):
        a platform with idempotent sends (Discord's nonce) uses it to drop a repeat.

        Raises:
            DeliveryFailed: with ``retryable`` and ``retry_after`` set by the platform's answer.
        """

    def stream_interval_s(self, chat: ChatRef) -> float | None:
        """Least seconds between two edits of a streamed message in ``chat`` by the platform's
        rules; ``None`` (the default) when the platform shows no streamed text there."""
        return None

    async def send_preview(self, chat: ChatRef, text: str, *, key: str) -> str:
        """Show ``text`` (plain, cut to one message) as a new message with a Stop button where the
        platform has buttons; return its id. Raises :class:`~bumblebot.core.errors.DeliveryFailed`."""
        raise NotImplementedError

    async def edit_preview(self, chat: ChatRef, message_id: str, text: str, *, final: bool = False) -> None:
        """Show ``text`` (plain, cut to one message) in the preview ``message_id``; ``final``
        removes its Stop button. Raises :class:`~bumblebot.core.errors.DeliveryFailed`."""
        raise NotImplementedError

    async def finish_preview(self, chat: ChatRef, message_id: str, chunk: Any, *, key: str) -> str:
        """Replace the preview ``message_id`` by the first chunk of the final text (formatted,
        without the Stop button); returns the id of the message showing it: a new one (sent
        with ``key``) when the preview is gone. Raises :class:`~bumblebot.core.errors.DeliveryFailed`."""
        raise NotImplementedError

    async def delete_message(self, chat: ChatRef, message_id: str) -> None:
        """Delete one of the bot's messages. Raises :class:`~bumblebot.core.errors.DeliveryFailed`."""
        raise NotImplementedError

    async def download(self, attachment: Attachment, dest: Path) -> int:
        """Fetch a file of a message this adapter received into ``dest`` (created or replaced);
        returns its size in bytes.

        Raises:
            MediaError: too big for the platform's or the configured limit, gone, or the
                platform unreachable (``retryable``).
        """
        raise MediaError(f"{self.platform.value} messages carry no files")

    def max_upload_bytes(self, chat: ChatRef, kind: FileKind) -> int | None:
        """The largest file the platform takes in ``chat`` as ``kind``, bytes (``None``: it
        takes no files)."""
        return None

    async def send_file(
        self, chat: ChatRef, path: Path, *, kind: FileKind, caption: str, key: str, name: str = ""
    ) -> str:
        """Send the file at ``path`` as ``kind`` with ``caption`` (plain text, maybe ``""``,
        within :meth:`caption_limit`), called ``name`` in the chat (default: the path's
        name); returns the platform's message id. ``key`` as for :meth:`send_chunk`. Raises
        :class:`~bumblebot.core.errors.DeliveryFailed`."""
        raise NotImplementedError

    def caption_limit(self) -> int:
        """Longest caption of a file, characters (longer text goes in messages of its own)."""
        return 0

    def caption_fits(self, text: str) -> bool:
        """Whether ``text`` fits as the caption of a file (the platform's own measure)."""
        return len(text) <= self.caption_limit()

    @abstractmethod
    async def send_typing(self, chat: ChatRef) -> None:
        """Show a typing indicator once (platforms expire it after ~5 s).

        Raises:
            DeliveryFailed: with ``retry_after`` when the platform asked for silence (a 429):
                the indicator is not refreshed before it is over.
        """

    @contextlib.asynccontextmanager
    async def typing(self, chat: ChatRef, interval_s: float = 4.5) -> AsyncIterator[Typing]:
        """Keep a typing indicator alive for the duration of the ``async with`` block, except
        while it is paused (:class:`Typing`): refreshed every ``interval_s`` seconds, and after
        a refusal with ``retry_after`` (a 429) not before that many seconds, since the platform
        refuses every request sent before then."""
        handle = Typing()

        async def refresh() -> None:
            loop = asyncio.get_running_loop()
            quiet_until = 0.0  # loop time before which the platform asked for silence
            while True:
                await handle.wait_resumed()
                hold = quiet_until - loop.time()
                if hold > 0:  # resumed inside the flood window: wait it out first
                    await handle.wait_paused(hold)
                    continue
                try:
                    await self.send_typing(chat)
                except DeliveryFailed as exc:
                    if exc.retry_after is not None:
                        quiet_until = loop.time() + exc.retry_after
                    log.debug("typing indicator failed for %s: %s", chat.key, exc)
                except Exception as exc:  # typing is cosmetic; never fail a turn for it
                    log.debug("typing indicator failed for %s: %s", chat.key, exc)
                await handle.wait_paused(max(interval_s, quiet_until - loop.time()))

        task = asyncio.create_task(refresh(), name=f"bumblebot:{chat.key}:typing")
        try:
            yield handle
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
