"""The message-sequence invariant (bumblebot/cognition/sequence.py): validate() and repair() keep
every tool call answered by its result, and a repaired history never loses the latest user message."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bumblebot.cognition.sequence import MISSING_RESULT, InvalidSequence, is_valid, repair, validate
from bumblebot.core.messages import Message

SETTINGS = settings(max_examples=150, deadline=None)


def call(cid: str, name: str = "read_file") -> dict:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": "{}"}}


def user(text: str = "hi") -> Message:
    return Message(role="user", content=text)


def calls(*ids: str) -> Message:
    return Message(role="assistant", content="", tool_calls=[call(i) for i in ids])


def result(cid: str | None, text: str = "ok") -> Message:
    return Message(role="tool", content=text, tool_call_id=cid, name="read_file")


@st.composite
def valid_histories(draw: st.DrawFn, max_units: int = 12) -> list[Message]:
    """Valid sequences: user / assistant / system messages and tool groups of 1-4 parallel
    calls whose results come in any order."""
    ids = itertools.count()
    out: list[Message] = []
    kinds = st.sampled_from(["user", "assistant", "tools", "tools", "system"])
    for kind in draw(st.lists(kinds, max_size=max_units)):
        if kind == "tools":
            group = [f"call_{next(ids)}" for _ in range(draw(st.integers(1, 4)))]
            out.append(calls(*group))
            out += [result(cid) for cid in draw(st.permutations(group))]
        else:
            out.append(Message(role=kind, content=f"{kind} {len(out)}"))
    for i, m in enumerate(out):
        m.id = i + 1
    return out


@st.composite
def damaged_histories(draw: st.DrawFn) -> list[Message]:
    """Valid sequences cut, spliced and damaged at random: any shape a bug could leave."""
    msgs = list(draw(valid_histories()))
    for op in draw(
        st.lists(st.sampled_from(["slice", "drop", "orphan", "dup", "swap", "sys"]), max_size=4)
    ):
        n = len(msgs)
        if op == "slice" and n:
            a = draw(st.integers(0, n))
            msgs = msgs[a : draw(st.integers(a, n))]
        elif op == "drop" and n:
            del msgs[draw(st.integers(0, n - 1))]
        elif op == "orphan":
            msgs.insert(
                draw(st.integers(0, n)), result(draw(st.sampled_from(["x", "call_0", None])))
            )
        elif op == "dup" and n:
            i = draw(st.integers(0, n - 1))
            msgs.insert(draw(st.integers(0, n)), msgs[i])
        elif op == "swap" and n > 1:
            i, j = draw(st.integers(0, n - 1)), draw(st.integers(0, n - 1))
            msgs[i], msgs[j] = msgs[j], msgs[i]
        elif op == "sys":
            msgs.insert(draw(st.integers(0, n)), Message(role="system", content="s"))
    return msgs


# --- validate: examples ---------------------------------------------------------------


def test_valid_parallel_calls_in_any_order() -> None:
    validate([user(), calls("a", "b"), result("b"), result("a"), Message("assistant", "done")])


@pytest.mark.parametrize(
    ("messages", "index", "words"),
    [
        ([result("a"), user()], 0, "outside"),
        ([user(), result("a")], 1, "outside"),
        ([user(), calls("a"), user()], 1, "missing"),
        ([user(), calls("a", "b"), result("a")], 1, "missing"),
        ([user(), calls("a"), result("a"), result("a")], 3, "second result"),
        ([user(), calls("a"), result("z")], 2, "answers no call"),
        ([calls("a"), result("a"), calls("a"), result("a")], 2, "duplicate"),
        ([calls("a"), Message("system", "s"), result("a")], 1, "system"),
        ([calls("a"), result("a"), Message("system", "s"), result("a")], 3, "outside"),
        ([Message("assistant", tool_calls=[{"type": "function"}])], 0, "without an id"),
    ],
)
def test_validate_rejects(messages: list[Message], index: int, words: str) -> None:
    with pytest.raises(InvalidSequence) as info:
        validate(messages)
    assert info.value.index == index
    assert words in info.value.reason
    assert isinstance(info.value, ValueError)


def test_system_message_after_a_complete_group_is_fine() -> None:
    validate([Message("system", "s"), calls("a"), result("a"), Message("system", "s"), user()])


def test_empty_tool_calls_list_is_a_plain_assistant_message() -> None:
    validate([user(), Message("assistant", "hello", tool_calls=[]), user()])


# --- repair: examples -----------------------------------------------------------------


def test_orphan_after_latest_user_is_dropped_and_user_kept() -> None:
    # an orphan result after the latest user message: the old repair returned an empty suffix here
    latest = user("latest question")
    fixed = repair([user("old"), result("gone"), latest, result("gone2")])
    assert fixed[-1] is latest
    assert [m.role for m in fixed] == ["user", "user"]


def test_missing_result_gets_a_stub_in_its_group() -> None:
    a = calls("a", "b")
    ra = result("a")
    fixed = repair([user(), a, ra, user("next")])
    assert fixed[1] is a and fixed[2] is ra
    stub = fixed[3]
    assert (stub.role, stub.tool_call_id, stub.content) == ("tool", "b", MISSING_RESULT)
    assert fixed[4].content == "next"
    validate(fixed)


def test_duplicate_call_id_is_removed_from_a_copy() -> None:
    first, second = calls("a"), Message("assistant", "x", tool_calls=[call("a"), call("b")], id=7)
    fixed = repair([first, result("a"), second, result("a"), result("b")])
    validate(fixed)
    assert fixed[2] is not second and fixed[2].id == 7 and fixed[2].tool_call_ids == ["b"]
    assert second.tool_call_ids == ["a", "b"]  # the input is not modified
    assert [m.tool_call_id for m in fixed if m.role == "tool"] == ["a", "b"]


# --- properties -------------------------------------------------------------------------


@SETTINGS
@given(valid_histories())
def test_generated_histories_are_valid(msgs: list[Message]) -> None:
    validate(msgs)


@SETTINGS
@given(valid_histories())
def test_repair_of_valid_is_identity(msgs: list[Message]) -> None:
    fixed = repair(msgs)
    assert fixed is not msgs
    assert len(fixed) == len(msgs) and all(a is b for a, b in zip(fixed, msgs, strict=True))


@SETTINGS
@given(damaged_histories())
def test_repair_always_yields_a_valid_sequence(msgs: list[Message]) -> None:
    fixed = repair(msgs)
    validate(fixed)
    # user messages: all kept, same objects, same order
    users = [m for m in msgs if m.role == "user"]
    assert [m for m in fixed if m.role == "user"] == users  # Message compares by identity
    if any(m.role == "user" for m in msgs):
        assert fixed
    # non-tool messages are kept in order (assistants may be copies with fewer calls)
    kept = [(m.role, m.content, m.id) for m in fixed if m.role != "tool"]
    assert kept == [(m.role, m.content, m.id) for m in msgs if m.role != "tool"]
    # every tool message is from the input or a stub
    inputs = {id(m) for m in msgs}
    assert all(id(m) in inputs or m.content == MISSING_RESULT for m in fixed if m.role == "tool")
    # repairing again changes nothing
    again = repair(fixed)
    assert all(a is b for a, b in zip(again, fixed, strict=True))


@SETTINGS
@given(valid_histories(), st.data())
def test_random_slices_of_valid_histories_repair_to_valid(
    msgs: list[Message], data: st.DataObject
) -> None:
    a = data.draw(st.integers(0, len(msgs)))
    b = data.draw(st.integers(a, len(msgs)))
    part = msgs[a:b]
    fixed = repair(part)
    assert is_valid(fixed)
    if is_valid(part):
        assert all(x is y for x, y in zip(fixed, part, strict=True))
    # a slice only loses results at its start and calls' results at its end: nothing else
    assert len([m for m in fixed if m.role != "tool"]) == len([m for m in part if m.role != "tool"])
