"""One home for each conversation's state: its sessions and the turn in progress.

A :class:`Conversation` is loaded by the engine when its actor starts and lives as long as the
actor. It, its :class:`Session` objects and its :class:`Turn` are the **only writers** of a
conversation's history, compaction state and turn records; every change is written to the
store first and then applied in memory, so what is in memory is always what is on disk.

* :class:`Session` (``/reset`` starts the next one): the active history, the compaction
  summary and counters, and the running token estimate of both.
* :class:`Turn`: the turn in progress, written as it happens (docs/cognition.md, "The agent loop"):
  the user message when it starts, each assistant message *before* its tools run, each tool
  result as soon as it completes, each message taken mid-turn, and each message for the user
  in the outbox together with the assistant message that shows it. After a crash the turn is
  resumed from exactly these rows (:meth:`Conversation.resume_turn`): on-disk history always
  equals what the model did and what the user saw.

A turn keeps the :class:`Session` it started in, so ``/reset`` during a turn gives the
conversation a new session at once while the running turn finishes in the old one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import Sequence
from typing import Any

from bumblebot.cognition.compaction import CompactionOutcome, summary_message
from bumblebot.core.activity import NO_ACTIVITY, Activity
from bumblebot.core.events import ChatKind, ChatRef, Inbound
from bumblebot.core.messages import Message, TurnContext
from bumblebot.media import prepared
from bumblebot.runtime.inbox import Inbox
from bumblebot.runtime.turnevents import TurnEvents
from bumblebot.runtime.turnstate import TurnState
from bumblebot.store import (
    CompactionState,
    ConversationRecord,
    JournalEntry,
    OutboxEntry,
    RunningTurn,
    Store,
)

log = logging.getLogger(__name__)

#: The result given to a ``say`` that a legacy turn (no checkpoints) had delivered.
LEGACY_SAID = '{"delivered": true, "queued": false}'


#: Background messages are shortened to this many characters each.
BACKGROUND_CHARS = 300
BACKGROUND_OPEN = "[Earlier in this chat, not addressed to you: background only, do not answer these]"
BACKGROUND_CLOSE = "[End of background]"


def _continues(entry: JournalEntry, before: JournalEntry | None) -> bool:
    """``entry`` is the next part of a paste ``before`` began (same sender, no files, no quote)."""
    return (
        before is not None and before.inbound.paste_part and before.inbound.sender_id == entry.inbound.sender_id
        and not entry.inbound.attachments and not entry.inbound.quote and not before.inbound.attachments
    )


def _one(entry: JournalEntry) -> str:
    inbound = entry.inbound
    files = prepared(entry).text
    if not files and inbound.attachments and entry.media is None:
        text = inbound.shown_text  # files not fetched (no media intake, or refused by a limit): named
    else:
        text = f"{inbound.text}\n{files}" if inbound.text and files else inbound.text or files
    if inbound.quote:
        text = f"[Replying to {inbound.quote}]\n{text}"
    return f"[{inbound.speaker}]: {text}" if inbound.chat_kind is ChatKind.GROUP else text


def _short(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def user_message(entries: list[JournalEntry], background: Sequence[Inbound] = ()) -> Message:
    """The user message of a turn (or of messages taken mid-turn): :func:`merge_text`, with
    the images of every entry (``bumblebot.media.intake``) as references."""
    images = [ref.to_json() for e in entries for ref in prepared(e).images]
    return Message(role="user", content=merge_text(entries, background), images=images or None)


def merge_text(entries: list[JournalEntry], background: Sequence[Inbound] = ()) -> str:
    """The user text of a turn: one message as is; in groups each part names its speaker, and a
    reply carries what it replies to (``[Replying to Name: text]``). ``background``: earlier
    group messages not addressed to the bot (``telegram.group_context``), put first
    between :data:`BACKGROUND_OPEN` and :data:`BACKGROUND_CLOSE`, each shortened to
    :data:`BACKGROUND_CHARS`. The parts of a long paste (``Inbound.paste_part``) are joined by a
    line break, as one text."""
    parts: list[str] = []
    for i, entry in enumerate(entries):
        if not entry.inbound.text and not prepared(entry).text and not entry.inbound.attachments:
            continue  # folded into an earlier part (a long message kept as a file)
        if parts and _continues(entry, entries[i - 1] if i else None):
            parts[-1] += "\n" + entry.inbound.text  # a long paste the client cut up: one text
        else:
            parts.append(_one(entry))
    if background:
        lines = [f"[{b.speaker}]: {_short(b.shown_text, BACKGROUND_CHARS)}" for b in background]
        parts.insert(0, "\n".join([BACKGROUND_OPEN, *lines, BACKGROUND_CLOSE]))
    return "\n\n".join(parts)


async def background_of(store: Store, entries: list[JournalEntry]) -> list[Inbound]:
    """The group background for a turn (or a steering message) taking ``entries``: what came
    in unaddressed before the last of them and after what an earlier turn took."""
    last = max(entries, key=lambda e: e.id)
    return await store.background(last.inbound.chat, last.id, last.inbound.background)


class Session:
    """One session of a conversation: active history, summary, compaction counters.

    Args:
        store: where every change is written first.
        conversation_id: the conversation's row id.
        number: the session number (``conversations.session`` when it was current).
        history: the active history (messages not covered by the summary), oldest first.
        compaction: the summary and counters from the ``compaction`` table.
        key: the conversation's key (``ChatRef.key``).
    """

    def __init__(
        self,
        store: Store,
        conversation_id: int,
        number: int,
        history: list[Message],
        compaction: CompactionState,
        key: str = "",
    ) -> None:
        self._store = store
        self.conversation_id = conversation_id
        self.key = key  # the conversation's key (``ChatRef.key``): where its facts are flushed
        self.number = number
        self.history: list[Message] = []
        self.compaction = compaction
        self.summary_message: Message | None = None
        self.tokens = 0
        self._replace(history, compaction)

    @classmethod
    async def load(cls, store: Store, record: ConversationRecord, number: int) -> Session:
        """Read a session from the store (a running turn's messages are its own, not history)."""
        history = await store.history(record.id, number)
        state = await store.compaction_state(record.id, number)
        return cls(store, record.id, number, history, state, record.chat.key)

    @property
    def summary(self) -> str | None:
        return self.compaction.summary

    def _replace(self, history: list[Message], compaction: CompactionState) -> None:
        self.history = history
        self.compaction = compaction
        self.summary_message = summary_message(compaction.summary) if compaction.summary else None
        self.tokens = sum(m.tokens for m in history) + (self.summary_message.tokens if self.summary_message else 0)

    def adopt(self, messages: list[Message]) -> None:
        """A finished turn's messages (already stored by :meth:`Turn.finish`) join the history."""
        self.history.extend(messages)
        self.tokens += sum(m.tokens for m in messages)

    async def apply_compaction(self, outcome: CompactionOutcome, *, failed: bool, next_retry_at: float) -> None:
        """Persist one compaction (summary, covered and pruned rows, counters), then adopt its
        history. A failed summary only counts the failure and arms the backoff."""
        state = await self._store.save_compaction(
            self.conversation_id,
            self.number,
            summary=outcome.summary,
            covered_ids=outcome.covered_ids,
            pruned_ids=outcome.pruned_ids,
            passes=outcome.passes,
            failed=failed,
            next_retry_at=next_retry_at,
        )
        self._replace(outcome.messages, state)

    async def prune(self, history: list[Message], pruned_ids: list[int]) -> None:
        """Persist that ``pruned_ids`` show as the placeholder, then adopt ``history``."""
        await self._store.mark_pruned(pruned_ids)
        self._replace(history, self.compaction)


class Turn:
    """The turn in progress, recorded step by step (module docstring).

    Args:
        store: where every change is written first.
        conversation: the conversation's row.
        session: the session the turn runs in (kept even if ``/reset`` comes meanwhile).
        turn_id: the ``turns`` row.
        entries: the journal entries it answers (messages taken mid-turn are added).
        transcript: the turn's messages so far; the first is the user message.
        state: resumable state, saved with each checkpoint (route, resumes, outage facts).
        resumed: the turn was read back after a stop or a crash (rows it left open may wait).
        activity: the live event bus, told of each checkpoint (:class:`TurnEvents`).
    """

    def __init__(
        self,
        store: Store,
        conversation: ConversationRecord,
        session: Session,
        turn_id: int,
        entries: list[JournalEntry],
        transcript: list[Message],
        state: TurnState,
        *,
        resumed: bool = False,
        activity: Activity = NO_ACTIVITY,
    ) -> None:
        self._store = store
        self.events = TurnEvents(activity, conversation.chat.key, turn_id)
        self.conversation = conversation
        self.session = session
        self.id = turn_id
        self.entries = entries
        self.transcript = transcript
        #: the journal entries of each of the turn's user messages: its input first, then each
        #: taken mid-turn (:meth:`steer`); read back after a crash, the input's alone, and only
        #: when nothing was taken mid-turn
        self.inputs: list[tuple[Message, list[JournalEntry]]] = (
            [(transcript[0], list(entries))] if [m.role for m in transcript].count("user") == 1 else []
        )
        self.state = state
        #: the state as the store has it (a checkpoint writes it only when it changed)
        self._saved_state = state.as_dict()
        #: set by ``/stop``; the agent loop ends the turn at once (in memory only: a turn a
        #: crash cut off is resumed, a stop needs the process that runs it)
        self.stop = asyncio.Event()
        #: streaming rows this process already gave out (two streamed says never share one)
        self._streams: set[int] = set()
        self._stream_lock = asyncio.Lock()
        #: a row may be open that no stream here holds (the turn was resumed, or an outage
        #: paused one of its streams)
        self._left_open = resumed
        #: read back after a stop or a crash (not a turn this process began)
        self.resumed = resumed

    @property
    def chat(self) -> ChatRef:
        return self.conversation.chat

    @property
    def journal_ids(self) -> list[int]:
        return [e.id for e in self.entries]

    @property
    def user_message(self) -> Message:
        return self.transcript[0]

    async def set_context(self, context: TurnContext) -> None:
        """Record the ``[Turn context]`` the turn's user message is sent with (later requests
        of the conversation send it again with the message, as it was)."""
        user = self.user_message
        if user.id is not None:
            await self._store.set_context(user.id, context)
        user.set_context(context)

    async def record(self, message: Message, *, trace: dict[str, Any] | None = None) -> None:
        """Checkpoint one message: an assistant message before its tools run, or one tool result
        as it completes (kept in call order in memory). ``trace`` is saved with it. A step of
        the model's (an assistant message) is progress: the stalled resumes counted so far are
        forgotten, so only a turn cut off again and again at the same point is given up."""
        if message.role == "assistant" and not message.note:
            self.state.stalled_resumes = 0
        state = self._changed_state()
        await self._store.record(self.conversation.id, self.session.number, self.id, [message], state=state, trace=trace)
        self._state_saved(state)
        self._append(message)
        self.events.recorded(message, trace)

    async def record_all(self, messages: list[Message]) -> None:
        """Checkpoint several messages (and the state) in one transaction."""
        state = self._changed_state()
        await self._store.record(self.conversation.id, self.session.number, self.id, messages, state=state)
        self._state_saved(state)
        for message in messages:
            self._append(message)
            self.events.recorded(message)

    def _changed_state(self) -> dict[str, Any] | None:
        """The state to write with a checkpoint: ``None`` when the store has it already."""
        state = self.state.as_dict()
        return None if state == self._saved_state else state

    def _state_saved(self, state: dict[str, Any] | None) -> None:
        if state is not None:
            self._saved_state = state

    def _append(self, message: Message) -> None:
        if message.role == "tool":
            self._insert_result(message)
        else:
            self.transcript.append(message)

    def _insert_result(self, message: Message) -> None:
        start = len(self.transcript)
        while start > 0 and self.transcript[start - 1].role == "tool":
            start -= 1
        owner = self.transcript[start - 1] if start > 0 else None
        order = {cid: i for i, cid in enumerate(owner.tool_call_ids)} if owner is not None else {}
        rank = order.get(message.tool_call_id or "", len(order))
        at = len(self.transcript)
        while at > start and order.get(self.transcript[at - 1].tool_call_id or "", len(order)) > rank:
            at -= 1
        self.transcript.insert(at, message)

    async def prune(self, transcript: list[Message], pruned_ids: list[int]) -> None:
        """Persist that ``pruned_ids`` (tool results of this turn) show as the placeholder,
        then adopt ``transcript`` (the same messages, those results replaced)."""
        await self._store.mark_pruned(pruned_ids)
        self.transcript[:] = transcript

    async def refold(self, message: Message, entries: list[JournalEntry]) -> None:
        """One of the turn's inputs (:attr:`inputs`), kept as a file after it was taken
        (``TurnPreparer.refold``): ``message`` is rebuilt from ``entries`` (the same, their
        text the excerpt), in the store first, with its ``[Turn context]``."""
        new = user_message(entries, await background_of(self._store, entries))
        new.make_storable()
        assert message.id is not None
        await self._store.rewrite_message(message.id, new.content)
        new.id = message.id
        new.set_context(message.context)
        self.transcript[next(i for i, m in enumerate(self.transcript) if m is message)] = new
        self.inputs = [(new, list(entries)) if m is message else (m, e) for m, e in self.inputs]
        folded = {e.id: e for e in entries}
        self.entries = [folded.get(e.id, e) for e in self.entries]

    async def steer(self, entries: list[JournalEntry]) -> Message:
        """Take messages that arrived mid-turn into this turn (one user message), durably:
        after a crash they are answered by the resumed turn, not by a new one."""
        message = user_message(entries, await background_of(self._store, entries))
        await self._store.record(
            self.conversation.id, self.session.number, self.id, [message], journal_ids=[e.id for e in entries]
        )
        self.entries.extend(entries)
        self.transcript.append(message)
        self.inputs.append((message, list(entries)))
        return message

    async def speak(
        self, text: str, *, tool_call_id: str | None = None, shown: Message | None = None,
        stream: OutboxEntry | None = None, attachment: dict[str, Any] | None = None,
    ) -> OutboxEntry:
        """Queue ``text`` for the user in the outbox. ``shown`` is the assistant message that
        shows it in the history (a plain-text reply, a daemon note), written in the same
        transaction; a ``say`` call is its own record (its assistant message is already stored).
        ``stream`` is the streaming row (:meth:`open_stream`) that showed it being written.
        ``attachment`` is a file sent with it (``OutboxEntry.attachment``).
        """
        state = self._changed_state()
        entry = await self._store.speak(
            self.conversation.id, self.session.number, self.id, self.chat, text,
            tool_call_id=tool_call_id, message=shown, state=state, stream=stream, attachment=attachment,
        )
        self._state_saved(state)
        if shown is not None:
            self.transcript.append(shown)
        self.events.said(text, note=shown is not None and shown.note)
        return entry

    async def open_stream(self) -> OutboxEntry:
        """A streaming outbox row for a ``say`` being written: one this turn left open when it
        was cut off (a crash, an outage mid-stream), so its preview is taken over and never
        shown twice, else a new one."""
        async with self._stream_lock:  # a row is never seen unclaimed by open_streams
            for entry in await self._unclaimed():
                self._streams.add(entry.id)
                return entry
            entry = await self._store.open_stream(self.conversation.id, self.id, self.chat)
            self._streams.add(entry.id)
            return entry

    async def _unclaimed(self) -> list[OutboxEntry]:
        """Open streaming rows no stream of this process holds. Only a resumed turn, or one
        whose stream an outage paused, can have any: other turns skip the read."""
        if not self._left_open:
            return []
        return [
            e for e in await self._store.outbox_for_turn(self.id)
            if e.streaming and e.status == "pending" and e.id not in self._streams
        ]

    def release_stream(self, entry: OutboxEntry) -> None:
        """A streaming row left open (an outage): the turn's next stream may take it over."""
        self._streams.discard(entry.id)
        self._left_open = True

    async def stream_previewed(self, entry: OutboxEntry, preview_id: str, shown: str) -> OutboxEntry:
        """The platform message ``preview_id`` shows the streaming row ``entry`` now, with the
        text ``shown`` (kept so that a preview left open can be kept or taken down later)."""
        await self._store.stream_previewed(entry.id, preview_id, shown)
        return dataclasses.replace(entry, preview_id=preview_id, text=shown)

    async def open_streams(self) -> list[OutboxEntry]:
        """Streaming rows of this turn that no stream of this process holds (left open by a
        crash or an outage)."""
        async with self._stream_lock:
            return await self._unclaimed()

    def claim_stream(self, entry: OutboxEntry) -> None:
        """``entry`` (from :meth:`open_streams`) is taken over now."""
        self._streams.add(entry.id)

    async def settle_stream(self, entry: OutboxEntry, *, status: str, text: str | None = None, error: str | None = None) -> None:
        """Close a streaming row that no ``say`` took over (see ``Store.settle_stream``)."""
        await self._store.settle_stream(entry.id, status=status, text=text, error=error)

    async def save_state(self) -> None:
        state = self._changed_state()
        if state is not None:
            await self._store.record(self.conversation.id, self.session.number, self.id, [], state=state)
            self._state_saved(state)

    async def outbox(self) -> list[OutboxEntry]:
        """Every message this turn queued, oldest first (to resume a turn)."""
        return await self._store.outbox_for_turn(self.id)

    async def finish(self, *, status: str, trace: dict[str, Any], journal_status: str = "done") -> None:
        """Close the turn (status, trace, journal entries) in one transaction; its messages join
        its session's history."""
        await self._store.finish_turn(
            self.id, status=status, trace=trace, journal_ids=self.journal_ids, journal_status=journal_status,
            state=self._changed_state(),
        )
        self.session.adopt(self.transcript)
        self.events.ended(status, trace.get("stop_reason"))


class Conversation:
    """A conversation: where it lives, its current :class:`Session`, the turn in progress.

    Build it with :meth:`load`.
    """

    def __init__(
        self, store: Store, record: ConversationRecord, session: Session, inbox: Inbox | None = None,
        activity: Activity = NO_ACTIVITY,
    ) -> None:
        self._store = store
        self.activity = activity  # told of each turn's checkpoints
        #: the operator paused it: no turn takes its waiting messages (the engine keeps it)
        self.paused = False
        self.record = record
        self.session = session
        self.turn: Turn | None = None
        #: everything waiting for a turn (messages, bursts, files, a pending stop, the /reset fence)
        self.inbox = inbox if inbox is not None else Inbox()

    @classmethod
    async def load(
        cls, store: Store, chat: ChatRef, *, debounce_s: float = 0.0, activity: Activity = NO_ACTIVITY,
    ) -> Conversation:
        """The conversation of ``chat`` with its current session loaded."""
        record = await store.conversation(chat)
        session = await Session.load(store, record, record.session)
        return cls(store, record, session, Inbox(debounce_s=debounce_s), activity)

    @property
    def id(self) -> int:
        return self.record.id

    @property
    def chat(self) -> ChatRef:
        return self.record.chat

    @property
    def key(self) -> str:
        return self.record.chat.key

    def moved_to(self, chat: ChatRef) -> None:
        """The chat changed its id (``Store.move_chat`` already re-keyed the row)."""
        self.record = ConversationRecord(self.id, chat, self.record.session)
        self.session.key = chat.key

    async def reset(self, fence: int = 0) -> list[JournalEntry]:
        """``/reset``: a new, empty session from now on (a running turn finishes in its own).

        ``fence``: the journal id of the ``/reset`` message. Messages from people journaled
        before it that no turn has begun answering (waiting in the inbox, or taken by a turn
        still being prepared) are set aside: settled ``ignored`` in the same transaction as
        the new session, so neither this process nor the next start answers them in the new
        session. Returns them.
        """
        aside = self.inbox.set_aside(fence)
        number = await self._store.reset(self.id, set_aside=sorted(e.id for e in aside))
        if self.turn is None:
            self.inbox.take_stop()  # the stop that came with it was for what it set aside
        self.record = ConversationRecord(self.id, self.chat, number)
        self.session = Session(self._store, self.id, number, [], CompactionState(None, 0, 0, 0, 0.0), self.key)
        return aside

    async def begin_turn(self, entries: list[JournalEntry], state: TurnState) -> Turn | None:
        """Start a turn answering ``entries`` in the current session (checkpoint 0: the turn
        row and the user message). ``None`` when a ``/reset`` came after them while the turn
        was being prepared: they were set aside (:meth:`reset`), no turn begins."""
        self.inbox.began()
        entries = self.inbox.after_fence(entries)
        if not entries:
            self.inbox.take_stop()  # the stop that came with the /reset was for this turn
            return None
        user = user_message(entries, await background_of(self._store, entries))
        state.speaker_entry = entries[-1].id  # the person the turn answers (its [Turn context])
        session = self.session
        turn_id = await self._store.begin_turn(self.id, session.number, [e.id for e in entries], user, state.as_dict())
        self.turn = Turn(self._store, self.record, session, turn_id, list(entries), [user], state, activity=self.activity)
        self.turn.events.started(state.route, state.route_reason, len(entries))
        if self.inbox.take_stop():  # /stop came while the turn was being routed
            self.turn.stop.set()
        return self.turn

    async def resume_turn(self, running: RunningTurn, state: TurnState) -> Turn:
        """The turn ``running`` as it was recorded when the last process stopped.

        A legacy turn (no checkpoints yet) is rebuilt first: its user message from its journal
        entries, then one step of ``say`` calls, delivered, for the messages it had delivered
        (that is how it spoke), so what the user saw is what the resumed turn knows and it goes
        on from there. ``state`` is the state it starts with then.
        """
        if running.session == self.session.number:
            session = self.session
        else:  # /reset came after the turn began: it finishes in its own session
            session = await Session.load(self._store, self.record, running.session)
        if running.legacy:
            said = [e.text for e in await self._store.outbox_for_turn(running.id) if e.status == "sent"]
            transcript = [Message(role="user", content=merge_text(running.entries))]
            if said:
                calls = [
                    {"id": f"legacy_{running.id}_{i}", "type": "function",
                     "function": {"name": "say", "arguments": json.dumps({"text": text}, ensure_ascii=False)}}
                    for i, text in enumerate(said)
                ]
                transcript.append(Message(role="assistant", tool_calls=calls))
                transcript += [
                    Message(role="tool", content=LEGACY_SAID, tool_call_id=c["id"], name="say", ok=True) for c in calls
                ]
            await self._store.upgrade_turn(self.id, session.number, running.id, transcript, state.as_dict())
        else:
            transcript = await self._store.turn_messages(running.id)
            state = TurnState.from_dict(running.state)
        self.turn = Turn(
            self._store, self.record, session, running.id, list(running.entries), transcript, state, resumed=True,
            activity=self.activity,
        )
        self.turn.events.started(state.route, state.route_reason, len(running.entries), resumed=True)
        if self.inbox.take_stop():  # /stop came while the turn was being read back
            self.turn.stop.set()
        return self.turn

    async def reload(self) -> RunningTurn | None:
        """Read the conversation again from the store (after a failed write). Returns the
        half-recorded turn, if one is left running, so that it can be resumed.

        The inbox is read back too: the journal's pending entries of this chat that no turn
        has taken, oldest first. A failed ``begin_turn`` or steering write took its entries out
        of the inbox before it failed; the journal still holds them."""
        self.record = await self._store.conversation(self.chat)
        self.session = await Session.load(self._store, self.record, self.record.session)
        self.turn = None
        running = next((t for t in await self._store.running_turns() if t.conversation.id == self.id), None)
        taken = {e.id for e in running.entries} if running is not None else set()
        journal = [
            e for e in await self._store.pending_inbound()
            if e.inbound.chat == self.chat and e.id not in taken and e.turn_id is None
        ]
        self.inbox.replace_all(journal, taken)
        return running

    async def drop(self, entries: list[JournalEntry]) -> None:
        """``/stop`` while ``entries`` wait (for a file service): they are settled unanswered."""
        await self._store.settle_journal([e.id for e in entries], "ignored")

    def request_stop(self) -> bool:
        """``/stop``: the turn in progress stops (``Turn.stop``); a turn still being routed
        (the classifier call) stops as soon as it begins. ``False`` when already asked."""
        if self.turn is not None:
            if self.turn.stop.is_set():
                return False
            self.turn.stop.set()
            return True
        return self.inbox.request_stop()

    def turn_done(self) -> None:
        self.turn = None
        self.inbox.take_stop()
