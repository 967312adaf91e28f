"""Bumblebot's tools: the registry, agency tools and work tools (files, knowledge, shell, web).

``bumblebot/app/cli.py`` calls :func:`build_registry` with values from the settings and hands
the result to the engine as a :class:`bumblebot.core.toolkit.Toolbox`. The engine never
imports this package.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from bumblebot.core.redaction import NO_SECRETS, Redactor

from .access import ChatAccess, ToolAccess, allowlisted_private_chats
from .agency import AGENCY_TOOLS
from .definition import Tool, make_tool, tool
from .files import FILE_TOOLS
from .knowledge import KNOWLEDGE_TOOLS
from .registry import DEFAULT_MAX_RESULT_CHARS, Registry, cap_text
from .sandbox import Sandbox, probe
from .sending import SENDING_TOOLS
from .shell import COMMANDS_DIR, reap_orphaned_commands, shell_tools
from .tasks import task_tools
from .web import web_tools

if TYPE_CHECKING:
    from collections.abc import Callable

    from bumblebot.core.settings import ToolsSettings
    from bumblebot.runtime.scheduler import Scheduler

__all__ = [
    "COMMANDS_DIR",
    "AGENCY_TOOLS",
    "TOOL_GROUPS",
    "FILE_TOOLS",
    "Registry",
    "Sandbox",
    "Tool",
    "build_registry",
    "allowlisted_private_chats",
    "cap_text",
    "make_tool",
    "probe",
    "reap_orphaned_commands",
    "shell_tools",
    "tool",
    "tool_access",
    "web_tools",
]

#: The tool groups of ``tools.<group>.allowed_chats``, with the names of their tools. The agency
#: tools (``say``, ``think``, ``wait``, ``end_turn``) belong to none: every turn has them.
TOOL_GROUPS: dict[str, tuple[str, ...]] = {
    "shell": ("run_command",),
    "web": ("fetch_url",),
    "files": (*(t.name for t in FILE_TOOLS), *(t.name for t in SENDING_TOOLS)),
    "knowledge": tuple(t.name for t in KNOWLEDGE_TOOLS),
    "tasks": ("schedule_task", "list_tasks", "cancel_task"),
}


def tool_access(settings: ToolsSettings, trusted: Callable[[str], bool]) -> ToolAccess:
    """Where each tool may be used, from ``tools.<group>.allowed_chats`` and
    ``tools.files.shared_chats``; ``trusted`` is the ``"private"`` rule
    (:func:`tools.access.allowlisted_private_chats`)."""
    rules = {}
    for group, names in TOOL_GROUPS.items():
        access = ChatAccess(tuple(getattr(settings, group).allowed_chats), trusted)
        rules.update(dict.fromkeys(names, access))
    return ToolAccess(rules, ChatAccess(tuple(settings.files.shared_chats), trusted))


def build_registry(
    *,
    workspace: Path,
    shell_enabled: bool = False,
    shell_timeout_s: float = 60.0,
    shell_max_output_chars: int = 6000,
    shell_sandbox: Sandbox | None = None,
    web_enabled: bool = True,
    web_timeout_s: float = 20.0,
    web_max_bytes: int = 2_000_000,
    web_allow_private: bool = False,
    web_allowed_hosts: Iterable[str] = (),
    max_result_chars: int = DEFAULT_MAX_RESULT_CHARS,
    scheduler: Scheduler | None = None,
    access: ToolAccess | None = None,
    redactor: Redactor = NO_SECRETS,
) -> Registry:
    """The registry the daemon offers: agency tools, file tools, and the enabled others.

    Args:
        workspace: the directory work tools are confined to; created if missing. (The
            tools use ``ToolContext.workspace`` at call time; pass the same directory.)
        shell_enabled: offer ``run_command``. Off by default: even sandboxed, a shell is a
            trust decision (see :mod:`tools.shell`).
        shell_timeout_s: longest (and default) command run time, in seconds.
        shell_max_output_chars: cap per output stream of a command, about characters;
            lowered to ``(max_result_chars - 400) // 2`` if larger, so that the JSON result
            of a command normally fits the result cap and stays valid JSON.
        shell_sandbox: the bubblewrap sandbox commands run in, already tried
            (:func:`tools.sandbox.probe`); ``None``: unconfined.
        web_enabled: offer ``fetch_url``.
        web_timeout_s: deadline of one fetch, in seconds.
        web_max_bytes: most body bytes read per fetch.
        web_allow_private: let ``fetch_url`` reach loopback/private/link-local addresses.
        web_allowed_hosts: host names exempt from that address check.
        max_result_chars: cap on every tool result, in characters (head and tail kept).
        scheduler: offer ``schedule_task``, ``list_tasks`` and ``cancel_task`` on it.
        access: where each tool may be used (:func:`tool_access`); default: everywhere.
        redactor: the secrets no tool call is given and no result holds.

    Returns:
        A new :class:`Registry`: ``say``, ``think``, ``wait``, ``end_turn``, the file tools,
        ``send_file``, ``remember`` and ``recall``, then ``run_command`` and ``fetch_url`` when enabled.

    Raises:
        ValueError: for a non-positive limit.
        OSError: if the workspace cannot be created.
    """
    workspace.mkdir(parents=True, exist_ok=True)
    tools: list[Tool] = [*AGENCY_TOOLS, *FILE_TOOLS, *SENDING_TOOLS, *KNOWLEDGE_TOOLS]
    if shell_enabled:
        per_stream = min(shell_max_output_chars, max(100, (max_result_chars - 400) // 2))
        tools += shell_tools(max_timeout_s=shell_timeout_s, max_output_chars=per_stream, sandbox=shell_sandbox)
    if scheduler is not None:
        tools += task_tools(scheduler)
    if web_enabled:
        tools += web_tools(
            timeout_s=web_timeout_s,
            max_bytes=web_max_bytes,
            allow_private=web_allow_private,
            allowed_hosts=web_allowed_hosts,
        )
    return Registry(tools, max_result_chars=max_result_chars, access=access, redactor=redactor)
