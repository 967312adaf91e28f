"""What ``bumblebot check`` learns about the endpoint is remembered where the daemon looks for
it (bumblebot/app/probing.py), so the first real turn pays nothing to learn it again; and it
says what it learned. ``check_all`` against ``FakeOpenAI``, real SQLite, then the daemon."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import running, write_config
from fakes.openai_server import FakeOpenAI, Reply, is_aux, is_loop, text, tool_calls
from support import env_for, judges_say_done, loop_requests, say

from bumblebot.app import probing
from bumblebot.app.check import check_all
from bumblebot.app.probing import is_local
from bumblebot.core.config import Secrets, load_settings
from bumblebot.core.entity import load_entity
from bumblebot.llm import ForcingFallback, stream_key, thinking_key, tool_choice_key
from bumblebot.llm.overruns import overrun_key
from bumblebot.llm.pace import speed_key
from bumblebot.llm.window import LearnedWindow, window_key
from bumblebot.store import Store


async def check(config: Path) -> tuple[list[str], Any]:
    settings = load_settings(config)
    entity = load_entity(settings.entity, config_dir=config.parent)
    return await check_all(settings, Secrets(OPENAI_API_KEY="sk-test"), entity, chat_only=True), settings


def answer_with_ping(server: FakeOpenAI) -> None:
    server.default = lambda request: tool_calls(("ping", {})) if is_loop(request) else text("ok")


#: who the data directory belongs to as ``service install`` leaves it: the service user's (nobody
#: when the tests run as root: root creates no database in a directory of root's own), else ours
SERVICE_UID = 65534 if os.geteuid() == 0 else os.geteuid()


def service_data_dir(tmp_path: Path) -> Path:
    """The data directory ``service install`` made: there, and the service user's."""
    data = tmp_path / "data"
    data.mkdir(mode=0o700)
    os.chown(data, SERVICE_UID, SERVICE_UID)
    return data


async def test_check_shows_the_configured_and_the_learned_window_and_remembers_it(tmp_path, capsys):
    service_data_dir(tmp_path)
    async with FakeOpenAI(context_window=4096) as server:
        answer_with_ping(server)
        problems, settings = await check(write_config(tmp_path, server))
        assert problems == []
        out = capsys.readouterr().out
        assert ("[ok] context window test-model: cognition.max_context_tokens is not set (32768 assumed); the "
                "endpoint says 4096 tokens (from /props): the daemon uses 4096") in out
        async with Store(settings.db_path) as store:  # remembered for the daemon
            assert LearnedWindow.parse(await store.get_kv(window_key(server.base_url, "test-model"))).tokens == 4096
        # configured larger than the server's: both shown, and what to do about it
        problems, _ = await check(write_config(tmp_path, server, cognition={"max_context_tokens": 32768}))
        assert problems == []
        out = capsys.readouterr().out
        assert ("[note] context window test-model: cognition.max_context_tokens is 32768; the endpoint says 4096 "
                "tokens (from /props): the daemon uses 4096; lower cognition.max_context_tokens to 4096") in out




async def test_a_local_server_telling_no_window_is_asked_with_one_oversized_request(tmp_path, tg, capsys):
    """llama-cpp-python says its window nowhere: check sends one request too long for any local
    window, with max_tokens 1; the server refuses it before evaluating it, stating its window,
    and check reports and remembers it. The daemon's first turn then keeps a 27 KB paste as a
    file before any request: none is refused."""
    service_data_dir(tmp_path)
    async with FakeOpenAI(context_window=4096, tells_window=None, context_error="openai") as server:
        answer_with_ping(server)
        config = write_config(tmp_path, server, tg)
        problems, settings = await check(config)
        assert problems == []
        out = capsys.readouterr().out
        assert ("[ok] context window test-model: cognition.max_context_tokens is not set (32768 assumed); the endpoint "
                f"refused a request of about {probing.WINDOW_PROBE_TOKENS} tokens just now, stating its window: 4096 "
                "tokens (remembered for the daemon): the daemon uses 4096") in out
        probes = [r for r in server.context_refused if r["max_tokens"] == 1]
        assert len(probes) == 1 and len(server.context_refused) == 1  # llm.model's, nothing else refused
        async with Store(settings.db_path) as store:
            assert LearnedWindow.parse(await store.get_kv(window_key(server.base_url, "test-model"))).tokens == 4096
        judges_say_done(server)
        server.default = lambda r: text("DONE: fine") if is_aux(r) else say("Kept it; I read its start.")
        async with running(config) as d:
            tg.push_text("\n".join(f"line {i:04d}: " + "the quick brown fox jumps over the lazy dog. " * 2
                                    for i in range(300)), chat_id=52)
            await d.engine.wait_for_turns(1, timeout=30)
    assert tg.sent(52) == ["Kept it; I read its start."]
    assert len(server.context_refused) == 1  # the first turn sent nothing too long


async def test_a_server_answering_the_oversized_request_is_said_so_and_the_configured_window_stays(tmp_path, capsys):
    async with FakeOpenAI(tells_window=None) as server:
        answer_with_ping(server)
        problems, _ = await check(write_config(tmp_path, server))
    assert problems == []
    out = capsys.readouterr().out
    assert ("[ok] context window test-model: cognition.max_context_tokens is not set (32768 assumed); the endpoint does "
            "not say its window") in out
    assert (f"it answered a request of about {probing.WINDOW_PROBE_TOKENS} tokens: its window is larger, or it cuts "
            "long prompts without saying so, so the daemon uses 32768") in out


async def test_the_oversized_request_goes_to_one_model_and_is_not_sent_again_once_answered(tmp_path, capsys):
    """The failing input: a gateway on a private address in front of a hosted model with a 1M
    window answered it, and every check sent it again, once per model (reflex and background
    too): six requests of ~1 MB over two checks, each billed."""
    service_data_dir(tmp_path)
    async with FakeOpenAI(tells_window=None) as server:
        answer_with_ping(server)
        config = write_config(tmp_path, server, llm={"reflex_model": "small-model", "background_model": "bg-model"})
        await check(config)
        await check(config)
    oversized = [r for r in server.requests if r.get("max_tokens") == 1]
    assert [r["model"] for r in oversized] == ["test-model"]
    assert "was answered at the last check, so it is not sent again before" in capsys.readouterr().out


async def test_the_oversized_request_is_given_up_after_its_timeout(tmp_path, capsys, monkeypatch):
    """A server that would evaluate it (a window larger still) holds check for the timeout at most."""
    monkeypatch.setattr(probing, "WINDOW_PROBE_TIMEOUT_S", 0.5)
    async with FakeOpenAI(tells_window=None) as server:
        def answer(request: dict[str, Any]) -> Any:
            if request["max_tokens"] == 1:
                return Reply(message={"role": "assistant", "content": "x"}, delay=30)
            return tool_calls(("ping", {})) if is_loop(request) else text("ok")

        server.default = answer
        problems, _ = await check(write_config(tmp_path, server, llm={"timeout_s": 60}))
    assert problems == []
    assert f"a request of about {probing.WINDOW_PROBE_TOKENS} tokens got no answer within 0.5 s" in capsys.readouterr().out


async def test_only_a_server_on_this_machine_or_its_network_gets_the_oversized_request():
    assert await is_local("http://127.0.0.1:8000/v1") and await is_local("http://localhost:11434/v1")
    assert await is_local("http://192.168.1.20:8080/v1") and await is_local("http://[::1]:8000/v1")
    assert not await is_local("http://8.8.8.8/v1")  # a hosted API that took it would bill ~250k tokens


async def test_what_check_learns_is_remembered_so_the_first_turn_pays_nothing(tmp_path, tg, capsys):
    """An endpoint refusing tool_choice=required (a bare 500, as llama-cpp-python), streams
    (a 400) and reasoning_effort: check says what it learned, not a silent [ok], and writes it
    where the daemon reads it; the daemon's first turn then sends no request it would refuse."""
    service_data_dir(tmp_path)  # check runs before the daemon's first start
    async with FakeOpenAI(reject_tool_choice_required=500, tool_choice_refusal="", reject_stream=400,
                          reject_reasoning_effort=True) as server:
        answer_with_ping(server)
        config = write_config(tmp_path, server, tg, llm={"max_retries": 2}, delivery={"streaming": "on"})
        problems, settings = await check(config)
        assert problems == []
        out = capsys.readouterr().out
        assert "[note] tool forcing: auto: the endpoint refused tool_choice=required just now (remembered for the " \
               "daemon)" in out
        assert "[ok] tool forcing" not in out
        assert "[note] streaming: whole messages, learned just now (remembered for the daemon)" in out
        assert "[ok] thinking: not asked for: the daemon remembers that test-model refused reasoning_effort" in out
        async with Store(settings.db_path) as store:
            assert ForcingFallback.parse(await store.get_kv(tool_choice_key(server.base_url))) is not None
            assert await store.get_kv(stream_key(server.base_url))
            assert await store.get_kv(thinking_key(server.base_url, "test-model"))
        refused_by_check = len(server.rejected)
        judges_say_done(server)
        server.push(say("hello there"), when=is_loop)
        async with running(config) as d:
            tg.push_text("help me research the history of the bicycle and compare the sources", chat_id=51)
            await d.engine.wait_for_turns(1, timeout=20)
    assert tg.sent(51) == ["hello there"]
    assert len(server.rejected) == refused_by_check  # nothing refused: the turn started plain
    first = loop_requests(server)[-1]
    assert first["tool_choice"] == "auto" and not first.get("stream") and "reasoning_effort" not in first


async def test_check_measures_each_endpoints_speed_and_remembers_it_for_the_daemon(tmp_path, tg, capsys):
    """One request that writes: streamed, its writing speed is exact; it is said, and kept where
    the daemon reads it, so that the daemon's first deadline is the endpoint's own."""
    service_data_dir(tmp_path)
    async with FakeOpenAI(tokens_per_s=100) as server:
        counting = "one two " * 30  # 60 chunks of 4 characters, about a token each: within 64
        server.default = lambda request: (
            # check's overrun probe, answered as a server that stops at max_tokens does
            tool_calls(("note", {"text": "one"}), finish_reason="length", usage={"completion_tokens": 4})
            if "Call the note tool" in str(request["messages"])
            else tool_calls(("ping", {})) if is_loop(request)
            else Reply(message={"role": "assistant", "content": counting}, stream_chars=4)
            if "Count from 1 to 200" in str(request["messages"]) else text("ok")
        )
        config = write_config(tmp_path, server, tg, delivery={"streaming": "on"})
        problems, settings = await check(config)
        assert problems == []
        out = capsys.readouterr().out
        [line] = [x for x in out.splitlines() if "speed test-model" in x]
        writing = int(line.split(": ", 1)[1].split(" tokens/s writing")[0])
        assert 70 <= writing <= 110, line  # the fake writes 100 tokens/s
        assert "does not stop at max_tokens" not in line
        async with Store(settings.db_path) as store:
            remembered = json.loads(await store.get_kv(speed_key(server.base_url, "test-model", "text")) or "{}")
        assert remembered["writing"] and remembered["reading"]


async def test_check_finds_a_server_that_writes_tool_arguments_past_max_tokens(tmp_path, tg, capsys):
    """llama-cpp-python ignores max_tokens inside a call's arguments: check's one request with a
    budget of 16 tokens shows it, and the daemon's first turn sends its string arguments bounded."""
    service_data_dir(tmp_path)
    async with FakeOpenAI() as server:
        def answer(request: dict[str, Any]) -> Reply:
            names = [t["function"]["name"] for t in request.get("tools") or ()]
            if "note" in names:  # a runaway story, as long as the schema lets it be
                limit = request["tools"][0]["function"]["parameters"]["properties"]["text"]["maxLength"]
                return tool_calls(("note", {"text": "x" * limit}), usage={"completion_tokens": limit // 4})
            return tool_calls(("ping", {})) if is_loop(request) else text("ok")

        server.default = answer
        config = write_config(tmp_path, server, tg)
        problems, settings = await check(config)
        assert problems == []
        out = capsys.readouterr().out
        assert "does not stop at max_tokens (wrote 100 tokens with max_tokens 4)" in out
        async with Store(settings.db_path) as store:
            assert await store.get_kv(overrun_key(server.base_url, "test-model"))
        judges_say_done(server)
        server.push(say("hello there"), when=is_loop)
        async with running(config) as d:
            tg.push_text("hi", chat_id=52)
            await d.engine.wait_for_turns(1, timeout=20)
    first = loop_requests(server)[-1]
    say_tool = next(t for t in first["tools"] if t["function"]["name"] == "say")
    assert say_tool["function"]["parameters"]["properties"]["text"]["maxLength"] == 500


async def test_check_finds_a_server_that_writes_a_short_call_past_a_tiny_budget(tmp_path, tg, capsys):
    """SmolLM2-135M on llama-cpp-python wrote notes of 11 to 27 tokens to check's requests with
    a budget of 16, within the margin turns allow: the server that ignores max_tokens went
    unseen, and the first runaway of a turn ran 274 s. A budget of 4, and the server's own count
    of more than twice it, give it away."""
    service_data_dir(tmp_path)
    async with FakeOpenAI() as server:
        def answer(request: dict[str, Any]) -> Reply:
            names = [t["function"]["name"] for t in request.get("tools") or ()]
            if "note" in names:
                return tool_calls(("note", {"text": "one, two, three"}), usage={"completion_tokens": 11})
            return tool_calls(("ping", {})) if is_loop(request) else text("ok")

        server.default = answer
        problems, _ = await check(write_config(tmp_path, server, tg))
    assert problems == []
    assert "does not stop at max_tokens (wrote 11 tokens with max_tokens 4)" in capsys.readouterr().out


async def test_check_asks_again_when_the_model_wrote_an_empty_call(tmp_path, tg, capsys):
    service_data_dir(tmp_path)
    notes: list[dict[str, Any]] = []
    async with FakeOpenAI() as server:
        def answer(request: dict[str, Any]) -> Reply:
            names = [t["function"]["name"] for t in request.get("tools") or ()]
            if "note" in names and request["model"] == "test-model":
                notes.append(request)
                if len(notes) == 1:  # a call with nothing in it: shows neither
                    return tool_calls(("note", {}), usage={"completion_tokens": 2})
                return tool_calls(("note", {"text": "one, " * 80}), usage={"completion_tokens": 160})
            return tool_calls(("ping", {})) if is_loop(request) else text("ok")

        server.default = answer
        problems, _ = await check(write_config(tmp_path, server, tg))
    assert problems == [] and len(notes) == 2
    assert "does not stop at max_tokens (wrote 160 tokens with max_tokens 4)" in capsys.readouterr().out


async def test_check_asks_once_of_a_server_that_stops_at_the_budget(tmp_path, tg, capsys):
    service_data_dir(tmp_path)
    notes: list[dict[str, Any]] = []
    async with FakeOpenAI() as server:
        def answer(request: dict[str, Any]) -> Reply:
            names = [t["function"]["name"] for t in request.get("tools") or ()]
            if "note" in names:
                notes.append(request)  # one for each model: test-model and reflex-model
                return tool_calls(("note", {"text": "one"}), finish_reason="length",
                                  usage={"completion_tokens": 4})
            return tool_calls(("ping", {})) if is_loop(request) else text("ok")

        server.default = answer
        problems, _ = await check(write_config(tmp_path, server, tg))
    assert problems == [] and [r["model"] for r in notes] == ["test-model", "reflex-model"]
    assert "does not stop at max_tokens" not in capsys.readouterr().out


async def test_check_next_to_a_running_daemon_writes_what_it_learns(tmp_path, tg, capsys):
    """check takes no lock and writes its rows through WAL and the busy timeout while the daemon
    holds the database open; the daemon keeps running and reads them at its next start."""
    async with FakeOpenAI(context_window=4096) as server:
        answer_with_ping(server)
        config = write_config(tmp_path, server, tg)
        async with running(config) as d:
            problems, settings = await check(config)
            assert problems == []
            raw = await d.store.get_kv(window_key(server.base_url, "test-model"))
        assert LearnedWindow.parse(raw).tokens == 4096
        assert "the endpoint says 4096 tokens (from /props)" in capsys.readouterr().out


# -- whose database: check run as root must leave it the service user's ---------------------------


async def test_check_creates_a_missing_database_owned_as_its_data_directory_is(tmp_path):
    """check before the daemon's first start: the database it remembers what it learned in
    belongs to the data directory's owner (the service user's, when check runs as root)."""
    data = service_data_dir(tmp_path)
    async with FakeOpenAI(context_window=4096) as server:
        answer_with_ping(server)
        problems, _ = await check(write_config(tmp_path, server))
    assert problems == []
    made = {(p.name, p.stat().st_uid, p.stat().st_gid) for p in data.glob("bumblebot.db*")}
    assert made == {("bumblebot.db", SERVICE_UID, SERVICE_UID)}


@pytest.fixture
def reachable(tmp_path: Path) -> Iterator[Path]:
    """A folder another user may pass through (pytest's own are root's, mode 0700)."""
    base = Path(tempfile.mkdtemp(prefix="bumblebot-probing-", dir="/tmp"))
    base.chmod(0o755)
    try:
        yield base
    finally:
        shutil.rmtree(base)


async def check_process(config: Path, tmp_path: Path) -> str:
    """``bumblebot check --chat-only`` run as its own process, as an operator runs it; its output."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bumblebot", "--config", str(config), "check", "--chat-only", cwd=tmp_path,
        env=env_for(tmp_path), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    return out.decode()


def write_as_nobody(db: Path) -> subprocess.CompletedProcess[str]:
    """A write to ``db`` by the service user (nobody), as the daemon's first start makes."""
    script = ("import sqlite3, sys; c = sqlite3.connect(sys.argv[1]); c.execute('PRAGMA journal_mode=WAL'); "
              "c.execute(\"INSERT OR REPLACE INTO kv VALUES ('written', 'by the service user')\"); c.commit()")
    return subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c",
                           script, str(db)], capture_output=True, text=True, timeout=30)


if os.geteuid() == 0:  # only root can run check as root for another user's data directory

    async def test_check_run_as_root_before_the_first_start_leaves_the_service_user_a_database_it_opens(
        tmp_path, reachable
    ):
        """service install gave the data directory to the service user; root runs check before
        the first start. The database it made was root's (0600) and the service could not open it."""
        data = reachable / "data"
        data.mkdir(mode=0o700)
        os.chown(data, 65534, 65534)
        async with FakeOpenAI(context_window=4096) as server:
            answer_with_ping(server)
            out = await check_process(write_config(tmp_path, server, data_dir=str(data)), tmp_path)
        assert "[FAIL]" not in out and "the endpoint says 4096 tokens (from /props)" in out
        assert {p.stat().st_uid for p in data.glob("bumblebot.db*")} == {65534}
        written = write_as_nobody(data / "bumblebot.db")
        assert written.returncode == 0, written.stderr
        assert {(p.stat().st_uid, p.stat().st_gid) for p in data.iterdir()} == {(65534, 65534)}

    async def test_check_run_as_root_writes_into_the_service_users_database_without_taking_it(tmp_path, reachable):
        data = reachable / "data"
        data.mkdir(mode=0o700)
        os.chown(data, 65534, 65534)
        assert write_as_nobody(data / "bumblebot.db").returncode == 1  # no kv table yet: made by the daemon below
        async with FakeOpenAI(context_window=4096) as server:
            answer_with_ping(server)
            config = write_config(tmp_path, server, data_dir=str(data))
            made = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable,
                                   "-c", "import asyncio, sys; from bumblebot.store import Store; "
                                   "asyncio.run(Store(__import__('pathlib').Path(sys.argv[1])).open())",
                                   str(data / "bumblebot.db")], capture_output=True, text=True, timeout=30,
                                  env=env_for(tmp_path))
            assert made.returncode == 0, made.stderr
            out = await check_process(config, tmp_path)
        assert "[FAIL]" not in out
        with contextlib.closing(sqlite3.connect(data / "bumblebot.db")) as db:  # what check learned is there
            assert db.execute("SELECT value FROM kv WHERE key = ?", (window_key(server.base_url, "test-model"),)).fetchone()
        assert write_as_nobody(data / "bumblebot.db").returncode == 0
        assert {p.stat().st_uid for p in data.iterdir()} == {65534}

    async def test_check_run_as_root_in_a_data_directory_of_roots_creates_no_database_and_says_so(tmp_path, capsys):
        """It may not have been given to the service user yet: a database of root's in it would
        stay root's when service install gives the directory away. The lines of what it learned
        say it is for this run only."""
        async with FakeOpenAI(context_window=4096, tells_window=None, context_error="openai",
                              reject_tool_choice_required=500, tool_choice_refusal="") as server:
            answer_with_ping(server)
            problems, settings = await check(write_config(tmp_path, server))
        assert problems == [] and not settings.db_path.exists()
        out = capsys.readouterr().out
        assert ("[note] what check learns: for this run only, not remembered for the daemon: there is no database "
                "yet, and check runs as root in a data directory of root's") in out
        assert "stating its window: 4096 tokens (for this run only: not remembered, see above)" in out
        assert "[note] tool forcing: auto: the endpoint refused tool_choice=required just now (for this run only" in out
        assert "remembered for the daemon)" not in out


if os.geteuid() == 0:
    async def test_root_check_creates_nothing_through_a_symbolic_link_in_the_service_users_directory(tmp_path):
        """The failing input: the service user linked ``bumblebot.db`` to a path of its choice;
        root's check created a database of root's there (and the daemon lost its own)."""
        data = service_data_dir(tmp_path)
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        (data / "bumblebot.db").symlink_to(elsewhere / "planted.db")
        async with FakeOpenAI(context_window=4096) as server:
            settings = load_settings(write_config(tmp_path, server))
            store, why = await probing.writable_store(settings)
        assert store is None and "symbolic link" in why
        assert not (elsewhere / "planted.db").exists()
