"""The web tool, ``fetch_url``: GET one http(s) URL with an SSRF guard.

A tool that fetches any URL the model names lets a model talked into it read cloud metadata
(``169.254.169.254``), the router's admin page or services bound to localhost. Here (OWASP
SSRF prevention, "network layer"):

* only ``http`` and ``https`` URLs are fetched;
* the host is resolved once (``loop.getaddrinfo``) and **every** address it resolves to
  must be public: loopback, private, link-local, multicast, reserved, unspecified and
  other non-global addresses are refused (IPv4-mapped and 6to4 IPv6 addresses are
  judged by the IPv4 address inside) unless ``allow_private`` is set, or the host is in
  ``allowed_hosts``;
* the request then goes to the checked address itself (the URL's host is replaced by the
  address; ``Host`` and TLS SNI/certificate checks keep the real name), so a DNS answer
  that changes between check and connect (DNS rebinding) cannot redirect it;
* redirects are followed by hand, at most :data:`MAX_REDIRECTS`, and every hop is checked
  the same way; environment proxies are ignored (``trust_env=False``);
* the body is streamed and reading stops at ``max_bytes``; the whole fetch has one
  deadline of ``timeout_s`` seconds.

The result is JSON ``{"url", "status", "content_type", "truncated", "text"}``: HTML is
reduced to readable text (scripts and styles dropped), other text is returned as is, and
binary content is only described. ``ok`` is ``status < 400``.

One ``httpx.AsyncClient`` is made per call, without keep-alive: connections are pinned
to addresses, so a pooled connection must never carry a request for another host.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import re
import socket
import ssl
from collections.abc import Awaitable, Callable, Iterable
from html.parser import HTMLParser

import httpx
from pydantic import BaseModel, Field

from bumblebot.core.toolkit import ToolContext, ToolKind, ToolResult

from .definition import Tool, make_tool
from .registry import cap_text

__all__ = [
    "MAX_REDIRECTS",
    "FetchRefused",
    "FetchUrlArgs",
    "Resolver",
    "UrlFetcher",
    "blocked_reason",
    "html_to_text",
    "system_resolver",
    "web_tools",
]

#: Most redirects followed for one fetch.
MAX_REDIRECTS = 5

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
#: ``resolver(host, port)`` → the host's addresses as text, in connection order.
Resolver = Callable[[str, int], Awaitable[list[str]]]

_USER_AGENT = "Bumblebot/0.1 (fetch_url)"
_TEXT_TYPES = frozenset(
    {
        "application/json",
        "application/xml",
        "application/javascript",
        "application/x-javascript",
        "application/ecmascript",
        "application/x-yaml",
        "application/yaml",
        "application/toml",
        "application/x-sh",
    }
)
_HTML_TYPES = frozenset({"text/html", "application/xhtml+xml"})


class FetchRefused(Exception):
    """A URL the tool will not fetch; the message is shown to the model."""


def blocked_reason(address: IPAddress) -> str | None:
    """Why ``address`` may not be fetched without ``allow_private``, or ``None`` if public.

    Returns e.g. ``"127.0.0.1 (a loopback address)"``. IPv4-mapped (``::ffff:a.b.c.d``) and
    6to4 (``2002::/16``) addresses are judged by the IPv4 address they carry.
    """
    inner: IPAddress = address
    if isinstance(address, ipaddress.IPv6Address):
        inner = address.ipv4_mapped or address.sixtofour or address
    checks = (
        ("unspecified", inner.is_unspecified),
        ("loopback", inner.is_loopback),
        ("link-local", inner.is_link_local),
        ("multicast", inner.is_multicast),
        ("reserved", inner.is_reserved),
        ("private", inner.is_private),
        ("non-global", not inner.is_global),
    )
    for label, hit in checks:
        if hit:
            return f"{address} (a {label} address)"
    return None


async def system_resolver(host: str, port: int) -> list[str]:
    """The addresses of ``host`` from the system resolver (``loop.getaddrinfo``).

    Raises:
        OSError: (``socket.gaierror``) if the name does not resolve.
    """
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    seen: dict[str, None] = {}
    for *_, sockaddr in infos:
        seen.setdefault(str(sockaddr[0]), None)
    return list(seen)


class UrlFetcher:
    """Fetches URLs under one policy.

    Args:
        timeout_s: deadline of one whole fetch (all hops, body included), in seconds.
        max_bytes: most body bytes read (after content decoding); the rest is dropped.
        max_text_chars: cap on the returned text (head and tail kept).
        allow_private: fetch private/loopback/... addresses too (trusted networks only).
        allowed_hosts: host names (or address literals) exempt from the address check,
            compared case-insensitively, e.g. an intranet wiki.
        resolver: name resolution, :func:`system_resolver` by default.
        verify: TLS verification as for ``httpx`` (``True``: the certifi bundle; an
            ``ssl.SSLContext`` for a private CA). Certificates are checked against the
            URL's host name, not the pinned address.
    """

    def __init__(
        self,
        *,
        timeout_s: float = 20.0,
        max_bytes: int = 2_000_000,
        max_text_chars: int = 12_000,
        allow_private: bool = False,
        allowed_hosts: Iterable[str] = (),
        resolver: Resolver | None = None,
        verify: ssl.SSLContext | bool = True,
    ) -> None:
        if timeout_s <= 0 or max_bytes <= 0 or max_text_chars <= 0:
            raise ValueError("web limits must be positive")
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self.max_text_chars = max_text_chars
        self.allow_private = allow_private
        self.allowed_hosts = frozenset(host.lower().strip("[]") for host in allowed_hosts)
        self._resolve = resolver or system_resolver
        self._verify = verify

    async def fetch(self, url: str) -> ToolResult:
        """GET ``url`` following checked redirects; never raises for network trouble.

        Returns:
            JSON ``{"url", "status", "content_type", "truncated", "text"}`` with
            ``ok = status < 400``, or an error result (refused URL, DNS failure, timeout,
            connection error, too many redirects).

        Raises:
            asyncio.CancelledError: if cancelled.
        """
        try:
            async with asyncio.timeout(self.timeout_s):
                return await self._fetch(url)
        except (TimeoutError, httpx.TimeoutException):
            return ToolResult.error(f"timed out after {self.timeout_s:g} s fetching {url}")
        except FetchRefused as exc:
            return ToolResult.error(str(exc))
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            return ToolResult.error(f"fetching {url} failed: {type(exc).__name__}: {exc}")

    async def _fetch(self, raw_url: str) -> ToolResult:
        current = _parse_url(raw_url)
        async with httpx.AsyncClient(
            timeout=httpx.Timeout(self.timeout_s),
            verify=self._verify,
            follow_redirects=False,
            trust_env=False,
            limits=httpx.Limits(max_keepalive_connections=0),
            headers={"User-Agent": _USER_AGENT, "Accept": "text/html,text/*;q=0.9,*/*;q=0.5"},
        ) as client:
            for _hop in range(MAX_REDIRECTS + 1):
                request = await self._pinned_request(client, current)
                response = await client.send(request, stream=True)
                try:
                    if response.is_redirect:
                        location = response.headers["location"]
                        current = _parse_url(str(current.join(location)))
                        continue
                    return await self._read(response, current)
                finally:
                    await response.aclose()
        return ToolResult.error(f"too many redirects (more than {MAX_REDIRECTS}) from {raw_url}")

    async def _pinned_request(self, client: httpx.AsyncClient, url: httpx.URL) -> httpx.Request:
        """A request for ``url`` sent to a checked address of its host."""
        host = url.raw_host.decode("ascii")
        port = url.port or (443 if url.scheme == "https" else 80)
        try:
            addresses = await self._resolve(host, port)
        except OSError as exc:
            raise FetchRefused(f"cannot resolve host {host}: {exc}") from exc
        if not addresses:
            raise FetchRefused(f"cannot resolve host {host}: no addresses")
        if not self.allow_private and host.lower() not in self.allowed_hosts:
            for text in addresses:
                reason = blocked_reason(ipaddress.ip_address(text))
                if reason:
                    raise FetchRefused(
                        f"refused: {host} resolves to {reason}; private and local network "
                        "addresses are not fetched"
                    )
        extensions = {"sni_hostname": host} if url.scheme == "https" else {}
        return client.build_request(
            "GET",
            url.copy_with(host=addresses[0]),
            headers={"Host": url.netloc.decode("ascii")},
            extensions=extensions,
        )

    async def _read(self, response: httpx.Response, url: httpx.URL) -> ToolResult:
        body = bytearray()
        truncated = False
        async for chunk in response.aiter_bytes():
            room = self.max_bytes - len(body)
            body += chunk[:room]
            if len(chunk) > room:
                truncated = True
                break
        content_type = response.headers.get("content-type", "")
        text = _render(bytes(body), content_type, response.charset_encoding, truncated)
        payload = {
            "url": str(url.copy_with(fragment=None)),
            "status": response.status_code,
            "content_type": content_type,
            "truncated": truncated,
            "text": cap_text(text, self.max_text_chars),
        }
        return ToolResult(json.dumps(payload, ensure_ascii=False), ok=response.status_code < 400)


def _parse_url(raw: str) -> httpx.URL:
    try:
        url = httpx.URL(raw.strip())
    except httpx.InvalidURL as exc:
        raise FetchRefused(f"invalid URL {raw!r}: {exc}") from exc
    if url.scheme not in ("http", "https"):
        scheme = f"{url.scheme}:" if url.scheme else "URLs without a scheme"
        raise FetchRefused(f"only http:// and https:// URLs are fetched, not {scheme} ({raw})")
    if not url.host:
        raise FetchRefused(f"invalid URL {raw!r}: no host")
    return url


def _render(body: bytes, content_type: str, charset: str | None, truncated: bool) -> str:
    mime = content_type.split(";", 1)[0].strip().lower()
    textual = (
        mime.startswith("text/")
        or mime in _TEXT_TYPES
        or mime.endswith(("+json", "+xml"))
        or (not mime and b"\x00" not in body[:8192])
    )
    if not textual:
        more = " (truncated)" if truncated else ""
        return f"[binary content: {mime or 'unknown type'}, {len(body)} bytes{more}; not shown]"
    try:
        text = body.decode(charset or "utf-8", errors="replace")
    except LookupError:
        text = body.decode("utf-8", errors="replace")
    looks_html = not mime and text.lstrip()[:200].lower().startswith(("<!doctype html", "<html"))
    if mime in _HTML_TYPES or looks_html:
        return html_to_text(text)
    return text


# -- HTML to text -------------------------------------------------------------------------

_SKIP_TAGS = frozenset({"script", "style", "noscript", "template", "svg", "iframe", "object"})
_BLOCK_TAGS = frozenset(
    {
        "address", "article", "aside", "blockquote", "br", "dd", "div", "dl", "dt",
        "figcaption", "figure", "footer", "form", "h1", "h2", "h3", "h4", "h5", "h6",
        "header", "hr", "li", "main", "nav", "ol", "p", "pre", "section", "table", "title",
        "tr", "ul",
    }
)  # fmt: skip


class _TextExtractor(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self._skip_depth = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in _SKIP_TAGS:
            self._skip_depth += 1
        elif tag in _BLOCK_TAGS:
            self.parts.append("\n- " if tag == "li" else "\n")
        elif tag in ("td", "th"):
            self.parts.append("\t")

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in _BLOCK_TAGS:
            self.parts.append("\n")

    def handle_endtag(self, tag: str) -> None:
        if tag in _SKIP_TAGS:
            self._skip_depth = max(0, self._skip_depth - 1)
        elif tag in _BLOCK_TAGS:
            self.parts.append("\n")

    def handle_data(self, data: str) -> None:
        if not self._skip_depth:
            self.parts.append(data)


_SPACES = re.compile(r"[ \t\r\f\v\u00a0]+")
_BLANK_LINES = re.compile(r"\n{3,}")


def html_to_text(html: str) -> str:
    """Readable text of an HTML document: tags dropped, ``script``/``style`` and similar
    elements removed with their content, blocks on their own lines, spaces collapsed."""
    parser = _TextExtractor()
    parser.feed(html)
    parser.close()
    lines = (_SPACES.sub(" ", line).strip() for line in "".join(parser.parts).split("\n"))
    return _BLANK_LINES.sub("\n\n", "\n".join(lines)).strip()


# -- the tool -----------------------------------------------------------------------------


class FetchUrlArgs(BaseModel):
    url: str = Field(description="An http:// or https:// URL")


def web_tools(
    *,
    timeout_s: float = 20.0,
    max_bytes: int = 2_000_000,
    max_text_chars: int = 12_000,
    allow_private: bool = False,
    allowed_hosts: Iterable[str] = (),
    resolver: Resolver | None = None,
) -> tuple[Tool, ...]:
    """The ``fetch_url`` tool, configured; arguments as for :class:`UrlFetcher`."""
    fetcher = UrlFetcher(
        timeout_s=timeout_s,
        max_bytes=max_bytes,
        max_text_chars=max_text_chars,
        allow_private=allow_private,
        allowed_hosts=allowed_hosts,
        resolver=resolver,
    )

    async def fetch_url(ctx: ToolContext, args: FetchUrlArgs) -> ToolResult:
        return await fetcher.fetch(args.url)

    description = (
        "Fetch a web page or file by URL (GET, http/https only) and get its status, content "
        "type and text; HTML is reduced to plain text. Local and private network addresses "
        "are refused."
        if not allow_private
        else "Fetch a web page or file by URL (GET, http/https only) and get its status, "
        "content type and text; HTML is reduced to plain text."
    )
    built = make_tool(
        fetch_url, kind=ToolKind.WORK, description=description, timeout_s=timeout_s + 5,
        brief="Fetch a web page by URL (http/https) as text.",
    )
    return (built,)
