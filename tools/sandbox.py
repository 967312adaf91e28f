"""The bubblewrap sandbox ``run_command`` runs in (``tools.shell.sandbox: bwrap``).

:class:`Sandbox` builds the ``bwrap`` command line around one shell command; :func:`probe`
tries it once (is bubblewrap there, may it create its namespaces here?) and says why not.

**Inside the sandbox** (``bwrap(1)``):

* the file system is a fresh, read-only root holding ``/usr``, ``/bin``, ``/sbin`` and ``/lib*``
  read-only, a handful of world-readable ``/etc`` files (:data:`ETC_FILES`: ``passwd``,
  ``group``, name resolution, the CA certificates, ``alternatives``, the loader cache, the
  time zone; nothing else of ``/etc``, so not the daemon's config or ``.env``, nor a TLS
  private key), a fresh, read-only ``/proc`` of its own PID namespace, a minimal, read-only
  ``/dev``, a private ``/tmp`` and ``/dev/shm`` (each a tmpfs of ``tmp_mb``: writing more
  fails with "No space left on device"), and the workspace, read-write, at
  ``/workspace`` (the working directory and ``$HOME``). Nothing else of the host is there: not
  the data directory (``../bumblebot.db`` of the workspace does not exist inside), not
  ``/home``, ``/root``, ``/var``, ``/run`` or ``/opt``;
* its own PID namespace: the daemon and every other process of the host are invisible (no
  ``/proc/<daemon pid>/environ``); its own IPC and UTS namespaces; no network but a private
  loopback unless ``tools.shell.network`` (then the host's network, loopback services and
  abstract unix sockets included);
* ``--die-with-parent``: the sandbox is killed when the daemon dies; ``--new-session``: the
  command is in a session of its own (no controlling terminal to push input into);
* limits per process, set by ``prlimit(1)`` (util-linux) between bwrap and the shell, so no
  ``preexec_fn`` runs in the daemon: address space (``memory_mb``), CPU seconds (``cpu_s``),
  no core files, and ``RLIMIT_NPROC`` (``max_processes``).

**The process limit.** ``RLIMIT_NPROC`` counts the tasks (processes and threads) of the
command's real user, and the kernel does not apply it to root (uid 0, even mapped from inside
a user namespace: ``--uid`` inside ``--unshare-user`` does not help) nor to a process holding
``CAP_SYS_ADMIN`` or ``CAP_SYS_RESOURCE``. So:

* a daemon running as an ordinary user (the systemd service) runs bubblewrap unprivileged with
  ``--unshare-user``; since Linux 5.14 the count is kept per user namespace, so each command
  has its own budget, apart from the daemon's threads and other commands (older kernels
  count every process of the user, the daemon's threads included);
* a daemon running as root runs bubblewrap privileged (no user namespace), and the command
  drops to a throwaway uid (random, from :data:`ROOT_UID_BASE`) and the ``nogroup`` gid with
  ``setpriv(1)``, keeping only ``CAP_DAC_OVERRIDE`` and ``CAP_FOWNER`` so that it can still
  read and write the root-owned workspace. Everything else is mounted read-only, so they
  write no further than the workspace, ``/tmp`` and ``/dev/shm``; but they read past any
  file mode, so only files every user may read are mounted from ``/etc`` (the command can read
  all of ``/usr``). Files it creates belong to that uid. Its own uid gives each command its
  own process budget.

Either way, a fork bomb stops at ``max_processes``, and the wall-clock timeout of
:func:`tools.shell.run_shell` then kills the whole PID namespace (killing its pid 1 kills every
process in it, and no new one can be made).

**Memory.** ``memory_mb`` is ``RLIMIT_AS``, per process: the worst case of one command is
about ``max_processes`` x ``memory_mb`` plus ``/tmp`` and ``/dev/shm`` (2 x ``tmp_mb``), and
memory held outside any address space (an unmapped ``memfd``, a detached System V shared
memory segment, kernel buffers) is not counted at all. A cap on the total needs a memory
cgroup, which bubblewrap does not set up and an unprivileged daemon cannot create without a
delegated cgroup; under systemd, ``MemoryMax=`` on the unit caps the daemon and its commands
together (tmpfs pages count against the cgroup of whoever wrote them).

**What it does not do**: it does not limit disk use in the workspace, the total memory of
all processes together (above), nor network traffic when ``tools.shell.network`` is on; it
filters no system calls beyond bubblewrap's own; the command can read every file of
``/usr``. The daemon's files outside the workspace, its secrets and its processes are out of
reach.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "ETC_FILES",
    "ROOT_UID_BASE",
    "WORKSPACE",
    "Sandbox",
    "probe",
]

#: Where the workspace is inside the sandbox (also the working directory and ``$HOME``).
WORKSPACE = "/workspace"

#: The only parts of the host's ``/etc`` the sandbox sees (those that exist), read-only, each
#: world-readable by convention. Of the TLS folders only the CA certificates and OpenSSL's
#: config (Debian's ``/etc/ssl/certs``, Fedora's ``/etc/pki/tls/certs`` and
#: ``/etc/pki/ca-trust/extracted``), never ``/etc/ssl/private``, ``/etc/pki/tls/private`` or
#: the rest of ``/etc/pki`` (subscription keys, NSS databases): a command run by a root daemon
#: keeps ``CAP_DAC_OVERRIDE``, so a file's mode would not keep it from a key bound here.
ETC_FILES = (
    "passwd", "group", "nsswitch.conf", "hosts", "host.conf", "resolv.conf", "gai.conf",
    "services", "protocols",
    "ssl/certs", "ssl/cert.pem", "ssl/ca-bundle.pem", "ssl/openssl.cnf",
    "pki/tls/certs", "pki/tls/cert.pem", "pki/tls/openssl.cnf", "pki/ca-trust/extracted",
    "pki/java/cacerts", "crypto-policies/config", "crypto-policies/back-ends",
    "alternatives", "ld.so.cache", "ld.so.conf", "ld.so.conf.d",
    "localtime", "timezone", "mime.types", "os-release",
)  # fmt: skip

_ETC_FOLDERS = sorted({str(Path("/etc", name).parent) for name in ETC_FILES})

#: Top-level system directories bound read-only when present (on a merged-/usr system the
#: links point into ``/usr``, which is bound as well).
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")

#: As root, a command runs as ``ROOT_UID_BASE + n`` (n random below ``2**20``): uids no account
#: uses, far above the ranges distributions and systemd hand out to users and containers.
ROOT_UID_BASE = 0x7A000000
_NOGROUP = 65534

_PROBE_TIMEOUT_S = 10.0
_probed: dict[tuple[Sandbox, Path], str | None] = {}


@dataclass(frozen=True, slots=True)
class Sandbox:
    """How ``run_command`` confines a command.

    Args:
        bwrap: the bubblewrap binary: a name looked up in ``PATH``, or a path.
        network: share the host's network (default: a private loopback only).
        memory_mb: address space of each process, MiB (``RLIMIT_AS``).
        tmp_mb: size of each of ``/tmp`` and ``/dev/shm`` (tmpfs, held in memory), MiB.
        max_processes: processes and threads of the command at once (``RLIMIT_NPROC``).
        cpu_s: CPU seconds of each process (``RLIMIT_CPU``).
    """

    bwrap: str = "bwrap"
    network: bool = False
    memory_mb: int = 1024
    tmp_mb: int = 512
    max_processes: int = 128
    cpu_s: int = 60

    def argv(
        self, command: str, workspace: Path, *, info_fd: int | None = None, root: bool | None = None
    ) -> list[str]:
        """The command line running ``/bin/sh -c command`` in the sandbox, ``workspace`` at
        :data:`WORKSPACE`.

        Args:
            info_fd: a file descriptor bwrap writes ``{"child-pid": ...}`` to (its pid 1, as
                the host sees it: the leader of the sandbox's session), then closes.
            root: build it for a daemon running as root (default: whether this process is).
        """
        if root is None:
            root = os.geteuid() == 0
        argv = [self.bwrap, "--die-with-parent", "--new-session", "--unshare-pid", "--unshare-ipc",
                "--unshare-uts", "--unshare-cgroup-try"]  # fmt: skip
        if not root:
            argv.append("--unshare-user")
        if not self.network:
            argv.append("--unshare-net")
        if info_fd is not None:
            argv += ["--info-fd", str(info_fd)]
        argv += ["--ro-bind", "/usr", "/usr"]
        for path in _SYSTEM_DIRS[1:]:
            argv += ["--ro-bind-try", path, path]
        for folder in _ETC_FOLDERS:  # bwrap would make the folders of a bound file 0700
            argv += ["--perms", "0755", "--dir", folder]
        for name in ETC_FILES:
            argv += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
        tmp = str(self.tmp_mb * 1024 * 1024)
        # /dev read-only: bwrap's /dev is a tmpfs of its own, unbounded, where only /dev/shm
        # (sized) and the device nodes (bound) are for writing
        argv += ["--proc", "/proc", "--dev", "/dev", "--size", tmp, "--tmpfs", "/dev/shm",
                 "--size", tmp, "--tmpfs", "/tmp",
                 "--bind", str(workspace), WORKSPACE, "--chdir", WORKSPACE,
                 "--remount-ro", "/proc", "--remount-ro", "/dev", "--remount-ro", "/"]  # fmt: skip
        if root:
            for cap in ("CAP_SETUID", "CAP_SETGID", "CAP_DAC_OVERRIDE", "CAP_FOWNER"):
                argv += ["--cap-add", cap]
            caps = "-all,+dac_override,+fowner"
            uid = ROOT_UID_BASE + random.randrange(2**20)
            argv += ["--", "setpriv", f"--reuid={uid}", f"--regid={_NOGROUP}", "--clear-groups",
                     f"--inh-caps={caps}", f"--ambient-caps={caps}", f"--bounding-set={caps}"]  # fmt: skip
        else:
            argv.append("--")
        memory = self.memory_mb * 1024 * 1024
        argv += ["prlimit", f"--as={memory}", f"--cpu={self.cpu_s}", f"--nproc={self.max_processes}",
                 "--core=0", "--", "/bin/sh", "-c", command]  # fmt: skip
        return argv

    def scrub(self, text: str, workspace: Path) -> str:
        """``text`` (bubblewrap's own messages) with the host path of ``workspace`` replaced by
        :data:`WORKSPACE`."""
        return text.replace(str(workspace), WORKSPACE)


async def probe(sandbox: Sandbox, workspace: Path) -> str | None:
    """Run a trivial command in ``sandbox`` once; ``None`` if it works, else why not.

    The answer is kept for this process (per sandbox and workspace): the daemon and
    ``bumblebot check`` ask once at start. Creates ``workspace`` if missing; never raises for a
    missing or failing bubblewrap.
    """
    key = (sandbox, workspace)
    if key not in _probed:
        _probed[key] = await _try(sandbox, workspace)
    return _probed[key]


async def _try(sandbox: Sandbox, workspace: Path) -> str | None:
    hint = "install bubblewrap (Debian: apt install bubblewrap) or set tools.shell.bwrap"
    try:
        await asyncio.to_thread(workspace.mkdir, parents=True, exist_ok=True)
        proc = await asyncio.create_subprocess_exec(
            *sandbox.argv("exit 0", workspace), cwd=workspace, env={"PATH": "/usr/bin:/bin"},
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE, start_new_session=True,
        )  # fmt: skip
    except FileNotFoundError:
        return f"bubblewrap ({sandbox.bwrap}) was not found; {hint}"
    except OSError as exc:
        return f"bubblewrap ({sandbox.bwrap}) cannot be started ({exc.strerror}); {hint}"
    try:
        _, err = await asyncio.wait_for(proc.communicate(), _PROBE_TIMEOUT_S)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        return f"a trial run of bubblewrap did not end within {_PROBE_TIMEOUT_S:g} s"
    if proc.returncode == 0:
        return None
    lines = sandbox.scrub(err.decode(errors="replace"), workspace).strip().splitlines()
    said = lines[-1] if lines else f"exit status {proc.returncode}"
    return (f"a trial run of bubblewrap failed: {said} (it needs user namespaces, or root; "
            "under systemd see docs/tools.md, The shell sandbox)")  # fmt: skip
