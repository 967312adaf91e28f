"""``bumblebot check`` tells the network from a token (bumblebot/app/reach.py).

A host that does not resolve, a refused connection, a TLS failure or a timeout names the host
and the URL setting, never the token; a platform or endpoint refusing the credentials names the
token or key. Hosts under ``.invalid`` never resolve (RFC 2606), so no test needs the internet;
the refusals come from the fakes over real HTTP.
"""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import TOKEN, write_config
from fakes.discord_server import FakeDiscord
from fakes.openai_server import FakeOpenAI, error, is_loop, text, tool_calls
from fakes.telegram_server import FakeTelegram

from bumblebot.app.check import check_all
from bumblebot.app.reach import model_failure, network_reason
from bumblebot.core.config import Secrets, load_settings
from bumblebot.core.entity import load_entity

UNRESOLVABLE = "http://nonexistent.invalid:1"


def answer_with_ping(llm: FakeOpenAI) -> None:
    llm.default = lambda request: tool_calls(("ping", {})) if is_loop(request) else text("ok")


async def check(
    tmp_path: Path, server: FakeOpenAI, capsys: Any, secrets: dict[str, str], /, **sections: Any
) -> dict[str, str]:
    """``check_all`` against the config ``sections``; its lines, ``{what: "[ok|FAIL] …"}``."""
    settings = load_settings(write_config(tmp_path, server, None, **sections))
    entity = load_entity(settings.entity, config_dir=tmp_path)
    await check_all(settings, Secrets(**secrets), entity)
    lines = {}
    for line in capsys.readouterr().out.splitlines():
        what = line.split("] ", 1)[-1].split(":", 1)[0]
        lines[what] = line
    return lines


async def test_an_unresolvable_telegram_host_names_the_network_not_the_token(tmp_path, llm, capsys):
    answer_with_ping(llm)
    lines = await check(tmp_path, llm, capsys, {"TELEGRAM_BOT_TOKEN": TOKEN},
                        telegram={"enabled": True, "base_url": f"{UNRESOLVABLE}/bot"})
    line = lines["telegram"]
    assert line.startswith("[FAIL] telegram: cannot reach nonexistent.invalid:1: ")
    assert line.endswith("; check the network/DNS or telegram.base_url")
    assert "TELEGRAM_BOT_TOKEN" not in line and TOKEN not in line
    assert "model endpoint" not in lines and lines["model test-model"].startswith("[ok]")  # only the platform failed


async def test_a_telegram_refusing_the_token_names_the_token(tmp_path, llm, capsys):
    answer_with_ping(llm)
    async with FakeTelegram(token=TOKEN) as tg:  # it answers 401 Unauthorized to any other token
        lines = await check(tmp_path, llm, capsys, {"TELEGRAM_BOT_TOKEN": "999:WRONG-token-value-for-the-test-only"},
                            telegram={"enabled": True, "base_url": tg.base_url})
    line = lines["telegram"]
    assert line == f"[FAIL] telegram: {tg.base_url}<token>/getMe was refused (HTTP 401: Unauthorized); check TELEGRAM_BOT_TOKEN"
    assert "network" not in line


async def test_discord_tells_its_network_from_its_token(tmp_path, llm, capsys):
    answer_with_ping(llm)
    lines = await check(tmp_path, llm, capsys, {"DISCORD_BOT_TOKEN": "unused"},
                        discord={"enabled": True, "api_base_url": f"{UNRESOLVABLE}/api/v10"})
    assert lines["discord"].startswith("[FAIL] discord: cannot reach nonexistent.invalid:1: ")
    assert lines["discord"].endswith("; check the network/DNS or discord.api_base_url")
    assert "DISCORD_BOT_TOKEN" not in lines["discord"]
    async with FakeDiscord() as dc:
        lines = await check(tmp_path, llm, capsys, {"DISCORD_BOT_TOKEN": "not-the-fakes-token"},
                            discord={"enabled": True, "api_base_url": dc.api_base})
    assert lines["discord"] == (f"[FAIL] discord: {dc.api_base}/users/@me was refused (HTTP 401: 401: Unauthorized); "
                                "check DISCORD_BOT_TOKEN")


async def test_an_unresolvable_model_endpoint_names_the_network_not_the_key(tmp_path, llm, capsys):
    lines = await check(tmp_path, llm, capsys, {"OPENAI_API_KEY": "sk-test"},
                        llm={"base_url": f"{UNRESOLVABLE}/v1", "max_retries": 0, "timeout_s": 10})
    line = lines["model endpoint"]
    assert line.startswith("[FAIL] model endpoint: cannot reach nonexistent.invalid:1: ")
    assert "check the network/DNS or llm.base_url / OPENAI_BASE_URL" in line
    assert f"({UNRESOLVABLE}/v1/chat/completions)" in line and "OPENAI_API_KEY" not in line


async def test_a_model_endpoint_refusing_the_key_names_the_key(tmp_path, llm, capsys):
    llm.push(error(401, "Incorrect API key provided"))
    lines = await check(tmp_path, llm, capsys, {"OPENAI_API_KEY": "sk-wrong"})
    line = lines["model endpoint"]
    assert line.startswith(f"[FAIL] model endpoint: {llm.base_url}/chat/completions: model endpoint error 401")
    assert line.endswith("(the endpoint refused the key: check OPENAI_API_KEY)") and "network" not in line


async def test_a_model_the_endpoint_does_not_serve_names_the_model(tmp_path, llm, capsys):
    llm.push(error(404, "The model `test-model` does not exist"))
    line = (await check(tmp_path, llm, capsys, {"OPENAI_API_KEY": "sk-test"}))["model endpoint"]
    assert "check llm.model" in line and "OPENAI_API_KEY" not in line and "network" not in line


async def test_a_model_endpoint_that_drops_the_connection_names_the_network_not_the_key(tmp_path, llm, capsys):
    """Regression: a server that closes the connection without answering (or a URL without
    http://) was "Connection error. (check … OPENAI_API_KEY …)": the openai client raises the
    errors of its own httpx (httpx2), which the reasons did not know."""
    async def closer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1024)
        writer.close()

    server = await asyncio.start_server(closer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        dropped = (await check(tmp_path, llm, capsys, {"OPENAI_API_KEY": "sk-test"},
                               llm={"base_url": f"http://127.0.0.1:{port}/v1", "max_retries": 0}))["model endpoint"]
        no_scheme = (await check(tmp_path, llm, capsys, {"OPENAI_API_KEY": "sk-test"},
                                 llm={"base_url": f"127.0.0.1:{port}/v1", "max_retries": 0}))["model endpoint"]
    finally:
        server.close()
        await server.wait_closed()
    assert dropped.startswith(f"[FAIL] model endpoint: cannot reach 127.0.0.1:{port}: the server closed the "
                              "connection without an HTTP answer"), dropped
    assert "the URL does not start with http:// or https://" in no_scheme
    assert "OPENAI_API_KEY" not in dropped + no_scheme and "Connection error" not in dropped + no_scheme


def test_a_connection_error_without_a_known_cause_is_still_the_network():
    """The client's connection error (openai.APIConnectionError, as translate() makes it a
    ModelUnavailable without status) is a network failure whatever caused it; an error the
    endpoint reported mid-stream, also without status, is not."""
    import openai
    from httpx2 import Request

    from bumblebot.core.errors import ModelUnavailable
    from bumblebot.llm.completion import translate

    url = "http://127.0.0.1:9/v1"
    try:
        try:
            raise RuntimeError("something no reason knows")
        except RuntimeError as cause:
            raise openai.APIConnectionError(request=Request("POST", f"{url}/chat/completions")) from cause
    except openai.APIConnectionError as exc:
        try:
            raise translate(exc, base_url=url, timeout_s=10, clock=lambda: 0.0) from exc
        except ModelUnavailable as model_error:
            failed = model_error
    line = model_failure(failed, f"{url}/chat/completions")
    assert line.startswith("cannot reach 127.0.0.1:9: the connection failed; check the network/DNS"), line
    assert "OPENAI_API_KEY" not in line
    try:
        raise ModelUnavailable("the model endpoint reported an error mid-stream: provider down") from ValueError("x")
    except ModelUnavailable as mid_stream:
        assert "OPENAI_API_KEY" in model_failure(mid_stream, f"{url}/chat/completions")


@pytest.mark.parametrize(("variable", "value"), [
    ("DISCORD_BOT_TOKEN", "MTIz.abc\u200b"),  # a zero-width space pasted along with it
    ("OPENAI_API_KEY", "sk-test\u200b"),
    ("TELEGRAM_BOT_TOKEN", f"{TOKEN}\x07"),  # a control character
])
async def test_a_token_with_a_character_no_request_carries_is_one_line_naming_it(tmp_path, llm, capsys, variable, value):
    """Regression: a non-ASCII character in a token or key crashed check with UnicodeEncodeError
    (the header), a control character with httpx.InvalidURL (Telegram's URL holds the token)."""
    answer_with_ping(llm)
    secrets = {"OPENAI_API_KEY": "sk-test", variable: value}
    lines = await check(tmp_path, llm, capsys, secrets, discord={"enabled": True, "api_base_url": "http://127.0.0.1:9/api"},
                        telegram={"enabled": True, "base_url": "http://127.0.0.1:9/bot"})
    what = {"DISCORD_BOT_TOKEN": "discord", "OPENAI_API_KEY": "model endpoint", "TELEGRAM_BOT_TOKEN": "telegram"}[variable]
    line = lines[what]
    bad = f"U+{ord(value[-1]):04X}"
    assert line.startswith(f"[FAIL] {what}: {variable} holds {bad} ("), line
    assert f"set {variable} again" in line and value[:-1] not in line


async def test_a_url_setting_that_is_no_url_is_one_line_naming_the_setting(tmp_path, llm, capsys):
    """Regression: `telegram.base_url: "http://[::1/bot"` crashed check with httpx.InvalidURL."""
    answer_with_ping(llm)
    lines = await check(tmp_path, llm, capsys, {"TELEGRAM_BOT_TOKEN": TOKEN},
                        telegram={"enabled": True, "base_url": "http://[::1/bot"})
    assert lines["telegram"].startswith("[FAIL] telegram: http://[::1/bot is not a valid URL (")
    assert lines["telegram"].endswith("; fix telegram.base_url") and TOKEN not in lines["telegram"]
    lines = await check(tmp_path, llm, capsys, {"OPENAI_API_KEY": "sk-test"}, llm={"base_url": "http://[::1/v1"})
    assert lines["model endpoint"].startswith("[FAIL] model endpoint: http://[::1/v1 is not a valid URL (")
    assert lines["model endpoint"].endswith("; fix llm.base_url / OPENAI_BASE_URL")


async def test_a_password_in_an_endpoint_url_is_never_printed(tmp_path, llm, capsys):
    """Regression: `OPENAI_BASE_URL=http://bob:PW@host/v1` was printed whole by check: in the
    model lines, the voice notes line and a failure's (…/chat/completions)."""
    answer_with_ping(llm)
    with_password = llm.base_url.replace("http://", "http://bob:PW-not-shown@")
    masked = llm.base_url.replace("http://", "http://bob:***@")
    lines = await check(tmp_path, llm, capsys, {"OPENAI_API_KEY": "sk-test"}, llm={"base_url": with_password})
    assert lines["model test-model"] == f"[ok] model test-model: answered at {masked}"
    assert lines["voice notes"].startswith(f"[ok] voice notes: transcribed at {masked}/audio/transcriptions")
    assert not any("PW-not-shown" in line for line in lines.values())
    llm.push(error(401, "Incorrect API key provided"))
    line = (await check(tmp_path, llm, capsys, {"OPENAI_API_KEY": "sk-test"}, llm={"base_url": with_password}))["model endpoint"]
    assert line.startswith(f"[FAIL] model endpoint: {masked}/chat/completions: ") and "PW-not-shown" not in line


async def test_a_telegram_base_url_with_a_wrong_path_names_the_setting_too(tmp_path, llm, capsys):
    """Telegram answers a malformed token with 404, and so does any server a base_url with a
    wrong path reaches: the line names both."""
    answer_with_ping(llm)
    async with FakeTelegram(token=TOKEN) as tg:
        wrong = tg.base_url.replace("/bot", "/api/bot")
        line = (await check(tmp_path, llm, capsys, {"TELEGRAM_BOT_TOKEN": TOKEN},
                            telegram={"enabled": True, "base_url": wrong}))["telegram"]
    assert line == f"[FAIL] telegram: {wrong}<token>/getMe was not found (HTTP 404); check TELEGRAM_BOT_TOKEN, and telegram.base_url"


async def test_a_request_through_a_proxy_names_the_proxy(tmp_path, llm, capsys, monkeypatch):
    """With HTTP(S)_PROXY set httpx goes through the proxy: a proxy that is down is named, not
    only the host behind it."""
    answer_with_ping(llm)
    unused = socket.socket()
    unused.bind(("127.0.0.1", 0))
    port = unused.getsockname()[1]
    unused.close()  # nothing listens there now
    for name in ("http_proxy", "https_proxy", "all_proxy", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTP_PROXY", f"http://user:PROXY-PW@127.0.0.1:{port}")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")  # the fake model endpoint
    line = (await check(tmp_path, llm, capsys, {"DISCORD_BOT_TOKEN": "unused"},
                        discord={"enabled": True, "api_base_url": f"{UNRESOLVABLE}/api/v10"}))["discord"]
    assert line == (f"[FAIL] discord: cannot reach nonexistent.invalid:1 through the proxy 127.0.0.1:{port} (HTTP_PROXY): "
                    "Connection refused; check the proxy (HTTP_PROXY), the network/DNS or discord.api_base_url")


# -- network_reason: the words for what real httpx requests met ---------------------------------


async def failure(url: str, timeout: float = 5, **client: Any) -> BaseException:
    async with httpx.AsyncClient(timeout=timeout, **client) as http:
        with pytest.raises(httpx.HTTPError) as caught:
            await http.get(url)
    return caught.value


async def test_network_reasons_name_what_happened_without_the_url():
    unused = socket.socket()
    unused.bind(("127.0.0.1", 0))
    port = unused.getsockname()[1]
    unused.close()  # nothing listens there now
    refused = await failure(f"http://127.0.0.1:{port}/bot123:SECRET/getMe")
    assert network_reason(refused) == "Connection refused"

    unresolvable = network_reason(await failure(f"{UNRESOLVABLE}/bot123:SECRET/getMe"))
    assert unresolvable is not None and "SECRET" not in unresolvable

    no_scheme = await failure("api.telegram.org/bot123:SECRET/getMe")
    assert network_reason(no_scheme) == "the URL does not start with http:// or https://"


async def test_a_silent_server_times_out_and_plain_http_fails_tls():
    accepted: list[asyncio.StreamWriter] = []

    async def silent(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)  # accepts, reads nothing, answers nothing

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        assert network_reason(await failure(f"http://127.0.0.1:{port}/", timeout=0.3)) == "timed out"
    finally:
        for writer in accepted:
            writer.close()
        server.close()
        await server.wait_closed()

    async def plain(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1024)
        writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(plain, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        reason = network_reason(await failure(f"https://127.0.0.1:{port}/"))
        assert reason is not None and reason.startswith("TLS failed")
    finally:
        server.close()
        await server.wait_closed()


def test_an_error_that_is_not_the_network_has_no_network_reason():
    assert network_reason(ValueError("bad JSON")) is None


# -- what check prints -------------------------------------------------------------------------


async def test_check_hides_a_key_the_endpoint_echoes_in_its_refusal(tmp_path, llm, capsys):
    # regression: "Incorrect API key provided: sk-…" was printed with the key in it
    key = "sk-primary-SECRET-0123456789"
    llm.push(error(401, f"Incorrect API key provided: {key}. You can find your API key at …"))
    lines = await check(tmp_path, llm, capsys, {"OPENAI_API_KEY": key})
    assert "Incorrect API key provided: [REDACTED]." in lines["model endpoint"]
    assert not [line for line in lines.values() if key in line]


async def test_check_asks_the_background_model_and_fails_on_one_the_endpoint_does_not_serve(tmp_path, llm, capsys):
    # regression: llm.background_model was neither listed nor asked, so a typo passed
    def answer(request: dict[str, Any]) -> Any:
        if request["model"] == "cheap-modle":
            return error(404, "The model `cheap-modle` does not exist")
        return tool_calls(("ping", {})) if is_loop(request) else text("ok")

    llm.default = answer
    lines = await check(tmp_path, llm, capsys, {"OPENAI_API_KEY": "sk-test"}, llm={"background_model": "cheap-modle"})
    assert lines["model cheap-modle"].startswith("[FAIL] model cheap-modle: ")
    assert "(check llm.background_model, a model that endpoint serves" in lines["model cheap-modle"]
    assert lines["model test-model"].startswith("[ok]") and lines["tool calls"].startswith("[ok]")
    lines = await check(tmp_path, llm, capsys, {"OPENAI_API_KEY": "sk-test"}, llm={"background_model": "cheap-model"})
    assert lines["model cheap-model"] == f"[ok] model cheap-model: answered at {llm.base_url}"
