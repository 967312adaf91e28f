"""A ``say`` being streamed: one platform message that shows its text as the model writes it.

Exactly once: before anything is shown, the turn opens a ``streaming`` outbox row
(``Turn.open_stream``), and the platform id of the message showing the text is recorded on it
as soon as it is known. When the ``say`` call is complete, the row *becomes* that call's
message: ``Turn.speak(..., stream=row)``, and delivery edits the preview into the final,
formatted text (``Delivery``). A crash or an outage mid-stream leaves the row open; the resumed
turn's next stream takes it over (and its message), so the user never gets a second copy. A
preview no ``say`` takes over (a call dropped as a repeat, an unusable call) is deleted.

Pacing: edits of one message are at least ``interval_s`` apart; text that arrives meanwhile
is coalesced, so only the latest is sent. A platform 429 pauses the preview for its
``retry_after`` (up to :data:`MAX_PAUSE_S`), and the final text waits it out too; a preview
the adapter skips (its pacer gave the turn to another call) just tries again after
``interval_s``. Intermediate text is dropped; the final text is always delivered through the
outbox whatever happened to the preview. Edits never hold the
model's stream up: :meth:`LivePreview.add` only records the text and wakes the pump task.

A preview never shows a configured secret, nor the beginning of one at the end of the text
written so far (:meth:`~bumblebot.core.redaction.Redactor.streamed`): that part shows with a
later edit if it turns out to be something else.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

from bumblebot.core.adapter import Adapter
from bumblebot.core.errors import DeliveryFailed
from bumblebot.core.events import ChatRef
from bumblebot.core.redaction import NO_SECRETS, Redactor
from bumblebot.store import OutboxEntry

log = logging.getLogger(__name__)

#: Longest platform-requested pause a preview waits out, seconds (the final text goes through
#: the outbox regardless).
MAX_PAUSE_S = 30.0
#: A preview starts once the text has this many characters (a word or two, not one letter).
MIN_PREVIEW_CHARS = 8
#: How long closing a preview waits for an edit in flight, seconds.
CLOSE_WAIT_S = 10.0


class StreamRows(Protocol):
    """The streaming outbox rows of the turn a preview belongs to (the runtime's ``Turn``
    writes them)."""

    @property
    def chat(self) -> ChatRef: ...

    async def open_stream(self) -> OutboxEntry:
        """A new ``streaming`` row, before anything is shown."""

    async def stream_previewed(self, entry: OutboxEntry, preview_id: str, shown: str) -> OutboxEntry:
        """The row's message is on screen (its platform id), showing ``shown``."""

    def release_stream(self, entry: OutboxEntry) -> None:
        """The row stays open for the turn's next stream to take over."""

    async def settle_stream(self, entry: OutboxEntry, *, status: str, text: str | None = None, error: str | None = None) -> None:
        """Close the row (``sent`` with what it shows, or ``failed``)."""


class LivePreview:
    """One streamed ``say``: its outbox row and the message that shows it meanwhile.

    Args:
        turn: the turn that writes the row.
        adapter: the platform (``send_preview``, ``edit_preview``, ``delete_message``).
        interval_s: least seconds between two sends or edits.
        key: idempotency key of the preview's send (Discord's nonce).
        on_shown: called once, when the first text is visible (the typing indicator stops).
        clean: what the user may see of the raw text (reasoning and engine notes removed);
            applied when the text is shown, at most once per edit, not on every fragment.
        redactor: the secrets never shown (``Delivery.redactor``), applied after ``clean``.
        still_ours: whether this worker still holds the conversation (a worker of a cluster:
            ``Database.holds_fence``), asked before each send or edit; once not, the preview stops.
    """

    def __init__(
        self, turn: StreamRows, adapter: Adapter, *, interval_s: float, key: Callable[[int], Awaitable[str]],
        on_shown: Callable[[], None] = lambda: None, clean: Callable[[str], str] = str.strip,
        redactor: Redactor = NO_SECRETS, still_ours: Callable[[], Awaitable[bool]] | None = None,
    ) -> None:
        self._still_ours = still_ours
        self._clean = clean
        self._redactor = redactor
        self._turn = turn
        self._adapter = adapter
        self._interval_s = interval_s
        self._key = key
        self._on_shown = on_shown
        self._parts: list[str] = []  # the raw text so far, in the pieces it came in
        self._length = 0
        self._version = 0  # pieces received; what is shown was built from ``_shown_version``
        self._shown_version = 0
        #: the text the platform shows now
        self.shown = ""
        self._changed = asyncio.Event()
        self._closing = asyncio.Event()
        self._dead = False
        self._quiet_until = 0.0  # loop time before which the platform asked for silence (a 429)
        self.entry: OutboxEntry | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def started(self) -> bool:
        return self._task is not None

    def add(self, text: str, *, start: bool = False) -> None:
        """More text (never blocks). The pump starts once there are
        :data:`MIN_PREVIEW_CHARS` characters, or at once with ``start`` (a later say of the
        same completion is streaming: this one is complete, and must show first)."""
        if text:
            self._parts.append(text)
            self._length += len(text)
            self._version += 1
        if self._task is None:
            if not start and self._length < MIN_PREVIEW_CHARS:
                return
            self._task = asyncio.create_task(self._pump(), name="bumblebot:preview")
        self._changed.set()

    def restart(self) -> None:
        """The completion is asked again (a reflex reply cut at its budget): the text starts
        over in the same message, which is edited when the new text shows."""
        self._parts.clear()
        self._length = 0
        self._version += 1

    async def _pump(self) -> None:
        try:
            self.entry = await self._turn.open_stream()
            while not self._closing.is_set() and not self._dead:
                if self._version == self._shown_version:
                    self._changed.clear()
                    await _first(self._changed, self._closing)
                    continue
                version = self._version
                text = self._redactor.streamed(self._clean("".join(self._parts)))  # once per edit, not per piece
                pause = await self._show(text) if text and text != self.shown else 0.0
                self._shown_version = version
                await _first(self._closing, timeout=max(self._interval_s, pause))
        except asyncio.CancelledError:
            raise
        except Exception:  # the preview is cosmetic; the final text goes through the outbox
            log.exception("streaming preview failed in %s", self._turn.chat.key)
            self._dead = True

    async def _show(self, text: str) -> float:
        """Send or edit the preview; returns the extra pause the platform asked for."""
        assert self.entry is not None
        chat = self._turn.chat
        if self._still_ours is not None and not await self._still_ours():
            log.info("streaming preview in %s stopped: another worker took the conversation over", chat.key)
            self._dead = True
            return 0.0
        try:
            if self.entry.preview_id is None:
                message_id = await self._adapter.send_preview(chat, text, key=await self._key(self.entry.id))
                self.entry = await self._turn.stream_previewed(self.entry, message_id, text)
                self._on_shown()
            else:
                await self._adapter.edit_preview(chat, self.entry.preview_id, text)
        except DeliveryFailed as exc:
            if not exc.retryable:
                log.info("streaming preview in %s stopped: %s", chat.key, exc)
                self._dead = True
                return 0.0
            if exc.retry_after is None:  # skipped (another call went first): the platform asked nothing
                return self._interval_s
            pause = min(exc.retry_after, MAX_PAUSE_S)  # a 429: the latest text goes once it is over
            self._quiet_until = asyncio.get_running_loop().time() + pause
            return pause
        self.shown = text
        return 0.0

    async def _stop(self) -> None:
        self._closing.set()
        if self._task is None:
            return
        try:
            await asyncio.wait_for(asyncio.shield(self._task), CLOSE_WAIT_S)
        except TimeoutError:  # a platform call that hangs: give up on it
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def take(self) -> OutboxEntry | None:
        """Stop previewing; the row (with the preview's message id) for ``Turn.speak``,
        ``None`` when nothing was opened. After a 429 it returns once the platform's
        ``retry_after`` is over, so the final edit does not land inside the flood window."""
        await self._stop()
        quiet = self._quiet_until - asyncio.get_running_loop().time()
        if quiet > 0:
            await asyncio.sleep(quiet)
        return self.entry

    async def pause(self) -> None:
        """Stop previewing and leave the row open (an outage, a shutdown): the turn's next
        stream, after the retry or the restart, takes it over."""
        await self._stop()
        if self.entry is not None:
            if self.shown and self.entry.preview_id is not None:
                with contextlib.suppress(Exception):  # what is on screen, for a /stop meanwhile
                    await self._turn.stream_previewed(self.entry, self.entry.preview_id, self.shown)
            self._turn.release_stream(self.entry)

    async def withdraw(self) -> None:
        """No ``say`` takes this text: delete the preview, then close the row (in that order:
        a crash in between leaves an open row, whose message the next stream takes over)."""
        await self._stop()
        if self.entry is None:
            return
        if self.entry.preview_id is not None:
            try:
                await self._adapter.delete_message(self._turn.chat, self.entry.preview_id)
            except Exception as exc:  # gone already, or too old to delete: it stays
                log.info("could not delete a withdrawn preview in %s: %s", self._turn.chat.key, exc)
        await self._turn.settle_stream(self.entry, status="failed", error="preview withdrawn")

    async def keep(self) -> str:
        """``/stop``: what is shown stays as it is; returns that text (``""``: nothing shown)."""
        await self._stop()
        if self.entry is None:
            return ""
        if self.entry.preview_id is None or not self.shown:
            await self._turn.settle_stream(self.entry, status="failed", error="stopped before it was shown")
            return ""
        with contextlib.suppress(Exception):  # the Stop button goes; the text stays
            await self._adapter.edit_preview(self._turn.chat, self.entry.preview_id, self.shown, final=True)
        await self._turn.settle_stream(self.entry, status="sent", text=self.shown)
        return self.shown


async def _first(*events: asyncio.Event, timeout: float | None = None) -> None:
    """Wait until one of ``events`` is set (or ``timeout`` seconds pass)."""
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
