"""The message shape the engine, the store and compaction share.

A :class:`Message` is one entry of a conversation in OpenAI chat-completions form:

* ``user``: ``content`` is what the person wrote (never the ``[Turn context]`` preamble: the
  first user message of a turn keeps the preamble it was sent with apart, in ``context``);
* ``assistant``: ``content`` (may be ``""``) and optional ``tool_calls``, each
  ``{"id": str, "type": "function", "function": {"name": str, "arguments": str}}``;
* ``tool``: ``content`` is the tool result, ``tool_call_id`` names the call it answers;
* ``system``: only ever built per request (the system prompt, the compaction summary); never stored.

``id`` is the SQLite row id once stored (``None`` before). Token estimates follow the
token estimate (docs/compaction.md, "Token estimate"): ``len(text) // 4 + 10`` per
message, where text includes tool call names and arguments. The estimate is computed once
per message and cached, so the cost of estimating a prompt grows with new messages only.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, Literal

from bumblebot.core.events import blank, storable_text

Role = Literal["system", "user", "assistant", "tool"]

#: Per-message overhead of the token estimate, in tokens.
MESSAGE_OVERHEAD_TOKENS = 10
#: Long string arguments of old tool calls are shown cut to this many characters.
CLIPPED_VALUE_CHARS = 200
#: Characters of one tool call's JSON frame: ``{"id":…,"type":"function","function":{"name":…,"arguments":…}}``.
CALL_FRAME_CHARS = 60


#: What a user message that shows nothing (:func:`~bumblebot.core.events.blank`) reads as: one
#: whose files all failed, or one an older version stored blank. Endpoints that refuse blank
#: text (Anthropic models through OpenRouter) would refuse every later request of the chat.
NOTHING_READABLE = "[A message with nothing in it that could be read]"


def estimate_text_tokens(text: str) -> int:
    """Tokens for a piece of text by the token estimate: ``len(text) // 4``."""
    return len(text) // 4


@dataclass(frozen=True, slots=True)
class TurnContext:
    """The ``[Turn context]`` block a turn's first user message was sent with: kept with the
    message and sent again with it in every later request, so each request repeats the one
    before it as a prefix (providers' prompt caches).

    Args:
        lines: the block's lines up to its knowledge: the marker, time, platform, speaker,
            mode and note lines.
        facts: the knowledge sections it showed (``"## title\\nbody"``), under "What you
            know here:".
    """

    lines: tuple[str, ...]
    facts: tuple[str, ...] = ()

    def text(self, known: Collection[str] | None = None) -> str:
        """The block as sent, ending with a ``---`` line. ``known``: the facts that still
        hold; a fact no longer in the knowledge files is left out (``None``: all shown)."""
        facts = [f for f in self.facts if known is None or f in known]
        knowledge = ["What you know here:\n" + "\n\n".join(facts)] if facts else []
        return "\n".join([*self.lines, *knowledge, "---"])

    def to_json(self) -> dict[str, Any]:
        return {"lines": list(self.lines), "facts": list(self.facts)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TurnContext:
        return cls(tuple(str(x) for x in data.get("lines", ())), tuple(str(x) for x in data.get("facts", ())))


@dataclass(slots=True, eq=False)
class Message:
    """One chat message in OpenAI form, plus its database id.

    Args:
        role: ``"system"``, ``"user"``, ``"assistant"`` or ``"tool"``.
        content: the text; ``""`` rather than ``None`` (some servers reject null content).
        tool_calls: for assistant messages, the OpenAI ``tool_calls`` list, or ``None``.
        tool_call_id: for tool messages, the id of the call this result answers.
        name: for tool messages, the tool's name (informational).
        id: SQLite row id, ``None`` until stored.
        pruned: ``True`` when compaction replaced a tool result with the placeholder
            (the original stays in the database for audit).
        ok: for tool messages, whether the call succeeded (``None`` for other roles).
        note: ``True`` for an assistant message the daemon itself sent (an outage notice, a
            step-cap note): the user saw it, but the model did not say it, so it never counts
            as the entity's answer.
        images: for user messages, the images that came with it, as references
            (``bumblebot.media.intake.ImageRef`` as JSON: ``{"path", "mime", "width", "height"}``, the
            path relative to ``<data_dir>/media``); the bytes never live in the history. Not
            counted in :attr:`tokens` (the request that shows them adds their cost).
        context: for the first user message of a turn, the ``[Turn context]`` it was sent
            with (requests put it before ``content``; counted in :attr:`tokens`).
    """

    role: Role
    content: str = ""
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    id: int | None = None
    pruned: bool = False
    ok: bool | None = None
    note: bool = False
    images: list[dict[str, Any]] | None = None
    context: TurnContext | None = None
    _tokens: int | None = field(default=None, repr=False)

    @property
    def tool_call_ids(self) -> list[str]:
        """Ids of the tool calls of an assistant message (``[]`` if none)."""
        return [c["id"] for c in self.tool_calls or ()]

    @property
    def tokens(self) -> int:
        """Estimated tokens: ``len(text) // 4 + 10``, where the text of a tool call is its
        name, its arguments (as the JSON string they travel in), its id and the call's JSON
        frame (:data:`CALL_FRAME_CHARS`), and a tool result's text includes the id it answers.
        Endpoints count that structure; leaving it out undercounts tool-heavy turns."""
        if self._tokens is None:
            n = len(self.content)
            for call in self.tool_calls or ():
                fn = call.get("function", {})
                arguments = fn.get("arguments", "") or ""
                n += len(fn.get("name", "")) + len(arguments) + arguments.count('"') + len(call.get("id", ""))
                n += CALL_FRAME_CHARS
            n += len(self.tool_call_id or "")
            if self.context is not None:
                n += len(self.context.text()) + 1
            self._tokens = n // 4 + MESSAGE_OVERHEAD_TOKENS
        return self._tokens

    def set_context(self, context: TurnContext | None) -> None:
        """Give this message the ``[Turn context]`` it is sent with (its estimate follows)."""
        self.context, self._tokens = context, None

    def make_storable(self) -> None:
        """Make this message fit to store and send, in place (before it is first written): lone
        surrogates in its text and its calls' arguments replaced by U+FFFD, and a user text
        that shows nothing replaced by :data:`NOTHING_READABLE`."""
        content = storable_text(self.content)
        if self.role == "user" and blank(content):
            content = NOTHING_READABLE
        if content != self.content:
            self.content, self._tokens = content, None
        calls = [sound_call(c) for c in self.tool_calls or ()]
        if calls != (self.tool_calls or []):
            self.tool_calls, self._tokens = calls, None

    def with_content(self, content: str, *, pruned: bool | None = None) -> Message:
        """A copy with new ``content`` (the cached estimate is recomputed)."""
        return Message(
            role=self.role,
            content=content,
            tool_calls=self.tool_calls,
            tool_call_id=self.tool_call_id,
            name=self.name,
            id=self.id,
            pruned=self.pruned if pruned is None else pruned,
            ok=self.ok,
            note=self.note,
            images=self.images,
            context=self.context,
        )

    def with_clipped_calls(self, max_chars: int = CLIPPED_VALUE_CHARS) -> Message:
        """A copy of an assistant message whose tool calls' long string arguments are cut to
        ``max_chars`` characters (``pruned=True``): how an old step of a turn that grew past
        the window is shown (arguments that are not a JSON object are cut whole)."""
        calls = []
        for call in self.tool_calls or ():
            fn = dict(call.get("function", {}))
            fn["arguments"] = clip_arguments(fn.get("arguments", "") or "", max_chars)
            calls.append({**call, "function": fn})
        return Message(
            role=self.role, content="", tool_calls=calls or None, tool_call_id=self.tool_call_id,
            name=self.name, id=self.id, pruned=True, ok=self.ok, note=self.note,
        )

    def to_api(self) -> dict[str, Any]:
        """The dict sent to a chat-completions endpoint. ``content`` is never ``None``."""
        out: dict[str, Any] = {"role": self.role, "content": self.content or ""}
        if self.role == "assistant" and self.tool_calls:
            out["tool_calls"] = self.tool_calls
        if self.role == "tool":
            out["tool_call_id"] = self.tool_call_id
        return out

    @classmethod
    def from_api(cls, data: dict[str, Any]) -> Message:
        """Build from an OpenAI-form dict (``content: None`` becomes ``""``)."""
        return cls(
            role=data["role"],
            content=data.get("content") or "",
            tool_calls=data.get("tool_calls") or None,
            tool_call_id=data.get("tool_call_id"),
            name=data.get("name"),
        )


def estimate_messages(messages: list[Message]) -> int:
    """Sum of the cached per-message estimates."""
    return sum(m.tokens for m in messages)


def estimate_tools(tool_schemas: list[dict[str, Any]]) -> int:
    """Tokens of the tool schemas sent with a request (``len(json) // 4``)."""
    if not tool_schemas:
        return 0
    return estimate_text_tokens(json.dumps(tool_schemas, separators=(",", ":")))


def json_text(value: Any, *, default: Any = None) -> str:
    """``value`` as JSON text, non-ASCII kept readable, every lone surrogate in it replaced by
    U+FFFD (:func:`~bumblebot.core.events.storable_text`): no UTF-8 writer (SQLite, an HTTP
    body) takes one raw, and one kept as a ``\\uXXXX`` escape comes back raw when the text is
    read. ``default`` as for :func:`json.dumps`."""
    return storable_text(json.dumps(value, ensure_ascii=False, default=default))


def _no_constant(name: str) -> Any:
    raise ValueError(f"not valid JSON ({name} is not a JSON value)")


def json_object(arguments: str) -> dict[str, Any]:
    """``arguments`` (a tool call's JSON text) read strictly: a JSON object, by the JSON
    standard (RFC 8259), not by Python's lenient reader (``NaN``, ``Infinity`` are refused).
    ``""`` reads as ``{}`` (no arguments).

    Raises:
        ValueError: ``"not valid JSON (…)"``, or ``"a JSON list, not an object"``.
    """
    try:
        value = json.loads(arguments or "{}", parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc.msg})") from None
    except RecursionError:
        raise ValueError("not valid JSON (nested too deeply)") from None
    if not isinstance(value, dict):
        raise ValueError(f"a JSON {type(value).__name__}, not an object")
    return value


def loose_object(arguments: str) -> dict[str, Any] | None:
    """``arguments`` read as a JSON object whose strings may hold raw control characters (a
    line break written as is inside a string: small models do it, and JSON wants it escaped);
    ``None`` when it is not one even so. Written back with :func:`json_text`, it is valid JSON."""
    try:
        value = json.loads(arguments, strict=False, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def valid_arguments(arguments: str) -> bool:
    """Whether ``arguments`` is a JSON object a strict endpoint (vLLM) accepts in a history."""
    try:
        json_object(arguments)
    except ValueError:
        return False
    return True


def clip_arguments(arguments: str, max_chars: int) -> str:
    """``arguments`` (a tool call's JSON text) with every string value longer than
    ``max_chars`` cut to it plus ``…[N characters cut]``; still valid JSON."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return json.dumps({"cut": arguments[:max_chars] + "…"}) if len(arguments) > max_chars else arguments

    def clip(node: Any) -> Any:
        if isinstance(node, str) and len(node) > max_chars:
            return f"{node[:max_chars]}…[{len(node) - max_chars} characters cut]"
        if isinstance(node, dict):
            return {k: clip(v) for k, v in node.items()}
        if isinstance(node, list):
            return [clip(v) for v in node]
        return node

    return json_text(clip(value))


#: What a surrogate looks like in JSON text: raw, or as a ``\uXXXX`` escape.
_MAY_HOLD_SURROGATE = re.compile(r"[\ud800-\udfff]|\\u[dD][89a-fA-F]")


def storable_arguments(arguments: str) -> str:
    """A tool call's arguments (a JSON object's text) with every lone surrogate, raw or written
    as a ``\\uXXXX`` escape (which reads back as a raw one), replaced by U+FFFD; ``arguments``
    itself when it holds none."""
    if not _MAY_HOLD_SURROGATE.search(arguments):
        return arguments
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError):
        return storable_text(arguments)
    clean = json_text(value)
    return arguments if clean == json.dumps(value, ensure_ascii=False) else clean


def sound_call(call: dict[str, Any]) -> dict[str, Any]:
    """A tool call read back from the store as a request may carry it: arguments that are not a
    JSON object (older versions recorded them as the model sent them) become ``{}``, and a lone
    surrogate (:func:`storable_arguments`) becomes U+FFFD, so one bad call in an old history
    cannot make a strict endpoint refuse every later request. (What this version records is
    sound already: ``calls.fit_call``.)"""
    fn = call.get("function") or {}
    arguments = fn.get("arguments") or ""
    if valid_arguments(arguments):
        sound = storable_arguments(arguments)
        return call if sound == arguments else {**call, "function": {**fn, "arguments": sound}}
    return {**call, "function": {**fn, "arguments": "{}"}}
