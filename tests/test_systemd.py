"""The sd_notify protocol (bumblebot/app/systemd.py) against real AF_UNIX datagram sockets.

Each test binds the socket systemd would hold (a path in tmp_path, or an abstract name),
points the Notifier's NOTIFY_SOCKET at it and reads the exact datagrams. Waiting is always a
receive with a timeout, never a sleep.
"""

from __future__ import annotations

import asyncio
import logging
import os
import select
import signal
import socket
import struct
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import pytest
from conftest import write_config
from support import env_for

from bumblebot.app.systemd import Notifier

WAIT_S = 5.0  # the longest any test waits for a datagram that must come


@pytest.fixture(params=["path", "abstract"])
def listener(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    """``(bound receiving socket, the NOTIFY_SOCKET value naming it)``."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if request.param == "path":
        path = tmp_path / "notify"
        sock.bind(str(path))
        name = str(path)
    else:
        abstract = f"bumblebot-test-{uuid.uuid4().hex}"
        sock.bind(b"\x00" + abstract.encode())
        name = f"@{abstract}"
    sock.settimeout(WAIT_S)
    with sock:
        yield sock, name


def drain(sock: socket.socket) -> list[bytes]:
    """Every datagram already queued on ``sock``, without waiting."""
    out = []
    while select.select([sock], [], [], 0)[0]:
        out.append(sock.recv(4096))
    return out


def test_each_message_is_one_exact_datagram(listener):
    sock, name = listener
    notifier = Notifier({"NOTIFY_SOCKET": name})
    assert notifier.enabled

    assert notifier.status("starting: opening the database") is True
    assert sock.recv(4096) == b"STATUS=starting: opening the database"
    assert notifier.ready("serving telegram, discord as Ada") is True
    assert sock.recv(4096) == b"READY=1\nSTATUS=serving telegram, discord as Ada"
    assert notifier.watchdog() is True
    assert sock.recv(4096) == b"WATCHDOG=1"
    assert notifier.stopping("stopping: finishing replies in flight (up to 30 s)") is True
    assert sock.recv(4096) == b"STOPPING=1\nSTATUS=stopping: finishing replies in flight (up to 30 s)"
    notifier.ready()
    notifier.stopping()
    assert sock.recv(4096) == b"READY=1"
    assert sock.recv(4096) == b"STOPPING=1"


def test_a_status_is_one_line_and_cannot_smuggle_an_assignment(listener):
    sock, name = listener
    notifier = Notifier({"NOTIFY_SOCKET": name})
    notifier.status("fine\nREADY=1\r\n  and\tmore\x00")
    assert sock.recv(4096) == b"STATUS=fine READY=1 and more"
    notifier.status("ünïcode ✓")
    assert sock.recv(4096) == "STATUS=ünïcode ✓".encode()


def test_the_datagram_carries_our_credentials(tmp_path):
    """What NotifyAccess=main relies on: the kernel attaches the sender's pid (SCM_CREDENTIALS)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    with sock:
        sock.bind(str(tmp_path / "notify"))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        sock.settimeout(WAIT_S)
        Notifier({"NOTIFY_SOCKET": str(tmp_path / "notify")}).ready("up")
        data, ancillary, _, _ = sock.recvmsg(4096, socket.CMSG_SPACE(struct.calcsize("3i")))
    assert data == b"READY=1\nSTATUS=up"
    creds = [d for level, kind, d in ancillary if (level, kind) == (socket.SOL_SOCKET, socket.SCM_CREDENTIALS)]
    assert len(creds) == 1
    pid, uid, _gid = struct.unpack("3i", creds[0][: struct.calcsize("3i")])
    assert (pid, uid) == (os.getpid(), os.getuid())


def test_the_default_env_is_os_environ(monkeypatch, tmp_path):
    path = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        sock.settimeout(WAIT_S)
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        assert Notifier().ready("up")
        assert sock.recv(4096) == b"READY=1\nSTATUS=up"
    monkeypatch.delenv("NOTIFY_SOCKET")
    assert not Notifier().enabled


def test_without_notify_socket_every_call_is_a_no_op(caplog):
    caplog.set_level(logging.DEBUG, logger="bumblebot.app.systemd")
    for env in ({}, {"NOTIFY_SOCKET": ""}, {"WATCHDOG_USEC": "30000000"}):
        notifier = Notifier(env)
        assert not notifier.enabled
        assert [notifier.ready("x"), notifier.status("x"), notifier.stopping("x"), notifier.watchdog()] == [False] * 4
        assert notifier.watchdog_interval_s() is None
    assert caplog.records == []


async def test_keep_alive_without_a_watchdog_returns_at_once(listener):
    _, name = listener
    for env in ({}, {"NOTIFY_SOCKET": name}, {"NOTIFY_SOCKET": name, "WATCHDOG_USEC": "0"}):
        await asyncio.wait_for(Notifier(env).keep_alive(), WAIT_S)


@pytest.mark.parametrize(
    ("usec", "pid", "interval"),
    [
        ("30000000", None, 15.0),  # WatchdogSec=30: a ping every 15 s
        ("30000000", "self", 15.0),
        ("30000000", "parent", None),  # meant for the process that started us
        ("1000", None, 0.0005),
        (" 20000000 ", " self ", 10.0),
        ("0", None, None),
        ("-5", None, None),
        ("soon", None, None),
        ("", None, None),
        ("30000000", "", None),
        ("30000000", "x", None),
        (None, "self", None),
    ],
)
def test_watchdog_interval_is_half_of_watchdog_usec_for_our_pid(listener, usec, pid, interval):
    _, name = listener
    env = {"NOTIFY_SOCKET": name}
    if usec is not None:
        env["WATCHDOG_USEC"] = usec
    if pid is not None:
        env["WATCHDOG_PID"] = pid.replace("self", str(os.getpid())).replace("parent", str(os.getppid()))
    assert Notifier(env).watchdog_interval_s() == interval


def _watchdog_env(name: str, interval_s: float) -> dict[str, str]:
    return {"NOTIFY_SOCKET": name, "WATCHDOG_USEC": str(int(interval_s * 2 * 1_000_000)), "WATCHDOG_PID": str(os.getpid())}


async def _receive(sock: socket.socket) -> bytes:
    loop = asyncio.get_running_loop()
    return await asyncio.wait_for(loop.sock_recv(sock, 4096), WAIT_S)


async def test_keep_alive_pings_again_and_again_while_the_loop_runs(listener):
    sock, name = listener
    sock.setblocking(False)
    notifier = Notifier(_watchdog_env(name, 0.02))
    pinger = asyncio.create_task(notifier.keep_alive())
    try:
        pings = [await _receive(sock) for _ in range(6)]
    finally:
        pinger.cancel()
        await asyncio.gather(pinger, return_exceptions=True)
    assert pings == [b"WATCHDOG=1"] * 6


async def test_a_blocked_loop_sends_no_pings_and_they_resume_after(listener):
    sock, name = listener
    sock.setblocking(False)
    pinger = asyncio.create_task(Notifier(_watchdog_env(name, 0.02)).keep_alive())
    try:
        assert await _receive(sock) == b"WATCHDOG=1"
        drain(sock)
        # Block the loop for 0.5 s (25 intervals) with a synchronous call, watching the socket.
        arrived, _, _ = select.select([sock], [], [], 0.5)
        assert arrived == [], "a ping came while the event loop was blocked"
        assert await _receive(sock) == b"WATCHDOG=1"  # the loop runs again: so do the pings
    finally:
        pinger.cancel()
        await asyncio.gather(pinger, return_exceptions=True)


async def test_keep_alive_ends_when_stop_is_set(listener):
    sock, name = listener
    sock.setblocking(False)
    stop = asyncio.Event()
    pinger = asyncio.create_task(Notifier(_watchdog_env(name, 10.0)).keep_alive(stop))
    assert await _receive(sock) == b"WATCHDOG=1"  # the first ping is sent at once
    stop.set()
    await asyncio.wait_for(pinger, WAIT_S)  # long before the next ping (10 s)
    assert drain(sock) == []


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "bumblebot.app.systemd" and r.levelno >= logging.WARNING]


@pytest.mark.parametrize(
    "target",
    ["missing", "regular file", "directory", "abstract, nobody bound", "path too long", "NUL in path"],
)
def test_a_missing_or_broken_socket_never_raises_and_warns_once(tmp_path, caplog, target):
    caplog.set_level(logging.DEBUG, logger="bumblebot.app.systemd")
    (tmp_path / "file").write_text("not a socket")
    name = {
        "missing": str(tmp_path / "no-such-socket"),
        "regular file": str(tmp_path / "file"),
        "directory": str(tmp_path),
        "abstract, nobody bound": f"@bumblebot-test-{uuid.uuid4().hex}",
        "path too long": "/" + "x" * 200,
        "NUL in path": str(tmp_path / "a\x00b"),
    }[target]
    notifier = Notifier({**_watchdog_env(name, 0.01)})
    assert notifier.enabled
    for _ in range(3):
        assert notifier.ready("up") is False
        assert notifier.status("still") is False
        assert notifier.watchdog() is False
        assert notifier.stopping("bye") is False
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and name.replace("\x00", "") in warnings[0].replace("\x00", "")


async def test_keep_alive_on_a_broken_socket_runs_on_quietly(tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger="bumblebot.app.systemd")
    pinger = asyncio.create_task(Notifier(_watchdog_env(str(tmp_path / "gone"), 0.005)).keep_alive())
    done, _ = await asyncio.wait([pinger], timeout=0.2)  # it must still be running: it never raises
    pinger.cancel()
    await asyncio.gather(pinger, return_exceptions=True)
    assert done == set()
    assert len(_warnings(caplog)) == 1


@pytest.mark.parametrize("name", ["vsock:2:9999", "notify", "relative/path"])
def test_an_unsupported_address_disables_the_notifier_with_one_warning(caplog, name):
    caplog.set_level(logging.DEBUG, logger="bumblebot.app.systemd")
    notifier = Notifier({"NOTIFY_SOCKET": name, "WATCHDOG_USEC": "30000000"})
    assert not notifier.enabled
    assert [notifier.ready("x"), notifier.watchdog(), notifier.stopping()] == [False] * 3
    assert notifier.watchdog_interval_s() is None
    assert len(_warnings(caplog)) == 1 and name in _warnings(caplog)[0]


def test_a_receiver_that_goes_away_is_survived(tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger="bumblebot.app.systemd")
    path = tmp_path / "notify"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(WAIT_S)
    notifier = Notifier({"NOTIFY_SOCKET": str(path)})
    assert notifier.ready("up")
    assert sock.recv(4096) == b"READY=1\nSTATUS=up"
    sock.close()
    path.unlink()
    assert notifier.stopping("bye") is False
    assert len(_warnings(caplog)) == 1


@pytest.mark.timeout(20)
def test_a_full_socket_queue_drops_pings_instead_of_blocking(tmp_path, caplog):
    """Nobody reads the socket: sends fail fast with a full queue (EAGAIN) and are dropped. A
    blocking socket would hang here until the timeout."""
    caplog.set_level(logging.DEBUG, logger="bumblebot.app.systemd")
    path = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        sock.bind(str(path))
        notifier = Notifier({"NOTIFY_SOCKET": str(path)})
        results = [notifier.watchdog() for _ in range(5000)]
        assert results[0] is True
        assert False in results, "the queue never filled"
        first_drop = results.index(False)
        warnings = _warnings(caplog)
        assert len(warnings) == 1 and "full" in warnings[0]
        # what did fit arrived intact
        sock.settimeout(WAIT_S)
        received = drain(sock)
        assert set(received) == {b"WATCHDOG=1"} and len(received) == results.count(True) >= first_drop


# -- through the real command line ---------------------------------------------------------


def _append(path: Path) -> BinaryIO:
    return path.open("ab")  # a local file: opened at once, never worth a thread


async def test_bumblebot_run_says_ready_pings_and_says_stopping(tmp_path, llm, tg):
    """``bumblebot run`` started the way systemd starts it (NOTIFY_SOCKET, WATCHDOG_USEC, and
    WATCHDOG_PID as the child's own pid is unknown beforehand, so left unset): READY=1 once
    Telegram is connected, WATCHDOG=1 pings while it serves, STOPPING=1 on SIGTERM, exit 0."""
    path = tmp_path / "notify"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.setblocking(False)
    env = {**env_for(tmp_path), "NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "200000"}  # a ping every 0.1 s
    with sock, _append(tmp_path / "daemon.log") as log_file:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bumblebot", "run", "--config", str(write_config(tmp_path, llm, tg)),
            cwd=tmp_path, env=env, stdout=asyncio.subprocess.DEVNULL, stderr=log_file,
        )
        seen: list[bytes] = []

        async def until(first: bytes, timeout: float = 30) -> bytes:
            async with asyncio.timeout(timeout):
                while True:
                    seen.append(await asyncio.get_running_loop().sock_recv(sock, 4096))
                    if seen[-1].startswith(first):
                        return seen[-1]

        try:
            ready = await until(b"READY=1")
            assert any(c.method == "getMe" for c in tg.calls), "READY=1 came before Telegram was connected"
            await until(b"WATCHDOG=1", WAIT_S)
            await until(b"WATCHDOG=1", WAIT_S)
            proc.send_signal(signal.SIGTERM)
            stopping = await until(b"STOPPING=1")
            code = await asyncio.wait_for(proc.wait(), 30)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    log = (tmp_path / "daemon.log").read_text()
    assert code == 0, log
    assert ready.split(b"\n")[0] == b"READY=1" and all(line.startswith(b"STATUS=") for line in ready.split(b"\n")[1:])
    assert stopping.split(b"\n")[0] == b"STOPPING=1"
    assert seen.index(ready) < seen.index(stopping)
    assert "systemd notification" not in log  # no send failed
