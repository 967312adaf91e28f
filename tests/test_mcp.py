"""MCP tool servers (tools/mcp.py): a real stdio MCP server (``tests/fakes/mcp_server.py``, written
with the SDK) run as a subprocess, reached through the manager and the registry. No mocks."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from bumblebot.cognition.state import LoopState
from bumblebot.core.logs import bind
from bumblebot.core.mcp_settings import MCPSettings, secret_values
from bumblebot.core.messages import Message
from bumblebot.core.toolkit import SCHEMA_LEVELS, ToolContext, ToolKind
from tools import build_registry
from tools.definition import Tool, make_tool
from tools.access import allowlisted_private_chats
from tools.mcp import MCPTools, mcp_schema, tool_name
from tools.mcp_client import MCPManager, probe_servers
from tools.mcp_records import ServerState
from tools.registry import Registry

FAKE = Path(__file__).resolve().parent / "fakes" / "mcp_server.py"
OWNER = 42  # the allowlisted Telegram user: "telegram:42" is their private chat
PRIVATE_CHAT = f"telegram:{OWNER}"
GROUP_CHAT = "telegram:-1001234"
TOKEN = "fake-mcp-secret-0123456789"


def stdio(*args: str, **cfg: Any) -> dict[str, Any]:
    """A server entry running the fake server with ``args``."""
    return {"command": [sys.executable, str(FAKE), *args], **cfg}


def settings(**servers: dict[str, Any]) -> MCPSettings:
    return MCPSettings.model_validate({"servers": servers, "startup_wait_s": 20})


@contextlib.asynccontextmanager
async def mcp(
    config: MCPSettings, *, environ: dict[str, str] | None = None, wait: bool = True, **kwargs: Any
) -> AsyncIterator[tuple[MCPManager, Registry]]:
    """A running manager and a registry offering its tools (the private rule: user 42)."""
    env = {"PATH": os.environ.get("PATH", ""), "TOK": TOKEN, **(environ or {})}
    manager = MCPManager(config, environ=env, **kwargs)
    registry = build_registry(workspace=Path.cwd() / "workspace", web_enabled=False)
    registry.add_source(MCPTools(manager, trusted=allowlisted_private_chats(telegram_user_ids=[OWNER])))
    async with manager:
        if wait:
            await manager.wait_settled()
        yield manager, registry


def ctx(conversation: str = PRIVATE_CHAT) -> ToolContext:
    return ToolContext(workspace=Path.cwd(), data_dir=Path.cwd(), conversation=conversation)


def names(registry: Registry, conversation: str = PRIVATE_CHAT, level: int = 0) -> list[str]:
    return [s["function"]["name"] for s in registry.schemas(level, conversation=conversation)]


def schema_of(registry: Registry, name: str, conversation: str = PRIVATE_CHAT, level: int = 0) -> dict[str, Any]:
    return next(s for s in registry.schemas(level, conversation=conversation) if s["function"]["name"] == name)


async def until(check: Callable[[], Any], timeout_s: float = 15.0) -> Any:
    """Poll ``check`` until it is truthy; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := check():
            return value
        await asyncio.sleep(0.05)
    raise AssertionError(f"not reached within {timeout_s} s")


def error_of(content: str) -> str:
    return json.loads(content)["error"]


# -- offered, called, a work tool -------------------------------------------------------------


async def test_a_tool_is_offered_and_its_result_comes_back_through_the_registry() -> None:
    async with mcp(settings(fake=stdio(env={"FAKE_MCP_TOKEN": "${TOK}"}))) as (manager, registry):
        assert manager.status()[0].state is ServerState.CONNECTED
        offered = names(registry)
        assert {"say", "read_file", "fake__add", "fake__echo", "fake__picture"} <= set(offered)
        add = schema_of(registry, "fake__add")["function"]
        assert add["description"] == "Add two integers and return the sum."
        assert add["parameters"]["required"] == ["a", "b"]
        assert add["parameters"]["properties"]["a"] == {"type": "integer"}  # titles dropped

        result = await registry.execute("fake__add", '{"a": 2, "b": 40}', ctx())
        assert (result.ok, result.content) == (True, "42")

        picture = await registry.execute("fake__picture", "{}", ctx())
        assert picture.ok
        assert picture.content.splitlines()[0] == "here is the chart"
        assert "[an image (image/png, 70 bytes); not shown]" in picture.content
        assert "[resource file:///notes/report.txt, text/plain]\nQ3 report: up 4%" in picture.content
        assert "[resource link big.csv: file:///notes/big.csv, text/csv]" in picture.content

        secret = await registry.execute("fake__secret", "{}", ctx())  # ${TOK} reached the server's env
        assert secret.content == TOKEN

        failed = await registry.execute("fake__fail", "{}", ctx())
        assert not failed.ok
        assert error_of(failed.content) == "fake__fail: Error executing tool fail: the fake server refuses"

        refused = await registry.execute("fake__add", '{"a": "two"}', ctx())
        assert not refused.ok and "fake__add:" in error_of(refused.content)


async def test_mcp_tools_are_work_tools_for_the_completion_gate() -> None:
    async with mcp(settings(fake=stdio())) as (_, registry):
        assert registry.kind("fake__add") is ToolKind.WORK
        assert registry.kind("say") is ToolKind.AGENCY
        assert registry.timeout_s("fake__add") == 30 + 2  # the server's own timeout answers first
        call = {"id": "c1", "type": "function", "function": {"name": "fake__add", "arguments": '{"a":1,"b":2}'}}
        result = await registry.execute("fake__add", '{"a":1,"b":2}', ctx())
        transcript = [
            Message(role="user", content="what is 1+2?"),
            Message(role="assistant", content="", tool_calls=[call]),
            Message(role="tool", content=result.content, tool_call_id="c1", name="fake__add", ok=result.ok),
        ]
        state = LoopState.replay(transcript, registry.kind)  # what the gate's grounding judge counts
        assert (state.work_calls, state.work_ok) == (1, 1)
        gate = state.gate_input("end_turn", False, 0)
        assert gate.work_calls == 1 and gate.previews[0].tool == "fake__add"


async def test_results_go_through_the_registry_cap() -> None:
    async with mcp(settings(fake=stdio())) as (manager, _):
        small = build_registry(workspace=Path.cwd() / "workspace", web_enabled=False, max_result_chars=300)
        small.add_source(MCPTools(manager, trusted=allowlisted_private_chats(telegram_user_ids=[OWNER])))
        long = await small.execute("fake__echo", json.dumps({"text": "x" * 5000}), ctx())
        assert long.ok and len(long.content) <= 300 and "characters cut" in long.content


# -- failures ---------------------------------------------------------------------------------


async def test_a_server_whose_command_exits_at_once_is_logged_with_why_and_retried(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    starts = tmp_path / "starts"
    config = settings(
        dead=stdio("--exit-now", "3", "--starts", str(starts), env={"FAKE_MCP_TOKEN": "${TOK}"}),
        fake=stdio(),
    )
    caplog.set_level(logging.INFO, logger="bumblebot.mcp")
    async with mcp(config, retry_initial_s=0.2) as (manager, registry):
        await until(lambda: starts.is_file() and len(starts.read_text().splitlines()) >= 3)
        dead = manager.server_of("dead")
        assert dead is not None and dead.state is ServerState.RETRYING and dead.attempts >= 2
        assert "cannot open the database /nonexistent/db.sqlite" in (dead.error or "")
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        why = next(m for m in warnings if m.startswith("MCP server dead failed to start"))
        assert "the server closed the connection" in why and "cannot open the database" in why
        assert "trying again in 0.2 s" in why
        assert TOKEN not in caplog.text and "[REDACTED]" in why  # its env secret, echoed on stderr

        # the manager keeps running: the other server serves, the dead one's tools are left out
        assert not [n for n in names(registry) if n.startswith("dead__")]
        assert (await registry.execute("fake__add", '{"a":1,"b":1}', ctx())).content == "2"
        unknown = await registry.execute("dead__add", '{"a":1,"b":1}', ctx())
        assert not unknown.ok and "unknown tool 'dead__add'" in error_of(unknown.content)
        assert "dead retrying" in manager.summary() and "fake connected (7 tools)" in manager.summary()


async def test_a_command_that_cannot_run_is_reported(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="bumblebot.mcp")
    async with mcp(settings(ghost={"command": ["/nonexistent/mcp-server", "--flag"]})) as (manager, _):
        status = manager.status()[0]
        assert status.state is ServerState.RETRYING
        assert status.error == "cannot run '/nonexistent/mcp-server': No such file or directory: /nonexistent/mcp-server"
        assert "MCP server ghost failed to start: cannot run" in caplog.text
        # /status in a chat says that it is down, not the error (a path of the daemon's machine)
        shown = MCPTools(manager, trusted=allowlisted_private_chats(telegram_user_ids=[OWNER])).summary(PRIVATE_CHAT)
        assert shown.startswith("MCP: ghost retrying in ") and "nonexistent" not in shown and "(" not in shown


async def test_a_server_that_dies_is_reconnected(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    starts = tmp_path / "starts"
    caplog.set_level(logging.INFO, logger="bumblebot.mcp")
    async with mcp(settings(fake=stdio("--die-after-calls", "1", "--starts", str(starts))), retry_initial_s=0.2) as (
        manager,
        registry,
    ):
        assert (await registry.execute("fake__add", '{"a":1,"b":2}', ctx())).content == "3"
        await until(lambda: "MCP server fake disconnected" in caplog.text)  # noticed without a call
        await until(lambda: len(starts.read_text().splitlines()) == 2 and manager.status()[0].state is ServerState.CONNECTED)
        assert (await registry.execute("fake__add", '{"a":2,"b":2}', ctx())).content == "4"


async def test_a_hanging_call_times_out_with_a_clear_error_and_the_server_stays_usable() -> None:
    async with mcp(settings(fake=stdio(timeout_s=1))) as (_, registry):
        assert registry.timeout_s("fake__hang") == 3
        started = time.monotonic()
        result = await registry.execute("fake__hang", "{}", ctx())
        assert time.monotonic() - started < 5
        assert not result.ok
        assert error_of(result.content) == (
            "fake__hang timed out after 1 s: the MCP server 'fake' did not answer and the call was cancelled; "
            "carry on without it"
        )
        assert (await registry.execute("fake__add", '{"a":3,"b":4}', ctx())).content == "7"


async def test_startup_waits_only_up_to_the_bound() -> None:
    silent = {"command": [sys.executable, "-c", "import time; time.sleep(60)"]}
    config = MCPSettings.model_validate({"servers": {"silent": silent}, "startup_wait_s": 0.5})
    manager = MCPManager(config)
    async with manager:
        started = time.monotonic()
        assert await manager.wait_settled() is False
        assert 0.4 < time.monotonic() - started < 4
        assert manager.status()[0].state is ServerState.STARTING
        assert manager.tools() == []


async def test_an_unset_variable_fails_the_server_without_retries(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="bumblebot.mcp")
    config = settings(web={"url": "http://127.0.0.1:9/mcp", "headers": {"Authorization": "Bearer ${NOT_SET}"}})
    async with mcp(config) as (manager, _):
        status = manager.status()[0]
        assert status.state is ServerState.FAILED
        assert status.error == "header Authorization needs ${NOT_SET}, which is not set in the environment"
        assert "MCP server web cannot start" in caplog.text


# -- what is offered where ------------------------------------------------------------------


async def test_the_tools_allowlist_hides_a_tool(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="bumblebot.mcp")
    async with mcp(settings(fake=stdio(tools=["add", "nonesuch"]))) as (manager, registry):
        assert [n for n in names(registry) if n.startswith("fake__")] == ["fake__add"]
        hidden = await registry.execute("fake__echo", '{"text": "hi"}', ctx())
        assert not hidden.ok and "unknown tool 'fake__echo'" in error_of(hidden.content)
        status = manager.status()[0]
        assert status.tools == ("add",) and "echo" in status.hidden and status.missing == ("nonesuch",)
        assert "MCP server fake has no tool named nonesuch" in caplog.text


async def test_allowed_chats_hide_tools_from_a_group_chat() -> None:
    config = settings(
        private=stdio(),  # default: private chats with allowlisted users
        team=stdio(allowed_chats=[GROUP_CHAT]),
        public=stdio(allowed_chats=["*"], tools=["add"]),
        nowhere=stdio(allowed_chats=[], tools=["add"]),
    )
    async with mcp(config) as (manager, registry):
        def servers(conversation: str) -> set[str]:
            return {n.split("__")[0] for n in names(registry, conversation) if "__" in n}

        assert servers(PRIVATE_CHAT) == {"private", "public"}
        assert servers(GROUP_CHAT) == {"team", "public"}
        assert servers(f"{GROUP_CHAT}:7") == {"team", "public"}  # a topic of the group
        assert servers("telegram:77") == {"public"}  # a private chat, but not an allowlisted user
        assert servers("console:local") == {"private", "public"}  # the terminal is the owner's
        assert servers("") == {"public"}  # outside a conversation (the system prompt's tool list)

        refused = await registry.execute("private__add", '{"a":1,"b":1}', ctx(GROUP_CHAT))
        assert not refused.ok
        assert error_of(refused.content) == "tool 'private__add' is not available in this conversation"
        assert (await registry.execute("team__add", '{"a":1,"b":1}', ctx(GROUP_CHAT))).content == "2"

        status = MCPTools(manager, trusted=allowlisted_private_chats(telegram_user_ids=[OWNER])).summary(GROUP_CHAT)
        assert status == (
            "MCP: private connected (not offered in this chat), team connected (7 tools here), "
            "public connected (1 tool here), nowhere connected (not offered in this chat)"
        )

        with bind(conversation=GROUP_CHAT):  # the key every turn binds: schemas() reads it
            assert {n.split("__")[0] for n in [s["function"]["name"] for s in registry.schemas()] if "__" in n} == {
                "team", "public",
            }


def test_the_private_rule_follows_the_allowlists() -> None:
    trusted = allowlisted_private_chats(
        telegram_user_ids=[42], telegram_chat_ids=[7, -100], discord_user_ids=[5], is_private=lambda key: key == "discord:900"
    )
    assert trusted("telegram:42") and trusted("telegram:7") and trusted("console:local")
    assert not trusted("telegram:-100") and not trusted("telegram:8") and not trusted("telegram:x")
    assert trusted("discord:900") and not trusted("discord:901")
    open_bot = allowlisted_private_chats(is_private=lambda key: True)
    assert not open_bot("telegram:42") and not open_bot("discord:900") and open_bot("console:local")


@pytest.mark.parametrize("protocol", ["auto", "legacy"])
async def test_tools_list_changed_refreshes_the_offered_tools(protocol: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="bumblebot.mcp")
    async with mcp(settings(fake=stdio(protocol=protocol))) as (_, registry):
        assert "fake__echo" in names(registry) and "fake__multiply" not in names(registry)
        assert (await registry.execute("fake__change_tools", "{}", ctx())).content == "changed"
        await until(lambda: "fake__multiply" in names(registry))
        assert "fake__echo" not in names(registry)
        assert (await registry.execute("fake__multiply", '{"a":6,"b":7}', ctx())).content == "42"
        gone = await registry.execute("fake__echo", '{"text":"hi"}', ctx())
        assert not gone.ok and "is not available now" in error_of(gone.content)
        assert registry.kind("fake__echo") is ToolKind.WORK  # a call made before keeps its kind
        assert "MCP server fake changed its tools; new: multiply; gone: echo" in caplog.text


# -- budget, names --------------------------------------------------------------------------


async def test_long_schemas_are_trimmed_to_the_budget_and_shrink_with_the_level() -> None:
    config = MCPSettings.model_validate(
        {"servers": {"big": stdio("--long-description")}, "tool_budget_chars": 600, "startup_wait_s": 20}
    )
    async with mcp(config) as (_, registry):
        sizes = []
        for level in range(SCHEMA_LEVELS):
            entry = schema_of(registry, "big__add", level=level)
            size = len(json.dumps(entry, separators=(",", ":")))
            assert size <= max(200, int(600 * (1.0, 0.6, 0.4, 0.4)[level])), (level, size)
            sizes.append(size)
            params = entry["function"]["parameters"]
            assert params["type"] == "object" and set(params["required"]) == {"a", "b"}
            assert entry["function"]["description"].startswith("Add two numbers.")
        assert sizes == sorted(sizes, reverse=True) and sizes[-1] < sizes[0]
        assert "note" not in schema_of(registry, "big__add", level=2)["function"]["parameters"]["properties"]


def test_mcp_schema_keeps_property_names_and_data() -> None:
    schema = {
        "type": "object",
        "title": "Args",
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "properties": {
            "title": {"type": "string", "title": "Title", "description": "The note's title"},
            "kind": {"enum": ["a", "b"], "default": "a", "examples": ["a"]},
            "limit": {"type": "integer", "minimum": 1, "maximum": 50},
        },
        "required": ["title"],
    }
    full = mcp_schema("notes__add", "Add a note.", schema, 0, 1200)["function"]["parameters"]
    assert full["properties"]["title"] == {"type": "string", "description": "The note's title"}
    assert full["properties"]["kind"] == {"enum": ["a", "b"], "default": "a"}
    assert full["properties"]["limit"] == {"type": "integer", "minimum": 1, "maximum": 50}
    assert "$schema" not in full and "title" not in full
    lean = mcp_schema("notes__add", "Add a note.", schema, 2, 1200)["function"]["parameters"]
    assert lean == {"type": "object", "properties": {"title": {"type": "string"}}, "required": ["title"]}
    odd = mcp_schema("x__y", "", {}, 0, 1200)["function"]
    assert odd["parameters"] == {"type": "object", "properties": {}} and odd["description"] == "x__y"


def test_tool_names_are_sanitised_unique_and_short() -> None:
    assert tool_name("notes", "search") == "notes__search"
    assert tool_name("notes", "files/read.v2") == "notes__files_read_v2"
    long = tool_name("calendar", "x" * 80)
    assert len(long) == 64 and long.startswith("calendar__xxx")
    assert long == tool_name("calendar", "x" * 80)  # stable
    clash = tool_name("notes", "a.b", taken={"notes__a_b"})
    assert clash != "notes__a_b" and clash.startswith("notes__a_b_")
    import re

    for name in (long, clash, tool_name("n", "ü ñ")):
        assert re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name)


def test_server_names_and_transports_are_validated() -> None:
    with pytest.raises(ValueError, match="either command"):
        MCPSettings.model_validate({"servers": {"x": {}}})
    with pytest.raises(ValueError, match="either command"):
        MCPSettings.model_validate({"servers": {"x": {"command": ["a"], "url": "http://h/mcp"}}})
    with pytest.raises(ValueError, match="headers are for url servers"):
        MCPSettings.model_validate({"servers": {"x": {"command": ["a"], "headers": {"A": "b"}}}})
    with pytest.raises(ValueError, match="env and cwd are for command servers"):
        MCPSettings.model_validate({"servers": {"x": {"url": "http://h/mcp", "env": {"A": "b"}}}})
    with pytest.raises(ValueError, match="server names"):
        MCPSettings.model_validate({"servers": {"a__b": {"command": ["a"]}}})
    with pytest.raises(ValueError, match="url must start"):
        MCPSettings.model_validate({"servers": {"x": {"url": "ftp://h"}}})


def test_secret_values_cover_env_and_headers() -> None:
    config = MCPSettings.model_validate({"servers": {
        "a": {"command": ["a"], "env": {"API_KEY": "${KEY}", "LEVEL": "debug-verbose"}},
        "b": {"url": "https://h/mcp", "headers": {"Authorization": "Bearer ${TOKEN}"}},
    }})
    values = secret_values(config, {"KEY": "k" * 12, "TOKEN": "t" * 20})
    assert set(values) == {"k" * 12, "debug-verbose", "Bearer " + "t" * 20, "t" * 20}
    assert values[0] == "Bearer " + "t" * 20  # longest first


# -- lifecycle ------------------------------------------------------------------------------


async def test_stop_ends_stdio_servers_and_is_idempotent(tmp_path: Path) -> None:
    starts = tmp_path / "starts"
    manager = MCPManager(settings(fake=stdio("--starts", str(starts))))
    await manager.start()
    with pytest.raises(RuntimeError, match="already started"):
        await manager.start()
    assert await manager.wait_settled()
    pid = int(starts.read_text().split()[0])
    os.kill(pid, 0)  # alive
    started = time.monotonic()
    await asyncio.gather(manager.stop(), manager.stop())
    await manager.stop()
    assert time.monotonic() - started < 8
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert manager.status()[0].state is ServerState.STOPPED and manager.tools() == []
    with pytest.raises(RuntimeError):
        await manager.start()
    leftovers = [t for t in asyncio.all_tasks() if t.get_name().startswith("bumblebot:mcp")]
    assert leftovers == []


async def test_disabled_servers_are_not_started(tmp_path: Path) -> None:
    starts = tmp_path / "starts"
    async with mcp(settings(off=stdio("--starts", str(starts), enabled=False))) as (manager, registry):
        assert manager.status()[0].state is ServerState.DISABLED
        assert not starts.exists() and "off disabled" in manager.summary()
        assert not [n for n in names(registry) if n.startswith("off__")]


async def test_probe_servers_reports_states_and_tools() -> None:
    config = settings(fake=stdio(tools=["add", "echo"]), dead=stdio("--exit-now", "1"))
    statuses = {s.name: s for s in await probe_servers(config, timeout_s=20)}
    assert statuses["fake"].state is ServerState.CONNECTED and statuses["fake"].tools == ("add", "echo")
    assert statuses["dead"].state is ServerState.RETRYING and "cannot open the database" in (statuses["dead"].error or "")


# -- streamable HTTP ------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.asynccontextmanager
async def http_server(token: str) -> AsyncIterator[str]:
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(FAKE), "--http", str(port),
        env={**os.environ, "FAKE_MCP_TOKEN": token}, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        proc.terminate()
        await proc.wait()


async def test_a_streamable_http_server_with_a_header_from_the_environment(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="bumblebot.mcp")
    async with http_server(TOKEN) as url:
        config = settings(
            web={"url": url, "headers": {"Authorization": "Bearer ${TOK}"}},
            wrong={"url": url, "headers": {"Authorization": "Bearer not-the-token"}},
        )
        async with mcp(config, wait=False, retry_initial_s=0.2) as (manager, registry):
            await until(lambda: manager.server_of("web").state is ServerState.CONNECTED)  # type: ignore[union-attr]
            assert (await registry.execute("web__add", '{"a":20,"b":22}', ctx())).content == "42"
            await until(lambda: (manager.server_of("wrong").attempts or 0) >= 1)  # type: ignore[union-attr]
            wrong = manager.server_of("wrong")
            assert wrong is not None and wrong.state is ServerState.RETRYING
            assert TOKEN not in caplog.text


# -- the registry's run-time tools, alone ---------------------------------------------------


class Shelf:
    """A ToolSource by hand: a list of tools, a generation, a set of refused conversations."""

    def __init__(self, tools: Sequence[Tool], refused: set[str] = frozenset()) -> None:  # type: ignore[assignment]
        self.items, self.refused, self.generation = list(tools), set(refused), 0
        self.seen = {t.name: t for t in tools}

    def tools(self) -> Sequence[Tool]:
        return self.items

    def permits(self, name: str, conversation: str) -> bool:
        return conversation not in self.refused

    def known(self, name: str) -> Tool | None:
        return self.seen.get(name)


async def _pong(ctx: ToolContext) -> str:
    """Answer pong."""
    return "pong"


async def _other(ctx: ToolContext) -> str:
    """Shadowed by the registered one."""
    return "shadow"


def test_registry_sources_are_cached_per_generation_and_never_shadow_registered_tools() -> None:
    registered = make_tool(_pong, kind=ToolKind.AGENCY, name="ping")
    shelf = Shelf([make_tool(_pong, kind=ToolKind.WORK, name="extra"), make_tool(_other, kind=ToolKind.WORK, name="ping")])
    registry = Registry([registered], sources=[shelf])
    first = registry.schemas(0, conversation="a")
    assert [s["function"]["name"] for s in first] == ["ping", "extra"]
    assert registry.schemas(0, conversation="a") is first  # cached
    assert registry.kind("ping") is ToolKind.AGENCY and registry.kind("extra") is ToolKind.WORK
    assert registry.names() == ["ping"] and [t.name for t in registry.offered("a")] == ["extra"]
    shelf.items, shelf.generation = [], 1
    assert [s["function"]["name"] for s in registry.schemas(0, conversation="a")] == ["ping"]
    assert registry.kind("extra") is ToolKind.WORK  # known before
    plain = Registry([registered])  # no sources: the cached list, as before
    assert plain.schemas() is plain.schemas() and plain.schemas(0, conversation="a") is plain.schemas()


async def test_registry_source_tools_run_only_where_permitted(tmp_path: Path) -> None:
    shelf = Shelf([make_tool(_pong, kind=ToolKind.WORK, name="extra")], refused={"group"})
    registry = Registry([], sources=[shelf])
    here = ToolContext(workspace=tmp_path, data_dir=tmp_path, conversation="mine")
    there = ToolContext(workspace=tmp_path, data_dir=tmp_path, conversation="group")
    assert (await registry.execute("extra", "{}", here)).content == "pong"
    refused = await registry.execute("extra", "{}", there)
    assert not refused.ok and "not available in this conversation" in refused.content
    assert registry.schemas(0, conversation="group") == []
    missing = await registry.execute("nothing", "{}", here)
    assert "available tools: extra" in missing.content


def test_only_the_mcp_client_imports_the_sdk() -> None:
    import ast

    root = Path(__file__).resolve().parent.parent
    users = []
    for path in sorted([*(root / "bumblebot").rglob("*.py"), *(root / "tools").rglob("*.py"), *(root / "adapters").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else []
            )
            if any(m.split(".")[0] in ("mcp", "mcp_types") for m in modules):
                users.append(path.relative_to(root).as_posix())
    assert sorted(set(users)) == ["tools/mcp_client.py"]
