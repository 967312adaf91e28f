"""A file the entity sends, copied out of the workspace before it is queued.

The ``send_file`` tool checks its path inside the workspace, but the outbox sends the file
later: at once, after a platform's ``retry_after``, or after a restart. A command in the
workspace could swap the file for a link to the database or to ``/proc/self/environ`` in
between, and the upload would follow it. So the file is copied, once, into
``<data_dir>/media/outgoing/``: opened without following a link in its last part, without
blocking (a pipe is refused, not waited on), checked to be a regular file, and checked to be
the very file the tool resolved (its path as the kernel sees the open descriptor, so a folder
swapped for a link on the way is caught too). The outbox sends the copy and deletes it once
sent.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from pathlib import Path

from bumblebot.core.regular import open_regular

#: Under the media directory: copies of the files queued to be sent.
OUTGOING = "outgoing"


class StagingError(ValueError):
    """The file cannot be sent as it is (the message is for the model)."""


class FileTooLarge(StagingError):
    """The file is ``size`` bytes, over the ``limit`` the chat takes."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"the file is {size} bytes, over the {limit} this chat takes")
        self.size, self.limit = size, limit


def stage_file(path: Path, into: Path, max_bytes: int) -> Path:
    """A private copy of the regular file ``path`` (absolute, resolved) in the folder ``into``.

    Raises:
        StagingError: it is no longer a regular file at that path (a link, a pipe, gone), or it
            is larger than ``max_bytes`` (nothing is copied: a sparse file of terabytes costs
            nothing in the workspace and would fill the disk here).
        OSError: the copy could not be written.
    """
    try:
        fd = open_regular(path)
    except OSError as exc:
        raise StagingError(f"{path.name} cannot be opened ({exc.strerror or exc})") from None
    with os.fdopen(fd, "rb") as source:
        opened = Path(os.readlink(f"/proc/self/fd/{fd}")) if Path("/proc/self/fd").is_dir() else path
        if opened != path:
            raise StagingError(f"{path.name} changed while it was being sent; send it again")
        size = os.fstat(fd).st_size
        if size > max_bytes:
            raise FileTooLarge(size, max_bytes)
        into.mkdir(mode=0o700, parents=True, exist_ok=True)
        copy = into / f"file-{secrets.token_hex(8)}{''.join(path.suffixes[-1:])}"
        with open(copy, "xb") as target:
            shutil.copyfileobj(source, target)
            if target.tell() > max_bytes:  # it grew while it was copied
                copy.unlink()
                raise StagingError(f"{path.name} changed while it was being sent; send it again")
    return copy


def delete_unwanted(folder: Path, wanted: set[str]) -> int:
    """Delete the copies in ``folder`` whose paths are not in ``wanted`` (no pending row sends
    them); returns how many."""
    deleted = 0
    for path in folder.iterdir() if folder.is_dir() else ():
        if str(path) not in wanted:
            with contextlib.suppress(OSError):
                path.unlink()
                deleted += 1
    return deleted
