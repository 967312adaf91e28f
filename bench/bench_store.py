"""The store on PostgreSQL against the store on SQLite, turn by turn, in the same command.

Both runs drive the daemon's engine in this process (the console adapter's path, delivering to
nowhere) against the fake OpenAI server of ``tests/fakes``, once with the default SQLite file
and once with ``store.url`` naming a database of a throwaway PostgreSQL server started here
(Debian's ``postgresql``; ``fsync`` on, ``synchronous_commit=off``: like SQLite's WAL with
``synchronous=NORMAL``, a crash may lose the last commits but corrupts nothing). Printed:

* **CPU per turn**, instant model, turns one after another: this process's CPU (the engine and
  the database client: aiosqlite's thread, or asyncpg), and on PostgreSQL also the server's
  (its processes' user and system time). Ratios: PostgreSQL / SQLite.
* **Latency**, ``--chats`` chats at once, each sending its next message when the last is
  answered, a model that takes ``--latency`` s per request: first reply p50, p95 and p99.

Usage: ``python bench/bench_store.py [--turns 300] [--chats 10] [--latency 0.2] [--rounds 20]``
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from bench_turn import NullAdapter  # noqa: E402
from fakes.openai_server import FakeOpenAI, Reply, is_aux, text, tool_calls  # noqa: E402
from fakes.postgres_server import PostgresServer  # noqa: E402

from bumblebot.app.daemon import Daemon  # noqa: E402
from bumblebot.core.config import Secrets, load_settings  # noqa: E402
from bumblebot.core.entity import load_entity  # noqa: E402
from bumblebot.core.events import ChatKind, ChatRef, Inbound, Platform  # noqa: E402


def scripted(delay: float):
    def reply(request: dict) -> Reply:
        if is_aux(request):
            return text("DONE: fine", delay=delay)
        return tool_calls(("say", {"text": "hello"}), ("end_turn", {}), delay=delay)

    return reply


def server_cpu(server: PostgresServer) -> float:
    """CPU seconds (user + system) the server has used so far: its postmaster's, with that of
    its children that ended (``cutime``, ``cstime``), and its live children's (proc(5))."""
    ticks = os.sysconf("SC_CLK_TCK")
    postmaster = int((server.data / "postmaster.pid").read_text().split()[0])
    total = 0.0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid, parent = int(entry.name), int(fields[1])
        if pid == postmaster:
            total += sum(int(f) for f in fields[11:15]) / ticks
        elif parent == postmaster:
            total += (int(fields[11]) + int(fields[12])) / ticks
    return total


class Replies(NullAdapter):
    """Delivers to nowhere, and tells when a chat's reply was sent."""

    def __init__(self) -> None:
        self.sent: dict[str, asyncio.Event] = {}

    async def send_chunk(self, chat: ChatRef, text: str, *, key: str) -> str:
        self.sent.setdefault(chat.chat_id, asyncio.Event()).set()
        return "1"


async def daemon(folder: Path, llm: FakeOpenAI, url: str | None, adapter: NullAdapter | None = None) -> Daemon:
    store = f"store: {{url: '{url}'}}\n" if url else ""
    (folder / "bumblebot.yaml").write_text(
        f"data_dir: {folder / 'data'}\nllm: {{base_url: '{llm.base_url}', max_retries: 0, max_concurrent_requests: 64}}\n"
        f"telegram: {{enabled: false}}\ncognition: {{classifier: false}}\n{store}"
    )
    d = Daemon(load_settings(folder / "bumblebot.yaml"), Secrets(OPENAI_API_KEY="sk-bench"), load_entity("default"))
    await d.start(adapters=[adapter or NullAdapter()])
    return d


async def cpu_per_turn(folder: Path, url: str | None, turns: int, server: PostgresServer) -> tuple[float, float]:
    async with FakeOpenAI(default=scripted(0.0)) as llm:
        d = await daemon(folder, llm, url)
        assert d.engine is not None
        for i in range(20):  # warm up: the conversation, prepared statements, caches
            await d.engine.submit(Inbound(ChatRef(Platform.CONSOLE, "warm"), f"w{i}", "u", "user", "hi", ChatKind.PRIVATE))
            await d.engine.wait_for_turns(i + 1)
        ours, theirs = time.process_time(), server_cpu(server) if url else 0.0
        for i in range(turns):
            await d.engine.submit(Inbound(ChatRef(Platform.CONSOLE, "bench"), str(i), "u", "user", "hi", ChatKind.PRIVATE))
            await d.engine.wait_for_turns(20 + i + 1)
        ours, theirs = time.process_time() - ours, (server_cpu(server) - theirs) if url else 0.0
        await d.stop()
    return ours / turns, theirs / turns


async def latencies(folder: Path, url: str | None, chats: int, rounds: int, latency: float) -> list[float]:
    async with FakeOpenAI(default=scripted(latency)) as llm:
        adapter = Replies()
        d = await daemon(folder, llm, url, adapter)
        assert d.engine is not None
        engine = d.engine
        out: list[float] = []

        async def chat(n: int) -> None:
            ref = ChatRef(Platform.CONSOLE, f"chat{n}")
            for r in range(rounds):
                sent = adapter.sent[ref.chat_id] = asyncio.Event()
                start = time.perf_counter()
                await engine.submit(Inbound(ref, f"{n}-{r}", "u", "user", "hi", ChatKind.PRIVATE))
                await sent.wait()
                out.append(time.perf_counter() - start)

        await asyncio.gather(*(chat(n) for n in range(chats)))
        await d.stop()
    return out


def tail(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def main(args: argparse.Namespace) -> None:
    root = Path(tempfile.mkdtemp(prefix="bumblebot-bench-store-"))
    root.chmod(0o755)  # as root, the server runs as the postgres user, who must reach its folder
    (root / "pg").mkdir()
    server = PostgresServer(root / "pg", durable=True)
    try:
        server.start()
        results = {}
        for name in ("sqlite", "postgresql"):
            url = await server.database() if name == "postgresql" else None
            folder = root / f"{name}-cpu"
            folder.mkdir()
            cpu = await cpu_per_turn(folder, url, args.turns, server)
            url = await server.database() if name == "postgresql" else None
            folder = root / f"{name}-latency"
            folder.mkdir()
            lat = await latencies(folder, url, args.chats, args.rounds, args.latency)
            results[name] = (cpu, lat)
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
    (sq_cpu, _), sq_lat = results["sqlite"]
    (pg_cpu, pg_server), pg_lat = results["postgresql"]
    print(f"CPU per turn, {args.turns} turns, instant model")
    print(f"  SQLite      this process {sq_cpu * 1000:7.2f} ms")
    print(f"  PostgreSQL  this process {pg_cpu * 1000:7.2f} ms  ({pg_cpu / sq_cpu:.2f}x)")
    print(f"              + server     {pg_server * 1000:7.2f} ms  (together {(pg_cpu + pg_server) / sq_cpu:.2f}x)")
    print(f"first reply, {args.chats} chats x {args.rounds} messages, model {args.latency} s per request")
    for q, label in ((0.5, "p50"), (0.95, "p95"), (0.99, "p99")):
        a, b = tail(sq_lat, q), tail(pg_lat, q)
        print(f"  {label}: SQLite {a * 1000:7.1f} ms  PostgreSQL {b * 1000:7.1f} ms  ({b / a:.2f}x)")
    print(f"  mean: SQLite {statistics.mean(sq_lat) * 1000:7.1f} ms  PostgreSQL {statistics.mean(pg_lat) * 1000:7.1f} ms")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="The store on PostgreSQL vs on SQLite, in one command.")
    parser.add_argument("--turns", type=int, default=300, help="turns of the CPU measurement")
    parser.add_argument("--chats", type=int, default=10, help="chats at once in the latency measurement")
    parser.add_argument("--rounds", type=int, default=20, help="messages each chat sends")
    parser.add_argument("--latency", type=float, default=0.2, help="seconds the model takes per request")
    asyncio.run(main(parser.parse_args()))
