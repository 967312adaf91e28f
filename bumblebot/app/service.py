"""``bumblebot service install``: a hardened systemd unit for the current installation.

:func:`plan_install` works out the paths of the installation it runs from (the venv of
``sys.executable`` and the ``bumblebot`` console script next to it, the config file, its
``data_dir``), :func:`render_unit` writes the unit text, and :func:`install` writes the unit,
creates the state directory and returns what to print, including the next commands. Nothing
here runs ``systemctl``.

The standard system install (what ``deploy/bumblebot.service`` holds)
---------------------------------------------------------------------

* service user: ``bumblebot``, a system user with no login shell, home ``/var/lib/bumblebot``;
* venv: ``/opt/bumblebot``, root's, mode 0755: the service reads it and cannot change it;
* entry point: ``/opt/bumblebot/bin/bumblebot`` (``ExecStart=… run --config …``);
* config: ``/etc/bumblebot/bumblebot.yaml``, ``root:bumblebot`` 0640, in ``/etc/bumblebot``
  (``root:bumblebot`` 0750); it sets ``data_dir: /var/lib/bumblebot``;
* secrets: ``/etc/bumblebot/.env``, ``root:root`` 0600 (systemd reads it, see below);
* data (``data_dir``, also the working directory and ``$HOME``): ``/var/lib/bumblebot``,
  ``bumblebot`` 0700, made by ``StateDirectory=bumblebot``;
* unit: ``/etc/systemd/system/bumblebot.service``, root 0644.

Steps, as root, on a machine with Python ≥ 3.11 and its ``venv`` module (Debian and Ubuntu:
``apt install python3 python3-venv``)::

    # 1. a wheel, built by whoever owns the clone (or skip it: install `bumblebot` from the package index)
    cd /path/to/bumblebot && python3 -m venv /tmp/bb-build && /tmp/bb-build/bin/pip wheel --no-deps -w dist .
    # 2. the service user, the venv and the package
    useradd --system --user-group --home-dir /var/lib/bumblebot --shell /usr/sbin/nologin bumblebot
    python3 -m venv /opt/bumblebot
    /opt/bumblebot/bin/pip install /path/to/bumblebot/dist/bumblebot-*.whl
    # 3. config and secrets
    install -d -m 0750 -g bumblebot /etc/bumblebot
    install -m 0640 -g bumblebot bumblebot.yaml /etc/bumblebot/bumblebot.yaml   # data_dir: /var/lib/bumblebot
    install -m 0600 .env /etc/bumblebot/.env
    # 4. the unit and the state directory, then start it
    /opt/bumblebot/bin/bumblebot service install --config /etc/bumblebot/bumblebot.yaml
    systemctl daemon-reload && systemctl enable --now bumblebot
    systemctl status bumblebot; journalctl -u bumblebot -f

Upgrade: ``/opt/bumblebot/bin/pip install --upgrade <new wheel>`` (a wheel rebuilt with the
same version number also needs ``--force-reinstall --no-deps``), then ``systemctl restart
bumblebot``. The venv is root's; the service user cannot write it, nor the config.

Why the secrets can be root-only: systemd reads ``EnvironmentFile=`` itself, in the service
manager (as root, on the host's file system, before the sandbox and ``User=`` apply;
systemd.exec(5), ``EnvironmentFile=``), and hands the values to the daemon as environment
variables. The leading ``-`` in ``EnvironmentFile=-/etc/bumblebot/.env`` makes a missing file
fine. The working directory is the state directory, so the daemon never tries to open a
``./.env`` it may not read. systemd's parser is simpler than python-dotenv's: plain
``NAME=value`` lines (``#`` comments, optional quotes) mean the same to both; no ``${VAR}``
expansion.

The unit
--------

``Type=notify`` with ``NotifyAccess=main``: the daemon sends ``READY=1`` once every enabled
adapter is connected and ``STOPPING=1`` when it begins to stop (``bumblebot/app/systemd.py``);
only the main process may, so a shell-tool command cannot speak for it. ``WatchdogSec=30``:
the daemon pings every 15 s from its event loop; a loop blocked 30 s is hung (no legitimate
stall comes near that: ``bumblebot/app/watchdog.py`` already logs every stall over 0.5 s), and
systemd kills it with SIGABRT and restarts it (``Restart=on-failure``) 10 s later, so chats
come back within about 40 s. ``RestartPreventExitStatus=2``: a configuration error does not
heal by restarting. ``TimeoutStopSec=45``: in-flight turns get ``engine.shutdown_grace_s``
(30 s) to finish, then ``KillMode=control-group`` kills whatever is left, shell-tool commands
included. ``PYTHONFAULTHANDLER=1``: the watchdog's SIGABRT makes Python print every thread's
stack to the journal before it dies, which shows where the loop was stuck.

Sandboxing (system units): the file system is read-only (``ProtectSystem=strict``) except the
data directory (``StateDirectory=`` when it is under ``/var/lib``, else ``ReadWritePaths=``);
``/home``, ``/root`` and ``/run/user`` are hidden (``ProtectHome=yes``; ``read-only`` when the
installation itself lives there, symbolic links followed); no devices, kernel tunables,
modules, logs, clock or hostname; no capabilities, set-uid files, realtime scheduling or
namespaces; only IPv4, IPv6 and unix sockets; files created private (``UMask=0077``). Not used: ``MemoryDenyWriteExecute=``
(breaks libffi callbacks and JITs that shell commands may run) and ``SystemCallFilter=``
(not tested against every tool command). User units (``systemctl --user``) keep only what an
unprivileged manager can apply without user namespaces: the seccomp-based settings and
``NoNewPrivileges=``; no ``User=``, ``WantedBy=default.target``, and ``loginctl enable-linger``
keeps them running without a login session.

What a system unit's service could not reach is found before anything is written
(``bumblebot/app/unit_reach.py``, :attr:`InstallPlan.refusals`): an entry point, a Python (the
one of its ``#!`` line and the one that resolves to), the ``bumblebot`` code when the venv does
not hold it (an editable install), a config or a data directory under ``/tmp``
(``PrivateTmp=yes``), in a home the unit hides (a venv in ``/opt`` made from a pyenv Python in
``/root``: ``ProtectHome=yes``), or behind a directory the service user may not search (a clone
in ``/root``, mode 0700), as named or where symbolic links lead. ``service install`` then
writes nothing and says which path, which setting or directory, and what to do.
``ProtectHome=read-only`` is chosen when the entry point, config or data directory (or where
their links lead) is in a home.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from bumblebot.app.unit_reach import (
    HOME_ROOTS,
    RUN_FIX,
    Need,
    Who,
    blocked_at,
    pythons,
    refusals,
    ways,
)
from bumblebot.core.errors import BumblebotError

__all__ = [
    "CONFIG_PATH",
    "ENV_FILE",
    "SERVICE_USER",
    "STATE_DIR",
    "SYSTEM_UNIT_DIR",
    "UNIT_NAME",
    "VENV",
    "WATCHDOG_S",
    "InstallError",
    "InstallPlan",
    "install",
    "plan_install",
    "render_unit",
]

UNIT_NAME = "bumblebot.service"
#: Where a system unit goes; a user unit goes to ``~/.config/systemd/user``.
SYSTEM_UNIT_DIR = Path("/etc/systemd/system")
#: The standard system install (module docstring).
SERVICE_USER = "bumblebot"
VENV = Path("/opt/bumblebot")
CONFIG_PATH = Path("/etc/bumblebot/bumblebot.yaml")
ENV_FILE = Path("/etc/bumblebot/.env")
STATE_DIR = Path("/var/lib/bumblebot")
#: ``WatchdogSec=``, seconds; the daemon pings every half of it.
WATCHDOG_S = 30

_STATE_ROOT = Path("/var/lib")
_UNSAFE = set(" \t\n\r\"'\\;") | {chr(c) for c in range(32)}


class InstallError(BumblebotError):
    """A unit or directory could not be planned or written.

    Args:
        path: the file or directory involved.
        message: the whole message, naming ``path`` and what to do.
    """

    def __init__(self, path: Path, message: str) -> None:
        self.path = path
        super().__init__(message)


@dataclass(frozen=True, slots=True)
class InstallPlan:
    """What :func:`install` writes where, and what to print after (from :func:`plan_install`).

    ``unit_path``/``unit_text``: the unit file and its contents. ``state_dir``: the data
    directory to create (mode 0700), ``owner`` the user to give it to (when run as root).
    ``exec_path``/``config_path``: the entry point and config file the unit runs.
    ``commands``: the next commands, in order. ``notes``: problems found on the way (a
    missing service user, files it cannot read), each with its fix. ``refusals``: why the
    service could not run as the unit says (an entry point, Python, config or data directory
    its sandbox hides or its user cannot reach; ``bumblebot/app/unit_reach.py``), each with
    what to do: ``service install`` writes nothing then.
    """

    unit_path: Path
    unit_text: str
    state_dir: Path
    owner: str | None
    user_mode: bool
    exec_path: Path
    config_path: Path
    commands: tuple[str, ...]
    notes: tuple[str, ...] = field(default=())
    refusals: tuple[str, ...] = field(default=())


def _checked(path: Path, what: str) -> str:
    """``path`` as written in the unit: absolute, ``%`` doubled (systemd specifiers).

    Raises:
        InstallError: it is relative or holds a space, quote, backslash, ``;`` or a control
            character, which the unit's settings would split or unescape.
    """
    text = str(path)
    if not path.is_absolute():
        raise InstallError(path, f"the {what} must be an absolute path for the systemd unit, not {text}")
    if _UNSAFE & set(text):
        shown = text if text.isprintable() else repr(text)
        raise InstallError(
            path, f"the {what} {shown} has a space, quote, backslash, ';' or control character: "
            "systemd would split or unescape it; move it to a plain path",
        )
    return text.replace("%", "%%")


def _under(path: Path, roots: Iterable[Path]) -> bool:
    return any(path == root or path.is_relative_to(root) for root in roots)


def render_unit(
    *,
    exec_path: Path,
    config_path: Path,
    data_dir: Path,
    env_file: Path,
    user: str | None,
    user_mode: bool,
    working_dir: Path,
    writable: Iterable[Path] = (),
    shell_sandbox: bool = False,
) -> str:
    """The unit file text (module docstring, "The unit", for every setting and why).

    Args:
        exec_path: the ``bumblebot`` console script, absolute.
        config_path: the config file, absolute; ``ExecStart=<exec_path> run --config <it>``.
        data_dir: the data directory, absolute; the one place the sandbox lets it write
            (``StateDirectory=`` when under ``/var/lib``, else ``ReadWritePaths=``).
        env_file: ``EnvironmentFile=-<it>``; missing is fine, read by systemd as root.
        user: ``User=`` for a system unit; ``None`` runs it as root. Ignored with ``user_mode``.
        user_mode: a ``systemctl --user`` unit: no ``User=``, no namespace-based sandboxing,
            ``WantedBy=default.target``.
        working_dir: ``WorkingDirectory=``, absolute.
        writable: more directories the daemon writes (e.g. a ``tools.workspace`` outside
            ``data_dir``), made writable like ``data_dir``.
        shell_sandbox: ``run_command`` is on, in its bubblewrap sandbox: the unit lets the
            daemon make the namespaces, the own ``/proc`` and the netlink socket bubblewrap
            needs (else the shell would not be offered).

    Raises:
        InstallError: a path is relative or has characters a unit cannot hold (it is named).
        ValueError: ``user`` is not a plausible user name.
    """
    exec_text = _checked(exec_path, "bumblebot entry point").replace("$", "$$")
    config_text = _checked(config_path, "config file").replace("$", "$$")
    env_text = _checked(env_file, "environment file")
    work_text = _checked(working_dir, "working directory")
    data_text = _checked(data_dir, "data directory")
    extra = [_checked(p, "writable directory") for p in writable if p != data_dir and not p.is_relative_to(data_dir)]
    if user is not None and not user_mode and (not user or _UNSAFE & set(user) or "%" in user):
        raise ValueError(f"not a user name for User=: {user!r}")

    lines = [
        "# Bumblebot, written by `bumblebot service install` for this installation.",
        "# Change settings with `systemctl" + (" --user" if user_mode else "") + " edit bumblebot` (a drop-in):",
        "# installing again rewrites this file.",
        "[Unit]",
        "Description=Bumblebot LLM entity for Telegram and Discord",
    ]
    if not user_mode:  # the user manager has no network-online.target
        lines += ["After=network-online.target", "Wants=network-online.target"]
    lines += [
        "",
        "[Service]",
        "# READY=1 once every adapter is connected, STOPPING=1 on SIGTERM (bumblebot/app/systemd.py).",
        "Type=notify",
        "NotifyAccess=main",
        f"# WATCHDOG=1 from the event loop every {WATCHDOG_S // 2} s; a loop stuck {WATCHDOG_S} s is killed and restarted.",
        f"WatchdogSec={WATCHDOG_S}",
        "# A watchdog kill (SIGABRT) first prints every thread's Python stack to the journal.",
        "Environment=PYTHONFAULTHANDLER=1",
    ]
    if user and not user_mode:
        lines.append(f"User={user}")
    lines += [
        f"WorkingDirectory={work_text}",
        "# Read by systemd itself" + ("" if user_mode else ", as root,") + " before the sandbox applies; '-': may be missing.",
        f"EnvironmentFile=-{env_text}",
        f"ExecStart={exec_text} run --config {config_text}",
        "# SIGTERM: stop intake, let in-flight turns finish (engine.shutdown_grace_s, 30 s), exit 0.",
        "KillSignal=SIGTERM",
        "TimeoutStopSec=45",
        "# Kill whatever the shell tool started along with the daemon.",
        "KillMode=control-group",
        "# Exit 1 (a platform refused us) or killed by the watchdog: start again, not in a tight loop.",
        "Restart=on-failure",
        "RestartSec=10",
        "# Exit 2 = configuration error: restarting will not help.",
        "RestartPreventExitStatus=2",
        "",
        "# Sandboxing: the daemon needs its data directory and the network.",
        "UMask=0077",
        "NoNewPrivileges=yes",
    ]
    if not user_mode:
        state = (
            data_dir.relative_to(_STATE_ROOT).as_posix().replace("%", "%%")
            if data_dir != _STATE_ROOT and data_dir.is_relative_to(_STATE_ROOT) else None
        )
        if state is not None:
            lines += [f"StateDirectory={state}", "StateDirectoryMode=0700"]
        writable_dirs = ([] if state is not None else [data_text]) + extra
        homes = [way for p in (exec_path, config_path, working_dir, data_dir, *writable) for way in ways(p)]
        lines += [
            "ProtectSystem=strict",
            f"ProtectHome={'read-only' if any(_under(p, HOME_ROOTS) for p in homes) else 'yes'}",
        ]
        if writable_dirs:
            lines.append(f"ReadWritePaths={' '.join(writable_dirs)}")
        lines += [
            "PrivateTmp=yes",
            "PrivateDevices=yes",
            f"ProtectKernelTunables={'no' if shell_sandbox else 'yes'}",
            "ProtectKernelModules=yes",
            f"ProtectKernelLogs={'no' if shell_sandbox else 'yes'}",
            "ProtectControlGroups=yes",
            "ProtectClock=yes",
            "ProtectHostname=yes",
            "CapabilityBoundingSet=",
            "AmbientCapabilities=",
        ]
    if shell_sandbox:  # docs/tools.md, "The shell sandbox"
        lines += [
            "# run_command's bubblewrap sandbox: its namespaces, its own /proc (which the two",
            "# Protect* settings above would stop it mounting) and its loopback (set up by netlink).",
            "RestrictNamespaces=user mnt pid ipc uts net cgroup",
        ]
    lines += [
        "RestrictSUIDSGID=yes",
        "RestrictRealtime=yes",
        *([] if shell_sandbox else ["RestrictNamespaces=yes"]),
        "LockPersonality=yes",
        "RestrictAddressFamilies=AF_INET AF_INET6 AF_UNIX" + (" AF_NETLINK" if shell_sandbox else ""),
        "SystemCallArchitectures=native",
        "",
        "[Install]",
        f"WantedBy={'default.target' if user_mode else 'multi-user.target'}",
    ]
    return "\n".join(lines) + "\n"


def plan_install(
    *,
    config_path: Path,
    data_dir: Path | None = None,
    user_mode: bool = False,
    user: str | None = SERVICE_USER,
    env_file: Path | None = None,
    writable: Iterable[Path] = (),
    executable: Path | None = None,
    unit_dir: Path | None = None,
    home: Path | None = None,
    euid: int | None = None,
    shell_sandbox: bool = False,
) -> InstallPlan:
    """Work out the unit for the installation this process runs from.

    Args:
        config_path: the config file (made absolute); it must exist.
        data_dir: the config's ``data_dir`` (absolute); default: read from ``config_path``.
        user_mode: a user unit in ``~/.config/systemd/user`` instead of a system unit in
            ``/etc/systemd/system``.
        user: ``User=`` of a system unit (default ``bumblebot``; ``None``: root).
        env_file: ``EnvironmentFile=``; default ``.env`` next to the config file.
        writable: more directories the daemon writes (``tools.workspace`` outside ``data_dir``).
        executable: the Python of the installation (default ``sys.executable``); the
            ``bumblebot`` console script must sit next to it.
        unit_dir: where the unit goes (default per ``user_mode``; tests pass a tmp directory).
        home: the home directory for ``user_mode`` (default ``Path.home()``).
        euid: whose commands to print (default ``os.geteuid()``; root gets no ``sudo``).
        shell_sandbox: ``tools.shell`` is on with its bubblewrap sandbox (see :func:`render_unit`).

    Raises:
        InstallError: no config file, no console script next to ``executable``, or a path the
            unit cannot hold; the message names it.
        ConfigError: ``data_dir`` was not given and the config file is invalid.
    """
    config = Path(os.path.abspath(Path(config_path).expanduser()))
    if not config.is_file():
        raise InstallError(config, f"no config file at {config}: write one first (see docs/configuration.md)")
    if data_dir is None:
        from bumblebot.core.config import load_settings

        data_dir = load_settings(config).data_dir
    data = Path(os.path.abspath(Path(data_dir).expanduser()))
    python = Path(os.path.abspath(executable or sys.executable))  # not resolved: a venv's python is a symlink
    entry = python.parent / "bumblebot"
    if not (entry.is_file() and os.access(entry, os.X_OK)):
        raise InstallError(
            entry, f"no bumblebot entry point at {entry} (next to {python}): install the package into "
            f"that venv first ({python.parent / 'pip'} install bumblebot-*.whl)",
        )
    env = Path(os.path.abspath(env_file)) if env_file is not None else config.parent / ".env"
    extra = [Path(os.path.abspath(p)) for p in writable]
    euid = os.geteuid() if euid is None else euid
    if user_mode:
        user = None
        unit_dir = unit_dir or (home or Path.home()) / ".config" / "systemd" / "user"
    else:
        unit_dir = unit_dir or SYSTEM_UNIT_DIR
    unit_text = render_unit(
        exec_path=entry, config_path=config, data_dir=data, env_file=env, user=user,
        user_mode=user_mode, working_dir=data, writable=extra,
        shell_sandbox=shell_sandbox,
    )

    notes: list[str] = []
    commands: list[str] = []
    code = _code_outside() if executable is None else None
    if code is not None and not user_mode:
        notes.append(
            f"the service runs the bumblebot code in {code}, outside the venv (an editable install or a source "
            "clone): edits there change the service at its next start, and the unit sets no PYTHONPATH, so the "
            f"venv must find that code by itself (pip install -e does); a wheel installed into the venv, as in "
            "docs/running.md, keeps the service apart from the clone"
        )
    if user_mode:
        systemctl, journal = "systemctl --user", "journalctl --user"
        commands.append(f"loginctl enable-linger {pwd.getpwuid(os.getuid()).pw_name}  # run without a login session")
    else:
        sudo = "" if euid == 0 else "sudo "
        systemctl, journal = f"{sudo}systemctl", f"{sudo}journalctl"
        if user is not None:
            try:
                account = pwd.getpwnam(user)
            except KeyError:
                notes.append(f"there is no user {user!r} yet: the first command below creates it")
                commands.append(
                    f"{sudo}useradd --system --user-group --home-dir {data} --shell /usr/sbin/nologin {user}"
                )
                if not data.is_relative_to(_STATE_ROOT):  # StateDirectory= would chown it itself
                    commands.append(f"{sudo}chown {user}:{user} {data}")
            else:
                blocked = blocked_at(config, Who.named(account.pw_name), 4)
                if blocked is not None:
                    notes.append(f"{user} may not be able to read {config} (stopped at {blocked}): "
                                 f"chgrp {account.pw_name} {config} && chmod 0640 {config}")
    if not env.exists():
        notes.append(f"there is no {env}: the service reads its secrets from it (EnvironmentFile=); "
                     f"install -m 0600 .env {env}")
    commands += [
        f"{systemctl} daemon-reload",
        f"{systemctl} enable --now bumblebot",
        f"{systemctl} status bumblebot",
        f"{journal} -u bumblebot -f",
    ]
    return InstallPlan(
        unit_path=unit_dir / UNIT_NAME,
        unit_text=unit_text,
        state_dir=data,
        owner=user,
        user_mode=user_mode,
        exec_path=entry,
        config_path=config,
        commands=tuple(commands),
        notes=tuple(notes),
        refusals=() if user_mode else tuple(refusals(unit_text, _needs(entry, python, config, data, extra, code), user)),
    )


def _code_outside() -> Path | None:
    """Where this process imports the ``bumblebot`` package from (the directory holding it,
    resolved) when that is outside its venv: an editable install, a source clone on
    ``PYTHONPATH``, a ``pip install --user``; ``None`` when the venv holds it."""
    package = Path(__file__).resolve().parents[1]  # bumblebot/
    return None if package.is_relative_to(Path(sys.prefix).resolve()) else package.parent


def _needs(
    entry: Path, python: Path, config: Path, data: Path, writable: list[Path], code: Path | None = None
) -> list[Need]:
    """What the service of the unit needs to reach (``bumblebot/app/unit_reach.py``): ``code``
    is the directory the package is imported from when the venv does not hold it."""
    elsewhere = "move it out of there (the standard places: docs/running.md, Running as a service)"
    wheel = (f"build a wheel and install it into the venv ({python.parent / 'pip'} install bumblebot-*.whl; "
             "docs/running.md, Running as a service), or install a unit that runs as you and sees your home with --user")
    return [
        Need("the bumblebot entry point (ExecStart=)", entry, 5, RUN_FIX),
        *(Need(what, path, 1, RUN_FIX) for what, path in pythons(entry, python)),
        *([Need("the bumblebot code, imported from outside the venv (an editable install or a source clone)",
                code, 5, wheel)] if code is not None else []),
        Need("the config file", config, 0, f"{elsewhere}, e.g. {CONFIG_PATH}"),
        Need("the data directory (data_dir)", data, 0, f"{elsewhere}, e.g. data_dir: {STATE_DIR}"),
        *(Need("the writable directory", path, 0, elsewhere) for path in writable),
    ]


def _report(plan: InstallPlan, done: list[str]) -> str:
    out = [*done]
    out += [f"note: {n}" for n in plan.notes]
    out.append("next:")
    out += [f"  {c}" for c in plan.commands]
    return "\n".join(out) + "\n"


def install(plan: InstallPlan, *, dry_run: bool = False) -> str:
    """Write ``plan.unit_path`` and create ``plan.state_dir``; return the text to print.

    With ``dry_run`` nothing is written: the text holds the unit and what would be done.
    The unit is replaced atomically (mode 0644). The state directory is created with mode
    0700 and, when this runs as root and the user exists, given to ``plan.owner``.

    Raises:
        InstallError: a file or directory could not be written, named in the message (for a
            permission error on a system unit: run with sudo, or use ``--user``).
    """
    if dry_run:
        return _report(plan, [
            f"# {plan.unit_path} (dry run: nothing written)",
            plan.unit_text.rstrip("\n"),
            f"# {_state_dir_intent(plan)}",
        ])
    done = [_write_unit(plan)]
    done.append(_make_state_dir(plan))
    return _report(plan, done)


def _state_dir_intent(plan: InstallPlan) -> str:
    """What :func:`_make_state_dir` would do, in words (a dry run's last line)."""
    path = plan.state_dir
    if path.exists() and not path.is_dir():
        return f"would stop: the data directory {path} is a file, not a directory (move it or change data_dir)"
    owner_exists: bool | None = None  # None: not given away (not root, or a user unit)
    if plan.owner and not plan.user_mode and os.geteuid() == 0:
        try:
            owner_exists = bool(pwd.getpwnam(plan.owner))
        except KeyError:
            owner_exists = False
    missing = f"not yet {plan.owner}'s: that user does not exist"
    if path.is_dir():
        if owner_exists:
            return f"would keep {path}, which exists, and give it to {plan.owner} (mode 0700)"
        return f"would keep {path}, which exists" + (f" ({missing})" if owner_exists is False else "")
    given = {True: f", owned by {plan.owner}", False: f", {missing}", None: ""}[owner_exists]
    return f"would create {path} (mode 0700{given})"


def _write_unit(plan: InstallPlan) -> str:
    path = plan.unit_path
    try:
        old: str | None = path.read_text()
    except FileNotFoundError:
        old = None
    except OSError:
        old = ""  # unreadable: written over (or the write below says why not)
    if old == plan.unit_text:
        return f"{path} is up to date"
    partial = path.with_name(f".{path.name}.partial")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(plan.unit_text)
        partial.chmod(0o644)
        os.replace(partial, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)
        hint = ""
        if isinstance(exc, PermissionError):
            hint = (
                f"; check the permissions of {path.parent}" if plan.user_mode
                else f"; run it as root (sudo {plan.exec_path} service install --config {plan.config_path}), "
                "or install a user unit with --user"
            )
        raise InstallError(path, f"cannot write {path}: {exc.strerror or exc}{hint}") from exc
    return f"{'replaced' if old is not None else 'wrote'} {path}"


def _make_state_dir(plan: InstallPlan) -> str:
    path = plan.state_dir
    if path.exists() and not path.is_dir():
        raise InstallError(path, f"the data directory {path} is a file, not a directory: move it or change data_dir")
    existed = path.is_dir()
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        if plan.owner and not plan.user_mode and os.geteuid() == 0:
            try:
                account = pwd.getpwnam(plan.owner)
            except KeyError:
                return f"{'kept' if existed else 'created'} {path} (not yet {plan.owner}'s: that user does not exist)"
            os.chown(path, account.pw_uid, account.pw_gid)
            path.chmod(0o700)
            return f"{'kept' if existed else 'created'} {path}, owned by {plan.owner}"
    except OSError as exc:
        hint = "; run it as root, or use --user" if isinstance(exc, PermissionError) and not plan.user_mode else ""
        raise InstallError(path, f"cannot create the data directory {path}: {exc.strerror or exc}{hint}") from exc
    return f"{'kept' if existed else 'created'} {path}"
