"""Turns, written step by step: the ``turns`` table and a turn's checkpoints.

A turn is written as it happens: ``begin_turn`` (the turn row and the user message),
``record`` (each assistant message before its tools run, each tool result when it completes,
each message taken mid-turn), ``speak`` (an outbox row, with the assistant message it shows
when there is one, in one transaction), ``finish_turn`` (status, trace, journal settlement).
A ``say`` whose text is streamed first gets a ``streaming`` outbox row (``open_stream``,
``stream_previewed``, ``settle_stream``) that ``speak`` then takes over. Only
``bumblebot/runtime/conversation.py`` calls these writers. After a crash, ``running_turns``
gives back what was left ``running`` so it can be resumed from its checkpoints.

Each turn row holds its session, status, resumable ``state`` and ``trace`` (JSON). The
messages, journal entries and outbox rows a turn writes live in their own tables
(``history.py``, ``journal.py``, ``outbox.py``) and are written here with their helpers.
"""

from __future__ import annotations

import json
import time
from typing import Any

from bumblebot.core.events import ChatRef, Platform
from bumblebot.core.messages import Message
from bumblebot.store.connection import Database
from bumblebot.store.history import insert_messages
from bumblebot.store.journal import journal_entry_from_row
from bumblebot.store.outbox import insert_outbox, outbox_insert, write_status
from bumblebot.store.records import ConversationRecord, OutboxEntry, RunningTurn
from bumblebot.store.schema import to_json


class TurnTables(Database):
    """The ``turns`` table and a turn's checkpoints (part of :class:`bumblebot.store.Store`)."""

    async def begin_turn(
        self,
        conversation_id: int,
        session: int,
        journal_ids: list[int],
        user_message: Message,
        state: dict[str, Any],
    ) -> int:
        """Open a turn: its row (``running``), its user message, and the journal entries' turn id
        (they stay ``pending`` until it finishes), in one transaction. Returns the turn id."""
        async with self.transaction() as db:
            turn_id = await db.insert(
                "INSERT INTO turns (conversation_id, session, status, started_at, state)"
                " VALUES (?, ?, 'running', ?, ?)",
                (conversation_id, session, time.time(), to_json(state)),
            )
            assert turn_id is not None
            await insert_messages(db, conversation_id, session, turn_id, [user_message])
            await db.executemany("UPDATE journal SET turn_id=? WHERE id=?", [(turn_id, j) for j in journal_ids])
        return turn_id

    async def record(
        self,
        conversation_id: int,
        session: int,
        turn_id: int,
        messages: list[Message],
        *,
        journal_ids: list[int] = (),  # type: ignore[assignment]
        state: dict[str, Any] | None = None,
        trace: dict[str, Any] | None = None,
    ) -> None:
        """Checkpoint: append ``messages`` to a running turn (setting their ``id``), attach
        ``journal_ids`` to it (messages taken mid-turn), and save its state and trace."""
        update = (
            "UPDATE turns SET state=COALESCE(?, state), trace=COALESCE(?, trace) WHERE id=?",
            (None if state is None else to_json(state), None if trace is None else to_json(trace), turn_id),
        )
        if not messages and not journal_ids:
            if state is not None or trace is not None:
                await self.write(*update)
            return
        async with self.transaction() as db:
            await insert_messages(db, conversation_id, session, turn_id, messages)
            if journal_ids:
                await db.executemany("UPDATE journal SET turn_id=? WHERE id=?", [(turn_id, j) for j in journal_ids])
            if state is not None or trace is not None:
                await db.execute(*update)

    async def speak(
        self,
        conversation_id: int,
        session: int,
        turn_id: int,
        chat: ChatRef,
        text: str,
        *,
        tool_call_id: str | None = None,
        message: Message | None = None,
        state: dict[str, Any] | None = None,
        stream: OutboxEntry | None = None,
        attachment: dict[str, Any] | None = None,
    ) -> OutboxEntry:
        """Queue ``text`` for delivery in the outbox and, when it shows as an assistant message
        of its own (a plain-text reply, a daemon note), record ``message`` in the same
        transaction: what the user will see and what the entity remembers are one fact. The
        turn's ``state`` is saved with it (a note that ends the turn says so there).

        ``stream`` is the turn's streaming row (:meth:`open_stream`) that showed this text as
        it was written: it becomes the message (its preview is edited into the final text)
        instead of a new row. ``attachment`` is a file to send with it (:attr:`OutboxEntry.attachment`)."""
        if stream is None and message is None and state is None:  # one statement: no BEGIN … COMMIT
            row_id = await self.insert(*outbox_insert(conversation_id, turn_id, chat, text, tool_call_id, attachment))
            return OutboxEntry(
                row_id, conversation_id, turn_id, chat, text, "pending", [], 0, None, tool_call_id, None,
                attachment=attachment,
            )
        async with self.transaction() as db:
            if stream is None:
                outbox_id = await insert_outbox(db, conversation_id, turn_id, chat, text, tool_call_id, attachment)
                preview_id = None
            else:
                outbox_id, preview_id = stream.id, stream.preview_id
                await db.execute(
                    "UPDATE outbox SET text=?, tool_call_id=?, streaming=0, attachment=? WHERE id=?",
                    (text, tool_call_id, to_json(attachment) if attachment else None, outbox_id),
                )
            if message is not None:
                await insert_messages(db, conversation_id, session, turn_id, [message])
            if state is not None:
                await db.execute("UPDATE turns SET state=? WHERE id=?", (to_json(state), turn_id))
        return OutboxEntry(
            outbox_id, conversation_id, turn_id, chat, text, "pending", [], 0, None, tool_call_id, preview_id,
            attachment=attachment,
        )

    async def open_stream(self, conversation_id: int, turn_id: int, chat: ChatRef) -> OutboxEntry:
        """A row for a ``say`` whose text is still being streamed (``streaming``, no text yet);
        :meth:`speak` with ``stream=`` turns it into the message."""
        row_id = await self.insert(
            "INSERT INTO outbox (conversation_id, turn_id, platform, chat_id, thread_id, text, streaming,"
            " created_at) VALUES (?, ?, ?, ?, ?, '', 1, ?)",
            (conversation_id, turn_id, chat.platform.value, chat.chat_id, chat.thread_id, time.time()),
        )
        return OutboxEntry(row_id, conversation_id, turn_id, chat, "", "pending", [], 0, None, streaming=True)

    async def stream_previewed(self, outbox_id: int, preview_id: str, shown: str) -> None:
        """The platform message ``preview_id`` now shows the streaming row ``outbox_id``, with
        the text ``shown``."""
        await self.write("UPDATE outbox SET preview_id=?, text=? WHERE id=?", (preview_id, shown, outbox_id))

    async def settle_stream(self, outbox_id: int, *, status: str, text: str | None = None, error: str | None = None) -> None:
        """Close a streaming row without a ``say`` to show: ``failed`` (its preview was taken
        down, or never shown) or ``sent`` (``/stop``: the ``text`` shown so far stays, as
        the row's message; the conversation is marked active with it)."""
        now = time.time()
        update = (
            (
                "UPDATE outbox SET status=?, streaming=0, text=COALESCE(?, text), last_error=?,"
                " platform_message_ids=CASE WHEN ?='sent' AND preview_id IS NOT NULL"
                " THEN json_array(preview_id) ELSE platform_message_ids END,"
                " sent_at=CASE WHEN ?='sent' THEN ? ELSE sent_at END WHERE id=?"
            ),
            (status, text, error, status, status, now, outbox_id),
        )
        await write_status(self, update, outbox_id, status, now)

    async def upgrade_turn(self, conversation_id: int, session: int, turn_id: int, messages: list[Message], state: dict[str, Any]) -> None:
        """Give a legacy turn (see :meth:`running_turns`) its session, state and first messages."""
        async with self.transaction() as db:
            await db.execute("UPDATE turns SET session=?, state=? WHERE id=?", (session, to_json(state), turn_id))
            await insert_messages(db, conversation_id, session, turn_id, messages)

    async def rewrite_message(self, message_id: int, content: str) -> None:
        """Replace the text of a stored message: a turn's input kept as a file after the turn
        began (the endpoint's window turned out smaller), its user message then the excerpt."""
        await self.write("UPDATE messages SET content=? WHERE id=?", (content, message_id))

    async def finish_turn(
        self,
        turn_id: int,
        *,
        status: str,
        trace: dict[str, Any],
        journal_ids: list[int],
        journal_status: str = "done",
        state: dict[str, Any] | None = None,
    ) -> None:
        """Close a turn: its status (``done`` or ``failed``) and trace, and its journal entries
        (``done`` or ``failed``), in one transaction."""
        now = time.time()
        async with self.transaction() as db:
            await db.executemany(
                "UPDATE journal SET status=?, turn_id=?, done_at=? WHERE id=?",
                [(journal_status, turn_id, now, j) for j in journal_ids],
            )
            await db.execute(
                "UPDATE turns SET status=?, ended_at=?, trace=?, state=COALESCE(?, state) WHERE id=?",
                (status, now, to_json(trace), None if state is None else to_json(state), turn_id),
            )

    async def running_turns(self, platforms: set[str] | None = None, chat: ChatRef | None = None) -> list[RunningTurn]:
        """Turns left ``running`` (a crash, or a stop past the grace period), oldest first.

        A turn written by a version without step checkpoints (no state, no messages) comes back
        with ``legacy`` set, so it can be rebuilt from its journal entries and the messages it
        had delivered; one that no longer answers any pending entry is marked ``interrupted``.

        Args:
            platforms: only conversations on these platforms (``None``: all), so that
                ``bumblebot chat`` never touches the turns of a daemon serving Telegram.
            chat: only this conversation's (a worker of a cluster taking it over).
        """
        where, params = "", ()
        if chat is not None:
            where, params = " AND c.platform = ? AND c.chat_id = ? AND c.thread_id = ?", (
                chat.platform.value, chat.chat_id, chat.thread_id
            )
        rows = await self._all(
            "SELECT t.id, t.session, t.state, t.trace, c.id AS cid, c.platform, c.chat_id, c.thread_id,"
            " c.session AS current, (SELECT COUNT(*) FROM messages m WHERE m.turn_id = t.id) AS n"
            " FROM turns t JOIN conversations c ON c.id = t.conversation_id"
            f" WHERE t.status = 'running'{where} ORDER BY t.id", params,
        )
        out: list[RunningTurn] = []
        stale: list[int] = []
        for r in rows:
            if platforms is not None and r["platform"] not in platforms:
                continue
            entries = [
                journal_entry_from_row(j)
                for j in await self._all(
                    "SELECT * FROM journal WHERE turn_id=? AND status='pending' ORDER BY id", (r["id"],)
                )
            ]
            legacy = not r["state"] or not r["n"] or r["session"] is None
            if legacy and not entries:
                stale.append(int(r["id"]))
                continue
            chat = ChatRef(Platform(r["platform"]), r["chat_id"], r["thread_id"])
            out.append(
                RunningTurn(
                    id=int(r["id"]),
                    conversation=ConversationRecord(int(r["cid"]), chat, int(r["current"])),
                    session=int(r["current"] if r["session"] is None else r["session"]),
                    state={} if legacy else json.loads(r["state"]),
                    trace=json.loads(r["trace"]) if r["trace"] else {},
                    entries=entries,
                    legacy=legacy,
                )
            )
        if stale:
            async with self.transaction() as db:
                await db.executemany(
                    "UPDATE turns SET status='interrupted', ended_at=? WHERE id=?", [(time.time(), i) for i in stale]
                )
        return out

    async def recent_turns(self, conversation_id: int | None = None, limit: int = 10) -> list[dict[str, Any]]:
        """The last ``limit`` turns (newest first) with their traces."""
        where = "WHERE t.conversation_id = ?" if conversation_id is not None else ""
        params: tuple[Any, ...] = (conversation_id, limit) if conversation_id is not None else (limit,)
        rows = await self._all(
            "SELECT t.id, t.status, t.started_at, t.ended_at, t.trace, c.platform, c.chat_id, c.thread_id"
            f" FROM turns t JOIN conversations c ON c.id = t.conversation_id {where}"
            " ORDER BY t.id DESC LIMIT ?",
            params,
        )
        return [
            {
                "turn_id": r["id"], "status": r["status"], "started_at": r["started_at"],
                "ended_at": r["ended_at"], "chat": f"{r['platform']}:{r['chat_id']}"
                + (f":{r['thread_id']}" if r["thread_id"] else ""),
                "trace": json.loads(r["trace"]) if r["trace"] else {},
            }
            for r in rows
        ]
