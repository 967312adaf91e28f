"""Login, sessions and CSRF.

* **Login**: one token (``BUMBLEBOT_WEB_TOKEN``, else the one ``bumblebot web token`` made,
  kept as its SHA-256 in the store's ``kv`` under :data:`TOKEN_KEY`). Compared in constant
  time on SHA-256 digests (:func:`token_matches`).
* **Failed logins** are slowed per client address (:class:`Throttle`): the answer to the n-th
  failure in a row waits ``0.5 s * 2**(n-1)``, at most 30 s; attempts from one address wait
  their turn; a success forgets the address. The wait is an ``asyncio.sleep``: the loop never
  blocks.
* **Sessions** live in memory (:class:`Sessions`): a random id in an HttpOnly, SameSite=Strict
  cookie (``Secure`` with ``web.secure_cookie``), lasting ``web.session_hours``; a restart logs
  everyone out.
* **CSRF**: each session has a random token every form carries (field ``csrf``), checked on
  every POST; and a POST whose ``Origin`` (when the browser sends one) is not this server's is
  refused.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web

#: the ``kv`` key of the token's SHA-256 (hex) that ``bumblebot web token`` stores
TOKEN_KEY = "web.token_sha256"
COOKIE = "bumblebot_session"
#: the first failed login's wait, doubled by each further failure in a row, up to :data:`MAX_DELAY_S`
FIRST_DELAY_S = 0.5
MAX_DELAY_S = 30.0
#: addresses remembered at most (the oldest are forgotten first)
MAX_CLIENTS = 10_000
#: failed logins of one address held waiting for their answer at once; more get 429 at once
MAX_HELD = 8
#: the shortest ``BUMBLEBOT_WEB_TOKEN`` accepted (``bumblebot web token`` makes 43 characters)
MIN_TOKEN_CHARS = 16
#: a page may show this many flash messages at most
MAX_FLASH = 5


def new_token() -> str:
    """A fresh login token (256 random bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def token_digest(token: str) -> str:
    """The SHA-256 of ``token``, hex: what the store keeps."""
    return hashlib.sha256(token.encode()).hexdigest()


def token_matches(given: str, expected_sha256: str | None) -> bool:
    """Whether ``given`` is the token whose SHA-256 (hex) is ``expected_sha256``, in constant time."""
    if not expected_sha256:
        return False
    try:
        expected = bytes.fromhex(expected_sha256)
    except ValueError:
        return False
    return hmac.compare_digest(hashlib.sha256(given.encode()).digest(), expected)


@dataclass
class Session:
    id: str
    csrf: str
    expires: float
    flash: list[str] = field(default_factory=list)
    #: the last ``check`` run from the Setup page: its lines
    check: list[tuple[str, str]] | None = None


class Sessions:
    """Logged-in browsers, by cookie value; expired ones are dropped when met."""

    def __init__(self, hours: float) -> None:
        self.ttl = hours * 3600.0
        self._by_id: dict[str, Session] = {}

    def create(self) -> Session:
        self._sweep()
        session = Session(secrets.token_urlsafe(32), secrets.token_urlsafe(32), time.time() + self.ttl)
        self._by_id[session.id] = session
        return session

    def get(self, session_id: str | None) -> Session | None:
        if not session_id:
            return None
        session = self._by_id.get(session_id)
        if session is not None and session.expires < time.time():
            del self._by_id[session_id]
            return None
        return session

    def drop(self, session_id: str | None) -> None:
        self._by_id.pop(session_id or "", None)

    def _sweep(self) -> None:
        now = time.time()
        for sid in [sid for sid, s in self._by_id.items() if s.expires < now]:
            del self._by_id[sid]


class Throttle:
    """Failed logins per client address, and the wait before each one's answer.

    Every attempt is checked at once: the right token logs in without waiting, however many
    wrong ones the same address (a proxy in front serves every client from one) has in flight.
    A wrong one is answered after a wait that doubles with each failure in a row, from
    :data:`FIRST_DELAY_S` up to :data:`MAX_DELAY_S`; at most :data:`MAX_HELD` are held per
    address, those past it are answered at once with 429. Guessing stays hopeless because the
    token is long (``bumblebot web token`` makes 256 bits; a shorter ``BUMBLEBOT_WEB_TOKEN``
    than :data:`MIN_TOKEN_CHARS` is refused at start)."""

    def __init__(self, first_s: float = FIRST_DELAY_S, most_s: float = MAX_DELAY_S) -> None:
        self.first_s, self.most_s = first_s, most_s
        self._failures: dict[str, int] = {}
        self._held: dict[str, int] = {}

    def delay(self, client: str) -> float:
        """The wait before answering the next failure of ``client``."""
        n = self._failures.get(client, 0)
        return min(self.first_s * 2**n, self.most_s)

    def held(self, client: str) -> int:
        """``client``'s failures waiting for their answer now."""
        return self._held.get(client, 0)

    def full(self, client: str) -> bool:
        """``client`` already has :data:`MAX_HELD` failures waiting for their answer."""
        return self.held(client) >= MAX_HELD

    async def failed(self, client: str) -> None:
        """Count a failure and wait its delay (the answer goes after it)."""
        wait = self.delay(client)
        if len(self._failures) >= MAX_CLIENTS:
            self._failures.pop(next(iter(self._failures)))
        self._failures[client] = self._failures.get(client, 0) + 1
        self._held[client] = self._held.get(client, 0) + 1
        try:
            await asyncio.sleep(wait)
        finally:
            self._held[client] -= 1
            if not self._held[client]:
                del self._held[client]

    def succeeded(self, client: str) -> None:
        self._failures.pop(client, None)


def _request_key(name: str, kind: type) -> Any:
    """A key of a request's own storage (``web.RequestKey`` where aiohttp has it, else the name)."""
    key = getattr(web, "RequestKey", None)
    return key(name, kind) if key is not None else name


#: the request's session (set by the server's guard) and its form's text fields (set by an action)
SESSION: Any = _request_key("session", Session)
FORM: Any = _request_key("form", dict)


def client_address(request: web.Request) -> str:
    """The peer's address (behind a proxy: the proxy's, so all clients share one throttle)."""
    return request.remote or "unknown"


def same_origin(request: web.Request) -> bool:
    """``True`` unless the browser sent an ``Origin`` that is not this server's (scheme, host, port)."""
    origin = request.headers.get("Origin")
    if origin is None:
        return True
    host = request.headers.get("X-Forwarded-Host") or request.host
    proto = request.headers.get("X-Forwarded-Proto") or request.scheme
    return origin.rstrip("/") == f"{proto}://{host}"


def local_path(value: str | None, default: str = "/") -> str:
    """``value`` when it is a path of this site (after a login, after an action), else
    ``default``: never ``//host``, a URL, a backslash, or a space or control character (a
    browser drops tabs and line breaks from a URL, so ``/<TAB>/host`` would lead to ``//host``)."""
    if not value or not value.startswith("/") or value.startswith("//"):
        return default
    if any(c == "\\" or c.isspace() or ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        return default
    parts = urlsplit(value)
    return default if parts.scheme or parts.netloc else value


def csrf_ok(session: Session, given: str | None) -> bool:
    return given is not None and hmac.compare_digest(session.csrf.encode(), given.encode())


class Login:
    """The login check: the token's digest comes from ``expected`` (the environment's token,
    else the store's), asked at each attempt, so a token made while the daemon runs counts."""

    def __init__(self, expected: Callable[[], Awaitable[str | None]], sessions: Sessions, throttle: Throttle) -> None:
        self.expected, self.sessions, self.throttle = expected, sessions, throttle

    async def attempt(self, client: str, token: str) -> Session | None:
        """A new session for the right token; ``None`` for a wrong one (after the throttle's
        wait, or at once when the address has too many waiting: :class:`TooMany`)."""
        if token and token_matches(token, await self.expected()):
            self.throttle.succeeded(client)
            return self.sessions.create()
        if self.throttle.full(client):
            raise TooMany(self.throttle.delay(client))
        await self.throttle.failed(client)
        return None


class TooMany(Exception):
    """Too many failed logins from one address are waiting for their answer."""

    def __init__(self, retry_after_s: float) -> None:
        super().__init__(f"too many failed logins; try again in {retry_after_s:.0f} s")
        self.retry_after_s = retry_after_s