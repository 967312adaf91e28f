"""The tool registry and the agency tools (tools/registry.py, tools/agency.py): a call with bad
arguments is never run, not even with empty arguments; agency vs work kinds (spec "Completion
gate")."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Annotated, Any

import pytest
from conftest import running, write_config
from fakes.openai_server import Reply, is_loop
from pydantic import BaseModel, Field
from support import ZERO_WIDTH, judges_say_done, loop_requests, say, tool_result

from bumblebot.core.toolkit import DeliveryReport, ToolContext, ToolKind, ToolResult
from tools import build_registry
from tools.agency import AGENCY_TOOLS
from tools.definition import make_tool, tool
from tools.registry import Registry, cap_text


class RecordingTurn:
    """A TurnControl that records what the agency tools asked of it."""

    def __init__(self, report: DeliveryReport | None = None) -> None:
        self.report = report or DeliveryReport(delivered=True)
        self.said: list[str] = []
        self.thoughts: list[str] = []
        self.ended = 0

    async def say(self, text: str, *, call_id: str | None = None) -> DeliveryReport:
        self.said.append(text)
        return self.report

    def end_turn(self) -> None:
        self.ended += 1

    def think(self, thought: str) -> None:
        self.thoughts.append(thought)


@pytest.fixture
def ctx(tmp_path: Path) -> ToolContext:
    return ToolContext(workspace=tmp_path, data_dir=tmp_path, conversation="test:1")


class Note(BaseModel):
    title: str = Field(description="A field that happens to be called title")
    tags: list[str] = Field(default_factory=list, description="Labels")


class SaveNoteArgs(BaseModel):
    path: str = Field(description="Where to save, relative to the workspace")
    note: Note = Field(description="The note")


class Calls:
    """Counts tool invocations so tests can prove a body did not run."""

    def __init__(self) -> None:
        self.args: list[Any] = []


def make_registry(calls: Calls, **kwargs: Any) -> Registry:
    registry = Registry(**kwargs)

    @registry.tool(kind=ToolKind.WORK, timeout_s=7)
    async def save_note(ctx: ToolContext, args: SaveNoteArgs) -> str:
        """Save a note to a file.

        This second paragraph is not part of the description.
        """
        calls.args.append(args)
        return f"saved {args.note.title} to {args.path}"

    @registry.tool(kind=ToolKind.AGENCY)
    async def nap(
        ctx: ToolContext,
        seconds: Annotated[float, Field(description="How long", ge=0)],
        loud: bool = False,
    ) -> str:
        """Take a nap
        of some length."""
        calls.args.append((seconds, loud))
        return f"napped {seconds}"

    @registry.tool(kind=ToolKind.AGENCY)
    async def ping(ctx: ToolContext) -> str:
        """Answer pong."""
        calls.args.append(None)
        return "pong"

    return registry


def walk(node: Any) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    if isinstance(node, dict):
        found.append(node)
        for value in node.values():
            found += walk(value)
    elif isinstance(node, list):
        for value in node:
            found += walk(value)
    return found


# -- schemas ------------------------------------------------------------------------------


def test_schemas_name_describe_and_require_without_titles() -> None:
    registry = make_registry(Calls())
    schemas = {s["function"]["name"]: s for s in registry.schemas()}
    assert list(schemas) == ["save_note", "nap", "ping"]
    assert all(s["type"] == "function" for s in schemas.values())

    save = schemas["save_note"]["function"]
    assert save["description"] == "Save a note to a file."
    params = save["parameters"]
    assert params["type"] == "object"
    assert params["additionalProperties"] is False
    assert params["required"] == ["path", "note"]
    assert params["properties"]["path"]["description"].startswith("Where to save")
    # pydantic's "title" noise is gone everywhere, but a *field* named title survives
    assert not [d for d in walk(params) if isinstance(d.get("title"), str)]
    note_schema = params["$defs"]["Note"]
    assert "title" in note_schema["properties"]
    assert note_schema["properties"]["title"]["description"].startswith("A field")

    nap = schemas["nap"]["function"]
    assert nap["description"] == "Take a nap of some length."
    assert nap["parameters"]["required"] == ["seconds"]
    assert nap["parameters"]["properties"]["seconds"] == {
        "description": "How long",
        "minimum": 0,
        "type": "number",
    }
    assert nap["parameters"]["properties"]["loud"]["default"] is False
    assert nap["parameters"]["additionalProperties"] is False

    ping = schemas["ping"]["function"]["parameters"]
    assert ping["properties"] == {} and "required" not in ping


def test_kind_and_timeout_lookups() -> None:
    registry = make_registry(Calls())
    assert registry.kind("save_note") is ToolKind.WORK
    assert registry.kind("nap") is ToolKind.AGENCY
    assert registry.kind("nope") is None
    assert registry.timeout_s("save_note") == 7
    assert registry.timeout_s("nap") is None
    assert registry.timeout_s("nope") is None


def test_declaration_errors() -> None:
    def not_async(ctx: ToolContext) -> str:
        """Sync."""
        return ""

    async def undocumented(ctx: ToolContext) -> str:
        return ""

    async def untyped(ctx, value):  # type: ignore[no-untyped-def]
        """Untyped."""
        return ""

    async def ok(ctx: ToolContext) -> str:
        """Fine."""
        return ""

    with pytest.raises(TypeError, match="async"):
        make_tool(not_async, kind=ToolKind.WORK)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="description"):
        make_tool(undocumented, kind=ToolKind.WORK)
    with pytest.raises(TypeError, match="needs a type"):
        make_tool(untyped, kind=ToolKind.WORK)
    with pytest.raises(ValueError, match="invalid tool name"):
        make_tool(ok, kind=ToolKind.WORK, name="has space")
    registry = Registry([make_tool(ok, kind=ToolKind.WORK)])
    with pytest.raises(ValueError, match="already registered"):
        registry.add(make_tool(ok, kind=ToolKind.AGENCY))


async def test_models_without_forbid_become_strict(ctx: ToolContext) -> None:
    class Loose(BaseModel):
        value: int

    async def loose(ctx: ToolContext, args: Loose) -> str:
        """Loose args."""
        return str(args.value)

    # a model local to a function cannot be found from the string annotations
    with pytest.raises(TypeError, match="args_model="):
        make_tool(loose, kind=ToolKind.WORK)
    built = tool(kind=ToolKind.WORK, args_model=Loose)(loose)
    assert built.schema()["function"]["parameters"]["additionalProperties"] is False

    registry = Registry([built])
    assert await registry.execute("loose", '{"value": 1}', ctx) == ToolResult("1")
    result = await registry.execute("loose", '{"value": 1, "extra": 2}', ctx)
    assert not result.ok and "extra: Extra inputs are not permitted" in result.content


# -- execute: arguments -------------------------------------------------------------------


async def test_valid_call_runs_once(ctx: ToolContext) -> None:
    calls = Calls()
    registry = make_registry(calls)
    args = json.dumps({"path": "a.md", "note": {"title": "Hi", "tags": ["x"]}})
    result = await registry.execute("save_note", args, ctx)
    assert result == ToolResult("saved Hi to a.md", ok=True)
    assert len(calls.args) == 1 and calls.args[0].note.tags == ["x"]

    result = await registry.execute("nap", '{"seconds": 2, "loud": true}', ctx)
    assert result.ok and result.content == "napped 2.0"
    assert calls.args[-1] == (2.0, True)


@pytest.mark.parametrize(
    ("arguments", "needle"),
    [
        ("{", "not valid JSON"),
        ("{'path': 'a'}", "not valid JSON"),
        ('{"path": "a.md", "note": {"title": "x"}', "not valid JSON"),
        ("[1, 2]", "got an array"),
        ('"a.md"', "got a string"),
        ("42", "got a number"),
        ("true", "got a boolean"),
        ("", "Field required"),
        ("null", "Field required"),
        ("{}", "path: Field required"),
        ('{"path": 5, "note": {"title": "x"}}', "path: Input should be a valid string"),
        ('{"path": "a", "note": {"title": 1}}', "note.title"),
        ('{"path": "a", "note": {"title": "x"}, "mode": "w"}', "mode: Extra inputs"),
    ],
)
async def test_bad_arguments_never_run_the_tool(
    ctx: ToolContext, arguments: str, needle: str
) -> None:
    calls = Calls()
    result = await make_registry(calls).execute("save_note", arguments, ctx)
    assert not result.ok
    error = json.loads(result.content)["error"]
    assert error.startswith("save_note: ")
    assert needle in error
    assert calls.args == []


async def test_empty_arguments_are_fine_for_a_tool_without_required_fields(
    ctx: ToolContext,
) -> None:
    calls = Calls()
    registry = make_registry(calls)
    for arguments in ("", "null", "{}", "  "):
        assert await registry.execute("ping", arguments, ctx) == ToolResult("pong")
    assert calls.args == [None] * 4
    result = await registry.execute("nap", '{"seconds": -1}', ctx)
    assert not result.ok and "greater than or equal to 0" in result.content
    assert len(calls.args) == 4


async def test_unknown_tool_lists_the_available_ones(ctx: ToolContext) -> None:
    result = await make_registry(Calls()).execute("delete_everything", "{}", ctx)
    assert not result.ok
    error = json.loads(result.content)["error"]
    assert "delete_everything" in error and "save_note, nap, ping" in error


# -- execute: failures, cancellation, caps ------------------------------------------------


async def test_exception_in_tool_becomes_error_without_traceback(
    ctx: ToolContext, caplog: pytest.LogCaptureFixture
) -> None:
    registry = Registry()
    calls = Calls()

    @registry.tool(kind=ToolKind.WORK)
    async def explode(ctx: ToolContext) -> str:
        """Raise."""
        calls.args.append(None)
        raise ValueError("boom")

    result = await registry.execute("explode", "{}", ctx)
    assert not result.ok
    assert json.loads(result.content) == {"error": "explode failed: ValueError: boom"}
    assert "Traceback" not in result.content
    assert len(calls.args) == 1  # run once, never again with other arguments
    assert any("explode" in r.getMessage() and r.exc_info for r in caplog.records)


async def test_cancellation_propagates(ctx: ToolContext) -> None:
    registry = Registry()
    started = asyncio.Event()
    finished = asyncio.Event()

    @registry.tool(kind=ToolKind.WORK)
    async def hang(ctx: ToolContext) -> str:
        """Wait forever."""
        started.set()
        try:
            await asyncio.Event().wait()
        finally:
            finished.set()
        return "never"

    @registry.tool(kind=ToolKind.WORK)
    async def cancel_itself(ctx: ToolContext) -> str:
        """Raise CancelledError."""
        raise asyncio.CancelledError

    task = asyncio.create_task(registry.execute("hang", "{}", ctx))
    await asyncio.wait_for(started.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert finished.is_set()

    with pytest.raises(asyncio.CancelledError):
        await registry.execute("cancel_itself", "{}", ctx)


async def test_results_are_capped_keeping_head_and_tail(ctx: ToolContext) -> None:
    registry = Registry(max_result_chars=1000)

    @registry.tool(kind=ToolKind.WORK)
    async def flood(ctx: ToolContext) -> ToolResult:
        """A long result."""
        return ToolResult("H" * 10_000 + "T" * 10_000, ok=False)

    result = await registry.execute("flood", "", ctx)
    assert not result.ok  # the tool's own ok survives the cap
    assert len(result.content) <= 1000
    assert result.content.startswith("H" * 400)
    assert result.content.endswith("T" * 200)
    kept = result.content.count("H") + result.content.count("T")
    assert f"[... {20_000 - kept} characters cut ...]" in result.content


async def test_error_results_are_capped_too(ctx: ToolContext) -> None:
    registry = Registry(max_result_chars=300)

    @registry.tool(kind=ToolKind.WORK)
    async def verbose(ctx: ToolContext) -> str:
        """Fail verbosely."""
        raise RuntimeError("x" * 5000)

    result = await registry.execute("verbose", "{}", ctx)
    assert not result.ok and len(result.content) <= 300
    assert result.content.startswith('{"error": "verbose failed: RuntimeError: xxx')
    result = await registry.execute("y" * 5000, "{}", ctx)
    assert not result.ok and len(result.content) <= 300


@pytest.mark.parametrize("limit", [0, 5, 40, 41, 100, 999])
def test_cap_text_bounds(limit: int) -> None:
    text = "".join(chr(ord("a") + i % 26) for i in range(5000))
    capped = cap_text(text, limit)
    assert len(capped) <= limit
    assert text.startswith(capped[: min(limit, 5)])
    assert cap_text("short", 100) == "short"
    if "characters cut" in capped:
        kept = len(capped) - len(capped[capped.index("\n[") : capped.index("]\n") + 2])
        assert f"[... {5000 - kept} characters cut ...]" in capped


async def test_non_string_result_is_an_error(ctx: ToolContext) -> None:
    registry = Registry()

    @registry.tool(kind=ToolKind.WORK)
    async def bad(ctx: ToolContext) -> str:
        """Return the wrong type."""
        return 42  # type: ignore[return-value]

    result = await registry.execute("bad", "{}", ctx)
    assert not result.ok and "returned int" in result.content


# -- subsets and the default registry -----------------------------------------------------


def test_copy_builds_subsets() -> None:
    registry = make_registry(Calls(), max_result_chars=500)
    assert registry.copy(exclude=["nap"]).names() == ["save_note", "ping"]
    only = registry.copy(only=["ping", "nap"], exclude=["ping"])
    assert only.names() == ["nap"] and only.max_result_chars == 500
    assert registry.names() == ["save_note", "nap", "ping"]
    with pytest.raises(ValueError, match="napp"):
        registry.copy(exclude=["napp"])


def test_build_registry_enables_what_is_configured(tmp_path: Path) -> None:
    workspace = tmp_path / "ws"
    default = build_registry(workspace=workspace)
    assert workspace.is_dir()
    assert default.names() == [
        "say", "think", "wait", "end_turn",
        "read_file", "write_file", "append_file", "list_directory", "search_files", "send_file",
        "remember", "recall", "fetch_url",
    ]  # fmt: skip
    assert "run_command" not in default  # the shell is off unless asked for
    assert {default.kind(n) for n in ("say", "think", "wait", "end_turn")} == {ToolKind.AGENCY}
    assert {default.kind(n) for n in default.names()[4:]} == {ToolKind.WORK}

    full = build_registry(workspace=workspace, shell_enabled=True, shell_timeout_s=9)
    assert "run_command" in full and full.kind("run_command") is ToolKind.WORK
    assert full.timeout_s("run_command") > 9

    bare = build_registry(workspace=workspace, web_enabled=False, max_result_chars=900)
    assert "fetch_url" not in bare and bare.max_result_chars == 900


# -- agency tools -------------------------------------------------------------------------


@pytest.fixture
def agency() -> Registry:
    return Registry(AGENCY_TOOLS)


async def test_say_delivers_and_reports(agency: Registry, ctx: ToolContext) -> None:
    turn = RecordingTurn()
    ctx.turn = turn
    result = await agency.execute("say", json.dumps({"text": "Hello there"}), ctx)
    assert result.ok
    assert json.loads(result.content) == {"delivered": True, "queued": False}
    assert turn.said == ["Hello there"]


async def test_say_queued_is_ok_and_failure_is_not(agency: Registry, ctx: ToolContext) -> None:
    queued = RecordingTurn(DeliveryReport(delivered=False, queued=True, error="429"))
    ctx.turn = queued
    result = await agency.execute("say", '{"text": "hi"}', ctx)
    assert result.ok
    assert json.loads(result.content) == {"delivered": False, "queued": True, "error": "429"}

    failed = RecordingTurn(DeliveryReport(delivered=False, error="chat not found"))
    ctx.turn = failed
    result = await agency.execute("say", '{"text": "hi"}', ctx)
    assert not result.ok
    assert json.loads(result.content)["error"] == "chat not found"


async def test_say_refuses_empty_text_and_missing_turn(agency: Registry, ctx: ToolContext) -> None:
    turn = RecordingTurn()
    ctx.turn = turn
    for text in ("", "   \n\t"):
        result = await agency.execute("say", json.dumps({"text": text}), ctx)
        assert not result.ok and "nothing to say" in result.content
    assert turn.said == []
    result = await agency.execute("say", "{}", ctx)
    assert not result.ok and "text: Field required" in result.content

    ctx.turn = None
    for name, args in (("say", {"text": "hi"}), ("think", {"thought": "x"}), ("end_turn", {})):
        result = await agency.execute(name, json.dumps(args), ctx)
        assert not result.ok and "no turn" in result.content


async def test_think_and_end_turn(agency: Registry, ctx: ToolContext) -> None:
    turn = RecordingTurn()
    ctx.turn = turn
    assert await agency.execute("think", '{"thought": "plan: read the file"}', ctx) == ToolResult(
        "noted"
    )
    assert turn.thoughts == ["plan: read the file"]

    assert await agency.execute("end_turn", "", ctx) == ToolResult("ending turn")
    assert turn.ended == 1 and turn.thoughts == ["plan: read the file"]

    result = await agency.execute("end_turn", '{"summary": "answered the question"}', ctx)
    assert result == ToolResult("ending turn")
    assert turn.ended == 2 and turn.thoughts[-1] == "answered the question"

    result = await agency.execute("end_turn", '{"mood": "happy"}', ctx)
    assert not result.ok and "mood" in result.content
    assert turn.ended == 2


async def test_wait_clamps_and_sleeps(agency: Registry, ctx: ToolContext) -> None:
    loop = asyncio.get_running_loop()
    start = loop.time()
    result = await agency.execute("wait", '{"seconds": 0.05}', ctx)
    assert result == ToolResult("waited 0.05 s")
    assert loop.time() - start >= 0.04

    result = await agency.execute("wait", '{"seconds": -5}', ctx)
    assert result == ToolResult("waited 0 s (asked for -5 s)")

    result = await agency.execute("wait", '{"seconds": NaN}', ctx)
    assert not result.ok and "seconds" in result.content
    result = await agency.execute("wait", '{"seconds": "soon"}', ctx)
    assert not result.ok and "seconds" in result.content


# -- say through the whole daemon --------------------------------------------------------------


async def test_the_model_saying_only_invisible_characters_sends_nothing_and_stores_no_blank(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(Reply(message={"role": "assistant", "content": "\u200b", "tool_calls": [
        {"id": "call_zw", "type": "function", "function": {"name": "say", "arguments": json.dumps({"text": ZERO_WIDTH})}},
    ]}, finish_reason="tool_calls"), when=is_loop)
    llm.push(say("A real answer."), when=is_loop)
    llm.push(say("Next."), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as daemon:
        tg.push_text("hey", chat_id=167)
        await daemon.engine.wait_for_turns(1)
        tg.push_text("and?", chat_id=167)
        await daemon.engine.wait_for_turns(2)
    assert tg.sent(167) == ["A real answer.", "Next."]
    assert llm.violations == []
    assert "nothing to say" in tool_result(loop_requests(llm)[1], "say")[0]["error"]


# -- what a result may hold ---------------------------------------------------------------------


async def test_an_error_names_workspace_files_relative_to_it_and_a_result_holds_no_lone_surrogate(ctx) -> None:
    """A tool's exception was shown to the model with the workspace's absolute path in it; a
    result holding a lone surrogate (a web page's ``\\ud800``) failed the turn's next write."""

    async def opens(ctx: ToolContext, path: Annotated[str, Field(description="a file")]) -> str:
        """Open a file."""
        raise FileNotFoundError(2, "No such file or directory", str(ctx.workspace / path))

    async def fetches(ctx: ToolContext) -> str:
        """Fetch a page."""
        return "a page with a broken \ud800 character"

    registry = Registry([make_tool(opens, kind=ToolKind.WORK), make_tool(fetches, kind=ToolKind.WORK)])
    failed = await registry.execute("opens", json.dumps({"path": "notes/today.md"}), ctx)
    fetched = await registry.execute("fetches", "{}", ctx)
    assert not failed.ok and str(ctx.workspace) not in failed.content
    assert json.loads(failed.content)["error"].endswith("No such file or directory: 'notes/today.md'")
    assert fetched.ok and fetched.content == "a page with a broken \ufffd character"


async def test_an_error_never_names_where_the_daemon_keeps_its_data(tmp_path) -> None:
    """``remember`` on a broken knowledge folder told the model
    "NotADirectoryError: ... '/home/.../data/knowledge/telegram_51.md'"."""
    ctx = ToolContext(workspace=tmp_path / "data" / "workspace", data_dir=tmp_path / "data", conversation="test:1")

    async def remembers(ctx: ToolContext) -> str:
        """Remember."""
        raise NotADirectoryError(20, "Not a directory", str(ctx.data_dir / "knowledge" / "telegram_51.md"))

    failed = await Registry([make_tool(remembers, kind=ToolKind.WORK)]).execute("remembers", "{}", ctx)
    assert not failed.ok and str(ctx.data_dir) not in failed.content and str(ctx.data_dir.resolve()) not in failed.content
    assert "<data_dir>/knowledge/telegram_51.md" in failed.content
