"""knowledge.md (bumblebot/cognition/knowledge.py): sections, locked sections, deduplicated atomic
appends, and a file with bytes that are not UTF-8."""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import threading
from pathlib import Path

import pytest

from conftest import running, write_config
from fakes.openai_server import is_loop
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import judges_say_done, say

from bumblebot.cognition.knowledge import (
    SEED,
    KnowledgeFile,
    Section,
    clean_body,
    clean_title,
    normalize_title,
)

DOC = """# Knowledge
Preamble line.

## [LOCKED] About yourself
I am Bumble.
Keep this.

## User prefs
Likes tea.

```md
## not a heading inside a fence
```
## Empty
"""


def test_sections_titles_and_locks(tmp_path: Path) -> None:
    path = tmp_path / "knowledge.md"
    path.write_text(DOC)
    k = KnowledgeFile(path)
    assert k.sections() == [
        Section("[LOCKED] About yourself", "I am Bumble.\nKeep this.", True),
        Section("User prefs", "Likes tea.\n\n```md\n## not a heading inside a fence\n```", False),
        Section("Empty", "", False),
    ]
    assert k.titles() == ["[LOCKED] About yourself", "User prefs", "Empty"]
    assert k.read() == DOC


def test_missing_file_is_created_with_the_seed(tmp_path: Path) -> None:
    path = tmp_path / "entity" / "knowledge.md"
    k = KnowledgeFile(path)
    assert k.read() == SEED and path.read_text() == SEED
    assert k.sections() == []
    assert k.append_sections([("First", "fact")]) == ["First"]
    assert path.read_text() == "# Knowledge\n\n## First\nfact\n"


async def test_a_named_pipe_in_place_of_a_knowledge_file_is_an_error_not_a_wait(tmp_path: Path) -> None:
    """A named pipe where the file should be: reading it waited for ever for a writer (in a
    worker thread, or on the event loop where the prompt is built)."""
    path = tmp_path / "knowledge.md"
    os.mkfifo(path)
    try:
        with pytest.raises(OSError, match="not a regular file"):
            await asyncio.wait_for(asyncio.to_thread(KnowledgeFile(path).read), 10)
        with pytest.raises(OSError, match="not a regular file"):
            await asyncio.wait_for(asyncio.to_thread(KnowledgeFile(path).append_sections, [("Fact", "kept")]), 10)
    finally:  # a thread a failing test left stuck opening it goes on
        with contextlib.suppress(OSError):
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    assert stat.S_ISFIFO(os.lstat(path).st_mode)


def test_append_dedupes_and_respects_locked_sections(tmp_path: Path) -> None:
    path = tmp_path / "knowledge.md"
    path.write_text(DOC)
    k = KnowledgeFile(path)
    added = k.append_sections(
        [
            ("New fact", "body 1"),
            ("  new   FACT ", "dup of the item above"),
            ("user prefs", "dup of an existing title"),
            ("[locked] Rules", "must never be added"),
            ("About Yourself", "shadow of a locked title"),
            ("[Locked] about yourself", "overwrite attempt"),
            ("", "no title"),
            ("No body", "   "),
            ("## Multi\nline   title", "first\n## sneaky heading\n# h1\n### fine"),
        ]
    )
    assert added == ["New fact", "Multi line title"]
    text = path.read_text()
    assert text.startswith(DOC)  # existing text untouched
    assert text[len(DOC) :] == (
        "\n## New fact\nbody 1\n\n"
        "## Multi line title\nfirst\n### sneaky heading\n### h1\n### fine\n"
    )
    assert [s.title for s in k.sections()] == [
        "[LOCKED] About yourself",
        "User prefs",
        "Empty",
        "New fact",
        "Multi line title",
    ]
    assert k.append_sections([("new fact", "again")]) == []
    assert path.read_text() == text


def test_no_write_when_nothing_is_new(tmp_path: Path) -> None:
    path = tmp_path / "knowledge.md"
    path.write_text(DOC)
    before = path.stat().st_mtime_ns, path.stat().st_ino
    assert KnowledgeFile(path).append_sections([("user PREFS", "x")]) == []
    assert (path.stat().st_mtime_ns, path.stat().st_ino) == before


def test_write_is_atomic_and_leaves_no_temp_files(tmp_path: Path) -> None:
    path = tmp_path / "knowledge.md"
    path.write_text(DOC)
    os.chmod(path, 0o640)
    inode = path.stat().st_ino
    KnowledgeFile(path).append_sections([("A", "b")])
    assert path.stat().st_ino != inode  # replaced, not rewritten in place
    assert path.stat().st_mode & 0o777 == 0o600  # the owner's permissions kept, the group's dropped
    assert sorted(p.name for p in tmp_path.iterdir()) == ["knowledge.md"]


def test_failed_write_keeps_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "knowledge.md"
    path.write_text(DOC)
    os.chmod(tmp_path, 0o500)  # directory not writable: no temp file can be created
    try:
        if os.access(tmp_path, os.W_OK):  # running as root: make the target a directory instead
            os.chmod(tmp_path, 0o700)
            target = tmp_path / "as_dir"
            target.mkdir()
            k = KnowledgeFile(target)
        else:
            k = KnowledgeFile(path)
        try:
            k.append_sections([("A", "b")])
        except OSError:
            pass
        else:
            raise AssertionError("append_sections should have raised OSError")
    finally:
        os.chmod(tmp_path, 0o700)
    assert path.read_text() == DOC
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_fingerprint_changes_with_content(tmp_path: Path) -> None:
    k = KnowledgeFile(tmp_path / "knowledge.md")
    first = k.fingerprint()
    assert first == k.fingerprint() and len(first) == 64
    k.append_sections([("A", "b")])
    assert k.fingerprint() != first


def test_concurrent_appends_from_threads_lose_nothing(tmp_path: Path) -> None:
    path = tmp_path / "knowledge.md"
    start = threading.Barrier(8)

    def worker(n: int) -> None:
        k = KnowledgeFile(path)  # separate instances share the per-path lock
        start.wait(timeout=10)
        for i in range(10):
            k.append_sections([(f"T{n}-{i}", "x"), ("shared", f"from {n}")])

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    titles = KnowledgeFile(path).titles()
    assert sorted(titles) == sorted([f"T{n}-{i}" for n in range(8) for i in range(10)] + ["shared"])


def test_unclosed_fence_in_a_body_does_not_hide_later_sections(tmp_path: Path) -> None:
    k = KnowledgeFile(tmp_path / "knowledge.md")
    assert k.append_sections([("Code", "```python\nprint(1)"), ("After", "x")]) == ["Code", "After"]
    assert k.titles() == ["Code", "After"]
    assert k.append_sections([("after", "dup")]) == []


def test_normalize_title() -> None:
    assert normalize_title("  User \t PREFS ") == normalize_title("user prefs") == "user prefs"
    assert normalize_title("[LOCKED]  About  you") == "about you"


titles = st.text(st.characters(codec="utf-8", exclude_categories=["Cs", "Cc"]), max_size=20)
bodies = st.lists(
    st.one_of(
        st.characters(codec="utf-8", exclude_categories=["Cs"]),
        st.sampled_from(["\n", "#", "```", " "]),
    ),
    max_size=30,
).map("".join)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(st.tuples(titles, bodies), max_size=8), st.lists(st.tuples(titles, bodies), max_size=8)
)
def test_appends_round_trip_without_duplicates(
    tmp_path: Path, first: list[tuple[str, str]], second: list[tuple[str, str]]
) -> None:
    path = tmp_path / "knowledge.md"
    path.write_text("# Knowledge\n\n## [locked] Core\nfixed\n")
    k = KnowledgeFile(path)
    added = k.append_sections(first) + k.append_sections(second)
    sections = k.sections()
    assert sections[0] == Section("[locked] Core", "fixed", True)
    assert [s.title for s in sections[1:]] == added
    keys = [normalize_title(s.title) for s in sections]
    assert len(keys) == len(set(keys)) and all(keys)
    assert not any(s.locked for s in sections[1:])
    for s in sections[1:]:  # each body is the cleaned body of the first valid item with that title
        expected = next(
            clean_body(b)
            for t, b in first + second
            if normalize_title(clean_title(t)) == normalize_title(s.title) and clean_body(b)
        )
        assert s.body == expected


# -- through the whole daemon ------------------------------------------------------------------


async def test_unreadable_knowledge_bytes_do_not_silence_the_bot(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(say("still answering"), when=is_loop)
    config = write_config(tmp_path, llm, tg)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "knowledge.md").write_bytes(b"# Knowledge\n\n## Caf\xe9\nLatin-1 edit\n")
    async with running(config) as d:
        tg.push_text("hi", chat_id=24)
        await tg.wait_for("sendMessage")
        await d.engine.wait_for_turns(1)
        pending = await d.store.pending_inbound()
    assert tg.sent(24) == ["still answering"] and pending == []
