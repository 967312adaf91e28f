"""Bumblebot against a real model: what the user sees, message by message.

Run from the repository root, against any OpenAI-compatible endpoint (for a small local model,
llama.cpp's ``llama-server`` with SmolLM2-135M-Instruct and ``--jinja``)::

    python bench/bench_real_model.py --base-url http://127.0.0.1:8011/v1 --model smollm2-tools

``python -m bumblebot run`` (this tree's code) talks to the endpoint and to the fake Telegram of
``tests/fakes``, which runs in this process (no network besides the endpoint). Each chat sends
its messages one after another, the next once the turn that answers the last one has finished
(its journal entry, read from the daemon's database) or ``--turn-timeout`` has passed. Printed
per message: how many bot messages it got, how long until the first one showed and until its
turn finished; then the distribution of those figures, the messages over the turn's message
cap, the messages left unanswered, and the conversations that stopped working (a "too long"
note, or no answer to their last message).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sqlite3
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from fakes.telegram_server import FakeTelegram  # noqa: E402

TOKEN = "123456:REAL-model-run-fake-telegram-token-0000"
#: Varied input: greetings, chat, a question, tasks in two languages, a joke, JSON, code, a file.
MESSAGES = [
    "hi", "how are you today?", "tell me a joke", "what is the capital of France?",
    "ajoute du lait à ma liste de courses", "write a file notes.txt that says hello",
    "give me a JSON object for a person named Bob aged 3", "thanks!", "lol",
    "explain in two sentences why the sky is blue", "what did I ask you to add to my list?",
    "tell me three fun facts about bees, one message each", "¿qué hora es?",
    "write a python function that adds two numbers", "what's 12 times 7?", "ok cool",
    "summarise our conversation so far", "can you read notes.txt for me?", "good night", "bye",
]


@dataclass
class Row:
    chat: int
    text: str
    replies: int = 0
    first_s: float | None = None
    turn_s: float | None = None
    texts: list[str] = field(default_factory=list)


def handled(db: Path, chat: int, message_id: int) -> bool:
    """Whether the turn that answers the message has finished: its journal entry is no longer
    pending (a message taken into a running turn is done when that turn ends; counting the
    chat's finished turns took the end of a turn that was running when it came for its own)."""
    if not db.exists():
        return False
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as conn:
            row = conn.execute(
                "SELECT status FROM journal WHERE chat_id = ? AND message_id = ?", (str(chat), str(message_id))
            ).fetchone()
    except sqlite3.Error:
        return False
    return row is not None and row[0] != "pending"


def shown(tg: FakeTelegram, chat: int) -> list[str]:
    return tg.shown(chat)


async def one_chat(tg: FakeTelegram, db: Path, chat: int, texts: list[str], timeout: float, rows: list[Row]) -> None:
    for text in texts:
        before = len(shown(tg, chat))
        row = Row(chat, text)
        rows.append(row)
        pushed = time.monotonic()
        message_id = tg.push_text(text, chat_id=chat)["message"]["message_id"]
        while time.monotonic() - pushed < timeout:
            if row.first_s is None and len(shown(tg, chat)) > before:
                row.first_s = time.monotonic() - pushed
            if handled(db, chat, message_id):
                row.turn_s = time.monotonic() - pushed
                break
            await asyncio.sleep(0.2)
        await asyncio.sleep(0.5)  # a note sent with the turn's end
        now = shown(tg, chat)
        row.texts = now[before:]
        row.replies = len(row.texts)
        if row.first_s is None and row.replies:
            row.first_s = time.monotonic() - pushed


async def check_next_to(config: Path, db: Path, env: dict[str, str], log: Any) -> None:
    """``bumblebot check --chat-only`` once the daemon has made its database (check writes what
    it learns there; it creates none as root)."""
    while not db.exists():
        await asyncio.sleep(0.2)
    check = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bumblebot", "--config", str(config), "check", "--chat-only", env=env,
        stdout=log, stderr=log,
    )
    started = time.monotonic()
    await check.wait()
    print(f"bumblebot check took {time.monotonic() - started:.1f} s (exit {check.returncode})")


def pct(values: list[float], p: int) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[p - 1]


async def amain(args: argparse.Namespace) -> int:
    import yaml

    tmp = Path(tempfile.mkdtemp(prefix="bumblebot-real-"))
    async with FakeTelegram(token=TOKEN) as tg:
        config = {
            "data_dir": str(tmp / "data"),
            "llm": {"base_url": args.base_url, "model": args.model, "timeout_s": args.request_timeout, "max_retries": 0,
                    "max_concurrent_requests": args.max_concurrent_requests},
            "telegram": {"enabled": True, "base_url": tg.base_url, "base_file_url": tg.base_file_url, "poll_timeout_s": 1},
            "cognition": {"max_context_tokens": args.window},
        }
        path = tmp / "bumblebot.yaml"
        path.write_text(yaml.safe_dump(config))
        env = {k: v for k, v in os.environ.items() if not k.startswith("BUMBLEBOT_")}
        env.update(TELEGRAM_BOT_TOKEN=TOKEN, OPENAI_API_KEY="sk-local-not-real-000000", PYTHONUNBUFFERED="1",
                   NO_PROXY="127.0.0.1,localhost", PYTHONPATH=str(ROOT))
        log = open(tmp / "daemon.log", "wb")  # noqa: SIM115
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bumblebot", "--config", str(path), "run", env=env,
            stdout=asyncio.subprocess.DEVNULL, stderr=log,
        )
        rows: list[Row] = []
        try:
            if args.check:  # as an operator does: what check learns, no turn pays for
                await check_next_to(path, tmp / "data" / "bumblebot.db", env, log)
            messages = MESSAGES[: args.messages]
            chats = [9001 + i for i in range(args.chats)]
            plan = {chat: messages[i :: args.chats] for i, chat in enumerate(chats)}
            started = time.monotonic()
            await asyncio.gather(*(one_chat(tg, tmp / "data" / "bumblebot.db", c, t, args.turn_timeout, rows)
                                   for c, t in plan.items()))
            elapsed = time.monotonic() - started
        finally:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 30)
            except TimeoutError:
                proc.kill()
            log.close()
    cap = args.cap
    print(f"{len(rows)} messages over {args.chats} chats in {elapsed:.0f} s; data in {tmp}")
    for r in rows:
        first = f"{r.first_s:.1f}s" if r.first_s is not None else "-"
        turn = f"{r.turn_s:.1f}s" if r.turn_s is not None else "timeout"
        print(f"  chat {r.chat} {r.text[:40]!r}: {r.replies} message(s), first {first}, turn {turn}")
        for t in r.texts:
            print(f"      > {t[:110]!r}")
    replies = [r.replies for r in rows]
    firsts = [r.first_s for r in rows if r.first_s is not None]
    turns = [r.turn_s for r in rows if r.turn_s is not None]
    print(f"replies per message: mean {statistics.mean(replies):.2f}, max {max(replies)}; "
          f"distribution {dict(sorted({n: replies.count(n) for n in set(replies)}.items()))}")
    for name, values in (("first words", firsts), ("turn finished", turns)):
        if values:
            print(f"{name}: p50 {pct(values, 50):.1f} s, p95 {pct(values, 95):.1f} s, max {max(values):.1f} s "
                  f"({len(values)} of {len(rows)})")
    print(f"over the cap of {cap}: {sum(n > cap for n in replies)}; unanswered: {sum(n == 0 for n in replies)}; "
          f"turns not finished within {args.turn_timeout:.0f} s: {len(rows) - len(turns)}")
    dead = [c for c in {r.chat for r in rows}
            if any("too long" in t for r in rows if r.chat == c for t in r.texts)
            or [r for r in rows if r.chat == c][-1].replies == 0]
    print(f"dead conversations: {len(dead)} {sorted(dead)}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description="Bumblebot against a real model endpoint, through a fake Telegram.")
    parser.add_argument("--base-url", required=True, help="the endpoint, e.g. http://127.0.0.1:8011/v1")
    parser.add_argument("--model", default="smollm2-tools", help="model name at the endpoint")
    parser.add_argument("--messages", type=int, default=20, help=f"messages to send (at most {len(MESSAGES)})")
    parser.add_argument("--chats", type=int, default=4, help="chats they are spread over")
    parser.add_argument("--window", type=int, default=4096, help="cognition.max_context_tokens")
    parser.add_argument("--cap", type=int, default=4, help="the turn's message cap, for the report")
    parser.add_argument("--turn-timeout", type=float, default=600.0, help="seconds to wait for one turn")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="llm.timeout_s")
    parser.add_argument("--check", action="store_true", help="run `bumblebot check --chat-only` first")
    parser.add_argument("--max-concurrent-requests", type=int, default=64,
                        help="llm.max_concurrent_requests (1 for a server that answers one request at a time)")
    return asyncio.run(amain(parser.parse_args()))


if __name__ == "__main__":
    raise SystemExit(main())
