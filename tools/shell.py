"""The shell tool, ``run_command``: a trust decision, off by default.

**What this tool is.** ``run_command`` runs ``/bin/sh -c <command>`` as the daemon's own
user. A shell cannot be confined by looking at the command string: deny-lists of
"dangerous" commands are bypassed by ``. script``, ``| /bin/bash``, here-strings,
``su -c``, a newline as a separator and countless spellings (a substring deny-list of
``rm -rf /`` lets ``rm -fr /`` through). So there is
no deny-list here, and nothing pretends to be one. Enabling the tool means trusting
everyone who can talk to the entity with a shell as the daemon user, on the daemon's
machine, with its network. Only enable it for a daemon whose user and host you are willing
to hand over, and confine the daemon with the operating system: a dedicated user, systemd
sandboxing (``ProtectSystem=strict``, ``ProtectHome=yes``, ``ReadWritePaths=`` the
workspace, ``PrivateTmp=yes``, ``NoNewPrivileges=yes``, ``KillMode=control-group``), or a
container (see ``deploy/``).

**What the tool does do** (hygiene, not a sandbox):

* cwd is the workspace; the environment is reduced to ``PATH``, ``HOME`` (the workspace)
  and ``LANG``, so the daemon's secrets (``TELEGRAM_BOT_TOKEN``, ``DISCORD_BOT_TOKEN``,
  ``OPENAI_API_KEY``, ...) are not handed to the command (they can still be read from
  wherever the daemon reads them, e.g. its config file, if the user may read it);
* stdin is ``/dev/null``, so a command waiting for input ends instead of hanging;
* the command runs in a new session (its own process group). On timeout the group gets
  ``SIGTERM``, then ``SIGKILL`` after a grace period. When the shell exits, whatever is
  left of its group (background children) is killed too: nothing outlives the call. A
  process that starts its own session (``setsid``) escapes the group; only the OS
  (``KillMode=control-group``) catches that;
* a command whose daemon died (SIGKILL, a crash) would run on and land its effect after the
  restart, while the resumed turn is told the call was interrupted. So each running command
  is noted in ``<data_dir>/commands/<pgid>`` (with the leader's start time), and
  :func:`reap_orphaned_commands` kills what is left of those groups when the daemon starts
  (Linux ``/proc``; the start time guards against a reused pid);
* the timeout is the smaller of the model's ``timeout_s`` and the configured maximum;
* stdout and stderr are captured separately, each capped (head and tail kept), and
  reported as JSON ``{"exit_code", "stdout", "stderr", "timed_out"}``; the result is
  ``ok`` only for exit code 0 without timeout. ``exit_code`` is negative when a signal
  ended the shell (``-9`` for ``SIGKILL``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, Field

from bumblebot.core.toolkit import ToolContext, ToolKind, ToolResult

from .definition import Tool, make_tool

__all__ = [
    "COMMANDS_DIR",
    "CommandOutcome",
    "RunCommandArgs",
    "command_env",
    "reap_orphaned_commands",
    "run_shell",
    "shell_tools",
]

log = logging.getLogger(__name__)

#: Under the data directory: one file per running command, named by its process group.
COMMANDS_DIR = "commands"

_DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"


def command_env(workspace: Path) -> dict[str, str]:
    """The whole environment a command gets: ``PATH``, ``HOME`` = workspace, ``LANG``.

    Nothing else of the daemon's environment is passed on (no tokens, no API keys).
    """
    return {
        "PATH": os.environ.get("PATH") or _DEFAULT_PATH,
        "HOME": str(workspace),
        "LANG": os.environ.get("LANG") or "C.UTF-8",
    }


@dataclass(frozen=True, slots=True)
class CommandOutcome:
    """How a command ended.

    Args:
        exit_code: the shell's exit status; negative for a signal (``-9`` = ``SIGKILL``).
        stdout: captured standard output, capped (head and tail kept).
        stderr: captured standard error, capped the same way.
        timed_out: ``True`` when the command was stopped for running past its timeout.
    """

    exit_code: int | None
    stdout: str
    stderr: str
    timed_out: bool

    @property
    def ok(self) -> bool:
        """Exit code 0 and no timeout."""
        return self.exit_code == 0 and not self.timed_out

    def to_result(self) -> ToolResult:
        """The tool result: ``{"exit_code", "stdout", "stderr", "timed_out"}`` as JSON."""
        payload = {
            "exit_code": self.exit_code,
            "stdout": self.stdout,
            "stderr": self.stderr,
            "timed_out": self.timed_out,
        }
        return ToolResult(json.dumps(payload, ensure_ascii=False), ok=self.ok)


class _HeadTail:
    """Keeps the first and last bytes of a stream, counting what falls in between."""

    def __init__(self, limit: int) -> None:
        self._head_limit = limit - limit // 3
        self._tail_limit = limit // 3
        self._head = bytearray()
        self._tail = bytearray()
        self._total = 0

    def feed(self, data: bytes) -> None:
        self._total += len(data)
        room = self._head_limit - len(self._head)
        if room > 0:
            self._head += data[:room]
            data = data[room:]
        if data and self._tail_limit:
            self._tail += data
            excess = len(self._tail) - self._tail_limit
            if excess > 0:
                del self._tail[:excess]

    def text(self) -> str:
        cut = self._total - len(self._head) - len(self._tail)
        head = self._head.decode("utf-8", errors="replace")
        tail = self._tail.decode("utf-8", errors="replace")
        if cut <= 0:
            return (self._head + self._tail).decode("utf-8", errors="replace")
        return f"{head}\n[... {cut} bytes cut ...]\n{tail}"


class _CommandProtocol(asyncio.SubprocessProtocol):
    """Collects a command's output and tells when the shell has exited.

    ``exited`` is set when the shell process ends, even if background children still
    hold the output pipes (``Process.wait()`` would wait for the pipes too).
    """

    def __init__(self, limit: int) -> None:
        self.stdout = _HeadTail(limit)
        self.stderr = _HeadTail(limit)
        self.exited = asyncio.Event()
        self.pipes_closed = asyncio.Event()
        self._open_pipes = {1, 2}

    def pipe_data_received(self, fd: int, data: bytes | str) -> None:
        chunk = data.encode() if isinstance(data, str) else data
        (self.stdout if fd == 1 else self.stderr).feed(chunk)

    def pipe_connection_lost(self, fd: int, exc: Exception | None) -> None:
        self._open_pipes.discard(fd)
        if not self._open_pipes:
            self.pipes_closed.set()

    def process_exited(self) -> None:
        self.exited.set()


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is gone
        os.killpg(pgid, sig)


async def _wait(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` seconds for ``event``; ``True`` if it was set."""
    try:
        async with asyncio.timeout(timeout_s):
            await event.wait()
    except TimeoutError:
        return False
    return True


def _proc_stat(pid: str) -> tuple[int, int] | None:
    """``(process group, start time in clock ticks since boot)`` of ``pid`` from
    ``/proc/<pid>/stat`` (proc(5): fields 5 and 22), or ``None`` if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)", field 3 is index 0
    return int(fields[2]), int(fields[19])


def _note_command(ledger: Path | None, pid: int) -> Path | None:
    if ledger is None:
        return None
    stat = _proc_stat(str(pid))
    if stat is None:
        return None  # already gone
    try:
        ledger.mkdir(parents=True, exist_ok=True)
        path = ledger / str(pid)
        path.write_text(str(stat[1]))
    except OSError as exc:
        log.warning("cannot note running command %d in %s: %s", pid, ledger, exc)
        return None
    return path


def reap_orphaned_commands(ledger: Path) -> int:
    """Kill (``SIGKILL``) what is left of commands an earlier daemon process started and did not
    live to stop, as noted in ``ledger`` (``<data_dir>/commands``); empty the ledger.

    A process counts as the command's when it is in the noted process group, started no earlier
    than the group's leader did, and the leader (if alive) is the noted one: a pid reused since
    is left alone. Call it before any
    turn runs. Returns how many processes were killed; never raises for a missing ledger or a
    system without ``/proc`` (then only the ledger is emptied, and a warning logged).
    """
    try:
        notes = [p for p in ledger.iterdir() if p.name.isdigit()]
    except OSError:
        return 0
    if not notes:
        return 0
    groups: dict[int, int] = {}
    for note in notes:
        with contextlib.suppress(OSError, ValueError):
            groups[int(note.name)] = int(note.read_text().strip() or 0)
    for pgid, started in list(groups.items()):
        leader = _proc_stat(str(pgid))
        if leader is not None and leader[1] != started:
            del groups[pgid]  # the pid was reused: that group is someone else's
    killed = 0
    if not Path("/proc/self/stat").exists():
        log.warning("cannot check for commands left running by the last process (no /proc): %s", sorted(groups))
    else:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            stat = _proc_stat(entry.name)
            if stat is None or stat[0] not in groups or stat[1] < groups[stat[0]]:
                continue
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(entry.name), signal.SIGKILL)
                killed += 1
        if killed:
            log.warning("killed %d process(es) of commands left running by the last process", killed)
    for note in notes:
        with contextlib.suppress(OSError):
            note.unlink()
    return killed


async def run_shell(
    command: str,
    *,
    cwd: Path,
    timeout_s: float,
    max_output_chars: int,
    kill_grace_s: float = 2.0,
    env: dict[str, str] | None = None,
    ledger: Path | None = None,
) -> CommandOutcome:
    """Run ``/bin/sh -c command`` in its own process group and collect its output.

    Args:
        command: the shell command line.
        cwd: working directory (the workspace).
        timeout_s: seconds before the group gets ``SIGTERM`` (then ``SIGKILL`` after
            ``kill_grace_s``).
        max_output_chars: cap per stream, in bytes of output (about as many characters).
        kill_grace_s: seconds between ``SIGTERM`` and ``SIGKILL``, and the longest wait
            for the output pipes to close once the group is dead.
        env: the environment; defaults to :func:`command_env` of ``cwd``.
        ledger: where the running command is noted for :func:`reap_orphaned_commands`
            (``<data_dir>/commands``); ``None``: not noted.

    Returns:
        The outcome. Whatever is left of the process group is killed before returning,
        also when the call is cancelled.

    Raises:
        OSError: if the shell cannot be started (e.g. ``cwd`` does not exist).
        asyncio.CancelledError: if cancelled (after killing the group).
    """
    loop = asyncio.get_running_loop()
    protocol = _CommandProtocol(max_output_chars)
    starting = asyncio.ensure_future(
        loop.subprocess_exec(
            lambda: protocol,
            "/bin/sh",
            "-c",
            command,
            cwd=cwd,
            env=command_env(cwd) if env is None else env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
    )
    try:
        # shielded: a cancellation while asyncio is still wiring the pipes would leave
        # asyncio waiting for pipes that background children may hold open for minutes
        transport, _ = await asyncio.shield(starting)
    except asyncio.CancelledError:
        try:
            started, _ = await starting
        except Exception:
            pass  # the shell did not start: nothing to stop
        else:
            await _stop(started, protocol, kill_grace_s)
        raise
    note = _note_command(ledger, transport.get_pid())
    timed_out = False
    try:
        if not await _wait(protocol.exited, timeout_s):
            timed_out = True
            _signal_group(transport.get_pid(), signal.SIGTERM)
            await _wait(protocol.exited, kill_grace_s)
    finally:
        try:
            await _stop(transport, protocol, kill_grace_s)
        finally:
            if note is not None:
                with contextlib.suppress(OSError):
                    note.unlink()
    return CommandOutcome(
        transport.get_returncode(), protocol.stdout.text(), protocol.stderr.text(), timed_out
    )


async def _stop(
    transport: asyncio.SubprocessTransport, protocol: _CommandProtocol, grace_s: float
) -> None:
    """Kill what is left of the command's process group and close the transport."""
    _signal_group(transport.get_pid(), signal.SIGKILL)  # the shell leads its own group
    try:
        await _wait(protocol.exited, grace_s)
        await _wait(protocol.pipes_closed, grace_s)
    finally:
        transport.close()


class RunCommandArgs(BaseModel):
    command: str = Field(min_length=1, description="A /bin/sh command line")
    timeout_s: float | None = Field(
        None, gt=0, description="Seconds before the command is stopped (capped by config)"
    )


def shell_tools(
    *,
    max_timeout_s: float = 60.0,
    max_output_chars: int = 6000,
    kill_grace_s: float = 2.0,
) -> tuple[Tool, ...]:
    """The ``run_command`` tool, configured.

    Args:
        max_timeout_s: the longest a command may run, in seconds; also the default.
        max_output_chars: cap per stream (stdout, stderr), about characters.
        kill_grace_s: seconds between ``SIGTERM`` and ``SIGKILL`` on timeout.

    Returns:
        A one-tool tuple. Its registry timeout leaves room for the kill sequence, so the
        tool itself reports ``timed_out`` before the engine would cancel it.

    Raises:
        ValueError: for a non-positive limit.
    """
    if max_timeout_s <= 0 or max_output_chars <= 0 or kill_grace_s < 0:
        raise ValueError("shell limits must be positive")

    async def run_command(ctx: ToolContext, args: RunCommandArgs) -> ToolResult:
        timeout = min(args.timeout_s or max_timeout_s, max_timeout_s)
        outcome = await run_shell(
            args.command,
            cwd=ctx.workspace,
            timeout_s=timeout,
            max_output_chars=max_output_chars,
            kill_grace_s=kill_grace_s,
            ledger=ctx.data_dir / COMMANDS_DIR,
        )
        return outcome.to_result()

    description = (
        "Run a shell command (/bin/sh -c) in the workspace and get its exit code, stdout "
        f"and stderr as JSON. It is stopped after timeout_s seconds (at most "
        f"{max_timeout_s:g}); background processes do not survive the call; stdin is empty."
    )
    built = make_tool(
        run_command,
        kind=ToolKind.WORK,
        description=description,
        timeout_s=max_timeout_s + 2 * kill_grace_s + 5,
        brief="Run a shell command in the workspace.",
    )
    return (built,)
