"""The web console's view of the running daemon: :class:`DaemonConsole` implements
:class:`bumblebot.web.console.Console` from the daemon's parts (the engine, the store, the
adapters, the endpoints, the tools, the MCP servers, the settings, the activity bus).

Actions go through the engine's ``operate``, ``block`` and ``unblock``, which journal them like
commands from the chat (sender ``operator``, source ``console``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from bumblebot.app.reach import shown_url
from bumblebot.cognition.knowledge import conversation_file_name
from bumblebot.core.activity import NO_ACTIVITY, Activity
from bumblebot.core.events import ChatRef, Platform
from bumblebot.media.names import chat_folder
from bumblebot.store import Store

REDACTED = "<redacted>"
#: a text setting whose name holds one of these is a secret, whatever its value (numbers, such
#: as ``max_context_tokens``, are not secrets)
SECRET_NAMES = re.compile(r"key|token|secret|passw|authorization|cookie|credential", re.IGNORECASE)
#: a URL with a user name and password in it (``http://bob:pw@host/v1``)
URL_WITH_USER = re.compile(r"^[a-z][a-z0-9+.-]*://[^/?#]*@", re.IGNORECASE)
#: a learned value is shown up to this many characters
LEARNED_CHARS = 200
#: ``check``'s lines: ``[ok] what: detail``, ``[FAIL] …``, ``[note] …``
CHECK_LINE = re.compile(r"^\[(\w+)\] (.*)$")


def redacted(value: Any, redact: Any, name: str = "") -> Any:
    """``value`` (the settings as plain data) with every secret replaced by :data:`REDACTED`:
    values under a key-like name, and any text the redactor changes."""
    if isinstance(value, dict):
        return {k: redacted(v, redact, str(k)) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redacted(v, redact, name) for v in value]
    if not isinstance(value, str) or not value:
        return value
    if name and SECRET_NAMES.search(name) and not name.endswith("_env"):
        return REDACTED
    if redact(value) != value:
        return REDACTED
    return shown_url(value) if URL_WITH_USER.match(value) else value


class DaemonConsole:
    """The :class:`~bumblebot.web.console.Console` of a started ``Daemon`` (not imported: the
    daemon builds this)."""

    def __init__(self, daemon: Any) -> None:  # a started bumblebot.app.daemon.Daemon
        self.daemon = daemon
        self.store: Store = daemon.store
        self.activity: Activity = getattr(daemon, "activity", NO_ACTIVITY)

    @property
    def _engine(self) -> Any:
        assert self.daemon.engine is not None, "the daemon is not open"
        return self.daemon.engine

    # -- what the pages show -------------------------------------------------------------------

    def adapters(self) -> list[dict[str, str]]:
        out = []
        for adapter in self.daemon.adapters:
            state = getattr(adapter, "state", None)
            out.append({
                "platform": adapter.platform.value,
                "state": str(state) if state is not None else "running",
                "detail": str(getattr(adapter, "detail", "") or ""),
            })
        return out

    def endpoints(self) -> list[dict[str, Any]]:
        llm = self.daemon.llm
        if llm is None:
            return []
        out = []
        for endpoint in llm.all:
            learned = [  # the memory is shared by the endpoints: each shows its own keys
                f"{k}: {v[:LEARNED_CHARS]}" for k, v in sorted(endpoint.capabilities.known().items())
                if endpoint.memory_key in k
            ]
            cooling = llm.cooling(endpoint)
            out.append({
                "base_url": shown_url(endpoint.base_url),
                "model": llm.model_on(endpoint),
                "learned": [self.daemon.redactor(line) for line in learned],
                "outage": f"not answering; tried again in {cooling:.0f} s" if cooling > 0 else None,
            })
        return out

    def running(self) -> dict[str, Any]:
        engine = self._engine
        return {"running": engine.working(), "waiting": engine.queue_depth}

    def tools(self) -> list[dict[str, Any]]:
        from tools import TOOL_GROUPS
        from tools.access import describe_rules

        settings, toolbox = self.daemon.settings, self.daemon.toolbox
        where = {name: describe_rules(getattr(settings.tools, group).allowed_chats)
                 for group, names in TOOL_GROUPS.items() for name in names}
        return [{"name": name, "where": where.get(name, "everywhere")} for name in toolbox.names()]

    def mcp_servers(self) -> list[dict[str, Any]]:
        if self.daemon.mcp is None:
            return []
        return [
            {"name": s.name, "state": str(s.state), "tools": list(s.tools), "last_error": s.error}
            for s in self.daemon.mcp.status()
        ]

    def settings_redacted(self) -> dict[str, Any]:
        data = self.daemon.settings.model_dump(mode="json")
        return redacted(data, self.daemon.redactor)  # type: ignore[no-any-return]

    def paused(self, conversation: str) -> bool:
        return bool(self._engine.paused(conversation))

    def facts_file(self, conversation: str) -> Path:
        return self.daemon.settings.data_dir / "knowledge" / conversation_file_name(conversation)

    def inbox_dir(self, conversation: str) -> Path:
        from bumblebot.media.intake import INBOX

        return self.daemon.settings.workspace.resolve() / INBOX / chat_folder(conversation)

    async def check(self) -> list[tuple[str, str]]:
        """``bumblebot check`` as the command prints it, line by line (already redacted)."""
        from bumblebot.app.check import check_all
        from bumblebot.core.usage import scoped

        d = self.daemon
        printed: list[str] = []
        with scoped(kind="check"):
            await check_all(d.settings, d.secrets, d.entity, out=printed.append)
        lines = []
        for line in (part for text in printed for part in text.splitlines()):
            m = CHECK_LINE.match(line)
            lines.append((m.group(1), m.group(2)) if m else ("", line))
        return [(label, d.redactor(text)) for label, text in lines]

    # -- actions -------------------------------------------------------------------------------

    async def _operate(self, conversation: str, action: str, argument: str = "") -> str:
        chat = await self.store.chat_of(conversation)
        if chat is None:
            try:
                chat = ChatRef.from_key(conversation)
            except ValueError:
                return f"No conversation {conversation}."
        return str(await self._engine.operate(chat, action, argument=argument))

    async def stop_turn(self, conversation: str) -> str:
        return await self._operate(conversation, "stop")

    async def reset(self, conversation: str) -> str:
        return await self._operate(conversation, "reset")

    async def compact(self, conversation: str) -> str:
        return await self._operate(conversation, "compact")

    async def cancel_task(self, conversation: str, task_id: int) -> str:
        return await self._operate(conversation, "cancel_task", str(task_id))

    async def pause(self, conversation: str) -> str:
        return await self._operate(conversation, "pause")

    async def resume(self, conversation: str, *, set_aside: bool = False) -> str:
        return await self._operate(conversation, "resume_set_aside" if set_aside else "resume")

    async def block(self, platform: str, sender_id: str) -> str:
        return str(await self._engine.block(Platform(platform), sender_id))

    async def unblock(self, platform: str, sender_id: str) -> str:
        return str(await self._engine.unblock(Platform(platform), sender_id))
