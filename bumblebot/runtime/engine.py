"""The engine: intake, one actor per conversation, commands, recovery and shutdown.

Flow of a message: an adapter calls :meth:`Engine.submit` (the :class:`~bumblebot.core.adapter.Intake`
interface); the message is written to the journal (for Telegram together with the next update
offset) *before* the adapter acknowledges it to the platform; a duplicate (same platform, chat
and message id) is dropped here. The entry goes to its conversation's
:class:`~bumblebot.runtime.actor.ConversationActor`, which runs turns one at a time
(:mod:`bumblebot.runtime.runner`). Replies leave through :mod:`bumblebot.delivery.outbox`.

Lifecycle: ``start()`` expires outbox rows older than ``engine.outbox_expiry_s``, recovers
(turns the last process left running are resumed from their last checkpoint, other pending
journal entries are queued again) and begins accepting; adapters start; ``mark_ready()`` lets
turns run, and with them the outbox sweeper (every 30 s: expire, then retry) and housekeeping
(retention, at once and then daily). ``stop()`` stops intake, lets in-flight turns finish
within ``engine.shutdown_grace_s``, cancels what is left (it stays recorded as running and is
resumed after the next start), then stops the sweeper and housekeeping. The store closes
last, in the daemon.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from bumblebot.cognition.knowledge import Memory
from bumblebot.cognition.prompt import PromptBuilder
from bumblebot.core.activity import NO_ACTIVITY, Activity
from bumblebot.core.events import ChatRef, Inbound, Platform, blank
from bumblebot.core.errors import LeaseLost
from bumblebot.core.metrics import NO_METRICS, Metrics
from bumblebot.core.settings import EngineSettings
from bumblebot.delivery import Delivery
from bumblebot.media import MediaIntake
from bumblebot.runtime.actor import ConversationActor, Progress
from bumblebot.runtime.commands import NOT_ANSWERED_TEXT, NOT_MANAGER_TEXT, NOTHING_TO_STOP_TEXT, EngineCommands
from bumblebot.runtime.conversation import Conversation
from bumblebot.runtime.ownership import HOUSEKEEPING_ROLE, OwnedConversations, Ownership, spawn_in
from bumblebot.runtime.runner import TurnRunner
from bumblebot.runtime.scheduler import Scheduler
from bumblebot.store import JournalEntry, Pruned, Store
from bumblebot.store.connection import FENCE

log = logging.getLogger(__name__)

OUTBOX_SWEEP_S = 30.0
#: Seconds before the automations try again after a failure (the database unreachable).
AUTOMATIONS_RETRY_S = 5.0
#: Seconds between two retention passes (the first runs as soon as the engine is ready).
HOUSEKEEPING_S = 24 * 3600.0
#: How often a worker of a cluster asks whether retention is due (one worker runs it, daily).
HOUSEKEEPING_CHECK_S = 3600.0
HOUSEKEEPING_KEY = "housekeeping.last"
DAY_S = 86400.0
REFUSED_KEY = "{platform}.refused:{user_id}"
#: Most refusals sent to strangers in :data:`REFUSAL_WINDOW_S`, all chats together: a thousand
#: strangers writing at once must not make the bot send a thousand messages (and spend its
#: platform's rate limit on them). Those left out are told when they write again.
MAX_REFUSALS = 20
REFUSAL_WINDOW_S = 60.0
__all__ = ["NOTHING_TO_STOP_TEXT", "NOT_ANSWERED_TEXT", "NOT_MANAGER_TEXT", "Engine"]


class Engine(EngineCommands, OwnedConversations):
    """The cognition engine's front: what adapters talk to (:class:`~bumblebot.core.adapter.Intake`).

    Args:
        settings: the ``engine`` section.
        store: the open database (the journal, conversations, cursors).
        runner: runs turns.
        delivery: the outbox (command answers, refusals) and its sweeper.
        prompts: the entity (greeting, name).
        memory: the conversations' facts files (moved with a chat that changes its id).
        scheduler: scheduled tasks and autonomous cycles (``None``: none run).
        metrics: samples :attr:`queue_depth` at each scrape (``bumblebot_queue_depth``);
            default: not sampled.
        media: the inboxes of the files people sent (moved with a chat that changes its id).
        debounce_s: a burst of messages within this many seconds is one turn
            (``cognition.debounce_s``; :class:`~bumblebot.runtime.actor.ConversationActor`).
        activity: the live event bus: turns' checkpoints, queued messages, the operator's
            actions (default: :data:`~bumblebot.core.activity.NO_ACTIVITY`).
        ownership: a worker of a cluster: the conversations it holds (it runs only those,
            :mod:`~bumblebot.runtime.ownership`); ``None``: alone, it runs every one.

    Commands, and the operator's actions (pause, block…), are its part
    :class:`~bumblebot.runtime.commands.EngineCommands`.
    """

    def __init__(
        self,
        settings: EngineSettings,
        store: Store,
        runner: TurnRunner,
        delivery: Delivery,
        prompts: PromptBuilder,
        memory: Memory | None = None,
        scheduler: Scheduler | None = None,
        metrics: Metrics | None = None,
        media: MediaIntake | None = None,
        debounce_s: float = 0.0,
        activity: Activity = NO_ACTIVITY,
        ownership: Ownership | None = None,
    ) -> None:
        self.settings = settings
        self.activity = activity
        self._paused: set[str] = set()
        self._blocked: set[tuple[str, str]] = set()
        self._titles: dict[str, str] = {}
        self._debounce_s = debounce_s
        self._media = media
        self._scheduler = scheduler
        self._platforms: set[Platform] | None = None
        self._memory = memory
        self._store = store
        self._ownership = ownership
        self._dispatched: dict[int, str] = {}  # a worker's: journal ids queued here, and their chat
        self._adopting: set[str] = set()  # a worker's: conversations being taken over
        self._held_back: dict[str, list[JournalEntry]] = {}  # their messages journaled meanwhile
        self._runner = runner
        self._delivery = delivery
        self._prompts = prompts
        self._ready = asyncio.Event()
        self._actors: dict[str, ConversationActor] = {}
        self._actor_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._accepting = False
        self._stopped = False
        self._refusals: collections.deque[float] = collections.deque()  # when recent refusals were sent
        self.progress = Progress()
        self._commands = self._command_handlers()
        # metrics hook: bumblebot_queue_depth reads the inboxes at each scrape
        (NO_METRICS if metrics is None else metrics).watch_queue(lambda: self.queue_depth)

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self, platforms: set[Platform] | None = None) -> None:
        """Recover from the last run and begin accepting messages.

        Args:
            platforms: the platforms this process serves; only their turns and pending journal
                entries are recovered (``bumblebot chat`` must not answer Telegram messages).
                ``None``: every platform.

        Raises:
            RuntimeError: the engine was already started.
        """
        if self._accepting or self._stopped:
            raise RuntimeError("engine already started" if self._accepting else "engine was stopped")
        self._platforms = platforms
        await self._load_operated()  # before any actor: a paused conversation stays paused
        await self.expire_outbox()  # before a resumed turn or the sweeper could send an expired row
        if self._ownership is not None:  # a worker: its conversations come as it claims them (collect)
            self._accepting = True
            self._spawn(self._every(OUTBOX_SWEEP_S, self.sweep_outbox, "outbox sweep"), "bumblebot:outbox")
            self._spawn(self._every(HOUSEKEEPING_CHECK_S, self._housekeep, "housekeeping"), "bumblebot:housekeeping")
            if self._scheduler is not None:
                self._spawn(self._automations(self._scheduler), "bumblebot:automations")
            return
        running = await self._store.running_turns(None if platforms is None else {p.value for p in platforms})
        if running:
            log.warning("%d turn(s) were cut off by the last shutdown; resuming them", len(running))
        for turn in running:
            (await self._actor(turn.conversation.chat)).resume(turn)
        resumed = {t.id for t in running}
        self._accepting = True
        for entry in await self._store.pending_inbound():
            if entry.turn_id in resumed or (platforms is not None and entry.inbound.chat.platform not in platforms):
                continue
            await self._dispatch(entry)
        self._spawn(self._every(OUTBOX_SWEEP_S, self.sweep_outbox, "outbox sweep"), "bumblebot:outbox")
        self._spawn(self._every(HOUSEKEEPING_S, self.prune, "housekeeping"), "bumblebot:housekeeping")
        if self._scheduler is not None:
            self._spawn(self._automations(self._scheduler), "bumblebot:automations")

    def mark_ready(self) -> None:
        """Adapters are connected: let turns run (resumed and recovered ones first)."""
        self._ready.set()

    async def stop(self) -> None:
        """Stop intake, let in-flight turns finish (or cancel them after the grace period)."""
        if self._stopped:
            return
        self._stopped = True
        self._accepting = False
        self._ready.set()
        actors = list(self._actors.values())
        for actor in actors:
            actor.stop()
        running = [a.task for a in actors if a.task is not None and not a.task.done()]
        running += list(self._delivery.posting) + list(self._delivery.retrying)  # messages on their way out
        if running:
            _, pending = await asyncio.wait(running, timeout=self.settings.shutdown_grace_s)
            for task in pending:
                task.cancel()
            for task in pending:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            if pending:
                log.warning("%d turn(s) did not finish in time; they resume after restart", len(pending))
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self._delivery.close()  # before the store closes: no retry may write after it

    def _spawn(self, coro: Any, name: str, context: contextvars.Context | None = None) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, **spawn_in(context, name=name))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _every(self, seconds: float, job: Callable[[], Awaitable[Any]], what: str) -> None:
        """Run ``job`` once the engine is ready and then every ``seconds``; a failure is logged
        and the next run goes ahead."""
        await self._ready.wait()
        while True:
            try:
                await job()
            except Exception:
                log.exception("%s failed", what)
            await asyncio.sleep(seconds)

    async def _automations(self, scheduler: Scheduler) -> None:
        """Once ready: fire what is due (tasks, autonomous cycles), then sleep until the next.
        Only this process's platforms fire (``bumblebot chat`` never runs a Telegram task)."""
        await self._ready.wait()
        while True:
            try:
                await self.run_automations()
                await scheduler.wait(self._platforms)
            except Exception:  # the database, say: a due task fires once it answers again
                log.exception("automations failed; trying again shortly")
                await asyncio.sleep(AUTOMATIONS_RETRY_S)

    async def run_automations(self) -> int:
        """Fire every task due now and start the autonomous turns of this interval slot;
        returns how many turns were queued."""
        if self._scheduler is None or not self._accepting:
            return 0
        queued = 0
        for entry in await self._scheduler.fire_due(self._platforms):
            if self._owned(entry):  # else it waits in the journal for its conversation's worker
                await self._dispatch(entry)
            queued += 1
        for inbound in await self._scheduler.autonomous(self._platforms):
            queued += int(await self.submit(inbound))
        return queued

    async def sweep_outbox(self, now: float | None = None) -> int:
        """One sweep: expire what waited too long, then one attempt at every other pending row.

        Args:
            now: the time of the sweep, epoch seconds (default: the clock; tests pass one).

        Returns:
            how many messages were delivered.
        """
        await self.expire_outbox(now)
        return await self._delivery.retry_pending()

    async def expire_outbox(self, now: float | None = None) -> int:
        """Mark outbox rows still pending ``engine.outbox_expiry_s`` after they were queued as
        ``failed``: a reply that late answers a conversation that has moved on, and a row must
        not be retried forever. Each is logged (WARNING, with its chat and age).

        Args:
            now: epoch seconds (default: the clock).

        Returns:
            how many rows expired.
        """
        now = time.time() if now is None else now
        limit = self.settings.outbox_expiry_s
        expired = await self._store.expire_outbox(
            now - limit, error=f"expired: not delivered within {_hours(limit)} of being queued"
        )
        for entry, created_at in expired:
            log.warning(
                "outbox message %d to %s expired undelivered after %s (%d attempt(s); last error: %s); "
                "it will not be sent",
                entry.id, entry.chat.key, _hours(now - created_at), entry.attempts, entry.last_error or "none",
            )
        return len(expired)

    async def _housekeep(self) -> None:
        """A worker of a cluster: retention, by the one worker holding the housekeeping role,
        once a day across the cluster (when it last ran is in ``kv``)."""
        assert self._ownership is not None
        if not self._ownership.leads(HOUSEKEEPING_ROLE):
            return
        last = float(await self._store.get_kv(HOUSEKEEPING_KEY) or 0)
        if time.time() - last >= HOUSEKEEPING_S:
            await self.prune()
            await self._store.prune_cluster(time.time() - HOUSEKEEPING_S)
            await self._store.set_kv(HOUSEKEEPING_KEY, str(time.time()))

    async def prune(self, now: float | None = None) -> Pruned:
        """Drop settled journal and outbox rows and finished turns' traces older than
        ``engine.retention_days`` (:meth:`Store.prune`, in short batches); the history stays.
        Nothing is pruned when ``retention_days`` is 0.

        Args:
            now: epoch seconds (default: the clock).

        Returns:
            how many rows of each kind went.
        """
        days = self.settings.retention_days
        if days <= 0:
            return Pruned()
        now = time.time() if now is None else now
        pruned = await self._store.prune(now - days * DAY_S)
        log.info(
            "retention (%d days): pruned %d journal row(s), %d outbox row(s) and %d turn trace(s)",
            days, pruned.journal, pruned.outbox, pruned.traces,
        )
        return pruned

    # -- observing (tests, `bumblebot chat`) ----------------------------------------------------

    async def wait_until(self, predicate: Callable[[], bool], timeout: float | None = 10.0) -> None:
        """See :meth:`Progress.wait_until`."""
        await self.progress.wait_until(predicate, timeout)

    async def wait_for_turns(self, n: int, timeout: float = 10.0) -> None:
        """Wait until ``n`` turns finished since start."""
        await self.wait_until(lambda: self.progress.turns_finished >= n, timeout)

    @property
    def loaded_conversations(self) -> int:
        return len(self._actors)

    @property
    def queue_depth(self) -> int:
        """Messages waiting in the inboxes of loaded conversations, not yet taken by a turn.
        Safe to read from another thread (the metrics exporter): it only copies and counts."""
        return sum(actor.queued for actor in list(self._actors.values()))

    def working(self) -> list[str]:
        """The keys of the conversations with a turn or job running now, sorted."""
        return sorted(a.key for a in list(self._actors.values()) if a.working)

    @property
    def waiting(self) -> int:
        """Conversations whose turn waits out a model outage."""
        return sum(a.waiting for a in self._actors.values())

    @property
    def idle(self) -> bool:
        """No conversation has a turn or job running or queued (one waiting out a model
        outage does not count: it is resumed after the next start)."""
        return not any(a.working for a in self._actors.values())

    @property
    def settled(self) -> bool:
        """:attr:`idle`, and no compaction between turns is due or running (tests)."""
        return self.idle and not any(a.compacting for a in self._actors.values())

    # -- intake (bumblebot.core.adapter.Intake) ------------------------------------------------------

    @property
    def accepting(self) -> bool:
        return self._accepting

    @property
    def entity_name(self) -> str:
        return self._prompts.entity.name

    async def submit(self, inbound: Inbound, *, kv: dict[str, str] | None = None) -> bool:
        """Journal ``inbound`` and queue it for its conversation.

        A message that shows nothing (empty, or only invisible characters such as
        ``"\u200b"``; :func:`~bumblebot.core.events.blank`) is journaled as ``ignored`` and never
        answered: a blank message in the history makes some endpoints refuse every later
        request. A blank caption or quote is dropped (the files are answered).

        Returns:
            ``True`` if accepted; ``False`` for a duplicate (already journaled), a blank
            message, or before the engine started. While stopping, a message is journaled but not started: it is
            answered after the next start (platforms such as Discord never redeliver it).
        """
        if not self._accepting and not self._stopped:
            return False
        inbound = _visible(inbound.storable())
        if self.blocked(inbound):  # the operator blocked them: journaled, never answered
            if await self._store.journal(inbound, kv=kv, status="ignored") is not None:
                log.info("message %s in %s from blocked sender %s; not answered", inbound.message_id, inbound.chat.key,
                         inbound.sender_id)
            return False
        if inbound.source == "chat" and not inbound.text and not inbound.attachments:
            # only invisible characters: journaled (a redelivery stays one), never a turn, since a
            # blank user message in the history makes some endpoints refuse every later request
            if await self._store.journal(inbound, kv=kv, status="ignored") is not None:
                log.info("message %s in %s shows nothing; not answered", inbound.message_id, inbound.chat.key)
            return False
        journal_id = await self._store.journal(inbound, kv=kv)
        if journal_id is None:
            log.info("duplicate message %s in %s ignored", inbound.message_id, inbound.chat.key)
            return False
        await self._titled(inbound)
        if self._ownership is not None and not self._ownership.owns(inbound.chat.key) and not self._stopped:
            await self.take(inbound.chat)  # its adoption queues its waiting messages, this one among them
            self.progress.accepted += 1  # else another worker holds the chat: it reads the journal
            await self.progress.notify()
            return True
        if self._stopped:
            log.info("message %s in %s arrived while stopping; kept for the next start", inbound.message_id, inbound.chat.key)
            return True
        if self._ownership is not None:  # earlier messages another worker journaled go first
            await self.catch_up(inbound.chat, journal_id)
        await self._dispatch(JournalEntry(journal_id, inbound, "pending"))
        self.progress.accepted += 1
        await self.progress.notify()
        return True

    async def answer(self, inbound: Inbound, text: str | None, *, kv: dict[str, str] | None = None) -> bool:
        """Journal a message handled without a turn and reply ``text`` (if any). ``False`` if
        it was a duplicate."""
        if await self._store.journal(inbound.storable(), kv=kv, status="ignored") is None:
            return False
        if text:
            await self.reply(inbound.chat, text)
        return True

    async def observe(self, inbound: Inbound, *, kv: dict[str, str] | None = None) -> bool:
        """Journal a group message not addressed to the bot: no turn, no reply; the next turn
        in that chat may see it as background (``Inbound.background``). ``False`` if it was a
        duplicate."""
        inbound = _visible(inbound.storable())
        shows = bool(inbound.text or inbound.attachments) and not self.blocked(inbound)
        return await self._store.journal(inbound, kv=kv, status="ignored", background=shows) is not None

    async def edit(self, inbound: Inbound) -> bool:
        """An edited message: if it still waits for a turn (in its conversation's
        inbox, during ``cognition.debounce_s``, behind a running turn in ``queue`` mode, or for
        its files), its text, quote and files become the edit's, in the journal and in the
        inbox. Once a turn has taken it the edit is ignored (the answer is to what was first
        written), and so is an edit that leaves nothing visible. Returns whether it replaced
        the message."""
        if await self._elsewhere(inbound.chat):
            await self.relay_edit(inbound)  # the waiting message is in its worker's inbox
            return True
        actor = self._actors.get(inbound.chat.key)
        queued = actor.queued_entry(inbound.message_id) if actor is not None and not actor.closed else None
        edited = _visible(inbound.storable())
        if queued is None or actor is None or not (edited.text or edited.attachments):
            log.info("edit of message %s in %s ignored (already answered, or not for me)", inbound.message_id, inbound.chat.key)
            return False
        same_files = edited.attachments == queued.inbound.attachments
        new = dataclasses.replace(queued.inbound, text=edited.text, quote=edited.quote, attachments=edited.attachments)
        entry = dataclasses.replace(queued, inbound=new, media=queued.media if same_files else None)
        actor.replace_queued(entry)  # before any await: the next turn takes the edited text
        if not await self._store.replace_pending(entry.id, new, keep_media=same_files):
            return False
        log.info("message %s in %s edited before it was answered; the turn takes the new text", inbound.message_id, inbound.chat.key)
        return True

    async def move_chat(self, old: ChatRef, new: ChatRef) -> bool:
        """The chat ``old`` now lives at ``new``'s id (Telegram: a group became a supergroup,
        ``migrate_to_chat_id``): its conversation, facts and pending work continue there, and
        a loaded actor is re-keyed. ``False`` when there was nothing to move or ``new``
        already had a conversation (then both stay as they are)."""
        if self._media is not None:  # the files people sent there go with it
            try:
                await asyncio.to_thread(self._media.move_chat, old.key, new.key)
            except OSError as exc:
                log.warning("could not move the files of %s to %s: %s", old.key, new.key, exc)
        if self._memory is not None:  # first: a crash after the database move must not strand it
            try:
                self._memory.move(old.key, new.key)
            except OSError as exc:
                log.warning("could not move the facts of %s to %s: %s", old.key, new.key, exc)
        async with self._actor_lock:  # no actor of ``new`` can be created meanwhile
            if not await self._store.move_chat(old, new):
                log.info("%s: nothing to move to %s (no history, or the new chat has its own)", old.key, new.key)
                return False
            for key, actor in list(self._actors.items()):
                chat = actor.conversation.chat
                if chat.platform is old.platform and chat.chat_id == old.chat_id:
                    del self._actors[key]
                    actor.conversation.moved_to(ChatRef(new.platform, new.chat_id, chat.thread_id))
                    self._actors[actor.key] = actor
        log.info("conversation %s moved to %s", old.key, new.key)
        return True

    async def refuse_once(self, inbound: Inbound, text: str, *, kv: dict[str, str] | None = None) -> None:
        """Journal a message from outside the allowlist; ``text`` goes to each sender once."""
        if not await self.answer(inbound, None, kv=kv):
            return
        key = REFUSED_KEY.format(platform=inbound.chat.platform.value, user_id=inbound.sender_id)
        if await self._store.get_kv(key) is None and self._may_refuse():
            await self._store.set_kv(key, "1")  # before sending: a crash costs the refusal, never doubles it
            await self.reply(inbound.chat, text)
        log.info("%s: refused user %s (not in the allowlist)", inbound.chat.platform.value, inbound.sender_id)

    def _may_refuse(self) -> bool:
        """Whether one more refusal fits :data:`MAX_REFUSALS` per :data:`REFUSAL_WINDOW_S`."""
        now = time.monotonic()
        while self._refusals and self._refusals[0] <= now - REFUSAL_WINDOW_S:
            self._refusals.popleft()
        if len(self._refusals) >= MAX_REFUSALS:
            return False
        self._refusals.append(now)
        return True

    async def reply(self, chat: ChatRef, text: str) -> None:
        """Send ``text`` to ``chat`` through the outbox, outside any turn (a command's answer, a
        refusal). The row is written before this returns; it is delivered in the background,
        after the replies queued to the same chat before it, so an adapter's intake is never
        held up by the platform's pace (20 commands in a second from one chat would otherwise
        hold every other chat's next update for 20 s on Telegram). A crash before it is sent
        leaves the row to the outbox sweeper."""
        conversation = await self._store.conversation(chat)
        await self._delivery.post(conversation.id, chat, text)

    async def cursor(self, key: str) -> str | None:
        return await self._store.get_kv(key)

    async def set_cursor(self, key: str, value: str) -> None:
        await self._store.set_kv(key, value)

    async def _dispatch(self, entry: JournalEntry, *, adopting: bool = False) -> None:
        if self._ownership is not None:  # a worker reads the journal too: each entry is queued once
            if entry.id in self._dispatched:
                return
            if entry.inbound.chat.key in self._adopting and not adopting:
                self._held_back.setdefault(entry.inbound.chat.key, []).append(entry)  # queued after its adoption
                return
            self._dispatched[entry.id] = entry.inbound.chat.key
        try:
            actor = await self._actor(entry.inbound.chat)
        except LeaseLost:  # given up or lost meanwhile: journaled, its holder queues it from there
            self._dispatched.pop(entry.id, None)
            return
        actor.enqueue(entry)
        self.activity.publish(actor.key, "queued", waiting=actor.queued, total=self.queue_depth)

    async def _actor(self, chat: ChatRef) -> ConversationActor:
        """The live actor of ``chat`` (loaded on demand)."""
        async with self._actor_lock:
            actor = self._actors.get(chat.key)
            if actor is None or actor.closed:
                context = self._fenced(chat.key)  # LeaseLost before anything is made
                conversation = await Conversation.load(
                    self._store, chat, debounce_s=self._debounce_s, activity=self.activity
                )
                conversation.paused = chat.key in self._paused
                actor = ConversationActor(
                    conversation,
                    self._runner,
                    ready=self._ready,
                    idle_unload_s=self.settings.idle_unload_s,
                    progress=self.progress,
                )
                self._actors[chat.key] = actor
                actor.fence = None if context is None else context.get(FENCE)
                actor.task = self._spawn(actor.run(), f"bumblebot:{chat.key}:actor", context)
                actor.task.add_done_callback(lambda _, a=actor: self._forget(a))
            return actor

    def _forget(self, actor: ConversationActor) -> None:
        if self._actors.get(actor.key) is actor:
            del self._actors[actor.key]
        if actor.lost and not self._stopped:
            self._spawn(self.let_go(actor.key, actor.fence), f"bumblebot:{actor.key}:let-go")
        if not self._stopped:
            self._spawn(self.progress.notify(), "bumblebot:notify")


def _hours(seconds: float) -> str:
    """``"24 h"``, ``"1.5 h"``, ``"90 s"``: a duration for log lines."""
    return f"{seconds / 3600:.3g} h" if seconds >= 3600 else f"{seconds:.0f} s"


def _visible(inbound: Inbound) -> Inbound:
    """``inbound`` with a text or quote that shows nothing (:func:`~bumblebot.core.events.blank`) as ``""``."""
    text = "" if blank(inbound.text) else inbound.text
    quote = "" if blank(inbound.quote.partition(": ")[2] or inbound.quote) else inbound.quote
    if text == inbound.text and quote == inbound.quote:
        return inbound
    return dataclasses.replace(inbound, text=text, quote=quote)

