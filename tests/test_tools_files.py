"""File tools (tools/files.py): confinement to the workspace (no path, symlink or search escapes
it) and their limits."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from bumblebot.core.toolkit import ToolContext, ToolResult
from tools.files import (
    FILE_TOOLS,
    MAX_LIST_ENTRIES,
    MAX_SEARCH_MATCHES,
    READ_CAP_BYTES,
    PathEscapeError,
    resolve_in_workspace,
)
from tools.registry import Registry

SECRET = "top secret outside the workspace"


@pytest.fixture
def layout(tmp_path: Path) -> dict[str, Path]:
    """``ws/`` (the workspace) next to ``outside/`` holding a secret, plus symlinks out."""
    workspace = tmp_path / "ws"
    outside = tmp_path / "outside"
    workspace.mkdir()
    outside.mkdir()
    (outside / "secret.txt").write_text(SECRET + "\n")
    (workspace / "notes.txt").write_text("hello\nworld\n")
    (workspace / "file_link").symlink_to(outside / "secret.txt")
    (workspace / "dir_link").symlink_to(outside, target_is_directory=True)
    (workspace / "relative_link").symlink_to(Path("..") / "outside" / "secret.txt")
    (workspace / "dangling").symlink_to(outside / "created-by-tool.txt")
    (workspace / "inside_link").symlink_to(workspace / "notes.txt")
    return {"workspace": workspace, "outside": outside}


@pytest.fixture
def ctx(layout: dict[str, Path], tmp_path: Path) -> ToolContext:
    return ToolContext(workspace=layout["workspace"].resolve(), data_dir=tmp_path / "data")


@pytest.fixture
def files() -> Registry:
    return Registry(FILE_TOOLS, max_result_chars=200_000)


async def call(files: Registry, ctx: ToolContext, name: str, **args: Any) -> ToolResult:
    return await files.execute(name, json.dumps(args), ctx)


def snapshot(directory: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


ESCAPES = [
    "../outside/secret.txt",
    "../../etc/passwd",
    "/etc/passwd",
    "~/.ssh/id_rsa",
    "~root/.bashrc",
    "sub/../../outside/secret.txt",
    "file_link",
    "relative_link",
    "dir_link",
    "dir_link/secret.txt",
    "dangling",
]

OPERATIONS: list[tuple[str, dict[str, Any]]] = [
    ("read_file", {}),
    ("write_file", {"content": "pwned"}),
    ("append_file", {"content": "pwned"}),
    ("list_directory", {}),
    ("search_files", {"pattern": "secret"}),
]


@pytest.mark.parametrize("path", ESCAPES)
@pytest.mark.parametrize(("name", "extra"), OPERATIONS, ids=[op for op, _ in OPERATIONS])
async def test_every_escape_is_refused_for_every_operation(
    files: Registry,
    ctx: ToolContext,
    layout: dict[str, Path],
    name: str,
    extra: dict[str, Any],
    path: str,
) -> None:
    before = snapshot(layout["outside"])
    result = await call(files, ctx, name, path=path, **extra)
    assert not result.ok
    error = json.loads(result.content)["error"]
    assert error.startswith(f"path escapes the workspace: {path}")
    assert SECRET not in result.content
    assert snapshot(layout["outside"]) == before
    assert not (layout["outside"] / "created-by-tool.txt").exists()
    assert not (layout["workspace"] / "~").exists()


async def test_absolute_outside_path_is_refused(
    files: Registry, ctx: ToolContext, layout: dict[str, Path]
) -> None:
    secret = str(layout["outside"] / "secret.txt")
    for name, extra in OPERATIONS:
        result = await call(files, ctx, name, path=secret, **extra)
        assert not result.ok and "path escapes the workspace" in result.content
    assert (layout["outside"] / "secret.txt").read_text() == SECRET + "\n"


def test_resolve_in_workspace(layout: dict[str, Path]) -> None:
    workspace = layout["workspace"]
    root = workspace.resolve()
    assert resolve_in_workspace(workspace, ".") == root
    assert resolve_in_workspace(workspace, "") == root
    assert resolve_in_workspace(workspace, "a/../b/c.txt") == root / "b" / "c.txt"
    assert resolve_in_workspace(workspace, str(root / "notes.txt")) == root / "notes.txt"
    assert resolve_in_workspace(workspace, "inside_link") == root / "notes.txt"
    assert resolve_in_workspace(workspace, "dir~/x") == root / "dir~" / "x"
    with pytest.raises(PathEscapeError, match=r"path escapes the workspace: \.\."):
        resolve_in_workspace(workspace, "..")
    with pytest.raises(PathEscapeError):
        resolve_in_workspace(workspace, "dangling")
    with pytest.raises(ValueError, match="NUL"):
        resolve_in_workspace(workspace, "a\x00b")


async def test_symlink_loop_is_an_error(
    files: Registry, ctx: ToolContext, layout: dict[str, Path]
) -> None:
    (layout["workspace"] / "loop_a").symlink_to("loop_b")
    (layout["workspace"] / "loop_b").symlink_to("loop_a")
    result = await call(files, ctx, "read_file", path="loop_a")
    assert not result.ok


# -- allowed operations -------------------------------------------------------------------


async def test_write_then_read_round_trip(
    files: Registry, ctx: ToolContext, layout: dict[str, Path]
) -> None:
    result = await call(files, ctx, "write_file", path="deep/er/poem.txt", content="line1\nline2\n")
    assert result == ToolResult("wrote 12 bytes to deep/er/poem.txt")
    target = layout["workspace"] / "deep" / "er" / "poem.txt"
    assert target.read_text() == "line1\nline2\n"
    assert oct(target.stat().st_mode & 0o777) == oct(0o600)  # private, whatever the umask

    result = await call(files, ctx, "write_file", path="deep/er/poem.txt", content="new")
    assert result.ok and target.read_text() == "new"
    assert sorted(p.name for p in target.parent.iterdir()) == ["poem.txt"]  # no temp files

    result = await call(files, ctx, "read_file", path="deep/er/poem.txt")
    assert result == ToolResult("new")


async def test_absolute_path_inside_workspace_is_allowed(files: Registry, ctx: ToolContext) -> None:
    result = await call(files, ctx, "read_file", path=str(ctx.workspace / "notes.txt"))
    assert result == ToolResult("hello\nworld\n")


async def test_symlink_inside_the_workspace_is_followed(
    files: Registry, ctx: ToolContext, layout: dict[str, Path]
) -> None:
    assert await call(files, ctx, "read_file", path="inside_link") == ToolResult("hello\nworld\n")
    result = await call(files, ctx, "append_file", path="inside_link", content="more\n")
    assert result.ok
    assert (layout["workspace"] / "notes.txt").read_text() == "hello\nworld\nmore\n"
    assert (layout["workspace"] / "inside_link").is_symlink()


async def test_append_creates_and_appends(
    files: Registry, ctx: ToolContext, layout: dict[str, Path]
) -> None:
    assert await call(files, ctx, "append_file", path="log/a.log", content="one\n") == ToolResult(
        "appended 4 bytes to log/a.log"
    )
    await call(files, ctx, "append_file", path="log/a.log", content="two\n")
    assert (layout["workspace"] / "log" / "a.log").read_text() == "one\ntwo\n"


async def test_files_written_are_private_whatever_the_umask(
    files: Registry, ctx: ToolContext, layout: dict[str, Path]
) -> None:
    """Written and appended files are 0600 under a umask of 022; one replaced keeps only its
    owner's permissions (a script stays executable, for its owner alone)."""
    workspace = layout["workspace"]
    (workspace / "open.txt").write_text("old")
    os.chmod(workspace / "open.txt", 0o644)
    (workspace / "run.sh").write_text("echo old")
    os.chmod(workspace / "run.sh", 0o755)
    previous = os.umask(0o022)
    try:
        for name in ("new.txt", "open.txt", "run.sh"):
            assert (await call(files, ctx, "write_file", path=name, content="new")).ok
        assert (await call(files, ctx, "append_file", path="added.log", content="one\n")).ok
    finally:
        os.umask(previous)
    modes = {n: oct((workspace / n).stat().st_mode & 0o777) for n in ("new.txt", "open.txt", "run.sh", "added.log")}
    assert modes == {"new.txt": "0o600", "open.txt": "0o600", "run.sh": "0o700", "added.log": "0o600"}


async def test_write_to_a_directory_is_an_error(files: Registry, ctx: ToolContext) -> None:
    for path in (".", "dir_inside"):
        (ctx.workspace / "dir_inside").mkdir(exist_ok=True)
        result = await call(files, ctx, "write_file", path=path, content="x")
        assert not result.ok and "is a directory" in result.content


async def test_read_window_and_line_numbers(files: Registry, ctx: ToolContext) -> None:
    (ctx.workspace / "n.txt").write_text("".join(f"line {i}\n" for i in range(1, 11)))
    result = await call(files, ctx, "read_file", path="n.txt", offset_line=3, max_lines=2)
    assert result.content == (
        "line 3\nline 4\n\n[... showed lines 3-4 of n.txt; continue with offset_line=5]"
    )
    result = await call(
        files, ctx, "read_file", path="n.txt", offset_line=9, max_lines=5, line_numbers=True
    )
    assert result.content == "     9\tline 9\n    10\tline 10"
    result = await call(files, ctx, "read_file", path="n.txt", offset_line=50)
    assert not result.ok and "past the end" in result.content
    result = await call(files, ctx, "read_file", path="n.txt", max_lines=0)
    assert not result.ok and "max_lines" in result.content


async def test_read_is_capped_in_bytes(files: Registry, ctx: ToolContext) -> None:
    line = "x" * 99 + "\n"
    (ctx.workspace / "big.txt").write_text(line * 2000)  # 200 KB
    result = await call(files, ctx, "read_file", path="big.txt", max_lines=2000)
    assert result.ok
    body, footer = result.content.rsplit("\n[... ", 1)
    assert len(body.encode()) <= READ_CAP_BYTES
    shown = READ_CAP_BYTES // 100
    assert body.count("\n") == shown
    assert f"continue with offset_line={shown + 1}" in footer

    (ctx.workspace / "one_line.js").write_text("y" * (READ_CAP_BYTES * 2))
    result = await call(files, ctx, "read_file", path="one_line.js")
    assert result.ok and "longer than 64 KiB and was cut" in result.content
    assert result.content.count("y") == READ_CAP_BYTES


async def test_read_refuses_binary_missing_and_directories(
    files: Registry, ctx: ToolContext
) -> None:
    (ctx.workspace / "blob.bin").write_bytes(b"\x89PNG\x00\x01\x02")
    result = await call(files, ctx, "read_file", path="blob.bin")
    assert not result.ok and "binary" in result.content
    result = await call(files, ctx, "read_file", path="missing.txt")
    assert not result.ok and "no such file: missing.txt" in result.content
    (ctx.workspace / "d").mkdir()
    result = await call(files, ctx, "read_file", path="d")
    assert not result.ok and "is a directory" in result.content
    (ctx.workspace / "empty.txt").write_text("")
    assert await call(files, ctx, "read_file", path="empty.txt") == ToolResult("(empty file)")


async def test_list_directory_marks_kinds_and_caps(
    files: Registry, ctx: ToolContext, layout: dict[str, Path]
) -> None:
    (ctx.workspace / "sub").mkdir()
    result = await call(files, ctx, "list_directory")
    lines = result.content.splitlines()
    assert lines[0] == "./ (7 entries)"
    assert "sub/" in lines and "notes.txt" in lines and "inside_link@" in lines
    assert "dir_link@ (points outside the workspace)" in lines
    assert "file_link@ (points outside the workspace)" in lines
    assert "secret.txt" not in result.content

    many = ctx.workspace / "many"
    many.mkdir()
    for i in range(MAX_LIST_ENTRIES + 25):
        (many / f"f{i:04}").touch()
    result = await call(files, ctx, "list_directory", path="many")
    lines = result.content.splitlines()
    assert lines[0] == f"many/ ({MAX_LIST_ENTRIES + 25} entries)"
    assert len(lines) == 1 + MAX_LIST_ENTRIES + 1
    assert lines[-1] == "[... and 25 more]"

    result = await call(files, ctx, "list_directory", path="notes.txt")
    assert not result.ok and "not a directory" in result.content


async def test_search_stays_inside_and_skips_binaries(
    files: Registry, ctx: ToolContext, layout: dict[str, Path]
) -> None:
    workspace = ctx.workspace
    (workspace / "src").mkdir()
    (workspace / "src" / "a.py").write_text("x = 1\nneedle = 2\n")
    (workspace / "src" / "b.bin").write_bytes(b"needle\x00\x00")
    (workspace / "src" / "huge.txt").write_text("needle\n" + "z" * (1024 * 1024))
    (workspace / ".git").mkdir()
    (workspace / ".git" / "config").write_text("needle\n")
    (layout["outside"] / "secret.txt").write_text("needle " + SECRET)

    result = await call(files, ctx, "search_files", pattern="needle")
    assert result.content.splitlines() == ["1 matches for 'needle' in .", "src/a.py:2: needle = 2"]

    result = await call(files, ctx, "search_files", pattern=r"^x\s*=", regex=True, path="src")
    assert result.content.splitlines()[1:] == ["src/a.py:1: x = 1"]
    result = await call(files, ctx, "search_files", pattern="NEEDLE", ignore_case=True)
    assert "src/a.py:2" in result.content
    result = await call(files, ctx, "search_files", pattern="(", regex=True)
    assert not result.ok and "invalid regular expression" in result.content
    result = await call(files, ctx, "search_files", pattern="(")
    assert result.ok  # a literal search for "("


async def test_search_caps_matches(files: Registry, ctx: ToolContext) -> None:
    (ctx.workspace / "many.txt").write_text("hit\n" * (MAX_SEARCH_MATCHES + 50))
    result = await call(files, ctx, "search_files", pattern="hit", path="many.txt")
    lines = result.content.splitlines()
    assert lines[0] == f"{MAX_SEARCH_MATCHES} matches for 'hit' in many.txt (stopped at 200)"
    assert len(lines) == MAX_SEARCH_MATCHES + 1


async def test_search_does_not_follow_symlinked_directories_out(
    files: Registry, ctx: ToolContext, layout: dict[str, Path]
) -> None:
    nested = layout["outside"] / "nested"
    nested.mkdir()
    (nested / "deep.txt").write_text("needle deep\n")
    (ctx.workspace / "sub").mkdir()
    (ctx.workspace / "sub" / "link_up").symlink_to(layout["outside"], target_is_directory=True)
    os.symlink(nested / "deep.txt", ctx.workspace / "sub" / "deep_link.txt")
    result = await call(files, ctx, "search_files", pattern="needle")
    assert result.content == "0 matches for 'needle' in ."


async def test_catastrophic_regex_is_stopped_without_freezing_the_event_loop(tmp_path, monkeypatch):
    """Regression: a backtracking regex (``(a+)+$`` with ``re``; ``(a|aa)+$`` still backtracks
    exponentially with the ``regex`` module) used to hold the GIL and freeze the daemon."""
    import asyncio
    import json

    import tools.files as files
    from bumblebot.core.toolkit import ToolContext
    from tools import build_registry

    monkeypatch.setattr(files, "SEARCH_BUDGET_S", 1.0)
    workspace = tmp_path / "ws"
    registry = build_registry(workspace=workspace)
    (workspace / "evil.txt").write_text("a" * 40 + "b\n")
    ctx = ToolContext(workspace=workspace, data_dir=tmp_path)
    search = asyncio.create_task(
        registry.execute("search_files", json.dumps({"pattern": "(a|aa)+$", "regex": True}), ctx)
    )
    await asyncio.sleep(0)  # let the search start
    # a worker thread and the event loop both need the GIL, which `re` used to hold for ever
    await asyncio.wait_for(asyncio.to_thread(int), 5)
    assert not search.done()
    result = await search
    assert not result.ok and "simplify the pattern" in result.content


# -- names longer than the file system allows, and errors the model reads -----------------------


async def test_a_name_longer_than_the_file_system_allows_is_shortened_keeping_its_extension(
    files: Registry, ctx: ToolContext, caplog: pytest.LogCaptureFixture
) -> None:
    """A file name over the OS limit (255 bytes) failed the write and named the workspace's
    absolute path to the model; the name is shortened instead, its extension kept."""
    long = "ü" * 300 + ".md"
    result = await call(files, ctx, "write_file", path=f"notes/{long}", content="kept")
    assert result.ok, result.content
    [saved] = (ctx.workspace / "notes").iterdir()
    assert saved.suffix == ".md" and len(saved.name.encode()) <= 255 and saved.read_text() == "kept"
    assert result.content == f"wrote 4 bytes to notes/{saved.name}"
    appended = await call(files, ctx, "append_file", path=f"notes/{long}", content="!")
    assert appended.ok and saved.read_text() == "kept!"
    assert not [r for r in caplog.records if r.exc_info]


@pytest.mark.parametrize("name, args", [
    ("read_file", {"path": "x" * 300 + ".txt"}),
    ("list_directory", {"path": "y" * 300}),
    ("write_file", {"path": "z" * 300 + "/a.txt", "content": "c"}),
    ("read_file", {"path": "missing/file.txt"}),
])
async def test_a_failing_file_operation_names_the_path_relative_to_the_workspace(
    files: Registry, ctx: ToolContext, name: str, args: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """``_run`` formatted the OS error's ``filename``: the workspace's absolute path."""
    result = await call(files, ctx, name, **args)
    assert not result.ok
    assert str(ctx.workspace) not in result.content and str(ctx.workspace.parent) not in result.content
    assert not [r for r in caplog.records if r.exc_info]


# -- named pipes and other files that are not regular -------------------------------------------


def release(fifo: Path) -> None:
    """Open both ends of ``fifo`` once: a thread a failing test left stuck opening it goes on
    (a worker thread never released would keep the test process from exiting)."""
    for flags in (os.O_RDONLY | os.O_NONBLOCK, os.O_WRONLY | os.O_NONBLOCK):
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, flags))


async def test_a_named_pipe_in_the_workspace_is_refused_without_holding_a_thread(
    files: Registry, ctx: ToolContext, layout: dict[str, Path]
) -> None:
    """``mkfifo notes.txt`` (through run_command): read_file opened it in a worker thread and
    waited for ever for a writer (append_file for a reader); six such calls filled the default
    executor and every ``asyncio.to_thread`` of the daemon hung. Each call now answers at once,
    the search skips the pipe, and the executor (one thread here, so one stuck call would stall
    all that follow) stays free."""
    folder = layout["workspace"] / "pipes"
    folder.mkdir()
    fifo = folder / "notes.txt"
    os.mkfifo(fifo)
    (folder / "todo.txt").write_text("buy a needle\n")
    loop = asyncio.get_running_loop()
    executor = ThreadPoolExecutor(max_workers=1)
    loop.set_default_executor(executor)
    refused = "pipes/notes.txt is not a regular file (a named pipe)"
    try:
        for _ in range(3):  # more calls than a small executor has threads
            for name, extra in [
                ("read_file", {}),
                ("append_file", {"content": "x"}),
                ("write_file", {"content": "x"}),
                ("search_files", {"pattern": "needle"}),
            ]:
                result = await asyncio.wait_for(call(files, ctx, name, path="pipes/notes.txt", **extra), 10)
                assert result == ToolResult.error(refused), name
        searched = await asyncio.wait_for(call(files, ctx, "search_files", pattern="needle", path="pipes"), 10)
        assert searched == ToolResult("1 matches for 'needle' in pipes\npipes/todo.txt:1: buy a needle")
        listed = await asyncio.wait_for(call(files, ctx, "list_directory", path="pipes"), 10)
        assert listed == ToolResult("pipes/ (2 entries)\nnotes.txt (a named pipe)\ntodo.txt")
        burst = await asyncio.wait_for(asyncio.gather(*(asyncio.to_thread(lambda: 1) for _ in range(10))), 10)
        assert burst == [1] * 10
        assert stat.S_ISFIFO(os.lstat(fifo).st_mode)  # write_file did not replace it either
    finally:
        release(fifo)
        executor.shutdown(wait=False)
