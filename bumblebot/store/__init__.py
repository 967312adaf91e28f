"""Persistence in SQLite (aiosqlite): conversations, history and compaction state, the
journal of inbound messages, turns, the outbox, tasks and the key-value memory."""

from bumblebot.store.store import (
    MIGRATIONS,
    CompactionState,
    ConversationRecord,
    JournalEntry,
    OutboxEntry,
    Pruned,
    RunningTurn,
    Store,
    TaskRecord,
    TooManyTasks,
)

__all__ = [
    "MIGRATIONS", "CompactionState", "ConversationRecord", "JournalEntry", "OutboxEntry", "Pruned", "RunningTurn",
    "Store", "TaskRecord", "TooManyTasks",
]
