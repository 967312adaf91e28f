"""How long a request may take: each request bounded on the client by its token budget.

Some servers do not stop at ``max_tokens``: llama-cpp-python ignores it inside a tool call's
arguments (its ``chatml-function-calling`` handler generates them with ``max_tokens=None``,
until its window is full: 2,651 tokens and two minutes for a reply budgeted at 512, seen on
two cores). Nothing in the request can stop such a server, so the client does:

* a **streamed** request is read until its answer goes past the budget
  (:class:`TokenCount`), then closed; most servers stop generating when the connection closes;
* a **whole** request gets a deadline (:meth:`Speed.deadline`) from its budget and what the
  endpoint has shown of its speed; when it passes, the request is aborted.

Either way the step ends as a ``length`` finish does (the completion carries its :class:`Cut`):
what was written so far, the model told it was cut, the turn capped as after any cut.

What the endpoint has shown (:class:`Pace`, per endpoint, model and kind of request: with tools
or without, as a server constraining calls to their schema writes them slower; remembered in
``kv`` ``llm.speed:<endpoint>|<model>|<kind>``) is two speeds, each from its last
:data:`SAMPLES` requests:

* **writing**, tokens per second of the answer: exact from a stream (the tokens after the first,
  over the time after the first); from a whole answer, its tokens over its whole time (a lower
  bound: part of that time was reading the prompt). The fastest sample is used, so a long answer
  teaches the real pace and short ones cannot slow it;
* **reading**, prompt tokens per second before the first token (queueing and network
  included): from a stream, up to its first token; from a whole answer, over its whole time (a
  lower bound again). The slow quarter is used: a prompt the server had cached reads far faster
  than one it had not, and the deadline must allow for the one it had not.

Before its first requests an endpoint is assumed slow (:data:`DEFAULT_WRITING`,
:data:`DEFAULT_READING`). The deadline is a bound, never a target, and only for a model seen
writing past its budget (:class:`~bumblebot.llm.overruns.Overruns`): :data:`SLACK` times the
expected time plus :data:`FLOOR_S`, stretched for each request in flight ahead of it (a server
that answers one at a time queues them). A whole request to any other model is bounded by
``llm.timeout_s`` as before: a server that answers nothing is an outage (the failover, the
outage notice), not a ``length`` finish, and a fast endpoint that honours ``max_tokens`` is
never cut.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bumblebot.llm.capabilities import CapabilityMemory

log = logging.getLogger(__name__)

#: Requests per endpoint and model whose speeds are kept.
SAMPLES = 32
#: Tokens per second assumed before an endpoint's first measurement: a small model on a
#: laptop's CPU, so that no request of a real server is cut before it has been measured.
DEFAULT_WRITING = 5.0
#: Prompt tokens per second assumed before the first measurement (the same laptop).
DEFAULT_READING = 50.0
#: The deadline of a model seen writing past its budget: this many times the expected time...
SLACK = 1.5
#: ...plus this many seconds (connection, a server's queue).
FLOOR_S = 5.0
#: Answers shorter than this (tokens) say too little of the writing speed to be a sample.
MIN_WRITTEN = 16
#: Prompts shorter than this (tokens) say too little of the reading speed.
MIN_PROMPT = 64
#: Seconds of writing shorter than this say nothing of its speed: a proxy that buffers a stream
#: and sends it at once, or a cached answer, would teach a pace no server has.
MIN_WRITING_S = 0.5
#: Seconds between two saves of an endpoint's samples (each request adds one; the store is
#: written at most this often, and a restart loses at most that much).
SAVE_EVERY_S = 60.0
#: Characters of a string argument per token of the budget (the token estimate's scale).
CHARS_PER_TOKEN = 4


#: The kinds of request whose speeds are kept apart: with tool schemas, or without.
KINDS = ("tools", "text")


def speed_key(endpoint: str, model: str, kind: str) -> str:
    """The ``kv`` key of the speeds measured at ``endpoint`` (its name in the keys) for ``model``
    and requests of ``kind`` (:data:`KINDS`): JSON ``{"reading": [float], "writing": [float]}``
    (tokens per second, oldest first)."""
    return f"llm.speed:{endpoint}|{model}|{kind}"


def prompt_size(messages: list[dict[str, Any]]) -> int:
    """The prompt's size for the speeds, tokens: its messages' text by the token estimate, an
    image as 1,000 (cheap: no JSON is made; the tool schemas, the same in every request, are
    left out)."""
    chars = 0
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict):
                    chars += len(str(part.get("text") or "")) if part.get("type") == "text" else 4000
        for call in message.get("tool_calls") or ():
            chars += len(str((call.get("function") or {}).get("arguments") or ""))
    return chars // CHARS_PER_TOKEN


@dataclass(frozen=True, slots=True)
class Speed:
    """What an endpoint has shown of its pace for one model.

    Args:
        writing: answer tokens per second.
        reading: prompt tokens per second before the first token.
        samples: the requests it was measured from (0: assumed, :data:`DEFAULT_WRITING`).
        overruns: the endpoint was seen writing past its budget: the tight deadline.
    """

    writing: float = DEFAULT_WRITING
    reading: float = DEFAULT_READING
    samples: int = 0
    overruns: bool = False
    writing_measured: bool = False

    def expected_s(self, prompt_tokens: int, budget: int) -> float:
        """Seconds a request of ``prompt_tokens`` that writes its whole ``budget`` takes."""
        return prompt_tokens / self.reading + budget / self.writing

    def deadline(self, prompt_tokens: int, budget: int) -> float | None:
        """Seconds after which a whole request is abandoned, with nothing in flight ahead of it;
        ``None`` for a model never seen overrunning (the module's docstring)."""
        if not self.overruns:
            return None
        return FLOOR_S + SLACK * self.expected_s(prompt_tokens, budget)

    def describe(self) -> str:
        """One line for ``bumblebot check``."""
        if not self.samples:
            return (f"not measured yet; assumed {self.writing:g} tokens/s writing, "
                    f"{self.reading:g} tokens/s reading the prompt")
        writing = (f"{self.writing:.0f} tokens/s writing" if self.writing_measured
                   else f"writing not timed yet (answers too short; {self.writing:g} tokens/s assumed)")
        return f"{writing}, {self.reading:.0f} tokens/s reading the prompt (from its last {self.samples} requests)"


@dataclass(frozen=True, slots=True)
class Cut:
    """A request the client cut at its budget.

    Args:
        by: ``"tokens"`` (a stream went past its budget) or ``"deadline"`` (a whole request
            outlasted it).
        budget: the request's ``max_tokens``.
        elapsed_s: seconds from sending it to the cut.
        deadline_s: the deadline it had (whole requests).
        writing: the writing speed the deadline assumed, tokens per second.
        written: the answer's tokens counted when it was cut (streams).
    """

    by: str
    budget: int
    elapsed_s: float
    deadline_s: float | None = None
    writing: float | None = None
    written: int | None = None

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"by": self.by, "budget": self.budget, "elapsed_s": round(self.elapsed_s, 2)}
        if self.deadline_s is not None:
            out["deadline_s"] = round(self.deadline_s, 2)
        if self.writing is not None:
            out["writing"] = round(self.writing, 1)
        if self.written is not None:
            out["written"] = self.written
        return out

    def describe(self) -> str:
        """What the trace and the log say of it."""
        if self.by == "tokens":
            return f"cut after {self.written} tokens of a {self.budget}-token budget, {self.elapsed_s:.1f} s in"
        return (f"cut at its {self.deadline_s:.1f} s deadline ({self.budget} tokens at {self.writing:.0f} tokens/s "
                f"and the prompt), {self.elapsed_s:.1f} s in")


class Overran(Exception):  # noqa: N818 - a signal between the sender and the client, not an error
    """A request was cut at its budget (:class:`Cut`); the client answers it as a ``length`` finish."""

    def __init__(self, cut: Cut) -> None:
        super().__init__(cut.describe())
        self.cut = cut


@dataclass(slots=True)
class InFlight:
    """The requests in flight to one endpoint (started, not ended), and the seconds a server
    answering one at a time would take to answer them all, each writing its whole budget."""

    count: int = 0
    ahead_s: float = 0.0


@dataclass(slots=True)
class Bound:
    """What one request may take, and when it ran (monotonic seconds).

    Args:
        budget: its ``max_tokens``.
        deadline_s: seconds it may take when sent whole (``None``: ``llm.timeout_s`` bounds it).
        speed: what the deadline was computed from.
        prompt_tokens: the request's prompt (:func:`prompt_size`).
        kind: with tools or without (:data:`KINDS`).
        flight: the endpoint's requests in flight (the deadline is stretched for each ahead).
    """

    budget: int
    deadline_s: float | None
    speed: Speed = field(default_factory=Speed)
    prompt_tokens: int = 0
    kind: str = "text"
    flight: InFlight | None = None
    expected_s: float = 0.0  # what it takes, writing its whole budget, with nothing ahead
    base_s: float | None = None  # the deadline with nothing ahead
    started: float | None = None
    first: float | None = None
    ended: float | None = None

    def start(self) -> None:
        """The request is sent now. The requests already in flight to the endpoint may be
        ahead of it at a server that answers one at a time: the deadline allows for what each
        of them may take, writing its whole budget."""
        self.started, self.first, self.ended = time.monotonic(), None, None
        if self.base_s is None:
            self.base_s = self.deadline_s
        if self.flight is not None:
            if self.base_s is not None:
                self.deadline_s = self.base_s + SLACK * self.flight.ahead_s
            self.flight.count += 1
            self.flight.ahead_s += self.expected_s

    def end(self) -> None:
        if self.ended is None and self.flight is not None:
            self.flight.count -= 1
            self.flight.ahead_s = max(0.0, self.flight.ahead_s - self.expected_s)
        self.ended = time.monotonic()

    @property
    def elapsed_s(self) -> float:
        if self.started is None:
            return 0.0
        return (self.ended or time.monotonic()) - self.started

    def deadline_cut(self) -> Cut:
        return Cut("deadline", self.budget, self.elapsed_s, deadline_s=self.deadline_s, writing=self.speed.writing)

    async def whole(self, send: Callable[[], Any]) -> Any:
        """``await send()`` within the deadline (started now).

        Raises:
            Overran: the deadline passed; the request was abandoned (its connection closed).
        """
        self.start()
        if self.deadline_s is None:
            try:
                return await send()
            finally:
                self.end()
        limit = asyncio.timeout(self.deadline_s)
        try:
            async with limit:
                return await send()
        except TimeoutError:
            if not limit.expired():
                raise
            raise Overran(self.deadline_cut()) from None
        finally:
            self.end()


class TokenCount:
    """The answer of a stream counted as it comes, against its budget.

    A chunk carrying text (of the answer or of a call's arguments) is at least one token, and
    the token estimate (4 characters a token) is another count: the answer is past its budget
    when both are past it by the margin :func:`past` allows a server's own count. A server that
    sends several tokens in a chunk is cut by the estimate; one that sends a token in several
    chunks, or long tokens (a line of dashes), is not cut early by either.
    """

    __slots__ = ("budget", "chunks", "chars")

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.chunks = 0
        self.chars = 0

    def add(self, text: str) -> bool:
        """Count one chunk of ``text``; whether the answer is now past the budget."""
        self.chunks += 1
        self.chars += len(text)
        return past(self.chunks, self.budget) and past(self.chars // CHARS_PER_TOKEN, self.budget)


def past(tokens: int, budget: int) -> bool:
    """Whether ``tokens`` are past a ``budget`` by more than a server's count and Bumblebot's
    may differ: a quarter and 16 tokens."""
    return tokens > budget * 1.25 + 16


@dataclass(slots=True)
class _Samples:
    reading: list[float] = field(default_factory=list)
    writing: list[float] = field(default_factory=list)
    saved: float | None = None  # monotonic time of the last save
    loaded: bool = False
    count: int = 0  # samples added in this process
    saved_count: int = 0  # ...of which saved

    def add(self, kind: str, value: float) -> None:
        values = self.reading if kind == "reading" else self.writing
        values.append(round(value, 3))
        del values[:-SAMPLES]
        self.count += 1

    def speed(self, overruns: bool) -> Speed:
        writing = max(self.writing) if self.writing else DEFAULT_WRITING
        reading = sorted(self.reading)[len(self.reading) // 4] if self.reading else DEFAULT_READING
        return Speed(writing=writing, reading=reading, samples=max(len(self.reading), len(self.writing)),
                     overruns=overruns, writing_measured=bool(self.writing))


class Pace:
    """The speeds of one endpoint's models, measured from its requests and remembered.

    Args:
        memory: where they are kept (the store's ``kv``).
        endpoint: the endpoint's name in the keys (:func:`~bumblebot.llm.capabilities.endpoint_key`).
    """

    def __init__(self, memory: CapabilityMemory, endpoint: str) -> None:
        self.memory = memory
        self.endpoint = endpoint
        self.flight = InFlight()
        self._models: dict[tuple[str, str], _Samples] = {}

    async def _samples(self, model: str, kind: str) -> _Samples:
        samples = self._models.setdefault((model, kind), _Samples())
        if not samples.loaded:
            samples.loaded = True
            try:
                data = json.loads(await self.memory.get(speed_key(self.endpoint, model, kind)) or "{}")
                samples.reading = [float(v) for v in data.get("reading", []) if float(v) > 0][-SAMPLES:]
                samples.writing = [float(v) for v in data.get("writing", []) if float(v) > 0][-SAMPLES:]
            except (ValueError, TypeError, AttributeError):
                log.warning("endpoint %s: the remembered speeds of %s are unreadable; measuring again",
                            self.endpoint, model)
        return samples

    async def speed(self, model: str, kind: str = "text", *, overruns: bool = False) -> Speed:
        """What ``model`` at this endpoint has shown of its pace with requests of ``kind``;
        ``overruns``: it was seen writing past its budget (the tight deadline)."""
        speed = (await self._samples(model, kind)).speed(overruns)
        if (await self._samples(model, kind)).reading:
            return speed
        # reading a prompt takes as long with tools as without: until requests of this kind
        # have measured it, the other kind's measure (bumblebot check's, say) stands for it
        other = await self._samples(model, "text" if kind == "tools" else "tools")
        if not other.reading:
            return speed
        return dataclasses.replace(speed, reading=other.speed(overruns).reading)

    async def bound(
        self, model: str, messages: list[dict[str, Any]], budget: int, kind: str, *, overruns: bool = False
    ) -> Bound:
        """The bound of a request of ``messages`` to ``model`` with a ``budget`` of tokens;
        ``overruns``: the model was seen writing past its budget (it gets a deadline)."""
        speed, prompt = await self.speed(model, kind, overruns=overruns), prompt_size(messages)
        return Bound(budget, speed.deadline(prompt, budget), speed, prompt, kind, self.flight,
                     speed.expected_s(prompt, budget))

    async def observe(self, model: str, written: int, bound: Bound, *, streamed: bool, reasoned: bool = False) -> None:
        """A request was answered (or cut by its token count): ``written`` tokens (reported, or
        estimated), timed by ``bound``; ``reasoned``: reasoning tokens were reported (written
        before the answer, unseen or apart from it: they say nothing of its writing speed)."""
        if bound.started is None or bound.ended is None:
            return
        prompt_tokens = bound.prompt_tokens
        samples = await self._samples(model, bound.kind)
        total = bound.ended - bound.started
        first = (bound.first - bound.started) if streamed and bound.first is not None else None
        before = samples.count
        if first is not None:
            if prompt_tokens >= MIN_PROMPT and first > 0:
                samples.add("reading", prompt_tokens / first)
            if written >= MIN_WRITTEN and total - first >= MIN_WRITING_S and not reasoned:
                samples.add("writing", (written - 1) / (total - first))
        elif total > 0:
            if prompt_tokens >= MIN_PROMPT:
                samples.add("reading", prompt_tokens / total)
            if written >= MIN_WRITTEN and total >= MIN_WRITING_S and not reasoned:
                samples.add("writing", written / total)
        if samples.count != before and (samples.saved is None or time.monotonic() - samples.saved >= SAVE_EVERY_S):
            await self._save(model, bound.kind, samples)

    async def flush(self) -> None:
        """Save the samples measured since the last save (the client is closing)."""
        for (model, kind), samples in self._models.items():
            if samples.count != samples.saved_count:
                await self._save(model, kind, samples)

    async def _save(self, model: str, kind: str, samples: _Samples) -> None:
        samples.saved, samples.saved_count = time.monotonic(), samples.count
        value = json.dumps({"reading": samples.reading, "writing": samples.writing})
        await self.memory.set(speed_key(self.endpoint, model, kind), value)
