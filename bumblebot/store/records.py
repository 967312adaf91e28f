"""The records the store hands out: one frozen dataclass per kind of row a caller reads back.

They carry no behaviour and know nothing of SQL; the table modules (``conversations``,
``history``, ``journal``, ``turns``, ``outbox``, ``tasks``, ``retention``) build them from rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bumblebot.core.events import ChatRef, Inbound


@dataclass(frozen=True, slots=True)
class ConversationRecord:
    """A conversation's row: its id, where it lives, and its current session number."""

    id: int
    chat: ChatRef
    session: int


@dataclass(frozen=True, slots=True)
class JournalEntry:
    """One journaled inbound message. ``media`` is what fetching its attachments gave
    (``bumblebot.media.intake.Prepared`` as JSON), ``None`` until they were fetched."""

    id: int
    inbound: Inbound
    status: str
    turn_id: int | None = None
    media: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class OutboxEntry:
    id: int
    conversation_id: int
    turn_id: int | None
    chat: ChatRef
    text: str
    status: str
    platform_message_ids: list[str]
    attempts: int
    last_error: str | None
    tool_call_id: str | None = None
    #: the platform message showing this row's text while it was streamed (edited into the
    #: first chunk when the row is delivered), ``None`` if none was shown
    preview_id: str | None = None
    #: the model is still writing the text: not to be sent by any sweep
    streaming: bool = False
    #: a file to send with (or, for a ``document``/``photo``, as) this message:
    #: ``{"kind": "photo"|"document"|"voice", "path": str|None, "name": str}``; a ``voice`` of
    #: a reply has no path until its speech is made (``bumblebot.delivery.outbox``)
    attachment: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class TaskRecord:
    """A scheduled task (``tasks`` row): ``kind`` ``once``/``every``/``cron`` with its ``spec``
    and time zone, the text to do, when it was made (epoch s), when it is due next (``None``
    once it has run for good), ``status`` ``active``/``done``/``cancelled``, how many times it
    ran, and the chat of its conversation."""

    id: int
    conversation_id: int
    chat: ChatRef
    kind: str
    spec: str
    tz: str
    text: str
    created_at: float
    next_due: float | None
    status: str
    runs: int
    last_due: float | None


@dataclass(frozen=True, slots=True)
class Pruned:
    """What one :meth:`Store.prune` removed: rows deleted (``journal``, ``outbox``) and turns
    whose ``trace`` and ``state`` were cleared (``traces``)."""

    journal: int = 0
    outbox: int = 0
    traces: int = 0

    @property
    def total(self) -> int:
        return self.journal + self.outbox + self.traces


@dataclass(frozen=True, slots=True)
class CompactionState:
    summary: str | None
    compactions: int
    passes: int
    failures: int
    next_retry_at: float


@dataclass(frozen=True, slots=True)
class RunningTurn:
    """A turn left ``running`` by a crash or a stop past the grace period: resumable.

    Args:
        id: the turn id.
        conversation: the conversation it belongs to (``session`` is the current one).
        session: the session the turn started in.
        state: the turn's resumable state (JSON object written by the engine).
        trace: the trace saved with its last checkpoint.
        entries: the journal entries it answers, oldest first (steered ones included).
        legacy: written by a version without step checkpoints (schema 1): it has no messages
            and no state yet.
    """

    id: int
    conversation: ConversationRecord
    session: int
    state: dict[str, Any]
    trace: dict[str, Any]
    entries: list[JournalEntry]
    legacy: bool = False
