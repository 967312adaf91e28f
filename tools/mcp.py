"""MCP servers' tools as registry tools.

:class:`MCPTools` is a :class:`tools.registry.ToolSource` over a
:class:`tools.mcp_client.MCPManager`: every tool of a connected server becomes a **work**
tool (it grounds an answer for the completion gate) named ``<server>__<tool>``, offered and run
while its server is connected, in the conversations its server's ``allowed_chats`` permits.

Names. ``<server>__<tool>`` with every character outside ``[A-Za-z0-9_-]`` replaced by ``_``;
a name longer than 64 characters, or one that would collide with another after that, is cut and
ends in a short hash of the tool's own name (stable across restarts).

Budget. MCP schemas are part of the fixed part of every request, which must fit small windows.
Each tool's schema (name, description and parameters as JSON) is held to
``mcp.tool_budget_chars`` characters at compaction level 0, and less at the higher levels (see
:func:`mcp_schema`): titles, examples and ``$schema`` go first, then long descriptions are
cut, then optional parameters, then every description; the last resort is the bare list of
required parameter names.

Where the tools are offered: each server's ``allowed_chats`` (default ``"private"``), read by
:class:`tools.access.ChatAccess` like the work tools' rules (``tools/access.py`` lists them).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict

from bumblebot.core.events import storable_text
from bumblebot.core.messages import json_text
from bumblebot.core.toolkit import SCHEMA_LEVELS, ToolContext, ToolKind, ToolResult
from tools.mcp_client import MCPManager
from tools.mcp_records import MCPTimeout, MCPUnavailable, RemoteTool

from .access import PRIVATE, ChatAccess
from .definition import Tool
from .schemas import first_sentence

__all__ = [
    "MCPTool",
    "MCPTools",
    "allowlisted_private_chats",
    "mcp_schema",
    "tool_name",
]

log = logging.getLogger("bumblebot.mcp")

#: Seconds the engine's own timeout of an MCP call waits past the server's ``timeout_s``, so the
#: call's clearer error (naming the server) comes first.
TIMEOUT_GRACE_S = 2.0

#: Characters of a tool's description at level 0 (later levels keep its first sentence), and
#: of a parameter's description at levels 0 and 1.
DESCRIPTION_CHARS = 400
PARAMETER_DESCRIPTION_CHARS = (160, 60, 0, 0)
#: Share of ``tool_budget_chars`` each compaction level allows.
LEVEL_BUDGET = (1.0, 0.6, 0.4, 0.4)

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")
_MAX_NAME = 64


# -- names ---------------------------------------------------------------------------------


def tool_name(server: str, tool: str, taken: Iterable[str] = ()) -> str:
    """The registry name of ``tool`` of ``server``: ``<server>__<tool>``, sanitised to
    ``^[A-Za-z0-9_-]{1,64}$``; cut and given a hash of ``tool`` when too long or already in
    ``taken``."""
    name = f"{_UNSAFE.sub('_', server)}__{_UNSAFE.sub('_', tool) or '_'}"
    taken = set(taken)
    if len(name) <= _MAX_NAME and name not in taken:
        return name
    digest = hashlib.sha256(tool.encode()).hexdigest()
    for width in (6, 10, 16, 64):
        suffix = f"_{digest[:width]}"
        candidate = name[: _MAX_NAME - len(suffix)] + suffix
        if candidate not in taken:
            return candidate
    raise ValueError(f"no free name for MCP tool {tool!r} of {server!r}")  # 64 hex digits collided


# -- schemas ---------------------------------------------------------------------------------

_DROP = frozenset({"title", "$schema", "$id", "$comment", "examples", "deprecated", "readOnly", "writeOnly"})
_DATA = frozenset({"enum", "const", "default"})
_MAPS = frozenset({"properties", "$defs", "definitions", "patternProperties", "dependentSchemas"})
_BOUNDS = frozenset({
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minLength", "maxLength", "pattern",
    "minItems", "maxItems", "uniqueItems", "multipleOf", "minProperties", "maxProperties",
})


def _trim(text: str, limit: int) -> str:
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    cut = text[: limit - 1]
    space = cut.rfind(" ")
    return (cut[:space] if space > limit // 2 else cut).rstrip(" ,;:") + "…"


def _clean(node: Any, *, describe: int, bounds: bool, defaults: bool) -> Any:
    """A copy of a JSON schema without noise; descriptions cut to ``describe`` characters
    (``0``: none), bounds and defaults kept when asked. Property names are never touched."""
    if isinstance(node, list):
        return [_clean(item, describe=describe, bounds=bounds, defaults=defaults) for item in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP or key.startswith("x-"):
            continue
        if key == "description":
            if describe and isinstance(value, str) and value.strip():
                out[key] = _trim(value, describe)
        elif key in _DATA:
            if key != "default" or defaults:
                out[key] = value
        elif key in _BOUNDS:
            if bounds:
                out[key] = value
        elif key in _MAPS and isinstance(value, dict):
            out[key] = {
                name: _clean(sub, describe=describe, bounds=bounds, defaults=defaults) for name, sub in value.items()
            }
        else:
            out[key] = _clean(value, describe=describe, bounds=bounds, defaults=defaults)
    return out


def _object(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` as the object schema the endpoint expects (``type`` and ``properties`` set)."""
    out = dict(schema)
    out["type"] = "object"
    if not isinstance(out.get("properties"), dict):
        out["properties"] = {}
    if "required" in out and not isinstance(out["required"], list):
        del out["required"]
    return out


def _variants(schema: dict[str, Any], level: int) -> list[dict[str, Any]]:
    """Ever smaller forms of an input schema, starting at ``level``'s."""
    required = [r for r in schema.get("required", []) if isinstance(r, str)] if isinstance(schema.get("required"), list) else []
    out: list[dict[str, Any]] = []
    for step in range(level, 3):
        describe = PARAMETER_DESCRIPTION_CHARS[step]
        shaped = _object(_clean(schema, describe=describe, bounds=step < 2, defaults=step < 1))
        if step >= 1:
            shaped.pop("additionalProperties", None)
            for key, prop in shaped["properties"].items():
                if key not in required and isinstance(prop, dict):
                    prop.pop("description", None)
        if step >= 2:
            shaped["properties"] = {k: v for k, v in shaped["properties"].items() if k in required}
        out.append(shaped)
    bare = {k: {"type": v["type"]} if isinstance(v, dict) and isinstance(v.get("type"), str) else {}
            for k, v in _object(schema)["properties"].items() if k in required}
    out.append({"type": "object", "properties": bare, "required": [r for r in required if r in bare]})
    return out


def mcp_schema(name: str, description: str, input_schema: dict[str, Any], level: int, budget_chars: int) -> dict[str, Any]:
    """The OpenAI ``tools`` entry of an MCP tool at a compaction ``level``, within budget.

    Level 0 keeps the description's first :data:`DESCRIPTION_CHARS` characters and parameter
    descriptions cut to 160; level 1 the first sentence, required parameters' descriptions cut
    to 60 and no bounds' defaults; levels 2 and 3 required parameters only, without
    descriptions or bounds. Whatever the level, the entry's JSON stays within
    ``budget_chars × LEVEL_BUDGET[level]`` characters when it can: smaller forms are tried in
    that order, then a shorter description, then bare required parameters.
    """
    level = max(0, min(SCHEMA_LEVELS - 1, level))
    budget = max(200, int(budget_chars * LEVEL_BUDGET[level]))
    description = description.strip() or name
    texts = [_trim(description, DESCRIPTION_CHARS)] if level == 0 else []
    texts.append(first_sentence(description))
    entry: dict[str, Any] = {}
    for text in texts:
        for parameters in _variants(input_schema, min(level, 2)):
            entry = {"type": "function", "function": {"name": name, "description": text, "parameters": parameters}}
            if len(json.dumps(entry, separators=(",", ":"), ensure_ascii=False)) <= budget:
                return entry
    return entry  # the smallest form, over budget: a tool with very many required parameters


# -- tools -----------------------------------------------------------------------------------


class _Arguments(BaseModel):
    """Any JSON object: the server validates its own arguments."""

    model_config = ConfigDict(extra="allow")


@dataclass(frozen=True, slots=True)
class MCPTool(Tool):
    """A registry tool backed by an MCP server's tool.

    Args:
        server: the server's name in the config.
        remote: the tool's name on the server.
        input_schema: its JSON schema of arguments, as the server listed it.
        budget_chars: the schema budget (``mcp.tool_budget_chars``).
    """

    server: str = ""
    remote: str = ""
    input_schema: dict[str, Any] = field(default_factory=dict)
    budget_chars: int = 1200
    _schemas: dict[int, dict[str, Any]] = field(default_factory=dict, repr=False, compare=False)

    async def invoke(self, ctx: ToolContext, args: BaseModel) -> ToolResult | str:
        """Call the server with the arguments as given (the server validates them)."""
        return await self.fn(ctx, dict(args.model_extra or {}))

    def schema(self, level: int = 0) -> dict[str, Any]:
        """The ``tools`` entry at a compaction ``level``, within budget (:func:`mcp_schema`);
        built once per level (callers must not modify it)."""
        if level not in self._schemas:
            self._schemas[level] = mcp_schema(self.name, self.description, self.input_schema, level, self.budget_chars)
        return self._schemas[level]


class MCPTools:
    """The MCP servers' tools for a :class:`tools.registry.Registry` (a ``ToolSource``).

    Args:
        manager: the running servers.
        trusted: the ``"private"`` rule (:func:`allowlisted_private_chats`); default: the
            terminal chat only.

    Register with ``registry.add_source(MCPTools(manager, trusted=...))``. Tools are rebuilt
    when the manager's generation changes (a server connected, died or changed its list), not
    at every step.
    """

    def __init__(self, manager: MCPManager, *, trusted: Callable[[str], bool] | None = None) -> None:
        self._manager = manager
        servers = manager.settings.servers
        rule = trusted or ChatAccess().trusted
        self._access = {
            name: ChatAccess(tuple(cfg.allowed_chats) if cfg.allowed_chats is not None else (PRIVATE,), rule)
            for name, cfg in servers.items()
        }
        self._built = -1
        self._tools: list[MCPTool] = []
        self._current: dict[str, MCPTool] = {}
        self._known: dict[str, MCPTool] = {}
        self._names: dict[tuple[str, str], str] = {}  # (server, remote name) -> registry name

    @property
    def generation(self) -> int:
        """The manager's generation."""
        return self._manager.generation

    def tools(self) -> Sequence[Tool]:
        """Every connected server's tools, by server in config order."""
        self._rebuild()
        return self._tools

    def permits(self, name: str, conversation: str) -> bool:
        """Whether ``conversation`` may use tool ``name`` (its server's ``allowed_chats``)."""
        self._rebuild()
        found = self._current.get(name) or self._known.get(name)
        return found is not None and self._access[found.server].permits(conversation)

    def known(self, name: str) -> Tool | None:
        """Tool ``name`` if a server offers it now or did since the daemon started."""
        self._rebuild()
        return self._known.get(name)

    def summary(self, conversation: str) -> str:
        """``/status``'s line: each server's state and how many of its tools ``conversation``
        may use, e.g. ``"MCP: notes connected (3 tools here), home retrying in 40 s, team
        connected (not offered in this chat)"``; ``""`` without servers. Why a server is down
        is the log's (its error may name a path of this machine)."""
        from tools.mcp_records import ServerState

        parts = []
        for status in self._manager.status():
            if status.state is not ServerState.CONNECTED:
                parts.append(self._manager.summary_of(status, reason=False))
            elif not self._access[status.name].permits(conversation):
                parts.append(f"{status.name} connected (not offered in this chat)")
            else:
                count = len(status.tools)
                parts.append(f"{status.name} connected ({count} tool{'s' if count != 1 else ''} here)")
        return f"MCP: {', '.join(parts)}" if parts else ""

    def _rebuild(self) -> None:
        generation = self._manager.generation
        if generation == self._built:
            return
        budget = self._manager.settings.tool_budget_chars
        assigned = set(self._names.values())
        built: list[MCPTool] = []
        for remote in self._manager.tools():
            key = (remote.server, remote.name)
            name = self._names.get(key)
            if name is None:  # a name once given stays with its tool, and is never given to another
                name = self._names[key] = tool_name(remote.server, remote.name, assigned)
                assigned.add(name)
            built.append(self._tool(remote, name, budget))
        self._tools = built
        self._current = {t.name: t for t in built}
        self._known.update(self._current)
        self._built = generation

    def _tool(self, remote: RemoteTool, name: str, budget: int) -> MCPTool:
        manager, server, public = self._manager, remote.server, name
        cfg = manager.settings.servers[server]

        async def call(ctx: ToolContext, arguments: dict[str, Any]) -> ToolResult:
            try:
                result = await manager.call(server, remote.name, arguments)
            except MCPTimeout as exc:
                log.warning("MCP tool %s timed out after %g s in %s", public, exc.seconds, ctx.conversation or "-")
                return ToolResult.error(
                    f"{public} timed out after {exc.seconds:g} s: the MCP server {server!r} did not answer and "
                    "the call was cancelled; carry on without it"
                )
            except MCPUnavailable as exc:
                return ToolResult.error(f"{public} is unavailable: {exc.reason}")
            if result.is_error:
                return ToolResult.error(f"{public}: {result.text}")
            return ToolResult(result.text)

        # a server's text may hold a lone surrogate, which no request to the model can carry
        description = storable_text(remote.description or f"The {remote.name} tool of the {server} MCP server.")
        return MCPTool(
            name=name,
            description=description,
            kind=ToolKind.WORK,
            args_model=_Arguments,
            fn=call,
            timeout_s=cfg.timeout_s + TIMEOUT_GRACE_S,
            brief=first_sentence(description),
            server=server,
            remote=remote.name,
            input_schema=json.loads(json_text(remote.input_schema)),
            budget_chars=budget,
        )
