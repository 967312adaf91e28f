"""Opening files without blocking (bumblebot/core/regular.py): a named pipe is refused at once,
a regular file opens as usual."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from bumblebot.core.regular import NotRegularFile, open_regular, open_regular_file, read_regular


@pytest.fixture
def fifo(tmp_path: Path) -> Iterator[Path]:
    """A named pipe nobody has open; released afterwards, so a thread a failing test left
    stuck opening it goes on (an executor thread never released keeps the process alive)."""
    path = tmp_path / "notes.txt"
    os.mkfifo(path)
    yield path
    for flags in (os.O_RDONLY | os.O_NONBLOCK, os.O_WRONLY | os.O_NONBLOCK):
        with contextlib.suppress(OSError):
            os.close(os.open(path, flags))


async def promptly(fn, *args, **kwargs):  # type: ignore[no-untyped-def]
    """``fn`` in a worker thread, bounded only as a guard: a blocking open never returns."""
    return await asyncio.wait_for(asyncio.to_thread(fn, *args, **kwargs), 10)


@pytest.mark.parametrize("flags", [os.O_RDONLY, os.O_WRONLY | os.O_APPEND | os.O_CREAT, os.O_RDWR])
async def test_a_named_pipe_with_nobody_at_the_other_end_is_refused_at_once(fifo: Path, flags: int) -> None:
    """Reading waited for a writer, writing for a reader, for ever."""
    with pytest.raises(NotRegularFile) as caught:
        await promptly(open_regular, fifo, flags)
    assert caught.value.kind == "a named pipe" and caught.value.filename == str(fifo)
    assert caught.value.strerror == "not a regular file (a named pipe)"


async def test_a_named_pipe_is_refused_by_the_readers_too(fifo: Path) -> None:
    with pytest.raises(NotRegularFile):
        await promptly(read_regular, fifo, follow=True)
    with pytest.raises(NotRegularFile):
        await promptly(open_regular_file, fifo, mode="r", encoding="utf-8")


async def test_a_symlink_is_refused_unless_followed(tmp_path: Path) -> None:
    (tmp_path / "real.txt").write_text("text")
    (tmp_path / "link.txt").symlink_to(tmp_path / "real.txt")
    with pytest.raises(NotRegularFile, match="a symlink"):
        await promptly(read_regular, tmp_path / "link.txt")
    assert await promptly(read_regular, tmp_path / "link.txt", follow=True) == b"text"


async def test_a_directory_is_refused_and_a_missing_file_is_the_usual_error(tmp_path: Path) -> None:
    with pytest.raises(NotRegularFile, match="a directory"):
        await promptly(read_regular, tmp_path)
    with pytest.raises(FileNotFoundError):
        await promptly(read_regular, tmp_path / "missing.txt")


def test_a_regular_file_opens_blocking_and_created_files_get_the_mode(tmp_path: Path) -> None:
    target = tmp_path / "log.txt"
    fd = open_regular(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        assert os.get_blocking(fd)  # O_NONBLOCK is cleared on what is handed back
        os.write(fd, b"one\n")
    finally:
        os.close(fd)
    assert target.stat().st_mode & 0o777 == 0o600
    assert read_regular(target) == b"one\n"
    with open_regular_file(target, mode="r", encoding="utf-8") as fh:
        assert fh.read() == "one\n"
