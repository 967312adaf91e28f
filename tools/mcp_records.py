"""What the MCP client gives out: servers' states and statuses, their tools, call results and
call errors.

These are plain values (no ``mcp`` SDK types): ``tools/mcp.py`` and ``bumblebot check`` read
them, and :class:`tools.mcp_client.MCPManager` makes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from bumblebot.core.errors import BumblebotError

__all__ = [
    "CallResult",
    "MCPCallError",
    "MCPTimeout",
    "MCPUnavailable",
    "RemoteTool",
    "ServerState",
    "ServerStatus",
]


class ServerState(StrEnum):
    """Where a server is in its life."""

    DISABLED = "disabled"  #: ``enabled: false``
    STARTING = "starting"  #: the first connection is under way
    CONNECTED = "connected"
    RETRYING = "retrying"  #: down; another try is scheduled
    FAILED = "failed"  #: a configuration problem (an unset ${VAR}); not tried again
    STOPPED = "stopped"


@dataclass(frozen=True, slots=True)
class RemoteTool:
    """One tool of a connected server, as it listed it (after the ``tools`` allowlist).

    Args:
        server: the server's name in the config.
        name: the tool's name on the server.
        description: its description (``title`` when it has none), untrimmed.
        input_schema: its JSON schema of arguments, untrimmed.
    """

    server: str
    name: str
    description: str
    input_schema: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ServerStatus:
    """A server's state for ``/status`` and ``bumblebot check``.

    Args:
        name: the server's name in the config.
        transport: ``"stdio"`` or ``"http"``.
        target: what it runs or reaches: the program, or the URL without its query.
        state: see :class:`ServerState`.
        tools: the tools offered (server names, after the allowlist).
        hidden: tools the server has that the allowlist leaves out.
        missing: allowlisted names the server does not have.
        error: why it is down or failed (redacted), else ``None``.
        attempts: failed tries since it was last connected for a while.
        retry_in_s: seconds to the next try, when retrying.
    """

    name: str
    transport: str
    target: str
    state: ServerState
    tools: tuple[str, ...] = ()
    hidden: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()
    error: str | None = None
    attempts: int = 0
    retry_in_s: float | None = None


@dataclass(frozen=True, slots=True)
class CallResult:
    """A tool call's result as text: ``is_error`` when the server said the call failed."""

    text: str
    is_error: bool = False


class MCPCallError(BumblebotError):
    """A call to an MCP tool could not be made or answered.

    Args:
        server: the server's name.
        tool: the tool's name on the server.
        reason: what went wrong, for the model and the log.
    """

    def __init__(self, server: str, tool: str, reason: str) -> None:
        self.server, self.tool, self.reason = server, tool, reason
        super().__init__(f"MCP server {server!r}, tool {tool!r}: {reason}")


class MCPUnavailable(MCPCallError):
    """The server is not connected (down, starting, retrying, disabled or unknown)."""


class MCPTimeout(MCPCallError):
    """The server did not answer within ``seconds``."""

    def __init__(self, server: str, tool: str, seconds: float) -> None:
        self.seconds = seconds
        super().__init__(server, tool, f"no answer within {seconds:g} s")
