"""Crash drills: ``bumblebot run`` as a subprocess, SIGKILLed mid-turn, restarted.

Everything is real except the two ends: the CLI runs in its own process with its own SQLite
file, and talks to :class:`~fakes.openai_server.FakeOpenAI` (the model) and
:class:`~fakes.telegram_server.FakeTelegram` (the users). What is checked is what a user can
see, plus what the tools left behind on disk:

* ``test_sigkill_drill_answers_every_message_exactly_once``: 120 messages in 10 private chats
  pushed at ~15/s; the daemon is SIGKILLed 3-5 times at random model-call moments and
  restarted (each life gets its share of the messages, so every kill lands in real work).
  Every message must get exactly one visible answer in the end.
* ``test_kill_between_append_file_and_the_next_step_appends_once``: a work tool's effect must
  not be repeated when the turn is resumed after a crash.
* ``test_kill_after_a_delivered_say_never_repeats_it``: what ``say`` delivered before a crash
  is part of every later request, and is not delivered again.

The fake model is a rule, not a script, where a crash can land anywhere: it answers only what
is not answered yet *in the messages of its request*, and it never says again a text its
history already holds, whatever that ``say`` call's result reports (as capable models do: they
do not repeat themselves). So the engine must deliver every ``say`` it recorded exactly once by
itself: one a crash cut off before it reached the outbox is delivered when the turn resumes.
The model ignores the daemon's prose hints such as "Already told the user: ...": an engine
that resumes an interrupted turn from its checkpointed steps passes, an engine that re-runs the
turn from scratch and relies on the model heeding a hint does not.

Kill moments are event-driven: "the k-th model request of this daemon's life arrives" (k
random), and the kill happens while the fake holds that request. Before the signal the fake
also waits until every other chat is parked in a model call (each released loop reply has been
followed by that chat's next request), so no ``sendMessage`` is in flight at the kill: a kill
inside a ``sendMessage`` is an in-doubt window (the platform may have shown the message, the
daemon cannot know) that no engine can close on Telegram, which has no idempotency key (on
Discord a nonce closes it). ``tests/test_crash_points.py`` crashes a turn after every single
write instead, deterministically, that window included. ``DRILL_SEED=<n>`` replays the random choices (kill
points, message order, latencies; the interleaving of concurrent chats stays up to the OS).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import sqlite3
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from conftest import write_config
from fakes.openai_server import FakeOpenAI, Reply, error, is_loop, text, tool_calls
from fakes.telegram_server import FakeTelegram
from support import (
    Gate,
    contents,
    kill_inside_model_call,
    say,
    start_daemon,
    stop_daemon,
    tool_result,
)

TOKEN = re.compile(r"q(\d+)-\d+")  # a user message's unique token, q<chat>-<n>
ANSWER = re.compile(r"a:(q\d+-\d+)")  # the model's answer to it, a:q<chat>-<n>

CHATS = [101 + i for i in range(10)]
MESSAGES_PER_CHAT = 12
PUSH_RATE_PER_S = 15.0
LATENCY_S = (0.05, 0.3)


# -- reading a chat-completions request -------------------------------------------------------


def _text_of(content: Any) -> str:
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


def user_texts(request: dict[str, Any]) -> list[str]:
    """Contents of the user-role messages (user messages, preamble, the daemon's nudges)."""
    return [_text_of(m.get("content")) for m in request["messages"] if m["role"] == "user"]


def said_texts(request: dict[str, Any]) -> list[str]:
    """Texts of the ``say`` calls in ``request`` whose tool result says the user got it (or
    will: ``queued``), as a model reads its own tool results. A ``say`` a crash cut off
    before it was sent comes back ``delivered: false`` and does not count."""
    results: dict[str, Any] = {}
    for m in request["messages"]:
        if m["role"] == "tool":
            try:
                results[m.get("tool_call_id")] = json.loads(m.get("content") or "")
            except ValueError:
                results[m.get("tool_call_id")] = None
    out = []
    for m in request["messages"]:
        if m["role"] != "assistant":
            continue
        for call in m.get("tool_calls") or ():
            if call["function"]["name"] != "say":
                continue
            result = results.get(call["id"])
            if not (isinstance(result, dict) and (result.get("delivered") or result.get("queued"))):
                continue
            try:
                out.append(str(json.loads(call["function"]["arguments"]).get("text", "")))
            except ValueError:
                out.append(call["function"]["arguments"])
    return out


def written_texts(request: dict[str, Any]) -> list[str]:
    """Texts of every ``say`` call in ``request``, whatever its result says, plus plain
    assistant text: everything the model has written so far."""
    out = [_text_of(m.get("content")) for m in request["messages"] if m["role"] == "assistant"]
    for m in request["messages"]:
        for call in m.get("tool_calls") or ():
            if call["function"]["name"] == "say":
                try:
                    out.append(str(json.loads(call["function"]["arguments"]).get("text", "")))
                except ValueError:
                    out.append(call["function"]["arguments"])
    return out


def chat_of(request: dict[str, Any]) -> int | None:
    """The chat a request is about (every token in it belongs to one chat), or None."""
    chats = {int(c) for c in TOKEN.findall(contents(request))}
    return chats.pop() if len(chats) == 1 else None


def token_order(token: str) -> tuple[int, int]:
    chat, n = token[1:].split("-")
    return int(chat), int(n)


def end_turn() -> Reply:
    return tool_calls(("end_turn", {}))


def judge_or(loop_reply: Callable[[dict[str, Any]], Reply]) -> Callable[[dict[str, Any]], Reply]:
    """A model: ``loop_reply(request)`` for loop requests, "DONE" for judges and the like."""

    def model(request: dict[str, Any]) -> Reply:
        return loop_reply(request) if is_loop(request) else text("DONE: fine")

    return model


# -- the drill's model ------------------------------------------------------------------------


def answer_what_is_unanswered(request: dict[str, Any]) -> Reply:
    """One ``say("a:<token>")`` per token asked and not yet answered in its history (a text
    it wrote once is never written again); ``end_turn`` if none."""
    asked = {m.group() for t in user_texts(request) for m in TOKEN.finditer(t)}
    answered = {a for t in written_texts(request) for a in ANSWER.findall(t)}
    todo = sorted(asked - answered, key=token_order)
    if not todo:
        return end_turn()
    return tool_calls(*[("say", {"text": f"a:{token}"}) for token in todo])


@dataclass
class Life:
    """One daemon process as the fake model sees it."""

    kill_at: int | None  # the model request (1-based, counted in this life) that triggers a kill
    requests: int = 0
    frozen: bool = False  # from the kill trigger on, every request is held until the kill
    kill_now: asyncio.Event = field(default_factory=asyncio.Event)
    dead: asyncio.Event = field(default_factory=asyncio.Event)
    #: chats whose last released loop reply has not yet brought their next request
    awaiting: set[int] = field(default_factory=set)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    in_calls: int = 0  # requests the fake has not answered yet


class DrillModel:
    """``llm.default`` for the drill: latency, the answering rule, and kill triggers."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.life = Life(kill_at=None)

    def new_life(self, kill_at: int | None) -> Life:
        self.life.dead.set()  # anything still held from the last process is dropped
        self.life = Life(kill_at=kill_at)
        return self.life

    async def __call__(self, request: dict[str, Any]) -> Reply:
        life = self.life
        life.in_calls += 1
        try:
            return await self._answer(life, request)
        finally:
            life.in_calls -= 1

    async def _answer(self, life: Life, request: dict[str, Any]) -> Reply:
        chat = chat_of(request)
        life.requests += 1
        if chat is not None:
            life.awaiting.discard(chat)
            life.changed.set()
        if life.kill_at is not None and life.requests == life.kill_at:
            life.frozen = True
            life.kill_now.set()
        if not life.frozen:
            await asyncio.sleep(self.rng.uniform(*LATENCY_S))  # simulated model latency
        if life.frozen or life is not self.life:
            await life.dead.wait()
            return error(503, "the daemon was killed while this reply was held")
        if not is_loop(request):
            return text("DONE: fine")
        if chat is not None:
            life.awaiting.add(chat)
        return answer_what_is_unanswered(request)

    async def quiesce(self, timeout: float) -> bool:
        """Wait until every chat that got a loop reply is back with its next (held) request:
        nothing the daemon does then is a delivery. False if that took over ``timeout``."""
        life = self.life
        try:
            async with asyncio.timeout(timeout):
                while life.awaiting:
                    life.changed.clear()
                    await life.changed.wait()
        except TimeoutError:
            return False
        return True


# -- driving the daemon -----------------------------------------------------------------------


def drill_seed() -> int:
    raw = os.environ.get("DRILL_SEED")
    return int(raw) if raw else random.SystemRandom().randrange(2**32)


class Pusher:
    """Pushes one message per token at a steady pace (the pace is the stimulus), never past
    ``allowed``: each daemon life releases its share, so every life has fresh work to be
    killed in."""

    def __init__(self, tg: FakeTelegram, tokens: list[str], rate: float) -> None:
        self.tg, self.tokens, self.rate = tg, tokens, rate
        self.allowed = 0
        self._more = asyncio.Event()

    def allow(self, n: int) -> None:
        self.allowed = max(self.allowed, n)
        self._more.set()

    async def run(self) -> None:
        for i, token in enumerate(self.tokens):
            while i >= self.allowed:
                self._more.clear()
                await self._more.wait()
            self.tg.push_text(f"please answer {token}", chat_id=token_order(token)[0])
            await asyncio.sleep(1 / self.rate)


def drill_tokens(rng: random.Random) -> list[str]:
    """Round n holds ``q<chat>-<n>`` of every chat, in random order; rounds in order."""
    tokens = []
    for n in range(1, MESSAGES_PER_CHAT + 1):
        round_ = [f"q{chat}-{n}" for chat in CHATS]
        rng.shuffle(round_)
        tokens += round_
    return tokens


async def event_or_exit(event: asyncio.Event, proc: asyncio.subprocess.Process, timeout: float) -> None:
    """Wait for ``event``; AssertionError if the daemon exits first or it takes too long."""
    waiting = asyncio.ensure_future(event.wait())
    exiting = asyncio.ensure_future(proc.wait())
    done, pending = await asyncio.wait(
        {waiting, exiting}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
    )
    for task in pending:
        task.cancel()
    if waiting not in done:
        if exiting in done:
            raise AssertionError(f"the daemon exited by itself with {proc.returncode}")
        raise AssertionError(f"no kill trigger within {timeout}s")


async def run_until_killed(model: DrillModel, config: Path, tmp_path: Path, kill_at: int) -> str:
    """Start a daemon, SIGKILL it at the ``kill_at``-th model request; describe the kill."""
    life = model.new_life(kill_at)
    proc = await start_daemon(config, tmp_path)
    try:
        await event_or_exit(life.kill_now, proc, timeout=30)
        quiet = await model.quiesce(timeout=5)
        in_calls = life.in_calls
        proc.send_signal(signal.SIGKILL)
        await asyncio.wait_for(proc.wait(), 10)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        life.dead.set()
    return f"k={kill_at}: {in_calls} in model calls" + ("" if quiet else ", a chat was still busy")


def answer_counts(tg: FakeTelegram, chats: list[int]) -> Counter[str]:
    """How often each token was answered visibly in its own chat."""
    counts: Counter[str] = Counter()
    for chat in chats:
        for sent in tg.sent(chat):
            counts.update(a for a in ANSWER.findall(sent) if a.startswith(f"q{chat}-"))
    return counts


async def until_every_token_answered(tg: FakeTelegram, tokens: list[str], timeout: float) -> None:
    """Wait (one sendMessage at a time) until every token has at least one visible answer."""
    deadline = asyncio.get_running_loop().time() + timeout
    while missing := [t for t in tokens if answer_counts(tg, CHATS)[t] == 0]:
        remaining = deadline - asyncio.get_running_loop().time()
        try:
            await tg.wait_for("sendMessage", n=len(tg.sent()) + 1, timeout=max(remaining, 0.01))
        except AssertionError:
            raise AssertionError(
                f"{len(missing)} token(s) never answered within {timeout}s: {missing}"
            ) from None


def outbox_statuses(db: Path, texts: list[str]) -> dict[str, list[str]]:
    """Outbox row statuses per text (a diagnostic: two rows = said twice, one row = resent)."""
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
            marks = ",".join("?" * len(texts))
            rows = conn.execute(
                f"SELECT text, status FROM outbox WHERE text IN ({marks}) ORDER BY id", texts
            ).fetchall()
    except sqlite3.Error as exc:
        return {t: [f"unreadable: {exc}"] for t in texts}
    out: dict[str, list[str]] = {t: [] for t in texts}
    for row_text, status in rows:
        out[row_text].append(status)
    return out


# -- test 1: the drill ------------------------------------------------------------------------


def describe_wrong(wrong: dict[str, int], db: Path) -> str:
    """Tokens not answered exactly once, grouped by cause (from the outbox rows)."""
    rows = outbox_statuses(db, [f"a:{t}" for t in wrong])
    causes: dict[str, list[str]] = {"never answered": [], "said again": [], "resent": []}
    for token, n in wrong.items():
        statuses = rows[f"a:{token}"]
        cause = "never answered" if n == 0 else "said again" if len(statuses) >= n else "resent"
        causes[cause].append(f"{token}x{n} (outbox {','.join(statuses) or '-'})")
    return "; ".join(f"{len(v)} {k}: {' '.join(v)}" for k, v in causes.items() if v)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("debounce_s", [0.0, 0.3], ids=["at-once", "debounced"])
async def test_sigkill_drill_answers_every_message_exactly_once(
    tmp_path: Path, llm: FakeOpenAI, tg: FakeTelegram, debounce_s: float
):
    """``debounced`` runs the same drill with bursts merged (``cognition.debounce_s``): turns restarted or sent
    back to the inbox for a burst must still answer every message exactly once."""
    seed = drill_seed()
    rng = random.Random(seed)
    model = DrillModel(random.Random(f"{seed}:latency"))
    llm.default = model
    # one say per token; a merged turn can answer more than the default four messages
    config = write_config(
        tmp_path, llm, tg, cognition={"classifier": False, "max_messages_per_turn": 20, "debounce_s": debounce_s}
    )
    tokens = drill_tokens(rng)
    kill_plan = [rng.randint(1, 20) for _ in range(rng.randint(3, 5))]
    # each killed life releases whole rounds (every chat gets new messages), the last one the rest
    share = len(CHATS) * (MESSAGES_PER_CHAT // (len(kill_plan) + 1))
    pusher = Pusher(tg, tokens, PUSH_RATE_PER_S)
    kills: list[str] = []

    def where() -> str:
        return f"seed={seed} (rerun with DRILL_SEED={seed}), kills {kills}"

    pushing = asyncio.create_task(pusher.run())
    try:
        for life, kill_at in enumerate(kill_plan, 1):
            pusher.allow(life * share)
            try:
                kills.append(await run_until_killed(model, config, tmp_path, kill_at))
            except AssertionError as exc:
                raise AssertionError(f"{where()}: life {life}: {exc}") from None
        model.new_life(kill_at=None)
        pusher.allow(len(tokens))
        proc = await start_daemon(config, tmp_path)
        try:
            await pushing
            await until_every_token_answered(tg, tokens, timeout=60)
        except AssertionError as exc:
            raise AssertionError(f"{where()}: {exc}") from None
        finally:
            code = await stop_daemon(proc)
    finally:
        pushing.cancel()

    log = (tmp_path / "daemon.log").read_text()
    assert code == 0, f"{where()}: exit code {code} on SIGTERM; daemon log tail:\n{log[-3000:]}"
    assert len(kills) >= 3, f"{where()}: only {len(kills)} kills"
    counts = answer_counts(tg, CHATS)
    wrong = {t: counts[t] for t in sorted(tokens, key=token_order) if counts[t] != 1}
    assert not wrong, (
        f"{where()}: {len(wrong)} of {len(tokens)} tokens were not answered exactly once: "
        + describe_wrong(wrong, tmp_path / "data" / "bumblebot.db")
    )


# -- test 2: a work tool's step, then a kill ---------------------------------------------------

NOTE = {"path": "notes.txt", "content": "line one\n"}  # tools/files.py AppendFileArgs


def note_taker(request: dict[str, Any]) -> Reply:
    """After the restart: report once the append is in the request, else (never having seen
    its earlier step) append again."""
    if tool_result(request, "append_file"):
        return say("done, noted")
    return tool_calls(("append_file", NOTE))


@pytest.mark.timeout(60)
async def test_kill_between_append_file_and_the_next_step_appends_once(
    tmp_path: Path, llm: FakeOpenAI, tg: FakeTelegram
):
    chat = 31
    notes = tmp_path / "data" / "workspace" / "notes.txt"
    llm.default = judge_or(note_taker)
    llm.push(tool_calls(("append_file", NOTE)), when=is_loop)  # step 1
    hang = Gate(say("never delivered"))  # step 2: the process dies inside this model call
    llm.push(hang, when=is_loop)
    config = write_config(tmp_path, llm, tg)

    await kill_inside_model_call(config, tmp_path, tg, hang, "note down: line one", chat)
    assert notes.exists() and notes.read_text() == "line one\n", "step 1 did not run before the kill"

    proc = await start_daemon(config, tmp_path)
    try:
        await tg.wait_for("sendMessage", predicate=lambda p: int(p["chat_id"]) == chat, timeout=30)
    finally:
        code = await stop_daemon(proc)

    problems = []
    written = notes.read_text()
    if written.count("line one") != 1:
        problems.append(f"notes.txt holds 'line one' {written.count('line one')} times: {written!r}")
    if tg.sent(chat) != ["done, noted"]:
        problems.append(f"the user saw {tg.sent(chat)!r}, not just ['done, noted']")
    if code != 0:
        problems.append(f"exit code {code} on SIGTERM")
    assert not problems, "; ".join(problems)


# -- test 3: a delivered say, then a kill ------------------------------------------------------

FOLLOW_UPS = {"follow-up one": "answer one", "follow-up two": "answer two"}


def two_parts(request: dict[str, Any]) -> Reply:
    """After the restart: "first part" unless the request shows it said, then "second part",
    then one distinct answer per follow-up question."""
    said = said_texts(request)
    if "first part" not in said:
        return say("first part", end=False)
    if "second part" not in said:
        return say("second part")
    asked = "\n".join(user_texts(request))
    for question, answer in FOLLOW_UPS.items():
        if question in asked and answer not in said:
            return say(answer)
    return end_turn()


async def until_sent(tg: FakeTelegram, chat: int, wanted: str) -> None:
    await tg.wait_for(
        "sendMessage", predicate=lambda p: int(p["chat_id"]) == chat and p.get("text") == wanted, timeout=30
    )


@pytest.mark.timeout(60)
async def test_kill_after_a_delivered_say_never_repeats_it(
    tmp_path: Path, llm: FakeOpenAI, tg: FakeTelegram
):
    chat = 32
    llm.default = judge_or(two_parts)
    llm.push(say("first part", end=False), when=is_loop)  # step 1: said, turn not ended
    hang = Gate(say("never delivered"))  # step 2: the process dies inside this model call
    llm.push(hang, when=is_loop)
    config = write_config(tmp_path, llm, tg)

    # deliberate ("file"): a reflex turn would end at its first say (one reply)
    await kill_inside_model_call(config, tmp_path, tg, hang, "tell me about the readme in two parts", chat)
    assert tg.sent(chat) == ["first part"], "step 1's say was not delivered before the kill"

    restarted_at = len(llm.requests)
    proc = await start_daemon(config, tmp_path)
    try:
        await until_sent(tg, chat, "second part")
        for question, answer in FOLLOW_UPS.items():
            tg.push_text(question, chat_id=chat)
            await until_sent(tg, chat, answer)
    finally:
        code = await stop_daemon(proc)

    after = [r for r in llm.requests[restarted_at:] if is_loop(r)]
    blind = [i for i, r in enumerate(after) if "first part" not in said_texts(r)]
    sent = tg.sent(chat)
    problems = []
    if sent.count("first part") != 1:
        problems.append(f"'first part' was delivered {sent.count('first part')} times")
    if blind:
        problems.append(
            f"{len(blind)} of {len(after)} loop requests after the restart lack the say('first part') call "
            f"(numbers {blind})"
        )
    if sent != ["first part", "second part", "answer one", "answer two"]:
        problems.append(f"transcript {sent!r}")
    if code != 0:
        problems.append(f"exit code {code} on SIGTERM")
    assert after, "no loop request after the restart"
    assert not problems, "; ".join(problems)
