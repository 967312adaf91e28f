"""Whether the service a system unit describes can reach the files it needs.

Two things stand between a unit and its files. Its sandbox hides whole trees (systemd.exec(5)):
``ProtectHome=yes`` and ``ProtectHome=tmpfs`` make ``/home``, ``/root`` and ``/run/user`` empty
for the service (``read-only`` leaves them readable), and ``PrivateTmp=yes`` gives it an empty
``/tmp`` and ``/var/tmp`` of its own. And ``User=`` runs it as a user who needs the search (x)
permission on every directory on the way and the right to run the program. An entry point or a
Python it cannot see or reach fails every start with status 203/EXEC; a config it cannot see
exits 2; a data directory in the private ``/tmp`` loses the history at every stop.
:func:`refusals` finds these from the unit's text before it is written (``service install``
then writes nothing). A user unit (``--user``) has neither: it runs as the user who installs
it and hides nothing.

Which Python runs: the program of the entry point's ``#!`` line, as the kernel runs it, and
the file it resolves to through symbolic links (a venv's ``python`` links to the interpreter it
was made from, which must be reachable too), and the same for the Python ``service install``
runs under (the one pip wrote into the script when the ``#!`` line could not hold it).
Every path is followed through symbolic links too (:func:`ways`): ``/opt/bumblebot`` linking to
a directory under ``/tmp`` or ``/root`` is where the service meets the sandbox.
"""

from __future__ import annotations

import grp
import os
import pwd
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

HOME_ROOTS = (Path("/home"), Path("/root"), Path("/run/user"))
TMP_ROOTS = (Path("/tmp"), Path("/var/tmp"))
_YES = {"yes", "true", "on", "1"}

#: What to do about an entry point or a Python the service cannot run.
RUN_FIX = ("install Bumblebot where the service can run it: a venv in /opt made from the system Python "
           "(/usr/bin/python3 -m venv /opt/bumblebot; docs/running.md, Running as a service), or install "
           "a unit that runs as you and sees your home with --user")


@dataclass(frozen=True, slots=True)
class Need:
    """A file the service needs: ``what`` it is (words), its ``path``, the permission ``bit``
    its user needs on it (1 run, 5 read and run, 0 only reach it), and ``fix`` when it is
    hidden or out of reach."""

    what: str
    path: Path
    bit: int
    fix: str


def hidden_roots(unit_text: str) -> list[tuple[Path, str]]:
    """The trees the unit's sandbox hides from its service, each with the setting that does."""
    settings: dict[str, str] = {}
    for line in unit_text.splitlines():
        key, sep, value = line.partition("=")
        if sep and not line.startswith(("#", ";")):
            settings[key.strip()] = value.strip()
    hidden = []
    home = settings.get("ProtectHome", "no").lower()
    if home in _YES or home == "tmpfs":
        hidden += [(root, f"ProtectHome={home} hides it from the service") for root in HOME_ROOTS]
    if settings.get("PrivateTmp", "no").lower() in _YES:
        hidden += [(root, "PrivateTmp=yes gives the service an empty one of its own") for root in TMP_ROOTS]
    return hidden


def interpreter(script: Path) -> Path | None:
    """The program of ``script``'s ``#!`` line when it names one by absolute path."""
    try:
        with open(script, "rb") as fh:
            first = fh.readline(512)
    except OSError:
        return None
    words = first[2:].split() if first.startswith(b"#!") else []
    program = Path(os.fsdecode(words[0])) if words else None
    return program if program is not None and program.is_absolute() else None


def pythons(entry: Path, python: Path) -> list[tuple[str, Path]]:
    """The Pythons that run ``entry`` (module docstring), each with words saying which, once."""
    found: list[tuple[str, Path]] = []
    for what, path in (("the Python of the entry point's #! line", interpreter(entry)), ("the venv's Python", python)):
        if path is None:
            continue
        resolved = Path(os.path.realpath(path))
        for label, p in ((what, path), (f"{what} ({path}) resolved", resolved)):
            if all(p != seen for _, seen in found):
                found.append((label, p))
    return found


@dataclass(frozen=True, slots=True)
class Who:
    """The service user as file permissions see it; a user not created yet is nobody's owner
    and in no existing group (``useradd --user-group`` gives it a new one)."""

    name: str
    uid: int | None
    gids: frozenset[int]

    @classmethod
    def named(cls, name: str) -> Who:
        try:
            account = pwd.getpwnam(name)
        except KeyError:
            return cls(name, None, frozenset())
        gids = {account.pw_gid} | {g.gr_gid for g in grp.getgrall() if name in g.gr_mem}
        return cls(name, account.pw_uid, frozenset(gids))


def blocked_at(path: Path, who: Who, bit: int) -> Path | None:
    """The first of ``path``'s existing directories ``who`` cannot search, or ``path`` when it
    lacks ``bit`` (4 read, 1 execute) for ``who``, by owner, group and mode (ACLs not read);
    ``None`` when it is reachable, or for root."""
    if who.uid == 0:
        return None

    def allowed(p: Path, want: int) -> bool:
        st = p.stat()
        shift = 6 if st.st_uid == who.uid else 3 if st.st_gid in who.gids else 0
        return (st.st_mode >> shift) & want == want

    try:
        for parent in reversed(path.parents):
            if parent.exists() and not allowed(parent, 1):
                return parent
        return None if bit == 0 or not path.exists() or allowed(path, bit) else path
    except OSError:
        return path


def _shown(path: Path) -> str:
    try:
        st = path.stat()
        owner = pwd.getpwuid(st.st_uid).pw_name
    except (OSError, KeyError):
        return str(path)
    return f"{path} (mode {st.st_mode & 0o7777:04o}, owner {owner})"


def ways(path: Path) -> list[Path]:
    """``path`` and where it leads through symbolic links, each once: its directories resolved
    (the file itself may be a link the kernel follows from there, as a venv's ``python``), then
    the file too. The service meets every one of them on its way: a link into ``/tmp`` dangles
    under ``PrivateTmp=yes``."""
    found = [path]
    for p in (Path(os.path.realpath(path.parent)) / path.name, Path(os.path.realpath(path))):
        if p not in found:
            found.append(p)
    return found


def refusals(unit_text: str, needs: Iterable[Need], user: str | None) -> list[str]:
    """Why the service of a system unit could not use each of ``needs``: hidden by the unit's
    sandbox, or out of reach of ``User=`` (``user``; ``None``: root, who reaches everything),
    as written or where symbolic links lead (:func:`ways`). Each sentence names the path (and
    the real one) and the setting or the directory in the way; what to do ends the last of the
    sentences that share it."""
    hidden = hidden_roots(unit_text)
    who = Who.named(user) if user is not None else None
    found: list[tuple[str, str]] = []
    told: set[Path] = set()
    for need in needs:
        for path in ways(need.path):
            cover = next(((root, why) for root, why in hidden if path == root or path.is_relative_to(root)), None)
            blocked = blocked_at(path, who, need.bit) if who is not None and cover is None else None
            if cover is None and blocked is None:
                continue
            if path not in told:  # a venv's python and the interpreter it links to meet the same one
                told.add(path)
                shown = need.path if path == need.path else f"{need.path} (through symbolic links: {path})"
                if cover is not None:
                    found.append((f"{need.what}: {shown} is under {cover[0]}, and the unit's {cover[1]}", need.fix))
                elif who is not None and blocked is not None:
                    found.append((f"{need.what}: {shown} is out of reach of the service user {who.name} (User=): "
                                  f"{_shown(blocked)} is in the way", need.fix))
            break
    return [
        text if i + 1 < len(found) and found[i + 1][1] == fix else f"{text}; {fix}"
        for i, (text, fix) in enumerate(found)
    ]
