"""Chat turns end to end: Bumblebot against the thinnest possible bot, in one run.

Run from the repository root::

    python bench/bench_chat.py            # the full run (a few minutes on 2 cores), writes docs/performance.md
    python bench/bench_chat.py --quick    # a smoke run (about a minute), prints only

Both bots run as their own subprocess against the same local fakes, which run in this process
(``tests/fakes``: FakeTelegram for the Bot API, FakeOpenAI for the model; no network):

* **baseline** (``bench/baseline_bot.py``): python-telegram-bot ``Application`` with one
  ``MessageHandler`` doing one chat completion and one ``sendMessage``;
* **Bumblebot**: ``python -m bumblebot run`` (the real daemon and its Telegram adapter) with
  a YAML config in a temporary directory; cognition settings are left at their defaults
  (the classifier is on), ``delivery.streaming`` is set on or off per run.

The fake model answers Bumblebot's loop requests with a ``say`` call carrying a ~200-character
reply plus ``end_turn``, tool-less requests (classifier, judges, summaries) with ``CHAT`` /
``DONE: fine``, and the baseline's request with the same reply as plain text. Latency ``L`` is
added to every request: a whole answer after ``L``; a streamed one starts after ``L/2`` and
spreads its chunks over the other ``L/2`` (so it is complete after ``L`` too).

Load is closed-loop: every chat sends a message, waits for the complete reply, reads it for
``THINK_S`` (4 s) and sends the next. The pause is a person reading; without it a chat would
write again the instant the answer arrives, which is the flood Telegram's per-chat limit (about
one message a second) forbids, and Bumblebot's pacer (``adapters/telegram/pacing.py``) would rightly
hold every such reply for a second, so the run would measure the pacing, not the bot.
One warm-up turn per chat is not measured (it creates the conversation; with history it loads
it). Measured per run (see ``docs/performance.md`` for the definitions): turns per second,
latency from pushing the update to the first visible text (first ``sendMessage`` or
``editMessageText`` to that chat) and to the complete reply (the send or edit whose text is the
whole reply), model requests per turn, CPU per turn (the child's utime+stime from
``/proc/<pid>/stat`` over the measured window), peak RSS (the child's ``VmHWM``), ready time
(spawn to the first ``getUpdates`` at the fake) and database growth per 1,000 turns. Every
Bumblebot value is also given as a ratio to the baseline's value in the matching run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import resource
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from fakes.openai_server import FakeOpenAI, Reply, is_aux, text, tool_calls
from fakes.telegram_server import FakeTelegram, visible_text

TOKEN = "123456:BENCH-token-for-the-fake-server-only"
BASELINE_MODEL = "baseline-model"  # bench/baseline_bot.py asks for this model
BOT_MODEL = "bench-model"
REPLY = (
    "Hey, good to hear from you! Things are calm on my side, thanks for asking. I spent the "
    "morning reading about old lighthouses and how their keepers lived. How is your day going "
    "so far, anything fun planned?"
)
#: Plain chat messages, cycled per chat (greetings, reactions, small talk; no work asked for).
TEXTS = (
    "hello Sam", "hey, how are you?", "good morning!", "thanks, that helps", "lol that's funny",
    "what's up?", "nice one", "ok cool", "hi there friend", "how was your day?",
)
STREAM_CHARS = 8  # characters per streamed chunk
#: Seconds a chat reads a reply before it writes again (see the module docstring).
THINK_S = 4.0
TURN_TIMEOUT_S = 30.0
READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 15.0
RUN_TIMEOUT_S = 240.0  # one bot's whole run, whatever happens
VISIBLE_METHODS = ("sendMessage", "editMessageText", "sendMessageDraft")
#: Calls to a chat, counted per turn in the notes (Telegram's limits count them).
CHAT_METHODS = (*VISIBLE_METHODS, "sendChatAction", "deleteMessage")
MAX_SETTLE_ROUNDS = 8
KEEP_TMP = False
PROFILE = False  # --profile: run each child under cProfile and print its hottest functions  # --keep-tmp: leave each run's directory (config, database, child log) behind


def _norm(value: str) -> str:
    return " ".join(value.split())


REPLY_NORM = _norm(REPLY)


# ---- the fakes, instrumented ---------------------------------------------------------------


@dataclass
class Watch:
    """One turn of one chat: when its update was pushed and when its text became visible."""

    pushed: float
    first: float | None = None
    complete: float | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    seen: list[str] = field(default_factory=list)


class BenchTelegram(FakeTelegram):
    """FakeTelegram that times each chat's visible texts and the first ``getUpdates``."""

    def __init__(self) -> None:
        super().__init__(token=TOKEN)
        self.first_poll: float | None = None
        self.polled = asyncio.Event()
        self.watches: dict[int, Watch] = {}
        self.visible = 0
        for method in VISIBLE_METHODS:
            inner = self._handlers.get(method)
            if inner is not None:
                self._handlers[method] = self._watching(method, inner)

    def _watching(self, method: str, inner: Any) -> Any:
        def handler(params: dict[str, Any]) -> Any:
            now = time.monotonic()
            result = inner(params)
            if getattr(result, "status", 200) == 200:  # an error is an aiohttp Response
                self._visible(method, params, now)
            return result

        return handler

    def _visible(self, method: str, params: dict[str, Any], now: float) -> None:
        self.visible += 1
        try:
            chat_id = int(params.get("chat_id"))  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return
        watch = self.watches.get(chat_id)
        if watch is None or watch.complete is not None:
            return
        shown = _norm(visible_text(str(params.get("text", "")), params.get("parse_mode")))
        if not shown:
            return
        if watch.first is None:
            watch.first = now
        if len(watch.seen) < 8:
            watch.seen.append(shown[:60])
        if shown == REPLY_NORM and method != "sendMessageDraft":  # a draft is not the message
            watch.complete = now
            watch.done.set()

    async def _get_updates(self, params: dict[str, Any]) -> list[dict[str, Any]]:
        if self.first_poll is None:
            self.first_poll = time.monotonic()
            self.polled.set()
        return await super()._get_updates(params)


class BenchModel:
    """The fake model's answers (a ``FakeOpenAI`` default) and the requests it counted."""

    def __init__(self, latency: float) -> None:
        self.latency = latency
        self.counts: Counter[str] = Counter()

    def __call__(self, request: dict[str, Any]) -> Reply:
        streamed = bool(request.get("stream"))
        if request.get("model") == BASELINE_MODEL:
            kind, reply, size = "baseline", text(REPLY), len(REPLY)
        elif not is_aux(request):
            kind = "loop"
            reply = tool_calls(("say", {"text": REPLY}), ("end_turn", {}))
            size = len(REPLY) + 40
        else:
            seen = "\n".join(str(m.get("content") or "") for m in request.get("messages", []))
            if "You route chat messages" in seen:
                kind, answer = "classifier", "CHAT"
            elif "summar" in seen.lower():
                kind, answer = "summary", "The user and the assistant chatted casually about their day."
            else:
                kind, answer = "judge", "DONE: fine"
            reply, size = text(answer), len(answer)
        self.counts[kind] += 1
        # tokens as the fake counts them (prompt with the tool schemas, and the answer)
        prompt = (len(json.dumps(request.get("messages", []))) + len(json.dumps(request.get("tools", [])))) // 4
        self.counts[f"tokens:{kind}"] += prompt + max(1, len(json.dumps(reply.message or {})) // 4)
        if streamed:
            self.counts["streamed"] += 1
        reply.stream_chars = STREAM_CHARS
        if self.latency:
            if streamed:
                chunks = math.ceil(size / STREAM_CHARS) + 3
                reply.delay = self.latency / 2
                reply.stream_delay = self.latency / 2 / chunks
            else:
                reply.delay = self.latency
        return reply

    def bot_requests(self) -> int:
        return sum(v for k, v in self.counts.items() if _is_request(k))


def _is_request(key: str) -> bool:
    """A key of :attr:`BenchModel.counts` that counts requests (not streams, not tokens)."""
    return key != "streamed" and not key.startswith("tokens:")


# ---- the child processes -------------------------------------------------------------------


def proc_cpu_s(pid: int) -> float:
    """utime + stime (+ waited-for children) of ``pid``, seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = sum(int(v) for v in fields[11:15])
    return ticks / os.sysconf("SC_CLK_TCK")


def self_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def proc_status_kb(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("BUMBLEBOT_") and k.upper() not in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "OPENAI_BASE_URL")}
    # the children run the code of this tree (not whatever copy of bumblebot is installed)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.update(TELEGRAM_BOT_TOKEN=TOKEN, OPENAI_API_KEY="sk-bench-key-not-real-000000", PYTHONUNBUFFERED="1",
               NO_PROXY="127.0.0.1,localhost", PTB_TIMEDELTA="true")
    return env


def streaming_key_supported() -> bool:
    from bumblebot.core.settings import Settings

    return "delivery" in Settings.model_fields


def write_config(tmp: Path, tg: FakeTelegram, llm: FakeOpenAI, stream: bool) -> Path:
    import yaml

    config: dict[str, Any] = {
        "data_dir": str(tmp / "data"),
        "llm": {"base_url": llm.base_url, "model": BOT_MODEL, "max_retries": 0, "timeout_s": 60},
        "telegram": {"enabled": True, "base_url": tg.base_url, "base_file_url": tg.base_file_url},
    }
    if streaming_key_supported():
        config["delivery"] = {"streaming": "on" if stream else "off"}
    path = tmp / "bumblebot.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


async def stop_child(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        await asyncio.wait_for(proc.wait(), STOP_TIMEOUT_S)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await asyncio.wait_for(proc.wait(), 10)


def profile_summary(path: Path, top: int = 25) -> str:
    """The child's functions with the most own time, and the most time below them."""
    import io
    import pstats

    out = io.StringIO()
    stats = pstats.Stats(str(path), stream=out)
    stats.strip_dirs().sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    lines = [line for line in out.getvalue().splitlines() if line.strip()]
    return "\n".join("    " + line for line in lines)


def db_bytes(data_dir: Path) -> int:
    """Bytes of the database and its write-ahead log (the ``-shm`` index is not data)."""
    files = (data_dir / "bumblebot.db", data_dir / "bumblebot.db-wal")
    return sum(p.stat().st_size for p in files if p.is_file())


# ---- history ---------------------------------------------------------------------------------


async def empty_db_bytes() -> int:
    from bumblebot.store import Store

    with tempfile.TemporaryDirectory(prefix="bench_chat_") as tmp:
        async with Store(Path(tmp) / "bumblebot.db") as store:
            await store.instance_id()
        return db_bytes(Path(tmp))


async def template_turn(data_dir: Path) -> list[Any] | None:
    """The messages of one finished turn in a Bumblebot database (the shape history copies)."""
    from bumblebot.store import Store

    path = data_dir / "bumblebot.db"
    if not path.exists():
        return None
    async with Store(path, readonly=True) as store:
        for turn in await store.recent_turns(limit=20):
            if turn.get("status") == "done":
                messages = await store.turn_messages(int(turn["turn_id"]))
                if messages and messages[0].role == "user":
                    return messages
    return None


def synthetic_turn() -> list[Any]:
    from bumblebot.core.messages import Message

    calls = [{"id": "call_a", "type": "function", "function": {"name": "say", "arguments": f'{{"text": "{REPLY}"}}'}},
             {"id": "call_b", "type": "function", "function": {"name": "end_turn", "arguments": "{}"}}]
    return [Message("user", "hello Sam"), Message("assistant", "", tool_calls=calls),
            Message("tool", "delivered", tool_call_id="call_a", name="say", ok=True),
            Message("tool", "ok", tool_call_id="call_b", name="end_turn", ok=True)]


def copy_turn(template: list[Any], n: int, user_text: str) -> list[Any]:
    """``template`` with fresh tool call ids (suffix ``n``) and the user's text replaced."""
    from bumblebot.core.messages import Message

    out = []
    for m in template:
        calls = None
        if m.tool_calls:
            calls = [{**c, "id": f"{c['id']}_{n}"} for c in m.tool_calls]
        content = user_text if m.role == "user" else m.content
        out.append(Message(m.role, content, tool_calls=calls,
                           tool_call_id=f"{m.tool_call_id}_{n}" if m.tool_call_id else None,
                           name=m.name, ok=m.ok, note=m.note))
    return out


async def populate(data_dir: Path, chats: list[int], messages: int, template: list[Any]) -> None:
    """Give every chat ``messages`` messages of finished history, through the Store API."""
    from bumblebot.core.events import ChatRef, Platform
    from bumblebot.store import Store

    data_dir.mkdir(parents=True, exist_ok=True)
    async with Store(data_dir / "bumblebot.db") as store:
        for chat_id in chats:
            conversation = await store.conversation(ChatRef(Platform.TELEGRAM, str(chat_id)))
            batch: list[Any] = []
            n = 0
            while n * len(template) < messages:
                batch += copy_turn(template, n, TEXTS[n % len(TEXTS)])
                n += 1
                if len(batch) >= 200:
                    await store.import_history(conversation, batch)
                    batch = []
            if batch:
                await store.import_history(conversation, batch)


# ---- one run ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    chats: int
    latency: float
    stream: bool
    history: int = 0  # messages of pre-existing history per chat (Bumblebot only)
    duration: float = 5.0  # measured window, seconds (closed loop); 0 = one turn per chat
    baseline_of: str | None = None  # the baseline run this one is compared with (default: itself)
    bots: tuple[str, ...] = ("baseline", "bumblebot")

    @property
    def label(self) -> str:
        model = "instant model" if not self.latency else f"model {self.latency:g} s"
        chats = f"{self.chats:,} chats" if self.duration else f"{self.chats:,} chats, one message each, all at once"
        parts = [chats, model, "streamed" if self.stream else "not streamed"]
        if self.history:
            parts.append(f"{self.history:,} msgs history")
        return ", ".join(parts)


@dataclass
class Result:
    bot: str
    case: Case
    turns: int = 0
    failed: int = 0
    elapsed: float = 0.0
    first: list[float] = field(default_factory=list)
    complete: list[float] = field(default_factory=list)
    cold_complete: list[float] = field(default_factory=list)
    requests: Counter[str] = field(default_factory=Counter)
    warmup_requests: Counter[str] = field(default_factory=Counter)
    cpu_s: float = 0.0
    rss_peak_kb: int = 0
    ready_s: float | None = None
    db_growth: int | None = None
    all_turns: int = 0  # every completed turn of the run (warm-up and settling included)
    settle_rounds: int = 0  # extra warm-up rounds until compaction of imported history settled
    harness_cpu_s: float = 0.0  # this process's CPU (the fakes) over the measured window
    error: str | None = None
    log_tail: str = ""
    template: list[Any] | None = None  # a recorded turn's messages (for the history runs)
    profile: str = ""  # --profile: the child's hottest functions
    platform_calls: Counter[str] = field(default_factory=Counter)  # calls to chats over the whole run

    @property
    def tps(self) -> float | None:
        return self.turns / self.elapsed if self.elapsed > 0 and self.turns else None

    @property
    def req_per_turn(self) -> float | None:
        n = sum(v for k, v in self.requests.items() if _is_request(k))
        return n / self.turns if self.turns else None

    @property
    def token_ratio(self) -> float | None:
        """Tokens of every model request of the turns (classifier, completion check and
        summaries included) ÷ tokens of their loop completions alone."""
        loop = self.requests.get("tokens:loop", 0)
        spent = sum(v for k, v in self.requests.items() if k.startswith("tokens:") and k != "tokens:baseline")
        return spent / loop if loop else None

    @property
    def cpu_ms_per_turn(self) -> float | None:
        return 1000 * self.cpu_s / self.turns if self.turns else None

    @property
    def db_kb_per_1k(self) -> float | None:
        if self.db_growth is None or not self.all_turns:
            return None
        return self.db_growth / 1024 / self.all_turns * 1000


async def chat_turns(tg: BenchTelegram, chat_id: int, result: Result, *, count: int | None, deadline: float | None,
                     start_index: int, phase: str, timeout: float) -> None:
    """One chat's closed loop: push a message, wait for the complete reply, read it for
    :data:`THINK_S`, repeat."""
    i = 0
    while (count is None or i < count) and (deadline is None or time.monotonic() < deadline):
        before = tg.watches.get(chat_id)
        if before is not None and before.complete is not None:
            await asyncio.sleep(max(0.0, before.complete + THINK_S - time.monotonic()))
            if deadline is not None and time.monotonic() >= deadline:
                break
        watch = Watch(pushed=time.monotonic())
        tg.watches[chat_id] = watch
        tg.push_text(TEXTS[(chat_id + start_index + i) % len(TEXTS)], chat_id=chat_id, first_name="Alice",
                     username=f"user{chat_id}")
        try:
            await asyncio.wait_for(watch.done.wait(), timeout)
        except TimeoutError:
            result.failed += 1
            if result.error is None:
                result.error = f"chat {chat_id}: no complete reply within {timeout:g}s (saw {watch.seen!r})"
            return
        assert watch.complete is not None and watch.first is not None
        result.all_turns += 1
        if phase == "cold":
            result.cold_complete.append(watch.complete - watch.pushed)
        elif phase == "measure":
            result.first.append(watch.first - watch.pushed)
            result.complete.append(watch.complete - watch.pushed)
            result.turns += 1
        i += 1


async def drive(tg: BenchTelegram, chats: list[int], result: Result, *, count: int | None = None,
                deadline: float | None = None, start_index: int = 0, phase: str = "measure",
                timeout: float = TURN_TIMEOUT_S) -> float:
    """All chats' loops at once; returns when the last turn ended (its complete reply)."""
    await asyncio.gather(*(chat_turns(tg, c, result, count=count, deadline=deadline, start_index=start_index,
                                      phase=phase, timeout=timeout) for c in chats))
    ends = [w.complete for c in chats if (w := tg.watches.get(c)) and w.complete is not None]
    return max(ends) if ends else time.monotonic()


async def run(bot: str, case: Case, template: list[Any] | None, empty_db: int) -> Result:
    """One bot's run of ``case``: fresh fakes, a fresh temporary directory, its own subprocess."""
    result = Result(bot, case)
    tmp = Path(tempfile.mkdtemp(prefix="bench_chat_"))
    procs: list[asyncio.subprocess.Process] = []
    try:
        async with asyncio.timeout(RUN_TIMEOUT_S):
            await measure(bot, case, template, empty_db, result, tmp, procs)
    except Exception as exc:  # noqa: BLE001 - report it and go on with the other runs
        result.error = result.error or f"{type(exc).__name__}: {exc}"
    finally:
        for proc in procs:  # normally stopped already; this is for timeouts and errors
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(proc.wait(), 10)
        if PROFILE and (tmp / "child.prof").exists():
            result.profile = profile_summary(tmp / "child.prof")
        log_path = tmp / "child.log"
        if result.error and log_path.exists():
            result.log_tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-15:])
        if KEEP_TMP:
            print(f"(kept {tmp})", end=" ")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return result


async def measure(bot: str, case: Case, template: list[Any] | None, empty_db: int, result: Result, tmp: Path,
                  procs: list[asyncio.subprocess.Process]) -> None:
    chats = [10_000 + i for i in range(case.chats)]
    model = BenchModel(case.latency)
    async with BenchTelegram() as tg, FakeOpenAI(models=(BOT_MODEL, BASELINE_MODEL), default=model,
                                                 validate_sequence=False) as llm:
        data = tmp / "data"
        if bot == "bumblebot":
            config = write_config(tmp, tg, llm, case.stream)
            if case.history:
                await populate(data, chats, case.history, template or synthetic_turn())
            argv = ["-m", "bumblebot", "--config", str(config), "run"]
        else:
            argv = [str(ROOT / "bench" / "baseline_bot.py"), "--telegram-base-url", tg.base_url,
                    "--telegram-base-file-url", tg.base_file_url, "--llm-base-url", llm.base_url]
            argv += ["--stream"] if case.stream else []
        argv = [sys.executable, *(["-m", "cProfile", "-o", str(tmp / "child.prof")] if PROFILE else []), *argv]
        db_before = db_bytes(data) if data.exists() else empty_db
        with open(tmp / "child.log", "wb") as log:  # noqa: ASYNC230 - opened once, before the clock starts
            spawned = time.monotonic()
            proc = await asyncio.create_subprocess_exec(*argv, cwd=tmp, env=child_env(), stdin=asyncio.subprocess.DEVNULL,
                                                        stdout=asyncio.subprocess.DEVNULL, stderr=log)
        procs.append(proc)
        try:
            exited = asyncio.ensure_future(proc.wait())
            polled = asyncio.ensure_future(tg.polled.wait())
            await asyncio.wait({exited, polled}, timeout=READY_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED)
            exited.cancel()
            polled.cancel()
            if tg.first_poll is None:
                raise RuntimeError(f"{bot} never polled (exit code {proc.returncode})")
            result.ready_s = tg.first_poll - spawned
            await turns(tg, model, proc.pid, case, chats, result)
            result.platform_calls = Counter(c.method for c in tg.calls if c.method in CHAT_METHODS)
            await asyncio.sleep(0.2)  # let trailing writes (outbox, journal) land
            result.rss_peak_kb = proc_status_kb(proc.pid, "VmHWM")
        finally:
            await stop_child(proc)  # before the fakes close: its last calls are answered
    if bot == "bumblebot" and data.exists():
        result.db_growth = db_bytes(data) - db_before
        if template is None and not case.history:
            result.template = await template_turn(data)


async def turns(tg: BenchTelegram, model: BenchModel, pid: int, case: Case, chats: list[int], result: Result) -> None:
    """Warm-up, then the measured window (the memory run: its one turn per chat is measured)."""
    cpu0, harness0 = proc_cpu_s(pid), self_cpu_s()
    start = time.monotonic()
    end = await drive(tg, chats, result, count=1, phase="cold" if case.duration else "measure",
                      timeout=max(TURN_TIMEOUT_S, case.chats * 0.2) if case.duration else 180.0)
    if result.failed:
        raise RuntimeError(f"{result.failed} warm-up turn(s) got no complete reply: {result.error}")
    if case.history:
        # imported history is compacted over the first turns (a few passes per turn): more
        # warm-up rounds until one makes no summary request
        while model.counts["summary"] and result.settle_rounds < MAX_SETTLE_ROUNDS and not result.failed:
            before = model.counts["summary"]
            result.settle_rounds += 1
            await drive(tg, chats, result, count=1, phase="settle", start_index=result.settle_rounds)
            if model.counts["summary"] == before:
                break
    result.warmup_requests = Counter(model.counts)
    if case.duration:
        model.counts.clear()
        cpu0, harness0 = proc_cpu_s(pid), self_cpu_s()
        start = time.monotonic()
        end = await drive(tg, chats, result, deadline=start + case.duration, start_index=1 + result.settle_rounds)
        result.requests = Counter(model.counts)
    else:
        result.requests = result.warmup_requests
    result.elapsed = end - start
    result.cpu_s = proc_cpu_s(pid) - cpu0
    result.harness_cpu_s = self_cpu_s() - harness0


# ---- the report ------------------------------------------------------------------------------


def pct(values: list[float], p: int) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[p - 1]


METRICS: list[tuple[str, str, Any, str]] = [
    # (column, unit, getter, format)
    ("turns/s", "", lambda r: r.tps, "{:.1f}"),
    ("first p50", "ms", lambda r: _ms(pct(r.first, 50)), "{:.0f}"),
    ("first p95", "ms", lambda r: _ms(pct(r.first, 95)), "{:.0f}"),
    ("first p99", "ms", lambda r: _ms(pct(r.first, 99)), "{:.0f}"),
    ("complete p50", "ms", lambda r: _ms(pct(r.complete, 50)), "{:.0f}"),
    ("complete p95", "ms", lambda r: _ms(pct(r.complete, 95)), "{:.0f}"),
    ("complete p99", "ms", lambda r: _ms(pct(r.complete, 99)), "{:.0f}"),
    ("model req/turn", "", lambda r: r.req_per_turn, "{:.2f}"),
    ("tokens ÷ completion", "", lambda r: r.token_ratio, "{:.2f}"),
    ("CPU/turn", "ms", lambda r: r.cpu_ms_per_turn, "{:.1f}"),
    ("peak RSS", "MB", lambda r: r.rss_peak_kb / 1024 if r.rss_peak_kb else None, "{:.0f}"),
    ("ready", "s", lambda r: r.ready_s, "{:.2f}"),
    ("DB/1k turns", "KB", lambda r: r.db_kb_per_1k, "{:.0f}"),
]


def _ms(value: float | None) -> float | None:
    return None if value is None else value * 1000


def cell(value: float | None, fmt: str, ref: float | None) -> str:
    if value is None:
        return "n/a"
    out = fmt.format(value)
    if ref is not None:
        out += f" ({value / ref:.2f}×)" if ref else " (n/a)"
    return out


def table(results: list[Result], baselines: dict[str, Result]) -> list[str]:
    head = ["run", "bot", *(f"{name} ({unit})" if unit else name for name, unit, _, _ in METRICS)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        base = baselines.get(r.case.baseline_of or r.case.name) if r.bot == "bumblebot" else None
        cells = [r.case.label, r.bot]
        for _, _, get, fmt in METRICS:
            value = get(r)
            if base is None or value is None or get(base) is None:
                cells.append(cell(value, fmt, None))
            else:
                cells.append(cell(value, fmt, get(base)))
        if r.failed or r.error:
            cells[1] += f" ⚠ {r.failed} failed" if r.failed else " ⚠ error"
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def mark(ok: bool | None) -> str:
    return "n/a" if ok is None else ("pass" if ok else "**miss**")


def targets(by: dict[tuple[str, str], Result], quick: bool) -> list[str]:
    def get(case: str, bot: str) -> Result | None:
        r = by.get((case, bot))
        return r if r is not None and r.turns else None

    lines = ["| target | measured | result |", "|---|---|---|"]
    for case, how in (("c10-L0.2-plain", "not streamed"), ("c10-L0.2-stream", "streamed")):
        b, m = get(case, "baseline"), get(case, "bumblebot")
        if b and m:
            ratio = pct(m.complete, 50) / pct(b.complete, 50)  # type: ignore[operator]
            lines.append(f"| 10 chats, 0.2 s model, {how}: p50 complete ≤ 1.1× baseline | {ratio:.2f}× "
                         f"({_ms(pct(m.complete, 50)):.0f} vs {_ms(pct(b.complete, 50)):.0f} ms) | {mark(ratio <= 1.1)} |")
    b, m = get("c10-L0.2-stream", "baseline"), get("c10-L0.2-stream", "bumblebot")
    if b and m:
        first, base = pct(m.first, 50) or 0.0, pct(b.complete, 50) or 0.0
        early = sum(c - f > 0.001 for f, c in zip(m.first, m.complete)) / len(m.first)
        lines.append(f"| 10 chats, 0.2 s model, streamed: first visible words sooner than the baseline's complete "
                     f"reply (p50) | {1000 * first:.0f} vs {1000 * base:.0f} ms; text showed before the complete "
                     f"reply in {100 * early:.0f}% of Bumblebot's turns | {mark(first < base)} |")
    for case, how in (("c10-L0.2-plain", "not streamed"), ("c10-L0.2-stream", "streamed")):
        b, m = get(case, "baseline"), get(case, "bumblebot")
        if b and m:
            ratio = pct(m.first, 50) / pct(b.first, 50)  # type: ignore[operator]
            lines.append(f"| 10 chats, 0.2 s model, {how}: first words p50 ≤ 1.1× baseline (the completion check "
                         f"runs once the reply is on screen) | {ratio:.2f}× | {mark(ratio <= 1.1)} |")
    plain = [r for (case, bot), r in by.items() if bot == "bumblebot" and r.turns and not r.case.history and r.case.duration]
    if plain:
        loop = sum(r.requests.get("tokens:loop", 0) for r in plain)
        spent = sum(v for r in plain for k, v in r.requests.items() if k.startswith("tokens:") and k != "tokens:baseline")
        ratio = spent / loop if loop else math.inf
        req = sum(sum(v for k, v in r.requests.items() if _is_request(k)) for r in plain) / sum(r.turns for r in plain)
        lines.append(f"| tokens of a plain chat turn ≤ 1.15× its one completion, the completion check included (all "
                     f"chat runs) | {ratio:.3f}× ({req:.2f} requests a turn) | {mark(ratio <= 1.15)} |")
    b, m = get("c100-L0", "baseline"), get("c100-L0", "bumblebot")
    if b and m and b.tps and m.tps:
        lines.append(f"| 100 chats, instant model: throughput ≥ 0.8× baseline | {m.tps / b.tps:.2f}× | "
                     f"{mark(m.tps / b.tps >= 0.8)} |")
        if b.cpu_ms_per_turn and m.cpu_ms_per_turn:
            ratio = m.cpu_ms_per_turn / b.cpu_ms_per_turn
            lines.append(f"| 100 chats, instant model: CPU per turn ≤ 2× baseline | {ratio:.2f}× | {mark(ratio <= 2)} |")
        for q in (95, 99):
            ratio = pct(m.complete, q) / pct(b.complete, q)  # type: ignore[operator]
            lines.append(f"| 100 chats, instant model: p{q} complete ≤ 2× baseline | {ratio:.2f}× "
                         f"({_ms(pct(m.complete, q)):.0f} vs {_ms(pct(b.complete, q)):.0f} ms) | {mark(ratio <= 2)} |")
    h10, h10k = get("h10", "bumblebot"), get("h10000", "bumblebot")
    if h10 and h10k:
        cpu = (h10k.cpu_ms_per_turn or 0) / (h10.cpu_ms_per_turn or math.inf)
        lat = pct(h10k.complete, 50) / pct(h10.complete, 50)  # type: ignore[operator]
        lines.append(f"| long histories: per-turn cost 10k vs 10 msgs within 1.5× | CPU {cpu:.2f}×, p50 complete {lat:.2f}× | "
                     f"{mark(cpu <= 1.5 and lat <= 1.5)} |")
    m = by.get(("mem1000", "bumblebot"))
    if m and m.rss_peak_kb:
        n = m.case.chats
        lines.append(f"| peak RSS ≤ 150 MB with 1,000 conversations loaded | {m.rss_peak_kb / 1024:.0f} MB "
                     f"({m.turns} of {n} conversations) | {mark(m.rss_peak_kb / 1024 <= 150 and n >= 1000) if n >= 1000 else 'n/a (quick: fewer conversations)'} |")
    ready = [r.ready_s for (case, bot), r in by.items() if bot == "bumblebot" and r.ready_s is not None and not r.case.history]
    if ready:
        med = statistics.median(ready)
        lines.append(f"| ready ≤ 1.5 s | median {med:.2f} s, max {max(ready):.2f} s over {len(ready)} starts | "
                     f"{mark(med <= 1.5)} |")
    return lines


def cases(quick: bool) -> list[Case]:
    d = 9.0 if quick else 20.0  # several turns per chat, with THINK_S between them
    hist_chats = 3 if quick else 10
    out = [
        Case("c10-L0", 10, 0.0, True, duration=d),
        Case("c100-L0", 100, 0.0, True, duration=d),
        Case("c10-L0.2-plain", 10, 0.2, False, duration=d),
        Case("c10-L0.2-stream", 10, 0.2, True, duration=d),
        Case("c100-L0.2-plain", 100, 0.2, False, duration=d),
        Case("c100-L0.2-stream", 100, 0.2, True, duration=d),
    ]
    if hist_chats != 10:
        out.append(Case("h-ref", hist_chats, 0.0, True, duration=d, bots=("baseline",)))
    ref = "c10-L0" if hist_chats == 10 else "h-ref"
    for h in (10, 1_000, 10_000):
        out.append(Case(f"h{h}", hist_chats, 0.0, True, history=h, duration=d, baseline_of=ref, bots=("bumblebot",)))
    out.append(Case("mem1000", 200 if quick else 1000, 0.0, True, duration=0))
    return out


def code_version() -> str:
    """The commit of the tree the bots ran from, and whether the code under test had local changes."""
    import subprocess

    def git(*argv: str) -> str:
        done = subprocess.run(["git", "-C", str(ROOT), *argv], capture_output=True, text=True, timeout=10, check=False)
        return done.stdout.strip() if done.returncode == 0 else ""

    commit = git("rev-parse", "--short", "HEAD")
    if not commit:
        return f"the tree at {ROOT} (not a git checkout)"
    changed = git("status", "--porcelain", "--", "bumblebot", "adapters", "tools", "entities")
    n = len(changed.splitlines())
    return f"commit {commit}" + (f" plus uncommitted changes in {n} file(s) of bumblebot/, adapters/, tools/" if n else "")


def machine() -> str:
    cpu = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return f"{os.cpu_count()} cores ({cpu}), Linux {platform.release()}, Python {platform.python_version()}"


def report_md(results: list[Result], baselines: dict[str, Result], by: dict[tuple[str, str], Result],
              runtime: float, quick: bool, notes: list[str]) -> str:
    stamp = time.strftime("%Y-%m-%d %H:%M")
    out = [
        "# Performance",
        "",
        ("How fast a chat turn is, measured side by side with the thinnest possible bot in one run of "
        "`python bench/bench_chat.py`. Numbers are from a shared, noisy machine: compare the "
        "ratios, which are measured in the same run, more than the absolute values."),
        "",
        (f"Last run: {stamp}, {'--quick (smoke run)' if quick else 'full run'}, {runtime:.0f} s; "
         f"machine: {machine()}; code measured: {code_version()}."),
        "",
        "## Method",
        "",
        ("- **Fakes, no network.** The benchmark process serves the Telegram Bot API "
        "(`tests/fakes/telegram_server.py`) and an OpenAI-compatible endpoint "
        "(`tests/fakes/openai_server.py`) on 127.0.0.1. Each bot runs as its own subprocess, pointed at them."),
        ("- **Baseline** (`bench/baseline_bot.py`): python-telegram-bot `Application` (concurrent updates) with one "
        "`MessageHandler`: one chat completion with `openai.AsyncOpenAI`, one `sendMessage` with the reply. In "
        "streamed runs it streams the completion and still sends once at the end, so its first visible text is its "
        "complete reply."),
        ("- **Bumblebot**: `python -m bumblebot run`, the real daemon and Telegram adapter, with a config in a "
        "temporary directory: Telegram pointed at the fake, `cognition` at its defaults (classifier on), "
        "`delivery.streaming` on or off per run."),
        (f"- **Model.** Loop requests are answered with a `say` call carrying a {len(REPLY)}-character reply plus "
        "`end_turn`; tool-less requests with `CHAT` (classifier), a short summary (summaries) or `DONE: fine` "
        "(judges); the baseline's request with the same reply as text. Latency *L* applies to every request: a "
        f"whole answer comes after *L*; a streamed one starts after *L*/2 and spreads its chunks ({STREAM_CHARS} "
        "characters each) over the other *L*/2."),
        ("- **Load.** Closed loop: each chat sends a plain chat message (greetings, reactions, small talk), waits for "
        f"the complete reply, reads it for {THINK_S:g} s, then sends the next, for the run's measured window. The "
        "reading pause stands for a person: a chat that writes again the instant the answer arrives is the flood "
        "Telegram's per-chat limit (about a message a second) forbids, and Bumblebot's pacer holds such "
        "replies for it, so the run would measure the pacing rather than the bot. Turns per second include the "
        "pauses (both bots alike). One warm-up turn per chat comes "
        "first and is not measured (it creates the conversation; in the history runs it loads it)."),
        ("- **History runs**: Bumblebot only; before it starts, every chat is given 10, 1,000 or 10,000 messages of "
        "finished history through `bumblebot.store.store.Store.import_history`, copies of a real turn recorded in an "
        "earlier run of the same command. Imported history is not compacted yet, so Bumblebot compacts it over its "
        "first turns there: warm-up rounds go on until one makes no summary request (at most "
        f"{MAX_SETTLE_ROUNDS}), and the measured turns see the settled state; the cold first turn and the number of "
        "rounds are in the notes. Their ratios are to the baseline's run at the same load (it has no history)."),
        ("- **Memory run**: 1,000 chats each send one message (all at once); peak RSS is then read with every "
        "conversation loaded."),
        "",
        "Metrics:",
        "",
        "- **turns/s**: measured turns ÷ (window start to the last complete reply).",
        ("- **first**: from pushing the update to the first `sendMessage` or `editMessageText` to that chat. "
        "**complete**: to the send or edit whose text is the whole reply. p50/p95/p99 over the measured turns."),
        "- **model req/turn**: every request the fake model received during the window ÷ turns.",
        "- **tokens ÷ completion**: tokens of every request of the window (the fake's count: prompt with the "
        "tool schemas, plus the answer) ÷ tokens of the loop completions alone: what the classifier, the "
        "completion check and summaries add.",
        "- **CPU/turn**: the bot process's utime + stime (`/proc/<pid>/stat`) over the window ÷ turns.",
        ("- **peak RSS**: the bot process's `VmHWM` at the end of the run. **ready**: spawn to the bot's first "
        "`getUpdates` at the fake."),
        ("- **DB/1k turns**: growth of `bumblebot.db` (with its WAL) over the run, after a clean stop, ÷ all turns "
        "of the run (warm-up included) × 1,000. The baseline keeps no database."),
        "- Every Bumblebot cell also shows its ratio to the baseline's value in the matching run, in parentheses.",
        "",
        "Reading the numbers:",
        "",
        ("- The fakes run in the benchmark process on the same 2 cores as the bot; their own CPU per turn is in "
        "the notes."),
        ("- Bumblebot keeps to Telegram's published limits (`adapters/telegram/pacing.py`): about 30 messages a "
        "second overall, one a second per chat after a burst of three. The baseline does not, so in the runs that "
        "ask for more than 30 replies a second (100 chats, and 1,000 at once) Bumblebot's throughput and latency "
        "are bound by that limit, not by its own cost; a streamed reply takes two calls while less than half the "
        "overall window is used (preview and final edit), one past that (the preview gives way). On Telegram itself the "
        "baseline's extra rate would end in 429s and flood waits. Compare those runs' CPU per turn, not their "
        "turns per second."),
        ("- With 100 or more requests in flight the baseline's CPU goes mostly to httpcore's connection-pool "
        "bookkeeping (seen with httpcore 1.0.9: every pool event scans the pooled connections for each queued "
        "request), so its throughput at 100 chats is below its throughput at 10 chats. A bot that keeps fewer "
        "requests in flight does not pay that; one that lifts its concurrency cap will."),
        ("- `python bench/bench_chat.py --profile --only <run>` runs the bots under cProfile and prints where their "
        "CPU went (slower, so its numbers are not comparable; it never writes this file)."),
        "",
        "## Results",
        "",
        *table(results, baselines),
        "",
        "## Targets",
        "",
        *targets(by, quick),
    ]
    if notes:
        out += ["", "## Notes", "", *[f"- {n}" for n in notes]]
    return "\n".join(out) + "\n"


def collect_notes(results: list[Result], streaming_key: bool) -> list[str]:
    notes = []
    if not streaming_key:
        notes.append("`delivery.streaming` is not a config key in this tree (load_settings has no `delivery` "
                     "section): the key was left out, so Bumblebot's 'streamed' and 'not streamed' runs had the "
                     "same configuration.")
    unstreamed = [r.case.name for r in results if r.bot == "bumblebot" and r.case.stream and r.all_turns
                  and not r.requests.get("streamed") and not r.warmup_requests.get("streamed")]
    if unstreamed:
        notes.append("Bumblebot asked for no streamed completion (no request had `stream: true`) in the streamed "
                     f"runs {', '.join(unstreamed)}: its text could only show once the whole reply was generated.")
    kinds = [f"{r.case.name}: " + ", ".join(f"{k} {v / r.turns:.2f}" for k, v in sorted(r.requests.items()))
             for r in results if r.bot == "bumblebot" and r.turns and r.requests]
    if kinds:
        notes.append("Bumblebot's model requests per measured turn by kind (`streamed` counts requests that asked "
                     "to stream, already counted under their kind): " + "; ".join(kinds) + ".")
    calls = [f"{r.case.name} {r.bot}: " + ", ".join(f"{k} {v / r.all_turns:.2f}" for k, v in sorted(r.platform_calls.items()))
             for r in results if r.all_turns and r.platform_calls]
    if calls:
        notes.append("Telegram calls per turn over the whole run (warm-up included): " + "; ".join(calls) + ".")
    harness = [f"{r.case.name} {r.bot} {1000 * r.harness_cpu_s / r.turns:.1f}" for r in results if r.turns]
    if harness:
        notes.append("CPU per turn of the benchmark process itself (both fakes, on the same 2 cores), ms: "
                     + "; ".join(harness) + ".")
    for r in results:
        if r.cold_complete and r.case.history:
            warm = ", ".join(f"{k} {v}" for k, v in sorted(r.warmup_requests.items()))
            settle = (f", then {r.settle_rounds} more warm-up round(s) until compaction of the imported history "
                      "settled" if r.settle_rounds else "")
            cold = 1000 * (pct(r.cold_complete, 50) or 0)
            notes.append(f"{r.case.label}: first (cold) turn per chat p50 complete {cold:.0f} ms{settle} "
                         f"(requests over the whole warm-up: {warm}).")
        if r.error:
            notes.append(f"{r.bot}, {r.case.label}: {r.error}")
    return notes


async def amain(args: argparse.Namespace) -> int:
    started = time.monotonic()
    wanted = [s for s in args.only.split(",") if s]
    selected = [c for c in cases(args.quick)
                if not wanted or c.name in wanted or any(s in c.name for s in wanted if s not in {k.name for k in cases(args.quick)})]
    empty_db = await empty_db_bytes()
    streaming_key = streaming_key_supported()
    results: list[Result] = []
    template: list[Any] | None = None
    for case in selected:
        for bot in case.bots:
            t0 = time.monotonic()
            print(f"[{time.monotonic() - started:6.1f}s] {bot:9s} {case.label} ...", end=" ", flush=True)
            r = await run(bot, case, template, empty_db)
            template = template or r.template
            results.append(r)
            status = f"{r.turns} turns" + (f", {r.failed} failed" if r.failed else "") + (f", ERROR {r.error}" if r.error else "")
            print(f"{status} ({time.monotonic() - t0:.1f}s)", flush=True)
            if r.profile:
                print(r.profile, flush=True)
            if r.error and r.log_tail:
                print("    child log tail:\n" + "\n".join("    | " + line for line in r.log_tail.splitlines()), flush=True)
    runtime = time.monotonic() - started
    baselines = {r.case.name: r for r in results if r.bot == "baseline"}
    by = {(r.case.name, r.bot): r for r in results}
    notes = collect_notes(results, streaming_key)
    if template is None:
        notes.append("History runs used a synthetic turn shape (no recorded turn was available).")
    md = report_md(results, baselines, by, runtime, args.quick, notes)
    print()
    print(md)
    if args.write or not (args.quick or args.no_write or args.only or args.profile):
        (ROOT / "docs" / "performance.md").write_text(md)
        print(f"wrote {ROOT / 'docs' / 'performance.md'}")
    return 1 if any(r.error for r in results) else 0


def main() -> int:
    parser = argparse.ArgumentParser(description="Bumblebot vs the thinnest bot, end to end against local fakes.")
    parser.add_argument("--quick", action="store_true", help="smoke run: short windows, fewer chats; prints only")
    parser.add_argument("--only", default="", help="comma-separated run names, or substrings of them (e.g. c100-L0,h10000)")
    parser.add_argument("--write", action="store_true", help="write docs/performance.md even with --quick/--only")
    parser.add_argument("--no-write", action="store_true", help="do not write docs/performance.md")
    parser.add_argument("--profile", action="store_true",
                        help="run each bot under cProfile and print where its CPU went (slows it: numbers are not comparable)")
    parser.add_argument("--keep-tmp", action="store_true", help="keep each run's temporary directory (debugging)")
    args = parser.parse_args()
    global KEEP_TMP, PROFILE
    KEEP_TMP, PROFILE = args.keep_tmp, args.profile
    os.environ.setdefault("NO_PROXY", "127.0.0.1,localhost")
    try:
        return asyncio.run(amain(args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
