"""Delivery through the outbox: every message reaches the platform from an ``outbox`` row.

The row is written before the first send (by the turn, together with the assistant message
that shows it, or by :meth:`Delivery.send` for messages outside a turn). The text is split by
the adapter and sent chunk by chunk; the platform ids of sent chunks are recorded, so a retry
resumes after the last sent chunk and never repeats one. A row whose text was streamed has a
``preview_id``: its first chunk is an edit of that message (``Adapter.finish_preview``), not a
new one (``bumblebot/delivery/preview.py``). Each chunk carries an idempotency key
(``<database id>-<outbox id>.<chunk>``, the database id being random per data directory):
platforms that honour one (Discord's ``nonce`` with
``enforce_nonce``) drop a repeat sent after a crash. Transient failures are retried here (the
only retry loop for sends) with exponential backoff or the platform's ``retry_after``; a
message that still fails stays ``pending`` and the sweeper retries it later (and at start-up).
A permanent refusal marks it ``failed``.

A row with an ``attachment`` sends a file as well: a ``photo`` or ``document``
(the ``send_file`` tool) goes as one message with the text as its caption, or after the text
when the text is longer than the platform's caption limit; a ``voice`` (``voice.reply:
mirror``) goes after the text's chunks, its speech made on the first attempt and kept as
``<data_dir>/media/voice/voice-<outbox id>-<token>.ogg`` (recorded in the row), so a retry
sends the same file and never makes it twice; it is deleted once sent. A file of the
``send_file`` tool is sent from the copy :meth:`Delivery.stage` made when it was queued
(``bumblebot/delivery/staging.py``), deleted once sent too. The file is the row's last part
and counts in ``platform_message_ids`` like a chunk.

No configured secret reaches a chat: a row's text, caption, file name and the words of its
voice are redacted before they are sent (:attr:`Delivery.redactor`, the store's too, so a row
read back after a restart splits into the same chunks), and so are the streamed previews
(``LivePreview``) and the commands' answers (``Engine.command``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import secrets
import stat
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bumblebot.core.adapter import Adapter, FileKind, Typing
from bumblebot.core.errors import STORE_FAILURES, DeliveryFailed, LeaseLost, MediaError
from bumblebot.core.events import ChatRef, Platform
from bumblebot.core.metrics import NO_METRICS, Metrics
from bumblebot.core.redaction import NO_SECRETS, Redactor
from bumblebot.core.toolkit import DeliveryReport
from bumblebot.core.usage import current_scope, scoped
from bumblebot.delivery.staging import OUTGOING, StagingError, delete_unwanted, stage_file
from bumblebot.llm.speech import Speech
from bumblebot.store import OutboxEntry, Store
from bumblebot.store.connection import FENCE, Fence

log = logging.getLogger(__name__)

#: Longest platform-requested wait honoured inline, seconds; longer ones leave the row pending.
MAX_INLINE_WAIT_S = 30.0
#: Seconds before a row sent but not recorded as sent (the database failed) is recorded again.
RECORD_RETRY_S = 1.0
#: Seconds before a row left pending with no wait named by the platform (it kept failing) is
#: tried again, its chat's later rows waiting behind it in order (instead of the next sweep,
#: which newer rows would go ahead of).
WAITING_RETRY_S = 10.0
#: Deliveries (the first, then sweeps 30 s apart) a voice reply is tried for while the speech
#: service is down, before it is given up (its text went out at the first).
VOICE_SWEEPS = 2


@dataclass(frozen=True, slots=True)
class _File:
    """The file part of an outbox row."""

    kind: FileKind
    caption: str


class Delivery:
    """Sends outbox messages through the registered adapters.

    Args:
        store: the database.
        attempts: send attempts per message before leaving it pending.
        base_delay_s: first backoff delay, doubled per attempt, seconds.
        speech: makes the voice of a row whose attachment is a ``voice`` (``None``: such rows
            are sent as text only).
        media_dir: ``<data_dir>/media``: where voice replies are kept.
        metrics: counts each delivery's outcome (``bumblebot_deliveries_total``: sent,
            failed, queued); default: not counted.
        redactor: the secrets no chat may see (default: none).
    """

    def __init__(
        self, store: Store, *, attempts: int = 3, base_delay_s: float = 0.5, speech: Speech | None = None,
        media_dir: Path | None = None, metrics: Metrics | None = None, redactor: Redactor = NO_SECRETS,
    ) -> None:
        self.store = store
        #: what no chat may see: applied to every row sent, every preview, every command's answer
        self.redactor = redactor
        self._metrics = NO_METRICS if metrics is None else metrics  # metrics hook
        self._speech = speech
        self._media_dir = media_dir
        self.attempts = attempts
        self.base_delay_s = base_delay_s
        self._adapters: dict[Platform, Adapter] = {}
        self._lock = asyncio.Lock()
        self._in_flight: set[int] = set()
        #: a worker of a cluster: the fence of each conversation it holds (``None`` for the
        #: others, whose rows the sweep leaves to their worker); ``None``: every row is ours
        self.fence_of: Callable[[str], Fence | None] | None = None
        #: chunks sent whose recording failed, by outbox row (:meth:`_sent_so_far`)
        self._sent: dict[int, list[str]] = {}
        #: the rows being sent now, by the task sending each (:meth:`_deliver_now`)
        self._sending: dict[int, asyncio.Future[DeliveryReport]] = {}
        self._sending_to: dict[int, str] = {}  # their chats
        self._sending_under: dict[int, Fence | None] = {}  # the hold each was started under
        self._prefix: str | None = None
        #: messages :meth:`post` is delivering, and the last one per chat
        self.posting: set[asyncio.Task[None]] = set()
        self._posted: dict[str, asyncio.Task[None]] = {}
        #: per chat: rows the platform asked to wait longer than MAX_INLINE_WAIT_S for, and
        #: the loop time the wait ends (:meth:`_later`)
        self._waiting: dict[str, set[int]] = {}
        self._waiting_until: dict[str, float] = {}
        self._timers: dict[str, asyncio.TimerHandle] = {}
        #: the sends and retries under way (the engine lets them finish before it stops)
        self.retrying: set[asyncio.Future[Any]] = set()
        self._closed = False

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
        ``None`` when it cannot (not connected, or a platform without streamed messages) or
        must not now (rows wait there for the platform: a preview would go ahead of them)."""
        if chat.key in self._waiting:
            return None
        adapter = self._adapters.get(chat.platform)
        interval = adapter.stream_interval_s(chat) if adapter is not None else None
        return None if adapter is None or interval is None else (adapter, interval)

    def upload_limit(self, chat: ChatRef, kind: FileKind) -> int | None:
        """The largest file ``chat`` takes as ``kind``, bytes; ``None`` when it takes none (or
        its platform is not connected)."""
        adapter = self._adapters.get(chat.platform)
        return None if adapter is None else adapter.max_upload_bytes(chat, kind)

    async def preview_key(self, outbox_id: int) -> str:
        """The idempotency key of the preview send of outbox row ``outbox_id``."""
        if self._prefix is None:
            self._prefix = await self.store.instance_id()
        return f"{self._prefix}-{outbox_id}.p"

    async def send(self, conversation_id: int, chat: ChatRef, text: str) -> DeliveryReport:
        """Record ``text`` (outside any turn: a command's answer, a refusal) and deliver it."""
        return await self.deliver(await self.store.outbox_add(conversation_id, None, chat, text))

    async def post(self, conversation_id: int, chat: ChatRef, text: str) -> OutboxEntry:
        """Record ``text`` (outside any turn) and deliver it in the background, after what was
        posted to the same chat before it (order kept); returns the row once it is written.

        For the callers that must not wait for the platform's pace: an adapter's intake
        answering a command (20 commands in a second from one chat would hold every
        other chat's next Telegram update for 20 s). The row counts as being sent from the
        start, so the sweeper never sends it alongside; a crash before it is out leaves it
        pending for the sweeper of the next start. :attr:`posting` holds the tasks."""
        entry = await self.store.outbox_add(conversation_id, None, chat, text)
        self._in_flight.add(entry.id)
        before = self._posted.get(chat.key)

        async def deliver() -> None:
            try:
                if before is not None:
                    await asyncio.wait([before])  # in order; how the one before went does not matter
                await self.deliver(entry)
            finally:
                self._in_flight.discard(entry.id)

        task = asyncio.create_task(deliver(), name=f"bumblebot:{chat.key}:post")
        self._posted[chat.key] = task
        self.posting.add(task)

        def done(finished: asyncio.Task[None]) -> None:
            self.posting.discard(finished)
            if self._posted.get(chat.key) is finished:
                del self._posted[chat.key]
            if not finished.cancelled() and finished.exception() is not None:
                log.error("message to %s not delivered: %r; the sweeper retries it", chat.key, finished.exception())

        task.add_done_callback(done)
        return entry

    async def deliver(self, entry: OutboxEntry, attempts: int | None = None) -> DeliveryReport:
        """Send an outbox row now, with retries; the row records every outcome.

        While the platform has the chat waiting longer than :data:`MAX_INLINE_WAIT_S` (a long
        429, a full group window) with rows left ``pending``, a newer row for that chat waits
        with them (``queued``): they all go, in order, as the wait ends (:meth:`_later`), so
        a reply never overtakes the rest of an earlier one."""
        key = entry.chat.key
        if key in self._waiting and entry.id not in self._waiting[key]:
            self._waiting[key].add(entry.id)
            return DeliveryReport(delivered=False, queued=True, error="the chat is rate limited; sent in order after it")
        return await self._deliver_now(entry, attempts or self.attempts)

    def _shown(self, entry: OutboxEntry) -> OutboxEntry:
        """``entry`` as its chat may see it: its text (the caption, the voice's words) and its
        file's name redacted."""
        if not self.redactor:
            return entry
        attachment = entry.attachment
        if attachment and attachment.get("name"):
            attachment = {**attachment, "name": self.redactor(attachment["name"])}
        return dataclasses.replace(entry, text=self.redactor.shown(entry.text), attachment=attachment)

    async def _attempts(self, entry: OutboxEntry, attempts: int) -> DeliveryReport:
        entry = self._shown(entry)
        adapter = self._adapters.get(entry.chat.platform)
        if adapter is None:
            await self.store.outbox_progress(
                entry.id, status="pending", message_ids=entry.platform_message_ids, error="adapter not running"
            )
            return DeliveryReport(delivered=False, queued=True, error="platform not connected")
        if self._prefix is None:
            self._prefix = await self.store.instance_id()
        try:
            chunks = self._parts(adapter, entry)
        except Exception as exc:  # a bug in splitting must not be retried for ever
            log.exception("cannot split outbox message %s for %s", entry.id, entry.chat.key)
            error = f"cannot split the message: {type(exc).__name__}"
            await self.store.outbox_progress(entry.id, status="failed", message_ids=entry.platform_message_ids, error=error)
            return DeliveryReport(delivered=False, error=error)
        if not chunks:  # Markdown that renders to nothing (an HTML comment): no message to send
            error = "nothing to show: the text renders to an empty message"
            if entry.preview_id is not None:  # its streamed preview showed the raw text: take it down
                with contextlib.suppress(Exception):
                    await adapter.delete_message(entry.chat, entry.preview_id)
            await self.store.outbox_progress(entry.id, status="failed", message_ids=entry.platform_message_ids, error=error)
            return DeliveryReport(delivered=False, error=error)
        sent = self._sent_so_far(entry)
        error = ""
        wait_s: float | None = None  # the platform's wait, when longer than can be waited here
        retry_after: float | None = None  # the last wait the platform asked for
        for attempt in range(attempts):
            try:
                for index in range(len(sent), len(chunks)):
                    await self._still_ours(entry)
                    key = f"{self._prefix}-{entry.id}.{index}"
                    part = chunks[index]
                    if isinstance(part, _File):
                        sent.append(await self._send_file(adapter, entry, part, key))
                    elif index == 0 and entry.preview_id is not None:  # the streamed preview becomes it
                        sent.append(await adapter.finish_preview(entry.chat, entry.preview_id, chunks[0], key=key))
                    else:
                        sent.append(await adapter.send_chunk(entry.chat, chunks[index], key=key))
                    if len(chunks) > 1:  # a crash mid-message must not resend earlier chunks
                        await self.store.outbox_chunks_sent(entry.id, sent)
            except DeliveryFailed as exc:
                error = str(exc)
                if not exc.retryable and isinstance(chunks[len(sent)], _File) and chunks[len(sent)].kind == "voice":
                    # the words are out; a voice that cannot be made or sent does not undo them
                    log.warning("voice reply to %s not sent: %s", entry.chat.key, error)
                    await self.store.outbox_progress(entry.id, status="sent", message_ids=sent, error=error)
                    return DeliveryReport(delivered=True)
                if not exc.retryable:
                    log.warning("delivery to %s refused: %s", entry.chat.key, error)
                    await self.store.outbox_progress(entry.id, status="failed", message_ids=sent, error=error)
                    self._drop_staged(entry)
                    return DeliveryReport(delivered=False, error=error, chat_unreachable=exc.chat_unreachable)
                retry_after = exc.retry_after
                if exc.retry_after is not None and exc.retry_after > MAX_INLINE_WAIT_S:
                    wait_s = exc.retry_after
                    break
                if attempt + 1 < attempts:
                    delay = exc.retry_after if exc.retry_after is not None else self.base_delay_s * 2**attempt
                    await asyncio.sleep(delay)
                continue
            await self.store.outbox_progress(entry.id, status="sent", message_ids=sent)
            self._drop_staged(entry)  # only now: a crash before the row says "sent" must find it
            return DeliveryReport(delivered=True)
        rest = chunks[len(sent):]
        if len(rest) == 1 and isinstance(rest[0], _File) and rest[0].kind == "voice" and entry.attempts >= VOICE_SWEEPS:
            # the words are out and the speech service stays down: a voice reply hours later
            # would answer a conversation that has moved on
            log.warning("voice reply to %s given up after %d tries: %s", entry.chat.key, entry.attempts + 1, error)
            await self.store.outbox_progress(entry.id, status="sent", message_ids=sent, error=error)
            return DeliveryReport(delivered=True)
        log.warning("delivery to %s failed for now, will retry: %s", entry.chat.key, error)
        await self.store.outbox_progress(entry.id, status="pending", message_ids=sent, error=error)
        if wait_s is not None or retry_after is not None:
            # rate limited (a long 429, or the last of a few short ones): its chat waits with
            # it, so no later row overtakes it, and it is tried again as the wait ends; other
            # failures (the platform unreachable) are the sweeper's, every 30 s
            self._later(entry, wait_s if wait_s is not None else retry_after or WAITING_RETRY_S)
        return DeliveryReport(delivered=False, queued=True, error=error)

    def _later(self, entry: OutboxEntry, wait_s: float) -> None:
        """``entry`` waits ``wait_s`` seconds for the platform: it is tried again as that ends
        (not at the next sweep, after newer messages went out), with the rows of its chat that
        came meanwhile, in order."""
        key = entry.chat.key
        loop = asyncio.get_running_loop()
        self._waiting.setdefault(key, set()).add(entry.id)
        until = loop.time() + wait_s
        if until <= self._waiting_until.get(key, 0.0):
            return  # a timer for a later end is already set
        self._waiting_until[key] = until

        def fire() -> None:
            self._timers.pop(key, None)
            if self._waiting_until.get(key) != until or self._closed:
                return  # a longer wait came since: its own timer goes
            self._background(self._after_wait(key))

        old = self._timers.pop(key, None)
        if old is not None:
            old.cancel()
        self._timers[key] = loop.call_at(until, fire)

    def retry_later(self, rows: set[int]) -> None:
        """One attempt at the pending ``rows`` soon, in the background (a worker that just took
        their chat over)."""
        self._background(self.retry_pending(only=rows))

    def _background(self, work: Any) -> asyncio.Future[Any]:
        """``work`` in a task of its own, which the engine lets finish before the store closes."""
        task = asyncio.ensure_future(work)
        self.retrying.add(task)
        task.add_done_callback(self.retrying.discard)
        return task

    def busy(self, key: str) -> bool:
        """Whether a message to chat ``key`` is being sent, or waits for the platform here."""
        return key in self._waiting or key in self._posted or key in self._sending_to.values()

    def forget(self, key: str) -> None:
        """A worker of a cluster no longer holds chat ``key``: its wait and timer go (its rows
        are its new worker's, found by that worker's sweep)."""
        self._waiting.pop(key, None)
        self._waiting_until.pop(key, None)
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()

    async def _after_wait(self, key: str) -> None:
        """The chat's wait is over: its waiting rows go, oldest first (those that join meanwhile
        after them), each with the full attempts. The first one left pending stops the batch:
        it and the rest keep waiting, behind a new wait (the platform's, or
        :data:`WAITING_RETRY_S`), so nothing overtakes it. Not under the sweeper's lock: other
        chats never wait for this one's pace."""
        if self.fence_of is not None and self.fence_of(key) is None:
            self.forget(key)  # taken over meanwhile: its new worker sends them
            return
        token = FENCE.set(self.fence_of(key) if self.fence_of is not None else FENCE.get())
        try:
            await self._send_after_wait(key)
        except LeaseLost:
            self.forget(key)
        finally:
            FENCE.reset(token)

    async def _send_after_wait(self, key: str) -> None:
        loop = asyncio.get_running_loop()
        while ids := self._waiting.get(key):
            batch = sorted(ids)
            ids.clear()  # rows queued from now on join the set, behind this batch
            for i, row_id in enumerate(batch):
                entry = await self.store.outbox_entry(row_id)
                if entry is None or entry.status != "pending" or row_id in self._in_flight:
                    continue
                report = await self._deliver_now(entry, self.attempts)
                if report.delivered or not report.queued:
                    continue
                # still waiting: it and the rest of the batch go first when it is over
                self._waiting.setdefault(key, set()).update(batch[i:])
                if self._waiting_until.get(key, 0.0) <= loop.time():
                    self._later(entry, WAITING_RETRY_S)
                return
        self._waiting.pop(key, None)
        self._waiting_until.pop(key, None)

    async def close(self, timeout: float = 10.0) -> None:
        """Stop the waits' timers and let a retry in progress finish (at most ``timeout``
        seconds), before the store closes; the rows still waiting stay ``pending`` for the
        sweeper of the next start."""
        self._closed = True
        for handle in self._timers.values():
            handle.cancel()
        self._timers.clear()
        if self.retrying:
            _, late = await asyncio.wait(list(self.retrying), timeout=timeout)
            for task in late:
                task.cancel()

    @staticmethod
    def _parts(adapter: Adapter, entry: OutboxEntry) -> list[Any]:
        """What a row sends, in order: text chunks, then its file if it has one."""
        attachment = entry.attachment
        if not attachment:
            return list(adapter.chunks(entry.text))
        kind: FileKind = attachment["kind"]
        if kind == "voice":
            return [*adapter.chunks(entry.text), _File("voice", "")]
        text = entry.text.strip()
        if adapter.caption_fits(text):
            return [_File(kind, text)]
        return [*adapter.chunks(text), _File(kind, "")]

    async def _send_file(self, adapter: Adapter, entry: OutboxEntry, part: _File, key: str) -> str:
        attachment = dict(entry.attachment or {})
        path = str(self._file(attachment.get("path"))) if attachment.get("path") else None
        if part.kind == "voice" and not path:
            voice = await self._voice(entry)
            path = str(voice)
            attachment["path"] = self.stored_path(voice)
            await self.store.outbox_set_attachment(entry.id, attachment)
        try:
            found = os.lstat(path).st_mode if path else 0
        except OSError:
            found = 0
        if not found:
            raise DeliveryFailed(f"the file to send is gone: {path}", retryable=False)
        if not stat.S_ISREG(found):  # a named pipe or a symlink put in its place: not opened
            raise DeliveryFailed(f"the file to send is no longer a regular file: {Path(path).name}", retryable=False)
        name = self.redactor(attachment.get("name") or Path(path).name)
        sent = await adapter.send_file(entry.chat, Path(path), kind=part.kind, caption=part.caption, key=key, name=name)
        if part.kind == "voice":  # made for this row alone: not kept once it is out
            with contextlib.suppress(OSError):
                Path(path).unlink()
        return sent

    async def stage(self, path: Path, max_bytes: int) -> Path:
        """A copy of the workspace file ``path`` (resolved and checked by the tool) to queue
        instead of it, so what is sent is what was checked, at every attempt.

        Raises:
            StagingError: the file is no longer that regular file, or larger than ``max_bytes``
                (it is not copied then).
            OSError: the copy could not be written.
        """
        if self._media_dir is None:
            raise StagingError("files cannot be sent here (no media directory)")
        return await asyncio.to_thread(stage_file, path, self._media_dir / OUTGOING, max_bytes)

    async def sweep_staged(self) -> int:
        """At start: delete the copies no pending row will send (a row refused or expired, a
        crash between the copy and its row). Returns how many were deleted."""
        if self._media_dir is None:
            return 0
        pending = [(e.attachment or {}).get("path") for e in await self.store.outbox_pending()]
        wanted = {str(self._file(path)) for path in pending if path}
        return await asyncio.to_thread(delete_unwanted, self._media_dir / OUTGOING, wanted)

    def stored_path(self, path: Path) -> str:
        """How a row records a file of the media directory: relative to it. The store redacts
        every text it keeps, and a configured value that happens to be part of the data
        directory's path would otherwise break the path of every file waiting to be sent."""
        if self._media_dir is not None and path.is_relative_to(self._media_dir):
            return path.relative_to(self._media_dir).as_posix()
        return str(path)

    def _file(self, stored: str) -> Path:
        """The file a row records (:meth:`stored_path`)."""
        path = Path(stored)
        return path if path.is_absolute() or self._media_dir is None else self._media_dir / path

    def _staged(self, path: Path) -> bool:
        return self._media_dir is not None and path.parent == self._media_dir / OUTGOING

    def _drop_staged(self, entry: OutboxEntry) -> None:
        """The copy a row that will never be sent was to send: not kept."""
        stored = (entry.attachment or {}).get("path")
        if stored and self._staged(path := self._file(stored)):
            with contextlib.suppress(OSError):
                path.unlink()

    async def _voice(self, entry: OutboxEntry) -> Path:
        """The speech of a row's text, made once: its file (named for this row and a random
        token, so a reused outbox id never finds an old one) is recorded before it is sent."""
        if self._speech is None or self._media_dir is None:
            raise DeliveryFailed("no speech service is configured", retryable=False)
        dest = self._media_dir / "voice" / f"voice-{entry.id}-{secrets.token_hex(6)}.ogg"
        try:
            # counted for the turn that said it; sent again by the sweeper: for its chat
            with scoped(conversation=current_scope().conversation or entry.chat.key):
                return await self._speech.synthesize(entry.text, dest)
        except MediaError as exc:
            raise DeliveryFailed(f"the voice reply could not be made: {exc}", retryable=exc.retryable) from exc

    async def retry_pending(self, only: set[int] | None = None) -> int:
        """One attempt at every pending outbox message, oldest first (or those of ``only``, row
        ids), never at one being sent meanwhile; rows of a chat the platform has waiting are
        left to the end of that wait. Returns how many were delivered."""
        delivered = 0
        async with self._lock:
            rows = None if only is None else [  # those rows alone, as outbox_pending lists them
                r for i in sorted(only) if (r := await self.store.outbox_entry(i)) and r.status == "pending" and not r.streaming]
            for listed in rows if rows is not None else await self.store.outbox_pending():
                if listed.chat.platform not in self._adapters or listed.id in self._in_flight:
                    continue
                if listed.chat.key in self._waiting:
                    continue  # goes, in order, when the platform's wait is over
                fence = self.fence_of(listed.chat.key) if self.fence_of is not None else None
                if self.fence_of is not None and fence is None:
                    continue  # another worker's conversation: its worker sends it
                token = FENCE.set(fence)
                try:
                    entry = await self.store.outbox_entry(listed.id)  # the list may be stale by now
                    if entry is None or entry.status != "pending" or entry.id in self._in_flight:
                        continue
                    report = await self.deliver(entry, 1)
                    delivered += int(report.delivered)
                    if report.delivered:
                        log.info("outbox row %d to %s sent on a retry", entry.id, entry.chat.key)
                except LeaseLost:
                    continue  # taken over meanwhile: its new worker sends it
                finally:
                    FENCE.reset(token)
        return delivered

    def _sent_so_far(self, entry: OutboxEntry) -> list[str]:
        """The message ids of ``entry``'s chunks sent so far: as recorded, or as this process
        sent them when recording that failed (the database was unreachable just after a
        send), so that no chunk is sent twice. The list grows as chunks go out."""
        known = self._sent.get(entry.id)
        if known is None or len(known) < len(entry.platform_message_ids):
            known = self._sent[entry.id] = list(entry.platform_message_ids)
        return known

    async def _still_ours(self, entry: OutboxEntry) -> None:
        """No send for a conversation another worker took over (its new worker sends the row),
        nor under a hold this worker no longer has (a send that outlived its dropped actor)."""
        fence = FENCE.get()
        if fence is not None and self.fence_of is not None and self.fence_of(entry.chat.key) != fence:
            raise LeaseLost(f"{entry.chat.key} is no longer held with this send's token; outbox row {entry.id} waits")
        if not await self.store.holds_fence():
            raise LeaseLost(f"{entry.chat.key} was taken over; outbox row {entry.id} is its new worker's")

    async def _deliver_now(self, entry: OutboxEntry, attempts: int) -> DeliveryReport:
        """Send ``entry`` now (never behind its chat's wait), with ``attempts``, in a task of its
        own that the caller's cancellation (``/stop``, a dropped chat) does not stop: a request
        that had left would reach the chat unrecorded and be sent again. A row being sent is
        not sent twice: a second caller under the same hold gets the first send's report."""
        sending = self._sending.get(entry.id)
        while sending is not None and self._sending_under.get(entry.id) != FENCE.get():
            # started under an earlier hold of the chat: it ends at its next check; then this
            # one sends what it left, from the row as recorded
            await asyncio.wait([sending])
            fresh = await self.store.outbox_entry(entry.id)
            if fresh is None or fresh.status != "pending":
                if not sending.cancelled() and sending.exception() is None:
                    return sending.result()  # its report, details and all
                return DeliveryReport(delivered=fresh is not None and fresh.status == "sent",
                                      error=None if fresh is None else fresh.last_error)
            entry, sending = fresh, self._sending.get(entry.id)
        if sending is None:
            sending = self._sending[entry.id] = self._background(self._send_now(entry, attempts))
            self._sending_to[entry.id], self._sending_under[entry.id] = entry.chat.key, FENCE.get()

            def done(task: asyncio.Future[DeliveryReport]) -> None:
                if self._sending.get(entry.id) is task:
                    del self._sending[entry.id], self._sending_to[entry.id], self._sending_under[entry.id]
                failure = None if task.cancelled() else task.exception()  # retrieved: callers left get it too
                if failure is not None and not isinstance(failure, LeaseLost):
                    log.warning("outbox row %d to %s not sent: %r; the sweeper retries it", entry.id, entry.chat.key, failure)

            sending.add_done_callback(done)
        return await asyncio.shield(sending)

    async def _send_now(self, entry: OutboxEntry, attempts: int) -> DeliveryReport:
        self._in_flight.add(entry.id)
        try:
            report = await self._attempts(entry, attempts)
        except STORE_FAILURES as exc:
            if self._sent.get(entry.id) and not isinstance(exc, LeaseLost):  # out, not recorded: recorded soon
                self._later(entry, RECORD_RETRY_S)
            raise
        finally:
            self._in_flight.discard(entry.id)
        self._sent.pop(entry.id, None)  # recorded: the row says what went out
        # metrics hook: one outcome per delivery (its inline retries included)
        self._metrics.delivery("sent" if report.delivered else "queued" if report.queued else "failed")
        return report

