"""run_command: cwd, reduced environment, process-group kill on timeout, exit and
cancellation, output caps (no deny-list of commands pretending to be a sandbox).

Each test runs in both modes: in the bubblewrap sandbox (``tools.shell.sandbox: bwrap``, the
default) and unconfined (``off``). What only the sandbox does is in tests/test_sandbox.py."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from processes import kill_all, marker, wait_for_marked, wait_until_gone

from bumblebot.core.toolkit import ToolContext, ToolResult
from tools import build_registry
from tools.registry import Registry
from tools.sandbox import WORKSPACE, Sandbox
from tools.shell import command_env, shell_tools


@pytest.fixture
def ctx(tmp_path: Path) -> ToolContext:
    workspace = tmp_path / "ws"
    workspace.mkdir()
    return ToolContext(workspace=workspace.resolve(), data_dir=tmp_path / "data")


@pytest.fixture(params=["bwrap", "off"])
def mode(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def shell(mode: str) -> Registry:
    sandbox = Sandbox() if mode == "bwrap" else None
    return Registry(shell_tools(max_timeout_s=5, max_output_chars=2000, kill_grace_s=1, sandbox=sandbox))


def killed_by(sig: signal.Signals, mode: str) -> int:
    """The exit code of a shell ended by ``sig``: bubblewrap reports it as a shell would."""
    return 128 + sig if mode == "bwrap" else -sig


def home(ctx: ToolContext, mode: str) -> str:
    return WORKSPACE if mode == "bwrap" else str(ctx.workspace)


@pytest.fixture
def stray_pids() -> Iterator[list[int]]:
    """Pids a test saw; killed at teardown so a failing test leaves nothing running."""
    pids: list[int] = []
    yield pids
    kill_all(pids)


async def run(shell: Registry, ctx: ToolContext, command: str, **extra: Any) -> ToolResult:
    return await shell.execute("run_command", json.dumps({"command": command, **extra}), ctx)


def outcome(result: ToolResult) -> dict[str, Any]:
    data = json.loads(result.content)
    assert set(data) == {"exit_code", "stdout", "stderr", "timed_out"}
    return data


async def read_fifo(path: Path, timeout: float = 10.0) -> str:
    """Read what a writer puts into the FIFO at ``path``, without blocking the loop."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    loop = asyncio.get_running_loop()
    ready = loop.create_future()
    try:
        loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
        try:
            await asyncio.wait_for(ready, timeout)
        finally:
            loop.remove_reader(fd)
        return os.read(fd, 4096).decode()
    finally:
        os.close(fd)


async def test_runs_in_the_workspace(shell: Registry, ctx: ToolContext, mode: str) -> None:
    result = await run(shell, ctx, "pwd; echo hello; echo oops >&2; echo $HOME")
    assert result.ok
    data = outcome(result)
    assert data["stdout"] == f"{home(ctx, mode)}\nhello\n{home(ctx, mode)}\n"
    assert data["stderr"] == "oops\n"
    assert data["exit_code"] == 0 and data["timed_out"] is False

    await run(shell, ctx, "echo made > here.txt")
    assert (ctx.workspace / "here.txt").read_text() == "made\n"


async def test_non_zero_exit_is_not_ok(shell: Registry, ctx: ToolContext) -> None:
    result = await run(shell, ctx, "echo partial; exit 3")
    assert not result.ok
    data = outcome(result)
    assert data["exit_code"] == 3 and data["stdout"] == "partial\n"
    result = await run(shell, ctx, "no-such-command-here")
    assert not result.ok and outcome(result)["exit_code"] == 127


async def test_stdin_is_empty(shell: Registry, ctx: ToolContext) -> None:
    result = await run(shell, ctx, "cat; echo done")
    assert result.ok and outcome(result)["stdout"] == "done\n"


async def test_secrets_are_not_passed_on(
    shell: Registry, ctx: ToolContext, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TELEGRAM_BOT_TOKEN", "123456:fake-telegram-secret")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-fake-openai-secret")
    monkeypatch.setenv("DISCORD_BOT_TOKEN", "fake-discord-secret")
    result = await run(shell, ctx, "env")
    assert result.ok
    env_lines = set(outcome(result)["stdout"].splitlines())
    for secret in ("fake-telegram-secret", "sk-fake-openai-secret", "fake-discord-secret"):
        assert secret not in outcome(result)["stdout"]
    assert f"HOME={home(ctx, mode)}" in env_lines
    names = {line.split("=", 1)[0] for line in env_lines}
    assert {"TELEGRAM_BOT_TOKEN", "OPENAI_API_KEY", "DISCORD_BOT_TOKEN"}.isdisjoint(names)
    assert set(command_env(ctx.workspace)) == {"PATH", "HOME", "LANG"}


async def test_timeout_stops_the_command(shell: Registry, ctx: ToolContext, mode: str) -> None:
    loop = asyncio.get_running_loop()
    start = loop.time()
    result = await run(shell, ctx, "echo before; sleep 30; echo after", timeout_s=1)
    elapsed = loop.time() - start
    assert not result.ok
    data = outcome(result)
    assert data["timed_out"] is True
    assert data["stdout"] == "before\n"
    assert data["exit_code"] == killed_by(signal.SIGTERM, mode)
    assert elapsed < 10


async def test_model_timeout_is_capped_by_config(ctx: ToolContext, mode: str) -> None:
    sandbox = Sandbox() if mode == "bwrap" else None
    shell = Registry(shell_tools(max_timeout_s=1, max_output_chars=500, kill_grace_s=1, sandbox=sandbox))
    loop = asyncio.get_running_loop()
    start = loop.time()
    result = await run(shell, ctx, "sleep 30", timeout_s=100)
    assert outcome(result)["timed_out"] is True
    assert loop.time() - start < 10


async def test_term_ignoring_group_is_killed(shell: Registry, ctx: ToolContext, mode: str) -> None:
    result = await run(shell, ctx, "trap '' TERM; sleep 30", timeout_s=0.5)
    data = outcome(result)
    assert data["timed_out"] is True and data["exit_code"] == killed_by(signal.SIGKILL, mode)


async def test_the_command_gets_sigterm_first(shell: Registry, ctx: ToolContext) -> None:
    """In the sandbox too the command itself is told to stop (not only bubblewrap killed)."""
    script = "trap 'echo stopping; rm -f lock; exit 3' TERM; touch lock; sleep 30 & wait"
    result = await run(shell, ctx, script, timeout_s=0.5)
    data = outcome(result)
    assert data["timed_out"] is True and data["exit_code"] == 3
    assert data["stdout"] == "stopping\n"
    assert not (ctx.workspace / "lock").exists()


def release(fifo: Path) -> None:
    """Let a command waiting in ``read go < fifo`` go on (O_RDWR: the open never blocks)."""
    fd = os.open(fifo, os.O_RDWR)
    try:
        os.write(fd, b"go\n")
    finally:
        os.close(fd)


async def test_background_children_die_with_the_call(
    shell: Registry, ctx: ToolContext, stray_pids: list[int]
) -> None:
    os.mkfifo(ctx.workspace / "go.fifo")
    # the child keeps the output pipe open: the call must still return when the shell exits
    for redirect in ("", " >/dev/null 2>&1"):
        mark = marker()
        task = asyncio.create_task(run(shell, ctx, f"sleep {mark}{redirect} & read go < go.fifo; echo done"))
        pids = await wait_for_marked(mark, stray_pids)
        release(ctx.workspace / "go.fifo")
        result = await task
        assert result.ok and outcome(result)["stdout"] == "done\n"
        for pid in pids:
            await wait_until_gone(pid)


async def test_cancelled_call_kills_the_group(
    shell: Registry, ctx: ToolContext, stray_pids: list[int]
) -> None:
    fifo = ctx.workspace / "ready.fifo"
    os.mkfifo(fifo)
    mark = marker()
    task = asyncio.create_task(run(shell, ctx, f"sleep {mark} & echo started > ready.fifo; wait"))
    assert await read_fifo(fifo) == "started\n"
    pids = await wait_for_marked(mark, stray_pids)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for pid in pids:
        await wait_until_gone(pid)


async def test_engine_timeout_while_running_kills_the_group(
    shell: Registry, ctx: ToolContext, stray_pids: list[int]
) -> None:
    # the engine applies Registry.timeout_s by cancelling the call (asyncio.wait_for)
    mark = marker()
    call = asyncio.ensure_future(run(shell, ctx, f"sleep {mark} & wait", timeout_s=30))
    pids = await wait_for_marked(mark, stray_pids)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(call, 0.2)
    for pid in pids:
        await wait_until_gone(pid)


async def test_a_command_that_cannot_start_names_no_host_path(shell: Registry, tmp_path: Path) -> None:
    """The model is not told where the daemon keeps its files, nor in what words Python failed."""
    missing = ToolContext(workspace=tmp_path / "gone", data_dir=tmp_path / "data")
    result = await run(shell, missing, "true")
    assert not result.ok
    assert str(tmp_path) not in result.content and "Error" not in result.content
    assert "could not be started" in json.loads(result.content)["error"]


async def test_output_is_capped_head_and_tail(shell: Registry, ctx: ToolContext) -> None:
    result = await run(
        shell,
        ctx,
        "printf START; head -c 100000 /dev/zero | tr '\\0' a; printf END; "
        "head -c 50000 /dev/zero | tr '\\0' e >&2",
    )
    assert result.ok
    data = outcome(result)
    stdout, stderr = data["stdout"], data["stderr"]
    assert stdout.startswith("STARTaaa") and stdout.endswith("aaaEND")
    assert len(stdout) < 2100 and len(stderr) < 2100
    kept = stdout.count("a") + len("STARTEND")
    assert f"[... {100_008 - kept} bytes cut ...]" in stdout
    assert "bytes cut" in stderr and stderr.strip("e\n").startswith("[...")


async def test_invalid_arguments(shell: Registry, ctx: ToolContext) -> None:
    for args in ({"command": ""}, {"command": "true", "timeout_s": 0}, {}):
        result = await shell.execute("run_command", json.dumps(args), ctx)
        assert not result.ok


def test_registry_timeout_leaves_room_for_the_kill() -> None:
    (built,) = shell_tools(max_timeout_s=30, kill_grace_s=2)
    assert built.timeout_s is not None and built.timeout_s > 30 + 2


async def test_built_registry_keeps_shell_results_valid_json(ctx: ToolContext) -> None:
    registry = build_registry(
        workspace=ctx.workspace, shell_enabled=True, shell_max_output_chars=20_000,
        max_result_chars=2000,
    )  # fmt: skip
    command = "head -c 50000 /dev/zero | tr '\\0' o; head -c 50000 /dev/zero | tr '\\0' e >&2"
    result = await run(registry, ctx, command)
    assert result.ok and len(result.content) <= 2000
    data = outcome(result)  # still valid JSON: the streams were capped, not the JSON
    assert "bytes cut" in data["stdout"] and "bytes cut" in data["stderr"]
