"""One configured MCP server's live state, as :class:`tools.mcp_client.MCPManager` keeps it.

A :class:`LiveServer` belongs to its server's supervisor task, which connects, serves and
reconnects it; calls and ``/status`` read it. What it does needs no SDK: marking a connection
lost, keeping the tools the ``tools`` allowlist lets through, saying why the server is down or
failed (with the last lines of its stderr), its :class:`ServerStatus`, and redacting its
secrets (the values of its ``${VAR}`` references, resolved by :func:`resolve`) out of all of it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from bumblebot.core.logs import redact
from bumblebot.core.mcp_settings import ENV_REF, MCPServerSettings

from .mcp_records import RemoteTool, ServerState, ServerStatus

__all__ = ["ConfigProblem", "ConnectionLost", "LiveServer", "clip", "leaf", "resolve"]

log = logging.getLogger("bumblebot.mcp")

#: Server stderr lines kept to explain a failure, and characters of them quoted.
STDERR_LINES = 20
STDERR_QUOTE_CHARS = 300


class ConfigProblem(Exception):
    """A server cannot be started as configured (not retried)."""


class ConnectionLost(Exception):
    """A connected server went away (the reason is the message)."""


@dataclass(slots=True)
class LiveServer:
    """One server's live state (owned by its supervisor task)."""

    name: str
    cfg: MCPServerSettings
    state: ServerState = ServerState.STARTING
    client: Any = None  # mcp.Client while connected
    tools: tuple[RemoteTool, ...] = ()
    hidden: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()
    error: str | None = None
    attempts: int = 0
    retry_at: float | None = None
    settled: asyncio.Event = field(default_factory=asyncio.Event)
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    refresh: bool = False
    lost: str | None = None
    task: asyncio.Task[None] | None = None
    scope: Any = None  # the anyio CancelScope of the current connection (stop cancels it)
    stderr: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=STDERR_LINES))
    secrets: list[str] = field(default_factory=list)

    def redact(self, text: str) -> str:
        """``text`` with this server's secrets masked."""
        return redact(text, self.secrets)

    def mark_lost(self, why: str) -> None:
        """A connected server went away: its supervisor wakes up and reconnects."""
        if self.state is ServerState.CONNECTED and self.lost is None:
            self.lost = why
            self.wakeup.set()

    def keep_tools(self, listed: list[Any]) -> None:
        """Keep the listed tools (the SDK's ``Tool`` values) that the ``tools`` allowlist lets
        through; note the ones it hides and the allowlisted ones the server lacks (logged once)."""
        wanted = set(self.cfg.tools)
        names = [t.name for t in listed]
        kept = [t for t in listed if not wanted or t.name in wanted]
        self.tools = tuple(
            RemoteTool(
                server=self.name,
                name=t.name,
                description=(t.description or t.title or "").strip(),
                input_schema=dict(t.input_schema or {}),
            )
            for t in kept
        )
        self.hidden = tuple(n for n in names if wanted and n not in wanted)
        missing = tuple(sorted(wanted - set(names)))
        if missing and missing != self.missing:
            log.warning(
                "MCP server %s has no tool named %s (mcp.servers.%s.tools); it has: %s",
                self.name, ", ".join(missing), self.name, ", ".join(names) or "none",
            )
        self.missing = missing

    def explain(self, exc: BaseException, why: str) -> str:
        """Why the server failed, redacted: ``why`` (the reason for ``exc``), a program that
        cannot run said so, and the last lines of its stderr."""
        if self.cfg.command is not None and isinstance(leaf(exc), OSError) and not isinstance(leaf(exc), ConnectionError):
            why = f"cannot run {self.cfg.command[0]!r}: {why}"
        tail = " | ".join(self.stderr)
        if tail:
            why += f"; its stderr: {clip(tail, STDERR_QUOTE_CHARS, keep_end=True)}"
        return self.redact(why)

    def down_reason(self) -> str:
        """Why a call cannot reach the server now, for the model."""
        if self.state is ServerState.RETRYING:
            wait = max(0.0, (self.retry_at or 0) - time.monotonic())
            return f"the server is down ({clip(self.error or '', 120)}); next try in {wait:.0f} s"
        return {
            ServerState.STARTING: "the server is still starting",
            ServerState.DISABLED: "the server is disabled in the config",
            ServerState.FAILED: f"the server cannot start: {self.error}",
            ServerState.STOPPED: "the daemon is stopping",
        }.get(self.state, "the server is not connected")

    def status(self, now: float) -> ServerStatus:
        """Its :class:`ServerStatus` at ``now`` (``time.monotonic()``)."""
        return ServerStatus(
            name=self.name,
            transport=self.cfg.transport,
            target=_target(self.cfg),
            state=self.state,
            tools=tuple(t.name for t in self.tools) if self.state is ServerState.CONNECTED else (),
            hidden=self.hidden,
            missing=self.missing,
            error=self.error,
            attempts=self.attempts,
            retry_in_s=max(0.0, self.retry_at - now) if self.state is ServerState.RETRYING and self.retry_at else None,
        )


def resolve(value: str, what: str, environ: Mapping[str, str]) -> str:
    """``value`` with each ``${VAR}`` replaced by ``environ[VAR]``; ``what`` names the value
    for :class:`ConfigProblem`, raised when a variable is not set."""

    def one(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in environ:
            raise ConfigProblem(f"{what} needs ${{{name}}}, which is not set in the environment")
        return environ[name]

    return ENV_REF.sub(one, value)


def leaf(exc: BaseException) -> BaseException:
    """The first non-group exception inside (anyio task groups wrap failures in groups)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def clip(text: str, limit: int, *, keep_end: bool = False) -> str:
    """``text`` on one line, at most ``limit`` characters (its end kept with ``keep_end``)."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    return "…" + text[-(limit - 1):] if keep_end else text[: limit - 1] + "…"


def _target(cfg: MCPServerSettings) -> str:
    if cfg.command is not None:
        return " ".join(cfg.command[:3]) + (" …" if len(cfg.command) > 3 else "")
    from urllib.parse import urlsplit

    parts = urlsplit(cfg.url or "")
    host = parts.hostname or ""
    return f"{parts.scheme}://{host}{f':{parts.port}' if parts.port else ''}{parts.path}"
