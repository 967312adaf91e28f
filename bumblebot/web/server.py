"""The console's web server: an aiohttp application on the daemon's own event loop.

:class:`WebConsole` builds the application (routes of :mod:`bumblebot.web.pages`,
:mod:`bumblebot.web.actions`, :mod:`bumblebot.web.events`, the login of
:mod:`bumblebot.web.auth`), serves it on ``web.listen`` with ``web.AppRunner`` and
``web.TCPSite``, and stops it. The guard middleware lets only the login page and the static
files through without a session: a page without one redirects to ``/login``, the event stream
and every POST answer 401; a POST needs the session's CSRF token and, when the browser sends
an ``Origin``, this server's.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import jinja2
from aiohttp import web

from bumblebot.core.errors import ConfigError
from bumblebot.core.settings import WebSettings, is_loopback
from bumblebot.web import actions, events, pages
from bumblebot.web.auth import (
    COOKIE,
    SESSION,
    Login,
    Session,
    Sessions,
    Throttle,
    TooMany,
    client_address,
    csrf_ok,
    local_path,
    same_origin,
)
from bumblebot.web.console import Console

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
#: what every answer carries: no framing, no sniffing, no referrer, scripts and styles from here only
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
    "connect-src 'self'; frame-ancestors 'none'; form-action 'self'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",  # no-referrer would make the browser send "Origin: null" with a form
}
OPEN_PATHS = ("/login", "/static/")


def templates() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(HERE / "templates"), autoescape=True, trim_blocks=True, lstrip_blocks=True,
        undefined=jinja2.ChainableUndefined,
    )
    env.filters["q"] = lambda s: quote(str(s), safe="")
    env.filters.update(pages.FILTERS)
    return env


class WebConsole:
    """The console's server. ``token_sha256``: the login token's SHA-256 (hex), asked at each
    login (``None``: no token, nobody logs in)."""

    def __init__(
        self, console: Console, settings: WebSettings, token_sha256: Callable[[], Awaitable[str | None]]
    ) -> None:
        self.console, self.settings = console, settings
        self.sessions = Sessions(settings.session_hours)
        self.login = Login(token_sha256, self.sessions, Throttle())
        self.env = templates()
        self.streams = events.Streams()
        self.app = self._app()
        self._runner: web.AppRunner | None = None
        self.address: tuple[str, int] | None = None  # bound host and port, once started

    def _app(self) -> web.Application:
        app = web.Application(middlewares=[self._headers, self._guard], client_max_size=64 * 1024)
        app.router.add_get("/login", self._login_page)
        app.router.add_post("/login", self._login_post)
        app.router.add_post("/logout", self._logout)
        app.router.add_static("/static/", HERE / "static", append_version=False)
        pages.routes(app, self)
        actions.routes(app, self)
        events.routes(app, self)
        return app

    # -- serving -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Listen on ``web.listen``.

        Raises:
            ConfigError: the address cannot be bound (in use, not this host's); names ``web.listen``.
        """
        listen = self.settings.listen
        assert listen is not None
        host, _, port = listen.rpartition(":")
        host = host.strip("[]")
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, int(port), reuse_address=True)
        try:
            await site.start()
        except OSError as exc:
            await self._runner.cleanup()
            self._runner = None
            reason = exc.strerror or str(exc)
            raise ConfigError("config", "web.listen", f"an address this host can listen on ({reason}: {listen})") from exc
        sockets = [s.getsockname() for s in (site._server.sockets if site._server else [])]  # type: ignore[union-attr]
        self.address = (str(sockets[0][0]), int(sockets[0][1])) if sockets else (host, int(port))
        if not is_loopback(listen):
            log.warning(
                "the web console listens on %s, not a loopback address, without TLS (web.insecure_bind): "
                "put a TLS proxy in front and set web.secure_cookie", listen,
            )
        log.info("web console at http://%s", f"[{self.address[0]}]:{self.address[1]}" if ":" in self.address[0]
                 else f"{self.address[0]}:{self.address[1]}")

    async def stop(self) -> None:
        """Close the listener and every open page and event stream (idempotent)."""
        runner, self._runner = self._runner, None
        if runner is not None:
            self.streams.close()
            await runner.cleanup()

    # -- the guard -----------------------------------------------------------------------------

    @web.middleware
    async def _guard(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        if not request.path.startswith(OPEN_PATHS):
            session = self.sessions.get(request.cookies.get(COOKIE))
            if session is None:
                if request.method != "GET" or request.path.startswith("/events"):
                    raise web.HTTPUnauthorized(text="log in first")
                raise web.HTTPFound("/login?next=" + quote(request.path_qs, safe=""))
            if request.method == "POST":
                form = await request.post()
                if not same_origin(request) or not csrf_ok(session, _text(form.get("csrf"))):
                    raise web.HTTPForbidden(text="refused: the form is stale or from another site; reload the page")
            request[SESSION] = session
        elif request.method == "POST" and not same_origin(request):
            raise web.HTTPForbidden(text="refused: the form is from another site")
        return await handler(request)

    @web.middleware
    async def _headers(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        """The security headers on every answer, those raised (redirects, refusals) included."""
        cache = "no-cache" if request.path.startswith("/static/") else "no-store"
        try:
            response = await handler(request)
        except web.HTTPException as exc:
            exc.headers.update(HEADERS)
            exc.headers["Cache-Control"] = cache
            raise
        if not response.prepared:  # an event stream sent its headers already
            response.headers.update(HEADERS)
            response.headers["Cache-Control"] = cache
        return response

    # -- login ---------------------------------------------------------------------------------

    async def _login_page(self, request: web.Request) -> web.Response:
        return self.render(request, "login.html", title="Log in", next=local_path(request.query.get("next")), error=None)

    async def _login_post(self, request: web.Request) -> web.Response:
        form = await request.post()
        token = (_text(form.get("token")) or "").strip()
        nxt = local_path(_text(form.get("next")))
        try:
            session = await self.login.attempt(client_address(request), token)
        except TooMany as exc:
            log.warning("web console: failed logins from %s: %s", client_address(request), exc)
            raise web.HTTPTooManyRequests(
                text=str(exc), headers={"Retry-After": str(max(1, round(exc.retry_after_s)))}
            ) from None
        if session is None:
            log.warning("web console: a failed login from %s", client_address(request))
            response = self.render(request, "login.html", title="Log in", next=nxt, error="That token is not right.")
            response.set_status(401)
            return response
        response = web.HTTPSeeOther(nxt)
        response.set_cookie(
            COOKIE, session.id, httponly=True, samesite="Strict", secure=self.settings.secure_cookie, path="/",
            max_age=int(self.settings.session_hours * 3600),
        )
        raise response

    async def _logout(self, request: web.Request) -> web.Response:
        self.sessions.drop(request.cookies.get(COOKIE))
        response = web.HTTPSeeOther("/login")
        response.del_cookie(COOKIE, path="/")
        raise response

    # -- rendering -----------------------------------------------------------------------------

    def render(self, request: web.Request, name: str, **context: Any) -> web.Response:
        """Render template ``name``; a logged-in page gets the session's CSRF token and its
        flash messages (shown once)."""
        session: Session | None = request.get(SESSION)
        flash: list[str] = []
        if session is not None:
            flash, session.flash = session.flash, []
        html = self.env.get_template(name).render(
            csrf=session.csrf if session else "", flash=flash, path=request.path, logged_in=session is not None,
            **context,
        )
        return web.Response(text=html, content_type="text/html")


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None



