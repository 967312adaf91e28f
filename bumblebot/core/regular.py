"""Opening files the model or its shell can reach without ever blocking on one that is not a
regular file.

A named pipe blocks ``open`` until its other end is opened (a read waits for a writer, a write
for a reader) and then blocks every read; a device may do the same. Opened in a worker thread,
such a file holds that thread for ever, and enough of them fill the default executor every
``asyncio.to_thread`` of the daemon shares. :func:`open_regular` opens with ``O_NONBLOCK``, so
the open returns at once whatever the path names, then checks with ``fstat`` that the
descriptor is a regular file and refuses anything else with :class:`NotRegularFile`. On a
regular file ``O_NONBLOCK`` changes nothing; it is cleared anyway before the descriptor is
handed back.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import IO, Any

__all__ = ["NotRegularFile", "describe_kind", "open_regular", "open_regular_file", "read_regular"]

_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_NOCTTY = getattr(os, "O_NOCTTY", 0)


class NotRegularFile(OSError):
    """A path names something other than a regular file (a pipe, a device, a socket, a
    directory, a symlink where none is followed). ``kind`` says what (:func:`describe_kind`);
    ``filename`` is the path as given."""

    def __init__(self, path: str | os.PathLike[str], kind: str) -> None:
        super().__init__(f"not a regular file ({kind}): {os.fspath(path)}")
        self.strerror = f"not a regular file ({kind})"
        self.filename = os.fspath(path)
        self.kind = kind


def describe_kind(mode: int) -> str:
    """What a file of ``st_mode`` ``mode`` is, for a message: ``"a named pipe"``, ``"a
    device"``, ``"a socket"``, ``"a directory"``, ``"a symlink"`` or ``"a regular file"``."""
    if stat.S_ISREG(mode):
        return "a regular file"
    if stat.S_ISFIFO(mode):
        return "a named pipe"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISLNK(mode):
        return "a symlink"
    return "not a regular file"


def open_regular(path: str | os.PathLike[str], flags: int = os.O_RDONLY, mode: int = 0o600, *, follow: bool = False) -> int:
    """``os.open(path, flags, mode)`` that returns at once and only ever opens a regular file.

    Args:
        path: the file.
        flags: ``os.O_*`` flags (``O_CREAT`` makes a regular file when none exists).
        mode: the permissions of a file ``O_CREAT`` makes.
        follow: follow a symlink in the last part of ``path`` (else ``O_NOFOLLOW``: opening one
            fails).

    Returns:
        A blocking descriptor on a regular file; the caller closes it.

    Raises:
        NotRegularFile: ``path`` is a pipe, a device, a socket, a directory (opening for
            writing a named pipe nobody reads fails this way too), or a symlink when not
            followed.
        OSError: the file cannot be opened (missing, no permission).
    """
    flags |= _O_NONBLOCK | _O_NOCTTY | (0 if follow else _O_NOFOLLOW)
    try:
        fd = os.open(path, flags, mode)
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # a named pipe (or a device) opened for writing with no reader
            raise NotRegularFile(path, _kind_at(path, follow)) from None
        if exc.errno == errno.ELOOP and not follow and _kind_at(path, False) == "a symlink":
            raise NotRegularFile(path, "a symlink") from None
        raise
    try:
        found = os.fstat(fd).st_mode
        if not stat.S_ISREG(found):
            raise NotRegularFile(path, describe_kind(found))
        if _O_NONBLOCK:
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_regular_file(path: str | os.PathLike[str], *, follow: bool = False, **kwargs: Any) -> IO[Any]:
    """:func:`open_regular` for reading, as a file object (``kwargs`` go to :func:`open`:
    ``"rb"`` unless a ``mode`` is given, e.g. ``mode="r", encoding="utf-8"``)."""
    kwargs.setdefault("mode", "rb")
    fd = open_regular(path, follow=follow)
    try:
        return open(fd, **kwargs)  # noqa: SIM115 - the caller closes it
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str | os.PathLike[str], *, follow: bool = False) -> bytes:
    """The bytes of the regular file ``path`` (:func:`open_regular`'s errors)."""
    with open_regular_file(path, follow=follow) as fh:
        data: bytes = fh.read()
    return data


def _kind_at(path: str | os.PathLike[str], follow: bool) -> str:
    try:
        return describe_kind(os.stat(path, follow_symlinks=follow).st_mode)
    except OSError:
        return "not a regular file"
