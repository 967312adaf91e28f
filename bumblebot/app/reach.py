"""What ``bumblebot check`` says when a server did not answer as hoped: the network or the token.

A request that got no HTTP answer at all (the host name does not resolve, the connection is
refused or times out, TLS fails, the URL is not ``http(s)://``) is about the network or the URL:
the line names the host, what went wrong and the setting that holds the URL, and not the token,
which was never looked at. An HTTP answer that refuses the credentials is about the token (or
the key): 401 and 403 everywhere, and 404 from Telegram, which answers a malformed token so.
Any other answer (a 5xx, a 429, a page that is not the API) names the status and the URL setting.

The words never hold a URL's path or the exception's own text: Telegram's URLs carry the token.
"""

from __future__ import annotations

import os
import socket
import ssl
from dataclasses import dataclass
from typing import Any

import httpx

from bumblebot.core.errors import ModelError

#: How long ``check`` waits for a platform's answer, seconds.
TIMEOUT_S = 15


@dataclass(frozen=True, slots=True)
class Reply:
    """What one GET got: ``status`` and the JSON ``body`` of an HTTP answer (``body`` is
    ``None`` when it was not JSON), or the ``error`` that kept any answer from coming."""

    status: int | None = None
    body: Any = None
    error: BaseException | None = None


async def get_json(url: str, headers: dict[str, str] | None = None) -> Reply:
    """GET ``url``; never raises for a network failure (it is in :attr:`Reply.error`)."""
    try:
        async with httpx.AsyncClient(timeout=TIMEOUT_S) as client:
            response = await client.get(url, headers=headers)
    except httpx.HTTPError as exc:
        return Reply(error=exc)
    try:
        body = response.json() if response.content else None
    except ValueError:
        body = None
    return Reply(status=response.status_code, body=body)


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and what caused it, outermost first."""
    out: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in out:
        out.append(current)
        current = current.__cause__ or current.__context__
    return out


def network_reason(exc: BaseException) -> str | None:
    """Why a request got no HTTP answer, in a few words that hold no URL (``"Name or service
    not known"``, ``"Connection refused"``, ``"timed out"``, ``"TLS: certificate verify
    failed …"``); ``None`` when ``exc`` (or its cause) is no network failure."""
    chain = _chain(exc)
    for cause in reversed(chain):  # the innermost cause says most
        if isinstance(cause, socket.gaierror):
            return cause.strerror or "the host name does not resolve"
        if isinstance(cause, ssl.SSLCertVerificationError):
            return f"TLS: the server's certificate was not accepted ({cause.verify_message})"
        if isinstance(cause, ssl.SSLError):
            return f"TLS failed ({cause.reason or cause.strerror or 'handshake'})"
        if isinstance(cause, (TimeoutError, httpx.TimeoutException)):
            return "timed out"
        if isinstance(cause, httpx.UnsupportedProtocol):
            return "the URL does not start with http:// or https://"
        if isinstance(cause, OSError) and cause.errno:
            return os.strerror(cause.errno)
    if any(isinstance(cause, httpx.RemoteProtocolError) for cause in chain):
        return "the server closed the connection without answering"
    if any(isinstance(cause, httpx.TransportError) for cause in chain):
        return "the connection failed"
    return None


def host_of(url: str) -> str:
    """``host`` or ``host:port`` of ``url`` (no path: a Telegram path holds the token)."""
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError):
        return "the server"
    if not parsed.host:
        return "the server"
    return f"{parsed.host}:{parsed.port}" if parsed.port else parsed.host


def unreachable(url: str, reason: str, setting: str) -> str:
    """The words of a network failure: the host, why, and what to check."""
    return f"cannot reach {host_of(url)}: {reason}; check the network/DNS or {setting}"


def platform_failure(reply: Reply, *, shown: str, url: str, setting: str, token: str, not_found_is_token: bool) -> str:
    """Why a platform's "who am I" request did not say who the bot is.

    Args:
        reply: what :func:`get_json` got.
        shown: the request as the line shows it, the token replaced (``…/bot<token>/getMe``).
        url: the configured base URL (its host is named when the network failed).
        setting: the key that holds ``url`` (``telegram.base_url``).
        token: the variable that holds the token (``TELEGRAM_BOT_TOKEN``).
        not_found_is_token: a 404 means a malformed token (Telegram's Bot API).
    """
    if reply.error is not None:
        return unreachable(url, network_reason(reply.error) or "no answer", setting)
    body = reply.body if isinstance(reply.body, dict) else {}
    said = body.get("description") or body.get("message")
    what = f"HTTP {reply.status}" + (f": {said}" if said else "")
    if reply.status in (401, 403) or (reply.status == 404 and not_found_is_token):
        return f"{shown} was refused ({what}); check {token}"
    if reply.status == 200:
        return f"{shown} did not answer as the platform's API does; check {setting}"
    return f"{shown} failed ({what}); try again later, or check {setting}"


def model_failure(
    exc: ModelError, url: str, *, settings: str = "llm.base_url / OPENAI_BASE_URL", key: str = "OPENAI_API_KEY",
    model: str = "llm.model",
) -> str:
    """Why the model endpoint at ``url`` did not answer ``check``'s request: the network and
    the URL when no HTTP answer came, the key on a 401 or 403, the model name and the URL on a
    404, else the endpoint's own words. ``settings``, ``key`` and ``model`` name where the
    endpoint's URL, key and model are set (a fallback's are in ``llm.fallbacks``)."""
    reason = network_reason(exc) if exc.status is None else None
    if reason is not None:
        return f"{unreachable(url, reason, settings)} ({url})"
    if exc.status in (401, 403):
        return f"{url}: {exc} (the endpoint refused the key: check {key})"
    if exc.status == 404:
        return f"{url}: {exc} (check {model}, a model that endpoint serves, and {settings}, which usually ends in /v1)"
    return f"{url}: {exc} (check {settings}, {key} and {model})"
