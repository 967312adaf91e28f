"""Declaring a tool: :class:`Tool`, the :func:`tool` decorator and :func:`make_tool`.

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
forbid unknown fields (``additionalProperties: false`` in the schema). A :class:`Tool` is
offered and run by a ``tools.registry.Registry``.
"""

from __future__ import annotations

import inspect
import re
import typing
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, create_model

from bumblebot.core.toolkit import ToolContext, ToolKind, ToolResult

from .schemas import function_schema

__all__ = ["Tool", "make_tool", "tool"]

#: OpenAI's rule for function names.
_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

_STRICT = ConfigDict(extra="forbid")


@dataclass(frozen=True, slots=True)
class Tool:
    """One declared tool.

    Args:
        name: the function name the model calls (``[A-Za-z0-9_-]{1,64}``).
        description: what the model reads about the tool.
        kind: agency or work (docs/cognition.md, "The completion gate").
        args_model: the pydantic model the JSON arguments are validated against.
        fn: the implementation, ``fn(ctx, args_model_instance)`` (see :meth:`invoke`).
        timeout_s: per-call timeout in seconds the engine applies; ``None`` for its default.
        takes_model: ``True`` when ``fn`` receives the model instance, ``False`` when it
            receives the fields as keyword arguments (plain typed signature).
        brief: a short description (about 60 characters) for small context windows; ``None``:
            the first sentence of ``description``.
        optional: left out at the most compact schema level (``SCHEMA_LEVELS``): a
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
        compaction ``level`` (``SCHEMA_LEVELS``; see ``tools/schemas.py``)."""
        return function_schema(self.name, self.description, self.brief, self.args_model, level)


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
