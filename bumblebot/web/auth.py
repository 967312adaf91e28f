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

from aiohttp import web

#: the ``kv`` key of the token's SHA-256 (hex) that ``bumblebot web token`` stores
TOKEN_KEY = "web.token_sha256"
COOKIE = "bumblebot_session"
#: the first failed login's wait, doubled by each further failure in a row, up to :data:`MAX_DELAY_S`
FIRST_DELAY_S = 0.5
MAX_DELAY_S = 30.0
#: addresses remembered at most (the oldest are forgotten first)
MAX_CLIENTS = 10_000
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
    """Failed logins per client address, and the wait before each answer."""

    def __init__(self, first_s: float = FIRST_DELAY_S, most_s: float = MAX_DELAY_S) -> None:
        self.first_s, self.most_s = first_s, most_s
        self._failures: dict[str, int] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    def lock(self, client: str) -> asyncio.Lock:
        """One attempt at a time per address: guesses in parallel wait for each other's delay."""
        lock = self._locks.get(client)
        if lock is None:
            if len(self._locks) >= MAX_CLIENTS:
                for old in [c for c, lk in self._locks.items() if not lk.locked()][: MAX_CLIENTS // 2]:
                    del self._locks[old]
            lock = self._locks[client] = asyncio.Lock()
        return lock

    def delay(self, client: str) -> float:
        """The wait before answering the next failure of ``client``."""
        n = self._failures.get(client, 0)
        return min(self.first_s * 2**n, self.most_s)

    async def failed(self, client: str) -> None:
        """Count a failure and wait its delay (the answer goes after it)."""
        wait = self.delay(client)
        if len(self._failures) >= MAX_CLIENTS:
            self._failures.pop(next(iter(self._failures)))
        self._failures[client] = self._failures.get(client, 0) + 1
        await asyncio.sleep(wait)

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


def csrf_ok(session: Session, given: str | None) -> bool:
    return given is not None and hmac.compare_digest(session.csrf.encode(), given.encode())


class Login:
    """The login check: the token's digest comes from ``expected`` (the environment's token,
    else the store's), asked at each attempt, so a token made while the daemon runs counts."""

    def __init__(self, expected: Callable[[], Awaitable[str | None]], sessions: Sessions, throttle: Throttle) -> None:
        self.expected, self.sessions, self.throttle = expected, sessions, throttle

    async def attempt(self, client: str, token: str) -> Session | None:
        """A new session for the right token; ``None`` (after the throttle's wait) for a wrong one."""
        async with self.throttle.lock(client):
            if token and token_matches(token, await self.expected()):
                self.throttle.succeeded(client)
                return self.sessions.create()
            await self.throttle.failed(client)
            return None
