"""The console's reads (``bumblebot/store/console.py``) on a real SQLite file, with rows written
through the store's own writers, and their query plans: no full scan of a big table."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from bumblebot.core.events import ChatRef, Inbound, Platform
from bumblebot.core.messages import Message
from bumblebot.core.usage import Scope, Usage
from bumblebot.store import Store
from bumblebot.store.console import LATENCY_SAMPLE

ALICE = ChatRef(Platform.TELEGRAM, "100")
BOB = ChatRef(Platform.TELEGRAM, "200")
TOPIC = ChatRef(Platform.DISCORD, "300", "77")


@dataclass
class Done:
    turn: int
    journal: int
    outbox: int
    user: int


async def chat_turn(
    store: Store, chat: ChatRef, text: str, reply: str, *, status: str = "done", trace: dict[str, Any] | None = None,
    send: bool = True, tool: bool = True,
) -> Done:
    """One answered message, as the engine writes it: journal, turn, a tool step, the reply
    spoken (and sent), the turn finished."""
    conversation = await store.conversation(chat)
    journal = await store.journal(Inbound(chat, f"m{time.monotonic_ns()}", "11", "Alice", text))
    assert journal is not None
    user = Message("user", text)
    turn = await store.begin_turn(conversation.id, conversation.session, [journal], user, {})
    if tool:
        call = {"id": f"c{turn}", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a"}'}}
        await store.record(
            conversation.id, conversation.session, turn,
            [Message("assistant", "", tool_calls=[call]), Message("tool", "file text " * 20, tool_call_id=f"c{turn}", ok=True)],
        )
    entry = await store.speak(conversation.id, conversation.session, turn, chat, reply, message=Message("assistant", reply))
    if send:
        await store.outbox_progress(entry.id, status="sent", message_ids=["1"])
    await store.finish_turn(
        turn, status=status, trace=trace or {"route": "main", "stop_reason": "answered"}, journal_ids=[journal],
        journal_status="done" if status == "done" else "failed",
    )
    assert user.id is not None
    return Done(turn, journal, entry.id, user.id)


def today(now: float) -> str:
    return datetime.fromtimestamp(now, UTC).strftime("%Y-%m-%d")


async def test_the_conversation_list_is_paged_by_last_activity_with_counts_of_its_rows(tmp_path: Path, store_location) -> None:
    now = time.time()
    used = Usage("http://127.0.0.1:1/v1", "m", prompt=1000, cached=200, completion=50)
    async with Store(store_location) as store:
        await chat_turn(store, ALICE, "hi", "hello")
        await chat_turn(store, BOB, "hey", "hello bob", tool=False)
        await chat_turn(store, TOPIC, "in a thread", "yes")
        await store.add_usage(today(now), Scope(conversation=ALICE.key, sender="11", kind="turn"), used, 0.25)
        await store.add_usage("2020-01-01", Scope(conversation=ALICE.key, sender="11", kind="turn"), used, 0.5)
        await store.add_usage(today(now), Scope(conversation=BOB.key, sender="11", kind="turn"), used, None)
        # Alice writes again: she is the most recent; Bob's reply is sent after that
        await store.journal(Inbound(ALICE, "again", "11", "Alice", "one more"))
        late = await store.outbox_add((await store.conversation(BOB)).id, None, BOB, "late note")
        await store.outbox_progress(late.id, status="sent", message_ids=["9"])
        await store.write("UPDATE conversations SET title = 'Bob_s 100% chat', paused_at = ? WHERE chat_id = '200'", (now,))

        rows, total = await store.console_conversations()
        assert total == 3
        assert [r["key"] for r in rows] == ["telegram:200", "telegram:100", "discord:300:77"]
        bob, alice, topic = rows
        assert bob == {
            "key": "telegram:200", "platform": "telegram", "chat_id": "200", "thread_id": "", "title": "Bob_s 100% chat",
            "last_active": bob["last_active"], "messages": 2, "tokens": 1050, "cost": 0.0, "paused": True,
        }
        assert (alice["messages"], alice["tokens"], alice["cost"], alice["paused"]) == (4, 2100, 0.75, False)
        assert (topic["thread_id"], topic["messages"], topic["tokens"]) == ("77", 4, 0)
        assert bob["last_active"] >= alice["last_active"] >= topic["last_active"] >= now

        page, total = await store.console_conversations(offset=1, limit=1)
        assert ([r["key"] for r in page], total) == (["telegram:100"], 3)
        assert [r["key"] for r in (await store.console_conversations(platform="discord"))[0]] == ["discord:300:77"]
        assert [r["key"] for r in (await store.console_conversations(state="paused"))[0]] == ["telegram:200"]
        assert (await store.console_conversations(state="active"))[1] == 2
        assert [r["key"] for r in (await store.console_conversations(query="00%"))[0]] == ["telegram:200"]  # % literal
        assert [r["key"] for r in (await store.console_conversations(query="s_1"))[0]] == []  # _ literal
        assert [r["key"] for r in (await store.console_conversations(query="bob_S"))[0]] == ["telegram:200"]
        assert [r["key"] for r in (await store.console_conversations(query="30"))[0]] == ["discord:300:77"]
        with pytest.raises(ValueError):
            await store.console_conversations(state="asleep")


async def test_last_activity_follows_journaled_messages_and_sent_rows_only(tmp_path: Path, store_location) -> None:
    async with Store(store_location) as store:
        bob = await store.conversation(BOB)
        entry = await store.outbox_add(bob.id, None, BOB, "queued")
        await store.write("UPDATE conversations SET last_active_at = 5")
        await store.outbox_progress(entry.id, status="pending", message_ids=[], error="flood wait")
        assert (await store._one("SELECT last_active_at FROM conversations"))[0] == 5  # type: ignore[index]
        await store.outbox_progress(entry.id, status="sent", message_ids=["1"])
        sent = (await store._one("SELECT last_active_at FROM conversations"))[0]  # type: ignore[index]
        assert sent > 5
        await store.write("UPDATE conversations SET last_active_at = 5")
        await store.journal(Inbound(BOB, "m1", "22", "Bob", "hi"))
        assert (await store._one("SELECT last_active_at FROM conversations"))[0] > 5  # type: ignore[index]


async def test_history_pages_the_session_with_compaction_boundaries_summary_and_pruned_results(tmp_path: Path, store_location) -> None:
    async with Store(store_location) as store:
        turns = [await chat_turn(store, ALICE, f"question {n}", f"answer {n}") for n in range(4)]
        conversation = await store.conversation(ALICE)
        ids = [r["id"] for r in await store._all("SELECT id FROM messages ORDER BY id")]
        assert len(ids) == 16  # 4 turns of user, tool call, tool result, reply
        # the first turn is the protected head; turns 2 and 3 are folded into the summary
        await store.save_compaction(
            conversation.id, conversation.session, summary="They asked four questions.", covered_ids=ids[4:12],
            pruned_ids=[ids[14]], passes=1, failed=False,
        )
        page = await store.console_history(ALICE.key)
        assert (page["session"], page["summary"], page["more"]) == (1, "They asked four questions.", False)
        shown = page["messages"]
        assert [m["id"] for m in shown] == ids[:4] + ids[12:]
        assert [m["id"] for m in shown if m["boundary"]] == [ids[12]]
        assert [m["id"] for m in shown if m["pruned"]] == [ids[14]]
        first, call, result, reply = shown[:4]
        assert (first["role"], first["content"], first["id"]) == ("user", "question 0", turns[0].user)
        assert call["tool_calls"][0]["function"]["name"] == "read_file" and call["content"] == ""
        assert (result["role"], result["tool_call_id"], result["content"].startswith("file text")) == ("tool", call["tool_calls"][0]["id"], True)
        assert set(reply) == {"id", "role", "content", "tool_calls", "tool_call_id", "pruned", "boundary", "at"}

        newest = await store.console_history(ALICE.key, limit=3)
        assert [m["id"] for m in newest["messages"]] == ids[13:] and newest["more"]
        older = await store.console_history(ALICE.key, before=ids[13], limit=3)
        assert [m["id"] for m in older["messages"]] == [ids[2], ids[3], ids[12]] and older["more"]
        assert [m["boundary"] for m in older["messages"]] == [False, False, True]
        oldest = await store.console_history(ALICE.key, before=ids[2], limit=3)
        assert [m["id"] for m in oldest["messages"]] == ids[:2] and not oldest["more"]

        await store.reset(conversation.id)  # a new session starts empty
        assert await store.console_history(ALICE.key) == {"session": 2, "summary": None, "messages": [], "more": False}
        assert (await store.console_history("telegram:999"))["session"] is None
        assert (await store.console_history("nonsense"))["messages"] == []


async def test_turns_are_listed_newest_first_and_one_turn_has_what_it_answered_and_sent(tmp_path: Path, store_location) -> None:
    async with Store(store_location) as store:
        first = await chat_turn(store, ALICE, "one", "reply one", trace={"route": "main", "steps": [{"n": 1}]})
        second = await chat_turn(store, ALICE, "two", "reply two", send=False)
        await chat_turn(store, BOB, "other chat", "x")
        conversation = await store.conversation(ALICE)
        running = await store.begin_turn(conversation.id, 1, [], Message("user", "three"), {})

        turns = await store.console_turns(ALICE.key)
        assert [t["id"] for t in turns] == [second.turn, first.turn]
        assert turns[1]["trace"] == {"route": "main", "steps": [{"n": 1}]}
        assert set(turns[0]) == {"id", "started_at", "finished_at", "status", "trace"}
        assert turns[0]["status"] == "done" and turns[0]["finished_at"] >= turns[0]["started_at"]
        assert [t["id"] for t in await store.console_turns(ALICE.key, offset=1, limit=5)] == [first.turn]
        assert await store.console_turns("telegram:999") == [] and await store.console_turns("bad") == []

        one = await store.console_turn(first.turn)
        assert one is not None
        assert (one["conversation"], one["session"], one["status"]) == ("telegram:100", 1, "done")
        assert [(j["id"], j["text"], j["sender"], j["status"]) for j in one["inbound"]] == [(first.journal, "one", "Alice", "done")]
        assert [(o["id"], o["text"], o["status"]) for o in one["outbox"]] == [(first.outbox, "reply one", "sent")]
        assert one["outbox"][0]["sent_at"] is not None
        # what it recorded: the user's message, the step's call with its arguments, the result, the reply
        assert [m["role"] for m in one["messages"]] == ["user", "assistant", "tool", "assistant"]
        call = one["messages"][1]["tool_calls"][0]["function"]
        assert (call["name"], call["arguments"]) == ("read_file", '{"path": "a"}')
        assert one["messages"][2]["content"].startswith("file text") and one["messages"][3]["content"] == "reply one"
        live = await store.console_turn(running)
        assert live is not None and (live["status"], live["finished_at"], live["trace"]) == ("running", None, {})
        assert await store.console_turn(9999) is None


async def test_tasks_are_listed_active_soonest_first_then_ended(tmp_path: Path, store_location) -> None:
    async with Store(store_location) as store:
        alice = await store.conversation(ALICE)
        bob = await store.conversation(BOB)
        add: dict[str, Any] = {"turn_id": None, "max_active": 10}
        late = await store.add_task(alice.id, kind="cron", spec="0 9 * * 1-5", tz="Europe/Paris", text="standup", due=3000.0, **add)
        soon = await store.add_task(bob.id, kind="every", spec="7200", tz="UTC", text="drink water", due=1000.0, **add)
        once = await store.add_task(alice.id, kind="once", spec="2026-12-24T18:00:00+01:00", tz="UTC", text="gifts", due=2000.0, **add)
        gone = await store.add_task(bob.id, kind="every", spec="90", tz="UTC", text="spam", due=500.0, **add)
        assert await store.cancel_task(bob.id, gone)

        rows, total = await store.console_tasks()
        assert total == 4
        assert [r["id"] for r in rows] == [soon, once, late, gone]
        assert rows[0] == {
            "id": soon, "conversation": "telegram:200", "schedule": "every 2 hours", "next_due": 1000.0,
            "last_run": None, "status": "active", "prompt": "drink water",
        }
        assert [r["schedule"] for r in rows[1:]] == [
            "once at 2026-12-24T18:00:00+01:00", "cron 0 9 * * 1-5 (Europe/Paris)", "every 90 seconds",
        ]
        assert rows[3]["status"] == "cancelled" and rows[3]["next_due"] is None
        assert [r["id"] for r in (await store.console_tasks(offset=2, limit=2))[0]] == [late, gone]
        assert [r["id"] for r in (await store.console_tasks(offset=3, limit=2))[0]] == [gone]
        assert (await store.console_tasks(offset=4))[0] == []


async def test_the_overview_counts_failures_usage_turns_and_reply_latency(tmp_path: Path, store_location) -> None:
    now = time.time()
    used = Usage("http://127.0.0.1:1/v1", "m", prompt=1000, cached=400, completion=100)
    async with Store(store_location) as store:
        fast = await chat_turn(store, ALICE, "fast", "quick")
        slow = await chat_turn(store, BOB, "slow", "took a while")
        await chat_turn(store, ALICE, "model broke", "sorry", status="failed",
                        trace={"stop_reason": "model_error", "error": "HTTP 500"})
        await chat_turn(store, BOB, "crash", "sorry", status="failed", trace={"stop_reason": "crash", "error_id": "ab12"})
        unsent = await chat_turn(store, TOPIC, "never answered", "lost", send=False)
        await store.outbox_progress(unsent.outbox, status="failed", message_ids=[], error="Forbidden: bot was blocked")
        pending = await store.outbox_add((await store.conversation(TOPIC)).id, None, TOPIC, "x" * 500)
        await store.outbox_add((await store.conversation(TOPIC)).id, None, TOPIC, "also waiting")
        await store.outbox_progress(pending.id, status="failed", message_ids=[], error="too long")
        # reply latency: 2 s and 10 s; a message received 2 days ago does not count
        for done, wait in ((fast, 2.0), (slow, 10.0)):
            await store.write("UPDATE journal SET received_at = ? WHERE id = ?", (now - 600, done.journal))
            await store.write("UPDATE outbox SET sent_at = ? WHERE id = ?", (now - 600 + wait, done.outbox))
        old = await chat_turn(store, ALICE, "old", "old reply")
        await store.write("UPDATE journal SET received_at = ? WHERE id = ?", (now - 2 * 86400, old.journal))
        await store.write("UPDATE turns SET started_at = ? WHERE id = ?", (now - 2 * 86400, old.turn))
        await store.write("UPDATE turns SET started_at = ? WHERE id = ?", (now - 3 * 3600, fast.turn))
        await store.add_usage(today(now), Scope(conversation=ALICE.key, sender="11", kind="turn"), used, 0.5)
        await store.add_usage(today(now), Scope(conversation=BOB.key, sender="22", kind="turn"), used, 0.25)
        await store.add_usage(today(now - 2 * 86400), Scope(conversation=BOB.key, kind="summary"), used, 1.0)
        await store.add_usage(today(now - 40 * 86400), Scope(conversation=BOB.key, kind="turn"), used, 9.0)

        o = await store.console_overview(now)
        assert o["outbox"] == {"pending": 1, "failed": 2}
        assert [(r["id"], r["conversation"], r["error"]) for r in o["failed_rows"]] == [
            (pending.id, "discord:300:77", "too long"), (unsent.outbox, "discord:300:77", "Forbidden: bot was blocked"),
        ]
        assert o["failed_rows"][0]["text"] == "x" * 200
        assert [(e["conversation"], e["why"]) for e in o["errors"]] == [
            ("telegram:200", "crash: internal error (id ab12)"), ("telegram:100", "model_error: HTTP 500"),
        ]
        assert all(e["at"] <= time.time() and isinstance(e["turn"], int) for e in o["errors"])
        assert o["today"] == {"prompt": 2000, "completion": 200, "cached": 800, "cost": 0.75, "requests": 2}
        days = o["days"]
        assert len(days) == 30 and days[-1] == {"day": today(now), "tokens": 2200, "cost": 0.75}
        assert days[-3] == {"day": today(now - 2 * 86400), "tokens": 1100, "cost": 1.0}
        assert sum(d["tokens"] for d in days) == 3300 and days[0]["day"] < days[1]["day"]
        hours = o["hours"]
        assert len(hours) == 24 and hours[-1]["hour"] <= now < hours[-1]["hour"] + 3600
        assert [h["hour"] for h in hours] == [hours[0]["hour"] + 3600 * n for n in range(24)]
        assert hours[-1]["turns"] == 4 and hours[-4]["turns"] == 1 and sum(h["turns"] for h in hours) == 5
        # the failed turns answered within the test's run: their latencies are near 0
        assert o["latency"]["turns"] == 4
        assert o["latency"]["p95"] == pytest.approx(10.0) and 0 <= o["latency"]["p50"] < 2.0 + 1e-6


async def test_reply_latency_without_answers_is_none_and_its_sample_is_bounded(tmp_path: Path, store_location) -> None:
    now = time.time()
    async with Store(store_location) as store:
        assert (await store.console_overview(now))["latency"] == {"p50": None, "p95": None, "turns": 0}
        old = await chat_turn(store, ALICE, "an hour ago", "hello")
        await store.write("UPDATE journal SET received_at = ? WHERE id = ?", (now - 3600, old.journal))
        await store.write("UPDATE outbox SET sent_at = ? WHERE id = ?", (now - 3590, old.outbox))
        assert (await store.console_overview(now))["latency"] == {"p50": 10.0, "p95": 10.0, "turns": 1}
        new = await chat_turn(store, BOB, "just now", "hello")
        await store.write("UPDATE outbox SET sent_at = ? WHERE id = ?", (now + 3, new.outbox))
        # as many newer answered messages as the sample holds, all taken by the new turn
        await store.write(
            "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?)"
            " INSERT INTO journal (platform, chat_id, message_id, sender_id, sender_name, chat_kind, text, status,"
            " turn_id, received_at) SELECT 'telegram', '200', 'x' || i, '22', 'Bob', 'private', 't', 'done', ?, ? FROM n",
            (LATENCY_SAMPLE, new.turn, now - 60),
        )
        # the old turn's message is past the newest LATENCY_SAMPLE: only the new turn is measured
        assert (await store.console_overview(now))["latency"] == {"p50": pytest.approx(63.0), "p95": pytest.approx(63.0), "turns": 1}


# -- query plans ------------------------------------------------------------------------------

BIG_TABLES = {"messages", "journal", "outbox", "turns", "usage"}


def scans(sql: str, plan: list[str]) -> list[str]:
    """The plan's lines that read a big table whole, or ``conversations`` whole without a
    ``LIMIT`` (aliases read from the statement)."""
    aliases = {}
    for table, alias in re.findall(r"\b(?:FROM|JOIN)\s+(\w+)(?:\s+(?:AS\s+)?(\w+))?", sql, re.IGNORECASE):
        aliases[table] = table
        if alias and alias.upper() not in {"WHERE", "ON", "ORDER", "GROUP", "JOIN", "LIMIT", "WITH"}:
            aliases[alias] = table
    bad = []
    for line in plan:
        m = re.match(r"SCAN (\w+)(.*)", line)
        if not m or m.group(1) not in aliases:
            continue
        table = aliases[m.group(1)]
        if table in BIG_TABLES:
            bad.append(line)
        elif table == "conversations" and "USING" not in m.group(2) and not re.search(r"\bLIMIT\b|\bLIKE\b", sql, re.IGNORECASE):
            bad.append(line)  # a page reads a few rows; a search's count reads one row per chat
    return bad


async def test_no_console_query_scans_a_big_table(tmp_path: Path) -> None:
    """Every statement the console's reads run (caught as SQLite runs them) is planned on an
    index: no ``SCAN`` of ``messages``, ``journal``, ``outbox``, ``turns`` or ``usage``. A plain
    scan of ``conversations`` is allowed where a ``LIMIT`` stops it, and for counting what a
    search (``LIKE '%…%'``, which no index serves) matches: one row per chat."""
    async with Store(tmp_path / "b.db") as store:
        for n in range(3):
            done = await chat_turn(store, ALICE if n % 2 else BOB, f"q{n}", f"a{n}")
        await store.add_usage(today(time.time()), Scope(conversation=ALICE.key, kind="turn"), Usage("u", "m", prompt=5), 0.1)
        await store.add_task((await store.conversation(ALICE)).id, kind="every", spec="60", tz="UTC", text="t", due=1.0,
                             turn_id=None, max_active=5)
        statements: list[str] = []
        await store.db.set_trace_callback(statements.append)
        await store.console_overview(time.time())
        await store.console_conversations()
        await store.console_conversations(query="1", platform="telegram", state="active", offset=1, limit=10)
        await store.console_conversations(query="1", state="paused")
        await store.console_history(ALICE.key)
        await store.console_history(ALICE.key, before=3, limit=2)
        await store.console_turns(ALICE.key)
        await store.console_turn(done.turn)
        await store.console_tasks()
        await store.console_tasks(offset=1, limit=1)
        await store.db.set_trace_callback(None)
        selects = [s for s in statements if s.lstrip().upper().startswith(("SELECT", "WITH"))]
        assert len(selects) >= 20
        problems = {}
        for sql in selects:
            plan = [r[3] for r in await store.db.execute_fetchall(f"EXPLAIN QUERY PLAN {sql}")]
            if bad := scans(sql, plan):
                problems[sql] = bad
        assert problems == {}


def test_the_plan_check_sees_a_scan_through_an_alias() -> None:
    assert scans("SELECT * FROM turns t WHERE t.status = 'x'", ["SCAN t"]) == ["SCAN t"]
    assert scans("SELECT * FROM conversations c", ["SCAN c"]) == ["SCAN c"]
    assert scans("SELECT * FROM conversations c LIMIT 5", ["SCAN c"]) == []
    assert scans("SELECT COUNT(*) FROM conversations c WHERE c.title LIKE '%a%'", ["SCAN c"]) == []
    assert scans("SELECT * FROM conversations c", ["SCAN c USING INDEX conversations_by_activity"]) == []
    assert scans("SELECT * FROM messages WHERE conversation_id = 1", ["SEARCH messages USING INDEX x (conversation_id=?)"]) == []


async def test_the_migration_starts_last_activity_at_the_newest_message_of_each_conversation(tmp_path: Path) -> None:
    """A database of schema 10 gets ``last_active_at`` from its journal and history."""
    import sqlite3

    from bumblebot.store import MIGRATIONS

    path = tmp_path / "b.db"
    conn = sqlite3.connect(path)
    for number, script in enumerate(MIGRATIONS[:10], start=1):
        conn.executescript(f"BEGIN;\n{script}\nPRAGMA user_version={number};\nCOMMIT;")
    conn.executescript(
        "INSERT INTO conversations (id, platform, chat_id, created_at) VALUES (1, 'telegram', '100', 10), (2, 'telegram', '200', 20);"
        "INSERT INTO messages (conversation_id, session, role, content, created_at) VALUES (1, 1, 'user', 'a', 50);"
        "INSERT INTO journal (platform, chat_id, message_id, sender_id, sender_name, chat_kind, text, received_at)"
        " VALUES ('telegram', '100', 'm1', '1', 'A', 'private', 'a', 70);"
    )
    conn.close()
    async with Store(path) as store:
        rows = await store._all("SELECT id, last_active_at FROM conversations ORDER BY id")
        assert [(r[0], r[1]) for r in rows] == [(1, 70.0), (2, 20.0)]
        assert [r["key"] for r in (await store.console_conversations())[0]] == ["telegram:100", "telegram:200"]
