"""Scheduled tasks (the ``tasks`` table) and what the scheduler reads to run them.

One row per task of ``schedule_task``: its schedule (``kind``, ``spec``, ``tz``), text, next
due time and status. :meth:`~TaskTables.fire_task` advances ``next_due`` in the same
transaction that journals the run (message id ``task:<id>:<due>``), so a due time fires
exactly once, whatever crashes. The reads at the end (``active_chats``, ``chat_kind``,
``unprompted_sent``) look at the journal and the outbox for the scheduler's autonomous turns.
Written only by ``bumblebot/runtime/scheduler.py``.
"""

from __future__ import annotations

import time
from typing import Any

import aiosqlite

from bumblebot.core.events import ChatKind, ChatRef, Inbound, Platform
from bumblebot.store.connection import Database
from bumblebot.store.journal import touch_chat
from bumblebot.store.records import TaskRecord


class TooManyTasks(Exception):
    """A conversation already has the most active tasks it may (``automation.max_tasks``)."""


#: A journal entry of a chat, still pending, whose message id starts with a prefix.
_PENDING_RUN = (
    "SELECT 1 FROM journal WHERE platform=? AND chat_id=? AND thread_id=? AND status='pending'"
    " AND substr(message_id, 1, ?) = ? LIMIT 1"
)


class TaskTables(Database):
    """The ``tasks`` table and the scheduler's reads (part of :class:`bumblebot.store.Store`)."""

    async def add_task(
        self, conversation_id: int, *, kind: str, spec: str, tz: str, text: str, due: float,
        turn_id: int | None, max_active: int,
    ) -> int:
        """A new active task; returns its id.

        Raises:
            TooManyTasks: the conversation has ``max_active`` active tasks already (checked in
                the same transaction).
        """
        async with self.transaction() as db:
            async with db.execute(
                "SELECT COUNT(*) FROM tasks WHERE conversation_id=? AND status='active'", (conversation_id,)
            ) as cur:
                row = await cur.fetchone()
            if row is not None and int(row[0]) >= max_active:
                raise TooManyTasks(f"this chat has {row[0]} scheduled tasks, the most it may have ({max_active})")
            task_id = await db.insert(
                "INSERT INTO tasks (conversation_id, kind, spec, tz, text, created_at, turn_id, next_due)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (conversation_id, kind, spec, tz, text, time.time(), turn_id, due),
            )
            assert task_id is not None
            return task_id

    async def tasks(self, conversation_id: int | None = None, *, active: bool = True) -> list[TaskRecord]:
        """Tasks of a conversation (every conversation's when ``None``), by next due time."""
        where = ["t.status='active'"] if active else []
        params: list[Any] = []
        if conversation_id is not None:
            where.append("t.conversation_id=?")
            params.append(conversation_id)
        clause = f"WHERE {' AND '.join(where)}" if where else ""
        rows = await self._all(
            "SELECT t.*, c.platform, c.chat_id, c.thread_id FROM tasks t JOIN conversations c ON c.id = t.conversation_id"
            f" {clause} ORDER BY t.next_due IS NULL, t.next_due, t.id",
            tuple(params),
        )
        return [_task_from_row(r) for r in rows]

    async def cancel_task(self, conversation_id: int, task_id: int) -> bool:
        """Cancel an active task of this conversation; ``False`` when there is none by that id."""
        cur = await self.write(
            "UPDATE tasks SET status='cancelled', next_due=NULL, ended_at=? WHERE id=? AND conversation_id=?"
            " AND status='active'",
            (time.time(), task_id, conversation_id),
        )
        return cur.rowcount == 1

    async def due_tasks(self, now: float) -> list[TaskRecord]:
        """Active tasks due at or before ``now``, oldest due first; not those of a paused
        conversation (they fire once when it is resumed, as a task missed while the daemon was down)."""
        rows = await self._all(
            "SELECT t.*, c.platform, c.chat_id, c.thread_id FROM tasks t JOIN conversations c ON c.id = t.conversation_id"
            " WHERE t.status='active' AND t.next_due <= ? AND c.paused_at IS NULL ORDER BY t.next_due, t.id",
            (now,),
        )
        return [_task_from_row(r) for r in rows]

    async def next_task_due(self, platforms: set[str] | None = None) -> float | None:
        """The earliest due time of any active task (of ``platforms`` only, when given), paused
        conversations' left out."""
        if platforms is None:
            row = await self._one(
                "SELECT MIN(t.next_due) FROM tasks t JOIN conversations c ON c.id = t.conversation_id"
                " WHERE t.status='active' AND c.paused_at IS NULL"
            )
        else:
            marks = ",".join("?" * len(platforms)) or "''"
            row = await self._one(
                "SELECT MIN(t.next_due) FROM tasks t JOIN conversations c ON c.id = t.conversation_id"
                f" WHERE t.status='active' AND c.paused_at IS NULL AND c.platform IN ({marks})",
                tuple(platforms),
            )
        return None if row is None or row[0] is None else float(row[0])

    async def pending_run(self, chat: ChatRef, prefix: str) -> bool:
        """Whether a journal entry of ``chat`` whose message id starts with ``prefix`` is still
        pending (a scheduled run or an autonomous turn not answered yet)."""
        row = await self._one(_PENDING_RUN, (chat.platform.value, chat.chat_id, chat.thread_id, len(prefix), prefix))
        return row is not None

    async def task(self, task_id: int) -> TaskRecord | None:
        rows = await self._all(
            "SELECT t.*, c.platform, c.chat_id, c.thread_id FROM tasks t JOIN conversations c ON c.id = t.conversation_id"
            " WHERE t.id=?",
            (task_id,),
        )
        return _task_from_row(rows[0]) if rows else None

    async def fire_task(self, task: TaskRecord, inbound: Inbound, next_due: float | None) -> int | None:
        """Journal the run of ``task`` at its due time and move the task on (``next_due``, or
        ``done``), in one transaction; returns the journal id. ``None`` when this due time
        was journaled before, the task changed meanwhile (cancelled, fired), or its previous run
        is still waiting to be answered (then this due time is skipped, so runs never pile up)."""
        c = inbound.chat
        now = time.time()
        async with self.transaction() as db:
            cur = await db.execute(
                "UPDATE tasks SET next_due=?, status=?, last_due=?, ended_at=? WHERE id=? AND"
                " status='active' AND next_due=?",
                (next_due, "active" if next_due is not None else "done", task.next_due,
                 None if next_due is not None else now, task.id, task.next_due),
            )
            if cur.rowcount != 1:
                return None
            prefix = f"task:{task.id}:"
            async with db.execute(_PENDING_RUN, (c.platform.value, c.chat_id, c.thread_id, len(prefix), prefix)) as pending:
                if await pending.fetchone() is not None:
                    return None  # its last run is still waiting (an outage, a long turn): no pile-up
            journal_id = await db.insert(
                "INSERT INTO journal (platform, chat_id, thread_id, message_id, update_id, sender_id,"
                " sender_name, chat_kind, source, text, quote, background, context_limit, status, received_at)"
                " VALUES (?, ?, ?, ?, NULL, ?, ?, ?, ?, ?, '', 0, 0, 'pending', ?) ON CONFLICT DO NOTHING",
                (c.platform.value, c.chat_id, c.thread_id, inbound.message_id, inbound.sender_id, inbound.sender_name,
                 inbound.chat_kind.value, inbound.source, inbound.text, now),
            )
            if journal_id is None:
                return None
            # ``runs`` counts the runs journaled, not the due times skipped meanwhile
            await db.execute("UPDATE tasks SET runs=runs+1 WHERE id=?", (task.id,))
            await db.execute(*touch_chat(c, now))
            return journal_id

    async def active_chats(self, since: float) -> list[tuple[ChatRef, str]]:
        """Conversations whose last message from a person that a turn answered (not a refused
        one, a command or background) came after ``since`` (epoch s), with its chat kind; not
        the paused ones."""
        rows = await self._all(
            "SELECT j.platform, j.chat_id, j.thread_id, j.chat_kind FROM journal j JOIN"
            " (SELECT MAX(id) AS last FROM journal"
            "  WHERE source='chat' AND background=0 AND turn_id IS NOT NULL"  # answered: not refused, not a command
            "  GROUP BY platform, chat_id, thread_id HAVING MAX(received_at) >= ?) m ON j.id = m.last"
            " WHERE NOT EXISTS (SELECT 1 FROM conversations c WHERE c.platform=j.platform AND c.chat_id=j.chat_id"
            " AND c.thread_id=j.thread_id AND c.paused_at IS NOT NULL)",
            (since,),
        )
        return [(ChatRef(Platform(r["platform"]), r["chat_id"], r["thread_id"]), r["chat_kind"]) for r in rows]

    async def chat_kind(self, chat: ChatRef) -> ChatKind:
        """Whether ``chat`` is private or a group, by the last message journaled there
        (private when none was)."""
        row = await self._one(
            "SELECT chat_kind FROM journal WHERE platform=? AND chat_id=? AND thread_id=? AND source='chat'"
            " ORDER BY id DESC LIMIT 1",
            (chat.platform.value, chat.chat_id, chat.thread_id),
        )
        return ChatKind(row["chat_kind"]) if row is not None else ChatKind.PRIVATE

    async def unprompted_sent(self, chat: ChatRef, since: float) -> int:
        """Messages autonomous turns queued to ``chat`` since ``since`` (epoch s), failed ones not counted."""
        row = await self._one(
            "SELECT COUNT(*) FROM outbox o WHERE o.platform=? AND o.chat_id=? AND o.thread_id=? AND o.created_at >= ?"
            " AND o.status != 'failed' AND o.turn_id IN (SELECT j.turn_id FROM journal j WHERE j.source='autonomous'"
            " AND j.platform=o.platform AND j.chat_id=o.chat_id AND j.thread_id=o.thread_id AND j.turn_id IS NOT NULL)",
            (chat.platform.value, chat.chat_id, chat.thread_id, since),
        )
        return int(row[0]) if row is not None else 0


def _task_from_row(r: aiosqlite.Row) -> TaskRecord:
    """The task of a ``tasks`` row joined with its conversation's chat."""
    return TaskRecord(
        id=int(r["id"]), conversation_id=int(r["conversation_id"]),
        chat=ChatRef(Platform(r["platform"]), r["chat_id"], r["thread_id"]), kind=r["kind"], spec=r["spec"],
        tz=r["tz"], text=r["text"], created_at=float(r["created_at"]),
        next_due=None if r["next_due"] is None else float(r["next_due"]), status=r["status"], runs=int(r["runs"]),
        last_due=None if r["last_due"] is None else float(r["last_due"]),
    )
