"""The tool registry: the tools the engine can offer and run, and how a call is run.

:class:`Registry` implements :class:`bumblebot.core.toolkit.Toolbox`: it offers the declared
tools' schemas at a compaction level (``tools/schemas.py``), and runs a call by validating its
JSON arguments (``tools/arguments.py``) and invoking the tool (tools are declared with
``@tool`` in ``tools/definition.py``). Its ``execute`` never raises for a tool's own failure
(unknown tool, malformed JSON, invalid arguments, an exception inside the tool): each becomes
``ToolResult(ok=False)``. A tool runs at most once per call, and only with validated
arguments: a failed call is never run again (say, with no arguments after a ``TypeError``),
since a second run could repeat its effects. ``asyncio.CancelledError`` propagates. A result
longer than ``max_result_chars`` is cut in the middle (:func:`cap_text`). What a tool returns
(a web page, a file, an MCP server's answer) has its lone surrogates replaced by U+FFFD, and
an error names the workspace's files by their paths in it (:func:`workspace_relative`), never
by where the workspace lies on the daemon's machine.

Tools that come and go at run time (MCP servers, ``tools/mcp.py``) reach a registry through a
:class:`ToolSource` (:meth:`Registry.add_source`): its tools are offered and run next to the
registered ones, and it says in which conversations each may be. See :class:`ToolSource`.

Where the registered tools may be used is a :class:`tools.access.ToolAccess`: a tool a
conversation may not use is neither offered there nor run (the call gets an error saying so),
and a conversation that may not reach the whole workspace runs its file tools with
``ToolContext.own_files_only`` set.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel

from bumblebot.core.events import storable_text
from bumblebot.core.logs import bound
from bumblebot.core.redaction import NO_SECRETS, Redactor
from bumblebot.core.errors import STORE_FAILURES
from bumblebot.core.settings import MIN_TOOL_RESULT_CHARS
from bumblebot.core.toolkit import SCHEMA_LEVELS, ToolContext, ToolKind, ToolResult

from .access import ToolAccess
from .arguments import validate_arguments
from .definition import Tool, make_tool
from .files import FILE_TOOLS, chat_inbox

#: The tools ``tools.files.shared_chats`` confines.
FILE_TOOL_NAMES = frozenset(t.name for t in FILE_TOOLS)

__all__ = [
    "DEFAULT_MAX_RESULT_CHARS",
    "Registry",
    "ToolSource",
    "cap_text",
    "workspace_relative",
]

log = logging.getLogger(__name__)

#: Default cap on the characters of one tool result the model sees.
DEFAULT_MAX_RESULT_CHARS = 16_000


def workspace_relative(text: str, workspace: Path) -> str:
    """``text`` with every path under ``workspace`` written relative to it (as the file tools
    take paths) and the workspace itself as ``.``."""
    for root in dict.fromkeys((str(workspace), str(workspace.resolve()))):
        text = re.sub(re.escape(root) + r"(?:/|(?![\w.-]))", lambda m: "" if m.group().endswith("/") else ".", text)
    return text


def cap_text(text: str, limit: int) -> str:
    """Cap ``text`` at ``limit`` characters, keeping its head and tail.

    The cut middle is replaced by a marker naming how many characters were cut, e.g.
    ``"\\n[... 1234 characters cut ...]\\n"``. The result is never longer than ``limit``
    (for ``limit`` smaller than the marker, only the head is kept).

    Raises:
        ValueError: if ``limit`` is negative.
    """
    if limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    if len(text) <= limit:
        return text
    cut = len(text) - limit
    while True:
        marker = f"\n[... {cut} characters cut ...]\n"
        keep = limit - len(marker)
        if keep <= 0:
            return text[:limit]
        if len(text) - keep == cut:
            break
        cut = len(text) - keep
    head = keep - keep // 3
    tail = keep - head
    return text[:head] + marker + (text[-tail:] if tail else "")


# -- run-time tools (MCP servers: tools/mcp.py) ---------------------------------------------


class ToolSource(Protocol):
    """Tools that appear and disappear while the daemon runs (``tools/mcp.py``: MCP servers).

    A :class:`Registry` consults its sources in :meth:`Registry.schemas`, ``kind``,
    ``timeout_s`` and ``execute``. Those run on the event loop at every step, so a source
    answers from memory, without I/O. A source's tool never shadows a registered one of the
    same name.
    """

    @property
    def generation(self) -> int:
        """A number that changes whenever :meth:`tools` or :meth:`permits` may answer
        differently (the registry caches schemas per generation)."""

    def tools(self) -> Sequence[Tool]:
        """The tools available now, whatever the conversation."""

    def permits(self, name: str, conversation: str) -> bool:
        """Whether tool ``name`` may be offered and run in ``conversation`` (a conversation
        key such as ``telegram:123``; ``""`` when not known)."""

    def known(self, name: str) -> Tool | None:
        """Tool ``name`` if this source offers it now or did before: calls already made keep
        their kind and timeout while it is gone."""


#: Most cached schema lists of run-time tools (one per level and conversation).
_MAX_DYNAMIC_SCHEMAS = 512


class Registry:
    """A set of tools the engine can offer and run; implements ``Toolbox``.

    Args:
        tools: tools to register now.
        max_result_chars: cap on one result's characters (head and tail kept).
        sources: run-time tools (see :class:`ToolSource` and :meth:`add_source`).
        access: where each registered tool may be used; default: every tool everywhere.
        redactor: the secrets no tool is given and no result holds: a call's arguments and its
            result are redacted (a ``remember`` of the bot token keeps ``[REDACTED]``, a file
            read that holds the key shows ``[REDACTED]``); default: none.

    Raises:
        ValueError: on a duplicate tool name or a ``max_result_chars`` below
            :data:`~bumblebot.core.settings.MIN_TOOL_RESULT_CHARS`.
    """

    def __init__(
        self,
        tools: Iterable[Tool] = (),
        *,
        max_result_chars: int = DEFAULT_MAX_RESULT_CHARS,
        sources: Iterable[ToolSource] = (),
        access: ToolAccess | None = None,
        redactor: Redactor = NO_SECRETS,
    ) -> None:
        if max_result_chars < MIN_TOOL_RESULT_CHARS:
            raise ValueError(f"max_result_chars must be >= {MIN_TOOL_RESULT_CHARS}, got {max_result_chars}")
        self.max_result_chars = max_result_chars
        self.access = access or ToolAccess()
        self.redactor = redactor
        self._tools: dict[str, Tool] = {}
        self._schemas: dict[int, list[dict[str, Any]]] = {}
        self._sources: list[ToolSource] = list(sources)
        self._dynamic: dict[tuple[Any, ...], list[dict[str, Any]]] = {}  # (level, conversation, generations)
        self._index: tuple[tuple[int, ...], dict[str, tuple[Tool, ToolSource]]] = ((), {})
        for item in tools:
            self.add(item)

    # -- building -------------------------------------------------------------------------

    def add(self, item: Tool) -> Tool:
        """Register ``item``; raises ``ValueError`` if its name is taken."""
        if item.name in self._tools:
            raise ValueError(f"tool {item.name!r} is already registered")
        self._tools[item.name] = item
        self._schemas = {}
        self._dynamic = {}
        self._index = ((), {})  # a registered name now shadows a source's
        return item

    def add_source(self, source: ToolSource) -> ToolSource:
        """Offer and run ``source``'s tools too, from now on."""
        self._sources.append(source)
        self._dynamic = {}
        self._index = ((), {})
        return source

    def tool(
        self,
        *,
        kind: ToolKind,
        name: str | None = None,
        timeout_s: float | None = None,
        description: str | None = None,
        args_model: type[BaseModel] | None = None,
    ) -> Callable[[Callable[..., Awaitable[ToolResult | str]]], Tool]:
        """Decorator form of :func:`tool` that also registers the tool here."""

        def decorate(fn: Callable[..., Awaitable[ToolResult | str]]) -> Tool:
            built = make_tool(
                fn,
                kind=kind,
                name=name,
                timeout_s=timeout_s,
                description=description,
                args_model=args_model,
            )
            return self.add(built)

        return decorate

    def copy(self, *, exclude: Iterable[str] = (), only: Iterable[str] | None = None) -> Registry:
        """A new registry with a subset of these tools (same ``max_result_chars`` and sources).

        Args:
            exclude: names to leave out.
            only: if given, keep just these names (before ``exclude`` applies).

        Raises:
            ValueError: if a name in ``exclude`` or ``only`` is not registered (a typo in
                a config should be loud).
        """
        excluded = set(exclude)
        kept = set(self._tools) if only is None else set(only)
        unknown = (excluded | kept) - set(self._tools)
        if unknown:
            raise ValueError(f"unknown tool(s): {', '.join(sorted(unknown))}")
        chosen = [t for n, t in self._tools.items() if n in kept and n not in excluded]
        return Registry(
            chosen, max_result_chars=self.max_result_chars, sources=self._sources, access=self.access, redactor=self.redactor
        )

    # -- queries --------------------------------------------------------------------------

    def names(self) -> list[str]:
        """Registered tool names, in registration order (not a source's: see :meth:`offered`)."""
        return list(self._tools)

    def get(self, name: str) -> Tool | None:
        """The tool called ``name``, or ``None``."""
        return self._tools.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __iter__(self) -> Iterator[Tool]:
        return iter(list(self._tools.values()))

    def __len__(self) -> int:
        return len(self._tools)

    def schemas(self, level: int = 0, conversation: str | None = None) -> list[dict[str, Any]]:
        """OpenAI ``tools`` entries for the registered tools ``conversation`` may use, in
        registration order, then the sources' tools it may use, at a compaction ``level``
        (:data:`SCHEMA_LEVELS`; at the last level optional tools are left out).

        Args:
            level: the compaction level.
            conversation: whose tools: a conversation key. ``None`` takes the one the running
                turn bound for its logs (``bumblebot.core.logs.bind``, set around every turn), or
                ``""`` outside a turn, where only tools allowed everywhere are offered.

        Built once per level (and conversation and sources' generation) and cached
        (JSON-schema generation is not free and runs every step); :meth:`add` invalidates
        the cache. Callers must not modify the returned list.
        """
        level = max(0, min(SCHEMA_LEVELS - 1, level))
        if level not in self._schemas:
            tools = [t for t in self._tools.values() if not (t.optional and level >= SCHEMA_LEVELS - 1)]
            self._schemas[level] = [t.schema(level) for t in tools]
        static = self._schemas[level]
        if not self._sources and not self.access.restricts:
            return static
        if conversation is None:
            conversation = str(bound().get("conversation", ""))
        generations = tuple(source.generation for source in self._sources)
        key = (level, conversation, generations)
        cached = self._dynamic.get(key)
        if cached is None:
            if len(self._dynamic) >= _MAX_DYNAMIC_SCHEMAS or any(k[2] != generations for k in self._dynamic):
                self._dynamic = {}
            if self.refused(conversation):
                mine = [t for t in self._tools.values() if not (t.optional and level >= SCHEMA_LEVELS - 1)]
                static = [t.schema(level) for t in mine if self.access.permits(t.name, conversation)]
            extra = [t for t in self.offered(conversation) if not (t.optional and level >= SCHEMA_LEVELS - 1)]
            cached = self._dynamic[key] = static + [t.schema(level) for t in extra] if extra else static
        return cached

    def summary(self, conversation: str) -> str:
        """``/status``'s line of the tools, e.g. ``"Tools: 12 offered here; not here: run_command.
        File tools reach only inbox/telegram_-100123/."``"""
        refused = self.refused(conversation)
        offered = len(self._tools) - len(refused) + len(self.offered(conversation))
        line = f"Tools: {offered} offered here"
        line += f"; not here: {', '.join(refused)}." if refused else "."
        if not self.access.whole_workspace(conversation) and any(name in self._tools for name in FILE_TOOL_NAMES):
            line += f" File tools reach only {chat_inbox(conversation)}/."
        return line

    def refused(self, conversation: str) -> list[str]:
        """The registered tools ``conversation`` may not use (``tools.<group>.allowed_chats``)."""
        return [name for name in self._tools if not self.access.permits(name, conversation)]

    def offered(self, conversation: str) -> list[Tool]:
        """The sources' tools ``conversation`` may use now, in source order."""
        return [t for t, source in self._current().values() if source.permits(t.name, conversation)]

    def kind(self, name: str) -> ToolKind | None:
        """The kind of tool ``name``, ``None`` if unknown (a source's tool keeps its kind
        while its source is down)."""
        found = self._lookup(name)
        return found.kind if found else None

    def timeout_s(self, name: str) -> float | None:
        """Per-call timeout of tool ``name`` in seconds; ``None`` for the engine's default
        (or if the tool is unknown)."""
        found = self._lookup(name)
        return found.timeout_s if found else None

    def _lookup(self, name: str) -> Tool | None:
        """A registered tool, else a source's current one, else one a source knew."""
        found = self._tools.get(name)
        if found is None and self._sources:
            entry = self._current().get(name)
            if entry is not None:
                return entry[0]
            for source in self._sources:
                if (known := source.known(name)) is not None:
                    return known
        return found

    def _current(self) -> dict[str, tuple[Tool, ToolSource]]:
        """The sources' tools now, by name (first source wins; registered names are skipped),
        rebuilt when a generation changes."""
        generations = tuple(source.generation for source in self._sources)
        if self._index[0] != generations:
            index: dict[str, tuple[Tool, ToolSource]] = {}
            for source in self._sources:
                for item in source.tools():
                    if item.name not in self._tools and item.name not in index:
                        index[item.name] = (item, source)
            self._index = (generations, index)
        return self._index[1]

    # -- running --------------------------------------------------------------------------

    async def execute(self, name: str, arguments: str, ctx: ToolContext) -> ToolResult:
        """Validate ``arguments`` and run tool ``name`` once.

        Args:
            name: the tool the model called.
            arguments: the call's arguments as JSON text. ``""`` and ``"null"`` mean "no
                arguments" and are validated as ``{}`` (a tool with required fields then
                fails validation and is not run); any other non-object JSON is an error.
            ctx: what the tool may use.

        Returns:
            The tool's result with its content capped at ``max_result_chars``. A ``str``
            returned by the tool becomes ``ToolResult(text, ok=True)``. Failures (unknown
            tool, malformed JSON, invalid arguments, an exception in the tool) are
            ``ToolResult.error(...)`` naming the problem; tracebacks go to the log only.

        Raises:
            asyncio.CancelledError: if the call is cancelled (never swallowed).
        """
        out = await self._run(name, self.redactor(arguments), ctx)
        content = self.redactor(storable_text(out.content))
        if not out.ok:
            content = workspace_relative(content, ctx.workspace)
            for root in dict.fromkeys((str(ctx.data_dir), str(ctx.data_dir.resolve()))):
                content = content.replace(root, "<data_dir>")  # where the daemon keeps its data is not the model's
        if len(content) > self.max_result_chars:
            content = cap_text(content, self.max_result_chars)
        return out if content == out.content else ToolResult(content, ok=out.ok)

    async def _run(self, name: str, arguments: str, ctx: ToolContext) -> ToolResult:
        found = self._callable(name, ctx.conversation)
        if isinstance(found, ToolResult):
            return found
        if not ctx.own_files_only and not self.access.whole_workspace(ctx.conversation):
            ctx = dataclasses.replace(ctx, own_files_only=True)
        args = validate_arguments(found.args_model, arguments)
        if isinstance(args, str):
            return ToolResult.error(f"{name}: {args}")
        try:
            out = await found.invoke(ctx, args)
        except STORE_FAILURES:
            raise  # the turn's own record failed (e.g. say): the turn recovers (bumblebot/core/errors.py)
        except Exception as exc:  # CancelledError is a BaseException and propagates
            log.warning("tool %s raised in %s", name, ctx.conversation or "-", exc_info=True)
            return ToolResult.error(f"{name} failed: {type(exc).__name__}: {exc}")
        if isinstance(out, str):
            return ToolResult(out)
        if not isinstance(out, ToolResult):
            log.error("tool %s returned %s, not str or ToolResult", name, type(out).__name__)
            return ToolResult.error(f"{name} failed: returned {type(out).__name__}")
        return out

    def _callable(self, name: str, conversation: str) -> Tool | ToolResult:
        """Tool ``name`` if ``conversation`` may run it now, else the error result saying why."""
        found = self._tools.get(name)
        if found is not None and not self.access.permits(name, conversation):
            return ToolResult.error(f"tool {name!r} is not available in this conversation")
        if found is None and self._sources:  # a source's tool, where this conversation may use it
            entry = self._current().get(name)
            if entry is not None and entry[1].permits(name, conversation):
                found = entry[0]
            elif entry is not None:
                return ToolResult.error(f"tool {name!r} is not available in this conversation")
            elif any(source.known(name) is not None for source in self._sources):
                return ToolResult.error(
                    f"tool {name!r} is not available now (its server is down or no longer offers it); "
                    "do without it or try again later"
                )
        if found is None:
            offered = [t.name for t in self.offered(conversation)] if self._sources else []
            mine = [n for n in self._tools if self.access.permits(n, conversation)]
            available = ", ".join([*mine, *offered]) or "(none)"
            return ToolResult.error(f"unknown tool {name!r}; available tools: {available}")
        return found
