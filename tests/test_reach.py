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
from bumblebot.app.reach import network_reason
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
