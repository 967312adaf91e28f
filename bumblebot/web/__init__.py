"""The operator's web console: an aiohttp server on the daemon's loop, login, pages, live
updates by server-sent events, and the actions (``docs/console.md``)."""

from bumblebot.web.console import Console
from bumblebot.web.server import WebConsole

__all__ = ["Console", "WebConsole"]
