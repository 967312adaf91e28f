"""What ``bumblebot check`` learns about the endpoint, kept where the daemon looks for it.

``check`` tries the endpoint as a first turn would (a tool request, streamed when
``delivery.streaming`` is on; a request asking for thinking under ``llm.thinking.mode: auto``)
and asks each model's context window (:mod:`bumblebot.llm.window`); a local server that says
its window nowhere (llama-cpp-python) is sent one request too long for any window it could run
with, which it refuses before evaluating it, stating its window (:func:`probe_window`). Its
client remembers what it learns in the daemon's own database (:func:`writable_store`): the
``"auto"`` fallback of tool forcing, whole answers instead of streams, a refusal of thinking,
the window. So the daemon's first real turn pays nothing to find them out again.

Writing next to a running daemon is safe: the database is in WAL mode, every connection waits
up to 10 s for another's write (``busy_timeout``), and ``check`` writes only small ``kv`` rows;
it never takes the daemon's instance lock. A running daemon keeps what it already knows in
memory and reads ``check``'s rows at its next start.

The database stays the daemon's: ``check`` run as root writes into an existing one without
changing its owner (SQLite gives the ``-wal`` and ``-shm`` files it creates the database's
owner), and creates a missing one only owned as its data directory is (:func:`writable_store`).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import time
from pathlib import Path
from urllib.parse import urlsplit

from bumblebot.core.errors import ContextTooLong, ModelError, STORE_FAILURES, StoreError
from bumblebot.core.settings import Settings
from bumblebot.llm import LLM, Completion, ForcingFallback, SayListener
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
#: The request ``check`` sends a local server that says its window nowhere, in estimated tokens
#: (4 characters each, about 1 MB): larger than any window such a server runs with, so it
#: refuses it before evaluating it (llama-cpp-python counts a prompt's tokens first: about a
#: second for this one) and its refusal states its window. At least twice the configured window.
WINDOW_PROBE_TOKENS = 262_144
#: Seconds that request may take (a server that evaluated it instead would take minutes).
WINDOW_PROBE_TIMEOUT_S = 20.0
#: Seconds the endpoint's host name may take to resolve (is it on this machine or network?).
RESOLVE_TIMEOUT_S = 5.0
#: An endpoint that answered (or outlasted) the oversized request is not sent it again for this
#: long: its window is larger, and another try costs as much.
WINDOW_PROBE_RETRY_S = 30 * 86_400.0
_PROBE_TEXT = "the quick brown fox jumps over the lazy dog. "
#: Where what ``check`` learns goes when the daemon's database is open for it.
REMEMBERED = "remembered for the daemon"


async def writable_store(settings: Settings) -> tuple[Store | None, str]:
    """The daemon's database opened for writing, for ``check``'s client to remember what it
    learns in (``CapabilityMemory`` on its ``kv``), or ``None`` and why not: ``check`` then
    learns for itself only.

    A missing database is created only owned as its data directory is, so that the daemon's
    user can open it: by the user ``check`` runs as when the directory is that user's, or, as
    root, for the user the directory belongs to (``service install`` gave it to the service
    user). In a directory of root's own, root creates none: the directory may not have been
    given to the service user yet, and the daemon's first start creates the database then.
    PostgreSQL (``store.url``) is opened as the daemon opens it."""
    if settings.on_postgres:
        store = Store(settings.store_location)
        try:
            await store.open()
        except StoreError as exc:
            return None, f"{settings.store_shown} cannot be opened for writing ({exc})"
        return store, ""
    path = settings.db_path
    if os.geteuid() == 0 and path.is_symlink():  # root would create or write whatever it points at
        return None, f"{path} is a symbolic link: check, run as root, writes nothing through it"
    if not path.exists():
        why = await asyncio.to_thread(_create_owned, path)
        if why:
            return None, why
    store = Store(path)
    try:
        await store.open()
    except (StoreError, *STORE_FAILURES, OSError) as exc:
        log.warning("check cannot write what it learns to %s (%s)", path, exc)
        return None, f"{path} cannot be opened for writing ({exc})"
    return store, ""


def _create_owned(path: Path) -> str:
    """Create the empty database file ``path`` owned as its directory is (``""``), or say why
    not. SQLite then gives the ``-wal`` and ``-shm`` files the same owner, as root too."""
    try:
        folder = path.parent.stat()
    except OSError as exc:
        return f"its data directory cannot be read ({exc.strerror or exc})"
    me = os.geteuid()
    if folder.st_uid != me and me != 0:
        return f"there is no database yet, and {path.parent} is not this user's: the daemon's first start creates it"
    if folder.st_uid == 0 and me == 0:
        return ("there is no database yet, and check runs as root in a data directory of root's: the daemon's first "
                "start creates it, owned by the user it runs as")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:  # made meanwhile, or a dangling symbolic link (O_EXCL never follows one)
        return "" if not path.is_symlink() else f"{path} is a symbolic link: check writes nothing through it"
    except OSError as exc:
        return f"{path} cannot be created ({exc.strerror or exc})"
    try:
        if me == 0:
            os.fchown(fd, folder.st_uid, folder.st_gid)
    except OSError as exc:
        path.unlink(missing_ok=True)  # not left root's
        return f"{path} cannot be given to the data directory's owner ({exc.strerror or exc})"
    finally:
        os.close(fd)
    return ""


async def probe_tools(llm: LLM, on_say: SayListener | None) -> Completion:
    """Tool requests until what a first turn would find out is decided: forcing accepted, or
    its fallback remembered; the request streamed, or whole answers remembered (when
    ``on_say`` streams it). At most :data:`MAX_TOOL_PROBES`; the last completion comes back.
    The first tries ``"required"`` even under a remembered fallback (a re-try of it, as the
    daemon's: accepted, forcing is back; refused, the fallback's timer starts again)."""
    probe = None
    if await llm.forcing_fallback() is not None:
        llm.retry_forcing()
    for _ in range(MAX_TOOL_PROBES):
        probe = await llm.complete(
            [{"role": "user", "content": "Call the ping tool now."}], max_tokens=64, tools=[PING_TOOL], on_say=on_say,
        )
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


#: The request that measures an endpoint's speed: a prompt to read and a long answer to write,
#: cut at :data:`SPEED_PROBE_TOKENS` (paid once per ``check``: about 300 tokens in, 64 out).
SPEED_PROBE = "Count from 1 to 200 in words, separated by commas: one, two, three, four, five, " * 4
SPEED_PROBE_TOKENS = 64


#: The tool of the request that asks whether a server stops at ``max_tokens`` inside a tool
#: call's arguments: its text is bounded by the schema, so that a server that does not stop (and
#: constrains arguments to their schema) stops there, within seconds.
NOTE_TOOL = {
    "type": "function",
    "function": {
        "name": "note", "description": "Keep a note.",
        "parameters": {"type": "object", "properties": {"text": {"type": "string", "maxLength": 400}},
                       "required": ["text"]},
    },
}
#: Its budget. A call with a ``text`` argument takes more tokens than this before any text: a
#: server that stops at ``max_tokens`` cuts every answer (``length``); one that does not writes
#: the whole call, up to 400 characters.
OVERRUN_PROBE_TOKENS = 4
#: What it asks for: counting, which even a 135M model keeps doing once started.
OVERRUN_PROBE = "Call the note tool. Its text: the numbers from one to one hundred in words, separated by commas."
#: Requests at most: a model that wrote an empty call shows neither, and is asked again.
OVERRUN_PROBES = 3


async def probe_overrun(llm: LLM, model: str, on_say: SayListener | None) -> None:
    """Tool requests to ``model`` with a budget of :data:`OVERRUN_PROBE_TOKENS` that ask for a
    long argument (streamed when ``on_say`` is given, as turns are): a model that writes past
    the budget is remembered as one (:class:`~bumblebot.llm.overruns.Overruns`) before a turn pays
    for a runaway. llama-cpp-python ignores ``max_tokens`` inside a call's arguments.

    An answer cut at the budget (``length``) shows a server that stops there. An answer that
    was not cut, of more than twice the budget by the server's own count, shows one that does
    not: by its own count, so the margin that turns allow for two different counts is not
    needed, and SmolLM2-135M's notes of 11 to 27 tokens are caught (a margin of 16 tokens let
    them through, and its first runaway in a turn took 274 s). Any other answer shows neither,
    and the request is made again, at most :data:`OVERRUN_PROBES` times."""
    for _ in range(OVERRUN_PROBES):
        try:
            completion = await llm.complete(
                [{"role": "user", "content": OVERRUN_PROBE}],
                model=model, max_tokens=OVERRUN_PROBE_TOKENS, tools=[NOTE_TOOL], on_say=on_say,
            )
        except ModelError as exc:  # found out at a turn's first overrun instead
            log.info("check: the request asking whether %s stops at max_tokens failed: %s", model, exc)
            return
        if completion.hit_length or await llm.overruns.seen(model):
            return
        written = completion.completion_tokens
        if written is not None and written > 2 * OVERRUN_PROBE_TOKENS:
            await llm.overruns.saw(model, f"wrote {written} tokens with max_tokens {OVERRUN_PROBE_TOKENS}")
            return


async def speed_line(llm: LLM, model: str, on_say: SayListener | None) -> str:
    """What ``model`` at ``llm`` has shown of its speed, after one request that writes
    :data:`SPEED_PROBE_TOKENS` tokens (streamed when ``on_say`` is given and the endpoint
    streams: the writing speed is then exact), and whether it was seen writing past its budget."""
    try:
        await llm.complete(
            [{"role": "user", "content": SPEED_PROBE.strip()}], model=model, max_tokens=SPEED_PROBE_TOKENS,
            on_say=on_say,
        )
    except ModelError as exc:  # the endpoint's other lines say what is wrong with it
        return f"not measured: {exc}"
    overruns = await llm.overruns.seen(model)
    line = (await llm.pace.speed(model, "text", overruns=overruns)).describe()
    tools = await llm.pace.speed(model, "tools", overruns=overruns)
    if tools.samples:
        line += f"; with tools {tools.writing:.0f} tokens/s writing, {tools.reading:.0f} reading"
    if why := await llm.overruns.reason(model):
        line += f"; it does not stop at max_tokens ({why}): requests get a tight deadline"
    return line


async def window_lines(
    settings: Settings, llm: LLM, primary: int | None = None, kept: str = REMEMBERED
) -> tuple[list[tuple[bool, str, str]], int]:
    """Ask each model's window (the one request :func:`probe_window` sends when a local server
    says it nowhere) and say, per model, the configured one, the endpoint's and the one the
    daemon uses: ``(fine, what, detail)``; ``fine`` is ``False`` when a configured window is
    larger than the endpoint's (the daemon corrects it). Also returns the window the daemon
    sizes requests for with this endpoint; ``primary``: the primary's, when ``llm`` is a
    fallback: a smaller one is said too (the daemon sizes every request for it). ``kept``:
    where what ``check`` learns goes (:data:`REMEMBERED`, or why it is for this run only)."""
    cognition = settings.cognition
    background = [settings.llm.background_model] if settings.llm.background_model else []
    models = list(dict.fromkeys([llm.model, llm.reflex_model, *background]))
    await llm.windows.load(models)
    said = await llm.windows.ask(models)
    probed: dict[str, str] = {}
    local = await is_local(llm.base_url)
    probe_tokens = max(WINDOW_PROBE_TOKENS, 2 * cognition.max_context_tokens)
    model = llm.model  # the one model probed: each probe costs a long prompt's evaluation
    if local and said.get(model) is None and llm.windows.get(model) is None:
        probed[model] = await probe_window(llm, model, probe_tokens)
    configured = "max_context_tokens" in cognition.model_fields_set
    mine = (f"cognition.max_context_tokens is {cognition.max_context_tokens}" if configured
            else f"cognition.max_context_tokens is not set ({cognition.max_context_tokens} assumed)")
    lines, smallest = [], cognition.max_context_tokens
    for model in models:
        window = said.get(model) or llm.windows.get(model)
        if window is None:
            why = probed.get(model) or (
                "check asks with an oversized request only a server on this machine or its network" if not local else ""
            )
            lines.append((True, f"context window {model}", _unknown_window(mine, cognition.max_context_tokens, why)))
            continue
        if said.get(model) is not None:
            source = f"the endpoint says {window.describe()}"
        elif model in probed:
            source = (f"the endpoint refused a request of about {probe_tokens} tokens just now, stating its window: "
                      f"{window.tokens} tokens ({kept})")
        else:
            source = f"the daemon learned {window.describe()} at {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(window.since))}"
        if not (window.assumed and configured):
            smallest = min(smallest, window.tokens)
        lines.append(_window_line(model, window, source, mine, configured, cognition.max_context_tokens))
    if primary is not None and smallest < primary:
        lines.append((False, "context window", (
            f"{smallest} tokens, smaller than the primary's {primary}: the daemon sizes every request for {smallest}, "
            "the primary's too, since this endpoint would refuse what a larger window takes; give it at least the "
            "primary's window"
        )))
    return lines, smallest


async def probe_window(llm: LLM, model: str, tokens: int) -> str:
    """Send ``model`` one request of about ``tokens`` estimated tokens asking for one token
    back, within :data:`WINDOW_PROBE_TIMEOUT_S`: a refusal stating the window teaches it
    (``LLM.complete`` remembers it, ``""`` comes back); else what happened, in words."""
    text = (_PROBE_TEXT * (tokens * 4 // len(_PROBE_TEXT) + 1))[: tokens * 4]
    asked = f"a request of about {tokens} tokens"
    key = probe_key(llm.base_url, model)
    if before := await llm.capabilities.get(key):  # answered before: sent again only after a while
        try:
            since = float(before)
        except ValueError:
            since = 0.0
        if time.time() - since < WINDOW_PROBE_RETRY_S:
            return f"{asked} was answered at the last check, so it is not sent again before {_utc(since + WINDOW_PROBE_RETRY_S)}"
    try:
        async with asyncio.timeout(WINDOW_PROBE_TIMEOUT_S):
            await llm.complete([{"role": "user", "content": text}], model=model, max_tokens=1)
    except ContextTooLong as exc:
        return "" if exc.window is not None else f"it refused {asked} as too long without saying its window"
    except TimeoutError:
        await llm.capabilities.set(key, str(time.time()))  # it may have evaluated it all: not again soon
        return f"{asked} got no answer within {WINDOW_PROBE_TIMEOUT_S:g} s"
    except ModelError as exc:
        return f"it refused {asked} ({exc})"
    await llm.capabilities.set(key, str(time.time()))
    return f"it answered {asked}: its window is larger, or it cuts long prompts without saying so"


def probe_key(base_url: str, model: str) -> str:
    """The ``kv`` key of when ``model`` at ``base_url`` last answered (or outlasted)
    :func:`probe_window`'s request, epoch seconds: it is not sent again within
    :data:`WINDOW_PROBE_RETRY_S`."""
    return f"llm.window_probe:{base_url}|{model}"


def _utc(epoch: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(epoch))


async def is_local(base_url: str) -> bool:
    """Whether the endpoint at ``base_url`` is on this machine or its local network: its host
    is, or resolves only to, loopback, private or link-local addresses. Only such a server is
    sent :func:`probe_window`'s request (a hosted API with a window that took it would bill it)."""
    host = urlsplit(base_url).hostname
    if not host:
        return False
    try:
        addresses = [ipaddress.ip_address(host)]
    except ValueError:
        try:
            async with asyncio.timeout(RESOLVE_TIMEOUT_S):
                found = await asyncio.get_running_loop().getaddrinfo(host, None)
        except (OSError, TimeoutError):
            return False
        addresses = [ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in found]
    return bool(addresses) and all(a.is_loopback or a.is_private or a.is_link_local for a in addresses)


def _unknown_window(mine: str, tokens: int, why: str) -> str:
    return (
        f"{mine}; the endpoint does not say its window (no /props, /models max_model_len or /api/show: "
        f"llama-cpp-python's server and hosted APIs do not){'; ' + why if why else ''}, so the daemon uses {tokens} "
        "until a context-length refusal states the endpoint's; set cognition.max_context_tokens to the server's "
        "context size (llama-cpp-python: --n_ctx) to spare that refusal"
    )


def _window_line(
    model: str, window: LearnedWindow, source: str, mine: str, configured: bool, tokens: int
) -> tuple[bool, str, str]:
    what = f"context window {model}"
    if window.assumed and configured:
        return True, what, f"{mine}; {source}: the configured window wins over an assumption"
    if window.tokens >= tokens:
        return True, what, f"{mine}; {source}: the daemon uses {tokens}"
    hint = f"; lower cognition.max_context_tokens to {window.tokens}" if configured else ""
    return not configured, what, f"{mine}; {source}: the daemon uses {window.tokens}{hint}"


def forcing_line(
    settings: Settings, before: ForcingFallback | None, after: ForcingFallback | None, forced_now: bool,
    now: float | None = None, kept: str = REMEMBERED,
) -> tuple[bool, str]:
    """The "tool forcing" line after ``check``'s tool requests: ``(note, detail)``, ``note``
    when ``check`` itself learned something the daemon will use. ``before``/``after``: the
    remembered fallback before and after those requests (under one, the first re-tried
    ``"required"``: the line says the state that re-try left); ``kept``: as :func:`window_lines`."""
    if settings.llm.tool_choice != "required":
        return False, f"{settings.llm.tool_choice} (llm.tool_choice in the config; never forced)"
    now = time.time() if now is None else now
    if before is None and after is not None:
        return True, f"auto: the endpoint refused tool_choice=required just now ({kept}): " + after.describe(now)
    if before is None:
        if forced_now:
            return False, "required"
        return True, ("required remembered, but the endpoint refused tool_choice=required just now; the daemon "
                      "falls back to 'auto' after a few refusals (see docs/cognition.md, Endpoint quirks)")
    if after is None:
        return False, ("required: check re-tried it just now and the endpoint accepted it; remembered, so the daemon "
                       "switches back at its next re-try or start")
    return False, after.describe(now) + "; check re-tried tool_choice=required just now: refused"
