"""What an MCP server's transport says besides its messages: that it ended, and its stderr.

* :class:`Watched` wraps an SDK transport so that the end of its read stream (EOF, an error)
  is noticed at once: it calls ``on_end`` (the manager marks the server lost and reconnects),
  instead of waiting for the next call or liveness check to fail.
* :func:`stderr_pipe` gives a stdio server's child process a pipe for its stderr, read line by
  line (logged at DEBUG, redacted) into the server's last lines, which say why a server that
  died did.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from typing import Any, Self, TextIO

from .mcp_state import LiveServer

__all__ = ["Watched", "stderr_pipe"]

log = logging.getLogger("bumblebot.mcp")


class Watched:
    """A transport whose end (EOF on the read stream) calls ``on_end`` at once, instead of
    being noticed at the next call or liveness check.

    Args:
        inner: the SDK's transport (an async context manager giving ``(read, write)``).
        on_end: called when the read stream ends or fails.
        after_enter: called once the transport is entered (or failed to be).
    """

    def __init__(
        self, inner: Any, on_end: Callable[[], None], after_enter: Callable[[], None] | None = None
    ) -> None:
        self._inner, self._on_end, self._after_enter = inner, on_end, after_enter

    async def __aenter__(self) -> Any:
        try:
            read, write = await self._inner.__aenter__()
        finally:
            if self._after_enter is not None:
                self._after_enter()  # the child holds its own copy of the stderr pipe now
        return _WatchedRead(read, self._on_end), write

    async def __aexit__(self, *exc: object) -> Any:
        return await self._inner.__aexit__(*exc)


class _WatchedRead:
    """Delegates to the SDK's read stream; its end calls ``on_end``."""

    def __init__(self, inner: Any, on_end: Callable[[], None]) -> None:
        self._inner, self._ended = inner, on_end

    async def receive(self) -> Any:
        try:
            return await self._inner.receive()
        except Exception:
            self._ended()
            raise

    def __aiter__(self) -> _WatchedRead:
        return self

    async def __anext__(self) -> Any:
        try:
            return await self._inner.__anext__()
        except (StopAsyncIteration, Exception):
            self._ended()
            raise

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def __aenter__(self) -> Self:
        await self._inner.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> Any:
        self._ended()
        return await self._inner.__aexit__(*exc)

    def __getattr__(self, name: str) -> Any:  # e.g. ``last_context`` of the SDK's context streams
        return getattr(self._inner, name)


async def stderr_pipe(server: LiveServer, stack: contextlib.AsyncExitStack) -> TextIO:
    """A pipe for the server's stderr: the write end (a text file) for the child, the read
    end read line by line into ``server.stderr`` (and the DEBUG log) until EOF.

    Closing it is pushed on ``stack``: the write end is closed, and the reader is given a
    second to reach EOF before it is cancelled.
    """
    read_fd, write_fd = os.pipe()
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 20)
    transport, _ = await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(read_fd, "rb", buffering=0)
    )
    errlog = os.fdopen(write_fd, "w", encoding="utf-8", errors="replace")

    async def pump() -> None:
        try:
            while line := await reader.readline():
                text = line.decode("utf-8", "replace").rstrip()
                if text:
                    server.stderr.append(text)
                    log.debug("MCP server %s stderr: %s", server.name, server.redact(text))
        except (OSError, ValueError):  # the pipe went away under us; nothing more to read
            pass
        finally:
            transport.close()

    task = asyncio.create_task(pump(), name=f"bumblebot:mcp:{server.name}:stderr")

    async def finish() -> None:
        if not errlog.closed:
            errlog.close()
        try:  # the child is gone: EOF comes at once unless a grandchild holds the pipe
            await asyncio.wait_for(asyncio.shield(task), 1.0)
        except TimeoutError:
            task.cancel()
        except asyncio.CancelledError:
            task.cancel()
            raise

    stack.push_async_callback(finish)
    return errlog
