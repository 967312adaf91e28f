"""Commands a killed daemon left running are killed when it starts again (tools.shell).

``run_command`` runs in its own session, so a SIGKILLed daemon's unconfined command
(``tools.shell.sandbox: off``) ran on, and landed its effect after the restart while the
resumed turn was told the call had been interrupted: a careful model checked, found nothing
yet, and ran it again. (A sandboxed command dies with the daemon: tests/test_sandbox.py.)
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

from conftest import write_config
from fakes.openai_server import is_loop, tool_calls
from support import judges_say_done, kill_daemon, say, start_daemon, stop_daemon

from tools.shell import COMMANDS_DIR, _proc_stat, reap_orphaned_commands


def alive(pid: int) -> bool:
    """Running (not gone, not a zombie nobody reaped yet)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


async def dead(pid: int, timeout: float = 5.0) -> bool:
    """Wait until ``pid`` is no longer running; ``False`` if it still runs after ``timeout``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while alive(pid):
        if loop.time() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


def sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen(["sleep", "300"], start_new_session=True)


async def test_reaping_kills_a_noted_group_and_spares_a_reused_pid(tmp_path):
    ledger = tmp_path / COMMANDS_DIR
    ledger.mkdir()
    orphan, stranger = sleeper(), sleeper()
    try:
        stat = _proc_stat(str(orphan.pid))
        assert stat is not None
        (ledger / str(orphan.pid)).write_text(str(stat[1]))
        (ledger / str(stranger.pid)).write_text("1")  # noted, but that pid now belongs to another process
        assert reap_orphaned_commands(ledger) == 1
        assert orphan.wait(5) == -signal.SIGKILL
        assert stranger.poll() is None
        assert list(ledger.iterdir()) == []
    finally:
        for proc in (orphan, stranger):
            proc.kill()
            proc.wait()


def test_reaping_without_a_ledger_does_nothing(tmp_path):
    assert reap_orphaned_commands(tmp_path / "missing") == 0


async def test_a_command_cut_off_by_a_crash_is_killed_at_the_next_start(tmp_path, llm, tg):
    started: asyncio.Queue[int] = asyncio.Queue()

    async def report(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await started.put(int((await reader.read()).decode()))
        writer.close()

    server = await asyncio.start_server(report, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    script = (
        "import os, socket, time; s = socket.create_connection(('127.0.0.1', %d)); "
        "s.sendall(str(os.getpid()).encode()); s.close(); time.sleep(300)" % port
    )
    judges_say_done(llm)
    llm.push(tool_calls(("run_command", {"command": f"{sys.executable} -c \"{script}\"; echo effect >> eff.txt"})),
             when=is_loop)
    config = write_config(tmp_path, llm, tg, tools={"shell": {"enabled": True, "timeout_s": 600, "sandbox": "off"}},
                          telegram={"allowed_user_ids": [71]})  # its private chat: the shell is offered there
    pid = None
    proc = await start_daemon(config, tmp_path)
    try:
        tg.push_text("run the long job", chat_id=71)
        pid = await asyncio.wait_for(started.get(), 20)
        await kill_daemon(proc)
        assert alive(pid)  # it outlived the daemon
        llm.push(say("the job was cut off"), when=is_loop)
        proc = await start_daemon(config, tmp_path)
        await tg.wait_for("sendMessage", timeout=20)
        assert await dead(pid)
        assert await stop_daemon(proc) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
        if pid is not None and alive(pid):
            os.kill(pid, signal.SIGKILL)
        server.close()
    assert tg.sent(71) == ["the job was cut off"]
    assert not (tmp_path / "data" / "workspace" / "eff.txt").exists()
    assert list((tmp_path / "data" / COMMANDS_DIR).iterdir()) == []
