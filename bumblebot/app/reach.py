"""What ``bumblebot check`` says when a server did not answer as hoped: the network or the token.

A request that got no HTTP answer at all (the host name does not resolve, the connection is
refused or times out, TLS fails, the URL is not ``http(s)://``) is about the network or the URL:
the line names the host, what went wrong and the setting that holds the URL, and not the token,
which was never looked at. An HTTP answer that refuses the credentials is about the token (or
the key): 401 and 403 everywhere, and 404 from Telegram, which answers a malformed token so
(and a base URL with a wrong path: that setting is named too).
Any other answer (a 5xx, a 429, a page that is not the API) names the status and the URL setting.
A request through a proxy (``HTTPS_PROXY``, ``HTTP_PROXY``, ``ALL_PROXY``) names the proxy too.

Before any request, a token holding a character no HTTP request can carry (a pasted zero-width
space, a control character: :func:`token_problem`) and a URL setting that is no URL
(:func:`url_problem`) are named as such. The words never hold a URL's path, a password in a URL
(:func:`shown_url`) or the exception's own text: Telegram's URLs carry the token.
"""

from __future__ import annotations

import os
import re
import socket
import ssl
import unicodedata
import urllib.request
from dataclasses import dataclass
from typing import Any

import httpx

from bumblebot.core.errors import ModelError, ModelUnavailable

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
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
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


def _is(exc: BaseException, name: str) -> bool:
    """Whether ``exc`` is of the class ``name`` of httpx or httpcore, or of the forks of them a
    client brings along (the openai client raises ``httpx2``'s), all of which name alike."""
    return any(c.__name__ == name and c.__module__.startswith(("httpx", "httpcore")) for c in type(exc).__mro__)


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
        if isinstance(cause, TimeoutError) or _is(cause, "TimeoutException"):
            return "timed out"
        if _is(cause, "UnsupportedProtocol"):
            return "the URL does not start with http:// or https://"
        if isinstance(cause, OSError) and cause.errno:
            return os.strerror(cause.errno)
    if any(_is(cause, "ProxyError") for cause in chain):
        return "the proxy did not connect to it"
    if any(_is(cause, "RemoteProtocolError") for cause in chain):
        return "the server closed the connection without an HTTP answer (is it an HTTP server?)"
    if any(_is(cause, "TransportError") or _is(cause, "NetworkError") for cause in chain):
        return "the connection failed"
    return None


def model_network_reason(exc: ModelError) -> str | None:
    """:func:`network_reason` for a model request: a :class:`ModelUnavailable` without an
    HTTP status that the client's connection error caused (``openai.APIConnectionError``, its
    ``APITimeoutError`` too) is a network failure even when no cause says why."""
    if exc.status is not None:
        return None
    reason = network_reason(exc)
    connection = any(type(c).__name__ in ("APIConnectionError", "APITimeoutError") for c in _chain(exc))
    return reason or ("the connection failed" if connection and isinstance(exc, ModelUnavailable) else None)


#: ``scheme://user:password@``: the user info of a URL (RFC 3986 §3.2.1), a malformed URL's too.
_USERINFO = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://[^/?#@:]*):[^/?#]*@")


def shown_url(url: str) -> str:
    """``url`` with the password of its user info masked (``http://bob:***@host/v1``)."""
    return _USERINFO.sub(r"\1:***@", url)


def token_problem(value: str, variable: str) -> str | None:
    """Why ``value``, the token or key in ``variable``, cannot go into a request (a character
    beyond ASCII or a control character, pasted along with it), naming the character, never
    the value; ``None`` when it can."""
    bad = next((c for c in value if not (" " <= c <= "~")), None)
    if bad is None:
        return None
    name = unicodedata.name(bad, "a control character" if unicodedata.category(bad) == "Cc" else "unnamed")
    return (f"{variable} holds U+{ord(bad):04X} ({name.lower()}), which no token or key has and no request can "
            f"carry (pasted along with it?): set {variable} again, typed or pasted without it")


def url_problem(url: str, setting: str) -> str | None:
    """Why ``url``, the value of ``setting``, is no URL a request can go to; ``None`` when it is one."""
    try:
        httpx.URL(url)
    except (httpx.InvalidURL, TypeError) as exc:
        return f"{shown_url(url)} is not a valid URL ({exc}); fix {setting}"
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


def proxy_for(url: str) -> tuple[str, str] | None:
    """The proxy a request for ``url`` goes through, as httpx picks it from the environment
    (``https_proxy`` / ``HTTPS_PROXY`` for an https URL …, else ``ALL_PROXY``, unless
    ``NO_PROXY`` names the host): ``(variable, proxy URL)``, or ``None``."""
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError):
        return None
    if not parsed.host or urllib.request.proxy_bypass_environment(parsed.host):
        return None
    for name in (f"{parsed.scheme}_proxy", "all_proxy"):
        for variable in (name, name.upper()):
            if os.environ.get(variable):
                return variable, os.environ[variable]
    return None


def unreachable(url: str, reason: str, setting: str) -> str:
    """The words of a network failure: the host (and the proxy on the way), why, and what to check."""
    proxy = proxy_for(url)
    if proxy is not None:
        variable, proxy_url = proxy
        return (f"cannot reach {host_of(url)} through the proxy {host_of(proxy_url)} ({variable}): {reason}; "
                f"check the proxy ({variable}), the network/DNS or {setting}")
    return f"cannot reach {host_of(url)}: {reason}; check the network/DNS or {setting}"


def platform_failure(reply: Reply, *, shown: str, url: str, setting: str, token: str, not_found_is_token: bool) -> str:
    """Why a platform's "who am I" request did not say who the bot is.

    Args:
        reply: what :func:`get_json` got.
        shown: the request as the line shows it, the token replaced (``…/bot<token>/getMe``).
        url: the configured base URL (its host is named when the network failed).
        setting: the key that holds ``url`` (``telegram.base_url``).
        token: the variable that holds the token (``TELEGRAM_BOT_TOKEN``).
        not_found_is_token: a 404 means a malformed token, or a wrong path in ``url``
            (Telegram's Bot API): both are named.
    """
    if reply.error is not None:
        if _is(reply.error, "InvalidURL"):
            return f"{shown} is not a valid URL; check {setting} and {token}"
        return unreachable(url, network_reason(reply.error) or "no answer", setting)
    body = reply.body if isinstance(reply.body, dict) else {}
    said = body.get("description") or body.get("message")
    what = f"HTTP {reply.status}" + (f": {said}" if said else "")
    if reply.status == 404 and not_found_is_token:  # a malformed token, or a base URL with a wrong path
        return f"{shown} was not found ({what}); check {token}, and {setting}"
    if reply.status in (401, 403):
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
    endpoint's URL, key and model are set (a fallback's are in ``llm.fallbacks``). A password
    in the URL is masked, in the error's words too."""
    shown = shown_url(url)
    reason = model_network_reason(exc)
    if reason is not None:
        return f"{unreachable(url, reason, settings)} ({shown})"
    base = url.removesuffix("/chat/completions")
    said = str(exc).replace(base, shown_url(base))
    if exc.status in (401, 403):
        return f"{shown}: {said} (the endpoint refused the key: check {key})"
    if exc.status == 404:
        return f"{shown}: {said} (check {model}, a model that endpoint serves, and {settings}, which usually ends in /v1)"
    return f"{shown}: {said} (check {settings}, {key} and {model})"
