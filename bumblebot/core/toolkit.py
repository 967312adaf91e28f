"""The contract between the engine and the tools it runs.

The engine (``bumblebot/``) never imports ``tools/``; ``bumblebot/app/cli.py`` builds a
registry from ``tools/`` and hands it to the engine as a :class:`Toolbox`.

Two kinds of tool (docs/cognition.md, "The completion gate"):

* **agency** tools (``say``, ``think``, ``wait``, ``end_turn``) steer the turn; they never
  count as grounding;
* **work** tools (files, shell, web, knowledge) do work; only they count for grounding.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol


class ToolKind(StrEnum):
    """Whether a tool steers the turn (agency) or does work (work)."""

    AGENCY = "agency"
    WORK = "work"


@dataclass(frozen=True, slots=True)
class ToolResult:
    """What a tool call gave back.

    Args:
        content: the text the model sees as the tool result (already capped by the registry).
        ok: ``False`` when the call failed (bad arguments, refused, raised, timed out).
    """

    content: str
    ok: bool = True

    @classmethod
    def error(cls, message: str) -> ToolResult:
        """A failed result whose content is ``{"error": message}`` as JSON text."""
        import json

        return cls(json.dumps({"error": message}, ensure_ascii=False), ok=False)


@dataclass(frozen=True, slots=True)
class DeliveryReport:
    """Outcome of one ``say``: ``delivered`` once the platform accepted every chunk.

    ``queued`` is ``True`` when delivery failed for now but the message stays in the outbox
    and will be retried (so the model must not repeat it). ``duplicate`` is ``True`` when the
    same text was already said in this turn and was not sent again (a message reaches the
    user exactly once). ``chat_unreachable`` is ``True`` when the platform
    said no message can reach this chat (blocked, deleted, no permission). ``dropped`` says why
    the engine did not send it at all (the turn's message limit), not a delivery failure.
    ``left`` is how many more messages the turn may send, told when it is one or none, so
    the model can say what remains while it still may.
    """

    delivered: bool
    queued: bool = False
    error: str | None = None
    duplicate: bool = False
    chat_unreachable: bool = False
    dropped: str | None = None
    left: int | None = None

    @property
    def ok(self) -> bool:
        """The message reached the user or will (it stays in the outbox until it does)."""
        return self.delivered or self.queued

    def as_result(self) -> ToolResult:
        """The ``say`` tool's result: ``{"delivered": bool, "queued": bool, "dropped"?, "note"?,
        "error"?}``, ``ok`` when delivered or queued."""
        import json

        payload: dict[str, object] = {"delivered": self.delivered, "queued": self.queued}
        if self.left is not None:
            payload["messages_left"] = self.left
            payload["note"] = (
                "that was the last message this turn may send; call end_turn" if self.left == 0 else
                "one message left this turn: if more remains than fits in it, use it to say so"
            )
        if self.duplicate:
            payload["note"] = "you already said this in this turn; it was not sent again"
        if self.dropped:
            payload["dropped"] = True
            payload["note"] = self.dropped
        if self.error:
            payload["error"] = self.error
        return ToolResult(json.dumps(payload, ensure_ascii=False), ok=self.ok)


class TurnControl(Protocol):
    """What agency tools may do to the running turn. Implemented by the runtime's ``TurnIO``
    (``bumblebot/runtime/io.py``), which asks the agent loop's delivery rule what goes out."""

    async def say(self, text: str, *, call_id: str | None = None) -> DeliveryReport:
        """Deliver ``text`` to the conversation now, through the outbox; ``call_id`` is the
        ``say`` call it answers (so a resumed turn knows whether it was delivered)."""

    async def send_file(self, path: Path, caption: str, *, call_id: str | None = None) -> DeliveryReport:
        """Send the file at ``path`` (inside the workspace) to the conversation with
        ``caption``, through the outbox: as a photo when it is an image, else a document."""

    def end_turn(self) -> None:
        """Ask the loop to end the turn after this step (the completion gate may refuse)."""

    def think(self, thought: str) -> None:
        """Record a private note in the turn trace (never shown to the user)."""


@dataclass(slots=True)
class ToolContext:
    """Everything a tool call may use.

    Args:
        workspace: the directory work tools are confined to (resolved, exists).
        data_dir: the daemon's data directory (``knowledge.md`` lives here).
        turn: the running turn, for agency tools; ``None`` outside a turn.
        conversation: the conversation's key (``ChatRef.key``, e.g. ``telegram:123``): logs,
            and where its private facts live (``remember``/``recall``).
        call_id: the id of the tool call being run (``None`` outside a turn).
        extras: free slot for tool-specific services (e.g. an ``httpx.AsyncClient``).
        own_files_only: the file tools reach only this conversation's own folder of the
            workspace, not the files of the workspace shared by trusted chats
            (``tools.files.shared_chats``; set by the registry).
    """

    workspace: Path
    data_dir: Path
    turn: TurnControl | None = None
    conversation: str = ""
    call_id: str | None = None
    extras: dict[str, Any] = field(default_factory=dict)
    own_files_only: bool = False


#: Compaction levels of :meth:`Toolbox.schemas` (0 to 3).
SCHEMA_LEVELS = 4


class Toolbox(Protocol):
    """The registry as the engine sees it."""

    def schemas(self, level: int = 0) -> list[dict[str, Any]]:
        """OpenAI ``tools`` entries: ``[{"type": "function", "function": {...}}, ...]``.

        ``level`` compacts them for small context windows: 0 as declared, up to
        ``SCHEMA_LEVELS - 1`` (3): brief descriptions, required parameters only, optional
        tools left out (``tools/schemas.py`` documents each level).
        """

    def kind(self, name: str) -> ToolKind | None:
        """The kind of a registered tool, ``None`` if unknown."""

    def timeout_s(self, name: str) -> float | None:
        """The per-call timeout of a tool in seconds, ``None`` for the engine's default."""

    async def execute(self, name: str, arguments: str, ctx: ToolContext) -> ToolResult:
        """Validate ``arguments`` (a JSON object as text) and run the tool.

        Never raises for a tool's own failure: unknown tools, malformed JSON, invalid
        arguments and exceptions inside the tool all become ``ToolResult(ok=False)``.
        """


ToolFn = Callable[..., Awaitable[ToolResult | str]]
