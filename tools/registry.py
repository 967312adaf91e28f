"""The tool registry: declared tools, their OpenAI schemas, validated execution.

A tool is an ``async`` function whose first parameter is the :class:`ToolContext`. Its
arguments are described either by one pydantic model::

    class ReadFileArgs(BaseModel):
        path: str = Field(description="Path relative to the workspace")

    @tool(kind=ToolKind.WORK)
    async def read_file(ctx: ToolContext, args: ReadFileArgs) -> ToolResult | str:
        \"\"\"Read a text file from the workspace.\"\"\"

or by a plain typed signature, from which the model is built with
:func:`pydantic.create_model` (``Annotated[..., Field(description=...)]`` gives a parameter
its description)::

    @tool(kind=ToolKind.AGENCY)
    async def wait(ctx: ToolContext, seconds: float = 3) -> str:
        \"\"\"Pause for a few seconds.\"\"\"

The first paragraph of the docstring is the tool's description. Argument models always
forbid unknown fields (``additionalProperties: false`` in the schema).

:class:`Registry` implements :class:`bumblebot.core.toolkit.Toolbox`. Its ``execute`` never
raises for a tool's own failure (unknown tool, malformed JSON, invalid arguments, an
exception inside the tool): each becomes ``ToolResult(ok=False)``. The reference
re-invoked a tool with *no* arguments when the first call raised ``TypeError``
(reference-study §4, "Registry"), which could run it twice; here a tool runs at most once
per call, and only with validated arguments. ``asyncio.CancelledError`` propagates.

Tools that come and go at run time (MCP servers, ``tools/mcp.py``) reach a registry through a
:class:`ToolSource` (:meth:`Registry.add_source`): its tools are offered and run next to the
registered ones, and it says in which conversations each may be. See :class:`ToolSource`.
"""

from __future__ import annotations

import inspect
import json
import logging
import re
import sqlite3
import typing
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from bumblebot.core.logs import bound
from bumblebot.core.toolkit import SCHEMA_LEVELS, ToolContext, ToolKind, ToolResult

__all__ = [
    "DEFAULT_MAX_RESULT_CHARS",
    "Registry",
    "Tool",
    "ToolSource",
    "cap_text",
    "tool",
]

log = logging.getLogger(__name__)

#: Default cap on the characters of one tool result the model sees.
DEFAULT_MAX_RESULT_CHARS = 16_000

#: Schema compaction levels, for small context windows (``Registry.schemas(level)``, the
#: count is ``bumblebot.core.toolkit.SCHEMA_LEVELS``): 0 as declared; 1 brief descriptions,
#: optional parameters without description, no ``additionalProperties``; 2 required
#: parameters only, without descriptions or bounds; 3 as 2 without the optional tools.

#: OpenAI's rule for function names.
_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

#: At most this many validation problems are listed in one error result.
_MAX_LISTED_ERRORS = 5

_STRICT = ConfigDict(extra="forbid")


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


@dataclass(frozen=True, slots=True)
class Tool:
    """One declared tool.

    Args:
        name: the function name the model calls (``[A-Za-z0-9_-]{1,64}``).
        description: what the model reads about the tool.
        kind: agency or work (spec, "Completion gate").
        args_model: the pydantic model the JSON arguments are validated against.
        fn: the implementation, ``fn(ctx, args_model_instance)`` (see :meth:`invoke`).
        timeout_s: per-call timeout in seconds the engine applies; ``None`` for its default.
        takes_model: ``True`` when ``fn`` receives the model instance, ``False`` when it
            receives the fields as keyword arguments (plain typed signature).
        brief: a short description (about 60 characters) for small context windows; ``None``:
            the first sentence of ``description``.
        optional: left out at the most compact schema level (:data:`SCHEMA_LEVELS`): a
            convenience the entity can do without (``think``, ``wait``).
    """

    name: str
    description: str
    kind: ToolKind
    args_model: type[BaseModel]
    fn: Callable[..., Awaitable[ToolResult | str]]
    timeout_s: float | None = None
    takes_model: bool = True
    brief: str | None = None
    optional: bool = False

    async def invoke(self, ctx: ToolContext, args: BaseModel) -> ToolResult | str:
        """Call the implementation with validated ``args``."""
        if self.takes_model:
            return await self.fn(ctx, args)
        fields = {name: getattr(args, name) for name in type(args).model_fields}
        return await self.fn(ctx, **fields)

    def schema(self, level: int = 0) -> dict[str, Any]:
        """The OpenAI ``tools`` entry ``{"type": "function", "function": {...}}`` at a
        compaction ``level`` (:data:`SCHEMA_LEVELS`)."""
        parameters = _clean_schema(self.args_model.model_json_schema())
        parameters.setdefault("properties", {})
        description = self.description
        if level >= 1:
            description = self.brief or first_sentence(self.description)
            required = set(parameters.get("required", ()))
            for key, prop in list(parameters["properties"].items()):
                if level >= 2 and key not in required:
                    del parameters["properties"][key]
                    continue
                prop.pop("default", None)
                if level >= 2 or key not in required:
                    prop.pop("description", None)
                if level >= 2:
                    for bound in ("minimum", "maximum", "minLength", "maxLength"):
                        prop.pop(bound, None)
        else:
            parameters["additionalProperties"] = False
        return {
            "type": "function",
            "function": {"name": self.name, "description": description, "parameters": parameters},
        }


def tool(
    *,
    kind: ToolKind,
    name: str | None = None,
    timeout_s: float | None = None,
    description: str | None = None,
    args_model: type[BaseModel] | None = None,
    brief: str | None = None,
    optional: bool = False,
) -> Callable[[Callable[..., Awaitable[ToolResult | str]]], Tool]:
    """Decorator turning an ``async def f(ctx, ...)`` into a :class:`Tool`.

    Args:
        kind: agency or work.
        name: defaults to the function's name.
        timeout_s: per-call timeout in seconds, ``None`` for the engine's default.
        description: defaults to the first paragraph of the function's docstring.
        brief: the short description for small windows (see :class:`Tool`).
        optional: dropped at the most compact schema level (see :class:`Tool`).
        args_model: the argument model ``f(ctx, args)`` takes; by default read from the
            annotations (give it when they cannot be resolved, e.g. a model defined
            inside a function in a module using ``from __future__ import annotations``).

    Raises:
        TypeError: if the function is not ``async``, has no ``ctx`` parameter, has an
            unannotated or unresolvable parameter or ``*args``/``**kwargs``, or has no
            description.
        ValueError: if the name is not a valid OpenAI function name.
    """

    def decorate(fn: Callable[..., Awaitable[ToolResult | str]]) -> Tool:
        return make_tool(
            fn,
            kind=kind,
            name=name,
            timeout_s=timeout_s,
            description=description,
            args_model=args_model,
            brief=brief,
            optional=optional,
        )

    return decorate


def make_tool(
    fn: Callable[..., Awaitable[ToolResult | str]],
    *,
    kind: ToolKind,
    name: str | None = None,
    timeout_s: float | None = None,
    description: str | None = None,
    args_model: type[BaseModel] | None = None,
    brief: str | None = None,
    optional: bool = False,
) -> Tool:
    """Build a :class:`Tool` from a function (the non-decorator form of :func:`tool`)."""
    tool_name = name or fn.__name__
    if not _NAME_RE.match(tool_name):
        raise ValueError(f"invalid tool name {tool_name!r}: must match {_NAME_RE.pattern}")
    if not inspect.iscoroutinefunction(fn):
        raise TypeError(f"tool {tool_name!r} must be an async function")
    text = description if description is not None else _first_paragraph(inspect.getdoc(fn))
    if not text:
        raise TypeError(f"tool {tool_name!r} needs a description (docstring)")
    if timeout_s is not None and timeout_s <= 0:
        raise ValueError(f"tool {tool_name!r}: timeout_s must be > 0, got {timeout_s}")
    if args_model is not None:
        model, takes_model = _strict(args_model), True
    else:
        model, takes_model = _args_model(fn, tool_name)
    return Tool(
        name=tool_name,
        description=text,
        kind=kind,
        args_model=model,
        fn=fn,
        timeout_s=timeout_s,
        takes_model=takes_model,
        brief=brief,
        optional=optional,
    )


# -- run-time tools (issue 15, MCP: added for tools/mcp.py) ----------------------------------


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

    Raises:
        ValueError: on a duplicate tool name or a ``max_result_chars`` below 200.
    """

    def __init__(
        self,
        tools: Iterable[Tool] = (),
        *,
        max_result_chars: int = DEFAULT_MAX_RESULT_CHARS,
        sources: Iterable[ToolSource] = (),
    ) -> None:
        if max_result_chars < 200:
            raise ValueError(f"max_result_chars must be >= 200, got {max_result_chars}")
        self.max_result_chars = max_result_chars
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
        """Offer and run ``source``'s tools too, from now on (issue 15)."""
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
        return Registry(chosen, max_result_chars=self.max_result_chars, sources=self._sources)

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
        """OpenAI ``tools`` entries for every registered tool, in registration order, then the
        sources' tools that ``conversation`` may use, at a compaction ``level``
        (:data:`SCHEMA_LEVELS`; at the last level optional tools are left out).

        Args:
            level: the compaction level.
            conversation: whose tools: a conversation key. ``None`` takes the one the running
                turn bound for its logs (``bumblebot.core.logs.bind``, set around every turn), or
                ``""`` outside a turn, where a source offers only tools allowed everywhere.

        Built once per level (and conversation and sources' generation) and cached
        (JSON-schema generation is not free and runs every step); :meth:`add` invalidates
        the cache. Callers must not modify the returned list.
        """
        level = max(0, min(SCHEMA_LEVELS - 1, level))
        if level not in self._schemas:
            tools = [t for t in self._tools.values() if not (t.optional and level >= SCHEMA_LEVELS - 1)]
            self._schemas[level] = [t.schema(level) for t in tools]
        static = self._schemas[level]
        if not self._sources:
            return static
        if conversation is None:
            conversation = str(bound().get("conversation", ""))
        generations = tuple(source.generation for source in self._sources)
        key = (level, conversation, generations)
        cached = self._dynamic.get(key)
        if cached is None:
            if len(self._dynamic) >= _MAX_DYNAMIC_SCHEMAS or any(k[2] != generations for k in self._dynamic):
                self._dynamic = {}
            extra = [t for t in self.offered(conversation) if not (t.optional and level >= SCHEMA_LEVELS - 1)]
            cached = self._dynamic[key] = static + [t.schema(level) for t in extra] if extra else static
        return cached

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
        out = await self._run(name, arguments, ctx)
        if len(out.content) > self.max_result_chars:
            out = ToolResult(cap_text(out.content, self.max_result_chars), ok=out.ok)
        return out

    async def _run(self, name: str, arguments: str, ctx: ToolContext) -> ToolResult:
        found = self._tools.get(name)
        if found is None and self._sources:  # a source's tool, where this conversation may use it
            entry = self._current().get(name)
            if entry is not None and entry[1].permits(name, ctx.conversation):
                found = entry[0]
            elif entry is not None:
                return ToolResult.error(f"tool {name!r} is not available in this conversation")
            elif any(source.known(name) is not None for source in self._sources):
                return ToolResult.error(
                    f"tool {name!r} is not available now (its server is down or no longer offers it); "
                    "do without it or try again later"
                )
        if found is None:
            offered = [t.name for t in self.offered(ctx.conversation)] if self._sources else []
            available = ", ".join([*self._tools, *offered]) or "(none)"
            return ToolResult.error(f"unknown tool {name!r}; available tools: {available}")
        parsed = _parse_arguments(arguments)
        if isinstance(parsed, str):
            return ToolResult.error(f"{name}: {parsed}")
        try:
            args = found.args_model.model_validate(parsed)
        except ValidationError as exc:
            return ToolResult.error(f"{name}: invalid arguments: {_describe(exc)}")
        try:
            out = await found.invoke(ctx, args)
        except sqlite3.Error:
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


# -- helpers ------------------------------------------------------------------------------


def _first_paragraph(doc: str | None) -> str:
    if not doc:
        return ""
    paragraph = doc.strip().split("\n\n", 1)[0]
    return " ".join(line.strip() for line in paragraph.splitlines()).strip()


def _args_model(fn: Callable[..., Any], tool_name: str) -> tuple[type[BaseModel], bool]:
    """The argument model of ``fn`` and whether ``fn`` takes it whole."""
    params = list(inspect.signature(fn).parameters.values())
    if not params or params[0].kind not in (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
    ):
        raise TypeError(f"tool {tool_name!r}: first parameter must be the ToolContext")
    try:
        hints = typing.get_type_hints(fn, include_extras=True)
    except NameError as exc:
        raise TypeError(
            f"tool {tool_name!r}: cannot resolve its annotations ({exc}); define the types "
            "at module level or pass args_model="
        ) from exc
    rest = params[1:]
    if len(rest) == 1:
        hint = hints.get(rest[0].name)
        if inspect.isclass(hint) and issubclass(hint, BaseModel):
            return _strict(hint), True
    fields: dict[str, Any] = {}
    for param in rest:
        if param.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            raise TypeError(f"tool {tool_name!r}: *args/**kwargs are not allowed")
        if param.name not in hints:
            raise TypeError(f"tool {tool_name!r}: parameter {param.name!r} needs a type")
        default = ... if param.default is inspect.Parameter.empty else param.default
        fields[param.name] = (hints[param.name], default)
    model_name = "".join(part.capitalize() for part in tool_name.split("_")) + "Args"
    model = create_model(model_name, __config__=_STRICT, **fields)
    return model, False


def _strict(model: type[BaseModel]) -> type[BaseModel]:
    """``model`` itself if it forbids unknown fields, else a subclass that does."""
    if model.model_config.get("extra") == "forbid":
        return model
    config = ConfigDict(**{**model.model_config, "extra": "forbid"})  # type: ignore[typeddict-item]
    return type(model.__name__, (model,), {"model_config": config, "__module__": model.__module__})


_SCHEMA_MAPPINGS = frozenset({"properties", "$defs", "definitions", "patternProperties"})
_SCHEMA_DATA = frozenset({"default", "enum", "const", "examples"})


def first_sentence(text: str, limit: int = 90) -> str:
    """The first sentence of ``text`` (up to a ``.``, ``!`` or ``?`` followed by a space and a
    capital letter, or the end), cut to ``limit`` characters; linear in the text's length."""
    text = " ".join(text.split())
    end = len(text)
    for i, char in enumerate(text[: limit + 2]):
        if char in ".!?" and (i + 2 >= len(text) or (text[i + 1] == " " and text[i + 2].isupper())):
            end = i + 1
            break
    sentence = text[:end]
    return sentence if len(sentence) <= limit else sentence[: limit - 1].rstrip() + "…"


def _clean_schema(node: Any, mapping: bool = False) -> Any:
    """Drop pydantic's ``title`` noise from a JSON schema (not fields named ``title``)."""
    if isinstance(node, list):
        return [_clean_schema(item) for item in node]
    if not isinstance(node, dict):
        return node
    if mapping:
        return {key: _clean_schema(value) for key, value in node.items()}
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "title" and isinstance(value, str):
            continue
        if key in _SCHEMA_DATA:
            out[key] = value
        else:
            out[key] = _clean_schema(value, mapping=key in _SCHEMA_MAPPINGS)
    return out


def _parse_arguments(arguments: str | None) -> dict[str, Any] | str:
    """The arguments object, or a message saying why there is none."""
    if arguments is None or not arguments.strip():
        return {}
    try:
        value = json.loads(arguments)
    except (json.JSONDecodeError, RecursionError) as exc:
        detail = exc.msg if isinstance(exc, json.JSONDecodeError) else "nested too deeply"
        return f"arguments are not valid JSON ({detail}); send a JSON object"
    if value is None:
        return {}
    if not isinstance(value, dict):
        return f"arguments must be a JSON object, got {_json_type(value)}"
    return value


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return type(value).__name__


def _describe(exc: ValidationError) -> str:
    """Pydantic's messages, one per problem, e.g. ``"path: Field required"``."""
    problems = exc.errors(include_url=False, include_context=False, include_input=False)
    parts = []
    for problem in problems[:_MAX_LISTED_ERRORS]:
        where = ".".join(str(part) for part in problem["loc"]) or "arguments"
        parts.append(f"{where}: {problem['msg']}")
    more = len(problems) - _MAX_LISTED_ERRORS
    if more > 0:
        parts.append(f"and {more} more")
    return "; ".join(parts)
