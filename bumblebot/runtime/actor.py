"""One actor per conversation: turns in a conversation run strictly one at a time.

Messages that arrive within ``cognition.debounce_s`` of each other are one turn (a long paste
the client cut into parts is one input); a lone message's turn starts at once. Messages that arrive while a turn runs wait in the
conversation's inbox; in ``steer`` mode the
running turn takes them at its next step boundary, otherwise the next turn takes them all at
once (several waiting messages merge into one turn). A turn the last process left running is
resumed before anything else. A turn suspended by a model outage is retried after its backoff;
new messages wait for it (in ``steer`` mode it takes them when
it goes on). An actor idle for ``engine.idle_unload_s`` ends (its conversation's memory goes
with it); the next message loads the conversation again from SQLite.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable

from bumblebot.runtime.conversation import DEBOUNCE_MAX_S, PASTE_SETTLE_S, Conversation, paste_part
from bumblebot.store import JournalEntry, RunningTurn
from bumblebot.runtime.turn import Finished, Outcome, Postponed, Requeued, Suspended, TurnRunner

log = logging.getLogger(__name__)

#: Backoff after a failure under a turn, before the conversation is read back (seconds).
RECOVER_FIRST_S = 5.0
RECOVER_MAX_S = 60.0
#: A turn waiting out an outage retries within this many seconds once the endpoint answers.
EARLY_JITTER_S = 0.5
#: Seconds after the last part of a Telegram album (photos sent together arrive as separate
#: messages with one ``media_group_id``) before its turn starts, so the album is one turn.
ALBUM_SETTLE_S = 1.0
#: Longest wait for an album's parts, seconds from its first.
ALBUM_MAX_WAIT_S = 5.0


class Progress:
    """Counters of the engine's work, and a way to wait for them (tests, ``bumblebot chat``)."""

    def __init__(self) -> None:
        self.accepted = 0
        self.turns_finished = 0
        self._changed = asyncio.Condition()

    async def notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def wait_until(self, predicate: Callable[[], bool], timeout: float | None = 10.0) -> None:
        """Wait until ``predicate()`` holds; re-checked whenever a message is accepted, a turn
        or job finishes or a conversation unloads (``timeout=None``: no limit).

        Raises:
            TimeoutError: it did not hold within ``timeout`` seconds.
        """
        async with asyncio.timeout(timeout), self._changed:
            await self._changed.wait_for(predicate)


class ConversationActor:
    """Serialises the turns of one conversation. Created and owned by the engine.

    Args:
        conversation: the conversation (its state and inbox).
        runner: runs, resumes and retries turns.
        ready: set once the adapters are connected; no turn runs before.
        idle_unload_s: the actor ends after this long with nothing to do, seconds.
        progress: counts finished turns.
        debounce_s: messages from people arriving within this many seconds of each other
            merge into one turn (``cognition.debounce_s``; issue 16). A lone message's turn
            starts at once (no added latency); when the next one follows within
            ``debounce_s`` while that turn is prepared or awaits its first completion (nothing
            shown yet), the turn is asked again with it (``Conversation.burst``). Once a burst
            is on, the turn waits until ``debounce_s`` after its last message (longer after a
            part of a long paste, which is waited for from the start), at most
            :data:`DEBOUNCE_MAX_S` after the first. ``0``: every turn starts at once.
    """

    def __init__(
        self,
        conversation: Conversation,
        runner: TurnRunner,
        *,
        ready: asyncio.Event,
        idle_unload_s: float,
        progress: Progress,
        debounce_s: float = 0.0,
    ) -> None:
        self.conversation = conversation
        self._debounce_s = debounce_s
        self._burst_at = -1e9  # when the last message from a person arrived (loop time)
        self._turn_burst = -1e9  # ``_burst_since`` of the burst the running turn began with
        self._burst_since = 0.0  # when the first message waiting in the inbox arrived
        self._runner = runner
        self._ready = ready
        self._idle_unload_s = idle_unload_s
        self._progress = progress
        self._jobs: list[Callable[[], Awaitable[None]]] = []
        self._resume: list[RunningTurn] = []
        self._wake = asyncio.Event()
        self._stopping = False
        self._suspended: Suspended | None = None
        self._postponed: Postponed | None = None
        self._album_at = 0.0  # when the last album part arrived (loop time)
        self._album_since = 0.0  # when the first part of the album being waited for arrived
        self._postponed_due = 0.0
        #: after a failure under a turn (the database), seconds before it is read back and resumed
        self._recover_in: float | None = None
        self.busy = False
        #: set (synchronously) when the actor has ended: it takes nothing more
        self.closed = False
        self.task: asyncio.Task[None] | None = None

    @property
    def key(self) -> str:
        return self.conversation.key

    @property
    def queued(self) -> int:
        return len(self.conversation.inbox)

    @property
    def waiting(self) -> bool:
        """A turn waits out a model outage, or messages wait for their files (a file service is down)."""
        return self._suspended is not None or self._postponed is not None

    @property
    def working(self) -> bool:
        """A turn or job is running or queued (a turn suspended by an outage does not count)."""
        return bool(self.busy or self.conversation.inbox or self._resume or self._jobs or self._recover_in)

    def enqueue(self, entry: JournalEntry) -> None:
        inbox = self.conversation.inbox
        now = asyncio.get_running_loop().time()
        if entry.inbound.album:
            if not inbox or inbox[-1].inbound.album != entry.inbound.album:
                self._album_since = now
            self._album_at = now
        if entry.inbound.source == "chat" and self._debounce_s > 0:
            conversation = self.conversation
            continues = now <= conversation.settle_at  # within the quiet the last message asked for
            if not continues:
                self._burst_since = now
            self._burst_at = now
            quiet = max(self._debounce_s, PASTE_SETTLE_S) if paste_part(entry.inbound) else self._debounce_s
            conversation.settle_at = now + quiet
            if (continues and self.busy and not entry.inbound.album and self._burst_since == self._turn_burst
                    and now - self._burst_since < DEBOUNCE_MAX_S):
                # the turn that began with this burst is asked again with it (not for ever: a
                # chat that never stops writing gets its answer, the rest steered in as usual);
                # a burst that began after the turn did waits for its own
                conversation.burst.set()
        inbox.append(entry)
        self._wake.set()

    def queued_entry(self, message_id: str) -> JournalEntry | None:
        """The entry of ``message_id`` if it waits for a turn (in the inbox, or for its files),
        ``None`` when a turn has taken it or it is not here."""
        waiting = [*self.conversation.inbox, *(self._postponed.entries if self._postponed is not None else ())]
        return next((e for e in waiting if e.inbound.message_id == message_id and e.inbound.source == "chat"), None)

    def replace_queued(self, entry: JournalEntry) -> bool:
        """Put ``entry`` (an edited message) where the waiting entry with its id is; ``False``
        when it no longer waits."""
        inbox = self.conversation.inbox
        for i, queued in enumerate(inbox):
            if queued.id == entry.id:
                inbox[i] = entry
                return True
        if self._postponed is not None:
            for i, queued in enumerate(self._postponed.entries):
                if queued.id == entry.id:
                    self._postponed.entries[i] = entry
                    return True
        return False

    def _settle_wait(self) -> float:
        """Seconds to wait before the inbox is taken (0: take it now): for more parts of an
        album (until :data:`ALBUM_SETTLE_S` after its last part, at most
        :data:`ALBUM_MAX_WAIT_S` after its first), or for the rest of a burst of messages
        (``debounce_s`` after the last, :data:`~bumblebot.runtime.conversation.PASTE_SETTLE_S` after a
        part of a long paste, at most :data:`DEBOUNCE_MAX_S` after the first)."""
        inbox = self.conversation.inbox
        if not inbox:
            return 0.0
        last = inbox[-1].inbound
        if last.album:
            until = min(self._album_at + ALBUM_SETTLE_S, self._album_since + ALBUM_MAX_WAIT_S)
        elif last.source == "chat" and self._debounce_s > 0:
            if not paste_part(last) and self._burst_since == self._burst_at:
                return 0.0  # a lone message: its turn begins at once (and is asked again if one follows)
            # a burst is on (or a paste has begun): wait for the quiet its last message asked for
            until = min(self.conversation.settle_at, self._burst_since + DEBOUNCE_MAX_S)
        else:
            return 0.0
        return max(0.0, until - asyncio.get_running_loop().time())

    def resume(self, running: RunningTurn) -> None:
        """Continue ``running`` (left by the last process) before anything else."""
        self._resume.append(running)
        self._wake.set()

    def schedule(self, job: Callable[[], Awaitable[None]]) -> None:
        """Run ``job`` in this actor between turns (e.g. ``/compact``), never during one."""
        self._jobs.append(job)
        self._wake.set()

    def stop(self) -> None:
        """Finish the running turn, then end; waiting entries stay pending in the journal."""
        self._stopping = True
        self._wake.set()

    async def run(self) -> None:
        """The actor's task: resume, run turns and jobs, retry a suspended turn, unload when idle."""
        await self._ready.wait()
        conversation = self.conversation
        while not self._stopping:
            if self._recover_in is not None:
                if await self._sleep(self._recover_in):
                    return
                await self._recover()
            elif self._suspended is not None:
                suspended = self._suspended
                if await self._sleep(suspended.retry_in, early=suspended.recovered, stop=suspended.turn.stop):
                    return
                self._suspended = None
                await self._turn(lambda: self._runner.retry(conversation, suspended))
            elif self._resume:
                running = self._resume.pop(0)
                await self._turn(lambda: self._runner.resume(conversation, running))
            elif self._jobs:
                job = self._jobs.pop(0)
                try:
                    await job()
                except Exception:
                    log.exception("job in %s failed", self.key)
                await self._progress.notify()
            elif self._postponed is not None and self._postponed_due <= asyncio.get_running_loop().time():
                # the file service may be back: the waiting messages go first again
                conversation.requeue(self._postponed.entries)
                self._postponed = None
            elif conversation.inbox and (wait := self._settle_wait()) > 0:
                if await self._sleep(wait):  # more photos of the album, or messages, may be on their way
                    return
            elif conversation.inbox:
                conversation.burst.clear()
                self._turn_burst = self._burst_since
                await self._turn(lambda: self._runner.run(conversation, conversation.take_inbox()))
            elif self._postponed is not None:  # nothing else to do: sleep until the retry
                if await self._sleep(self._postponed_due - asyncio.get_running_loop().time()):
                    return  # the entries stay pending in the journal: the next start has them
            else:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), self._idle_unload_s)
                except TimeoutError:
                    if not self.working:
                        self.closed = True  # before any await: intake sees it at once
                        return

    async def _sleep(
        self, seconds: float, early: asyncio.Event | None = None, stop: asyncio.Event | None = None
    ) -> bool:
        """Wait ``seconds`` unless stopped, or until ``early`` is set (then after a jitter of at
        most :data:`EARLY_JITTER_S`, so waiting conversations do not all retry at once), or
        ``stop`` is (``/stop``: at once); ``True`` when the actor is stopped."""
        self._wake.clear()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while not self._stopping and loop.time() < deadline and not (stop is not None and stop.is_set()):
            if early is not None and early.is_set():
                deadline = min(deadline, loop.time() + random.uniform(0, EARLY_JITTER_S))
                early = None
                continue
            waits = [asyncio.ensure_future(self._wake.wait())]
            if early is not None:
                waits.append(asyncio.ensure_future(early.wait()))
            try:
                await asyncio.wait(waits, timeout=deadline - loop.time(), return_when=asyncio.FIRST_COMPLETED)
            finally:
                for waiter in waits:
                    waiter.cancel()
            self._wake.clear()
        return self._stopping

    def stop_turn(self) -> bool:
        """``/stop``: the running turn (or the one waiting out an outage) stops at once: its
        model call is aborted, tools still running are cancelled, what it delivered stays, and
        its history records that it was stopped (``AgentLoop``). ``False`` when there is none."""
        if self._postponed is not None and not self.busy:
            # messages waiting for a file service: they are not answered after all
            waiting, self._postponed = self._postponed, None
            self._spawned_drop = asyncio.ensure_future(self.conversation.drop(waiting.entries))
            return True
        if not (self.busy or self._suspended is not None) or not self.conversation.request_stop():
            return False
        self._wake.set()  # a suspended turn is retried now, and ends as stopped
        return True

    async def reset(self, fence: int) -> tuple[bool, int]:
        """``/reset``, journaled as ``fence``: a fence between the sessions (issue 16). The
        turn running (or waiting out an outage, or for files) is stopped as ``/stop`` does and
        finishes in the old session; messages from people that arrived before the fence and
        no turn has begun answering are set aside unanswered (they belong to the conversation
        put aside); everything after it belongs to the new session. Returns ``(a turn was
        stopped, how many messages were set aside)``."""
        stopped = self.stop_turn()
        aside = await self.conversation.reset(fence)
        await self._progress.notify()
        return stopped, len(aside)

    async def _turn(self, work: Callable[[], Awaitable[Outcome]]) -> None:
        """Run one turn (messages keep merging into the inbox meanwhile)."""
        outcome: Outcome | None = None
        self.busy = True
        try:
            outcome = await work()
        except asyncio.CancelledError:
            raise
        except Exception:
            # a write under the turn failed (the database): the turn is half-recorded and
            # nothing else may run in this conversation before it is read back and resumed
            log.exception("turn in %s could not be recorded; recovering in %.0f s", self.key, RECOVER_FIRST_S)
            self._recover_in = RECOVER_FIRST_S
        finally:
            self.busy = False
        if isinstance(outcome, Suspended):
            self._suspended = outcome
        elif isinstance(outcome, Postponed):
            # the messages wait for their files; later ones (text, other files) go on meanwhile
            if outcome.entries:
                self._postponed = outcome
                self._postponed_due = asyncio.get_running_loop().time() + outcome.retry_in
            self.conversation.requeue(outcome.ready)
        elif isinstance(outcome, Requeued):  # a burst goes on: answered with the rest of it
            self.conversation.requeue(outcome.entries)
        elif isinstance(outcome, Finished):
            self._progress.turns_finished += 1
        await self._progress.notify()

    async def _recover(self) -> None:
        """Read the conversation back from the store and resume its half-recorded turn."""
        delay = self._recover_in or RECOVER_FIRST_S
        self._recover_in = None
        try:
            running = await self.conversation.reload()
        except Exception:
            self._recover_in = min(RECOVER_MAX_S, delay * 2)
            log.exception("%s: the store is still failing; next try in %.0f s", self.key, self._recover_in)
            return
        if running is not None:
            self._resume.insert(0, running)
