"""The message-sequence invariant every request must satisfy, and a last-resort repair.

Rule (OpenAI chat completions: every tool call needs a ``tool`` message with its id, right
after the assistant message that made it; a request that breaks this is refused with HTTP 400,
and so is every later request built on the same history):

* a ``tool`` message belongs to the contiguous block of ``tool`` messages directly after an
  ``assistant`` message with ``tool_calls`` and answers one of that message's call ids;
* every tool call of that assistant message has exactly one result in that block;
* call ids are unique across the whole sequence;
* no ``tool`` message appears anywhere else (e.g. at the start, or after a user message);
* ``system`` messages may appear anywhere except between an assistant ``tool_calls``
  message and its results.

:func:`validate` checks the rule; :func:`repair` makes any sequence satisfy it by removing
orphans and adding stub results, and leaves a valid sequence untouched.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bumblebot.cognition.state import say_text
from bumblebot.core.messages import Message

#: Content of the stub result :func:`repair` adds for a call whose result is missing.
MISSING_RESULT = "[tool result missing]"


class InvalidSequence(ValueError):
    """A message sequence breaks the tool-call pairing rule.

    Attributes:
        index: position in the sequence of the first offending message (for a call without
            a result: the assistant message holding the call).
        reason: what is wrong, in words.
    """

    def __init__(self, index: int, reason: str) -> None:
        super().__init__(f"invalid message sequence at {index}: {reason}")
        self.index = index
        self.reason = reason


def _call_id(call: Any) -> str | None:
    """The id of one OpenAI tool call dict, or ``None`` when it has no usable id."""
    if isinstance(call, dict):
        cid = call.get("id")
        if isinstance(cid, str) and cid:
            return cid
    return None


def _call_name(call: Any) -> str | None:
    fn = call.get("function") if isinstance(call, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    return name if isinstance(name, str) else None


def validate(messages: Sequence[Message]) -> None:
    """Check the pairing rule (module docstring) in one O(n) pass.

    Raises:
        InvalidSequence: at the first message that breaks the rule.
    """
    seen_calls: set[str] = set()
    pending: set[str] = set()  # calls of the open group still waiting for a result
    answered: set[str] = set()  # calls of the open group already answered
    group_at = -1  # index of the assistant message of the open group, -1 when none
    for i, m in enumerate(messages):
        if m.role == "tool":
            if group_at < 0:
                raise InvalidSequence(i, "tool result outside a tool-call group")
            cid = m.tool_call_id
            if cid in pending:
                pending.discard(cid)
                answered.add(cid)
            elif cid in answered:
                raise InvalidSequence(i, f"second result for tool call {cid!r}")
            else:
                raise InvalidSequence(i, f"tool result answers no call of its group: {cid!r}")
            continue
        if pending:
            what = "system message inside" if m.role == "system" else "tool results missing for"
            missing = ", ".join(sorted(pending))
            raise InvalidSequence(group_at if m.role != "system" else i, f"{what} calls {missing}")
        group_at = -1
        answered = set()
        if m.role == "assistant" and m.tool_calls:
            for call in m.tool_calls:
                cid = _call_id(call)
                if cid is None:
                    raise InvalidSequence(i, "tool call without an id")
                if cid in seen_calls:
                    raise InvalidSequence(i, f"duplicate tool call id {cid!r}")
                seen_calls.add(cid)
                pending.add(cid)
            group_at = i
    if pending:
        raise InvalidSequence(
            group_at, f"tool results missing for calls {', '.join(sorted(pending))}"
        )


def is_valid(messages: Sequence[Message]) -> bool:
    """``True`` when :func:`validate` accepts ``messages``."""
    try:
        validate(messages)
    except InvalidSequence:
        return False
    return True


def _stub(call: dict[str, Any], cid: str) -> Message:
    return Message(role="tool", content=MISSING_RESULT, tool_call_id=cid, name=_call_name(call))


def repair(messages: Sequence[Message]) -> list[Message]:
    """A valid copy of ``messages``: the defensive last resort before a request is sent.

    What changes (and nothing else; the order of kept messages is unchanged):

    * tool results outside a tool-call group, answering no call of their group, or answering
      an already-answered call are dropped;
    * tool calls without an id, or whose id already appeared earlier, are removed from a
      copy of their assistant message (its ``tool_calls`` becomes ``None`` if none remain);
    * a call without a result gets a stub result (:data:`MISSING_RESULT`) at the end of
      its group.

    User, system and assistant messages are always kept, so the latest user message survives
    and the model still answers what was last asked. A valid input comes back as a new list
    of the very same objects.
    """
    if is_valid(messages):
        return list(messages)
    out: list[Message] = []
    seen_calls: set[str] = set()
    i, n = 0, len(messages)
    while i < n:
        m = messages[i]
        i += 1
        if m.role == "tool":
            continue  # orphan: not directly after an assistant message with tool_calls
        if not (m.role == "assistant" and m.tool_calls):
            out.append(m)
            continue
        calls: dict[str, dict[str, Any]] = {}
        for call in m.tool_calls:
            cid = _call_id(call)
            if cid is not None and cid not in seen_calls:
                seen_calls.add(cid)
                calls[cid] = call
        if len(calls) != len(m.tool_calls):
            m = Message(
                role=m.role,
                content=m.content,
                tool_calls=list(calls.values()) or None,
                name=m.name,
                id=m.id,
                pruned=m.pruned,
            )
        out.append(m)
        answered: set[str] = set()
        while i < n and messages[i].role == "tool":
            result = messages[i]
            i += 1
            cid = result.tool_call_id
            if cid is not None and cid in calls and cid not in answered:
                answered.add(cid)
                out.append(result)
        out.extend(_stub(call, cid) for cid, call in calls.items() if cid not in answered)
    return out


def plain_conversation(request: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``request`` without tool rounds, for a tool-less request: what ``say`` delivered becomes
    plain assistant text, other calls and all results go, and neighbours of one role are
    merged (templates that demand alternation, Mistral and Gemma, refuse two in a row)."""
    out: list[dict[str, Any]] = []
    for m in request:
        if m["role"] == "tool":
            continue
        if m.get("tool_calls"):
            said = [say_text(c["function"].get("arguments") or "") for c in m["tool_calls"]
                    if c.get("function", {}).get("name") == "say"]
            if not any(said):
                continue
            m = {"role": "assistant", "content": "\n\n".join(t for t in said if t)}
        last = out[-1] if out else None
        if (last is not None and last["role"] == m["role"] and m["role"] in ("user", "assistant")
                and isinstance(last.get("content"), str) and isinstance(m.get("content"), str)):
            out[-1] = {**last, "content": f"{last['content']}\n\n{m['content']}"}
        else:
            out.append(m)
    return out
