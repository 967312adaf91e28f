"""MCP tool servers: connect, stay connected, list and call their tools.

This is the only module that imports the ``mcp`` SDK. ``tools/mcp.py`` turns what it lists
into registry tools; the engine never sees MCP at all. What it gives out (states, statuses,
remote tools, call results, call errors) are plain values of ``tools/mcp_records.py``.

One :class:`MCPManager` runs every configured server (``mcp.servers.<name>``), each in its
own supervisor task (``bumblebot:mcp:<name>``) that owns the server's live state
(:class:`tools.mcp_state.LiveServer`):

* **stdio** servers (``command: [argv...]``, ``env``, ``cwd``) are started as a child process
  in a session of its own. Only ``HOME``, ``LOGNAME``, ``PATH``, ``SHELL``, ``TERM`` and
  ``USER`` are inherited (the SDK's rule), plus ``env``: the daemon's own secrets never reach
  a server unless the config passes them. Their stderr is read line by line (logged at DEBUG,
  ``tools/mcp_streams.py``); its last lines say why a server that died did.
* **streamable HTTP** servers (``url``, ``headers``).

``${VAR}`` in an ``env`` or ``headers`` value is replaced by the environment variable ``VAR``
(a server whose variable is unset is not started: state ``failed``). Every such value is a
secret: ``bumblebot.core.mcp_settings.secret_values`` lists them for log and trace redaction.

Lifecycle. :meth:`MCPManager.start` starts the supervisors and returns at once;
:meth:`MCPManager.wait_settled` waits, at most a bound, until every server has connected or
failed once (the daemon's readiness never waits longer). A server that fails to start, dies,
or stops answering (a tools/list every :data:`HEALTH_INTERVAL_S` seconds) is logged with why
and retried with exponential backoff (1 s doubling up to ``retry_max_s``); its tools are left
out meanwhile. :meth:`MCPManager.stop` (idempotent) closes every connection: stdio servers
get their stdin closed, then SIGTERM, then SIGKILL (the SDK's bounded sequence).

Tool lists are fetched at connect and again when the server announces a change: the
``notifications/tools/list_changed`` notification on 2025-era connections, a
``subscriptions/listen`` event on 2026-era ones. :attr:`MCPManager.generation` changes with
every change of the tools offered.

The SDK (about half a second to import) is imported on first use, so a daemon without MCP
servers never loads it.

Calls (:meth:`MCPManager.call`) are bounded by the server's ``timeout_s``; a call that does not
answer in time raises :class:`MCPTimeout` (the SDK cancels the request on the server). Results
are rendered as text: text blocks as they are, short notes for images, audio and resources
(an embedded text resource keeps its text).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import time
from collections.abc import Mapping
from typing import Any, Self

from pydantic import ValidationError

from bumblebot import __version__
from bumblebot.core.mcp_settings import MCPSettings, secrets_of

from .mcp_records import (
    CallResult,
    MCPTimeout,
    MCPUnavailable,
    RemoteTool,
    ServerState,
    ServerStatus,
)
from .mcp_state import ConfigProblem, ConnectionLost, LiveServer, clip, leaf, resolve
from .mcp_streams import Watched, stderr_pipe

__all__ = ["MCPManager", "probe_servers"]

log = logging.getLogger("bumblebot.mcp")

#: Seconds between liveness checks (a tools/list) of a connected server.
HEALTH_INTERVAL_S = 60.0
#: A connection that lasted this long resets the backoff (seconds).
STABLE_AFTER_S = 30.0
#: How long :meth:`MCPManager.stop` waits for the connections to close before cancelling (seconds).
STOP_TIMEOUT_S = 10.0
#: Most pages of a tools/list read (a paginator that never ends cannot hang the connection).
MAX_LIST_PAGES = 20


class MCPManager:
    """Runs the configured MCP servers and calls their tools.

    Args:
        settings: ``mcp`` from the config.
        environ: where ``${VAR}`` values come from (default: ``os.environ``).
        retry_initial_s: the first wait before a failed server is tried again, seconds;
            doubled after each failure up to ``settings.retry_max_s``.
        health_interval_s: seconds between liveness checks of a connected server.

    Use as ``async with MCPManager(...) as mcp:`` or call :meth:`start` and :meth:`stop`.
    A second :meth:`start` raises ``RuntimeError``; :meth:`stop` may be called any number of times.
    """

    def __init__(
        self,
        settings: MCPSettings,
        *,
        environ: Mapping[str, str] | None = None,
        retry_initial_s: float = 1.0,
        health_interval_s: float = HEALTH_INTERVAL_S,
    ) -> None:
        self.settings = settings
        self._environ = dict(os.environ if environ is None else environ)
        self._retry_initial_s = retry_initial_s
        self._health_interval_s = health_interval_s
        self._servers = {name: LiveServer(name, cfg) for name, cfg in settings.servers.items()}
        for server in self._servers.values():
            server.secrets = sorted(secrets_of(server.cfg, self._environ), key=len, reverse=True)
            if not server.cfg.enabled:
                server.state = ServerState.DISABLED
                server.settled.set()
        self._generation = 0
        self._started = False
        self._stopping = False
        self._closing: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Start a supervisor per enabled server and return at once (see :meth:`wait_settled`).

        Raises:
            RuntimeError: if it was started before.
        """
        if self._started:
            raise RuntimeError("MCPManager is already started" if not self._stopping else "MCPManager is stopped")
        self._started = True
        for server in self._servers.values():
            if server.cfg.enabled:
                server.task = asyncio.create_task(self._supervise(server), name=f"bumblebot:mcp:{server.name}")

    async def wait_settled(self, timeout_s: float | None = None) -> bool:
        """Wait until every enabled server has connected or failed once, at most ``timeout_s``
        seconds (default ``settings.startup_wait_s``). Returns ``True`` when all settled."""
        timeout_s = self.settings.startup_wait_s if timeout_s is None else timeout_s
        waits = [s.settled.wait() for s in self._servers.values()]
        if not waits:
            return True
        try:
            await asyncio.wait_for(asyncio.gather(*waits), timeout_s)
        except TimeoutError:
            slow = [s.name for s in self._servers.values() if not s.settled.is_set()]
            log.info("MCP servers still starting after %g s: %s (their tools come when they connect)", timeout_s, ", ".join(slow))
            return False
        return True

    async def stop(self) -> None:
        """Close every connection and stop every stdio server (idempotent; later callers
        wait for the same close)."""
        if self._closing is None:
            self._closing = asyncio.create_task(self._stop(), name="bumblebot:mcp:stop")
        await asyncio.shield(self._closing)

    async def _stop(self) -> None:
        self._stopping = True
        self._started = True  # a stopped manager cannot start
        tasks = [s.task for s in self._servers.values() if s.task is not None]
        for server in self._servers.values():
            server.wakeup.set()
            if server.scope is not None:
                # an anyio cancellation, which the SDK's shielded shutdown of a stdio server
                # honours (stdin closed, SIGTERM, SIGKILL); a native task.cancel() may not
                server.scope.cancel()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=STOP_TIMEOUT_S)
            for task in pending:
                log.warning("MCP server %s did not close within %g s; cancelling it", task.get_name(), STOP_TIMEOUT_S)
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for server in self._servers.values():
            if server.state is not ServerState.DISABLED:
                server.state, server.tools = ServerState.STOPPED, ()
        self._bump()

    # -- queries --------------------------------------------------------------------------

    @property
    def generation(self) -> int:
        """Changes whenever :meth:`tools` may give a different answer."""
        return self._generation

    def tools(self) -> list[RemoteTool]:
        """The tools of every connected server, by server in config order."""
        return [t for s in self._servers.values() if s.state is ServerState.CONNECTED for t in s.tools]

    def status(self) -> list[ServerStatus]:
        """Every configured server's state, in config order."""
        now = time.monotonic()
        return [s.status(now) for s in self._servers.values()]

    def summary(self) -> str:
        """One line for ``/status``: each server and its state, e.g. ``"MCP: notes connected
        (3 tools), home retrying in 40 s (connection refused)"``; ``""`` without servers."""
        parts = [self.summary_of(status) for status in self.status()]
        return f"MCP: {', '.join(parts)}" if parts else ""

    @staticmethod
    def summary_of(status: ServerStatus, *, reason: bool = True) -> str:
        """One server's part of :meth:`summary`, e.g. ``"home retrying in 40 s (connection
        refused)"``; without the ``reason`` (an error's own words, which may name a path of
        this machine) where people in a chat read it."""
        if status.state is ServerState.CONNECTED:
            count = len(status.tools)
            return f"{status.name} connected ({count} tool{'s' if count != 1 else ''})"
        if status.state is ServerState.RETRYING:
            wait = f" in {status.retry_in_s:.0f} s" if status.retry_in_s is not None else ""
            return f"{status.name} retrying{wait}" + (f" ({clip(status.error or 'down', 80)})" if reason else "")
        if status.state is ServerState.FAILED:
            return f"{status.name} failed" + (f" ({clip(status.error or '', 80)})" if reason else " (see the daemon's log)")
        return f"{status.name} {status.state.value}"

    def server_of(self, name: str) -> ServerStatus | None:
        """The status of server ``name``, ``None`` if it is not configured."""
        return next((s for s in self.status() if s.name == name), None)

    # -- calls ----------------------------------------------------------------------------

    async def call(self, server: str, tool: str, arguments: dict[str, Any]) -> CallResult:
        """Call ``tool`` on ``server`` with ``arguments``, bounded by the server's ``timeout_s``.

        Returns:
            The result as text; ``is_error`` when the server said the tool failed (including
            a tool it does not have, or arguments it refused).

        Raises:
            MCPUnavailable: the server is not connected, or the connection broke during the
                call (the supervisor reconnects).
            MCPTimeout: no answer in time (the request is cancelled on the server).
            asyncio.CancelledError: the caller was cancelled (never swallowed).
        """
        from mcp import MCPError
        from mcp_types import CONNECTION_CLOSED, REQUEST_TIMEOUT

        live = self._servers.get(server)
        if live is None:
            raise MCPUnavailable(server, tool, "no such MCP server")
        client = live.client
        if live.state is not ServerState.CONNECTED or client is None:
            raise MCPUnavailable(server, tool, live.down_reason())
        timeout = live.cfg.timeout_s
        try:
            # the SDK's own timeout cancels the request on the server; ours is the backstop
            result = await asyncio.wait_for(
                client.call_tool(tool, arguments, read_timeout_seconds=timeout), timeout + 1.0
            )
        except TimeoutError:
            raise MCPTimeout(server, tool, timeout) from None
        except MCPError as exc:
            if exc.code == REQUEST_TIMEOUT:
                raise MCPTimeout(server, tool, timeout) from exc
            if exc.code == CONNECTION_CLOSED:
                live.mark_lost("the connection closed during a call")
                raise MCPUnavailable(server, tool, "the server went away during the call") from exc
            return CallResult(live.redact(f"{exc.error.message} (MCP error {exc.code})"), is_error=True)
        except ValidationError as exc:  # the server answered, but not with a valid result
            return CallResult(f"the server's answer was not a valid MCP result ({exc.error_count()} problem(s))", is_error=True)
        except Exception as exc:  # transport failures: the server is unreachable now
            why = live.redact(_why(exc))
            live.mark_lost(why)
            raise MCPUnavailable(server, tool, why) from exc
        return _render(result)

    # -- supervision ------------------------------------------------------------------------

    async def _supervise(self, server: LiveServer) -> None:
        """Connect, serve, and reconnect with backoff until the manager stops."""
        import anyio

        delay = self._retry_initial_s
        while not self._stopping:
            started = time.monotonic()
            try:
                try:
                    with anyio.CancelScope() as server.scope:
                        await self._session(server)
                finally:
                    server.scope = None
                if self._stopping:
                    break
                why = "the connection ended"
            except ConfigProblem as exc:
                server.state, server.error = ServerState.FAILED, server.redact(str(exc))
                server.settled.set()
                log.error("MCP server %s cannot start: %s (fix mcp.servers.%s)", server.name, server.error, server.name)
                self._bump()
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - every failure is logged and retried
                if self._stopping:
                    break
                why = server.explain(exc, _why(exc))
            was_connected = server.state is ServerState.CONNECTED
            if time.monotonic() - started >= STABLE_AFTER_S:
                delay, server.attempts = self._retry_initial_s, 0
            server.attempts += 1
            server.state, server.error, server.client = ServerState.RETRYING, why, None
            server.retry_at = time.monotonic() + delay
            server.settled.set()
            self._bump()
            what = "disconnected" if was_connected else "failed to start"
            log.warning(
                "MCP server %s %s: %s; its tools are left out; trying again in %g s (try %d)",
                server.name, what, why, delay, server.attempts + 1,
            )
            if await self._sleep(server, delay):
                break
            delay = min(delay * 2, self.settings.retry_max_s)
        server.client = None

    async def _session(self, server: LiveServer) -> None:
        """One connection: handshake, list tools, then serve until lost, stopped or unhealthy."""
        from mcp import Client
        from mcp_types import Implementation, ToolListChangedNotification
        from mcp_types.version import MODERN_PROTOCOL_VERSIONS

        server.lost, server.refresh = None, False
        server.wakeup.clear()
        server.stderr.clear()

        async def on_message(message: Any) -> None:
            if isinstance(message, ToolListChangedNotification):
                server.refresh = True
                server.wakeup.set()
            elif isinstance(message, Exception):
                log.debug("MCP server %s: transport error: %s", server.name, server.redact(_why(message)))

        async with contextlib.AsyncExitStack() as stack:
            transport = await self._transport(server, stack)
            client = Client(
                transport,
                mode=server.cfg.protocol,
                message_handler=on_message,
                read_timeout_seconds=self.settings.connect_timeout_s,
                client_info=Implementation(name="bumblebot", version=__version__),
                cache=None,
            )
            # the whole handshake is bounded (protocol auto may try one era, then the other)
            async with asyncio.timeout(self.settings.connect_timeout_s):
                await stack.enter_async_context(client)
                await self._list_tools(server, client)
            server.client = client
            server.state, server.error, server.attempts = ServerState.CONNECTED, None, 0
            server.settled.set()
            self._bump()
            era = client.protocol_version
            log.info(
                "MCP server %s connected (%s, protocol %s): %d tool(s)%s",
                server.name, server.cfg.transport, era, len(server.tools),
                f", {len(server.hidden)} hidden by its tools allowlist" if server.hidden else "",
            )
            caps = client.server_capabilities.tools
            if era in MODERN_PROTOCOL_VERSIONS and caps is not None and caps.list_changed:
                listener = asyncio.create_task(self._listen(server, client), name=f"bumblebot:mcp:{server.name}:listen")
                stack.push_async_callback(_cancel, listener)
            await self._serve(server, client)

    async def _serve(self, server: LiveServer, client: Any) -> None:
        while not self._stopping:
            try:
                await asyncio.wait_for(server.wakeup.wait(), self._health_interval_s)
            except TimeoutError:
                await self._refresh(server, client)  # the liveness check; raises when it is gone
                continue
            server.wakeup.clear()
            if self._stopping:
                return
            if server.lost is not None:
                raise ConnectionLost(server.lost)
            if server.refresh:
                server.refresh = False
                await self._refresh(server, client)

    async def _refresh(self, server: LiveServer, client: Any) -> None:
        """List the tools again; log and announce (a new generation) what changed."""
        before = server.tools
        await self._list_tools(server, client)
        if server.tools == before:
            return
        old, new = {t.name for t in before}, {t.name for t in server.tools}
        added, removed = sorted(new - old), sorted(old - new)
        log.info(
            "MCP server %s changed its tools%s%s", server.name,
            f"; new: {', '.join(added)}" if added else "", f"; gone: {', '.join(removed)}" if removed else "",
        )
        self._bump()

    async def _listen(self, server: LiveServer, client: Any) -> None:
        """2026-era change events (``subscriptions/listen``) mark the tool list for a refresh."""
        try:
            async with client.listen(tools_list_changed=True) as subscription:
                server.refresh = True  # a change between the first list and the subscription
                server.wakeup.set()
                async for _event in subscription:
                    server.refresh = True
                    server.wakeup.set()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the liveness check notices a dead server
            log.debug("MCP server %s: change subscription ended: %s", server.name, server.redact(_why(exc)))

    async def _list_tools(self, server: LiveServer, client: Any) -> None:
        """Read the whole tool list (every page) and apply the ``tools`` allowlist."""
        listed: list[Any] = []
        cursor: str | None = None
        if client.server_capabilities.tools is None:  # a server of resources or prompts only
            server.tools, server.hidden, server.missing = (), (), tuple(server.cfg.tools)
            return
        for _ in range(MAX_LIST_PAGES):
            page = await asyncio.wait_for(client.list_tools(cursor=cursor), self.settings.connect_timeout_s)
            listed += page.tools
            cursor = page.next_cursor
            if not cursor:
                break
        server.keep_tools(listed)

    async def _transport(self, server: LiveServer, stack: contextlib.AsyncExitStack) -> Any:
        """The SDK transport of ``server``, entered resources on ``stack``; raises
        :class:`ConfigProblem` for an unset ``${VAR}``."""
        from mcp import StdioServerParameters
        from mcp.client.stdio import stdio_client
        from mcp.client.streamable_http import create_mcp_http_client, streamable_http_client

        cfg = server.cfg
        on_end = functools.partial(server.mark_lost, "the server closed the connection")
        if cfg.command is not None:
            env = {key: resolve(value, f"env {key}", self._environ) for key, value in cfg.env.items()}
            params = StdioServerParameters(
                command=cfg.command[0], args=list(cfg.command[1:]), env=env, cwd=cfg.cwd,
            )
            errlog = await stderr_pipe(server, stack)
            return Watched(stdio_client(params, errlog=errlog), on_end, after_enter=errlog.close)
        headers = {key: resolve(value, f"header {key}", self._environ) for key, value in cfg.headers.items()}
        http = await stack.enter_async_context(create_mcp_http_client(headers=headers))
        return Watched(streamable_http_client(cfg.url or "", http_client=http), on_end)

    async def _sleep(self, server: LiveServer, seconds: float) -> bool:
        """Wait ``seconds`` or until stopped; ``True`` when stopped."""
        server.wakeup.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(server.wakeup.wait(), seconds)
        return self._stopping

    # -- helpers --------------------------------------------------------------------------

    def _bump(self) -> None:
        self._generation += 1


async def probe_servers(
    settings: MCPSettings, *, environ: Mapping[str, str] | None = None, timeout_s: float | None = None
) -> list[ServerStatus]:
    """Connect to every enabled server once, for ``bumblebot check``: the states and tools after
    at most ``timeout_s`` (default ``settings.connect_timeout_s``), then close them all."""
    manager = MCPManager(settings, environ=environ, retry_initial_s=3600.0)
    async with manager:
        await manager.wait_settled(settings.connect_timeout_s if timeout_s is None else timeout_s)
        return manager.status()


# -- rendering --------------------------------------------------------------------------------


def _render(result: Any) -> CallResult:
    """A ``CallToolResult`` as text: text blocks as they are, notes for the rest."""
    from mcp_types import (
        AudioContent,
        BlobResourceContents,
        EmbeddedResource,
        ImageContent,
        ResourceLink,
        TextContent,
        TextResourceContents,
    )

    parts: list[str] = []
    for block in result.content or ():
        if isinstance(block, TextContent):
            parts.append(block.text)
        elif isinstance(block, ImageContent):
            parts.append(f"[an image ({block.mime_type}, {_size(block.data)}); not shown]")
        elif isinstance(block, AudioContent):
            parts.append(f"[an audio clip ({block.mime_type}, {_size(block.data)}); not played]")
        elif isinstance(block, EmbeddedResource):
            res = block.resource
            mime = f", {res.mime_type}" if res.mime_type else ""
            if isinstance(res, TextResourceContents):
                parts.append(f"[resource {res.uri}{mime}]\n{res.text}")
            elif isinstance(res, BlobResourceContents):
                parts.append(f"[resource {res.uri}{mime}: {_size(res.blob)} of binary data; not shown]")
        elif isinstance(block, ResourceLink):
            mime = f", {block.mime_type}" if block.mime_type else ""
            parts.append(f"[resource link {block.name}: {block.uri}{mime}]")
        else:
            parts.append(f"[{getattr(block, 'type', type(block).__name__)} content; not shown]")
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content, ensure_ascii=False))
    text = "\n".join(parts) if parts else "(no output)"
    return CallResult(text, is_error=bool(result.is_error))


def _size(b64: str) -> str:
    b64 = b64.strip()
    n = len(b64) * 3 // 4 - (len(b64) - len(b64.rstrip("=")))
    return f"{n} bytes" if n < 1024 else f"{n / 1024:.1f} kB" if n < 1 << 20 else f"{n / (1 << 20):.1f} MB"


def _why(exc: BaseException) -> str:
    """A short reason for ``exc``: the SDK's error message, the OS error, or the type."""
    from mcp import MCPError
    from mcp_types import CONNECTION_CLOSED, REQUEST_TIMEOUT

    exc = leaf(exc)
    if isinstance(exc, ConnectionLost | ConfigProblem):
        return str(exc)
    if isinstance(exc, MCPError):
        if exc.code == CONNECTION_CLOSED:
            return "the server closed the connection"
        if exc.code == REQUEST_TIMEOUT:
            return "the server did not answer in time"
        return f"{exc.error.message} (MCP error {exc.code})"
    if isinstance(exc, TimeoutError):
        return "the server did not answer in time"
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror}" + (f": {exc.filename}" if exc.filename else "")
    text = str(exc).strip()
    return f"{type(exc).__name__}: {clip(text, 200)}" if text else type(exc).__name__


async def _cancel(task: asyncio.Task[Any]) -> None:
    """Cancel ``task`` and give it a moment to end (never swallowing our own cancellation)."""
    task.cancel()
    await asyncio.wait({task}, timeout=1.0)

