"""Telegram's updates by webhook: Telegram POSTs each one to ``telegram.webhook_url``.

An HTTPS proxy in front (nginx, Caddy; Telegram posts only to HTTPS on ports 443, 80, 88 or
8443: https://core.telegram.org/bots/api#setwebhook) passes the requests to
``telegram.webhook_listen`` on each worker; any worker takes any update. A request counts only
with the secret token Telegram sends in ``X-Telegram-Bot-Api-Secret-Token``, the
``TELEGRAM_WEBHOOK_SECRET`` given to ``setWebhook`` (compared in constant time; else 403). An
update is answered 200 once it is journaled (the handlers run before the answer), or when it
cannot be handled at all; 500 when the database failed, and Telegram sends it again later. The
same update sent twice, to one worker or to two, is journaled once (the journal's key).

The server is aiohttp's; the update goes through the adapter's handlers as a polled one does,
one at a time per worker (the handlers' per-update state is the adapter's).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

from aiohttp import web

log = logging.getLogger(__name__)

SECRET_HEADER = "X-Telegram-Bot-Api-Secret-Token"
#: What Telegram allows in a secret token (https://core.telegram.org/bots/api#setwebhook).
SECRET_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")
#: The largest update body read, bytes (an update is a few kB; a file is never inside one).
MAX_BODY = 1024 * 1024
#: At most one log line per this many seconds about refused requests.
REFUSED_LOG_S = 60.0


def secret_problem(secret: str | None) -> str | None:
    """Why ``secret`` cannot be a webhook's secret token, ``None`` when it can."""
    if not secret:
        return "set TELEGRAM_WEBHOOK_SECRET (1 to 256 of A-Z, a-z, 0-9, _ and -) for telegram.webhook_url"
    if len(secret) > 256 or not set(secret) <= SECRET_CHARS:
        return "TELEGRAM_WEBHOOK_SECRET may hold 1 to 256 of A-Z, a-z, 0-9, _ and - only"
    return None


class WebhookServer:
    """Serves ``POST <path of url>`` on ``listen``; each update with the right secret goes to
    ``take`` (its JSON), which answers whether it was recorded or may be dropped (``True``), or
    should come again (``False``)."""

    def __init__(self, url: str, listen: str, secret: str, take: Callable[[dict[str, object]], Awaitable[bool]]) -> None:
        self.path = urlsplit(url).path or "/"
        self.listen = listen
        self._secret = secret.encode()
        self._take = take
        self._lock = asyncio.Lock()
        self._runner: web.AppRunner | None = None
        self._refused, self._refused_logged = 0, -REFUSED_LOG_S

    async def start(self) -> None:
        app = web.Application(client_max_size=MAX_BODY)
        app.router.add_post(self.path, self._update)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        host, _, port = self.listen.rpartition(":")
        site = web.TCPSite(self._runner, host.strip("[]"), int(port))
        await site.start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _update(self, request: web.Request) -> web.Response:
        given = request.headers.get(SECRET_HEADER, "").encode()
        if not hmac.compare_digest(given, self._secret):
            self._refused += 1
            now = time.monotonic()
            if now - self._refused_logged >= REFUSED_LOG_S:  # a flood logs a line a minute
                log.warning("Telegram webhook: %d request(s) without the secret token refused (the last from %s)",
                            self._refused, request.remote)
                self._refused, self._refused_logged = 0, now
            return web.Response(status=403)
        try:
            update = json.loads(await request.read())
        except (ValueError, UnicodeDecodeError):
            log.error("Telegram webhook: a body that is not JSON; dropped")
            return web.Response(status=200)  # the same body would come again and again
        if not isinstance(update, dict):
            return web.Response(status=200)
        async with self._lock:
            recorded = await self._take(update)
        return web.Response(status=200 if recorded else 500)
