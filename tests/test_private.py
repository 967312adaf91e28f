"""Data at rest (bumblebot/app/private.py): under a umask of 022, ``bumblebot run``, ``chat``,
``backup`` and a restart leave every file under the data directory 0600 and every directory
0700; a data directory an older version left open is made private at start."""

from __future__ import annotations

import asyncio
import os
import shlex
import signal
import sqlite3
import stat
import sys
from pathlib import Path

from conftest import running, write_config
from fakes.openai_server import is_loop, tool_calls
from support import env_for, judges_say_done, say

from bumblebot.app.private import make_private


def not_private(root: Path) -> dict[str, str]:
    """Entries under ``root`` (itself included) that are not 0700 (a directory) or 0600 (a
    file), with their modes; symbolic links are not followed."""
    out = {}
    paths = [root, *(Path(top, n) for top, dirs, files in os.walk(root) for n in dirs + files)]
    for path in paths:
        mode = path.lstat().st_mode
        if stat.S_ISLNK(mode):
            continue
        want = 0o700 if stat.S_ISDIR(mode) else 0o600
        if stat.S_IMODE(mode) != want:
            out[str(path.relative_to(root))] = oct(stat.S_IMODE(mode))
    return out


def umask_022(config: Path, *args: str) -> list[str]:
    """The command line of ``bumblebot --config config args…`` started with the umask 022."""
    command = shlex.join([sys.executable, "-m", "bumblebot", "--config", str(config), *args])
    return ["sh", "-c", f"umask 022; exec {command}"]


async def start(config: Path, tmp_path: Path) -> asyncio.subprocess.Process:
    with open(tmp_path / "daemon.log", "ab") as log:
        return await asyncio.create_subprocess_exec(
            *umask_022(config, "run"), env=env_for(tmp_path), stdout=asyncio.subprocess.DEVNULL, stderr=log,
        )


async def stop(proc: asyncio.subprocess.Process) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        assert await asyncio.wait_for(proc.wait(), 20) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def turns_done(data: Path, n: int) -> None:
    """Wait until ``n`` turns are finished in the daemon's database (their rows are written
    once the reply is out)."""
    async with asyncio.timeout(20):
        while True:
            db = sqlite3.connect(data / "bumblebot.db")
            try:
                if db.execute("SELECT COUNT(*) FROM turns WHERE status='done'").fetchone()[0] >= n:
                    return
            finally:
                db.close()
            await asyncio.sleep(0.05)


async def cli(config: Path, tmp_path: Path, *args: str, stdin: bytes = b"") -> bytes:
    proc = await asyncio.create_subprocess_exec(
        *umask_022(config, *args), env=env_for(tmp_path), stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(stdin), 60)
    assert proc.returncode == 0, err.decode()
    return out


async def test_run_backup_chat_and_a_restart_under_umask_022_leave_only_private_files(tmp_path, llm, tg):
    judges_say_done(llm)
    config = write_config(tmp_path, llm, tg, telegram={"allowed_user_ids": [41]})  # the whole workspace
    data = tmp_path / "data"
    llm.push(tool_calls(("write_file", {"path": "notes/out.txt", "content": "kept"}),
                        ("remember", {"title": "Tea", "body": "likes green tea"})), when=is_loop)
    llm.push(say("noted"), when=is_loop)
    proc = await start(config, tmp_path)
    try:
        tg.push_document(b"some notes\n", "notes.txt", "text/plain", caption="keep this", chat_id=41)
        await tg.wait_for("sendMessage", predicate=lambda p: p.get("text") == "noted", timeout=20)
        await turns_done(data, 1)
        await cli(config, tmp_path, "backup", str(data / "backup.db"))
        await cli(config, tmp_path, "trace")
        present = {str(p.relative_to(data)) for p in data.rglob("*")}
        # the database with its WAL, the lock, a received file, a written one, facts, a backup
        assert {"bumblebot.db", "bumblebot.db-wal", "bumblebot.db-shm", "bumblebot.lock", "backup.db",
                "workspace/inbox/telegram_41/notes.txt", "workspace/notes/out.txt"} <= present
        assert any(p.startswith("knowledge/") and p.endswith(".md") for p in present)
        assert not_private(data) == {}
    finally:
        await stop(proc)
    llm.push(say("hello from the console"), when=is_loop)
    assert b"hello from the console" in await cli(config, tmp_path, "chat", stdin=b"hi there\n")
    assert (data / "bumblebot.log").is_file()
    assert not_private(data) == {}
    llm.push(say("back again"), when=is_loop)
    proc = await start(config, tmp_path)  # the restart
    try:
        tg.push_text("still there?", chat_id=41)
        await tg.wait_for("sendMessage", predicate=lambda p: p.get("text") == "back again", timeout=20)
        await turns_done(data, 3)
        assert not_private(data) == {}
    finally:
        await stop(proc)
    assert not_private(data) == {}


async def test_the_command_line_is_private_before_a_daemon_opens_anything(tmp_path, llm):
    """``run`` with no platform to serve creates the data directory and takes the lock, then
    exits 2 without a daemon: both are private all the same."""
    proc = await asyncio.create_subprocess_exec(
        *umask_022(write_config(tmp_path, llm, None), "run"), env=env_for(tmp_path) | {"TELEGRAM_BOT_TOKEN": ""},
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 2 and b"no platform to serve" in err
    assert (tmp_path / "data" / "bumblebot.lock").is_file()
    assert not_private(tmp_path / "data") == {}


async def test_an_older_data_dir_left_open_is_made_private_at_start_links_untouched(tmp_path, llm, tg):
    """Files 0644 and directories 0755 from an older version, in the data directory and in a
    workspace configured outside it, are made private; a link to a file outside, and that
    file, stay as they are; the process umask is the test's again after the stop."""
    data, workspace, outside = tmp_path / "data", tmp_path / "elsewhere" / "ws", tmp_path / "outside.txt"
    for folder in (data / "knowledge", data / "media" / "telegram_5", workspace / "inbox" / "telegram_5"):
        folder.mkdir(parents=True)
    for file in (data / "knowledge" / "telegram_5.md", data / "media" / "telegram_5" / "1-0.png",
                 workspace / "inbox" / "telegram_5" / "a.txt", workspace / "run.sh", outside):
        file.write_text("x")
        file.chmod(0o644)
    (workspace / "run.sh").chmod(0o755)
    (workspace / "link").symlink_to(outside)
    for folder in (data, *[p for p in data.rglob("*") if p.is_dir()], workspace.parent, workspace,
                   *[p for p in workspace.rglob("*") if p.is_dir()]):
        folder.chmod(0o755)
    previous = os.umask(0o022)
    try:
        async with running(write_config(tmp_path, llm, tg, tools={"workspace": str(workspace)})):
            assert not_private(data) == {}
            assert not_private(workspace) == {"run.sh": "0o700"}  # the owner may still run it
        assert os.umask(0o022) == 0o022  # restored at the stop
    finally:
        os.umask(previous)
    assert stat.S_IMODE(outside.stat().st_mode) == 0o644
    assert stat.S_IMODE(workspace.parent.stat().st_mode) == 0o755  # not the daemon's: above the workspace


async def test_backup_check_and_trace_leave_no_open_file_in_an_older_data_dir(tmp_path, llm, tg):
    async with running(write_config(tmp_path, llm, tg)):
        pass
    data = tmp_path / "data"
    for p in [data, *data.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    for args in (["check"], ["trace"], ["backup", str(tmp_path / "b.db")]):
        for p in data.glob("bumblebot.db-*"):
            p.unlink()
        proc = await asyncio.create_subprocess_exec(
            "sh", "-c", f"umask 022; exec {sys.executable} -m bumblebot --config {tmp_path / 'bumblebot.yaml'} {' '.join(args)}",
            env=env_for(tmp_path), stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        )
        await asyncio.wait_for(proc.wait(), 60)
        opened = {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in data.glob("bumblebot.db-*")}
        assert all(m == "0o600" for m in opened.values()), (args, opened)


def test_a_workspace_that_is_a_link_to_another_disk_is_made_private_too(tmp_path):
    """``data/workspace -> /disk/ws`` stayed 0755/0644: the walk follows no link, the
    workspace's own included."""
    elsewhere = tmp_path / "disk" / "ws"
    (elsewhere / "notes").mkdir(parents=True)
    (elsewhere / "notes" / "plan.md").write_text("x")
    for p in (elsewhere, elsewhere / "notes"):
        p.chmod(0o755)
    (elsewhere / "notes" / "plan.md").chmod(0o644)
    data = tmp_path / "data"
    data.mkdir()
    (data / "workspace").symlink_to(elsewhere, target_is_directory=True)
    make_private(data, data / "workspace")
    assert {oct(stat.S_IMODE(p.stat().st_mode)) for p in (elsewhere, elsewhere / "notes")} == {"0o700"}
    assert stat.S_IMODE((elsewhere / "notes" / "plan.md").stat().st_mode) == 0o600
    assert (data / "workspace").is_symlink()
