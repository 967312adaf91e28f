"""The console's actions: each a POST form (the guard in :mod:`bumblebot.web.server` checked
the session, the CSRF token and the origin), done through the :class:`Console`, answered by a
redirect back (``303``) with a flash message saying what happened."""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from bumblebot.web.auth import FORM, SESSION, local_path

if TYPE_CHECKING:
    from bumblebot.web.server import WebConsole

log = logging.getLogger(__name__)


def routes(app: web.Application, server: WebConsole) -> None:
    def bind(handler: Callable[[WebConsole, web.Request], Awaitable[str]]) -> Any:
        return functools.partial(_act, server, handler)

    app.router.add_post("/c/{key}/stop", bind(stop))
    app.router.add_post("/c/{key}/reset", bind(reset))
    app.router.add_post("/c/{key}/compact", bind(compact))
    app.router.add_post("/c/{key}/pause", bind(pause))
    app.router.add_post("/c/{key}/resume", bind(resume))
    app.router.add_post("/tasks/{task:\\d+}/cancel", bind(cancel_task))
    app.router.add_post("/block", bind(block))
    app.router.add_post("/unblock", bind(unblock))
    app.router.add_post("/setup/check", bind(check))


def _back(request: web.Request, default: str) -> str:
    """Where to go after the action: the form's ``back`` (a path of this site), else ``default``."""
    back = request.get(FORM, {}).get("back")
    return local_path(back if isinstance(back, str) else None, default)


async def _act(server: WebConsole, handler: Callable[[WebConsole, web.Request], Awaitable[str]], request: web.Request) -> web.Response:
    form = await request.post()
    request[FORM] = {k: v for k, v in form.items() if isinstance(v, str)}
    key = request.match_info.get("key")
    try:
        said = await handler(server, request)
    except web.HTTPException:
        raise
    except Exception as exc:  # the operator sees it failed; the log has the details
        log.exception("web console: %s failed", request.path)
        said = f"That failed: {type(exc).__name__}."
    request[SESSION].flash.append(said)
    raise web.HTTPSeeOther(_back(request, f"/c/{key}" if key else "/"))


def _field(request: web.Request, name: str) -> str:
    value = request[FORM].get(name, "").strip()
    if not value:
        raise web.HTTPBadRequest(text=f"the form lacks {name}")
    return str(value)


async def stop(server: WebConsole, request: web.Request) -> str:
    return await server.console.stop_turn(request.match_info["key"])


async def reset(server: WebConsole, request: web.Request) -> str:
    return await server.console.reset(request.match_info["key"])


async def compact(server: WebConsole, request: web.Request) -> str:
    return await server.console.compact(request.match_info["key"])


async def pause(server: WebConsole, request: web.Request) -> str:
    return await server.console.pause(request.match_info["key"])


async def resume(server: WebConsole, request: web.Request) -> str:
    set_aside = request[FORM].get("set_aside") == "1"
    return await server.console.resume(request.match_info["key"], set_aside=set_aside)


async def cancel_task(server: WebConsole, request: web.Request) -> str:
    return await server.console.cancel_task(_field(request, "conversation"), int(request.match_info["task"]))


async def block(server: WebConsole, request: web.Request) -> str:
    return await server.console.block(_field(request, "platform"), _field(request, "sender_id"))


async def unblock(server: WebConsole, request: web.Request) -> str:
    return await server.console.unblock(_field(request, "platform"), _field(request, "sender_id"))


async def check(server: WebConsole, request: web.Request) -> str:
    lines = await server.console.check()
    request[SESSION].check = lines
    return f"check ran: {len(lines)} lines."
