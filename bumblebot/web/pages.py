"""The console's pages: each handler gathers what it shows through the :class:`Console`
(paged store queries, never a whole table) and renders its template.

Files (a conversation's facts, its inbox) are read off the event loop (``asyncio.to_thread``).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from aiohttp import web

from bumblebot.core.activity import Event
from bumblebot.web import charts
from bumblebot.web.auth import SESSION

if TYPE_CHECKING:
    from bumblebot.web.server import WebConsole

CONVERSATIONS_PAGE = 50
TASKS_PAGE = 100
TURNS_PAGE = 20
HISTORY_PAGE = 200
#: a facts file is shown up to this many characters
FACTS_CHARS = 20_000
#: an inbox lists this many files at most
INBOX_FILES = 200


def when(ts: float | None) -> str:
    """Epoch seconds as local ``YYYY-MM-DD HH:MM:SS``; ``-`` for none."""
    return "-" if not ts else datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def money(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


FILTERS: dict[str, Callable[..., Any]] = {"when": when, "money": money, "seconds": seconds}


def routes(app: web.Application, server: WebConsole) -> None:
    def bind(handler: Callable[[WebConsole, web.Request], Awaitable[web.StreamResponse]]) -> Any:
        return functools.partial(handler, server)

    app.router.add_get("/", bind(overview))
    app.router.add_get("/conversations", bind(conversations))
    app.router.add_get("/c/{key}", bind(conversation))
    app.router.add_get("/turns/{turn:\\d+}", bind(turn))
    app.router.add_get("/tasks", bind(tasks))
    app.router.add_get("/tools", bind(tools))
    app.router.add_get("/setup", bind(setup))


def _int(value: str | None, default: int = 0) -> int:
    try:
        return max(int(value or default), 0)
    except ValueError:
        return default


async def overview(server: WebConsole, request: web.Request) -> web.Response:
    console = server.console
    data = await console.store.console_overview(time.time())
    days = data.get("days", [])
    hours = data.get("hours", [])
    day_labels = [str(d["day"]) for d in days]
    hour_labels = [datetime.fromtimestamp(h["hour"]).strftime("%H:00") for h in hours]
    figures = {
        "tokens": charts.bars("Tokens per day, 30 days", day_labels, [d["tokens"] or 0 for d in days]),
        "cost": charts.bars("Cost per day, 30 days", day_labels, [d["cost"] or 0 for d in days]),
        "turns": charts.bars("Turns per hour, 24 hours", hour_labels, [h["turns"] or 0 for h in hours]),
    }
    latency = data.get("latency") or {}
    figures["latency"] = charts.bars(
        "Reply latency p50 and p95, last 24 hours, seconds", ["p50", "p95"],
        [latency.get("p50") or 0, latency.get("p95") or 0], unit=" s",
    )
    return server.render(
        request, "overview.html", title="Overview", adapters=console.adapters(), endpoints=console.endpoints(),
        running=console.running(), data=data, figures=figures, latency=latency,
    )


async def conversations(server: WebConsole, request: web.Request) -> web.Response:
    q = request.query
    query, platform, state = q.get("q", "")[:200], q.get("platform", ""), q.get("state", "")
    offset = _int(q.get("offset"))
    rows, total = await server.console.store.console_conversations(
        query=query, platform=platform, state=state, offset=offset, limit=CONVERSATIONS_PAGE
    )
    return server.render(
        request, "conversations.html", title="Conversations", rows=rows, total=total, query=query,
        platform=platform, state=state, offset=offset, page=CONVERSATIONS_PAGE,
    )


def live_events(events: list[Event]) -> list[Event]:
    """The conversation's last turn as the live list shows it: its events from its
    ``turn_started`` on (running or ended), and what came after (queued messages, actions)."""
    start = 0
    for i, event in enumerate(events):
        if event.kind == "turn_started":
            start = i
    return events[start:]


def _read_facts(path: Path) -> str | None:
    try:
        with path.open(encoding="utf-8", errors="replace") as f:
            return f.read(FACTS_CHARS + 1)
    except OSError:
        return None


def _list_inbox(path: Path) -> list[dict[str, Any]]:
    try:
        entries = sorted(path.iterdir(), key=lambda p: p.name)[:INBOX_FILES]
    except OSError:
        return []
    out = []
    for p in entries:
        if p.name.startswith("."):
            continue  # a download still under way
        try:
            st = p.stat()
        except OSError:
            continue
        out.append({"name": p.name, "size": st.st_size, "at": st.st_mtime, "dir": p.is_dir()})
    return out


async def conversation(server: WebConsole, request: web.Request) -> web.Response:
    console = server.console
    key = request.match_info["key"]
    before = _int(request.query.get("before")) or None
    offset = _int(request.query.get("turns"))
    history = await console.store.console_history(key, before=before, limit=HISTORY_PAGE)
    turns = await console.store.console_turns(key, offset=offset, limit=TURNS_PAGE)
    facts, inbox = await asyncio.gather(
        asyncio.to_thread(_read_facts, console.facts_file(key)),
        asyncio.to_thread(_list_inbox, console.inbox_dir(key)),
    )
    live = live_events(console.activity.recent(key))
    messages = history.get("messages", [])
    return server.render(
        request, "conversation.html", title=key, key=key, platform=key.split(":", 1)[0],
        chat_id=key.split(":")[1] if ":" in key else "", history=history, messages=messages,
        oldest=messages[0]["id"] if messages else None, turns=turns, turns_offset=offset, turns_page=TURNS_PAGE,
        facts=facts, facts_cut=facts is not None and len(facts) > FACTS_CHARS, inbox=inbox,
        live=[_event(e) for e in live], last_seq=live[-1].seq if live else _last_seq(console),
        running=key in console.running().get("running", []), paused=console.paused(key),
    )


def _last_seq(console: Any) -> int:
    recent = console.activity.recent()
    return recent[-1].seq if recent else 0


def _event(event: Event) -> dict[str, Any]:
    return {"kind": event.kind, "data": event.data, "at": event.at, "seq": event.seq}


async def turn(server: WebConsole, request: web.Request) -> web.Response:
    found = await server.console.store.console_turn(int(request.match_info["turn"]))
    if found is None:
        raise web.HTTPNotFound(text="no such turn")
    return server.render(request, "turn.html", title=f"Turn {found['id']}", turn=found, trace=found.get("trace") or {})


async def tasks(server: WebConsole, request: web.Request) -> web.Response:
    offset = _int(request.query.get("offset"))
    rows, total = await server.console.store.console_tasks(offset=offset, limit=TASKS_PAGE)
    return server.render(request, "tasks.html", title="Tasks", rows=rows, total=total, offset=offset, page=TASKS_PAGE)


async def tools(server: WebConsole, request: web.Request) -> web.Response:
    return server.render(
        request, "tools.html", title="Tools and MCP", tools=server.console.tools(), servers=server.console.mcp_servers()
    )


async def setup(server: WebConsole, request: web.Request) -> web.Response:
    settings = yaml.safe_dump(server.console.settings_redacted(), sort_keys=False, allow_unicode=True)
    session = request[SESSION]
    return server.render(request, "setup.html", title="Setup", settings=settings, check=session.check)
