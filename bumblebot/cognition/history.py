"""What cognition reads and changes of a conversation: the session's history and the turn's
transcript. The runtime's ``Session`` and ``Turn`` (``bumblebot/runtime/conversation.py``)
are the one writer of both; compaction and the requests see them through these protocols."""

from __future__ import annotations

from typing import Protocol

from bumblebot.cognition.compaction import CompactionOutcome
from bumblebot.core.messages import Message
from bumblebot.store import CompactionState


class History(Protocol):
    """A session: its active history, its compaction state and summary, their token estimate."""

    key: str
    history: list[Message]
    compaction: CompactionState
    summary_message: Message | None
    tokens: int

    async def apply_compaction(self, outcome: CompactionOutcome, *, failed: bool, next_retry_at: float) -> None:
        """Record a compaction pass (or a failed one) and take its result."""

    async def prune(self, history: list[Message], pruned_ids: list[int]) -> None:
        """Record that old tool results were cleared, and take the history that shows it."""


class Transcript(Protocol):
    """The turn in progress: its messages so far, the user message first."""

    transcript: list[Message]

    async def prune(self, transcript: list[Message], pruned_ids: list[int]) -> None:
        """Record that tool results of the turn were cleared, and take the transcript that shows it."""
