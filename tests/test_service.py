"""``bumblebot service install`` (bumblebot/app/service.py): the unit text, the plan for this
installation, writing it into tmp_path directories, and systemd's own verdict on it."""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from bumblebot.app import service
from bumblebot.app.service import InstallError, install, plan_install, render_unit

ROOT = Path(__file__).resolve().parent.parent

#: Settings that need a privileged (system) manager or user namespaces: never in a user unit.
SYSTEM_ONLY = {
    "User", "StateDirectory", "StateDirectoryMode", "ReadWritePaths", "ProtectSystem", "ProtectHome",
    "PrivateTmp", "PrivateDevices", "ProtectKernelTunables", "ProtectKernelModules", "ProtectKernelLogs",
    "ProtectControlGroups", "ProtectClock", "ProtectHostname", "CapabilityBoundingSet", "AmbientCapabilities",
}


def parse(unit: str) -> dict[str, list[str]]:
    """``{"Section.Key": [values in order]}``, comments and blank lines left out."""
    out: dict[str, list[str]] = {}
    section = ""
    for line in unit.splitlines():
        if not line.strip() or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, sep, value = line.partition("=")
        assert sep, f"not a setting: {line!r}"
        out.setdefault(f"{section}.{key}", []).append(value)
    return out


def standard(**changes: object) -> str:
    """The unit of the standard system install (bumblebot/app/service.py), with ``changes``."""
    args: dict[str, object] = {
        "exec_path": service.VENV / "bin" / "bumblebot",
        "config_path": service.CONFIG_PATH,
        "data_dir": service.STATE_DIR,
        "env_file": service.ENV_FILE,
        "user": service.SERVICE_USER,
        "user_mode": False,
        "working_dir": service.STATE_DIR,
    }
    args.update(changes)
    return render_unit(**args)  # type: ignore[arg-type]


# -- render_unit -------------------------------------------------------------------------------


def test_the_system_unit_is_type_notify_with_a_watchdog_and_absolute_paths():
    unit = parse(standard())
    expected = {
        "Service.Type": ["notify"],
        "Service.NotifyAccess": ["main"],
        "Service.WatchdogSec": ["30"],
        "Service.User": ["bumblebot"],
        "Service.ExecStart": ["/opt/bumblebot/bin/bumblebot run --config /etc/bumblebot/bumblebot.yaml"],
        "Service.EnvironmentFile": ["-/etc/bumblebot/.env"],
        "Service.WorkingDirectory": ["/var/lib/bumblebot"],
        "Service.Restart": ["on-failure"],
        "Service.RestartSec": ["10"],
        "Service.RestartPreventExitStatus": ["2"],
        "Service.TimeoutStopSec": ["45"],
        "Service.KillMode": ["control-group"],
        "Service.Environment": ["PYTHONFAULTHANDLER=1"],  # a watchdog kill shows where the loop hung
        "Service.StateDirectory": ["bumblebot"],  # /var/lib/bumblebot, owned by User=, writable
        "Service.StateDirectoryMode": ["0700"],
        "Service.ProtectSystem": ["strict"],
        "Service.ProtectHome": ["yes"],
        "Service.NoNewPrivileges": ["yes"],
        "Unit.After": ["network-online.target"],
        "Unit.Wants": ["network-online.target"],
        "Install.WantedBy": ["multi-user.target"],
    }
    assert {k: unit.get(k) for k in expected} == expected
    assert "Service.ReadWritePaths" not in unit  # StateDirectory= already makes it writable
    # everything of the old deploy/bumblebot.service sandbox is still there
    for key in ("PrivateTmp", "PrivateDevices", "ProtectKernelTunables", "ProtectKernelModules",
                "ProtectControlGroups", "RestrictSUIDSGID", "LockPersonality", "SystemCallArchitectures"):
        assert unit[f"Service.{key}"] in (["yes"], ["native"]), key
    assert unit["Service.RestrictAddressFamilies"] == ["AF_INET AF_INET6 AF_UNIX"]
    assert all(len(values) == 1 for values in unit.values())


def test_a_data_dir_outside_var_lib_is_made_writable_by_path():
    unit = parse(standard(data_dir=Path("/srv/bumblebot/data"), working_dir=Path("/srv/bumblebot/data"),
                          writable=[Path("/srv/bumblebot/data/workspace"), Path("/srv/shared")]))
    assert unit["Service.ReadWritePaths"] == ["/srv/bumblebot/data /srv/shared"]  # a workspace inside is covered
    assert "Service.StateDirectory" not in unit
    nested = parse(standard(data_dir=Path("/var/lib/bots/ada")))
    assert nested["Service.StateDirectory"] == ["bots/ada"] and "Service.ReadWritePaths" not in nested


def test_an_installation_under_home_is_seen_read_only_not_hidden():
    unit = parse(standard(exec_path=Path("/home/ada/venv/bin/bumblebot")))
    assert unit["Service.ProtectHome"] == ["read-only"]
    unit = parse(standard(data_dir=Path("/home/ada/bumblebot-data")))
    assert unit["Service.ProtectHome"] == ["read-only"]
    assert unit["Service.ReadWritePaths"] == ["/home/ada/bumblebot-data"]


def test_the_user_unit_has_no_user_and_no_namespace_sandboxing():
    unit = parse(standard(user_mode=True, user="ignored", exec_path=Path("/home/ada/venv/bin/bumblebot"),
                          config_path=Path("/home/ada/bb/bumblebot.yaml"), env_file=Path("/home/ada/bb/.env"),
                          data_dir=Path("/home/ada/bb/data"), working_dir=Path("/home/ada/bb/data")))
    assert SYSTEM_ONLY.isdisjoint(key.split(".", 1)[1] for key in unit)
    assert "Unit.Wants" not in unit and "Unit.After" not in unit  # no network-online.target for users
    assert unit["Install.WantedBy"] == ["default.target"]
    assert unit["Service.Type"] == ["notify"] and unit["Service.WatchdogSec"] == ["30"]
    assert unit["Service.NotifyAccess"] == ["main"]
    assert unit["Service.ExecStart"] == ["/home/ada/venv/bin/bumblebot run --config /home/ada/bb/bumblebot.yaml"]
    assert unit["Service.EnvironmentFile"] == ["-/home/ada/bb/.env"]
    for key in ("NoNewPrivileges", "RestrictSUIDSGID", "LockPersonality", "RestrictRealtime", "RestrictNamespaces"):
        assert unit[f"Service.{key}"] == ["yes"], key  # seccomp-based: fine for an unprivileged manager


def test_with_the_sandboxed_shell_on_the_unit_lets_bubblewrap_start_and_keeps_the_rest():
    """A service with tools.shell.enabled got a unit under which bubblewrap cannot start (no
    namespaces, a hidden /proc, no netlink), so the shell was never offered."""
    plain, shell = parse(standard()), parse(standard(shell_sandbox=True))
    assert shell["Service.RestrictNamespaces"] == ["user mnt pid ipc uts net cgroup"]
    assert shell["Service.ProtectKernelTunables"] == ["no"] and shell["Service.ProtectKernelLogs"] == ["no"]
    assert shell["Service.RestrictAddressFamilies"] == ["AF_INET AF_INET6 AF_UNIX AF_NETLINK"]
    changed = {"Service.RestrictNamespaces", "Service.ProtectKernelTunables", "Service.ProtectKernelLogs",
               "Service.RestrictAddressFamilies"}
    assert {k: v for k, v in shell.items() if k not in changed} == {k: v for k, v in plain.items() if k not in changed}
    assert plain["Service.RestrictNamespaces"] == ["yes"]


def test_no_user_runs_the_system_unit_as_root():
    assert "Service.User" not in parse(standard(user=None))


def test_specifier_and_variable_characters_are_escaped():
    unit = parse(standard(exec_path=Path("/opt/50%/bin/bumblebot"), config_path=Path("/etc/bb$1/bumblebot.yaml")))
    assert unit["Service.ExecStart"] == ["/opt/50%%/bin/bumblebot run --config /etc/bb$$1/bumblebot.yaml"]


@pytest.mark.parametrize(
    ("name", "bad"),
    [
        ("exec_path", Path("/opt/my bot/bin/bumblebot")),
        ("config_path", Path('/etc/"bb"/bumblebot.yaml')),
        ("data_dir", Path("/var/lib/bb\nUser=root")),
        ("env_file", Path("relative/.env")),
        ("working_dir", Path("/srv/back\\slash")),
    ],
)
def test_a_path_the_unit_cannot_hold_is_refused_by_name(name, bad):
    with pytest.raises(InstallError) as caught:
        standard(**{name: bad})
    assert caught.value.path == bad
    shown = str(bad) if str(bad).isprintable() else repr(str(bad))
    assert shown in str(caught.value)


def test_deploy_unit_is_what_install_writes_for_the_standard_paths():
    text = (ROOT / "deploy" / "bumblebot.service").read_text()
    unit = standard()
    assert text.endswith(unit)
    header = text[: -len(unit)]
    assert all(not line or line.startswith("#") for line in header.splitlines())
    for step in ("python3 -m venv /opt/bumblebot", "/opt/bumblebot/bin/pip install", "/etc/bumblebot/.env",
                 "useradd --system", "/var/lib/bumblebot", "pip wheel"):
        assert step in header, step


# -- plan_install and install ------------------------------------------------------------------


@dataclass
class Tree:
    python: Path
    entry: Path
    config: Path
    data: Path
    units: Path
    home: Path


@pytest.fixture
def tree(tmp_path: Path) -> Iterator[Tree]:
    """An installation in tmp_path: a venv with a `bumblebot` script, a config naming its
    data_dir relatively, and empty places for units and a home directory."""
    bin_dir = tmp_path / "opt" / "bumblebot" / "bin"
    bin_dir.mkdir(parents=True)
    python = bin_dir / "python"
    python.write_text("")
    entry = bin_dir / "bumblebot"
    entry.write_text("#!/bin/sh\nexit 0\n")
    entry.chmod(0o755)
    config = tmp_path / "etc" / "bumblebot" / "bumblebot.yaml"
    config.parent.mkdir(parents=True)
    config.write_text("data_dir: ../../var/lib/bumblebot\n")
    yield Tree(python, entry, config, tmp_path / "var" / "lib" / "bumblebot", tmp_path / "units", tmp_path / "home")


def plan(tree: Tree, **changes: object) -> service.InstallPlan:
    args: dict[str, object] = {
        "config_path": tree.config, "executable": tree.python, "unit_dir": tree.units, "home": tree.home,
        "user": "nobody", "euid": 0,
    }
    args.update(changes)
    return plan_install(**args)  # type: ignore[arg-type]


def test_plan_finds_the_entry_point_config_and_data_dir_of_this_installation(tree, tmp_path):
    os.chdir(tree.config.parent)
    p = plan(tree, config_path=Path("bumblebot.yaml"))  # relative: made absolute
    unit = parse(p.unit_text)
    assert unit["Service.ExecStart"] == [f"{tree.entry} run --config {tree.config}"]
    assert unit["Service.WorkingDirectory"] == [str(tree.data)]  # data_dir read from the config, resolved
    assert unit["Service.ReadWritePaths"] == [str(tree.data)]
    assert unit["Service.EnvironmentFile"] == [f"-{tree.config.parent / '.env'}"]
    assert unit["Service.User"] == ["nobody"]
    assert p.unit_path == tree.units / "bumblebot.service"
    assert (p.state_dir, p.owner, p.exec_path, p.config_path) == (tree.data, "nobody", tree.entry, tree.config)
    assert p.commands == (
        "systemctl daemon-reload",
        "systemctl enable --now bumblebot",
        "systemctl status bumblebot",
        "journalctl -u bumblebot -f",
    )


def test_plan_takes_the_data_dir_it_is_given_and_a_non_root_gets_sudo(tree, tmp_path):
    p = plan(tree, data_dir=tmp_path / "elsewhere", euid=1000)
    assert p.state_dir == tmp_path / "elsewhere"
    assert parse(p.unit_text)["Service.WorkingDirectory"] == [str(tmp_path / "elsewhere")]
    assert p.commands[0] == "sudo systemctl daemon-reload" and p.commands[-1] == "sudo journalctl -u bumblebot -f"


def test_plan_defaults_to_the_system_unit_dir_and_the_bumblebot_user(tree):
    p = plan_install(config_path=tree.config, data_dir=tree.data, executable=tree.python)
    assert p.unit_path == Path("/etc/systemd/system/bumblebot.service")
    assert p.owner == "bumblebot" and parse(p.unit_text)["Service.User"] == ["bumblebot"]


def test_a_user_plan_goes_to_the_users_systemd_dir(tree):
    p = plan_install(config_path=tree.config, data_dir=tree.data, user_mode=True, executable=tree.python,
                     home=tree.home)
    assert p.unit_path == tree.home / ".config" / "systemd" / "user" / "bumblebot.service"
    assert p.owner is None and "Service.User" not in parse(p.unit_text)
    assert p.commands[0].startswith("loginctl enable-linger ")
    assert p.commands[1:] == (
        "systemctl --user daemon-reload",
        "systemctl --user enable --now bumblebot",
        "systemctl --user status bumblebot",
        "journalctl --user -u bumblebot -f",
    )


def test_a_missing_service_user_is_noted_and_created_first(tree):
    p = plan(tree, user="bumblebot-test-no-such-user", euid=1000)
    assert any("bumblebot-test-no-such-user" in note for note in p.notes)
    name = "bumblebot-test-no-such-user"
    assert p.commands[:2] == (
        f"sudo useradd --system --user-group --home-dir {tree.data} --shell /usr/sbin/nologin {name}",
        f"sudo chown bumblebot-test-no-such-user:bumblebot-test-no-such-user {tree.data}",  # not under /var/lib
    )
    assert p.commands[2] == "sudo systemctl daemon-reload"


def test_without_an_entry_point_or_a_config_the_plan_says_which_file(tree, tmp_path):
    tree.entry.unlink()
    with pytest.raises(InstallError) as caught:
        plan(tree)
    assert caught.value.path == tree.entry and str(tree.entry) in str(caught.value)
    with pytest.raises(InstallError) as caught:
        plan(tree, config_path=tmp_path / "nope.yaml")
    assert caught.value.path == tmp_path / "nope.yaml" and "nope.yaml" in str(caught.value)


def test_install_writes_the_unit_and_the_state_directory(tree):
    p = plan(tree)
    out = install(p, dry_run=False)
    assert p.unit_path.read_text() == p.unit_text
    assert stat.S_IMODE(p.unit_path.stat().st_mode) == 0o644
    assert tree.data.is_dir() and stat.S_IMODE(tree.data.stat().st_mode) == 0o700
    assert f"wrote {p.unit_path}" in out and str(tree.data) in out
    assert out.index("next:") < out.index("systemctl daemon-reload") < out.index("systemctl enable --now bumblebot")
    assert [x.name for x in tree.units.iterdir()] == ["bumblebot.service"]  # no partial file left

    assert f"{p.unit_path} is up to date" in install(p, dry_run=False)
    changed = replace(p, unit_text=p.unit_text.replace("RestartSec=10", "RestartSec=11"))
    assert f"replaced {p.unit_path}" in install(changed, dry_run=False)
    assert "RestartSec=11" in p.unit_path.read_text()


def test_a_user_install_creates_the_users_unit_directory(tree):
    p = plan(tree, user_mode=True, unit_dir=None)
    install(p, dry_run=False)
    assert (tree.home / ".config" / "systemd" / "user" / "bumblebot.service").read_text() == p.unit_text


def test_a_dry_run_prints_the_unit_and_writes_nothing(tree):
    p = plan(tree)
    out = install(p, dry_run=True)
    assert "Type=notify" in out and "WatchdogSec=30" in out and f"ExecStart={tree.entry} run" in out
    assert str(p.unit_path) in out and "systemctl enable --now bumblebot" in out
    assert not tree.units.exists() and not tree.data.exists()


def test_a_dry_run_says_it_keeps_a_data_dir_that_exists(tree):
    """Regression: a dry run said "would create" for a data directory that was already there."""
    tree.data.mkdir(parents=True)
    out = install(plan(tree), dry_run=True)
    assert "would create" not in out
    given = ", and give it to nobody (mode 0700)" if os.geteuid() == 0 else ""  # as the real run does
    assert f"# would keep {tree.data}, which exists{given}\n" in out
    tree.data.rmdir()
    tree.data.write_text("oops")
    assert f"# would stop: the data directory {tree.data} is a file" in install(plan(tree), dry_run=True)


def test_a_data_dir_that_is_a_file_is_named(tree):
    tree.data.parent.mkdir(parents=True)
    tree.data.write_text("oops")
    with pytest.raises(InstallError) as caught:
        install(plan(tree), dry_run=False)
    assert caught.value.path == tree.data and f"{tree.data} is a file" in str(caught.value)


def test_a_permission_error_names_the_file_and_says_sudo_or_user(tree, tmp_path):
    units = tmp_path / "locked"
    units.mkdir(mode=0o500)
    p = plan(tree, unit_dir=units)
    with pytest.raises(InstallError) as caught:
        with_unprivileged(lambda: install(p, dry_run=False))
    message = str(caught.value)
    assert caught.value.path == units / "bumblebot.service"
    assert f"cannot write {units / 'bumblebot.service'}" in message and "Permission denied" in message
    assert f"sudo {tree.entry} service install --config {tree.config}" in message and "--user" in message

    user = plan(tree, unit_dir=units, user_mode=True)
    with pytest.raises(InstallError) as caught:
        with_unprivileged(lambda: install(user, dry_run=False))
    assert str(units / "bumblebot.service") in str(caught.value) and "sudo" not in str(caught.value)


def with_unprivileged(call):
    """``call()`` without the right to write tmp_path (as `nobody` when we are root)."""
    if os.geteuid() != 0:
        return call()
    os.seteuid(pwd.getpwnam("nobody").pw_uid)
    try:
        return call()
    finally:
        os.seteuid(0)


if os.geteuid() == 0:  # only root can give the directory away; elsewhere this test is left out

    def test_as_root_the_state_directory_is_given_to_the_service_user(tree):
        out = install(plan(tree, user="nobody"), dry_run=False)
        assert tree.data.stat().st_uid == pwd.getpwnam("nobody").pw_uid
        assert f"{tree.data}, owned by nobody" in out


# -- what the service could not reach (bumblebot/app/unit_reach.py) -----------------------------


def test_which_settings_hide_which_trees():
    """systemd.exec(5): ProtectHome=yes and tmpfs hide /home, /root and /run/user, read-only
    leaves them readable; PrivateTmp=yes replaces /tmp and /var/tmp."""
    from bumblebot.app.unit_reach import hidden_roots

    def roots(unit: str) -> list[str]:
        return [str(root) for root, _ in hidden_roots(unit)]

    assert roots(standard()) == ["/home", "/root", "/run/user", "/tmp", "/var/tmp"]
    assert roots("[Service]\nProtectHome=tmpfs\n") == ["/home", "/root", "/run/user"]
    assert roots("[Service]\nProtectHome=read-only\nPrivateTmp=no\n") == []
    assert roots(standard(user_mode=True)) == []  # a user unit hides nothing
    # the unit the code writes for an installation in a home directory sees it read-only
    assert roots(standard(exec_path=Path("/home/ada/venv/bin/bumblebot"))) == ["/tmp", "/var/tmp"]


def test_a_python_under_root_is_hidden_from_a_venv_in_opt():
    """A venv in /opt made from a pyenv Python under /root: the unit hides /root (ProtectHome=yes),
    so its interpreter could not start."""
    from bumblebot.app.unit_reach import Need, refusals

    unit = standard()
    python = Path("/root/.pyenv/versions/3.11.7/bin/python3.11")
    [reason] = refusals(unit, [Need("the venv's Python (/opt/bumblebot/bin/python) resolved", python, 1, "fix it")], None)
    assert reason == (f"the venv's Python (/opt/bumblebot/bin/python) resolved: {python} is under /root, and the "
                      "unit's ProtectHome=yes hides it from the service; fix it")
    assert refusals(unit, [Need("the config file", Path("/etc/bumblebot/bumblebot.yaml"), 0, "fix")], None) == []


def test_the_pythons_are_the_scripts_and_the_venvs_as_written_and_resolved(tmp_path):
    from bumblebot.app.unit_reach import pythons

    real = tmp_path / "base" / "python3.11"
    real.parent.mkdir()
    real.write_text("")
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").symlink_to(real)
    entry = bin_dir / "bumblebot"
    entry.write_text(f"#!{bin_dir / 'python'}\nimport sys\n")
    assert pythons(entry, bin_dir / "python") == [
        ("the Python of the entry point's #! line", bin_dir / "python"),
        (f"the Python of the entry point's #! line ({bin_dir / 'python'}) resolved", real),
    ]
    # pip's form for a path the #! line cannot hold: /bin/sh runs it, with the venv's Python
    entry.write_text(f"#!/bin/sh\n'''exec' \"{bin_dir / 'python'}\" \"$0\" \"$@\"\n' '''\n")
    found = [path for _, path in pythons(entry, bin_dir / "python")]
    assert found[0] == Path("/bin/sh") and bin_dir / "python" in found and real in found


def test_a_missing_environment_file_is_noted(tree):
    p = plan(tree)
    env = tree.config.parent / ".env"
    assert any(note.startswith(f"there is no {env}: ") and "install -m 0600 .env" in note for note in p.notes)
    env.write_text("TELEGRAM_BOT_TOKEN=x\n")
    assert not any(str(env) in note for note in plan(tree).notes)


# -- service install as a new operator runs it -------------------------------------------------

BWRAP = shutil.which("bwrap") or "bwrap"
SYSTEMD_ANALYZE = shutil.which("systemd-analyze") or "systemd-analyze"
PYTHON = f"python{sys.version_info.major}.{sys.version_info.minor}"


class Machine:
    """This machine seen through a mount namespace (bubblewrap, as the shell sandbox uses it):
    empty directories of tmp_path mounted at ``/opt``, ``/srv`` or ``/root``, so an installation
    can sit exactly where an operator puts one, for root (CI) and other users alike. This
    process's Python is at ``/opt/python``, the code under test at ``/opt/src`` and its
    dependencies at ``/opt/deps``."""

    def __init__(self, tmp_path: Path, *places: str) -> None:
        self.host = tmp_path / "machine"
        self.binds: list[str] = []
        for place in ("/opt", *places):
            inside = self.host / place.strip("/")
            inside.mkdir(parents=True, mode=0o755, exist_ok=True)
            inside.chmod(0o700 if place == "/root" else 0o755)
            self.binds += ["--bind", str(inside), place]
        for source, place in ((sys.base_prefix, "/opt/python"), (ROOT, "/opt/src"),
                              (sysconfig.get_paths()["purelib"], "/opt/deps")):
            (self.host / place.strip("/")).mkdir(mode=0o755)
            self.binds += ["--ro-bind", str(source), place]
        # and where it was built for, should a place above cover it (its shared library is found there)
        self.binds += ["--ro-bind", sys.base_prefix, sys.base_prefix]

    def path(self, inside: str) -> Path:
        """Where a path of the namespace is on this machine (it must be under a mounted place)."""
        return self.host / inside.strip("/")

    def run(self, *argv: str, **env: str) -> subprocess.CompletedProcess[str]:
        environ = {k: v for k, v in os.environ.items() if not k.startswith(("BUMBLEBOT_", "PYTHON"))}
        return subprocess.run(
            [BWRAP, "--dev-bind", "/", "/", *self.binds, "--", *argv], env={**environ, **env},
            capture_output=True, text=True, timeout=120, umask=0o022, check=False,
        )

    def venv(self, where: str) -> str:
        """A venv at ``where`` with the ``bumblebot`` script pip writes; its path."""
        made = self.run(f"/opt/python/bin/{PYTHON}", "-m", "venv", "--without-pip", where)
        assert made.returncode == 0, made.stderr
        script = self.path(where) / "bin" / "bumblebot"
        script.write_text(f"#!{where}/bin/python\nimport sys\nfrom bumblebot.app.cli import main\nsys.exit(main())\n")
        script.chmod(0o755)
        return f"{where}/bin/bumblebot"

    def service_install(self, entry: str, *args: str, cwd: str) -> subprocess.CompletedProcess[str]:
        return self.run("sh", "-c", f'cd "{cwd}" && exec "$0" "$@"', entry, "service", "install", "--dry-run", *args,
                        PYTHONPATH="/opt/src:/opt/deps")


def dry_run_unit(out: str) -> str:
    """The unit text a ``--dry-run`` printed."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.endswith("(dry run: nothing written)"))
    end = next(i for i, line in enumerate(lines) if line.startswith("# would "))
    return "\n".join(lines[start + 1:end]) + "\n"


def test_the_installation_docs_running_md_describes_gets_a_unit_systemd_accepts(tmp_path):
    """The venv in /opt (made from a Python the service can run), the config and its .env
    elsewhere outside any home, data in /var/lib: the unit is written and systemd-analyze
    verify, which also checks that ExecStart= is there and executable, finds nothing."""
    machine = Machine(tmp_path, "/srv")
    entry = machine.venv("/opt/bumblebot")
    config = machine.path("/srv/bumblebot/bumblebot.yaml")
    config.parent.mkdir(mode=0o755)
    config.write_text("data_dir: /var/lib/bumblebot\n")
    (config.parent / ".env").write_text("TELEGRAM_BOT_TOKEN=123:abc\n")
    done = machine.service_install(entry, "--config", "/srv/bumblebot/bumblebot.yaml", cwd="/srv")
    assert done.returncode == 0, done.stderr
    unit_text = dry_run_unit(done.stdout)
    unit = parse(unit_text)
    assert unit["Service.ExecStart"] == ["/opt/bumblebot/bin/bumblebot run --config /srv/bumblebot/bumblebot.yaml"]
    assert unit["Service.ProtectHome"] == ["yes"] and unit["Service.PrivateTmp"] == ["yes"]
    assert unit["Service.StateDirectory"] == ["bumblebot"]
    units = tmp_path / "units"
    units.mkdir()
    (units / "bumblebot.service").write_text(unit_text)
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    verdict = machine.run(SYSTEMD_ANALYZE, "verify", str(units / "bumblebot.service"),
                          XDG_RUNTIME_DIR=str(runtime), SYSTEMD_LOG_LEVEL="notice")
    assert (verdict.returncode, verdict.stderr, verdict.stdout) == (0, "", "")


def test_a_checkout_under_root_is_refused_with_the_reason(tmp_path):
    """A clone in /root with its own .venv, installed from there: the unit runs as bumblebot,
    which cannot enter /root (0700); nothing is printed as a unit."""
    machine = Machine(tmp_path, "/root")
    entry = machine.venv("/root/bumblebot/.venv")
    machine.path("/root/bumblebot/bumblebot.yaml").write_text("data_dir: /var/lib/bumblebot\n")
    refused = machine.service_install(entry, cwd="/root/bumblebot")  # the config as `run` finds it
    assert refused.returncode == 1 and refused.stdout == "", refused.stderr
    lines = refused.stderr.splitlines()
    assert lines[0] == "bumblebot: service install writes no unit the service could not run:", refused.stderr
    assert lines[1].startswith(
        "  - the bumblebot entry point (ExecStart=): /root/bumblebot/.venv/bin/bumblebot is out of reach of the "
        "service user bumblebot (User=): /root (mode 0700, owner "
    )
    assert "/usr/bin/python3 -m venv /opt/bumblebot" in refused.stderr and "--user" in refused.stderr
    assert "the config file: /root/bumblebot/bumblebot.yaml is out of reach" in refused.stderr
    # a home the service user may enter: the unit sees it read-only (ProtectHome=read-only hides nothing)
    machine.path("/root").chmod(0o755)
    machine.path("/root/bumblebot/bumblebot.yaml").chmod(0o644)
    done = machine.service_install(entry, cwd="/root/bumblebot")
    assert done.returncode == 0, done.stderr
    assert parse(dry_run_unit(done.stdout))["Service.ProtectHome"] == ["read-only"]


@pytest.fixture
def in_tmp() -> Iterator[Path]:
    """A directory under /tmp itself (tmp_path follows $TMPDIR, which may be elsewhere)."""
    path = Path(tempfile.mkdtemp(dir="/tmp", prefix="bumblebot-test-"))
    yield path
    shutil.rmtree(path)


def test_a_checkout_under_tmp_is_refused_naming_private_tmp(in_tmp):
    """A venv made under /tmp, installed from there as `run` finds its config (./bumblebot.yaml):
    the unit's PrivateTmp=yes would hide it from the service."""
    checkout = in_tmp
    venv = checkout / ".venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    entry = venv / "bin" / "bumblebot"
    entry.write_text(f"#!{venv}/bin/python\nimport sys\nfrom bumblebot.app.cli import main\nsys.exit(main())\n")
    entry.chmod(0o755)
    (checkout / "bumblebot.yaml").write_text("data_dir: data\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BUMBLEBOT_", "PYTHON"))}
    env["PYTHONPATH"] = f"{ROOT}:{sysconfig.get_paths()['purelib']}"
    refused = subprocess.run([str(entry), "service", "install", "--dry-run"], cwd=checkout, env=env,
                             capture_output=True, text=True, timeout=60, check=False)
    assert refused.returncode == 1 and refused.stdout == "", refused.stderr
    assert (f"  - the bumblebot entry point (ExecStart=): {entry} is under /tmp, and the unit's PrivateTmp=yes "
            "gives the service an empty one of its own") in refused.stderr.splitlines()
    assert f"the data directory (data_dir): {checkout / 'data'} is under /tmp" in refused.stderr
    assert "/usr/bin/python3 -m venv /opt/bumblebot" in refused.stderr


def test_a_venv_and_a_config_reached_through_symbolic_links_into_tmp_are_refused(tmp_path, in_tmp):
    """Regression: /opt/bumblebot linking to a directory under /tmp (and a config linking there)
    got a unit whose ExecStart= dangles under PrivateTmp=yes (203/EXEC at every start)."""
    machine = Machine(tmp_path, "/srv")
    real = in_tmp / "real"
    real.mkdir()
    machine.path("/opt/bumblebot").symlink_to(real)
    entry = machine.venv("/opt/bumblebot/venv")
    (in_tmp / "bumblebot.yaml").write_text("data_dir: /var/lib/bumblebot\n")
    machine.path("/srv/bumblebot.yaml").symlink_to(in_tmp / "bumblebot.yaml")
    refused = machine.service_install(entry, "--config", "/srv/bumblebot.yaml", cwd="/srv")
    assert refused.returncode == 1 and refused.stdout == "", refused.stderr
    private = "is under /tmp, and the unit's PrivateTmp=yes gives the service an empty one of its own"
    assert (f"  - the bumblebot entry point (ExecStart=): /opt/bumblebot/venv/bin/bumblebot (through symbolic "
            f"links: {real}/venv/bin/bumblebot) {private}") in refused.stderr.splitlines()
    assert (f"  - the config file: /srv/bumblebot.yaml (through symbolic links: {in_tmp}/bumblebot.yaml) "
            f"{private}; move it out of there") in refused.stderr


def test_a_venv_linked_into_a_home_the_service_may_enter_sees_it_read_only(tmp_path):
    """/opt/bumblebot linking to a venv in /root (mode 0755): the unit sees homes read-only, as
    it does for a venv there named as it is, instead of hiding the venv."""
    machine = Machine(tmp_path, "/root")
    machine.path("/root").chmod(0o755)
    machine.venv("/root/bb")
    script = machine.path("/root/bb/bin/bumblebot")
    script.write_text(script.read_text().replace("#!/root/bb/bin/python", "#!/opt/bumblebot/bin/python"))
    machine.path("/opt/bumblebot").symlink_to("/root/bb")  # resolved inside the namespace
    machine.path("/opt/bumblebot.yaml").write_text("data_dir: /var/lib/bumblebot\n")
    done = machine.service_install("/opt/bumblebot/bin/bumblebot", "--config", "/opt/bumblebot.yaml", cwd="/opt")
    assert done.returncode == 0, done.stderr
    unit = parse(dry_run_unit(done.stdout))
    assert unit["Service.ExecStart"] == ["/opt/bumblebot/bin/bumblebot run --config /opt/bumblebot.yaml"]
    assert unit["Service.ProtectHome"] == ["read-only"]


def test_code_imported_from_a_hidden_home_is_refused_and_from_elsewhere_noted(tmp_path):
    """Regression: a venv in /opt whose bumblebot code is in /root (`pip install -e /root/src`)
    got only a note, and a unit whose ProtectHome=yes hides that code: ModuleNotFoundError at
    every start."""
    machine = Machine(tmp_path, "/root")
    machine.path("/root").chmod(0o755)
    machine.path("/root/src").mkdir(mode=0o755)
    machine.binds += ["--ro-bind", str(ROOT), "/root/src"]
    entry = machine.venv("/opt/bumblebot")
    machine.path("/opt/bumblebot.yaml").write_text("data_dir: /var/lib/bumblebot\n")
    argv = (entry, "service", "install", "--dry-run", "--config", "/opt/bumblebot.yaml")
    refused = machine.run(*argv, PYTHONPATH="/root/src:/opt/deps")
    assert refused.returncode == 1 and refused.stdout == "", refused.stderr
    assert ("  - the bumblebot code, imported from outside the venv (an editable install or a source clone): /root/src "
            "is under /root, and the unit's ProtectHome=yes hides it from the service; build a wheel and install it "
            "into the venv (/opt/bumblebot/bin/pip install bumblebot-*.whl; ") in refused.stderr
    # the same code where the service can read it: installed, and the note says what that means
    done = machine.run(*argv, PYTHONPATH="/opt/src:/opt/deps")
    assert done.returncode == 0, done.stderr
    assert ("note: the service runs the bumblebot code in /opt/src, outside the venv (an editable install or a source "
            "clone): edits there change the service at its next start, and the unit sets no PYTHONPATH") in done.stdout


def test_service_install_finds_the_config_as_run_does_or_says_how_to_name_it(in_tmp):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BUMBLEBOT_", "PYTHON"))}
    env["PYTHONPATH"] = str(ROOT)
    argv = [sys.executable, "-m", "bumblebot", "service", "install", "--dry-run"]
    nothing = subprocess.run(argv, cwd=in_tmp, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert nothing.returncode == 2
    assert "--config, else $BUMBLEBOT_CONFIG, else ./bumblebot.yaml" in nothing.stderr
    config = in_tmp / "etc" / "bumblebot.yaml"
    config.parent.mkdir()
    config.write_text("data_dir: /var/lib/bumblebot\n")
    named = subprocess.run(argv, cwd=in_tmp, env={**env, "BUMBLEBOT_CONFIG": str(config)}, capture_output=True,
                           text=True, timeout=60, check=False)
    assert f"the config file: {config} is under /tmp" in named.stderr  # found, and refused where it is


def test_a_user_unit_hides_nothing_so_nothing_is_refused(tree):
    assert plan(tree, user_mode=True).refusals == ()


# -- systemd's verdict -------------------------------------------------------------------------


def test_systemd_analyze_verify_accepts_the_user_unit(tree, tmp_path):
    p = plan(tree, user_mode=True)
    install(p, dry_run=False)
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime), "SYSTEMD_LOG_LEVEL": "notice"}
    args = [SYSTEMD_ANALYZE, "--user", "verify", str(p.unit_path)]
    done = subprocess.run(args, check=False, capture_output=True, text=True, env=env, timeout=60)
    assert (done.returncode, done.stderr, done.stdout) == (0, "", "")
