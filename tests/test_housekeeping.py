"""Bounded growth (bumblebot/store/housekeeping.py): outbox expiry and retention.

Real SQLite files; rows are written with the store and then given old timestamps. The sweeper
path is driven through ``Engine.sweep_outbox`` with a real :class:`Delivery` and a fake
:class:`Adapter` subclass; clocks are passed in, nothing sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from bumblebot.core.adapter import Adapter
from bumblebot.core.errors import DeliveryFailed
from bumblebot.core.events import ChatKind, ChatRef, Inbound, Platform
from bumblebot.core.messages import Message
from bumblebot.core.settings import EngineSettings
from bumblebot.delivery import Delivery
from bumblebot.runtime.engine import Engine
from bumblebot.store import MIGRATIONS, Pruned, Store

DAY = 86400.0
NOW = time.time()
OLD = NOW - 91 * DAY  # past the default 90-day retention
RECENT = NOW - 89 * DAY
CHAT = ChatRef(Platform.CONSOLE, "c")


class Console(Adapter):
    """A console platform that records what it sends; ``down`` makes sends fail (retryable)."""

    platform = Platform.CONSOLE

    def __init__(self) -> None:
        self.sent: list[str] = []
        self.down = False

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def chunks(self, text: str) -> Sequence[Any]:
        return [text]

    async def send_chunk(self, chat: ChatRef, chunk: Any, *, key: str) -> str:
        if self.down:
            raise DeliveryFailed("platform down", retryable=True)
        self.sent.append(chunk)
        return str(len(self.sent))

    async def send_typing(self, chat: ChatRef) -> None: ...


@asynccontextmanager
async def engine_on(path: Path, store_cls: type[Store] = Store, **engine: Any) -> AsyncIterator[tuple[Engine, Store, Console]]:
    """An engine with a real store and delivery; no turns run (no runner, no prompts needed)."""
    async with store_cls(path) as store:
        console = Console()
        delivery = Delivery(store, attempts=1)
        delivery.register(console)
        yield Engine(EngineSettings(**engine), store, None, delivery, None), store, console  # type: ignore[arg-type]


async def backdate(store: Store, table: str, row_id: int, **columns: float) -> None:
    sets = ", ".join(f"{name}=?" for name in columns)
    async with store.transaction() as db:
        await db.execute(f"UPDATE {table} SET {sets} WHERE id=?", (*columns.values(), row_id))


async def queue(store: Store, text: str, *, at: float, turn_id: int | None = None) -> int:
    conversation = await store.conversation(CHAT)
    entry = await store.outbox_add(conversation.id, turn_id, CHAT, text)
    await backdate(store, "outbox", entry.id, created_at=at)
    return entry.id


async def journal(store: Store, message_id: str, *, at: float, status: str) -> int:
    inbound = Inbound(chat=CHAT, message_id=message_id, sender_id="u", sender_name="U", text=message_id,
                      chat_kind=ChatKind.PRIVATE)
    journal_id = await store.journal(inbound, status="pending" if status == "pending" else "ignored")
    assert journal_id is not None
    async with store.transaction() as db:
        await db.execute(
            "UPDATE journal SET status=?, received_at=?, done_at=? WHERE id=?",
            (status, at, None if status == "pending" else at, journal_id),
        )
    return journal_id


async def column(store: Store, sql: str, *params: Any) -> list[Any]:
    return [r[0] for r in await store._all(sql, params)]


# -- outbox expiry --------------------------------------------------------------------------------


async def test_a_pending_row_past_expiry_is_marked_failed_and_never_sent(tmp_path, caplog, store_location):
    async with engine_on(store_location) as (engine, store, console):
        console.down = True
        stale = await queue(store, "yesterday's answer", at=NOW)
        assert await engine.sweep_outbox() == 0  # platform down: it stays pending, with its error
        await backdate(store, "outbox", stale, created_at=time.time() - 25 * 3600)
        fresh = await queue(store, "today's answer", at=time.time() - 3600)
        console.down = False
        with caplog.at_level(logging.WARNING, logger="bumblebot.runtime.engine"):
            assert await engine.sweep_outbox() == 1
        assert console.sent == ["today's answer"]
        expired = await store.outbox_entry(stale)
        assert expired is not None and expired.status == "failed"
        assert expired.last_error == (
            "expired: not delivered within 24 h of being queued (last error: platform down)"
        )
        [warning] = [r for r in caplog.records if "expired" in r.getMessage()]
        assert warning.levelno == logging.WARNING
        assert f"outbox message {stale} to console:c expired undelivered after 25 h" in warning.getMessage()
        # never again: not by the next sweep, not by a direct retry of that very row
        assert await engine.sweep_outbox() == 0
        assert await engine._delivery.retry_pending({stale}) == 0
        assert console.sent == ["today's answer"]
        assert (await store.outbox_entry(fresh)).status == "sent"  # type: ignore[union-attr]


async def test_the_expiry_bound_is_the_configured_one(tmp_path, store_location):
    async with engine_on(store_location, outbox_expiry_s=600) as (engine, store, _):
        old = await queue(store, "ten minutes late", at=NOW - 601)
        young = await queue(store, "nine minutes late", at=NOW - 540)
        assert await engine.expire_outbox(now=NOW) == 1
        assert [(await store.outbox_entry(i)).status for i in (old, young)] == ["failed", "pending"]  # type: ignore[union-attr]
        assert (await store.outbox_entry(old)).last_error == "expired: not delivered within 600 s of being queued"  # type: ignore[union-attr]


async def test_start_expires_before_resumed_turns_or_the_sweeper_can_send(tmp_path, store_location):
    path = store_location
    async with Store(path) as store:
        stale = await queue(store, "from two days ago", at=NOW - 2 * DAY)
    async with engine_on(path) as (engine, store, console):
        await engine.start({Platform.CONSOLE})
        try:
            assert (await store.outbox_entry(stale)).status == "failed"  # type: ignore[union-attr]
            engine.mark_ready()
            assert await engine.sweep_outbox() == 0
        finally:
            await engine.stop()
        assert console.sent == []


async def test_expiry_runs_in_batches(tmp_path, store_location):
    async with Store(store_location) as store:
        ids = [await queue(store, f"m{i}", at=OLD) for i in range(7)]
        expired = await store.expire_outbox(NOW, error="expired", batch=3)
        assert [entry.id for entry, _ in expired] == ids
        assert all(created == OLD for _, created in expired)
        assert await store.outbox_pending() == []


# -- retention ------------------------------------------------------------------------------------


async def test_retention_prunes_old_settled_rows_and_keeps_history_and_pending(tmp_path, store_location):
    async with engine_on(store_location) as (engine, store, _):
        conversation = await store.conversation(CHAT)
        # journal: settled old rows go; pending old and settled recent rows stay
        gone_journal = [await journal(store, f"old-{s}", at=OLD, status=s) for s in ("done", "ignored", "failed")]
        kept_journal = [
            await journal(store, "old-pending", at=OLD, status="pending"),
            await journal(store, "recent-done", at=RECENT, status="done"),
        ]
        # turns: an old finished one loses its trace and state (its row and messages stay), a
        # recent one keeps them, an old one still running keeps everything
        old_turn = await store.import_history(
            conversation, [Message(role="user", content="hello in spring"), Message(role="assistant", content="hi!")]
        )
        recent_turn = await store.import_history(conversation, [Message(role="user", content="recent")])
        running = await store.begin_turn(conversation.id, conversation.session, [kept_journal[0]],
                                         Message(role="user", content="old-pending"), {"active": True})
        async with store.transaction() as db:
            await db.execute("UPDATE turns SET trace='{\"steps\": 3}', state='{\"x\": 1}'")
        await backdate(store, "turns", old_turn, started_at=OLD, ended_at=OLD)
        await backdate(store, "turns", recent_turn, started_at=RECENT, ended_at=RECENT)
        await backdate(store, "turns", running, started_at=OLD)
        # outbox: settled old rows go; pending old ones and those of a running turn stay
        gone_outbox = [await queue(store, "old sent", at=OLD), await queue(store, "old failed", at=OLD)]
        await store.outbox_progress(gone_outbox[0], status="sent", message_ids=["1"])
        await store.outbox_progress(gone_outbox[1], status="failed", message_ids=[], error="forbidden")
        await backdate(store, "outbox", gone_outbox[0], sent_at=OLD)
        kept_outbox = [
            await queue(store, "old pending", at=OLD),
            await queue(store, "old, of the running turn", at=OLD, turn_id=running),
            await queue(store, "recent sent", at=RECENT),
        ]
        await store.outbox_progress(kept_outbox[1], status="sent", message_ids=["2"])
        await store.outbox_progress(kept_outbox[2], status="sent", message_ids=["3"])
        await backdate(store, "outbox", kept_outbox[1], sent_at=OLD)
        messages_before = await column(store, "SELECT id FROM messages ORDER BY id")
        history_before = [(m.id, m.role, m.content) for m in await store.history(conversation.id, conversation.session)]

        assert await engine.prune(now=NOW) == Pruned(journal=3, outbox=2, traces=1)

        assert await column(store, "SELECT id FROM journal ORDER BY id") == kept_journal
        assert not set(gone_journal) & set(kept_journal)
        assert await column(store, "SELECT id FROM outbox ORDER BY id") == kept_outbox
        turns = {r["id"]: r for r in await store._all("SELECT * FROM turns")}
        assert set(turns) == {old_turn, recent_turn, running}  # no turn row is deleted
        assert (turns[old_turn]["status"], turns[old_turn]["trace"], turns[old_turn]["state"]) == ("done", None, None)
        assert turns[recent_turn]["trace"] == '{"steps": 3}'
        assert (turns[running]["trace"], turns[running]["state"]) == ('{"steps": 3}', '{"x": 1}')
        assert await column(store, "SELECT id FROM messages ORDER BY id") == messages_before  # history stays
        assert await column(store, "SELECT turn_id FROM messages WHERE turn_id=?", old_turn) == [old_turn] * 2
        history = await store.history(conversation.id, conversation.session)
        assert [(m.id, m.role, m.content) for m in history] == history_before
        assert [m.content for m in history][:2] == ["hello in spring", "hi!"]
        assert [t["trace"] for t in await store.recent_turns(conversation.id)][-1] == {}  # trace still reads
        # a redelivery of a recent message is still a duplicate; the pending one still waits
        inbound = Inbound(chat=CHAT, message_id="recent-done", sender_id="u", sender_name="U", text="again",
                          chat_kind=ChatKind.PRIVATE)
        assert await store.journal(inbound) is None
        assert [e.id for e in await store.pending_inbound()] == [kept_journal[0]]
        # a second pass finds nothing more
        assert await engine.prune(now=NOW) == Pruned()


async def test_retention_is_configurable_and_zero_keeps_everything(tmp_path, store_location):
    async with engine_on(store_location, retention_days=0) as (engine, store, _):
        await journal(store, "ancient", at=NOW - 3650 * DAY, status="done")
        assert await engine.prune(now=NOW) == Pruned()
        assert len(await column(store, "SELECT id FROM journal")) == 1
    async with engine_on(store_location, retention_days=7) as (engine, store, _):
        await journal(store, "last week", at=NOW - 8 * DAY, status="done")
        await journal(store, "this week", at=NOW - 6 * DAY, status="done")
        assert await engine.prune(now=NOW) == Pruned(journal=2)  # "ancient" and "last week"
        assert await column(store, "SELECT message_id FROM journal") == ["this week"]


async def test_pruning_goes_in_short_batches_that_let_other_writers_in(tmp_path, store_location):
    class Counting(Store):
        def __init__(self, path: Path) -> None:
            super().__init__(path)
            self.committed = asyncio.Event()

        @contextlib.asynccontextmanager
        async def transaction(self) -> Any:
            async with super().transaction() as db:
                yield db
            self.committed.set()

    async with Counting(store_location) as store:
        for i in range(10):
            await journal(store, f"m{i}", at=OLD, status="done")
        store.committed.clear()

        async def a_turn_writes() -> int:
            # what a checkpoint does; it sees how far the prune got
            async with store.transaction() as db, db.execute("SELECT COUNT(*) FROM journal") as cur:
                row = await cur.fetchone()
            return int(row[0])

        pruning = asyncio.create_task(store.prune(NOW, batch=3))
        await asyncio.wait_for(store.committed.wait(), 5)  # the first batch of 3 is gone
        writing = asyncio.create_task(a_turn_writes())
        assert await writing in (7, 4)  # the writer got in between batches, not after all of them
        assert (await pruning).journal == 10
        assert await column(store, "SELECT id FROM journal") == []


async def test_housekeeping_prunes_as_soon_as_the_engine_is_ready(tmp_path, store_location):
    class Watched(Store):
        pruned = asyncio.Event()

        async def prune(self, before: float, *, batch: int = 500) -> Pruned:
            result = await super().prune(before, batch=batch)
            self.pruned.set()
            return result

    path = store_location
    async with Store(path) as store:
        await journal(store, "long ago", at=OLD, status="done")
    async with engine_on(path, store_cls=Watched) as (engine, store, _):
        await engine.start({Platform.CONSOLE})
        try:
            assert not Watched.pruned.is_set()  # not before the adapters are connected
            engine.mark_ready()
            await asyncio.wait_for(Watched.pruned.wait(), 5)
        finally:
            await engine.stop()
        assert await column(store, "SELECT id FROM journal") == []


async def test_the_retention_indexes_exist_after_migration(tmp_path):
    async with Store(tmp_path / "b.db") as store:
        assert (await store._one("PRAGMA user_version"))[0] == len(MIGRATIONS)  # type: ignore[index]
        names = set(await column(store, "SELECT name FROM sqlite_master WHERE type='index'"))
        assert {"journal_by_age", "outbox_by_age", "turns_with_trace"} <= names
        plan = " ".join(
            str(r[3]) for r in await store._all(
                "EXPLAIN QUERY PLAN SELECT id FROM turns WHERE trace IS NOT NULL AND started_at < 1"
            )
        )
        assert "turns_with_trace" in plan
