"""The settings of MCP tool servers (``mcp``): which servers, how to reach them, where their
tools are offered, and the secret values their settings hold (logs and traces redact them).
The client that connects to them is ``tools/mcp_client.py``."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

_SERVER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,31}$")
#: A reference to an environment variable in a server's ``env`` or ``headers``: ``${NAME}``.
ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")



class MCPServerSettings(BaseModel):
    """One MCP server: either ``command`` (stdio) or ``url`` (streamable HTTP)."""

    model_config = ConfigDict(extra="forbid", validate_default=True)

    command: list[str] | None = Field(
        None, description="stdio server: the program and its arguments, e.g. [npx, -y, @modelcontextprotocol/server-memory]"
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="stdio server: extra environment variables (values may be ${VAR}); only HOME, LOGNAME, "
        "PATH, SHELL, TERM and USER are inherited otherwise",
    )
    cwd: Path | None = Field(None, description="stdio server: its working directory; default: the daemon's")
    url: str | None = Field(None, description="streamable HTTP server: its endpoint, e.g. https://example.com/mcp")
    headers: dict[str, str] = Field(
        default_factory=dict,
        description='HTTP server: request headers; values may be ${VAR}, e.g. {Authorization: "Bearer ${NOTES_TOKEN}"}',
    )
    enabled: bool = Field(True, description="connect to this server")
    tools: list[str] = Field(
        default_factory=list, description="the server's tools to offer, by the server's own names; empty: all"
    )
    timeout_s: float = Field(30.0, gt=0, description="longest wait for one tool call, seconds")
    allowed_chats: list[str] | None = Field(
        None,
        description="where its tools are offered: conversation keys (telegram:123; a key covers its topics), "
        "'telegram:*', 'private' (private chats with allowlisted users, and the terminal), '*' (everywhere); "
        "default: private",
    )
    protocol: Literal["auto", "legacy"] = Field(
        "auto",
        description="auto: the newest protocol the server speaks; legacy: the 2025 initialize handshake only",
    )

    @model_validator(mode="after")
    def _one_transport(self) -> MCPServerSettings:
        if (self.command is None) == (self.url is None):
            raise ValueError("give either command (a stdio server) or url (a streamable HTTP server)")
        if self.command is not None:
            if not self.command or not self.command[0]:
                raise ValueError("command must name a program, e.g. [python, -m, my_server]")
            if self.headers:
                raise ValueError("headers are for url servers; a stdio server takes env")
        elif self.env or self.cwd is not None:
            raise ValueError("env and cwd are for command servers; a url server takes headers")
        elif not self.url.startswith(("http://", "https://")):  # type: ignore[union-attr]
            raise ValueError(f"url must start with http:// or https://, got {self.url!r}")
        return self

    @property
    def transport(self) -> str:
        """``"stdio"`` or ``"http"``."""
        return "stdio" if self.command is not None else "http"


class MCPSettings(BaseModel):
    """MCP tool servers (``mcp.servers.<name>``)."""

    model_config = ConfigDict(extra="forbid", validate_default=True)

    servers: dict[str, MCPServerSettings] = Field(
        default_factory=dict, description="the servers by name; a tool is offered as <name>__<tool>"
    )
    startup_wait_s: float = Field(
        10.0, ge=0, description="longest wait at startup for the servers before the daemon is ready, seconds"
    )
    connect_timeout_s: float = Field(30.0, gt=0, description="longest wait for a server's handshake or tool list, seconds")
    retry_max_s: float = Field(300.0, ge=1, description="longest wait between two tries of a server that is down, seconds")
    tool_budget_chars: int = Field(
        1200, ge=200, description="most characters of one MCP tool's schema (name, description, parameters) as offered"
    )

    @field_validator("servers")
    @classmethod
    def _names(cls, servers: dict[str, MCPServerSettings]) -> dict[str, MCPServerSettings]:
        bad = [name for name in servers if not _SERVER_NAME.match(name) or "__" in name]
        if bad:
            raise ValueError(
                f"server names must be 1-32 letters, digits, '_' or '-' (no '__'), got {', '.join(map(repr, bad))}"
            )
        return servers



def secret_values(settings: MCPSettings, environ: Mapping[str, str] | None = None) -> list[str]:
    """Every value of a server's ``env`` and ``headers``, with ``${VAR}`` resolved (unset ones
    skipped): the daemon adds them to what logs and traces redact."""
    environ = os.environ if environ is None else environ
    out = {v for server in settings.servers.values() for v in secrets_of(server, environ)}
    return sorted(out, key=len, reverse=True)  # longest first: a part never masks the whole


def secrets_of(server: MCPServerSettings, environ: Mapping[str, str]) -> set[str]:
    """The secret values one server's ``env`` and ``headers`` hold, ``${VAR}`` resolved."""
    out: set[str] = set()
    for value in (*server.env.values(), *server.headers.values()):
        out.add(ENV_REF.sub(lambda m: environ.get(m.group(1), ""), value))
        out |= {environ[m.group(1)] for m in ENV_REF.finditer(value) if environ.get(m.group(1))}
    return {v for v in out if v}


