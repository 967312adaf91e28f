"""systemd integration: readiness, status, stopping and watchdog pings over the notify socket.

Under ``Type=notify`` systemd considers the service started only when it says so, and with
``WatchdogSec=`` it kills (SIGABRT) and, with ``Restart=on-failure``, restarts a service that
stops pinging. :class:`Notifier` speaks that protocol without a library; it is small and
documented as stable (sd_notify(3), "Notes" and "Standalone Implementations"; systemd.io
PORTABILITY_AND_STABILITY):

* ``$NOTIFY_SOCKET`` names an ``AF_UNIX`` datagram socket: a file system path when it starts
  with ``/``, a Linux abstract-namespace name when it starts with ``@`` (the ``@`` stands for
  the leading NUL byte of the address). ``vsock:…`` addresses (a VM telling its host) are not
  supported here: the notifier is then disabled, with one WARNING.
* One message is one datagram of newline-separated ``NAME=VALUE`` assignments in UTF-8, no
  trailing newline needed: ``b"READY=1\\nSTATUS=serving telegram as Ada"``.
* The kernel attaches the sender's credentials (systemd turns on ``SO_PASSCRED`` on its
  end), so nothing else is sent; with ``NotifyAccess=main`` systemd accepts messages only from
  the main process, so a child (a shell-tool command) that inherits ``$NOTIFY_SOCKET`` cannot
  speak for the daemon.
* ``$WATCHDOG_USEC`` is the watchdog timeout in microseconds; ``$WATCHDOG_PID``, when set, is
  the process it is meant for (sd_watchdog_enabled(3): ignore both when it is another pid).
  systemd recommends a ping every half of the timeout. The watchdog is armed once start-up
  completes (``READY=1``) and disarmed once the service is stopping (systemd.service(5),
  ``WatchdogSec=``), so pings before ``READY`` or after ``STOPPING`` are harmless.

Messages used here: ``READY=1`` (start-up finished), ``STATUS=…`` (one line shown by
``systemctl status``), ``STOPPING=1`` (shutdown began), ``WATCHDOG=1`` (keep-alive ping).

Sending never raises and never blocks: the socket is non-blocking, a datagram that does not
fit the receiver's queue is dropped, and the first failure of any kind is logged at WARNING
(later ones at DEBUG). Without ``$NOTIFY_SOCKET`` (not under systemd, or ``Type=simple``)
every call is a no-op.

Use (``bumblebot run``)::

    notifier = Notifier()                      # reads os.environ
    notifier.status("starting: opening the database")
    ...                                        # connect every adapter
    notifier.ready("serving telegram as Ada")
    pings = asyncio.create_task(notifier.keep_alive())   # WATCHDOG=1 from the event loop
    ...
    notifier.stopping("stopping: finishing replies in flight")

The pings come from a task on the event loop on purpose: a loop blocked by a synchronous call
cannot run the task, the pings stop, and systemd kills and restarts the service.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Mapping

__all__ = ["Notifier"]

log = logging.getLogger(__name__)


def _one_line(text: str) -> str:
    """``text`` as one line: a newline would end the assignment and start another one."""
    return " ".join(text.replace("\x00", " ").split())


class Notifier:
    """The sd_notify client of one process (module docstring for the protocol).

    Args:
        env: where ``NOTIFY_SOCKET``, ``WATCHDOG_USEC`` and ``WATCHDOG_PID`` are read from,
            once, here (default :data:`os.environ`); tests pass a dict.

    ``enabled`` is true when ``$NOTIFY_SOCKET`` names a socket this class can speak to. Every
    method is a no-op otherwise. Each message goes through a socket of its own, closed at once
    (as libsystemd's ``sd_notify`` does): nothing to close, nothing inherited across ``fork``.
    """

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        self._socket_name = env.get("NOTIFY_SOCKET", "")
        self._watchdog_usec = env.get("WATCHDOG_USEC")
        self._watchdog_pid = env.get("WATCHDOG_PID")
        self._address: str | bytes | None = None
        if self._socket_name.startswith("/"):
            self._address = self._socket_name
        elif self._socket_name.startswith("@"):
            self._address = b"\x00" + self._socket_name[1:].encode()
        elif self._socket_name:
            log.warning(
                "NOTIFY_SOCKET=%s is not an AF_UNIX socket (a path or @name); systemd notifications are off",
                self._socket_name,
            )
        self._failed = False

    @property
    def enabled(self) -> bool:
        """Whether messages are sent at all (``$NOTIFY_SOCKET`` names a path or ``@name``)."""
        return self._address is not None

    # -- messages ----------------------------------------------------------------------------

    def ready(self, status: str | None = None) -> bool:
        """Start-up finished: ``READY=1``, with ``STATUS=<status>`` when given.

        Returns:
            whether the datagram was handed to the kernel (also for the other senders).
        """
        return self.send("READY=1", *self._status(status))

    def status(self, text: str) -> bool:
        """``STATUS=<text>``: one line that ``systemctl status`` shows (newlines become spaces)."""
        return self.send(*self._status(text))

    def stopping(self, status: str | None = None) -> bool:
        """Shutdown began: ``STOPPING=1``, with ``STATUS=<status>`` when given. systemd then
        stops the watchdog and waits up to ``TimeoutStopSec=`` for the process to exit."""
        return self.send("STOPPING=1", *self._status(status))

    def watchdog(self) -> bool:
        """One keep-alive ping: ``WATCHDOG=1``."""
        return self.send("WATCHDOG=1")

    def send(self, *assignments: str) -> bool:
        """Send ``assignments`` (``"NAME=VALUE"`` each, one line each) as one datagram.

        Never raises and never blocks: returns ``False`` when nothing was sent (disabled, no
        assignment, or a failure; the first failure is logged at WARNING, later ones at DEBUG).
        """
        if self._address is None or not assignments:
            return False
        payload = "\n".join(assignments).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.setblocking(False)
                sock.sendto(payload, self._address)
        except BlockingIOError:
            self._failure("dropped: the notify socket's queue is full (systemd is not reading it)")
            return False
        except (OSError, ValueError) as exc:  # ValueError: NUL in a path name
            self._failure(f"{type(exc).__name__}: {exc}")
            return False
        return True

    # -- the watchdog ------------------------------------------------------------------------

    def watchdog_interval_s(self) -> float | None:
        """Seconds between two pings: half of ``$WATCHDOG_USEC`` (µs), as systemd recommends.

        ``None`` when no pings are expected or possible: the notifier is disabled,
        ``$WATCHDOG_USEC`` is unset or not a positive integer, or ``$WATCHDOG_PID`` is set and
        is not this process's pid (then the variables were meant for a parent process).
        """
        if self._address is None or self._watchdog_usec is None:
            return None
        if self._watchdog_pid is not None:
            pid = self._watchdog_pid.strip()
            if not pid.isdigit() or int(pid) != os.getpid():
                return None
        usec = self._watchdog_usec.strip()
        if not usec.isdigit() or int(usec) == 0:
            return None
        return int(usec) / 1_000_000 / 2

    async def keep_alive(self, stop: asyncio.Event | None = None) -> None:
        """Ping ``WATCHDOG=1`` at once and then every :meth:`watchdog_interval_s` seconds.

        Runs on the event loop until cancelled, or until ``stop`` is set. Returns at once
        when no watchdog is expected (``watchdog_interval_s()`` is ``None``). A loop blocked by
        a synchronous call cannot run this coroutine, so the pings stop and systemd restarts
        the service after ``WatchdogSec=``: that is the point.
        """
        interval = self.watchdog_interval_s()
        if interval is None:
            return
        while stop is None or not stop.is_set():
            self.watchdog()
            if stop is None:
                await asyncio.sleep(interval)
                continue
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await stop.wait()

    # -- helpers -----------------------------------------------------------------------------

    @staticmethod
    def _status(text: str | None) -> tuple[str, ...]:
        return () if text is None else (f"STATUS={_one_line(text)}",)

    def _failure(self, why: str) -> None:
        if self._failed:
            log.debug("systemd notification to %s failed: %s", self._socket_name, why)
            return
        self._failed = True
        log.warning(
            "systemd notification to NOTIFY_SOCKET=%s failed: %s (logged once; the daemon runs on)",
            self._socket_name, why,
        )
