"""Scheduled tasks and autonomous cycles: input that no person sent.

:class:`Scheduler` is the one writer of the ``tasks`` table. The ``schedule_task``,
``list_tasks`` and ``cancel_task`` tools and the ``/tasks`` command go through it; the engine
asks it, in its automation loop, what is due.

**Exactly once.** A due task fires by :meth:`Store.fire_task`: one transaction journals the run
(``source: automation``, message id ``task:<id>:<due>``) and moves the task on (its next due
time, or ``done``). The journal entry is then a message like any other: its turn runs in the
conversation's actor (never at the same time as a user turn there), a crash before it finishes
leaves it ``pending`` and the next start answers it, and the unique message id means a due
time can never be journaled twice. A task that came due while the daemon was down fires once
after the start (not once per missed time), and the turn is told how late it is.

**Autonomous cycles** (``autonomy.enabled``): every ``autonomy.interval_s`` each conversation
whose last message from a person is within ``autonomy.active_window_s`` gets one turn
(``source: autonomous``, message id ``autonomy:<slot>``: one per interval slot, so a restart
within the slot does not give it a second), except in ``autonomy.quiet_hours`` and once
``autonomy.max_messages_per_day`` unprompted messages went out there that day (the entity's
day). Both kinds of turn may end without a message (the completion gate allows silence).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from datetime import datetime
from zoneinfo import ZoneInfo

from bumblebot.core.events import ChatKind, ChatRef, Inbound, Platform
from bumblebot.core.settings import AutomationSettings, AutonomySettings
from bumblebot.runtime.schedule import Kind, WhenError, describe, next_due, parse_when
from bumblebot.store import JournalEntry, Store, TaskRecord, TooManyTasks

log = logging.getLogger(__name__)

#: The scheduler looks at the clock at least this often, seconds (a clock jump is caught up).
MAX_SLEEP_S = 60.0
#: A task that fires this many seconds after its due time (the daemon was down) is told so.
LATE_S = 5.0
AUTOMATION_SOURCE = "automation"
AUTONOMOUS_SOURCE = "autonomous"
TASK_INSTRUCTION = (
    "Do this now. Whatever you say reaches the chat; if there is nothing worth saying, end your "
    "turn without a message."
)
AUTONOMOUS_TEXT = (
    "[Autonomous turn: nobody wrote to you. It is {now} ({zone}). You may reach out to this chat "
    "if there is something genuinely useful or kind to say (a follow-up, a reminder of something "
    "they mentioned). If not, end your turn without saying anything; silence is fine.]"
)


class TaskError(Exception):
    """A task could not be made or found; the message is for the model or the user."""


class Scheduler:
    """Scheduled tasks and autonomous cycles.

    Args:
        automation: the ``automation`` section (cap per conversation, shortest repeat).
        autonomy: the ``autonomy`` section.
        store: the database (``tasks``, and the journal for runs).
        zone: the entity's time zone now (it may be edited while running).
        clock: the wall clock, epoch seconds (tests inject one).
    """

    def __init__(
        self,
        automation: AutomationSettings,
        autonomy: AutonomySettings,
        store: Store,
        zone: Callable[[], ZoneInfo],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.automation = automation
        self.autonomy = autonomy
        self._store = store
        self._zone = zone
        self._clock = clock
        #: set when a task is added or cancelled: the automation loop looks again at once
        self.changed = asyncio.Event()

    # -- tasks (the tools and /tasks) ------------------------------------------------------------

    async def create(self, conversation: str, when: str, text: str, *, turn_id: int | None = None) -> TaskRecord:
        """A new task in the conversation with key ``conversation``.

        Raises:
            TaskError: ``when`` is unreadable (the message says how to write it), ``text`` is
                empty, or the conversation has ``automation.max_tasks`` active tasks.
        """
        text = text.strip()
        if not text:
            raise TaskError("task is empty: say what to do or say when it is due")
        zone = self._zone()
        now = self._clock()
        try:
            parsed = parse_when(when, zone, now, min_interval_s=self.automation.min_interval_s)
        except WhenError as exc:
            raise TaskError(str(exc)) from None
        record = await self._store.conversation(ChatRef.from_key(conversation))
        try:
            task_id = await self._store.add_task(
                record.id, kind=parsed.kind, spec=parsed.spec, tz=zone.key, text=text, due=parsed.first_due,
                turn_id=turn_id, max_active=self.automation.max_tasks,
            )
        except TooManyTasks as exc:
            raise TaskError(f"{exc}; cancel one first (the chat's task list shows them)") from None
        self.changed.set()
        log.info("task %d in %s: %s, first due %s", task_id, conversation, describe(parsed.kind, parsed.spec),
                 self.when(parsed.first_due, zone))
        [task] = [t for t in await self._store.tasks(record.id) if t.id == task_id]
        return task

    async def tasks(self, conversation: str) -> list[TaskRecord]:
        """The active tasks of a conversation, soonest first."""
        record = await self._store.conversation(ChatRef.from_key(conversation))
        return await self._store.tasks(record.id)

    async def cancel(self, conversation: str, task_id: int) -> None:
        """Cancel one of the conversation's active tasks.

        Raises:
            TaskError: no active task with that id in this conversation.
        """
        if not 0 < task_id < 2**62:
            raise TaskError(f"there is no active task {task_id} in this chat (the chat's task list shows them)")
        record = await self._store.conversation(ChatRef.from_key(conversation))
        if not await self._store.cancel_task(record.id, task_id):
            raise TaskError(f"there is no active task {task_id} in this chat (the chat's task list shows them)")
        self.changed.set()

    def when(self, epoch: float | None, zone: ZoneInfo | None = None) -> str:
        """``epoch`` as the entity reads time: ``2026-12-01 18:45 (Europe/Lisbon)``."""
        if epoch is None:
            return "never again"
        zone = zone or self._zone()
        return f"{datetime.fromtimestamp(epoch, zone):%Y-%m-%d %H:%M} ({zone.key})"

    def listing(self, tasks: list[TaskRecord]) -> str:
        """Tasks as lines: ``#3 · next 2026-12-01 18:45 (UTC) · every 2 hours · water the plants``."""
        if not tasks:
            return "No scheduled tasks here."
        lines = [
            f"#{t.id} · next {self.when(t.next_due, ZoneInfo(t.tz))} · {describe(_kind(t.kind), t.spec)} · {_short(t.text, 80)}"
            for t in tasks
        ]
        return "\n".join(lines)

    # -- firing (the engine's automation loop) ----------------------------------------------------

    async def fire_due(self, platforms: set[Platform] | None = None) -> list[JournalEntry]:
        """Journal a run of every task due now (of ``platforms`` only; ``None``: all) and move
        each on; returns the entries to dispatch (each due time once, whatever crashed before)."""
        now = self._clock()
        entries = []
        for task in await self._store.due_tasks(now):
            if platforms is not None and task.chat.platform not in platforms:
                continue
            assert task.next_due is not None
            zone = ZoneInfo(task.tz)
            following = next_due(_kind(task.kind), task.spec, zone, max(now, task.next_due))
            inbound = Inbound(
                chat=task.chat,
                message_id=f"task:{task.id}:{task.next_due:.0f}",
                sender_id="scheduler",
                sender_name="scheduled task",
                text=self._task_text(task, now, zone),
                chat_kind=await self._store.chat_kind(task.chat),
                source=AUTOMATION_SOURCE,
            )
            journal_id = await self._store.fire_task(task, inbound, following)
            if journal_id is None:
                continue
            late = now - task.next_due
            log.info("task %d in %s fired%s", task.id, task.chat.key, f" {late:.0f} s late" if late >= LATE_S else "")
            entries.append(JournalEntry(journal_id, inbound, "pending"))
        return entries

    def _task_text(self, task: TaskRecord, now: float, zone: ZoneInfo) -> str:
        assert task.next_due is not None
        late = now - task.next_due
        lateness = f"; it is now {self.when(now, zone)}, {_late(late)} late (the bot was not running)" if late >= LATE_S else ""
        repeat = f", {describe(_kind(task.kind), task.spec)}" if task.kind != "once" else ""
        head = (
            f"[Scheduled task #{task.id}{repeat}, set {self.when(task.created_at, zone)}, due {self.when(task.next_due, zone)}"
            f"{lateness}]"
        )
        return f"{head}\n{task.text}\n[{TASK_INSTRUCTION}]"

    async def wait(self, platforms: set[Platform] | None = None) -> None:
        """Sleep until the next task of ``platforms`` is due (at most :data:`MAX_SLEEP_S`, less
        when autonomy is on and its next cycle comes first), or until a task is added or
        cancelled."""
        due = await self._store.next_task_due(None if platforms is None else {p.value for p in platforms})
        now = self._clock()
        delay = MAX_SLEEP_S if due is None else min(MAX_SLEEP_S, max(0.0, due - now))
        if self.autonomy.enabled:
            interval = self.autonomy.interval_s
            delay = min(delay, interval - now % interval)
        self.changed.clear()
        try:
            await asyncio.wait_for(self.changed.wait(), delay)
        except TimeoutError:
            pass

    # -- autonomy --------------------------------------------------------------------------------

    async def autonomous(self, platforms: set[Platform] | None = None) -> list[Inbound]:
        """The autonomous turns due in this interval slot (none when autonomy is off, in quiet
        hours, or for a conversation at its daily cap). The engine journals them; the slot in
        the message id makes each conversation's cycle happen once per slot."""
        cfg = self.autonomy
        if not cfg.enabled:
            return []
        now = self._clock()
        zone = self._zone()
        local = datetime.fromtimestamp(now, zone)
        if cfg.quiet(local.hour, local.minute):
            return []
        slot = int(now // cfg.interval_s)
        day_start = local.replace(hour=0, minute=0, second=0, microsecond=0).timestamp()
        out = []
        for chat, kind in await self._store.active_chats(now - cfg.active_window_s):
            if platforms is not None and chat.platform not in platforms:
                continue
            if await self._store.unprompted_sent(chat, day_start) >= cfg.max_messages_per_day:
                continue
            if await self._store.pending_run(chat, "autonomy:"):
                continue  # the last one is still waiting (an outage, a long turn): no pile-up
            out.append(Inbound(
                chat=chat, message_id=f"autonomy:{slot}:{chat.thread_id}", sender_id="autonomy",
                sender_name="autonomous cycle",
                text=AUTONOMOUS_TEXT.format(now=f"{local:%A %Y-%m-%d %H:%M}", zone=zone.key),
                chat_kind=ChatKind(kind), source=AUTONOMOUS_SOURCE,
            ))
        return out

    async def may_run(self, entry: JournalEntry) -> str | None:
        """Why a scheduled or autonomous entry should not get its turn now (``None``: it
        should): its task was cancelled since it was queued; an autonomous one in quiet hours
        or at the day's cap (checked again when its turn would start, not only when queued)."""
        source = entry.inbound.source
        if source == AUTOMATION_SOURCE:
            task_id = _task_id(entry.inbound.message_id)
            task = await self._store.task(task_id) if task_id is not None else None
            if task is not None and task.status == "cancelled":
                return f"task {task_id} was cancelled"
        elif source == AUTONOMOUS_SOURCE:
            local = datetime.fromtimestamp(self._clock(), self._zone())
            if self.autonomy.quiet(local.hour, local.minute):
                return "quiet hours"
            if await self.unprompted_left(entry.inbound.chat) <= 0:
                return "the day's unprompted messages are used up"
        return None

    async def task_of(self, entry: JournalEntry) -> TaskRecord | None:
        """The task a scheduled entry is a run of (``None``: not one, or gone)."""
        task_id = _task_id(entry.inbound.message_id) if entry.inbound.source == AUTOMATION_SOURCE else None
        return None if task_id is None else await self._store.task(task_id)

    async def retire(self, entry: JournalEntry, why: str) -> None:
        """The task of a scheduled entry cannot reach its chat (blocked, deleted): cancelled."""
        task_id = _task_id(entry.inbound.message_id)
        if task_id is None:
            return
        task = await self._store.task(task_id)
        if task is not None and task.status == "active" and await self._store.cancel_task(task.conversation_id, task_id):
            log.warning("task %d in %s cancelled: %s", task_id, entry.inbound.chat.key, why)
            self.changed.set()

    async def unprompted_left(self, chat: ChatRef) -> int:
        """How many more unprompted messages ``chat`` may get today."""
        zone = self._zone()
        local = datetime.fromtimestamp(self._clock(), zone)
        day_start = local.replace(hour=0, minute=0, second=0, microsecond=0).timestamp()
        return max(0, self.autonomy.max_messages_per_day - await self._store.unprompted_sent(chat, day_start))


def _task_id(message_id: str) -> int | None:
    """The task id of a run's message id ``task:<id>:<due>``."""
    parts = message_id.split(":")
    return int(parts[1]) if len(parts) == 3 and parts[0] == "task" and parts[1].isdigit() else None


def _kind(kind: str) -> Kind:
    if kind not in ("once", "every", "cron"):
        raise TaskError(f"unknown task kind {kind!r}")
    return kind  # type: ignore[return-value]


def _short(text: str, n: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "…"


def _late(seconds: float) -> str:
    if seconds < 90:
        return f"{round(seconds)} seconds"
    if seconds < 3600:
        return f"{round(seconds / 60)} minutes"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} hours"
    return f"{round(seconds / 86400)} days"
