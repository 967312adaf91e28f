"""One actor per conversation: turns in a conversation run strictly one at a time.

Messages that arrive while a turn runs wait in the conversation's inbox
(:mod:`bumblebot.runtime.inbox`: bursts, albums and files waiting for a service are its
business too); in ``steer`` mode the running turn takes them at its next step boundary,
otherwise the next turn takes them all at once (several waiting messages merge into one turn).
A turn the last process left running is resumed before anything else. A turn suspended by a
model outage is retried after its backoff; new messages wait for it (in ``steer`` mode it takes
them when it goes on). An actor idle for ``engine.idle_unload_s`` ends (its conversation's
memory goes with it); the next message loads the conversation again from SQLite.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable

from bumblebot.core.errors import LeaseLost
from bumblebot.core.usage import message_came
from bumblebot.runtime.conversation import Conversation
from bumblebot.runtime.outcomes import Finished, Outcome, Postponed, Requeued, Suspended
from bumblebot.runtime.runner import TurnRunner
from bumblebot.store import JournalEntry, RunningTurn
from bumblebot.store.connection import Fence

log = logging.getLogger(__name__)

#: Backoff after a failure under a turn, before the conversation is read back (seconds).
RECOVER_FIRST_S = 5.0
RECOVER_MAX_S = 60.0
#: A turn waiting out an outage retries within this many seconds once the endpoint answers.
EARLY_JITTER_S = 0.5


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
    """

    def __init__(
        self,
        conversation: Conversation,
        runner: TurnRunner,
        *,
        ready: asyncio.Event,
        idle_unload_s: float,
        progress: Progress,
    ) -> None:
        self.conversation = conversation
        self.inbox = conversation.inbox
        self._runner = runner
        self._ready = ready
        self._idle_unload_s = idle_unload_s
        self._progress = progress
        #: jobs to run between turns, each with whether it settles a write the chat was
        #: promised (then it runs even when the actor stops first)
        self._jobs: list[tuple[Callable[[], Awaitable[None]], bool]] = []
        self._resume: list[RunningTurn] = []
        self._wake = asyncio.Event()
        #: the last turn finished: compact between turns if it left the conversation over the
        #: threshold; ``_interrupt`` (a message, /stop, /reset) stops that compaction before its
        #: next model call, ``_stopped`` (the actor's end) abandons it
        self._compact_due = False
        self._compacting = False
        self._interrupt = asyncio.Event()
        self._stopped = asyncio.Event()
        self._stopping = False
        self._suspended: Suspended | None = None
        self._taken: list[JournalEntry] = []  # the messages of the turn being run
        #: after a failure under a turn (the database), seconds before it is read back and resumed
        self._recover_in: float | None = None
        self.busy = False
        #: set (synchronously) when the actor has ended: it takes nothing more
        self.closed = False
        #: it ended on a lease lost (its worker lets the conversation go, to be taken again)
        self.lost = False
        #: the hold of a worker of a cluster it runs under (``None``: alone)
        self.fence: Fence | None = None
        self.task: asyncio.Task[None] | None = None

    @property
    def key(self) -> str:
        return self.conversation.key

    @property
    def queued(self) -> int:
        return len(self.inbox)

    @property
    def waiting(self) -> bool:
        """A turn waits out a model outage, or messages wait for their files (a file service is down)."""
        return self._suspended is not None or bool(self.inbox.postponed)

    @property
    def working(self) -> bool:
        """A turn or job is running or queued (a turn suspended by an outage does not count, nor
        messages waiting in a paused conversation)."""
        return bool(self.busy or self._takes or self._resume or self._jobs or self._recover_in)

    @property
    def compacting(self) -> bool:
        """A compaction between turns is due or running (not :attr:`working`: nobody waits
        for it, and a message stops it)."""
        return self._compact_due or self._compacting

    @property
    def _takes(self) -> bool:
        """Messages wait and the next turn may take them (the conversation is not paused)."""
        return bool(self.inbox) and not self.conversation.paused

    def set_paused(self, paused: bool) -> None:
        """The operator paused (or resumed) the conversation: while paused, messages wait in
        the inbox and no turn takes them; the turn running now finishes."""
        self.conversation.paused = paused
        self._wake.set()

    def enqueue(self, entry: JournalEntry) -> None:
        self.inbox.add(entry, busy=self.busy)
        if self.busy and entry.inbound.source == "chat" and not entry.inbound.album:
            message_came(self.key)  # the running turn takes it in at its next step: urgent now
        self._interrupt.set()
        self._wake.set()

    def queued_entry(self, message_id: str) -> JournalEntry | None:
        """The entry of ``message_id`` if it waits for a turn (in the inbox, or for its files),
        ``None`` when a turn has taken it or it is not here."""
        return self.inbox.find(message_id)

    def replace_queued(self, entry: JournalEntry) -> bool:
        """Put ``entry`` (an edited message) where the waiting entry with its id is; ``False``
        when it no longer waits."""
        return self.inbox.replace(entry)

    def resume(self, running: RunningTurn) -> None:
        """Continue ``running`` (left by the last process) before anything else."""
        self._resume.append(running)
        self._wake.set()

    def schedule(self, job: Callable[[], Awaitable[None]], *, settles: bool = False) -> None:
        """Run ``job`` in this actor between turns (e.g. ``/compact``), never during one;
        ``settles``: a write the chat was promised, run even if the actor stops before it."""
        self._jobs.append((job, settles))
        self._wake.set()

    def stop(self) -> None:
        """Finish the running turn, then end; waiting entries stay pending in the journal."""
        self._stopping = True
        self._interrupt.set()
        self._stopped.set()
        self._wake.set()

    async def run(self) -> None:
        """The actor's task: resume, run turns and jobs, retry a suspended turn, unload when idle."""
        await self._ready.wait()
        await self._serve()
        if self._stopping:  # writes promised before the stop still settle (a /stop's drop)
            for job, settles in self._jobs:
                if settles:
                    await self._job(job)

    async def _job(self, job: Callable[[], Awaitable[None]]) -> None:
        try:
            await job()
        except Exception:
            log.exception("job in %s failed", self.key)
        await self._progress.notify()

    async def _serve(self) -> None:
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
                await self._turn(lambda: self._runner.resume(conversation, running), running.entries)
            elif self._jobs:
                await self._job(self._jobs[0][0])
                del self._jobs[0]  # only now: the actor counts as working while its job runs
            elif self._compact_due and not self._takes:
                await self._compact_idle()
            elif self.inbox.postponed_ready():
                self.inbox.release_postponed()  # the file service may be back: they go first again
            elif self._takes and (wait := self.inbox.settle_wait()) > 0:
                if await self._sleep(wait):  # more photos of the album, or messages, may be on their way
                    return
            elif self._takes:
                taken = self.inbox.take()
                await self._turn(lambda: self._runner.run(conversation, taken), taken)
            elif self.inbox.postponed:  # nothing else to do: sleep until the retry, or new work
                if await self._sleep(self.inbox.postponed_due - asyncio.get_running_loop().time(), woken=True):
                    return  # the entries stay pending in the journal: the next start has them
            else:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), self._idle_unload_s)
                except TimeoutError:
                    if not self.working and not self.inbox:  # a paused one's messages keep it loaded
                        self.closed = True  # before any await: intake sees it at once
                        return

    async def _compact_idle(self) -> None:
        """Compact between turns (docs/compaction.md, "When compaction triggers"); a message
        that comes meanwhile stops it before its next model call; a stop of the actor abandons
        it at once (nobody waits for it, and the store rolls back a write it cuts)."""
        self._compact_due, self._compacting = False, True
        self._interrupt.clear()
        work = asyncio.ensure_future(self._job(lambda: self._runner.compact_idle(self.conversation, self._interrupt)))
        stopped = asyncio.ensure_future(self._stopped.wait())
        try:
            await asyncio.wait({work, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
            if not work.done():
                work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            self._compacting = False
        await self._progress.notify()  # now that it is over (the job's own notice came before)

    async def _sleep(
        self, seconds: float, early: asyncio.Event | None = None, stop: asyncio.Event | None = None, *,
        woken: bool = False,
    ) -> bool:
        """Wait ``seconds`` unless stopped, or until ``early`` is set (then after a jitter of at
        most :data:`EARLY_JITTER_S`, so waiting conversations do not all retry at once), or
        ``stop`` is (``/stop``: at once), or, with ``woken``, until new work comes (a message,
        a job); ``True`` when the actor is stopped."""
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
            if woken and self._wake.is_set():
                break
            self._wake.clear()
        return self._stopping

    def answering(self) -> set[str]:
        """The senders of the messages the work in progress answers: the turn running (or being
        prepared), the one waiting out an outage, the messages waiting for their files."""
        entries = [*self._taken, *self.inbox.postponed]
        if self.conversation.turn is not None:
            entries += self.conversation.turn.entries
        if self._suspended is not None:
            entries += self._suspended.turn.entries
        return {entry.inbound.sender_id for entry in entries}

    def stop_turn(self) -> bool:
        """``/stop``: the running turn (or the one waiting out an outage) stops at once: its
        model call is aborted, tools still running are cancelled, what it delivered stays, and
        its history records that it was stopped (``AgentLoop``). ``False`` when there is none."""
        self._interrupt.set()  # a compaction between turns stops too (nobody waits for it)
        if self.inbox.postponed and not self.busy:
            # messages waiting for a file service: they are not answered after all (settled in
            # the actor, so a stop of the engine waits for the write)
            dropped = self.inbox.drop_postponed()
            self.schedule(lambda: self.conversation.drop(dropped), settles=True)
            return True
        if not (self.busy or self._suspended is not None) or not self.conversation.request_stop():
            return False
        self._wake.set()  # a suspended turn is retried now, and ends as stopped
        return True

    async def reset(self, fence: int) -> tuple[bool, int]:
        """``/reset``, journaled as ``fence``: a fence between the sessions. The
        turn running (or waiting out an outage, or for files) is stopped as ``/stop`` does and
        finishes in the old session; messages from people that arrived before the fence and
        no turn has begun answering are set aside unanswered (they belong to the conversation
        put aside); everything after it belongs to the new session. Returns ``(a turn was
        stopped, how many messages were set aside)``."""
        stopped = self.stop_turn()
        aside = await self.conversation.reset(fence)
        await self._progress.notify()
        return stopped, len(aside)

    async def _turn(self, work: Callable[[], Awaitable[Outcome]], taken: list[JournalEntry] | None = None) -> None:
        """Run one turn of the ``taken`` messages (messages keep merging into the inbox meanwhile)."""
        outcome: Outcome | None = None
        self.busy = True
        self._taken = taken or []
        try:
            outcome = await work()
        except asyncio.CancelledError:
            raise
        except LeaseLost as exc:
            # another worker holds the conversation now and resumes the turn from what was
            # recorded: nothing more of it here
            log.warning("%s was taken over by another worker (%s); its turn goes on there", self.key, exc)
            self._stopping = True
            self.closed = self.lost = True
        except Exception:
            # a write under the turn failed (the database): the turn is half-recorded and
            # nothing else may run in this conversation before it is read back and resumed
            log.exception("turn in %s could not be recorded; recovering in %.0f s", self.key, RECOVER_FIRST_S)
            self._recover_in = RECOVER_FIRST_S
        finally:
            self.busy = False
            self._taken = []
        if isinstance(outcome, Suspended):
            self._suspended = outcome
        elif isinstance(outcome, Postponed):
            # the messages wait for their files; later ones (text, other files) go on meanwhile
            if outcome.entries:
                self.inbox.postpone(outcome.entries, outcome.retry_in)
            self.inbox.requeue(outcome.ready)
        elif isinstance(outcome, Requeued):  # a burst goes on: answered with the rest of it
            self.inbox.requeue(outcome.entries)
        elif isinstance(outcome, Finished):
            self._compact_due = True
            self._progress.turns_finished += 1
            self.inbox.requeue(outcome.rest)
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
