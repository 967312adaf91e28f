"""Tests for bumblebot.delivery.splitting: chunks within a platform's limit (UTF-16 on Telegram),
cut at the best boundary, never inside a character or an emoji sequence, code fences reopened."""

from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bumblebot.delivery.splitting import (
    split_markdown,
    split_text,
    utf16_len,
)

_FENCE_LINE = re.compile(r"[ \t]*(`{3,}|~{3,})(.*)")
PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --- oracles, written independently of the implementation -------------------------------------


def assert_slices(text: str, chunks: list[str]) -> None:
    """Each chunk is the next slice of ``text``; only whitespace lies between slices."""
    cursor = 0
    for chunk in chunks:
        at = _find_after_whitespace(text, chunk, cursor)
        assert at is not None, f"chunk {chunk!r} is not the next slice after {cursor}"
        cursor = at + len(chunk)
    assert not text[cursor:].strip()


def _find_after_whitespace(text: str, piece: str, cursor: int) -> int | None:
    at = text.find(piece, cursor)
    if at == -1 or text[cursor:at].strip():
        return None
    return at


def open_fence(chunk: str) -> str | None:
    """The fence left open at the end of ``chunk`` (CommonMark closing rule), or ``None``."""
    opened: str | None = None
    for line in chunk.split("\n"):
        m = _FENCE_LINE.fullmatch(line)
        if not m:
            continue
        run, rest = m.groups()
        if opened is None:
            if not (run[0] == "`" and "`" in rest):
                opened = run
        elif run[0] == opened[0] and len(run) >= len(opened) and not rest.strip():
            opened = None
    return opened


def assert_markdown_reconstructs(text: str, chunks: list[str]) -> None:
    """Without fence lines (added or original), the chunks are the text's slices in order.

    Fence lines are removed everywhere because the splitter adds closers and reopeners and may
    drop a closer that only whitespace precedes; balance is checked separately.
    """

    def without_fences(s: str) -> str:
        return "\n".join(line for line in s.split("\n") if not _FENCE_LINE.fullmatch(line))

    pieces = [without_fences(chunk).strip() for chunk in chunks]
    assert_slices(without_fences(text), [piece for piece in pieces if piece])


def assert_well_formed(chunks: list[str], limit: int, measure=len) -> None:
    for chunk in chunks:
        assert chunk.strip(), "empty or whitespace-only chunk"
        assert measure(chunk) <= limit, (measure(chunk), limit, chunk)


# --- split_text --------------------------------------------------------------------------------


def test_whitespace_only_and_empty_give_no_chunks():
    assert split_text("", 10) == []
    assert split_text(" \n\n\t ", 10) == []


def test_short_text_is_one_chunk_without_outer_blank_lines():
    assert split_text("\n\n  hello\nworld  \n", 100) == ["  hello\nworld"]


def test_limit_must_be_positive():
    with pytest.raises(ValueError):
        split_text("abc", 0)


def test_a_character_larger_than_the_limit_raises():
    with pytest.raises(ValueError):
        split_text("😀", 1, measure=utf16_len)


def test_prefers_paragraph_over_line_break():
    text = "a" * 30 + "\n\n" + "b" * 10 + "\n" + "c" * 10 + "\n" + "d" * 30
    assert split_text(text, 60) == ["a" * 30, "b" * 10 + "\n" + "c" * 10 + "\n" + "d" * 30]


def test_prefers_line_break_over_sentence_end():
    text = "First sentence. Second one\nthird line here and more words"
    assert split_text(text, 40) == ["First sentence. Second one", "third line here and more words"]


def test_prefers_sentence_end_over_space():
    text = "One two three four. Five six seven eight nine ten"
    assert split_text(text, 30) == ["One two three four.", "Five six seven eight nine ten"]


def test_space_cut_drops_only_the_space():
    assert split_text("alpha beta gamma delta", 11) == ["alpha beta", "gamma delta"]


def test_hard_cut_without_whitespace():
    assert split_text("x" * 25, 10) == ["x" * 10, "x" * 10, "x" * 5]


def test_a_boundary_early_in_the_window_loses_to_a_later_lesser_one():
    # The paragraph break would leave a 3-char chunk; the later line break fills the window.
    text = "Hi!\n\n" + "word " * 8 + "\n" + "tail " * 10
    chunks = split_text(text, 50)
    assert chunks[0] == "Hi!\n\n" + ("word " * 8).rstrip()
    assert_slices(text, chunks)


def test_indentation_after_a_line_cut_is_kept():
    text = "def f():\n    return 1\n    return 2"
    assert split_text(text, 22) == ["def f():\n    return 1", "    return 2"]


def test_utf16_measure_counts_emoji_twice():
    assert utf16_len("a😀é") == 4
    assert split_text("😀" * 10, 5, measure=utf16_len) == ["😀😀"] * 5


def test_hard_cut_keeps_skin_tone_and_zwj_sequences_whole():
    thumbs = "👍🏽"  # two code points
    assert split_text(thumbs * 5, 3) == [thumbs] * 5
    family = "👨\u200d👩\u200d👧"  # five code points
    assert split_text(family * 3, 7) == [family] * 3
    flags = "🇵🇹🇧🇷🇯🇵"  # three flags, two regional indicators each
    assert split_text(flags, 3) == ["🇵🇹", "🇧🇷", "🇯🇵"]


def test_telegram_9000_characters_with_newlines_keeps_every_line():
    lines = [f"line {i:04d} " + "lorem ipsum dolor sit amet " * 2 for i in range(140)]
    text = "\n".join(line.rstrip() for line in lines)
    assert 8500 < len(text) < 10000
    chunks = split_text(text, 4096, measure=utf16_len)
    assert len(chunks) == 3
    assert_well_formed(chunks, 4096, utf16_len)
    assert "\n".join(chunks) == text  # only the newline at each cut is dropped


def test_emoji_heavy_reply_fits_telegram_in_utf16():
    text = ("🎉 party " * 300 + "\n") * 3
    chunks = split_text(text, 4096, measure=utf16_len)
    assert len(chunks) > 2
    assert_well_formed(chunks, 4096, utf16_len)
    assert_slices(text, chunks)


_ALPHABET = st.sampled_from(
    list("ab c.!?\n\n\t") + ["😀", "é", "e\u0301", "。", "👍🏽", "\r\n", "🇵🇹", "\u200d"]
)


@PROPERTY
@given(
    text=st.lists(_ALPHABET, max_size=300).map("".join),
    limit=st.integers(min_value=2, max_value=60),
    measure=st.sampled_from([len, utf16_len]),
)
def test_split_text_properties(text, limit, measure):
    chunks = split_text(text, limit, measure=measure)
    assert_well_formed(chunks, limit, measure)
    assert_slices(text, chunks)
    leading = len(text) - len(text.lstrip())
    body = text[text.rfind("\n", 0, leading) + 1 :].rstrip()  # indentation is kept
    if body and measure(body) <= limit:
        assert chunks == [body]


# --- split_markdown ----------------------------------------------------------------------------


def test_a_code_block_across_the_discord_limit_is_closed_and_reopened():
    prose = "Here is the script you asked for, with comments explaining each step.\n" * 5
    code = "\n".join(f"    result_{i:03d} = compute(value_{i:03d})  # step {i}" for i in range(44))
    text = prose + "\n```python\n" + code + "\n```\n\nRun it with `python script.py`. " + "x" * 60
    assert 2400 < len(text) < 2700
    chunks = split_markdown(text, 2000)
    assert len(chunks) == 2
    assert_well_formed(chunks, 2000)
    assert all(open_fence(chunk) is None for chunk in chunks)
    assert chunks[0].endswith("\n```")
    assert chunks[1].startswith("```python\n    result_")
    assert_markdown_reconstructs(text, chunks)


def test_block_that_fits_moves_whole_to_the_next_chunk():
    text = "intro " * 10 + "\n\n```\n" + "code line\n" * 5 + "```\nafter"
    chunks = split_markdown(text, 100)
    assert chunks[1].startswith("```\ncode line")
    assert all(open_fence(chunk) is None for chunk in chunks)
    assert_markdown_reconstructs(text, chunks)


def test_tilde_fence_and_longer_fence_runs_are_reopened_verbatim():
    text = "~~~~sh\n" + "echo hello world\n" * 10 + "~~~~"
    chunks = split_markdown(text, 60)
    assert len(chunks) > 2
    assert all(c.startswith("~~~~sh\necho") and c.endswith("\n~~~~") for c in chunks)
    assert_well_formed(chunks, 60)
    assert_markdown_reconstructs(text, chunks)


def test_unclosed_fence_is_closed_in_the_last_chunk():
    assert split_markdown("look:\n```py\nprint(1)", 100) == ["look:\n```py\nprint(1)\n```"]


def test_fence_with_utf16_measure_counts_added_lines():
    text = "```\n" + "😀 " * 100 + "\n```"
    chunks = split_markdown(text, 50, measure=utf16_len)
    assert_well_formed(chunks, 50, utf16_len)
    assert all(open_fence(chunk) is None for chunk in chunks)
    assert_markdown_reconstructs(text, chunks)


def test_opener_longer_than_the_limit_is_handled():
    text = "```" + "x" * 50 + "\ncode\n```\nafter"
    chunks = split_markdown(text, 30)
    assert_well_formed(chunks, 30)
    assert all(open_fence(chunk) is None for chunk in chunks)
    visible = "".join(c.replace("```", "") for c in chunks)
    assert visible.replace("\n", "") == ("x" * 50 + "code" + "after")


def test_a_fence_too_long_to_carry_is_split_as_plain_text():
    assert split_markdown("```\ncode\n```", 6) == split_text("```\ncode\n```", 6)
    # model output: a line of 5000 tildes then text (it used to raise, and the outbox retried it
    # for ever); every character still arrives, in chunks within the limit
    text = "~" * 5000 + "\n" + "a" * 9000
    chunks = split_markdown(text, 4096)
    assert all(len(c) <= 4096 for c in chunks)
    assert "".join(chunks).replace("\n", "") == text.replace("\n", "")


def test_plain_markdown_matches_split_text():
    text = "para one is here.\n\npara two is here and longer. " * 5
    assert split_markdown(text, 70) == split_text(text, 70)


_PROSE_LINE = st.text(alphabet=st.sampled_from(list("abc .!?") + ["😀"]), min_size=1, max_size=50)
_CODE_LINE = st.text(alphabet=st.sampled_from(list("xyz =()  ") + ["é"]), max_size=40)


@st.composite
def markdown(draw) -> str:
    blocks = []
    for _ in range(draw(st.integers(min_value=1, max_value=6))):
        if draw(st.booleans()):
            blocks.append("\n".join(draw(st.lists(_PROSE_LINE, min_size=1, max_size=4))))
        else:
            fence = draw(st.sampled_from(["```", "~~~", "````"]))
            info = draw(st.sampled_from(["", "python", "js title"]))
            body = "\n".join(draw(st.lists(_CODE_LINE, max_size=8)))
            blocks.append(f"{fence}{info}\n{body}\n{fence}")
    return draw(st.sampled_from(["\n\n", "\n"])).join(blocks)


@PROPERTY
@given(text=markdown(), limit=st.integers(min_value=16, max_value=120),
       measure=st.sampled_from([len, utf16_len]))  # fmt: skip
def test_split_markdown_properties(text, limit, measure):
    chunks = split_markdown(text, limit, measure=measure)
    assert_well_formed(chunks, limit, measure)
    assert all(open_fence(chunk) is None for chunk in chunks), chunks
    assert_markdown_reconstructs(text, chunks)
