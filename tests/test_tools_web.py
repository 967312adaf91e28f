"""fetch_url: the SSRF guard (every hop, pinned addresses), limits and text extraction,
against a local aiohttp server on 127.0.0.1: no private, loopback or link-local address is
reached, not by a redirect nor by a name that resolves to one."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import socket
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from bumblebot.core.toolkit import ToolContext, ToolResult
from tools.registry import Registry
from tools.web import MAX_REDIRECTS, blocked_reason, html_to_text, web_tools

PAGE = """<!DOCTYPE html>
<html><head><title>Bumble Page</title>
<style>body { color: red; }</style>
<script>alert("tracking");</script></head>
<body><h1>Welcome</h1><p>First   paragraph with &amp; entity.</p>
<ul><li>one</li><li>two</li></ul><noscript>enable js</noscript>
<p>Second<br>line</p></body></html>"""


@dataclass
class Site:
    """The local test server: its origin and how often each path was hit."""

    origin: str
    port: int
    hits: Counter[str] = field(default_factory=Counter)
    release: asyncio.Event = field(default_factory=asyncio.Event)

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"


@pytest.fixture
async def site() -> AsyncIterator[Site]:
    state = Site(origin="", port=0)

    @web.middleware
    async def count(request: web.Request, handler: Any) -> web.StreamResponse:
        state.hits[request.path] += 1
        return await handler(request)

    async def page(request: web.Request) -> web.Response:
        return web.Response(text=PAGE, content_type="text/html")

    async def text(request: web.Request) -> web.Response:
        return web.Response(text="plain words\n", content_type="text/plain")

    async def big(request: web.Request) -> web.Response:
        return web.Response(text="z" * 200_000, content_type="text/plain")

    async def binary(request: web.Request) -> web.Response:
        return web.Response(body=b"\x89PNG\r\n\x1a\n\x00\x00" * 10, content_type="image/png")

    async def host(request: web.Request) -> web.Response:
        return web.Response(text=f"host={request.headers['Host']}", content_type="text/plain")

    async def missing(request: web.Request) -> web.Response:
        return web.Response(status=404, text="not here", content_type="text/plain")

    async def slow(request: web.Request) -> web.Response:
        await state.release.wait()
        return web.Response(text="too late")

    async def redirect(request: web.Request) -> web.Response:
        raise web.HTTPFound(request.query["to"])

    async def chain(request: web.Request) -> web.Response:
        left = int(request.match_info["left"])
        if left == 0:
            return web.Response(text="end of chain", content_type="text/plain")
        raise web.HTTPFound(f"/chain/{left - 1}")

    app = web.Application(middlewares=[count])
    app.add_routes(
        [
            web.get("/page", page),
            web.get("/text", text),
            web.get("/big", big),
            web.get("/binary", binary),
            web.get("/host", host),
            web.get("/missing", missing),
            web.get("/slow", slow),
            web.get("/redirect", redirect),
            web.get("/chain/{left}", chain),
        ]
    )
    runner = web.AppRunner(app)
    await runner.setup()
    tcp = web.TCPSite(runner, "127.0.0.1", 0)
    await tcp.start()
    sockets = tcp._server.sockets  # type: ignore[union-attr]
    state.port = sockets[0].getsockname()[1]
    state.origin = f"http://127.0.0.1:{state.port}"
    try:
        yield state
    finally:
        state.release.set()
        await runner.cleanup()


@pytest.fixture
def ctx(tmp_path: Path) -> ToolContext:
    return ToolContext(workspace=tmp_path, data_dir=tmp_path)


def fetcher(**config: Any) -> Registry:
    return Registry(web_tools(**config), max_result_chars=100_000)


async def fetch(registry: Registry, ctx: ToolContext, url: str) -> ToolResult:
    return await registry.execute("fetch_url", json.dumps({"url": url}), ctx)


def error_of(result: ToolResult) -> str:
    assert not result.ok
    return str(json.loads(result.content)["error"])


# -- the address check --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "label"),
    [
        ("127.0.0.1", "loopback"),
        ("127.8.9.10", "loopback"),
        ("::1", "loopback"),
        ("10.1.2.3", "private"),
        ("172.16.0.1", "private"),
        ("192.168.1.1", "private"),
        ("fd00::1", "private"),
        ("169.254.169.254", "link-local"),
        ("fe80::1", "link-local"),
        ("224.0.0.1", "multicast"),
        ("ff02::1", "multicast"),
        ("0.0.0.0", "unspecified"),
        ("::", "unspecified"),
        ("240.0.0.1", "reserved"),
        ("100.64.0.1", "non-global"),
        ("::ffff:127.0.0.1", "loopback"),
        ("::ffff:10.0.0.1", "private"),
        ("2002:7f00:1::", "loopback"),
    ],
)
def test_blocked_addresses(address: str, label: str) -> None:
    parsed = ipaddress.ip_address(address)
    assert blocked_reason(parsed) == f"{parsed} (a {label} address)"


@pytest.mark.parametrize("address", ["93.184.216.34", "1.1.1.1", "2606:4700:4700::1111"])
def test_public_addresses_pass(address: str) -> None:
    assert blocked_reason(ipaddress.ip_address(address)) is None


# -- refusals -----------------------------------------------------------------------------


async def test_loopback_is_refused_by_default(site: Site, ctx: ToolContext) -> None:
    registry = fetcher()
    for url in (site.url("/text"), site.url("/text", host="localhost")):
        assert "loopback address" in error_of(await fetch(registry, ctx, url))
    assert site.hits["/text"] == 0


@pytest.mark.parametrize(
    "url",
    [
        "file:///etc/passwd",
        "ftp://example.com/file.txt",
        "gopher://127.0.0.1:70/",
        "javascript:alert(1)",
        "example.com/no-scheme",
        "http://",
    ],
)
async def test_non_http_urls_are_refused(ctx: ToolContext, url: str) -> None:
    error = error_of(await fetch(fetcher(allow_private=True), ctx, url))
    assert "only http:// and https://" in error or "invalid URL" in error


async def test_each_redirect_hop_is_checked(site: Site, ctx: ToolContext) -> None:
    # 127.0.0.1 is allow-listed, "localhost" is not: the redirect to it must be refused
    registry = fetcher(allowed_hosts=["127.0.0.1"])
    ok = await fetch(registry, ctx, site.url("/text"))
    assert ok.ok and json.loads(ok.content)["text"] == "plain words\n"

    target = site.url("/text", host="localhost")
    result = await fetch(registry, ctx, site.url(f"/redirect?to={target}"))
    assert "refused: localhost resolves to" in error_of(result)
    assert site.hits["/redirect"] == 1 and site.hits["/text"] == 1

    to_file = site.url("/redirect?to=file:///etc/passwd")
    result = await fetch(fetcher(allow_private=True), ctx, to_file)
    assert "only http:// and https://" in error_of(result)


async def test_resolved_names_are_checked_and_pinned(site: Site, ctx: ToolContext) -> None:
    answers = {
        "wiki.test": ["127.0.0.1"],
        "evil.test": ["127.0.0.1"],
        "mixed.test": ["93.184.216.34", "10.0.0.7"],
    }

    async def resolver(host: str, port: int) -> list[str]:
        if host not in answers:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return answers[host]

    guarded = fetcher(resolver=resolver)
    assert "evil.test resolves to 127.0.0.1" in error_of(
        await fetch(guarded, ctx, f"http://evil.test:{site.port}/host")
    )
    # one private answer among public ones is enough to refuse (nothing is connected)
    assert "10.0.0.7 (a private address)" in error_of(
        await fetch(guarded, ctx, "http://mixed.test/host")
    )
    assert "cannot resolve host nowhere.test" in error_of(
        await fetch(guarded, ctx, "http://nowhere.test/")
    )
    assert site.hits["/host"] == 0

    # the request goes to the checked address while Host keeps the name
    trusted = fetcher(resolver=resolver, allow_private=True)
    result = await fetch(trusted, ctx, f"http://wiki.test:{site.port}/host#frag")
    data = json.loads(result.content)
    assert data["text"] == f"host=wiki.test:{site.port}"
    assert data["url"] == f"http://wiki.test:{site.port}/host"


# -- fetching -----------------------------------------------------------------------------


async def test_html_becomes_readable_text(site: Site, ctx: ToolContext) -> None:
    result = await fetch(fetcher(allow_private=True), ctx, site.url("/page"))
    assert result.ok
    data = json.loads(result.content)
    assert data["status"] == 200 and data["truncated"] is False
    assert data["content_type"].startswith("text/html")
    assert data["text"] == (
        "Bumble Page\n\nWelcome\n\nFirst paragraph with & entity.\n\n- one\n\n- two\n\nSecond\nline"
    )


async def test_body_is_capped_in_bytes(site: Site, ctx: ToolContext) -> None:
    result = await fetch(fetcher(allow_private=True, max_bytes=1000), ctx, site.url("/big"))
    data = json.loads(result.content)
    assert data["truncated"] is True and data["text"] == "z" * 1000

    result = await fetch(fetcher(allow_private=True, max_text_chars=500), ctx, site.url("/big"))
    data = json.loads(result.content)
    assert data["truncated"] is False
    assert len(data["text"]) <= 500 and "characters cut" in data["text"]


async def test_slow_server_times_out(site: Site, ctx: ToolContext) -> None:
    loop = asyncio.get_running_loop()
    start = loop.time()
    result = await fetch(fetcher(allow_private=True, timeout_s=0.5), ctx, site.url("/slow"))
    assert "timed out after 0.5 s" in error_of(result)
    assert loop.time() - start < 10
    assert site.hits["/slow"] == 1


async def test_redirects_are_followed_up_to_the_limit(site: Site, ctx: ToolContext) -> None:
    registry = fetcher(allow_private=True)
    result = await fetch(registry, ctx, site.url(f"/chain/{MAX_REDIRECTS}"))
    data = json.loads(result.content)
    assert data["text"] == "end of chain" and data["url"] == site.url("/chain/0")

    result = await fetch(registry, ctx, site.url(f"/chain/{MAX_REDIRECTS + 1}"))
    assert "too many redirects" in error_of(result)


async def test_binary_and_error_statuses(site: Site, ctx: ToolContext) -> None:
    registry = fetcher(allow_private=True)
    data = json.loads((await fetch(registry, ctx, site.url("/binary"))).content)
    assert data["text"] == "[binary content: image/png, 100 bytes; not shown]"

    result = await fetch(registry, ctx, site.url("/missing"))
    assert not result.ok
    data = json.loads(result.content)
    assert data["status"] == 404 and data["text"] == "not here"


async def test_connection_refused_is_an_error(ctx: ToolContext) -> None:
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result = await fetch(fetcher(allow_private=True), ctx, f"http://127.0.0.1:{port}/")
    assert "ConnectError" in error_of(result)


def test_html_to_text_drops_scripts_and_keeps_structure() -> None:
    html = (
        "<div>a<script>var x = '<p>no</p>';</script>b</div><template><p>hidden</p></template>"
        "<table><tr><td>c1</td><td>c2</td></tr></table><p>caf&eacute;&nbsp;ok</p>"
    )
    assert html_to_text(html) == "ab\n\nc1 c2\n\ncafé ok"
