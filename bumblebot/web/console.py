"""What the console needs of the running daemon (``bumblebot/app/console.py`` implements it
from the daemon's parts): the web room never sees the engine itself."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from bumblebot.core.activity import Activity
from bumblebot.store import Store


class Console(Protocol):
    store: Store  # the read queries of bumblebot/store/console.py
    activity: Activity

    def adapters(self) -> list[dict[str, str]]:
        """``[{"platform", "state", "detail"}]``."""
        ...

    def endpoints(self) -> list[dict[str, Any]]:
        """``[{"base_url" (no credentials), "model", "learned": [lines], "outage": str | None}]``."""
        ...

    def running(self) -> dict[str, Any]:
        """``{"running": [conversation keys], "waiting": int}``."""
        ...

    def tools(self) -> list[dict[str, Any]]:
        """``[{"name", "where": str}]``."""
        ...

    def mcp_servers(self) -> list[dict[str, Any]]:
        """``[{"name", "state", "tools": [names], "last_error": str | None}]``."""
        ...

    def settings_redacted(self) -> dict[str, Any]:
        """The effective configuration, every secret replaced by ``"<redacted>"``."""
        ...

    def paused(self, conversation: str) -> bool:
        """Whether the operator paused the conversation."""
        ...

    def facts_file(self, conversation: str) -> Path:
        """The conversation's facts file (it may not exist)."""
        ...

    def inbox_dir(self, conversation: str) -> Path:
        """The folder of the conversation's files in the workspace inbox (it may not exist)."""
        ...

    async def check(self) -> list[tuple[str, str]]:
        """``bumblebot check``'s lines, ``(label, text)``."""
        ...

    # The actions: each returns the text to show the operator ("Stopped.", "Nothing to stop.").
    async def stop_turn(self, conversation: str) -> str: ...
    async def reset(self, conversation: str) -> str: ...
    async def compact(self, conversation: str) -> str: ...
    async def cancel_task(self, conversation: str, task_id: int) -> str: ...
    async def pause(self, conversation: str) -> str: ...
    async def resume(self, conversation: str, *, set_aside: bool = False) -> str: ...
    async def block(self, platform: str, sender_id: str) -> str: ...
    async def unblock(self, platform: str, sender_id: str) -> str: ...
