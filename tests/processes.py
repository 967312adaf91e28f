"""Processes on the host, as the shell and sandbox tests find and wait for them.

A pid printed inside the sandbox is one of its own PID namespace, so tests find a command's
processes from the host: by a marker in their command line (``sleep <marker>``), or as the
descendants of a process.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import uuid
from pathlib import Path


def marker() -> str:
    """A ``sleep`` argument no other process has (about 300 seconds)."""
    return f"300.{uuid.uuid4().int % 10**9:09d}"


def pids_of(mark: str) -> list[int]:
    """Host pids of the processes running ``sleep <mark>``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if (entry / "cmdline").read_bytes().split(b"\0")[:2] == [b"sleep", mark.encode()]:
                    found.append(int(entry.name))
    return found


def descendants(pid: int) -> set[int]:
    """Host pids of every process below ``pid`` (children, their children, ...)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(parent, []).append(int(entry.name))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


async def wait_until_gone(pid: int, timeout: float = 5.0) -> None:
    """Wait (on a pidfd, not by polling) until ``pid`` has exited; zombies count as gone."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    loop = asyncio.get_running_loop()
    exited = loop.create_future()
    try:
        loop.add_reader(fd, lambda: exited.done() or exited.set_result(None))
        try:
            await asyncio.wait_for(exited, timeout)
        finally:
            loop.remove_reader(fd)
    finally:
        os.close(fd)


async def wait_for_marked(mark: str, seen: list[int], timeout: float = 10.0) -> list[int]:
    """The host pids of ``sleep <mark>`` once it runs; also added to ``seen`` (for cleanup)."""
    async with asyncio.timeout(timeout):
        while not (pids := await asyncio.to_thread(pids_of, mark)):
            await asyncio.sleep(0.02)
    seen += pids
    return pids


def kill_all(pids: list[int]) -> None:
    """SIGKILL each of ``pids`` still running (a failing test leaves nothing behind)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
