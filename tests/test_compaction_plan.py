"""Context compaction: boundaries, pruning, prompts and the compact() pass (spec, "Context
compaction"): tool groups never split, a failed summary drops nothing, locked knowledge
sections never touched."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
from pathlib import Path
from typing import ClassVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bumblebot.cognition.compaction import (
    extractive_summary,
    PLACEHOLDER,
    SUMMARY_HEADER,
    SUMMARY_HEADINGS,
    CompactionOutcome,
    FlushParseError,
    RunningEstimate,
    cap_tool_result,
    compact,
    find_boundaries,
    flush_request,
    head_end,
    parse_flush,
    prune_tool_results,
    serialize,
    summary_message,
    summary_request,
    with_summary,
)
from bumblebot.cognition.compaction_prompts import FLUSH_SYSTEM, SUMMARY_SYSTEM
from bumblebot.cognition.knowledge import KnowledgeFile
from bumblebot.cognition.sequence import validate
from bumblebot.core.messages import Message, estimate_messages

SETTINGS = settings(max_examples=120, deadline=None)
CTX = 32768
THRESHOLD = int(CTX * 0.75)
TARGET = int(CTX * 0.20)
FIXED = 1500


def call(cid: str, args: str = '{"path": "notes.txt"}') -> dict:
    return {"id": cid, "type": "function", "function": {"name": "read_file", "arguments": args}}


def numbered(msgs: list[Message]) -> list[Message]:
    for i, m in enumerate(msgs):
        m.id = i + 1
    return msgs


def conversation(turns: int, tool_chars: int = 2000, start: int = 0) -> list[Message]:
    """``turns`` turns of: user (with a FACT-n), assistant tool call, tool result, reply."""
    out: list[Message] = []
    for t in range(start, start + turns):
        out += [
            Message("user", f"Turn {t}: remember FACT-{t}. " + "u" * 380),
            Message("assistant", "", tool_calls=[call(f"c{t}")]),
            Message(
                "tool", f"result {t} " + "r" * tool_chars, tool_call_id=f"c{t}", name="read_file"
            ),
            Message("assistant", f"Reply {t} " + "a" * 380),
        ]
    return out


@st.composite
def histories(draw: st.DrawFn) -> list[Message]:
    """Valid histories of user/assistant messages and parallel tool groups, random sizes."""
    ids = itertools.count()
    out: list[Message] = []
    size = st.integers(0, 3000)
    for kind in draw(
        st.lists(st.sampled_from(["user", "assistant", "tools", "tools"]), max_size=40)
    ):
        if kind == "tools":
            group = [f"c{next(ids)}" for _ in range(draw(st.integers(1, 3)))]
            out.append(Message("assistant", "", tool_calls=[call(c) for c in group]))
            out += [
                Message("tool", "r" * draw(size), tool_call_id=c)
                for c in draw(st.permutations(group))
            ]
        else:
            out.append(Message(kind, "x" * draw(size)))
    return numbered(out)


class Model:
    """A scripted chat model: flush calls get ``flush_answer``; summary calls echo every
    FACT-n of their input under the seven headings (or fail as told)."""

    def __init__(
        self,
        flush_answer: str = "[]",
        summary_error: Exception | None = None,
        summary_text: str | None = None,
    ) -> None:
        self.flush_answer = flush_answer
        self.summary_error = summary_error
        self.summary_text = summary_text
        self.calls: list[tuple[str, list[dict], int, float]] = []

    async def __call__(self, messages: list[dict], max_tokens: int, temperature: float) -> str:
        kind = {FLUSH_SYSTEM: "flush", SUMMARY_SYSTEM: "summary"}[messages[0]["content"]]
        self.calls.append((kind, messages, max_tokens, temperature))
        if kind == "flush":
            return self.flush_answer
        if self.summary_error is not None:
            raise self.summary_error
        if self.summary_text is not None:
            return self.summary_text
        facts = sorted(
            set(re.findall(r"FACT-\d+", messages[1]["content"])), key=lambda f: int(f[5:])
        )
        body = {h: "None." for h in SUMMARY_HEADINGS}
        body["Critical Context"] = " ".join(facts) or "None."
        return "<think>plan</think>" + "\n".join(f"## {h}\n{b}" for h, b in body.items())

    def kinds(self) -> list[str]:
        return [c[0] for c in self.calls]


async def run(
    history: list[Message],
    model: Model,
    knowledge: KnowledgeFile | None = None,
    **overrides: object,
) -> CompactionOutcome:
    params: dict[str, object] = dict(
        previous_summary=None,
        complete=model,
        knowledge=knowledge,
        fixed_tokens=FIXED,
        max_context_tokens=CTX,
        threshold_ratio=0.75,
        target_ratio=0.20,
        protect_first_n=2,
        protect_last_n=12,
        max_passes=3,
        flush=True,
    )
    params.update(overrides)
    return await compact(history, **params)  # type: ignore[arg-type]


def prompt_of(out: CompactionOutcome) -> list[Message]:
    request = with_summary(out.messages, out.summary, protect_first_n=2)
    validate(request)
    return request


# --- boundaries -------------------------------------------------------------------------


@SETTINGS
@given(histories(), st.integers(0, 5), st.integers(0, 16), st.integers(0, 20000))
def test_boundaries_properties(msgs: list[Message], first: int, last: int, budget: int) -> None:
    start, end = find_boundaries(
        msgs, protect_first_n=first, protect_last_n=last, tail_token_budget=budget
    )
    n = len(msgs)
    assert 0 <= start <= end <= n
    head, middle, tail = msgs[:start], msgs[start:end], msgs[end:]
    assert head + middle + tail == msgs
    assert len(head) >= min(first, n)
    if n - start >= last:
        assert len(tail) >= last
    for cut in (start, end):  # no cut separates a tool_calls message from its results
        if 0 < cut < n:
            assert msgs[cut].role != "tool"
    # the tail is the budgeted part, grown only to reach protect_last_n or to keep a group whole
    if len(tail) > last and tail:
        first_group_end = 1
        while first_group_end < len(tail) and tail[first_group_end].role == "tool":
            first_group_end += 1
        rest = tail[first_group_end:]
        assert len(rest) <= last or estimate_messages(rest) <= budget
    # head + summary + tail is what compaction sends: valid
    validate([*head, summary_message("s" * 40), *tail])


def test_group_straddling_the_tail_cut_moves_into_the_tail() -> None:
    msgs = numbered(
        [Message("user", "q"), Message("assistant", "a")]
        + [Message("user", f"m{i}") for i in range(5)]
        + [Message("assistant", "", tool_calls=[call("p1"), call("p2"), call("p3")])]
        + [Message("tool", "r", tool_call_id=c) for c in ("p2", "p3", "p1")]
        + [Message("user" if i % 2 else "assistant", f"t{i}") for i in range(10)]
    )
    start, end = find_boundaries(msgs, protect_first_n=2, protect_last_n=12, tail_token_budget=0)
    assert start == 2
    assert msgs[end].tool_calls and len(msgs) - end == 14  # 12 wanted; the cut fell in the group


def test_head_is_extended_past_its_tool_group() -> None:
    msgs = numbered(
        [
            Message("user", "q"),
            Message("assistant", "", tool_calls=[call("a"), call("b")]),
            Message("tool", "x", tool_call_id="a"),
            Message("tool", "y", tool_call_id="b"),
        ]
        + [Message("user", f"u{i}") for i in range(20)]
    )
    start, _ = find_boundaries(msgs, protect_first_n=2, protect_last_n=12, tail_token_budget=0)
    assert start == 4


class CountingMessage(Message):
    """A Message that counts reads of its token estimate."""

    reads: ClassVar[list[int]] = []

    @property
    def tokens(self) -> int:  # type: ignore[override]
        CountingMessage.reads.append(1)
        return Message.tokens.fget(self)  # type: ignore[attr-defined]


def test_boundaries_read_only_head_and_tail_estimates() -> None:
    msgs = [CountingMessage("user" if i % 2 else "assistant", "z" * 400) for i in range(100_000)]
    CountingMessage.reads.clear()
    start, end = find_boundaries(msgs, protect_first_n=2, protect_last_n=12, tail_token_budget=3000)
    assert start == 2 and len(msgs) - end == 27  # 27 * 110 tokens fit 3000
    assert len(CountingMessage.reads) <= 30


def test_running_estimate_matches_full_estimate() -> None:
    msgs = conversation(5)
    est = RunningEstimate(msgs[:3])
    for m in msgs[3:]:
        est.add(m)
    assert est.total == estimate_messages(msgs)
    assert est.remove(msgs[0]) == estimate_messages(msgs[1:])


# --- prune, cap, serialize --------------------------------------------------------------


def test_prune_replaces_long_old_results_only() -> None:
    msgs = numbered(
        [
            Message("assistant", "", tool_calls=[call("a"), call("b")]),
            Message("tool", "L" * 201, tool_call_id="a"),
            Message("tool", "s" * 200, tool_call_id="b"),
            Message("user", "U" * 5000),
            Message("assistant", "", tool_calls=[call("c")]),
            Message("tool", "T" * 5000, tool_call_id="c"),
        ]
    )
    out, pruned = prune_tool_results(msgs, tail_start=4)
    assert pruned == [1]
    assert (
        out[1].content == PLACEHOLDER
        and out[1].pruned
        and out[1].id == 2
        and out[1].tool_call_id == "a"
    )
    assert out[1].tokens < msgs[1].tokens
    assert all(out[i] is msgs[i] for i in (0, 2, 3, 4, 5))  # short, non-tool and tail: kept
    assert msgs[1].content == "L" * 201  # input untouched
    again, pruned_again = prune_tool_results(out, tail_start=6, min_chars=10)
    assert pruned_again == [2, 5] and again[1] is out[1]  # already pruned: left alone


@given(st.text(max_size=3000), st.integers(0, 4000))
@settings(max_examples=200, deadline=None)
def test_cap_tool_result_keeps_head_and_tail(text: str, max_chars: int) -> None:
    capped = cap_tool_result(text, max_chars)
    if len(text) <= max_chars:
        assert capped == text
        return
    assert len(capped) <= max_chars
    if max_chars >= 200:
        head, _, rest = capped.partition("\n[... ")
        cut, _, tail = rest.partition(" characters cut ...]\n")
        assert text.startswith(head) and text.endswith(tail) and len(head) >= len(tail) > 0
        assert int(cut) == len(text) - len(head) - len(tail)


def test_cap_tool_result_example() -> None:
    text = "HEAD" + "x" * 10_000 + "TAIL"
    capped = cap_tool_result(text, 1000)
    assert capped.startswith("HEAD") and capped.endswith("TAIL") and "characters cut" in capped


def test_serialize_labels_roles_and_caps() -> None:
    msgs = [
        Message("user", "hello"),
        Message("assistant", "let me look", tool_calls=[call("a", "A" * 1000)]),
        Message("tool", "B" * 5000, tool_call_id="a", name="read_file"),
    ]
    text = serialize(msgs)
    assert "USER: hello" in text and "ASSISTANT: let me look" in text
    assert f"ASSISTANT CALLS: read_file({'A' * 400}...)" in text and "A" * 401 not in text
    assert (
        "TOOL RESULT (read_file): "
        + "B" * 2000
        + "\n[... 2200 characters omitted ...]\n"
        + "B" * 800
        in text
    )


def test_summary_request_updates_the_previous_summary_verbatim() -> None:
    previous = "## Goal\nShip v1\n## Critical Context\nFACT-1 and    odd   spacing"
    req = summary_request([Message("user", "more")], previous, 1500)
    assert [m["role"] for m in req] == ["system", "user"]
    assert previous in req[1]["content"] and "Update the existing summary" in req[1]["content"]
    assert all(f"## {h}" in req[0]["content"] for h in SUMMARY_HEADINGS)
    fresh = summary_request([Message("user", "more")], None, 1500)
    assert "existing summary" not in fresh[1]["content"] and "1500" in fresh[1]["content"]


def test_summary_message_is_never_truncated() -> None:
    text = "## Goal\n" + "g" * 50_000
    m = summary_message(text)
    assert m.role == "user" and m.content == SUMMARY_HEADER + text


def test_flush_request_lists_existing_titles() -> None:
    req = flush_request([Message("user", "I like tea")], ["User prefs", "[locked] About yourself"])
    assert "- User prefs" in req[1]["content"] and "I like tea" in req[1]["content"]


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        ('[{"title": "A", "body": "b"}]', [("A", "b")]),
        ('Sure!\n```json\n[{"title": " A ", "body": "b"}]\n```\nDone.', [("A", "b")]),
        ('<think>[maybe]</think>Facts [see below]: [{"title": "A", "body": "b"}] ok', [("A", "b")]),
        (
            '[{"title": "", "body": "b"}, {"title": "T"}, {"title": "X", "body": 3}, '
            '{"title": "Y", "body": "y"}]',
            [("Y", "y")],
        ),
        ("[]", []),
    ],
)
def test_parse_flush_accepts(answer: str, expected: list[tuple[str, str]]) -> None:
    assert parse_flush(answer) == expected


@pytest.mark.parametrize(
    "answer", ["not json", '{"title": "A", "body": "b"}', '["a", "b"]', "[{broken"]
)
def test_parse_flush_rejects(answer: str) -> None:
    with pytest.raises(FlushParseError):
        parse_flush(answer)


# --- compact() --------------------------------------------------------------------------


async def test_under_threshold_nothing_happens() -> None:
    history = numbered(conversation(3))
    model = Model()
    out = await run(history, model)
    assert out.passes == 0 and model.calls == [] and out.messages == history
    assert out.estimate_before == out.estimate_after == FIXED + estimate_messages(history)


async def test_crossing_the_threshold_flushes_then_summarises(tmp_path: Path) -> None:
    history = numbered(conversation(40))
    assert FIXED + estimate_messages(history) > THRESHOLD
    model = Model(flush_answer='[{"title": "User prefs", "body": "likes tea"}]')
    out = await run(history, model, KnowledgeFile(tmp_path / "knowledge.md"))
    assert model.kinds() == ["flush", "summary"]
    assert [t for _, _, _, t in model.calls] == [0.15, 0.25]
    assert out.passes == 1 and not out.summary_failed and out.error is None
    h = head_end(history, 2)
    assert h == 3  # the first 2 messages, extended past the tool result of the second
    assert [m.id for m in out.messages[:h]] == [1, 2, 3] and out.messages[:2] == history[:2]
    tail = out.messages[h:]
    assert len(tail) >= 12 and tail == history[len(history) - len(tail) :]
    assert out.covered_ids == [m.id for m in history[h : len(history) - len(tail)]]
    assert all(h in out.summary for h in SUMMARY_HEADINGS) and "<think>" not in out.summary
    assert "FACT-1 " in out.summary  # a fact of the middle reached the summary
    assert (
        out.estimate_after
        == FIXED + estimate_messages(out.messages) + summary_message(out.summary).tokens
    )
    assert out.estimate_after <= TARGET < THRESHOLD
    assert out.flushed == ["User prefs"]
    request = prompt_of(out)
    assert request[h].content.startswith(SUMMARY_HEADER)


async def test_second_compaction_updates_the_first_summary(tmp_path: Path) -> None:
    model = Model()
    first = await run(numbered(conversation(40)), model)
    assert "FACT-3 " in first.summary
    grown = first.messages + conversation(40, start=100)
    second = await run(grown, model, previous_summary=first.summary, force=True)
    assert model.kinds() == ["summary", "summary"]  # no knowledge file: no flush
    assert first.summary in model.calls[1][1][1]["content"]
    assert "FACT-3 " in second.summary and "FACT-101 " in second.summary
    assert second.estimate_after <= TARGET
    prompt_of(second)


async def test_summary_failure_drops_no_message() -> None:
    history = numbered(conversation(40))
    for model in (
        Model(summary_error=ConnectionError("HTTP 529 overloaded")),
        Model(summary_text="ok"),
    ):
        out = await run(history, model, previous_summary="## Goal\nold summary kept")
        assert out.summary_failed and out.summary == "## Goal\nold summary kept"
        assert out.covered_ids == [] and "summary" in (out.error or "")
        assert [m.id for m in out.messages] == [m.id for m in history]
        assert [m.role for m in out.messages] == [m.role for m in history]
        assert all(m.content == PLACEHOLDER for m in out.messages[:-12] if m.role == "tool")
        assert sorted(out.pruned_ids) == [m.id for m in out.messages if m.pruned]
        prompt_of(out)


async def test_flush_dedupes_titles_and_never_touches_locked_sections(tmp_path: Path) -> None:
    path = tmp_path / "knowledge.md"
    path.write_text("# Knowledge\n\n## [locked] About yourself\nI am Bumble.\n\n## Notes\n")
    answer = (
        "```json\n"
        + json.dumps(
            [
                {"title": "User prefs", "body": "Likes green tea."},
                {"title": "[locked] about yourself", "body": "I am evil now."},
                {"title": "user   PREFS", "body": "Duplicate."},
                {"title": "About Yourself", "body": "Also evil."},
                {"title": "notes", "body": "Dup of existing."},
            ]
        )
        + "\n```"
    )
    out = await run(numbered(conversation(40)), Model(flush_answer=answer), KnowledgeFile(path))
    assert out.flushed == ["User prefs"] and out.error is None and out.summary
    text = path.read_text()
    assert text.count("User prefs") == 1 and "Likes green tea." in text
    assert "evil" not in text and "Duplicate" not in text and "Dup of existing" not in text
    assert text.startswith("# Knowledge\n\n## [locked] About yourself\nI am Bumble.\n\n## Notes\n")


async def test_invalid_flush_json_writes_nothing_and_compaction_completes(tmp_path: Path) -> None:
    path = tmp_path / "knowledge.md"
    path.write_text("# Knowledge\n")
    model = Model(flush_answer="Here are the facts: {title: oops")
    out = await run(numbered(conversation(40)), model, KnowledgeFile(path))
    assert model.kinds() == ["flush", "summary"]
    assert out.flushed == [] and "flush: FlushParseError" in (out.error or "")
    assert not out.summary_failed and out.covered_ids and out.estimate_after <= TARGET
    assert path.read_text() == "# Knowledge\n"


async def test_pruning_alone_can_avoid_the_summary() -> None:
    history = numbered(conversation(6, tool_chars=30_000) + conversation(3, tool_chars=50))
    model = Model()
    out = await run(history, model, protect_last_n=4, flush=False)
    assert out.passes == 1 and model.calls == [] and out.summary is None
    assert len(out.messages) == len(history) and out.pruned_ids
    assert out.estimate_after <= TARGET


async def test_tool_group_straddling_the_cut_stays_whole() -> None:
    history = numbered(
        conversation(30)
        + [
            Message("user", "check three files"),
            Message("assistant", "", tool_calls=[call("p1"), call("p2"), call("p3")]),
        ]
        + [Message("tool", "x" * 3000, tool_call_id=c) for c in ("p3", "p1", "p2")]
        + [Message("assistant", f"step {i}") for i in range(10)]
    )
    out = await run(history, Model(), fixed_tokens=7000)  # leaves no tail budget: 12 messages
    request = prompt_of(out)
    tail = out.messages[3:]
    assert tail[0].tool_call_ids == ["p1", "p2", "p3"] and len(tail) == 14
    assert len(request) == 3 + 1 + 14


async def test_huge_middle_is_summarised_in_requests_that_fit_the_context() -> None:
    ctx = 6000
    history = numbered(conversation(60))  # ~29k tokens, far over a 6k context
    model = Model()
    out = await run(history, model, max_context_tokens=ctx, fixed_tokens=200, max_passes=10)
    assert out.passes > 1 and not out.summary_failed
    for _, messages, max_tokens, _ in model.calls:
        assert sum(len(m["content"]) for m in messages) // 4 + max_tokens <= ctx
    assert "FACT-1 " in out.summary and "FACT-40 " in out.summary
    assert out.estimate_after <= int(ctx * 0.2) or len(out.messages) <= 2 + 12 + 3
    prompt_of(out)


@settings(max_examples=60, deadline=None)
@given(
    histories(),
    st.integers(0, 4),
    st.integers(0, 14),
    st.integers(1, 4),
    st.sampled_from(["ok", "fail", "bad"]),
    st.booleans(),
)
def test_compact_keeps_sequences_valid_and_loses_nothing_silently(
    history: list[Message], first: int, last: int, passes: int, behaviour: str, force: bool
) -> None:
    model = Model(
        summary_error=RuntimeError("down") if behaviour == "fail" else None,
        summary_text="too short" if behaviour == "bad" else None,
    )
    out = asyncio.run(
        compact(
            history,
            previous_summary=None,
            complete=model,
            knowledge=None,
            fixed_tokens=0,
            max_context_tokens=8000,
            threshold_ratio=0.5,
            target_ratio=0.2,
            protect_first_n=first,
            protect_last_n=last,
            max_passes=passes,
            flush=True,
            force=force,
        )
    )
    validate(with_summary(out.messages, out.summary, protect_first_n=first))
    kept = [m.id for m in out.messages]
    assert kept == sorted(kept)  # order preserved
    assert sorted(kept + out.covered_ids) == [m.id for m in history]  # each message kept or covered
    assert out.passes <= passes
    assert sorted(out.pruned_ids) == [m.id for m in out.messages if m.pruned]
    if out.covered_ids:
        assert out.summary and behaviour == "ok"
    if behaviour != "ok":
        assert out.summary is None and out.covered_ids == []


def test_an_extractive_summary_shows_what_calls_said_and_keeps_the_ends():
    """A bot that speaks through ``say`` had its every message summarised as "assistant used
    say"; and a summary already full dropped the newest messages."""
    from bumblebot.cognition.compaction import extractive_summary

    call = {"id": "c1", "type": "function", "function": {"name": "say", "arguments": json.dumps({"text": "Your list has milk now"})}}
    chunk = [
        Message(role="user", content="ajoute du lait à ma liste"),
        Message(role="assistant", content="", tool_calls=[call]),
        Message(role="tool", content='{"delivered": true}', tool_call_id="c1", name="say"),
    ]
    text = extractive_summary(chunk, None, 2000)
    assert "- user: ajoute du lait à ma liste" in text
    assert "- assistant used say: Your list has milk now" in text
    assert "delivered" not in text
    full = extractive_summary([Message(role="user", content=f"message {i} " + "x" * 60) for i in range(40)], "GOAL " + "old " * 300, 600)
    assert len(full) <= 600
    assert full.startswith("GOAL old")  # the previous summary's start, at most half the room
    assert "message 39" in full and "message 0 " in full  # the newest, and the oldest: what was asked
    assert "message 20 " not in full and "- …" in full
    garbled = {"id": "c2", "type": "function", "function": {"name": "say", "arguments": "{not json"}}
    assert "- assistant used say: {not json" in extractive_summary([Message(role="assistant", content="", tool_calls=[garbled])], None, 500)


#: what a working model wrote at an earlier compaction: the user's goal and constraints
PREVIOUS = "\n".join([
    "## Goal", "- plan the user's trip to Lisbon on 12 May for their mother's 70th birthday",
    "## Constraints", "- budget 900 EUR; the mother uses a wheelchair; no flights before 10:00",
    *[f"## {h}\n- " + "detail " * 25 for h in SUMMARY_HEADINGS[2:]],
])


async def test_the_extractive_fallback_keeps_the_goal_of_the_previous_summary():
    """The newest lines took all the room and the previous summary, the person's goal first,
    was cut from its start: a chatty stretch made the conversation forget what it was for."""
    history = []
    for i in range(90):  # a chatty stretch: short messages
        history.append(Message(role="user", content=f"question {i}: and what about option {i}, is it nicer?", id=2 * i + 1))
        history.append(Message(role="assistant", content=f"answer {i}: option {i} is fine, a bit further from the centre.", id=2 * i + 2))

    async def cannot_summarise(messages, max_tokens, temperature):
        return "Here is a summary of the conversation: it was nice."  # SmolLM2: no headings

    out = await compact(
        history, previous_summary=PREVIOUS, complete=cannot_summarise, knowledge=None,
        fixed_tokens=1800, max_context_tokens=8000, threshold_ratio=0.75, target_ratio=0.4,
        protect_first_n=2, protect_last_n=12, max_passes=3, flush=False,
        extract_on_failure=True,  # the retry after a failed summary (state.failures > 0)
    )
    assert out.extractive and out.covered_ids
    assert "Lisbon" in out.summary, "the user's goal from the previous summary was dropped"
    assert "wheelchair" in out.summary


async def test_without_a_model_summary_the_extractive_fallback_keeps_the_request():
    """SmolLM2 never writes a usable summary, so no previous summary keeps the goal: the
    request, just after the protected greeting, was the oldest line of the chunk and the first
    one cut."""
    history = [Message(role="user", content="hi", id=1), Message(role="assistant", content="Hello! How can I help?", id=2),
               Message(role="user", content="Plan my trip to Lisbon on 12 May; budget 900 EUR; my mother uses a wheelchair.", id=3)]
    for i in range(90):
        history.append(Message(role="assistant", content=f"answer {i}: option {i} is fine, a bit further from the centre.", id=2 * i + 4))
        history.append(Message(role="user", content=f"question {i}: and what about option {i}, is it nicer?", id=2 * i + 5))

    async def cannot_summarise(messages, max_tokens, temperature):
        return "Here is a summary of the conversation: it was nice."

    out = await compact(
        history, previous_summary=None, complete=cannot_summarise, knowledge=None,
        fixed_tokens=1800, max_context_tokens=8000, threshold_ratio=0.75, target_ratio=0.4,
        protect_first_n=2, protect_last_n=12, max_passes=3, flush=False, extract_on_failure=True,
    )
    assert out.extractive and out.covered_ids
    assert "Lisbon" in out.summary and "wheelchair" in out.summary
    assert "question 89" in "".join(m.content for m in out.messages) + out.summary


def test_an_extractive_summary_stays_within_its_size():
    chunk = [Message(role="user", content="please book the flight to Oslo for Tuesday")] + [
        Message(role="assistant", content=f"line {i} " + "z" * 200) for i in range(60)]
    for max_chars in (200, 300, 400, 1000, 4000):
        for previous in (None, "", "G" * 10, "## Goal\n- " + "g" * 5000):
            text = extractive_summary(chunk, previous, max_chars)
            assert len(text) <= max_chars, (max_chars, previous and len(previous), len(text))
            if max_chars >= 400:
                assert "Oslo" in text
