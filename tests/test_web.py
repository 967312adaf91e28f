"""The web console's server through aiohttp's client, against a daemon on the fakes: the login,
the sessions, CSRF, the throttle of failed logins, the event stream, no secret on any page."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from conftest import TOKEN, running, write_config
from fakes.openai_server import FakeOpenAI, is_aux, is_loop, text, tool_calls
from fakes.telegram_server import FakeTelegram
from support import say

from bumblebot.core.config import load_settings
from bumblebot.core.errors import ConfigError

WEB_TOKEN = "web-token-for-the-tests-only-0123456789"
OPENAI_KEY = "sk-test-key-not-real-000000"  # what conftest.running gives the daemon
MCP_SECRET = "mcp-env-secret-for-the-tests-0123456789"
PAGES = ["/", "/conversations", "/c/telegram:1", "/tasks", "/tools", "/setup"]


def base_url(daemon: Any) -> str:
    host, port = daemon.web.address
    return f"http://{host}:{port}"


def client(daemon: Any) -> aiohttp.ClientSession:
    """A browser-like client: keeps cookies (of an IP address too), follows no redirect by itself."""
    return aiohttp.ClientSession(base_url=base_url(daemon), cookie_jar=aiohttp.CookieJar(unsafe=True))


async def login(session: aiohttp.ClientSession, token: str = WEB_TOKEN) -> aiohttp.ClientResponse:
    async with session.post("/login", data={"token": token, "next": "/"}, allow_redirects=False) as r:
        await r.read()
        return r


async def csrf_of(session: aiohttp.ClientSession, path: str = "/tools") -> str:
    async with session.get(path, allow_redirects=False) as r:
        assert r.status == 200
        m = re.search(r'name="csrf" value="([^"]+)"', await r.text())
    assert m is not None
    return m.group(1)


def web_config(tmp_path: Path, llm: FakeOpenAI, tg: FakeTelegram | None, **web: Any) -> Path:
    return write_config(tmp_path, llm, tg, web={"listen": "127.0.0.1:0", **web})


@pytest.fixture
async def daemon(tmp_path: Path, llm: FakeOpenAI, tg: FakeTelegram, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Any]:
    monkeypatch.setenv("BUMBLEBOT_WEB_TOKEN", WEB_TOKEN)
    async with running(web_config(tmp_path, llm, tg)) as d:
        yield d


async def test_every_page_and_the_event_stream_refuse_a_request_without_a_session(daemon: Any) -> None:
    async with client(daemon) as s:
        for path in PAGES:
            async with s.get(path, allow_redirects=False) as r:
                assert r.status == 302, path
                assert r.headers["Location"].startswith("/login?next="), path
        for path in ("/events", "/events?conversation=telegram:1"):
            async with s.get(path, allow_redirects=False) as r:
                assert r.status == 401
        for path in ("/c/telegram:1/stop", "/c/telegram:1/pause", "/tasks/1/cancel", "/block", "/setup/check", "/logout"):
            async with s.post(path, data={"csrf": "x"}, allow_redirects=False) as r:
                assert r.status == 401, path
        # a cookie that is no session is none
        s.cookie_jar.update_cookies({"bumblebot_session": "made-up"})
        async with s.get("/", allow_redirects=False) as r:
            assert r.status == 302


async def test_login_sets_a_strict_httponly_cookie_and_the_pages_open(daemon: Any) -> None:
    async with client(daemon) as s:
        r = await login(s)
        assert r.status == 303 and r.headers["Location"] == "/"
        cookie = r.headers["Set-Cookie"]
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Secure" not in cookie
        async with s.get("/tools") as page:
            assert page.status == 200
            assert "Content-Security-Policy" in page.headers
            assert "fetch_url" in await page.text()


async def test_a_post_without_the_csrf_token_or_from_another_origin_is_refused(daemon: Any) -> None:
    async with client(daemon) as s:
        await login(s)
        csrf = await csrf_of(s)
        async with s.post("/logout", data={}, allow_redirects=False) as r:
            assert r.status == 403
        async with s.post("/logout", data={"csrf": "not-the-token"}, allow_redirects=False) as r:
            assert r.status == 403
        async with s.post("/logout", data={"csrf": csrf}, headers={"Origin": "http://evil.example"}, allow_redirects=False) as r:
            assert r.status == 403
        async with s.get("/tools", allow_redirects=False) as r:
            assert r.status == 200  # still logged in: none of those did anything
        async with s.post("/logout", data={"csrf": csrf}, headers={"Origin": base_url(daemon)}, allow_redirects=False) as r:
            assert r.status == 303 and r.headers["Location"] == "/login"
        async with s.get("/tools", allow_redirects=False) as r:
            assert r.status == 302


async def test_a_wrong_token_is_refused_and_each_failure_answers_later(daemon: Any) -> None:
    async with client(daemon) as s:
        waits = []
        for _ in range(2):
            started = time.monotonic()
            r = await login(s, "not-the-token")
            waits.append(time.monotonic() - started)
            assert r.status == 401
            assert "bumblebot_session" not in r.cookies
        assert waits[0] >= 0.5
        assert waits[1] >= 1.0 and waits[1] > waits[0]
        async with s.get("/", allow_redirects=False) as r:
            assert r.status == 302
        started = time.monotonic()
        assert (await login(s)).status == 303  # the right one still logs in (after the wait it is due)
        # a success resets the count: the next failure waits the first delay again
        started = time.monotonic()
        assert (await login(s, "wrong")).status == 401
        assert 0.5 <= time.monotonic() - started < 1.0


async def read_events(response: aiohttp.ClientResponse, n: int, timeout: float = 5.0) -> list[dict[str, Any]]:
    """The next ``n`` events of an event stream, each ``{"id", "event", "data"}``."""
    events: list[dict[str, Any]] = []
    current: dict[str, Any] = {}

    async def read() -> None:
        while len(events) < n:
            line = (await response.content.readline()).decode().rstrip("\n")
            if not line:
                if "data" in current:
                    events.append(dict(current))
                current.clear()
            elif not line.startswith(":"):
                field, _, value = line.partition(": ")
                current[field] = json.loads(value) if field == "data" else value

    await asyncio.wait_for(read(), timeout)
    return events


async def test_the_event_stream_sends_the_conversations_events_and_honours_last_event_id(daemon: Any) -> None:
    activity = daemon.activity
    async with client(daemon) as s:
        await login(s)
        activity.publish("telegram:1", "queued", waiting=1)
        activity.publish("telegram:1", "queued", waiting=2)
        first = activity.recent("telegram:1")[-2].seq
        async with s.get("/events?conversation=telegram:1", headers={"Last-Event-ID": str(first)}) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            (backlog,) = await read_events(r, 1)
            assert backlog["data"]["data"]["waiting"] == 2 and backlog["id"] == str(first + 1)
            activity.publish("telegram:2", "queued", waiting=9)  # another conversation: not this stream
            activity.publish("telegram:1", "said", turn=1, text=f"the key is {OPENAI_KEY}")
            (said,) = await read_events(r, 1)
            assert said["event"] == "said"
            assert said["data"]["conversation"] == "telegram:1"
            assert OPENAI_KEY not in json.dumps(said)
            assert time.time() - said["data"]["at"] < 5
        async with s.get("/events") as r:  # every conversation
            activity.publish("telegram:2", "queued", waiting=3)
            (event,) = await read_events(r, 1)
            assert event["data"]["conversation"] == "telegram:2"


async def test_web_listen_on_every_address_needs_insecure_bind(tmp_path: Path, llm: FakeOpenAI) -> None:
    with pytest.raises(ConfigError) as refused:
        load_settings(write_config(tmp_path, llm, None, web={"listen": "0.0.0.0:8790"}))
    assert refused.value.key == "web.listen"
    assert "insecure_bind" in str(refused.value)
    settings = load_settings(write_config(tmp_path, llm, None, web={"listen": "0.0.0.0:8790", "insecure_bind": True}))
    assert settings.web.listen == "0.0.0.0:8790"
    assert load_settings(write_config(tmp_path, llm, None, web={"listen": "[::1]:8790"})).web.listen == "[::1]:8790"


async def test_the_daemon_refuses_to_start_without_a_login_token(tmp_path: Path, llm: FakeOpenAI, tg: FakeTelegram) -> None:
    with pytest.raises(ConfigError) as refused:
        async with running(web_config(tmp_path, llm, tg)):
            pass
    assert "BUMBLEBOT_WEB_TOKEN" in str(refused.value) and "bumblebot web token" in str(refused.value)


async def test_a_short_web_token_is_refused_at_start(
    tmp_path: Path, llm: FakeOpenAI, tg: FakeTelegram, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BUMBLEBOT_WEB_TOKEN", "hunter2")  # guessable: the throttle alone would not save it
    with pytest.raises(ConfigError) as refused:
        async with running(web_config(tmp_path, llm, tg)):
            pass
    assert refused.value.key == "BUMBLEBOT_WEB_TOKEN" and "16 characters" in str(refused.value)
    assert "hunter2" not in str(refused.value)


async def test_refusals_and_redirects_carry_the_security_headers(daemon: Any) -> None:
    async with client(daemon) as s:
        for method, path in (("GET", "/"), ("POST", "/c/telegram:1/stop"), ("GET", "/login")):
            async with s.request(method, path, allow_redirects=False) as r:
                assert r.status in (200, 302, 401), (path, r.status)
                assert "frame-ancestors 'none'" in r.headers["Content-Security-Policy"], path
                assert r.headers["Cache-Control"] == "no-store", path


async def test_failed_logins_past_those_held_are_refused_at_once(daemon: Any) -> None:
    from bumblebot.web.auth import MAX_HELD

    async with client(daemon) as attacker:
        held = [asyncio.ensure_future(login(attacker, f"wrong-{n}")) for n in range(MAX_HELD)]
        try:
            while daemon.web.login.throttle.held("127.0.0.1") < MAX_HELD:
                await asyncio.sleep(0.01)
            started = time.monotonic()
            r = await login(attacker, "one-more-wrong")
            assert r.status == 429 and time.monotonic() - started < 1.0
            assert int(r.headers["Retry-After"]) >= 1
        finally:
            for guess in held:
                guess.cancel()


async def test_a_port_in_use_is_a_config_error_naming_web_listen(
    tmp_path: Path, llm: FakeOpenAI, tg: FakeTelegram, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BUMBLEBOT_WEB_TOKEN", WEB_TOKEN)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError) as refused:
            async with running(write_config(tmp_path, llm, tg, web={"listen": f"127.0.0.1:{port}"})):
                pass
    assert refused.value.key == "web.listen"


async def test_bumblebot_web_token_prints_a_token_that_then_logs_in(
    tmp_path: Path, llm: FakeOpenAI, tg: FakeTelegram, capsys: pytest.CaptureFixture[str]
) -> None:
    from bumblebot.app.cli import main

    config = web_config(tmp_path, llm, tg)
    assert await asyncio.to_thread(main, ["web", "token", "--config", str(config)]) == 0
    token = capsys.readouterr().out.strip()
    assert len(token) >= 32
    db = (tmp_path / "data" / "bumblebot.db").read_bytes()
    assert token.encode() not in db  # only its hash is kept
    async with running(config) as d, client(d) as s:
        assert (await login(s, token)).status == 303
        async with s.get("/tools", allow_redirects=False) as r:
            assert r.status == 200


async def test_no_secret_appears_in_any_page_or_in_the_event_stream(
    tmp_path: Path, llm: FakeOpenAI, tg: FakeTelegram, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BUMBLEBOT_WEB_TOKEN", WEB_TOKEN)
    servers = {"vault": {"command": ["true"], "env": {"VAULT_PASS": MCP_SECRET}, "headers": {}}}
    config = write_config(
        tmp_path, llm, tg, web={"listen": "127.0.0.1:0"}, mcp={"servers": servers, "startup_wait_s": 1},
    )
    llm.push(say(f"the key is {OPENAI_KEY} and the token {TOKEN}"), when=is_loop)
    llm.push(text("DONE: answered"), when=is_aux)
    async with running(config) as d, client(d) as s:
        await login(s)
        async with s.get("/events") as stream:
            tg.push_text(f"tell me {WEB_TOKEN}", chat_id=1001)
            await d.engine.wait_for_turns(1)
            seen = []
            while not any(e["event"] == "turn_ended" for e in seen):
                seen += await read_events(stream, 1)
        assert seen, "the stream carried the turn"
        turns = await d.store.console_turns("telegram:1001")
        pages = [*PAGES, "/c/telegram:1001", *(f"/turns/{t['id']}" for t in turns), "/conversations?q=1001"]
        bodies = {}
        for path in pages:
            async with s.get(path, allow_redirects=False) as r:
                assert r.status == 200, path
                bodies[path] = await r.text()
        assert "vault" in bodies["/setup"] and "&lt;redacted&gt;" in bodies["/setup"]
        assert "telegram:1001" in bodies["/conversations"]
        everything = json.dumps(seen) + "".join(bodies.values())
        for secret in (TOKEN, OPENAI_KEY, WEB_TOKEN, MCP_SECRET):
            assert secret not in everything


async def test_the_overview_and_the_conversation_list_show_a_big_store(
    tmp_path: Path, llm: FakeOpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    """1,000 conversations and 100,000 messages (filled as ``bench/bench_console.py`` fills its
    file): the pages show a page of them (how fast: ``bench/bench_console.py``)."""
    import importlib.util

    from bumblebot.store import Store

    spec = importlib.util.spec_from_file_location("bench_console", Path(__file__).parents[1] / "bench" / "bench_console.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setenv("BUMBLEBOT_WEB_TOKEN", WEB_TOKEN)
    config = web_config(tmp_path, llm, None)
    db = tmp_path / "data" / "bumblebot.db"
    db.parent.mkdir(parents=True, exist_ok=True)
    async with Store(db):
        pass  # the schema, as the daemon makes it
    await asyncio.to_thread(bench.fill, db, time.time())
    async with running(config, telegram_token=None, adapters=[]) as d, client(d) as s:
        await login(s)
        for path, rows in (("/conversations", 50), ("/conversations?offset=980", 20)):
            async with s.get(path) as r:
                assert r.status == 200
                assert (await r.text()).count('class="conversation-row"') == rows, path
        async with s.get("/") as r:
            assert r.status == 200 and "Tokens per day" in await r.text()


async def test_an_action_with_the_csrf_token_is_done_and_says_so(daemon: Any) -> None:
    async with client(daemon) as s:
        await login(s)
        csrf = await csrf_of(s, "/c/telegram:42")
        form = {"csrf": csrf, "platform": "telegram", "sender_id": "42", "back": "/c/telegram:42"}
        async with s.post("/block", data={k: v for k, v in form.items() if k != "csrf"}, allow_redirects=False) as r:
            assert r.status == 403
        assert await daemon.store.blocked_senders() == set()
        async with s.post("/block", data=form, allow_redirects=False) as r:
            assert r.status == 303 and r.headers["Location"] == "/c/telegram:42"
        assert await daemon.store.blocked_senders() == {("telegram", "42")}
        async with s.get("/c/telegram:42") as page:
            assert 'class="flash"' in await page.text()  # what the engine answered, shown once
        async with s.post("/unblock", data=form, allow_redirects=False) as r:
            assert r.status == 303
        assert await daemon.store.blocked_senders() == set()


async def test_setup_runs_check_and_shows_its_lines(daemon: Any) -> None:
    async with client(daemon) as s:
        await login(s)
        csrf = await csrf_of(s, "/setup")
        async with s.post("/setup/check", data={"csrf": csrf, "back": "/setup"}) as r:
            assert r.status == 200 and str(r.url).endswith("/setup")
            page = await r.text()
        assert 'id="check-lines"' in page and "config" in page
        assert WEB_TOKEN not in page and OPENAI_KEY not in page


async def test_a_console_on_every_address_logs_a_warning(
    tmp_path: Path, llm: FakeOpenAI, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("BUMBLEBOT_WEB_TOKEN", WEB_TOKEN)
    config = write_config(tmp_path, llm, None, web={"listen": "0.0.0.0:0", "insecure_bind": True})
    with caplog.at_level(logging.WARNING, logger="bumblebot.web.server"):
        async with running(config, telegram_token=None, adapters=[]) as d:
            assert d.web.address[1] > 0
    assert any("without TLS" in r.getMessage() for r in caplog.records)


async def test_a_turns_page_shows_its_tool_calls_with_arguments_and_results(daemon: Any, llm: FakeOpenAI, tg: FakeTelegram) -> None:
    (daemon.settings.workspace / "notes.txt").write_text("the plants need water on Tuesday")
    llm.push(tool_calls(("read_file", {"path": "notes.txt"})), when=is_loop)
    llm.push(say("They need water on Tuesday."), when=is_loop)
    llm.push(text("DONE: answered"), when=is_aux)
    async with client(daemon) as s:
        await login(s)
        tg.push_text("when do the plants need water?", chat_id=1002)
        await daemon.engine.wait_for_turns(1)
        [turn] = await daemon.store.console_turns("telegram:1002")
        async with s.get(f"/turns/{turn['id']}") as r:
            assert r.status == 200
            page = await r.text()
    assert "read_file" in page and "notes.txt" in page  # the call and its arguments
    assert "the plants need water on Tuesday" in page  # its result


# -- found by review: open redirects, a password in a URL, concurrent checks, the throttle --------


@pytest.mark.parametrize("nxt", ["/\t/evil.example/", "/\n/evil.example/", "/\r/evil.example/"])
async def test_the_login_never_redirects_to_another_site(daemon: Any, nxt: str) -> None:
    """A link ``/login?next=%2F%09%2Fevil.example`` to the real console: after the login the
    browser stays on the console (a browser drops tabs and line breaks from a URL, so
    ``/<TAB>/evil.example`` would be ``//evil.example``)."""
    async with client(daemon) as s:
        async with s.post("/login", data={"token": WEB_TOKEN, "next": nxt}, allow_redirects=False) as r:
            assert r.status == 303
            location = r.headers["Location"]
    cleaned = re.sub(r"[\t\r\n]", "", location)
    assert not cleaned.startswith("//") and "evil.example" not in cleaned, location


async def test_an_action_back_never_leads_to_another_site(daemon: Any) -> None:
    """The actions' ``back`` field leads back to this site only."""
    async with client(daemon) as s:
        await login(s)
        csrf = await csrf_of(s, "/c/telegram:42")
        async with s.post("/c/telegram:42/pause", data={"csrf": csrf, "back": "/\t/evil.example/"},
                          allow_redirects=False) as r:
            location = r.headers["Location"]
    assert "evil.example" not in location, location


async def test_two_checks_at_once_leave_the_daemons_stdout_alone(daemon: Any) -> None:
    """Two clicks on "Run check" (two tabs, a double click) run check_all concurrently, each
    inside contextlib.redirect_stdout on the shared event loop: the redirections interleave
    and sys.stdout stays a StringIO for the rest of the daemon's life; each check's lines also
    pick up the other's."""
    before = sys.stdout
    async with client(daemon) as s:
        await login(s)
        csrf = await csrf_of(s, "/setup")

        async def run() -> int:
            async with s.post("/setup/check", data={"csrf": csrf, "back": "/setup"}, allow_redirects=False) as r:
                return r.status

        assert await asyncio.gather(run(), run()) == [303, 303]
        async with s.get("/setup") as r:
            page = await r.text()
    stuck = sys.stdout
    sys.stdout = before  # so that the rest of the session prints
    assert stuck is before, f"sys.stdout is now {stuck!r}"
    lines = re.search(r'<table id="check-lines">(.*?)</table>', page, re.S)
    assert lines is not None
    assert lines.group(1).count("data_dir:") == 1, "one check's lines carry the other's"


async def test_the_setup_page_hides_the_password_in_an_endpoint_url(
    tmp_path: Path, llm: FakeOpenAI, tg: FakeTelegram, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``llm.base_url: http://bob:PASSWORD@host/v1``: no page shows the password."""
    password = "pw-in-the-url-0123456789"
    monkeypatch.setenv("BUMBLEBOT_WEB_TOKEN", WEB_TOKEN)
    url = llm.base_url.replace("http://", f"http://bob:{password}@")
    config = write_config(tmp_path, llm, tg, web={"listen": "127.0.0.1:0"},
                          llm={"base_url": url, "model": "test-model", "reflex_model": "reflex-model",
                               "max_retries": 0, "timeout_s": 10})
    async with running(config) as d, client(d) as s:
        await login(s)
        bodies = {}
        for path in ("/", "/setup"):
            async with s.get(path) as r:
                bodies[path] = await r.text()
    assert password not in bodies["/"]  # the overview masks it
    assert password not in bodies["/setup"]


async def test_the_setup_page_shows_token_limits_which_are_no_secrets(daemon: Any) -> None:
    """Numbers named like secrets (``max_context_tokens``) are no secrets: the Setup page shows them."""
    async with client(daemon) as s:
        await login(s)
        async with s.get("/setup") as r:
            page = await r.text()
    assert "max_context_tokens: &lt;redacted&gt;" not in page
    assert "reflex_max_tokens: &lt;redacted&gt;" not in page


async def test_wrong_guesses_from_one_address_do_not_lock_the_operator_out(daemon: Any) -> None:
    """Five wrong guesses from one address are still waiting for their answers when the right
    token comes from it (behind a proxy every client is one address): it logs in at once."""
    import time

    async with client(daemon) as attacker, client(daemon) as operator:
        guesses = [asyncio.ensure_future(login(attacker, f"wrong-{n}")) for n in range(5)]
        await asyncio.sleep(0.1)
        started = time.monotonic()
        r = await login(operator)
        waited = time.monotonic() - started
        for g in guesses:
            g.cancel()
        assert r.status == 303
    assert waited < 2.0, f"the right token waited {waited:.1f} s behind the wrong ones"
