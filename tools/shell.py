"""The shell tool, ``run_command``: off by default; on, it runs in a bubblewrap sandbox.

**What the sandbox guarantees** (``tools.shell.sandbox: bwrap``, the default; the details and
the reasons are in :mod:`tools.sandbox`): the command sees the workspace, read-write, at
``/workspace`` (its working directory and ``$HOME``), a private ``/tmp`` and ``/dev/shm`` of
``tmp_mb`` each, the system's programs and libraries read-only and a few world-readable
``/etc`` files (no TLS private key), and nothing else of the host: not
the data directory (the database, the knowledge files, the other chats' state), not the
daemon's config or secrets, not the daemon's or any other host process (its own PID
namespace), no network but its own loopback unless ``tools.shell.network``. Each process is
limited in address space, CPU seconds and, for the command as a whole, in processes and
threads, so a fork bomb or a runaway allocation fails inside the sandbox while the daemon goes
on. The sandbox dies with the daemon.

**What it does not guarantee**: the workspace itself is the command's to read, change or fill
(every chat the bot serves shares it, see ``docs/security.md``); disk use, the memory of all
processes together (the address-space limit is per process) and, with
``tools.shell.network``, network use are not limited; a kernel
bug can break any namespace sandbox. Turning the shell on still hands that much to everyone
who can talk to the entity. If bubblewrap is missing or cannot run (no user namespaces), the
tool is not offered and ``bumblebot check`` says why. ``tools.shell.sandbox: off`` runs
``/bin/sh -c`` unconfined, as the daemon's user, with everything that user can reach (its
files, ``/proc/<daemon pid>/environ``, the network): a trust decision; then confine the daemon
itself (a dedicated user, the systemd unit's sandboxing, see ``deploy/``). No deny-list of
"dangerous" commands is kept in either mode: a shell cannot be confined by looking at the
command string.

**What the tool does in both modes:**

* cwd is the workspace; the environment is reduced to ``PATH``, ``HOME`` (the workspace)
  and ``LANG``, so the daemon's secrets (``TELEGRAM_BOT_TOKEN``, ``OPENAI_API_KEY``, ...) are not handed to the
  command;
* stdin is ``/dev/null``, so a command waiting for input ends instead of hanging;
* the command runs in a new session (its own process group). On timeout the command gets
  ``SIGTERM``, then ``SIGKILL`` after a grace period; when the shell exits, whatever is left
  of it (background children) is killed too: nothing outlives the call. Unconfined, the
  signals go to the shell's process group (a process that starts its own session escapes it;
  only the OS, ``KillMode=control-group``, catches that); in the sandbox, ``SIGTERM`` goes to
  the sandbox's session and ``SIGKILL`` to bubblewrap's pid 1, whose death ends every process
  of the PID namespace, whatever its session;
* a command whose daemon died (SIGKILL, a crash) could run on and land its effect after the
  restart, while the resumed turn is told the call was interrupted. So each running command
  is noted in ``<data_dir>/commands/<pgid>`` (with the leader's start time), and
  :func:`reap_orphaned_commands` kills what is left of those groups when the daemon starts
  (Linux ``/proc``; the start time guards against a reused pid). A sandbox dies with the
  daemon on its own (``--die-with-parent``); the ledger catches one cut off while starting;
* the timeout is the smaller of the model's ``timeout_s`` and the configured maximum;
* stdout and stderr are captured separately, each capped (head and tail kept), and
  reported as JSON ``{"exit_code", "stdout", "stderr", "timed_out"}``; the result is
  ``ok`` only for exit code 0 without timeout. ``exit_code`` is negative when a signal
  ended the shell (``-9`` for ``SIGKILL``) unconfined; in the sandbox bubblewrap reports a
  shell ended by signal n as ``128 + n``, as shells do (``137`` for ``SIGKILL``). Messages
  name the workspace as ``/workspace``, never by its path on the host.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path

from pydantic import BaseModel, Field

from bumblebot.core.toolkit import ToolContext, ToolKind, ToolResult

from .definition import Tool, make_tool
from .sandbox import WORKSPACE, Sandbox

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


def command_env(workspace: Path, *, sandboxed: bool = False) -> dict[str, str]:
    """The whole environment a command gets: ``PATH``, ``HOME`` = workspace, ``LANG``.

    Nothing else of the daemon's environment is passed on (no tokens, no API keys).
    ``sandboxed``: ``HOME`` is the workspace as the sandbox sees it and ``PATH`` the standard
    one (the daemon's may name host directories the sandbox does not have).
    """
    return {
        "PATH": _DEFAULT_PATH if sandboxed else os.environ.get("PATH") or _DEFAULT_PATH,
        "HOME": WORKSPACE if sandboxed else str(workspace),
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


class _SandboxLeader:
    """The host pid of bubblewrap's pid 1, which leads the sandbox's session, as bwrap reports
    it on its ``--info-fd`` (``{"child-pid": ...}``), read without waiting when needed."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._data = b""
        self.pid: int | None = None

    def read(self) -> int | None:
        """The pid, once bwrap has written it (it does before the sandbox starts)."""
        if self.pid is None and self._fd >= 0:
            with contextlib.suppress(OSError):  # BlockingIOError: nothing (more) written yet
                while chunk := os.read(self._fd, 4096):
                    self._data += chunk
            found = re.search(rb'"child-pid"\s*:\s*(\d+)', self._data)
            self.pid = int(found.group(1)) if found else None
        return self.pid

    def signal(self, sig: signal.Signals) -> None:
        """Send ``sig`` to the sandbox's session (its pid 1 takes only ``SIGKILL``, which ends
        the whole PID namespace)."""
        if (pid := self.read()) is not None:
            _signal_group(pid, sig)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


async def run_shell(
    command: str,
    *,
    cwd: Path,
    timeout_s: float,
    max_output_chars: int,
    kill_grace_s: float = 2.0,
    env: dict[str, str] | None = None,
    ledger: Path | None = None,
    sandbox: Sandbox | None = None,
) -> CommandOutcome:
    """Run ``/bin/sh -c command`` in a session of its own, in ``sandbox`` if given, and
    collect its output.

    Args:
        command: the shell command line.
        cwd: working directory (the workspace; in the sandbox, bound at ``/workspace``).
        timeout_s: seconds before the command gets ``SIGTERM`` (then ``SIGKILL`` after
            ``kill_grace_s``).
        max_output_chars: cap per stream, in bytes of output (about as many characters).
        kill_grace_s: seconds between ``SIGTERM`` and ``SIGKILL``, and the longest wait
            for the output pipes to close once the command is dead.
        env: the environment; defaults to :func:`command_env` of ``cwd``.
        ledger: where the running command is noted for :func:`reap_orphaned_commands`
            (``<data_dir>/commands``); ``None``: not noted.
        sandbox: run it in this bubblewrap sandbox (:mod:`tools.sandbox`); ``None``: unconfined.

    Returns:
        The outcome. Whatever is left of the command is killed before returning, also when
        the call is cancelled.

    Raises:
        OSError: if the shell (or bubblewrap) cannot be started (e.g. ``cwd`` does not exist).
        asyncio.CancelledError: if cancelled (after killing the command).
    """
    loop = asyncio.get_running_loop()
    protocol = _CommandProtocol(max_output_chars)
    leader: _SandboxLeader | None = None
    pass_fds: tuple[int, ...] = ()
    argv = ["/bin/sh", "-c", command]
    if sandbox is not None:
        info, pass_fds = _info_pipe()
        leader = _SandboxLeader(info)
        argv = sandbox.argv(command, cwd, info_fd=pass_fds[0])
    starting = asyncio.ensure_future(
        loop.subprocess_exec(
            lambda: protocol,
            *argv,
            cwd=cwd,
            env=command_env(cwd, sandboxed=sandbox is not None) if env is None else env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            pass_fds=pass_fds,
        )
    )
    try:
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
                await _stop(started, protocol, leader, kill_grace_s)
            raise
        finally:
            for fd in pass_fds:
                os.close(fd)  # bwrap has its copy (or failed to start)
        outcome = await _supervise(transport, protocol, leader, timeout_s, kill_grace_s, ledger)
    finally:
        if leader is not None:
            leader.close()
    if sandbox is None:
        return outcome
    return replace(outcome, stdout=sandbox.scrub(outcome.stdout, cwd), stderr=sandbox.scrub(outcome.stderr, cwd))


def _info_pipe() -> tuple[int, tuple[int]]:
    """A pipe for bwrap's ``--info-fd``: the read end (non-blocking) and the write end to pass."""
    read, write = os.pipe()
    os.set_blocking(read, False)
    return read, (write,)


async def _supervise(
    transport: asyncio.SubprocessTransport,
    protocol: _CommandProtocol,
    leader: _SandboxLeader | None,
    timeout_s: float,
    kill_grace_s: float,
    ledger: Path | None,
) -> CommandOutcome:
    """Wait for the started command, stop it on timeout, and say how it ended."""
    note = _note_command(ledger, transport.get_pid())
    timed_out = False
    try:
        if not await _wait(protocol.exited, timeout_s):
            timed_out = True
            if leader is None:
                _signal_group(transport.get_pid(), signal.SIGTERM)
            else:  # not bwrap itself: its death would kill the sandbox at once
                leader.signal(signal.SIGTERM)
            await _wait(protocol.exited, kill_grace_s)
    finally:
        try:
            await _stop(transport, protocol, leader, kill_grace_s)
        finally:
            if note is not None:
                with contextlib.suppress(OSError):
                    note.unlink()
    return CommandOutcome(
        transport.get_returncode(), protocol.stdout.text(), protocol.stderr.text(), timed_out
    )


async def _stop(
    transport: asyncio.SubprocessTransport,
    protocol: _CommandProtocol,
    leader: _SandboxLeader | None,
    grace_s: float,
) -> None:
    """Kill what is left of the command and close the transport.

    In the sandbox: first its pid 1 (the kernel then kills every process of the namespace, and
    bwrap reports ``128 + 9``), then bwrap's group, then pid 1 once more: a sandbox that had
    not been set up at the first kill was in bwrap's group until it started its session, and
    bwrap has reported it by now.
    """
    running = not protocol.exited.is_set()
    try:
        if leader is not None and running:
            leader.signal(signal.SIGKILL)
            await _wait(protocol.exited, grace_s)
        _signal_group(transport.get_pid(), signal.SIGKILL)  # the shell or bwrap leads its own group
        if leader is not None and running:
            leader.signal(signal.SIGKILL)
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
    sandbox: Sandbox | None = None,
) -> tuple[Tool, ...]:
    """The ``run_command`` tool, configured.

    Args:
        max_timeout_s: the longest a command may run, in seconds; also the default.
        max_output_chars: cap per stream (stdout, stderr), about characters.
        kill_grace_s: seconds between ``SIGTERM`` and ``SIGKILL`` on timeout.
        sandbox: run commands in this bubblewrap sandbox (check first that it works:
            :func:`tools.sandbox.probe`); ``None``: unconfined.

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
        try:
            outcome = await run_shell(
                args.command,
                cwd=ctx.workspace,
                timeout_s=timeout,
                max_output_chars=max_output_chars,
                kill_grace_s=kill_grace_s,
                ledger=ctx.data_dir / COMMANDS_DIR,
                sandbox=sandbox,
            )
        except OSError as exc:  # its text would name host paths
            return ToolResult.error(f"the command could not be started: {exc.strerror or 'system error'}")
        return outcome.to_result()

    description = (
        "Run a shell command (/bin/sh -c) in the workspace and get its exit code, stdout "
        f"and stderr as JSON. It is stopped after timeout_s seconds (at most "
        f"{max_timeout_s:g}); background processes do not survive the call; stdin is empty."
    )
    if sandbox is not None:
        description += (
            f" It runs in a sandbox: the workspace is {WORKSPACE} (also $HOME), /tmp is private "
            f"({sandbox.tmp_mb} MiB) and emptied after each call, the rest of the system is read-only"
            + ("." if sandbox.network else ", and there is no network.")
        )
    built = make_tool(
        run_command,
        kind=ToolKind.WORK,
        description=description,
        timeout_s=max_timeout_s + 2 * kill_grace_s + 5,
        brief="Run a shell command in the workspace.",
    )
    return (built,)
