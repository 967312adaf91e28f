"""Data at rest is the daemon user's alone: the data directory and the workspace are ``0700``,
every file the daemon writes there ``0600``, whatever the umask it was started with.

Two parts. :data:`PRIVATE_UMASK` is the process umask of every command (``cli.main``) and of a
running :class:`~bumblebot.app.daemon.Daemon`: whatever is created from then on (the database
and its ``-wal``/``-shm``, the lock, the chat log, the inbox and media files, the knowledge
files, the workspace, what a shell command writes) is private from the start. And
:func:`make_private`, once at start (in a thread), takes group and other permissions away from
what an older version, or a start under another umask, left open: a walk that follows no
symbolic link and touches only entries that need it. An owner's execute bit is kept (a script
in the workspace still runs).

The systemd unit and the service's config file are not the data: ``service install`` sets
their modes itself (``bumblebot/app/service.py``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

#: No permission for the group or others on anything created.
PRIVATE_UMASK = 0o077
#: The permissions :func:`make_private` takes away.
OPEN_BITS = 0o077


@contextlib.contextmanager
def private_umask() -> Iterator[None]:
    """The process umask is :data:`PRIVATE_UMASK` inside the block, the previous one after."""
    previous = os.umask(PRIVATE_UMASK)
    try:
        yield
    finally:
        os.umask(previous)


def make_private(data_dir: Path, *more: Path) -> int:
    """Create ``data_dir`` (mode 0700) if needed, and take the group's and others'
    permissions from it, from ``more`` roots (a workspace outside it) and from everything
    under them. Symbolic links are neither followed nor changed; an entry that cannot be
    changed (another user's) is left as it is, and the first such one is logged.

    Returns:
        how many entries were changed.

    Raises:
        OSError: ``data_dir`` cannot be created.
    """
    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    changed, failed = 0, []
    data_dir = data_dir.resolve()  # a root that is a link (a workspace on another disk) is its target
    roots = [data_dir, *(r for r in (m.resolve() for m in more) if not r.is_relative_to(data_dir))]  # each entry once
    for root in roots:
        for path in _tree(root):
            try:
                mode = path.lstat().st_mode
                if stat.S_ISLNK(mode) or not mode & OPEN_BITS:
                    continue
                _chmod(path, stat.S_IMODE(mode) & ~OPEN_BITS)
                changed += 1
            except FileNotFoundError:
                continue  # gone meanwhile
            except OSError as exc:
                failed.append(f"{path}: {exc.strerror or exc}")
    if changed:
        log.info("made %d files and directories under %s private (mode 0600/0700)", changed, data_dir)
    if failed:
        log.warning("%d files stay readable by others: %s", len(failed), failed[0])
    return changed


def _tree(root: Path) -> Iterator[Path]:
    """``root`` (if it exists and is no link) and everything under it, links not followed."""
    if not root.is_dir() or root.is_symlink():
        return
    yield root
    for top, dirs, files in os.walk(root, followlinks=False):
        for name in (*dirs, *files):
            yield Path(top, name)


def _chmod(path: Path, mode: int) -> None:
    """``chmod`` that never follows a link that replaced ``path`` after it was looked at."""
    try:
        os.chmod(path, mode, follow_symlinks=False)
    except NotImplementedError:  # no lchmod here: the entry was no link a moment ago
        os.chmod(path, mode)
