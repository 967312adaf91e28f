"""Timing of the operator console's reads (``bumblebot/store/console.py``) on a big store.

Run: ``python bench/bench_console.py [runs]`` (from the repository root; about half a minute,
most of it filling the file).

Fills a fresh SQLite file (schema made by :class:`~bumblebot.store.Store`, rows inserted in
bulk with plain SQL) with 1,000 conversations and 100,000 messages: 25,000 turns of four
messages each (user, a tool call, its result, the reply) spread over 30 days, a tenth of them
in the last 24 hours, each with a trace of about 2 KB, its journal entry and its sent outbox
row; one conversation in ten compacted (its middle covered by a summary, some results
pruned); one with 10,000 messages; 300 failed and 20 pending outbox rows; 250 failed turns;
usage rows for 30 days (per conversation, kind and model); 500 tasks. Then each console query
runs ``runs`` times (default 50) through the store's one aiosqlite connection, as the web
console calls it, and the table shows p50, p95 and p99 in milliseconds.

Then the same file is served by a daemon's web console (``web.listen`` on 127.0.0.1, no
platform, the fake model of ``tests/fakes``): each page fetched ``runs`` times through aiohttp
after logging in, rendered and sent, p50/p95/p99.

Target: the overview and the conversation list each well under 100 ms as queries, and under
300 ms as whole pages.
"""

from __future__ import annotations

import asyncio
import json
import random
import sqlite3
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "tests"))

from bumblebot.store import Store

CONVERSATIONS = 1_000
MESSAGES = 100_000
BIG_CONVERSATION_MESSAGES = 10_000
RUNS = 50
TARGET_MS = 100.0
DAY = 86400.0


def _day(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%d")


def _trace(rnd: random.Random, turn: int) -> str:
    steps = [
        {"step": n, "tool_calls": [{"name": "read_file", "arguments": '{"path": "notes.md"}'}],
         "content": "", "finish_reason": "tool_calls", "usage": {"prompt": rnd.randint(500, 9000), "completion": 80}}
        for n in range(1, rnd.randint(2, 5))
    ]
    return json.dumps({"route": "main", "reason": "default", "steps": steps, "stop_reason": "answered",
                       "gate": [{"verdict": "DONE", "why": "answered the question " * 5}], "turn": turn})


def fill(path: Path, now: float, seed: int = 28) -> dict[str, Any]:
    """The rows described in the module's docstring; returns what the queries are asked about."""
    rnd = random.Random(seed)
    db = sqlite3.connect(path)
    db.execute("BEGIN")
    conversations = []
    for n in range(CONVERSATIONS):
        platform = "telegram" if n % 5 else "discord"
        thread = str(n % 7) if platform == "discord" and n % 3 == 0 else ""
        conversations.append((n + 1, platform, str(100_000 + n), thread))
    db.executemany(
        "INSERT INTO conversations (id, platform, chat_id, thread_id, created_at, title, paused_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
        [(i, p, c, t, now - 40 * DAY, f"Chat {c} of person {i}", now if i % 50 == 0 else None) for i, p, c, t in conversations],
    )
    # turns: the big conversation gets its share, the rest spread at random
    turns_total = MESSAGES // 4
    owners = [1] * (BIG_CONVERSATION_MESSAGES // 4) + [
        rnd.randint(2, CONVERSATIONS) for _ in range(turns_total - BIG_CONVERSATION_MESSAGES // 4)
    ]
    starts = sorted(
        now - rnd.uniform(0, DAY) if k % 10 == 0 else now - rnd.uniform(DAY, 30 * DAY) for k in range(turns_total)
    )
    rnd.shuffle(owners)
    messages, turns, journal, outbox = [], [], [], []
    last_active: dict[int, float] = {}
    message_id = 0
    for turn_id, (cid, start) in enumerate(zip(owners, starts, strict=True), start=1):
        _, platform, chat_id, thread = conversations[cid - 1]
        failed = turn_id % 100 == 0
        wait = rnd.uniform(1.0, 30.0)
        turns.append((turn_id, cid, 1, "failed" if failed else "done", start, start + wait + 1,
                      json.dumps({"stop_reason": "model_error", "error": "HTTP 500"}) if failed else _trace(rnd, turn_id)))
        call = f"call_{turn_id}"
        for role, content, calls, call_id in (
            ("user", f"question {turn_id} " * rnd.randint(1, 20), None, None),
            ("assistant", "", json.dumps([{"id": call, "type": "function",
                                           "function": {"name": "read_file", "arguments": '{"path": "a"}'}}]), None),
            ("tool", "file text " * rnd.randint(10, 200), None, call),
            ("assistant", f"answer {turn_id} " * rnd.randint(1, 30), None, None),
        ):
            message_id += 1
            messages.append((message_id, cid, 1, turn_id, role, content, calls, call_id, start))
        journal.append((turn_id, platform, chat_id, thread, f"m{turn_id}", "11", "Alice", "private", f"question {turn_id}",
                        "failed" if failed else "done", turn_id, start, start + wait))
        status = "failed" if turn_id % 83 == 0 else "sent"
        outbox.append((turn_id, cid, turn_id, platform, chat_id, thread, f"answer {turn_id}", status,
                       "Forbidden: bot was blocked by the user" if status == "failed" else None, start + 0.5,
                       start + wait if status == "sent" else None))
        last_active[cid] = start + wait
    db.executemany("INSERT INTO turns (id, conversation_id, session, status, started_at, ended_at, trace) VALUES (?, ?, ?, ?, ?, ?, ?)", turns)
    db.executemany(
        "INSERT INTO messages (id, conversation_id, session, turn_id, role, content, tool_calls, tool_call_id, created_at)"
        " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", messages,
    )
    db.executemany(
        "INSERT INTO journal (id, platform, chat_id, thread_id, message_id, sender_id, sender_name, chat_kind, text, status,"
        " turn_id, received_at, done_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", journal,
    )
    db.executemany(
        "INSERT INTO outbox (id, conversation_id, turn_id, platform, chat_id, thread_id, text, status, last_error, created_at,"
        " sent_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", outbox,
    )
    db.executemany(
        "INSERT INTO outbox (conversation_id, platform, chat_id, thread_id, text, created_at) VALUES (?, ?, ?, ?, 'waiting', ?)",
        [(c[0], c[1], c[2], c[3], now - 60) for c in conversations[:20]],
    )
    db.executemany("UPDATE conversations SET last_active_at = ? WHERE id = ?", [(t, c) for c, t in last_active.items()])
    # one conversation in ten compacted: its middle covered by a summary, a few results pruned
    for cid in range(1, CONVERSATIONS + 1, 10):
        ids = [r[0] for r in db.execute("SELECT id FROM messages WHERE conversation_id = ? ORDER BY id", (cid,))]
        if len(ids) < 12:
            continue
        db.execute("INSERT INTO compaction (conversation_id, session, summary, compactions, updated_at) VALUES (?, 1, ?, 1, ?)",
                   (cid, "## Goal\nHelp with the notes.\n" * 20, now))
        db.execute("UPDATE messages SET covered_by = 1 WHERE conversation_id = ? AND id > ? AND id < ?",
                   (cid, ids[3], ids[len(ids) // 2]))
        db.execute("UPDATE messages SET pruned = 1 WHERE conversation_id = ? AND role = 'tool' AND id >= ? AND id < ?",
                   (cid, ids[len(ids) // 2], ids[-8]))
    usage = []
    for c in conversations:
        key = f"{c[1]}:{c[2]}" + (f":{c[3]}" if c[3] else "")
        for d in rnd.sample(range(30), 10):
            for kind, model in (("turn", "big"), ("judge", "small")):
                usage.append((_day(now - d * DAY), key, "11", kind, "http://127.0.0.1:8080/v1", model, rnd.randint(1, 20),
                              rnd.randint(1000, 90000), rnd.randint(0, 50000), rnd.randint(100, 5000), rnd.uniform(0, 0.5)))
    db.executemany(
        "INSERT OR IGNORE INTO usage (day, conversation, sender, kind, endpoint, model, requests, prompt_tokens, cached_tokens,"
        " completion_tokens, cost) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", usage,
    )
    db.executemany(
        "INSERT INTO tasks (conversation_id, kind, spec, tz, text, created_at, next_due, status) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        [(rnd.randint(1, CONVERSATIONS), "every", "3600", "UTC", f"task {n}", now - DAY,
          now + rnd.uniform(0, DAY) if n % 4 else None, "active" if n % 4 else "done") for n in range(500)],
    )
    db.execute("COMMIT")
    db.close()
    key = lambda c: f"{c[1]}:{c[2]}" + (f":{c[3]}" if c[3] else "")
    return {"big": key(conversations[0]), "small": key(conversations[1]), "turn": turns_total // 2}


def percentile(sorted_ms: list[float], share: float) -> float:
    return sorted_ms[min(len(sorted_ms) - 1, max(0, round(share * len(sorted_ms)) - 1))]


async def timed(call: Callable[[], Awaitable[Any]], runs: int) -> list[float]:
    await call()  # warm the page cache and the statement cache
    out = []
    for _ in range(runs):
        start = time.perf_counter()
        await call()
        out.append((time.perf_counter() - start) * 1000)
    return sorted(out)


async def main(runs: int) -> None:
    now = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bumblebot.db"
        async with Store(path):
            pass  # the schema, as the daemon makes it
        started = time.perf_counter()
        asked = fill(path, now)
        print(f"filled in {time.perf_counter() - started:.1f} s: {CONVERSATIONS} conversations, {MESSAGES} messages,"
              f" {path.stat().st_size / 1e6:.0f} MB")
        async with Store(path) as store:
            counts = await store._one("SELECT (SELECT COUNT(*) FROM conversations), (SELECT COUNT(*) FROM messages),"
                                      " (SELECT COUNT(*) FROM turns), (SELECT COUNT(*) FROM usage)")
            assert counts is not None and (counts[0], counts[1]) == (CONVERSATIONS, MESSAGES), tuple(counts or ())
            history = await store.console_history(asked["big"])
            queries: list[tuple[str, Callable[[], Awaitable[Any]]]] = [
                ("overview", lambda: store.console_overview(time.time())),
                ("conversations, page 1", lambda: store.console_conversations()),
                ("conversations, page 11", lambda: store.console_conversations(offset=500)),
                ("conversations, search", lambda: store.console_conversations(query="1234")),
                ("conversations, paused", lambda: store.console_conversations(state="paused", platform="telegram")),
                ("history, newest 200 (10k msgs)", lambda: store.console_history(asked["big"])),
                ("history, older 200 (10k msgs)", lambda: store.console_history(asked["big"], before=history["messages"][0]["id"])),
                ("history, small chat", lambda: store.console_history(asked["small"])),
                ("turns, newest 20", lambda: store.console_turns(asked["big"])),
                ("turns, page 50", lambda: store.console_turns(asked["big"], offset=1000)),
                ("one turn", lambda: store.console_turn(asked["turn"])),
                ("tasks, page 1", lambda: store.console_tasks()),
                ("tasks, page 4", lambda: store.console_tasks(offset=300)),
            ]
            print(f"{'query':34} {'p50 ms':>8} {'p95 ms':>8} {'p99 ms':>8}   ({runs} runs each)")
            worst = 0.0
            for name, call in queries:
                ms = await timed(call, runs)
                p50, p95, p99 = (percentile(ms, s) for s in (0.50, 0.95, 0.99))
                print(f"{name:34} {p50:8.2f} {p95:8.2f} {p99:8.2f}")
                if name.startswith(("overview", "conversations")):
                    worst = max(worst, p95)
            overview = await store.console_overview(time.time())
            print(f"overview: latency {overview['latency']}, outbox {overview['outbox']}")
            verdict = "met" if worst < TARGET_MS else "MISSED"
            print(f"target: overview and conversation list p95 under {TARGET_MS:.0f} ms: {verdict} ({worst:.2f} ms)")
        await pages(Path(tmp), runs)


PAGE_TARGET_MS = 300.0
WEB_TOKEN = "bench-console-web-token-0000000000"


async def pages(tmp: Path, runs: int) -> None:
    """The console's pages over HTTP from a daemon on the filled file."""
    import os

    import aiohttp
    import yaml
    from fakes.openai_server import FakeOpenAI

    from bumblebot.app.daemon import Daemon
    from bumblebot.core.config import Secrets, load_settings
    from bumblebot.core.entity import load_entity

    async with FakeOpenAI() as llm:
        config = tmp / "bumblebot.yaml"
        config.write_text(yaml.safe_dump({
            "data_dir": str(tmp), "web": {"listen": "127.0.0.1:0"}, "telegram": {"enabled": False},
            "llm": {"base_url": llm.base_url, "model": "test-model", "max_retries": 0},
        }))
        os.environ["BUMBLEBOT_WEB_TOKEN"] = WEB_TOKEN
        settings = load_settings(config)
        daemon = Daemon(settings, Secrets(OPENAI_API_KEY="sk-bench-not-real-000000"), load_entity(settings.entity, config_dir=tmp))
        try:
            await daemon.start([])
            host, port = daemon.web.address
            jar = aiohttp.CookieJar(unsafe=True)
            async with aiohttp.ClientSession(base_url=f"http://{host}:{port}", cookie_jar=jar) as http:
                async with http.post("/login", data={"token": WEB_TOKEN, "next": "/"}, allow_redirects=False) as r:
                    assert r.status in (302, 303), r.status

                async def get(path: str) -> None:
                    async with http.get(path, allow_redirects=False) as r:
                        assert r.status == 200, (path, r.status)
                        await r.read()

                print(f"{'page (HTTP)':34} {'p50 ms':>8} {'p95 ms':>8} {'p99 ms':>8}   ({runs} runs each)")
                worst = 0.0
                for path in ("/", "/conversations", "/conversations?offset=500", "/conversations?q=1234&platform=telegram"):
                    ms = await timed(lambda path=path: get(path), runs)
                    p50, p95, p99 = (percentile(ms, s) for s in (0.50, 0.95, 0.99))
                    print(f"{path:34} {p50:8.2f} {p95:8.2f} {p99:8.2f}")
                    worst = max(worst, p95)
            verdict = "met" if worst < PAGE_TARGET_MS else "MISSED"
            print(f"target: overview and conversation list pages p95 under {PAGE_TARGET_MS:.0f} ms: {verdict} ({worst:.2f} ms)")
        finally:
            await daemon.stop()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else RUNS))
