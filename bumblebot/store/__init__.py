"""Persistence in SQLite (aiosqlite): conversations, history and compaction state, the
journal of inbound messages, turns, the outbox, tasks and the key-value memory."""

from bumblebot.store.records import (
    CompactionState,
    ConversationRecord,
    JournalEntry,
    OutboxEntry,
    Pruned,
    RunningTurn,
    TaskRecord,
)
from bumblebot.store.schema import MIGRATIONS
from bumblebot.store.store import Store
from bumblebot.store.tasks import TooManyTasks

__all__ = [
    "MIGRATIONS", "CompactionState", "ConversationRecord", "JournalEntry", "OutboxEntry", "Pruned", "RunningTurn",
    "Store", "TaskRecord", "TooManyTasks",
]
