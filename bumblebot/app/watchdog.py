"""Event-loop health: log every stall of the asyncio loop, naming the code that held it.

Everything Bumblebot does shares one event loop: a call that blocks it (a slow regex, a
synchronous file or network call, a long computation) stops every chat, the Telegram poller
and the Discord heartbeat at once. :class:`LoopWatchdog` makes such stalls visible:

* a **heartbeat** task on the loop ticks every ``interval_s`` (0.1 s) and writes down when
  the next tick is due;
* a **watcher** thread wakes every ``min(interval_s, threshold_s / 5)`` seconds; once the tick
  is overdue by more than ``threshold_s`` (0.5 s) it takes the loop thread's stack
  (``sys._current_frames()``) and logs one WARNING::

      event loop stalled for 0.6 s (so far) in bumblebot.delivery.splitting._Layout.__init__ (splitting.py:250), task bumblebot:discord:42:actor

  naming the innermost frame inside ``bumblebot/``, ``adapters/`` or ``tools/`` (else the
  innermost frame), and the asyncio task that was running. When the loop ticks again it logs
  at INFO how long the stall lasted (``event loop stall in … ended after 2.4 s``).

A stall that ends between two looks of the watcher (one just over ``threshold_s``) is still
logged once, from the late tick, without a location. A stall inside C code that holds the GIL
(the ``re`` module does) cannot be seen while it lasts: no other thread runs. It is logged
as soon as the call returns, with the stack taken right then, which is usually still in the
function that made the call.

The heartbeat is the hook for a systemd watchdog: ``on_beat`` is called on the loop at every
tick, so a ``sd_notify("WATCHDOG=1")`` from it proves the loop itself is alive.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from types import FrameType, TracebackType
from typing import Self

__all__ = ["HEARTBEAT_S", "STALL_THRESHOLD_S", "LoopWatchdog", "location"]

log = logging.getLogger(__name__)

#: Seconds between two heartbeat ticks.
HEARTBEAT_S = 0.1
#: A tick overdue by more than this many seconds is a stall.
STALL_THRESHOLD_S = 0.5
#: Seconds :meth:`LoopWatchdog.stop` waits for the watcher thread to exit.
_JOIN_S = 2.0

_ROOT = Path(__file__).resolve().parents[2]  # the tree that holds bumblebot/, adapters/, tools/
#: Our own code, preferred when naming where a stall happened.
_PROJECT_DIRS = tuple(f"{_ROOT / name}{os.sep}" for name in ("bumblebot", "adapters", "tools"))


class _State(StrEnum):
    NEW = "new"
    RUNNING = "running"
    STOPPED = "stopped"


def location(frame: FrameType) -> str:
    """Where ``frame``'s stack is: ``"bumblebot.cognition.gate.CompletionGate.check (gate.py:88)"``.

    Names the innermost frame whose file is under ``bumblebot/``, ``adapters/`` or ``tools/``,
    else ``frame`` itself (the innermost of the stack).
    """
    chosen: FrameType | None = frame
    while chosen is not None and not chosen.f_code.co_filename.startswith(_PROJECT_DIRS):
        chosen = chosen.f_back
    chosen = chosen or frame
    code = chosen.f_code
    module = chosen.f_globals.get("__name__", "?")
    return f"{module}.{code.co_qualname} ({Path(code.co_filename).name}:{chosen.f_lineno})"


class LoopWatchdog:
    """Logs each stall of the running event loop over ``threshold_s`` (module docstring).

    Args:
        threshold_s: seconds a heartbeat tick may be overdue before it is a stall (0.5).
        interval_s: seconds between heartbeat ticks (0.1).
        on_beat: called with no arguments on the event loop at every tick (every
            ``interval_s``); it must return quickly. An exception from it is logged the first
            time and otherwise ignored: the heartbeat goes on.

    Use ``async with LoopWatchdog(): ...``, or :meth:`start` and :meth:`stop`, from a
    coroutine on the loop to watch. ``stalls`` counts the stalls logged so far.

    Raises:
        ValueError: ``threshold_s`` or ``interval_s`` is not positive.
    """

    def __init__(
        self,
        *,
        threshold_s: float = STALL_THRESHOLD_S,
        interval_s: float = HEARTBEAT_S,
        on_beat: Callable[[], object] | None = None,
    ) -> None:
        if threshold_s <= 0 or interval_s <= 0:
            raise ValueError(f"threshold_s and interval_s must be positive, not {threshold_s}, {interval_s}")
        self.threshold_s, self.interval_s = threshold_s, interval_s
        self.stalls = 0
        self._on_beat = on_beat
        self._look_s = min(interval_s, threshold_s / 5)
        self._state = _State.NEW
        # Shared with the watcher thread; each is replaced whole (one atomic assignment):
        self._tick: tuple[int, float] | None = None  # (ticks so far, monotonic s the next is due)
        self._late: tuple[int, float] = (0, 0.0)  # the last tick late by > threshold_s: (tick, s late)
        self._quit = threading.Event()
        self._loop_thread = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._thread: threading.Thread | None = None

    async def start(self) -> None:
        """Start the heartbeat on the running loop and the watcher thread.

        Raises:
            RuntimeError: the watchdog is already running or was stopped (it is not reusable).
        """
        if self._state is not _State.NEW:
            raise RuntimeError(f"the loop watchdog is {self._state}")
        self._state = _State.RUNNING
        self._loop, self._loop_thread = asyncio.get_running_loop(), threading.get_ident()
        self._tick = (0, time.monotonic())
        self._task = asyncio.create_task(self._heartbeat(), name="bumblebot:watchdog")
        self._thread = threading.Thread(target=self._watch, name="bumblebot:watchdog", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Stop the heartbeat and the watcher thread (which has exited on return). Idempotent."""
        if self._state is not _State.RUNNING:
            self._state = _State.STOPPED
            return
        self._state = _State.STOPPED
        self._quit.set()
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task])  # its end, not its CancelledError
        if self._thread is not None:
            self._thread.join(_JOIN_S)  # it wakes at once on _quit: milliseconds

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    async def _heartbeat(self) -> None:
        """On the loop: tick every ``interval_s``; note when the next tick is due, and each
        tick that came more than ``threshold_s`` late."""
        assert self._tick is not None
        ticks, due = self._tick
        failed = False
        try:
            while True:
                now = time.monotonic()
                ticks += 1
                if now - due > self.threshold_s:
                    self._late = (ticks, now - due)  # written before _tick: the watcher reads after
                due = now + self.interval_s
                self._tick = (ticks, due)
                if self._on_beat is not None:
                    try:
                        self._on_beat()
                    except Exception:
                        if not failed:
                            log.exception("the heartbeat's on_beat callback failed (logged once)")
                        failed = True
                await asyncio.sleep(self.interval_s)
        finally:
            self._tick = None  # no heartbeat, nothing to judge (also when someone else cancelled it)

    def _watch(self) -> None:
        """In the watcher thread: report each stall once, then how long it lasted."""
        stalled_at: int | None = None  # the tick count when the stall being reported was seen
        where = ""
        handled = 0  # the last late tick already logged
        while not self._quit.wait(self._look_s):
            now = time.monotonic()  # read before the tick, so a stall seen here is real
            tick = self._tick
            if tick is None:
                continue
            if stalled_at is None and now - tick[1] > self.threshold_s:
                stalled_at, (where, task) = tick[0], self._where()
                self.stalls += 1
                log.warning("event loop stalled for %.1f s (so far) in %s%s", now - tick[1], where, task)
            late_tick, late_s = self._late  # written before _tick: as new as the tick read above
            if late_tick <= handled:
                if stalled_at is not None and tick[0] != stalled_at:
                    stalled_at = None  # cannot happen (the tick after a stall is late too); never stuck
                continue
            handled = late_tick
            if stalled_at is not None:
                log.info("event loop stall in %s ended after %.1f s", where, late_s)
            else:
                self.stalls += 1
                log.warning("event loop stalled for %.1f s (over before the watchdog could see where)", late_s)
            stalled_at = None

    def _where(self) -> tuple[str, str]:
        """The loop thread's :func:`location` and ``", task <name>"`` (or ``""``)."""
        frame = sys._current_frames().get(self._loop_thread)
        if frame is None:
            return "an unknown place (no frame for the loop thread)", ""
        try:
            where = location(frame)
        finally:
            del frame
        task = None
        with contextlib.suppress(Exception):  # read from another thread: best effort
            task = asyncio.current_task(self._loop)
        return where, f", task {task.get_name()}" if task is not None else ""
