"""The bubblewrap sandbox of run_command (tools/sandbox.py): what a command can no longer reach
(the daemon's secrets and processes, the data directory, the rest of the file system, the
network), the limits that stop a fork bomb or a huge allocation while the daemon goes on, the
sandbox dying with the daemon, and the shell not offered where bubblewrap cannot run."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import TOKEN, write_config
from fakes.openai_server import FakeOpenAI, is_loop, tool_calls
from fakes.telegram_server import retry_after_body
from processes import descendants, kill_all, marker, wait_for_marked, wait_until_gone
from support import judges_say_done, kill_daemon, loop_requests, running, say, start_daemon, stop_daemon

from adapters.telegram.pacing import PaceLimits
from bumblebot.app.check import check_all
from bumblebot.core.config import Secrets, load_settings
from bumblebot.core.entity import load_entity
from bumblebot.core.toolkit import ToolContext, ToolResult
from tools.registry import Registry
from tools.sandbox import Sandbox, probe
from tools.shell import shell_tools


@pytest.fixture
def ctx(tmp_path: Path) -> ToolContext:
    """A workspace inside a data directory that holds a database, as the daemon lays them out."""
    data = tmp_path / "data"
    (data / "workspace").mkdir(parents=True)
    (data / "bumblebot.db").write_text("SQLite format 3 -- the daemon's history")
    return ToolContext(workspace=(data / "workspace").resolve(), data_dir=data)


@pytest.fixture
def stray_pids() -> Iterator[list[int]]:
    pids: list[int] = []
    yield pids
    kill_all(pids)


def sandboxed(sandbox: Sandbox | None = None, timeout_s: float = 10) -> Registry:
    tools = shell_tools(max_timeout_s=timeout_s, max_output_chars=2000, kill_grace_s=1, sandbox=sandbox or Sandbox())
    return Registry(tools)


async def run(shell: Registry, ctx: ToolContext, command: str, **extra: Any) -> dict[str, Any]:
    result: ToolResult = await shell.execute("run_command", json.dumps({"command": command, **extra}), ctx)
    data = json.loads(result.content)
    assert result.ok == (data.get("exit_code") == 0 and not data.get("timed_out"))
    return data


async def test_the_data_directory_is_not_there(ctx: ToolContext) -> None:
    db = ctx.data_dir / "bumblebot.db"
    data = await run(sandboxed(), ctx, f"cat ../bumblebot.db; cat {db}; ls -a ..; echo $PWD")
    assert "SQLite" not in data["stdout"] + data["stderr"]
    assert "bumblebot.db" not in data["stdout"]
    assert data["stdout"].endswith("workspace\n/workspace\n")
    assert "../bumblebot.db: No such file" in data["stderr"]


async def test_writes_land_in_the_workspace_only(ctx: ToolContext) -> None:
    name = f"sandbox-{uuid.uuid4().hex}"
    outside = ctx.data_dir / name
    elsewhere = [f"/{name}", f"/etc/{name}", f"/usr/{name}", str(outside)]
    command = (f"echo kept > {name}; echo private > /tmp/{name}; cat /tmp/{name}; "
               f"for f in {' '.join(elsewhere)}; do echo x > $f || echo refused $f; done")  # fmt: skip
    data = await run(sandboxed(), ctx, command)
    assert (ctx.workspace / name).read_text() == "kept\n"
    assert data["stdout"].splitlines() == ["private"] + [f"refused {f}" for f in elsewhere]
    assert not outside.exists() and not Path("/tmp", name).exists()
    data = await run(sandboxed(), ctx, f"cat /tmp/{name}")  # each call gets a /tmp of its own
    assert data["exit_code"] != 0


async def test_the_network_is_off_unless_enabled(ctx: ToolContext) -> None:
    received: asyncio.Queue[bytes] = asyncio.Queue()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await received.put(await reader.read())
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    command = f"bash -c 'echo hello > /dev/tcp/127.0.0.1/{port}' && echo sent"
    try:
        data = await run(sandboxed(), ctx, command)
        assert data["exit_code"] != 0 and data["stdout"] == ""
        assert "Connection refused" in data["stderr"]
        data = await run(sandboxed(Sandbox(network=True)), ctx, command)
        assert data["stdout"] == "sent\n"
        assert await asyncio.wait_for(received.get(), 10) == b"hello\n"
    finally:
        server.close()
    assert received.empty()  # the first, unnetworked try never arrived


async def test_a_fork_bomb_stops_at_the_process_limit(ctx: ToolContext) -> None:
    """The bomb runs two seconds inside; the daemon's side keeps working meanwhile and after.

    The bomb is started in the background: its launcher's own second fork can lose the race
    to its first child's descendants, and bash then retries a refused fork for 15 s (1 + 2 +
    4 + 8) before giving up, which a loaded machine made happen."""
    limit = 32
    shell = sandboxed(Sandbox(max_processes=limit), timeout_s=20)
    peak = 0
    done = asyncio.Event()

    async def watch() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, len(await asyncio.to_thread(descendants, os.getpid())))
            await asyncio.sleep(0.05)

    watcher = asyncio.create_task(watch())
    loop = asyncio.get_running_loop()
    start = loop.time()
    try:
        data = await run(shell, ctx, "bash -c ':(){ :|:& };:' & exec sleep 2")
    finally:
        done.set()
        await watcher
    assert loop.time() - start < 15 and data["exit_code"] == 0
    assert "Resource temporarily unavailable" in data["stderr"]  # forks were refused
    # bwrap and its pid 1 (root's own when the daemon is root), then the command's processes
    assert 8 < peak <= limit + 2
    start = loop.time()
    assert (await run(shell, ctx, "echo still here"))["stdout"] == "still here\n"
    assert loop.time() - start < 5
    async with asyncio.timeout(10):
        while await asyncio.to_thread(descendants, os.getpid()):
            await asyncio.sleep(0.05)  # nothing of the bomb is left


async def test_a_huge_allocation_fails_inside(ctx: ToolContext) -> None:
    shell = sandboxed(Sandbox(memory_mb=256), timeout_s=20)
    data = await run(shell, ctx, "python3 -c 'b = bytearray(10**10)'")
    assert data["exit_code"] == 1 and "MemoryError" in data["stderr"]
    data = await run(shell, ctx, "head -c 10G /dev/zero | tail; echo $?")
    assert data["stdout"] == "1\n" and "memory exhausted" in data["stderr"] and not data["timed_out"]
    assert (await run(shell, ctx, "echo still here"))["stdout"] == "still here\n"


async def test_tmp_and_dev_shm_are_bounded_and_dev_is_read_only(ctx: ToolContext) -> None:
    """tmpfs pages count against no process's address space: their size is the bound."""
    shell = sandboxed(Sandbox(tmp_mb=8), timeout_s=20)
    for where in ("/tmp", "/dev/shm"):
        data = await run(shell, ctx, f"head -c 64M /dev/zero > {where}/fill; echo $?; du -k {where}/fill")
        assert "No space left on device" in data["stderr"] and not data["timed_out"]
        status, size = data["stdout"].splitlines()
        assert status == "1" and int(size.split()[0]) <= 8 * 1024
    data = await run(shell, ctx, "head -c 1M /dev/zero > /dev/fill")
    assert data["exit_code"] != 0 and "Read-only file system" in data["stderr"]
    data = await run(shell, ctx, "echo still here; df -k /tmp /dev/shm | tail -n +2")
    lines = data["stdout"].splitlines()
    assert lines[0] == "still here"
    assert [line.split()[1] for line in lines[1:]] == ["8192", "8192"]  # a fresh, empty /tmp and /dev/shm
    assert [line.split()[2] for line in lines[1:]] == ["0", "0"]


@pytest.fixture
def root_only_key() -> Iterator[Path]:
    """A root-only (0600) file where host TLS private keys live, ``/etc/ssl/private``, made when
    the tests run as root: a command of a root daemon keeps ``CAP_DAC_OVERRIDE``, so only its
    absence from the sandbox keeps it from being read. As another user it cannot be made, and
    the folder (``0710`` on Debian) is what the sandbox must not show either."""
    folder = Path("/etc/ssl/private")
    key = folder / f"bumblebot-test-probe-{uuid.uuid4().hex}.key"
    if os.geteuid() != 0:
        yield key
        return
    made = not folder.exists()
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as file:
            file.write("-----BEGIN PRIVATE KEY-----\nbumblebot test probe\n")
        yield key
    finally:
        key.unlink(missing_ok=True)
        if made:
            folder.rmdir()


async def test_no_private_key_folder_of_etc_is_mounted(ctx: ToolContext, root_only_key: Path) -> None:
    """Only world-readable files of /etc are there, and https still finds its CA certificates."""
    ca = "python3 -c 'import ssl; print(ssl.create_default_context().cert_store_stats()[\"x509_ca\"] > 0)'"
    command = f"cat {root_only_key}; ls -d /etc/ssl/certs; {ca}; find /etc ! -perm -o=r"
    data = await run(sandboxed(), ctx, command)
    assert "bumblebot test probe" not in data["stdout"]
    assert f"cat: {root_only_key}: No such file or directory" in data["stderr"]
    assert data["stdout"] == "/etc/ssl/certs\nTrue\n"  # and find lists nothing unreadable
    assert "Permission denied" not in data["stderr"]


async def test_a_timeout_ends_every_process_of_the_sandbox(ctx: ToolContext, stray_pids: list[int]) -> None:
    """Even one that left the command's session (unconfined, ``setsid`` escapes the kill)."""
    escaped, child = marker(), marker()
    task = asyncio.create_task(run(sandboxed(), ctx, f"setsid sleep {escaped} & sleep {child}", timeout_s=5))
    pids = await wait_for_marked(escaped, stray_pids) + await wait_for_marked(child, stray_pids)
    data = await task
    assert data["timed_out"] is True
    for pid in pids:
        await wait_until_gone(pid)


async def test_messages_name_the_workspace_as_the_sandbox_sees_it(ctx: ToolContext) -> None:
    data = await run(sandboxed(), ctx, f"echo {ctx.workspace}/notes.txt >&2; ls {ctx.workspace}")
    assert str(ctx.data_dir) not in data["stderr"]
    assert data["stderr"].startswith("/workspace/notes.txt\n")


# -- the service's way: bubblewrap unprivileged, in a user namespace -----------------------------


@pytest.fixture
def unprivileged_workspace(tmp_path: Path) -> Iterator[tuple[Path, list[str]]]:
    """A workspace and the command prefix that runs bubblewrap as an ordinary user: nobody's
    own folder under /tmp when the tests run as root, else the test's own."""
    if os.geteuid() != 0:
        yield tmp_path, []
        return
    base = Path(tempfile.mkdtemp(prefix="bumblebot-sandbox-", dir="/tmp"))
    try:
        base.chmod(0o755)
        (base / "workspace").mkdir()
        shutil.chown(base / "workspace", 65534, 65534)
        yield base / "workspace", ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"]
    finally:
        shutil.rmtree(base)


async def test_unprivileged_the_process_limit_holds_in_the_user_namespace(
    unprivileged_workspace: tuple[Path, list[str]],
) -> None:
    workspace, as_user = unprivileged_workspace
    limit = 32
    command = "echo written > out.txt; bash -c ':(){ :|:& };:'; exec sleep 2"
    argv = Sandbox(max_processes=limit).argv(command, workspace, root=False)
    peak = 0
    proc = await asyncio.create_subprocess_exec(
        *as_user, *argv, cwd="/", env={"PATH": "/usr/bin:/bin", "TELEGRAM_BOT_TOKEN": TOKEN},
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )  # fmt: skip
    try:
        communicating = asyncio.ensure_future(proc.communicate())
        async with asyncio.timeout(20):
            while not communicating.done():
                peak = max(peak, len(await asyncio.to_thread(descendants, proc.pid)))
                await asyncio.wait([communicating], timeout=0.05)
        out, err = communicating.result()
    finally:
        if proc.returncode is None:
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
    assert proc.returncode == 0, err.decode()
    assert b"Resource temporarily unavailable" in err
    assert 8 < peak <= limit  # its pid 1 counts: it is the same user in the namespace
    assert (workspace / "out.txt").read_text() == "written\n"


async def test_unprivileged_tmp_and_dev_shm_are_bounded(unprivileged_workspace: tuple[Path, list[str]]) -> None:
    workspace, as_user = unprivileged_workspace
    command = "for d in /tmp /dev/shm; do head -c 64M /dev/zero > $d/fill; echo $?; done; echo x > /dev/fill; echo $?"
    argv = Sandbox(tmp_mb=8).argv(command, workspace, root=False)
    proc = await asyncio.create_subprocess_exec(
        *as_user, *argv, cwd="/", env={"PATH": "/usr/bin:/bin"}, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 20)
    finally:
        if proc.returncode is None:
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
    assert out == b"1\n1\n2\n", err.decode()
    assert err.count(b"No space left on device") == 2 and b"Read-only file system" in err


# -- in the daemon ------------------------------------------------------------------------------


def shell_config(tmp_path: Path, llm: FakeOpenAI, tg: Any, **shell: Any) -> Path:
    # the chats of these tests are their allowlisted users' private chats: the shell is offered there
    return write_config(tmp_path, llm, tg, tools={"shell": {"enabled": True, **shell}}, telegram={"allowed_user_ids": [81, 82]})


@pytest.mark.parametrize("sandbox", ["bwrap", "off"])
async def test_the_daemons_secrets_and_database_stay_out_of_reach(tmp_path, llm, tg, sandbox):
    """The daemon (a real ``bumblebot run``, its tokens in its environment) runs a command that
    looks for them where an unconfined one finds them; off, the same command finds them."""
    look = "cat /proc/$PPID/environ; echo; head -c 15 ../bumblebot.db; echo"
    if sandbox == "bwrap":  # every process it can see (its own PID namespace's)
        look += "; cat /proc/[0-9]*/environ"
    judges_say_done(llm)
    llm.push(tool_calls(("run_command", {"command": look})), when=is_loop)
    llm.push(say("looked"), when=is_loop)
    proc = await start_daemon(shell_config(tmp_path, llm, tg, sandbox=sandbox), tmp_path)
    try:
        tg.push_text("look around", chat_id=81)
        await tg.wait_for("sendMessage", timeout=20)
    finally:
        assert await stop_daemon(proc) == 0
    [result] = [m["content"] for r in loop_requests(llm) for m in r["messages"] if m["role"] == "tool"][:1]
    if sandbox == "off":  # the trust decision the sandbox takes away (the registry still hides the values)
        assert "TELEGRAM_BOT_TOKEN=[REDACTED]" in result and "SQLite format 3" in result
        assert TOKEN not in result and "sk-test-key-not-real" not in result
    else:
        assert "TELEGRAM_BOT_TOKEN" not in result and "SQLite" not in result and TOKEN not in result
        assert "'../bumblebot.db' for reading: No such file" in result


async def test_the_sandbox_dies_with_a_killed_daemon(tmp_path, llm, tg, stray_pids):
    """Nothing of the command runs on, and its effect never lands, once the daemon is gone."""
    workspace = tmp_path / "data" / "workspace"
    workspace.mkdir(parents=True)
    os.mkfifo(workspace / "ready.fifo")
    mark = marker()
    command = f"sleep {mark} & echo started > ready.fifo; wait; echo effect >> eff.txt"
    judges_say_done(llm)
    llm.push(tool_calls(("run_command", {"command": command})), when=is_loop)
    proc = await start_daemon(shell_config(tmp_path, llm, tg, timeout_s=600), tmp_path)
    try:
        tg.push_text("run the long job", chat_id=82)
        fd = os.open(workspace / "ready.fifo", os.O_RDONLY | os.O_NONBLOCK)
        try:
            ready = asyncio.Event()
            asyncio.get_running_loop().add_reader(fd, ready.set)
            await asyncio.wait_for(ready.wait(), 20)
            asyncio.get_running_loop().remove_reader(fd)
        finally:
            os.close(fd)
        pids = await wait_for_marked(mark, stray_pids)
        await kill_daemon(proc)
        for pid in pids:
            await wait_until_gone(pid)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert not (workspace / "eff.txt").exists()


# -- where bubblewrap cannot run ----------------------------------------------------------------


async def test_probe_says_why_bubblewrap_cannot_run(tmp_path: Path) -> None:
    assert await probe(Sandbox(), tmp_path / "ws") is None
    missing = await probe(Sandbox(bwrap=str(tmp_path / "no-bwrap")), tmp_path / "ws")
    assert missing is not None and "was not found" in missing and "apt install bubblewrap" in missing
    failing = await probe(Sandbox(bwrap="/bin/false"), tmp_path / "ws")
    assert failing is not None and failing.startswith("a trial run of bubblewrap failed: exit status 1")
    assert str(tmp_path) not in failing


@pytest.fixture
async def model() -> AsyncIterator[FakeOpenAI]:
    """An endpoint that answers check's pings."""
    async with FakeOpenAI() as server:
        judges_say_done(server)
        server.push(tool_calls(("ping", {})), when=is_loop)
        yield server


@pytest.mark.parametrize(
    ("shell", "offered", "line"),
    [
        ({"bwrap": "/nonexistent/bwrap"}, False,
         "[FAIL] shell: run_command is not offered: bubblewrap (/nonexistent/bwrap) was not found"),
        ({}, True, "[ok] shell: run_command runs in a bubblewrap sandbox, without network"),
        ({"sandbox": "off"}, True, "[ok] shell: WARNING: run_command runs unconfined (tools.shell.sandbox: off)"),
    ],
)  # fmt: skip
async def test_the_shell_is_offered_only_where_its_sandbox_runs(tmp_path, model, capsys, shell, offered, line):
    config = write_config(tmp_path, model, None, tools={"shell": {"enabled": True, **shell}})
    async with running(config, telegram_token=None) as daemon:
        assert ("run_command" in daemon.toolbox.names()) is offered
    settings = load_settings(config)
    entity = load_entity(settings.entity, config_dir=tmp_path)
    problems = await check_all(settings, Secrets(OPENAI_API_KEY="sk-test"), entity)
    assert problems == ([] if offered else ["shell"])
    assert line in capsys.readouterr().out


async def test_a_file_swapped_for_a_link_after_send_file_checked_it_is_not_what_goes_out(tmp_path, llm, tg):
    """send_file checked ``report.txt``; a command of the same step swapped it for a link to
    ``../bumblebot.db`` before the upload (held by a 429), and the retry uploaded the database."""
    judges_say_done(llm)
    llm.push(tool_calls(("run_command", {"command": "echo decoy > report.txt"})), when=is_loop)
    llm.push(tool_calls(
        ("say", {"text": "one"}),
        ("send_file", {"path": "report.txt"}),
        ("run_command", {"command": "sleep 0.3; ln -sf ../bumblebot.db report.txt"}),
    ), when=is_loop)
    llm.push(say("done"), when=is_loop)
    async with running(shell_config(tmp_path, llm, tg), pace=PaceLimits(per_chat_burst=1)) as d:
        tg.fail_next("sendDocument", 429, retry_after_body(1))  # Telegram's flood control
        tg.push_text("send me the report", chat_id=81)
        await tg.wait_for("sendDocument", n=2, timeout=30)
        await d.engine.wait_for_turns(1)
        outgoing = list((d.settings.media_dir / "outgoing").iterdir())
    docs = [f["data"] for f in tg.files_sent if f["method"] == "sendDocument"]
    assert docs == [b"decoy\n", b"decoy\n"]  # the 429'd try and the retry: the copy made when it was checked
    assert outgoing == []  # and the copy is gone once sent
