"""Where each tool may be used (tools/access.py, ``tools.<group>.allowed_chats``): a bot left in a
public group offers no shell and no reach into the shared workspace there, nor to strangers in
private chats; the terminal and allowlisted users' private chats get them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import running, write_config
from fakes.openai_server import is_loop
from support import judges_say_done, loop_requests, say

from bumblebot.core.logs import bind
from bumblebot.core.settings import ToolsSettings
from bumblebot.core.toolkit import ToolContext
from tools import TOOL_GROUPS, build_registry, tool_access
from tools.access import ChatAccess, allowlisted_private_chats, describe_rules
from tools.registry import Registry

OWNER = 42
OWNER_CHAT, STRANGER_CHAT, GROUP_CHAT, TERMINAL = f"telegram:{OWNER}", "telegram:77", "telegram:-1001234", "console:local"


def registry(tmp_path: Path, **tools: Any) -> Registry:
    """The daemon's registry with the shell on, under ``tools`` settings, one allowlisted user."""
    settings = ToolsSettings.model_validate(tools)
    return build_registry(
        workspace=tmp_path / "ws", shell_enabled=True,
        access=tool_access(settings, allowlisted_private_chats(telegram_user_ids=[OWNER])),
    )


def names(reg: Registry, conversation: str) -> set[str]:
    return {s["function"]["name"] for s in reg.schemas(conversation=conversation)}


def ctx(tmp_path: Path, conversation: str) -> ToolContext:
    return ToolContext(workspace=(tmp_path / "ws").resolve(), data_dir=tmp_path, conversation=conversation)


def test_by_default_the_shell_is_offered_only_in_the_terminal_and_allowlisted_private_chats(tmp_path):
    reg = registry(tmp_path)
    for trusted in (OWNER_CHAT, TERMINAL):
        assert "run_command" in names(reg, trusted)
    for stranger in (GROUP_CHAT, STRANGER_CHAT, f"{GROUP_CHAT}:5", "discord:900", ""):
        offered = names(reg, stranger)
        assert "run_command" not in offered, stranger
        assert {"say", "end_turn", "read_file", "remember", "fetch_url"} <= offered  # the rest stays
    assert reg.refused(GROUP_CHAT) == ["run_command"] and reg.refused(OWNER_CHAT) == []


def test_the_schemas_a_turn_gets_follow_its_bound_conversation(tmp_path):
    reg = registry(tmp_path)
    with bind(conversation=GROUP_CHAT):
        assert "run_command" not in {s["function"]["name"] for s in reg.schemas()}
    with bind(conversation=OWNER_CHAT):
        assert "run_command" in {s["function"]["name"] for s in reg.schemas()}


async def test_a_call_of_a_tool_not_offered_here_is_refused_and_not_run(tmp_path):
    reg = registry(tmp_path)
    marker = tmp_path / "ws" / "ran"
    result = await reg.execute("run_command", json.dumps({"command": f"touch {marker}"}), ctx(tmp_path, GROUP_CHAT))
    assert not result.ok and "not available in this conversation" in result.content
    assert not marker.exists()
    unknown = await reg.execute("nosuch", "{}", ctx(tmp_path, GROUP_CHAT))
    assert "run_command" not in unknown.content  # the list of tools there leaves it out too


def test_the_operator_widens_or_narrows_each_group(tmp_path):
    reg = registry(
        tmp_path,
        shell={"allowed_chats": [GROUP_CHAT]},
        web={"allowed_chats": ["private"]},
        tasks={"allowed_chats": []},
    )
    assert "run_command" in names(reg, f"{GROUP_CHAT}:7")  # a key covers its topics
    assert "run_command" not in names(reg, OWNER_CHAT)  # the group's rule replaces "private"
    assert "fetch_url" not in names(reg, GROUP_CHAT) and "fetch_url" in names(reg, OWNER_CHAT)
    everywhere = registry(tmp_path, shell={"allowed_chats": ["telegram:*"]})
    assert "run_command" in names(everywhere, STRANGER_CHAT) and "run_command" not in names(everywhere, "discord:1")


def test_every_group_names_tools_the_registry_has(tmp_path):
    class Scheduler:  # build_registry only hands it to the task tools
        pass

    reg = build_registry(workspace=tmp_path / "ws", shell_enabled=True, scheduler=Scheduler())  # type: ignore[arg-type]
    assert {n for group in TOOL_GROUPS.values() for n in group} <= set(reg.names())
    assert describe_rules(["*"]) == "everywhere" and describe_rules([]) == "nowhere"
    assert describe_rules(["private", "telegram:*"]) == "in the terminal and allowlisted users' private chats, every telegram chat"


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    """The owner's notes at the workspace's root; a document a group member sent, in its inbox."""
    root = tmp_path / "ws"
    (root / "inbox" / "telegram_-1001234").mkdir(parents=True)
    (root / "inbox" / "telegram_-1001234" / "minutes.txt").write_text("group minutes\n")
    (root / "owner-notes.txt").write_text("the owner's private plans\n")
    return root


async def test_a_group_reaches_only_its_own_folder_of_the_workspace(tmp_path, workspace):
    """In a public group the file tools read the owner's files at the workspace's root."""
    reg = registry(tmp_path)
    group = ctx(tmp_path, GROUP_CHAT)

    async def run(name: str, **args: Any) -> Any:
        return await reg.execute(name, json.dumps(args), group)

    for name, args in [
        ("read_file", {"path": "../../owner-notes.txt"}), ("list_directory", {"path": ".."}),
        ("search_files", {"pattern": "plans", "path": "../.."}), ("write_file", {"path": "../../new.txt", "content": "x"}),
        ("append_file", {"path": str(workspace / "owner-notes.txt"), "content": "x"}),
        ("read_file", {"path": "inbox/telegram_-1001234/../../owner-notes.txt"}),
    ]:
        result = await run(name, **args)
        assert not result.ok and "inbox/telegram_-1001234/" in result.content, (name, result.content)
        assert "private plans" not in result.content
    # a relative path starts in the chat's own folder: the owner's notes are not what it finds
    missing = await run("read_file", path="owner-notes.txt")
    assert not missing.ok and "private plans" not in missing.content
    assert (await run("list_directory", path=".")).content == "inbox/telegram_-1001234/ (1 entries)\nminutes.txt"
    assert (await run("search_files", pattern="plans", path=".")).content.startswith("0 matches")
    assert (await run("write_file", path="new.txt", content="x")).ok
    assert (workspace / "inbox" / "telegram_-1001234" / "new.txt").read_text() == "x"
    assert (await run("read_file", path="inbox/telegram_-1001234/minutes.txt")).content.startswith("group minutes")
    assert (await run("write_file", path="inbox/telegram_-1001234/summary.txt", content="ok")).ok
    found = await run("search_files", pattern="minutes|ok", regex=True, path="inbox/telegram_-1001234")
    assert "minutes.txt" in found.content and "summary.txt" in found.content
    assert not (workspace / "new.txt").exists() and not (tmp_path / "new.txt").exists()
    assert (workspace / "owner-notes.txt").read_text() == "the owner's private plans\n"
    owner = await reg.execute("read_file", json.dumps({"path": "owner-notes.txt"}), ctx(tmp_path, OWNER_CHAT))
    assert owner.content.startswith("the owner's private plans")
    assert reg.summary(GROUP_CHAT) == (
        f"Tools: {len(reg) - 1} offered here; not here: run_command. File tools reach only inbox/telegram_-1001234/."
    )
    assert reg.summary(TERMINAL) == f"Tools: {len(reg)} offered here."


def test_shared_chats_gives_a_trusted_group_the_whole_workspace(tmp_path, workspace):
    reg = registry(tmp_path, files={"shared_chats": ["private", GROUP_CHAT]})
    assert reg.access.whole_workspace(GROUP_CHAT) and not reg.access.whole_workspace(STRANGER_CHAT)
    assert ChatAccess(("private",)).permits(TERMINAL) and not ChatAccess(("private",)).permits(OWNER_CHAT)


async def test_a_group_is_never_offered_the_shell_through_telegram(tmp_path, llm, tg):
    """End to end: with ``tools.shell.enabled`` the model's request in a group carries no
    ``run_command``; the allowlisted owner's private chat's does; ``/status`` says which."""
    judges_say_done(llm)
    llm.push(say("Hello group."), when=is_loop)
    llm.push(say("Hello owner."), when=is_loop)
    config = write_config(
        tmp_path, llm, tg, tools={"shell": {"enabled": True}}, telegram={"allowed_user_ids": [OWNER, 7]},
    )
    async with running(config) as d:
        tg.push_text("@fake_bot hi", chat_id=-1001234, user_id=7, chat_type="supergroup")
        await d.engine.wait_for_turns(1)
        tg.push_text("hi", chat_id=OWNER, user_id=OWNER)
        await d.engine.wait_for_turns(2)
        tg.push_text("/status", chat_id=-1001234, user_id=7, chat_type="supergroup")
        await tg.wait_for("sendMessage", n=3)
    group, private = (
        {t["function"]["name"] for t in request["tools"]} for request in loop_requests(llm)[:2]
    )
    assert "run_command" not in group and "run_command" in private
    assert "not here: run_command" in tg.sent(-1001234)[-1]


async def test_discord_dms_of_allowlisted_users_get_the_shell_and_guild_channels_do_not(tmp_path, llm, dc):
    """A Discord key does not say whether it is a DM: the running adapter tells."""
    from fakes.discord_server import HUMAN_ID

    judges_say_done(llm)
    llm.push(say("Hello DM."), when=is_loop)
    llm.push(say("Hello channel."), when=is_loop)
    dc.add_guild("700000000000000001", ["700000000000000002"], name="Hive")
    section = {"enabled": True, "api_base_url": dc.api_base, "gateway_url": dc.gateway_url,
               "allowed_user_ids": [int(HUMAN_ID)]}
    config = write_config(tmp_path, llm, None, discord=section, tools={"shell": {"enabled": True}})
    async with running(config, telegram_token=None, discord_token=dc.token) as d:
        await dc.send_dm("hi")
        await d.engine.wait_for_turns(1)
        await dc.send_guild_message("hi all", "700000000000000001", "700000000000000002", mention_bot=True)
        await d.engine.wait_for_turns(2)
    dm, channel = ({t["function"]["name"] for t in request["tools"]} for request in loop_requests(llm)[:2])
    assert "run_command" in dm and "run_command" not in channel


async def test_a_group_with_no_files_yet_lists_an_empty_folder(tmp_path):
    """"What files do we have?" in a new group got "no such directory: inbox/telegram_-1001234"."""
    reg = registry(tmp_path)
    (tmp_path / "ws").mkdir(exist_ok=True)
    listed = await reg.execute("list_directory", json.dumps({"path": "."}), ctx(tmp_path, GROUP_CHAT))
    found = await reg.execute("search_files", json.dumps({"pattern": "x"}), ctx(tmp_path, GROUP_CHAT))
    assert (listed.ok, listed.content) == (True, "inbox/telegram_-1001234/ (0 entries)")
    assert found.ok and found.content.startswith("0 matches")
