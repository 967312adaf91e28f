"""What the operator's web console reads: the overview, the conversation list, a conversation's
history and turns, one turn, and the tasks.

Every read is paged or bounded and served by an index (schema step 11), so a page costs the
same with thousands of conversations as with ten: the overview counts the outbox's pending and
failed rows on ``outbox_pending``, sums ``usage`` by day on its primary key, counts turns per
hour on ``turns_by_start`` and measures reply latency from the journal's last 24 hours
(``journal_by_age``, at most :data:`LATENCY_SAMPLE` messages) and each one's turn's outbox rows
(``outbox_by_turn``). The conversation list is ordered on ``conversations_by_activity`` and
counts messages and sums usage only for the rows of its page. A history page is read from
``messages_active`` (messages no summary covers) and marks where a compaction folded messages
into the summary with one probe of ``messages_covered`` per row.

Conversations are named by their key (``ChatRef.key``: ``telegram:123``, ``discord:9:77``).
Times are epoch seconds; a day is a UTC date (``2026-12-02``), as ``usage`` keys them.
"""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime, timedelta
from typing import Any

import aiosqlite

from bumblebot.core.events import ChatRef
from bumblebot.store.connection import Database

#: Most answered messages the overview's reply latency is measured over (the newest first).
LATENCY_SAMPLE = 3000
#: Days of the overview's usage chart (today the last), hours of its turns chart.
CHART_DAYS = 30
CHART_HOURS = 24
#: Rows of the overview's lists of failed outbox rows and failed turns; characters of a row's text.
RECENT_FAILURES = 10
FAILED_TEXT_CHARS = 200
#: a turn page's messages at most (a turn's step cap keeps it far below)
TURN_MESSAGES = 500
#: What ``console_conversations(state=…)`` filters on.
STATES = ("", "active", "paused")

#: The conversation key of a ``conversations`` row ``c`` (``ChatRef.key``), in SQL.
_KEY = "c.platform || ':' || c.chat_id || CASE WHEN c.thread_id = '' THEN '' ELSE ':' || c.thread_id END"
_NEWEST = 2**63 - 1


class ConsoleTables(Database):
    """The console's reads across the tables (part of :class:`bumblebot.store.Store`)."""

    async def console_overview(self, now: float) -> dict[str, Any]:
        """The overview page's figures at ``now``: outbox rows pending (not still being
        streamed) and failed, the last failed rows and turns, today's usage, tokens and cost
        per day for :data:`CHART_DAYS` days and turns started per hour for :data:`CHART_HOURS`
        hours (both oldest first, zero-filled), and reply latency over the last 24 hours."""
        pending = await self._one("SELECT COUNT(*) FROM outbox WHERE status = 'pending' AND streaming = 0")
        failed = await self._one("SELECT COUNT(*) FROM outbox WHERE status = 'failed'")
        return {
            "outbox": {"pending": int(pending[0]) if pending else 0, "failed": int(failed[0]) if failed else 0},
            "failed_rows": await self._failed_rows(),
            "errors": await self._failed_turns(),
            **await self._usage_days(now),
            "hours": await self._turns_per_hour(now),
            "latency": await self._latency(now),
        }

    async def _failed_rows(self) -> list[dict[str, Any]]:
        rows = await self._all(
            "SELECT id, platform, chat_id, thread_id, substr(text, 1, ?) AS text, last_error, created_at FROM outbox"
            " WHERE status = 'failed' ORDER BY id DESC LIMIT ?",
            (FAILED_TEXT_CHARS, RECENT_FAILURES),
        )
        return [
            {
                "id": int(r["id"]), "conversation": _key(r), "text": str(r["text"]), "error": r["last_error"],
                "at": float(r["created_at"]),
            }
            for r in rows
        ]

    async def _failed_turns(self) -> list[dict[str, Any]]:
        rows = await self._all(
            f"SELECT t.id, {_KEY} AS key, COALESCE(t.ended_at, t.started_at) AS at,"
            " json_extract(t.trace, '$.stop_reason') AS stop, json_extract(t.trace, '$.error') AS error,"
            " json_extract(t.trace, '$.error_id') AS error_id"
            " FROM turns t JOIN conversations c ON c.id = t.conversation_id"
            " WHERE t.status = 'failed' ORDER BY t.id DESC LIMIT ?",
            (RECENT_FAILURES,),
        )
        return [{"conversation": r["key"], "turn": int(r["id"]), "at": float(r["at"]), "why": _why(r)} for r in rows]

    async def _usage_days(self, now: float) -> dict[str, Any]:
        """``today`` and ``days`` from the ``usage`` rows of the last :data:`CHART_DAYS` days."""
        today = datetime.fromtimestamp(now, UTC).date()
        days = [(today - timedelta(days=n)).isoformat() for n in range(CHART_DAYS - 1, -1, -1)]
        rows = await self._all(
            "SELECT day, SUM(requests) AS requests, SUM(prompt_tokens) AS prompt, SUM(completion_tokens) AS completion,"
            " SUM(cached_tokens) AS cached, SUM(cost) AS cost FROM usage WHERE day >= ? AND day <= ? GROUP BY day",
            (days[0], days[-1]),
        )
        by_day = {r["day"]: r for r in rows}
        now_row = by_day.get(days[-1])
        return {
            "today": {
                "prompt": int(now_row["prompt"]) if now_row else 0,
                "completion": int(now_row["completion"]) if now_row else 0,
                "cached": int(now_row["cached"]) if now_row else 0,
                "cost": float(now_row["cost"]) if now_row else 0.0,
                "requests": int(now_row["requests"]) if now_row else 0,
            },
            "days": [
                {
                    "day": day,
                    "tokens": int(by_day[day]["prompt"] + by_day[day]["completion"]) if day in by_day else 0,
                    "cost": float(by_day[day]["cost"]) if day in by_day else 0.0,
                }
                for day in days
            ],
        }

    async def _turns_per_hour(self, now: float) -> list[dict[str, Any]]:
        first = (int(now) // 3600 - (CHART_HOURS - 1)) * 3600
        rows = await self._all(
            "SELECT CAST(started_at AS INTEGER) / 3600 * 3600 AS hour, COUNT(*) AS n FROM turns"
            " WHERE started_at >= ? GROUP BY hour",
            (first,),
        )
        counts = {int(r["hour"]): int(r["n"]) for r in rows}
        return [{"hour": first + n * 3600, "turns": counts.get(first + n * 3600, 0)} for n in range(CHART_HOURS)]

    async def _latency(self, now: float) -> dict[str, Any]:
        """Reply latency: for each message from a person received in the last 24 hours that a
        turn took (the newest :data:`LATENCY_SAMPLE`), the seconds until that turn's first
        outbox row sent after it; p50 and p95 (nearest rank) of those, and how many turns
        sent them."""
        rows = await self._all(
            "SELECT j.turn_id, (SELECT MIN(o.sent_at) FROM outbox o WHERE o.turn_id = j.turn_id"
            " AND o.status = 'sent' AND o.sent_at >= j.received_at) - j.received_at AS wait"
            " FROM journal j WHERE j.received_at >= ? AND j.source = 'chat' AND j.background = 0"
            " AND j.turn_id IS NOT NULL ORDER BY j.received_at DESC LIMIT ?",
            (now - 86400, LATENCY_SAMPLE),
        )
        waits = sorted(float(r["wait"]) for r in rows if r["wait"] is not None)
        turns = {int(r["turn_id"]) for r in rows if r["wait"] is not None}
        return {"p50": _rank(waits, 0.50), "p95": _rank(waits, 0.95), "turns": len(turns)}

    async def console_conversations(
        self, *, query: str = "", platform: str = "", state: str = "", offset: int = 0, limit: int = 50
    ) -> tuple[list[dict[str, Any]], int]:
        """A page of conversations, the most recently active first, and how many match.

        Args:
            query: part of the title or chat id (case-insensitive for ASCII; ``%`` and ``_``
                match themselves).
            platform: only this platform's (``telegram``…); ``""``: all.
            state: ``paused``, ``active`` (not paused) or ``""`` (all).

        Raises:
            ValueError: ``state`` is none of :data:`STATES`.
        """
        if state not in STATES:
            raise ValueError(f"no conversation state {state!r}; one of {STATES}")
        where, params = [], []
        if query:
            pattern = "%" + query.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
            where.append("(c.title LIKE ? ESCAPE '\\' OR c.chat_id LIKE ? ESCAPE '\\')")
            params += [pattern, pattern]
        if platform:
            where.append("c.platform = ?")
            params.append(platform)
        if state:
            where.append("c.paused_at IS NOT NULL" if state == "paused" else "c.paused_at IS NULL")
        clause = f"WHERE {' AND '.join(where)}" if where else ""
        total = await self._one(f"SELECT COUNT(*) FROM conversations c {clause}", tuple(params))
        rows = await self._all(
            "SELECT p.*, (SELECT COUNT(*) FROM messages m WHERE m.conversation_id = p.id) AS messages,"
            " (SELECT COALESCE(SUM(u.prompt_tokens + u.completion_tokens), 0) FROM usage u WHERE u.conversation = p.key) AS tokens,"
            " (SELECT COALESCE(SUM(u.cost), 0.0) FROM usage u WHERE u.conversation = p.key) AS cost"
            f" FROM (SELECT c.id, {_KEY} AS key, c.platform, c.chat_id, c.thread_id, c.title, c.last_active_at,"
            f" c.paused_at FROM conversations c {clause} ORDER BY c.last_active_at DESC, c.id DESC LIMIT ? OFFSET ?) p"
            " ORDER BY p.last_active_at DESC, p.id DESC",
            (*params, max(0, limit), max(0, offset)),
        )
        return [
            {
                "key": r["key"], "platform": r["platform"], "chat_id": r["chat_id"], "thread_id": r["thread_id"],
                "title": r["title"], "last_active": r["last_active_at"], "messages": int(r["messages"]),
                "tokens": int(r["tokens"]), "cost": float(r["cost"]), "paused": r["paused_at"] is not None,
            }
            for r in rows
        ], int(total[0]) if total else 0

    async def console_history(self, key: str, *, before: int | None = None, limit: int = 200) -> dict[str, Any]:
        """A page of the current session's history as the model is sent it: the newest
        ``limit`` messages no summary covers (below message id ``before`` when given), oldest
        first, and the session's current summary.

        Each message's ``content`` is as stored: a ``pruned`` tool result is sent to the model
        as a placeholder (``PRUNED_PLACEHOLDER``) instead. ``boundary`` marks a message
        right after messages a compaction folded into the summary (where the summary stands
        in for them). ``more``: older messages are left. An unknown key gives session ``None``
        and no message."""
        conversation = await self._conversation_row(key)
        if conversation is None:
            return {"session": None, "summary": None, "messages": [], "more": False}
        cid, session = int(conversation["id"]), int(conversation["session"])
        summary = await self._one("SELECT summary FROM compaction WHERE conversation_id = ? AND session = ?", (cid, session))
        rows = await self._all(
            "SELECT p.*, EXISTS (SELECT 1 FROM messages c WHERE c.conversation_id = ? AND c.session = ?"
            " AND c.covered_by IS NOT NULL AND c.id > COALESCE(p.prev, 0) AND c.id < p.id) AS boundary"
            " FROM (SELECT q.*, LAG(q.id) OVER (ORDER BY q.id) AS prev FROM"
            " (SELECT id, role, content, tool_calls, tool_call_id, pruned, created_at FROM messages"
            " WHERE conversation_id = ? AND session = ? AND covered_by IS NULL AND id < ? ORDER BY id DESC LIMIT ?) q) p"
            " ORDER BY p.id",
            (cid, session, cid, session, _NEWEST if before is None else before, max(0, limit) + 1),
        )
        more = len(rows) > max(0, limit)
        return {
            "session": session,
            "summary": summary["summary"] if summary is not None else None,
            "messages": [
                {
                    "id": int(r["id"]), "role": r["role"], "content": r["content"],
                    "tool_calls": json.loads(r["tool_calls"]) if r["tool_calls"] else None,
                    "tool_call_id": r["tool_call_id"], "pruned": bool(r["pruned"]), "boundary": bool(r["boundary"]),
                    "at": float(r["created_at"]),
                }
                for r in (rows[1:] if more else rows)
            ],
            "more": more,
        }

    async def console_turns(self, key: str, *, offset: int = 0, limit: int = 20) -> list[dict[str, Any]]:
        """A page of a conversation's past turns (not those still running), newest first,
        with their traces."""
        chat = _chat(key)
        if chat is None:
            return []
        rows = await self._all(
            "SELECT t.id, t.started_at, t.ended_at, t.status, t.trace FROM turns t"
            " WHERE t.conversation_id = (SELECT id FROM conversations WHERE platform = ? AND chat_id = ? AND thread_id = ?)"
            " AND t.status != 'running' ORDER BY t.id DESC LIMIT ? OFFSET ?",
            (chat.platform.value, chat.chat_id, chat.thread_id, max(0, limit), max(0, offset)),
        )
        return [_turn(r) for r in rows]

    async def console_turn(self, turn_id: int) -> dict[str, Any] | None:
        """One turn (running or past), ``None`` when there is none by that id: as a row of
        :meth:`console_turns` plus its ``conversation`` key and ``session``, the messages it
        answered (``inbound``: ``id``, ``sender``, ``source``, ``text``, ``received_at``,
        ``status``; while retention keeps them) and what it queued to send (``outbox``:
        ``id``, ``text``, ``status``, ``error``, ``created_at``, ``sent_at``) and the messages it
        recorded (``messages``: the user's, each step's tool calls with their arguments, each
        result; shaped as :meth:`console_history`'s, without ``boundary``)."""
        row = await self._one(
            f"SELECT t.id, t.session, t.started_at, t.ended_at, t.status, t.trace, {_KEY} AS key"
            " FROM turns t JOIN conversations c ON c.id = t.conversation_id WHERE t.id = ?",
            (turn_id,),
        )
        if row is None:
            return None
        inbound = await self._all(
            "SELECT id, sender_name, source, text, received_at, status FROM journal WHERE turn_id = ? ORDER BY id",
            (turn_id,),
        )
        outbox = await self._all(
            "SELECT id, text, status, last_error, created_at, sent_at FROM outbox WHERE turn_id = ? ORDER BY id",
            (turn_id,),
        )
        messages = await self._all(  # at most the turn's caps of steps: its calls and results
            "SELECT id, role, content, tool_calls, tool_call_id, pruned, created_at FROM messages"
            " WHERE turn_id = ? ORDER BY id LIMIT ?",
            (turn_id, TURN_MESSAGES),
        )
        return {
            **_turn(row), "conversation": row["key"], "session": row["session"],
            "inbound": [
                {"id": int(j["id"]), "sender": j["sender_name"], "source": j["source"], "text": j["text"],
                 "received_at": float(j["received_at"]), "status": j["status"]}
                for j in inbound
            ],
            "outbox": [
                {"id": int(o["id"]), "text": o["text"], "status": o["status"], "error": o["last_error"],
                 "created_at": float(o["created_at"]), "sent_at": o["sent_at"]}
                for o in outbox
            ],
            "messages": [
                {"id": int(m["id"]), "role": m["role"], "content": m["content"],
                 "tool_calls": json.loads(m["tool_calls"]) if m["tool_calls"] else None,
                 "tool_call_id": m["tool_call_id"], "pruned": bool(m["pruned"]), "at": float(m["created_at"])}
                for m in messages
            ],
        }

    async def console_tasks(self, *, offset: int = 0, limit: int = 100) -> tuple[list[dict[str, Any]], int]:
        """A page of every task, and how many there are: the active ones first, soonest due
        first, then those that ended (done, cancelled), the newest first."""
        counts = await self._one(
            "SELECT (SELECT COUNT(*) FROM tasks WHERE status = 'active'), (SELECT COUNT(*) FROM tasks)"
        )
        active, total = (int(counts[0]), int(counts[1])) if counts else (0, 0)
        offset, limit = max(0, offset), max(0, limit)
        select = (
            f"SELECT t.id, {_KEY} AS key, t.kind, t.spec, t.tz, t.next_due, t.last_due, t.status, t.text"
            " FROM tasks t JOIN conversations c ON c.id = t.conversation_id"
        )
        rows: list[aiosqlite.Row] = []
        if offset < active and limit:
            rows += await self._all(
                f"{select} WHERE t.status = 'active' ORDER BY t.next_due, t.id LIMIT ? OFFSET ?", (limit, offset)
            )
        if len(rows) < limit:
            rows += await self._all(
                f"{select} WHERE t.status != 'active' ORDER BY t.id DESC LIMIT ? OFFSET ?",
                (limit - len(rows), max(0, offset - active)),
            )
        return [
            {
                "id": int(r["id"]), "conversation": r["key"], "schedule": readable_schedule(r["kind"], r["spec"], r["tz"]),
                "next_due": r["next_due"], "last_run": r["last_due"], "status": r["status"], "prompt": r["text"],
            }
            for r in rows
        ], total

    async def _conversation_row(self, key: str) -> aiosqlite.Row | None:
        chat = _chat(key)
        if chat is None:
            return None
        return await self._one(
            "SELECT id, session FROM conversations WHERE platform = ? AND chat_id = ? AND thread_id = ?",
            (chat.platform.value, chat.chat_id, chat.thread_id),
        )


def readable_schedule(kind: str, spec: str, tz: str) -> str:
    """A task's schedule in words: ``once at 2026-12-24T18:00:00+01:00``, ``every 2 hours``,
    ``cron 0 9 * * 1-5 (Europe/Paris)``."""
    if kind == "once":
        return f"once at {spec}"
    if kind == "every":
        try:
            seconds = float(spec)
        except ValueError:
            return f"every {spec}"
        for unit, size in (("week", 604800), ("day", 86400), ("hour", 3600), ("minute", 60)):
            if seconds >= size and seconds % size == 0:
                n = int(seconds // size)
                return f"every {n} {unit}{'s' if n != 1 else ''}"
        return f"every {seconds:g} seconds"
    return f"{kind} {spec} ({tz})"


def _chat(key: str) -> ChatRef | None:
    try:
        return ChatRef.from_key(key)
    except ValueError:
        return None


def _key(r: aiosqlite.Row) -> str:
    """The conversation key of a row with ``platform``, ``chat_id`` and ``thread_id``."""
    return f"{r['platform']}:{r['chat_id']}" + (f":{r['thread_id']}" if r["thread_id"] else "")


def _turn(r: aiosqlite.Row) -> dict[str, Any]:
    return {
        "id": int(r["id"]), "started_at": float(r["started_at"]), "finished_at": r["ended_at"], "status": r["status"],
        "trace": json.loads(r["trace"]) if r["trace"] else {},
    }


def _why(r: aiosqlite.Row) -> str:
    """Why a turn failed, from its trace: the reason it stopped and the error (or the id an
    internal error was logged under); ``""`` when retention cleared the trace."""
    error = r["error"] or (f"internal error (id {r['error_id']})" if r["error_id"] else "")
    return ": ".join(str(part) for part in (r["stop"], error) if part)


def _rank(values: list[float], share: float) -> float | None:
    """The nearest-rank percentile of sorted ``values`` (``None`` when there is none)."""
    if not values:
        return None
    return values[max(0, math.ceil(share * len(values)) - 1)]
