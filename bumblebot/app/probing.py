"""What ``bumblebot check`` learns about the endpoint, kept where the daemon looks for it.

``check`` tries the endpoint as a first turn would (a tool request, streamed when
``delivery.streaming`` is on; a request asking for thinking under ``llm.thinking.mode: auto``)
and asks each model's context window (:mod:`bumblebot.llm.window`). Its client remembers what
it learns in the daemon's own database (:func:`writable_store`): the ``"auto"`` fallback of tool
forcing, whole answers instead of streams, a refusal of thinking, the window. So the daemon's
first real turn pays nothing to find them out again.

Writing next to a running daemon is safe: the database is in WAL mode, every connection waits
up to 10 s for another's write (``busy_timeout``), and ``check`` writes only small ``kv`` rows;
it never takes the daemon's instance lock. A running daemon keeps what it already knows in
memory and reads ``check``'s rows at its next start.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from typing import Any

from bumblebot.core.errors import StoreError
from bumblebot.core.settings import Settings
from bumblebot.llm import LLM, Completion, SayListener
from bumblebot.llm.window import LearnedWindow
from bumblebot.store import Store

log = logging.getLogger(__name__)

PING_TOOL = {
    "type": "function",
    "function": {"name": "ping", "description": "Answer a ping.", "parameters": {"type": "object", "properties": {}}},
}
#: Tool requests ``check`` makes at most: one, and more only while forcing or streaming is
#: still undecided (an unexplained refusal or a dropped stream counts once per request).
MAX_TOOL_PROBES = 3


async def writable_store(settings: Settings) -> Store | None:
    """The daemon's database opened for writing (created when missing, as the daemon would),
    for ``check``'s client to remember what it learns in (``CapabilityMemory`` on its ``kv``).
    ``None`` when it cannot be opened: ``check`` then learns for itself only."""
    store = Store(settings.db_path)
    try:
        await store.open()
    except (StoreError, sqlite3.Error, OSError) as exc:
        log.warning("check cannot write what it learns to %s (%s)", settings.db_path, exc)
        return None
    return store


async def probe_tools(llm: LLM, on_say: SayListener | None) -> Completion:
    """Tool requests until what a first turn would find out is decided: forcing accepted, or
    its fallback remembered; the request streamed, or whole answers remembered (when
    ``on_say`` streams it). At most :data:`MAX_TOOL_PROBES`; the last completion comes back.
    The first tries ``"required"`` even under a remembered fallback (a re-try of it, as the
    daemon's: accepted, forcing is back; refused, the fallback's timer starts again)."""
    probe, retry_s = None, llm.forcing_retry_s
    if await llm.forcing_fallback() is not None:
        llm.forcing_retry_s = 0.0
    for _ in range(MAX_TOOL_PROBES):
        try:
            probe = await llm.complete(
                [{"role": "user", "content": "Call the ping tool now."}], max_tokens=64, tools=[PING_TOOL],
                on_say=on_say,
            )
        finally:
            llm.forcing_retry_s = retry_s
        forcing_known = (llm.settings.tool_choice != "required" or probe.tool_choice == "required"
                         or await llm.forcing_fallback() is not None)
        streaming_known = on_say is None or probe.streamed or await llm.stream_fallback() is not None
        if forcing_known and streaming_known:
            break
    assert probe is not None
    return probe


async def probe_thinking(llm: LLM, settings: Settings) -> None:
    """Under ``llm.thinking.mode: auto``, one request asking for thinking, as deliberate turns
    do: a refusal is remembered (``Thinking``) before a turn pays for it."""
    if settings.llm.thinking.mode == "auto" and await llm.thinks():
        await llm.complete([{"role": "user", "content": "Say ok."}], max_tokens=8, thinking=True)


async def window_lines(settings: Settings, llm: LLM) -> list[tuple[bool, str, str]]:
    """Ask each model's window and say, per model, the configured one, the endpoint's and the
    one the daemon uses: ``(fine, what, detail)``; ``fine`` is ``False`` when a configured
    window is larger than the endpoint's (the daemon corrects it)."""
    models = list(dict.fromkeys([llm.model, llm.reflex_model]))
    await llm.windows.load(models)
    said = await llm.windows.ask(models)
    cognition = settings.cognition
    configured = "max_context_tokens" in cognition.model_fields_set
    mine = (f"cognition.max_context_tokens is {cognition.max_context_tokens}" if configured
            else f"cognition.max_context_tokens is not set ({cognition.max_context_tokens} assumed)")
    lines = []
    for model in models:
        window = said.get(model) or llm.windows.get(model)
        lines.append(_window_line(model, window, said.get(model) is not None, mine, configured,
                                  cognition.max_context_tokens))
    return lines


def _window_line(
    model: str, window: LearnedWindow | None, told: bool, mine: str, configured: bool, tokens: int
) -> tuple[bool, str, str]:
    what = f"context window {model}"
    if window is None:
        return True, what, (
            f"{mine}; the endpoint does not say its window (no /props, /models max_model_len or /api/show: "
            f"llama-cpp-python's server and hosted APIs do not), so the daemon uses {tokens} until a "
            "context-length refusal states the endpoint's; set cognition.max_context_tokens to the server's "
            "context size (llama-cpp-python: --n_ctx) to spare that refusal"
        )
    if told:
        source = f"the endpoint says {window.describe()}"
    else:
        source = f"the daemon learned {window.describe()} at {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(window.since))}"
    if window.assumed and configured:
        return True, what, f"{mine}; {source}: the configured window wins over an assumption"
    if window.tokens >= tokens:
        return True, what, f"{mine}; {source}: the daemon uses {tokens}"
    hint = f"; lower cognition.max_context_tokens to {window.tokens}" if configured else ""
    return not configured, what, f"{mine}; {source}: the daemon uses {window.tokens}{hint}"


def learned_forcing(before: Any, forced_now: bool, after: Any, now: float | None = None) -> tuple[bool, str] | None:
    """The "tool forcing" line when ``check`` itself learned something: ``(fine, detail)``, or
    ``None`` when it learned nothing new. ``before``/``after``: the remembered fallback
    (a :class:`~bumblebot.llm.ForcingFallback`) before and after the probes."""
    if before is None and after is not None:
        return False, (
            "auto: the endpoint refused tool_choice=required just now; remembered for the daemon, which uses "
            "'auto' from its first turn: " + after.describe(time.time() if now is None else now)
        )
    if before is None and not forced_now:
        return False, ("required remembered, but the endpoint refused tool_choice=required just now; the daemon "
                       "falls back to 'auto' after a few refusals (see docs/cognition.md, Endpoint quirks)")
    return None
