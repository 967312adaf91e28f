"""A real MCP server over stdio, written with the SDK (``MCPServer``), for ``tests/test_mcp.py``.

Run as ``python tests/fakes/mcp_server.py [options]``; the MCP manager starts it like any
configured server. Its tools:

* ``add(a, b)``: the sum, as text; ``echo(text)``: the text back;
* ``hang()``: never answers (a call that must time out);
* ``picture()``: a line of text, a PNG image, an embedded text resource and a resource link;
* ``secret()``: the value of ``$FAKE_MCP_TOKEN`` (a secret the manager passed in ``env``);
* ``fail()``: an error result (``isError``);
* ``change_tools()``: removes ``echo``, adds ``multiply(a, b)`` and announces
  ``notifications/tools/list_changed`` (both protocol eras: the legacy notification on the
  connection and the 2026-era ``subscriptions/listen`` event).

Options:

* ``--exit-now CODE``: write a reason to stderr (naming ``$FAKE_MCP_TOKEN``, a secret the log
  must not show) and exit at once with ``CODE`` (a server whose command fails at start);
* ``--starts FILE``: append a line to ``FILE`` at every start (tests count restarts);
* ``--die-after-calls N``: exit (code 7) after answering ``N`` tool calls (a server that dies
  while connected);
* ``--long-description``: ``add`` gets a very long description and a bulky input schema;
* ``--http PORT``: serve streamable HTTP on ``127.0.0.1:PORT/mcp`` instead of stdio; with
  ``$FAKE_MCP_TOKEN`` set, a request without ``Authorization: Bearer <token>`` gets a 401.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import os
import sys
import threading
from pathlib import Path
from typing import Annotated, Any

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import (
    EmbeddedResource,
    ImageContent,
    ResourceLink,
    TextContent,
    TextResourceContents,
)
from pydantic import Field

#: A 1×1 transparent PNG.
PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg=="
)

LONG_DESCRIPTION = "Add two numbers. " + "This sentence pads the description to test the budget. " * 60


def build(args: argparse.Namespace) -> MCPServer:
    server = MCPServer("fake-mcp", instructions="A fake server for Bumblebot's tests.", log_level="ERROR")
    calls = {"n": 0}

    def answered() -> None:
        calls["n"] += 1
        if args.die_after_calls and calls["n"] >= args.die_after_calls:
            # exit once this answer is written: the next call finds the server gone
            threading.Timer(0.2, os._exit, (7,)).start()

    if args.long_description:
        @server.tool(name="add", description=LONG_DESCRIPTION)
        def add_long(
            a: Annotated[int, Field(description="The first number. " + "Padding. " * 40)],
            b: Annotated[int, Field(description="The second number. " + "Padding. " * 40)],
            note: Annotated[str, Field(description="An optional note. " + "Padding. " * 40)] = "",
        ) -> str:
            answered()
            return str(a + b)
    else:
        @server.tool(name="add")
        def add(a: int, b: int) -> str:
            """Add two integers and return the sum."""
            answered()
            return str(a + b)

    @server.tool(name="echo")
    def echo(text: Annotated[str, Field(description="What to say back")]) -> str:
        """Echo the text back."""
        answered()
        return text

    @server.tool(name="hang")
    async def hang() -> str:
        """Never answer (for timeout tests)."""
        await asyncio.Event().wait()
        return "unreachable"

    @server.tool(name="picture")
    def picture() -> list[Any]:
        """Return a picture and a document."""
        answered()
        return [
            TextContent(type="text", text="here is the chart"),
            ImageContent(type="image", data=base64.b64encode(PNG).decode(), mime_type="image/png"),
            EmbeddedResource(
                type="resource",
                resource=TextResourceContents(uri="file:///notes/report.txt", mime_type="text/plain", text="Q3 report: up 4%"),
            ),
            ResourceLink(type="resource_link", uri="file:///notes/big.csv", name="big.csv", mime_type="text/csv"),
        ]

    @server.tool(name="secret")
    def secret() -> str:
        """Return the token the server was given."""
        answered()
        return os.environ.get("FAKE_MCP_TOKEN", "(unset)")

    @server.tool(name="fail")
    def fail() -> str:
        """Always fail."""
        raise ToolError("the fake server refuses")

    @server.tool(name="change_tools")
    async def change_tools(ctx: Context) -> str:
        """Replace echo by multiply and announce the change."""
        server.remove_tool("echo")

        def multiply(a: int, b: int) -> str:
            """Multiply two integers."""
            return str(a * b)

        server.add_tool(multiply, name="multiply")
        with contextlib.suppress(Exception):  # the 2026 era drops it: the listen event below carries it
            await ctx.session.send_tool_list_changed()  # 2025 era: on the connection
        await ctx.notify_tools_changed()  # 2026 era: to subscriptions/listen streams
        return "changed"

    return server


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--exit-now", type=int, default=None)
    parser.add_argument("--starts", type=Path, default=None)
    parser.add_argument("--die-after-calls", type=int, default=0)
    parser.add_argument("--long-description", action="store_true")
    parser.add_argument("--http", type=int, default=None)
    args = parser.parse_args(argv)
    if args.starts is not None:
        with args.starts.open("a") as handle:
            handle.write(f"{os.getpid()}\n")
    if args.exit_now is not None:
        token = os.environ.get("FAKE_MCP_TOKEN", "")
        print(f"fake-mcp: cannot open the database /nonexistent/db.sqlite (token {token})", file=sys.stderr, flush=True)
        sys.exit(args.exit_now)
    server = build(args)
    if args.http is None:
        server.run("stdio")
        return
    serve_http(server, args.http, os.environ.get("FAKE_MCP_TOKEN", ""))


def serve_http(server: MCPServer, port: int, token: str) -> None:
    """Streamable HTTP behind a bearer-token check (when ``token`` is set)."""
    import uvicorn

    app = server.streamable_http_app()
    expected = f"Bearer {token}".encode()

    async def guarded(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and token and dict(scope["headers"]).get(b"authorization") != expected:
            await send({"type": "http.response.start", "status": 401, "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": b"unauthorized"})
            return
        await app(scope, receive, send)

    uvicorn.run(guarded, host="127.0.0.1", port=port, log_level="error")


if __name__ == "__main__":
    main()
