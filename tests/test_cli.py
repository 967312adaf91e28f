"""``bumblebot`` as a subprocess: the real CLI against the fakes."""

from __future__ import annotations

import asyncio
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import TOKEN, write_config
from fakes.openai_server import is_loop, tool_calls
from support import (
    Gate,
    contents,
    env_for,
    judges_say_done,
    kill_inside_model_call,
    say,
    start_daemon,
    tool_result,
)


async def test_sigkill_mid_turn_then_restart_answers_exactly_once(tmp_path, llm, tg):
    judges_say_done(llm)
    hang = Gate(say("never delivered"))  # the first process dies inside this model call
    llm.push(hang, when=is_loop)
    config = write_config(tmp_path, llm, tg)
    await kill_inside_model_call(config, tmp_path, tg, hang, "are you there?", 21)
    assert tg.sent(21) == []
    llm.push(say("yes, here"), when=is_loop)
    proc = await start_daemon(config, tmp_path)
    try:
        await tg.wait_for("sendMessage", timeout=20)
        await tg.wait_for("getUpdates", n=2, predicate=lambda p: int(p.get("offset", 0)) > 0, timeout=10)
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(proc.wait(), 20)
    finally:
        if proc.returncode is None:
            proc.kill()
    assert code == 0, (tmp_path / "daemon.log").read_text()
    assert tg.sent(21) == ["yes, here"]
    db = sqlite3.connect(tmp_path / "data" / "bumblebot.db")
    assert db.execute("SELECT status FROM journal").fetchall() == [("done",)]
    # the cut-off turn was resumed from its checkpoint, not answered again by a second turn
    assert db.execute("SELECT status, json_extract(trace, '$.resumes') FROM turns").fetchall() == [("done", 1)]
    log = (tmp_path / "daemon.log").read_text()
    assert "resuming" in log and TOKEN not in log and "sk-test-key" not in log


async def test_sigterm_lets_the_running_turn_finish_and_exits_zero(tmp_path, llm, tg):
    judges_say_done(llm)
    slow = Gate(say("finished before exit"))
    llm.push(slow, when=is_loop)
    proc = await start_daemon(write_config(tmp_path, llm, tg), tmp_path)
    try:
        tg.push_text("hello", chat_id=22)
        await asyncio.wait_for(slow.entered.wait(), 20)
        proc.send_signal(signal.SIGTERM)
        slow.release.set()
        code = await asyncio.wait_for(proc.wait(), 20)
    finally:
        if proc.returncode is None:
            proc.kill()
    assert code == 0
    assert tg.sent(22) == ["finished before exit"]


def run_cli(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bumblebot", *args], cwd=cwd, env=env or env_for(cwd),
        capture_output=True, text=True, timeout=60,
    )


def test_bad_config_exits_2_naming_file_and_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("cognition:\n  max_context_tokens: lots\n")
    result = run_cli("--config", str(bad), "run", cwd=tmp_path)
    assert result.returncode == 2
    line = result.stderr.strip().splitlines()[-1]
    assert str(bad) in line and "cognition.max_context_tokens" in line and "integer" in line


def test_unknown_key_is_an_error(tmp_path):
    bad = tmp_path / "bumblebot.yaml"
    bad.write_text("telegram:\n  alowed_user_ids: [1]\n")
    result = run_cli("check", cwd=tmp_path)
    assert result.returncode == 2
    assert "telegram.alowed_user_ids" in result.stderr and "unknown key" in result.stderr


def test_env_override_is_validated_too(tmp_path):
    env = env_for(tmp_path) | {"BUMBLEBOT_COGNITION__REFLEX_MAX_TOKENS": "many"}
    result = run_cli("run", cwd=tmp_path, env=env)
    assert result.returncode == 2
    assert "cognition.reflex_max_tokens" in result.stderr


def test_version(tmp_path):
    result = run_cli("--version", cwd=tmp_path)
    assert result.returncode == 0 and result.stdout.startswith("bumblebot ")


def test_run_without_any_token_explains_what_to_set(tmp_path):
    env = {k: v for k, v in env_for(tmp_path).items() if k != "TELEGRAM_BOT_TOKEN"}
    result = run_cli("run", cwd=tmp_path, env=env)
    assert result.returncode == 2
    assert "TELEGRAM_BOT_TOKEN" in result.stderr


async def test_check_reports_endpoint_and_token(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(tool_calls(("ping", {})), when=is_loop)
    config = write_config(tmp_path, llm, tg)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bumblebot", "--config", str(config), "check",
        env=env_for(tmp_path), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, out.decode() + err.decode()
    assert b"bot @fake_bot" in out and b"all checks passed" in out
    assert b"called a tool, forced" in out and b"is writable" in out
    assert b"privacy mode on: in groups it only sees mentions" in out  # the fake's getMe says so
    assert TOKEN.encode() not in out + err


async def test_check_fails_clearly_on_a_bad_token(tmp_path, llm, tg):
    judges_say_done(llm)
    config = write_config(tmp_path, llm, tg)
    env = env_for(tmp_path) | {"TELEGRAM_BOT_TOKEN": "999:WRONG-token-value-for-the-test-only"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bumblebot", "--config", str(config), "check",
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 1
    assert b"[FAIL] telegram" in out and b"WRONG-token" not in out + err


async def chat(config: Path, tmp_path: Path, typed: bytes) -> tuple[bytes, bytes]:
    """``bumblebot chat`` with ``typed`` as its input; returns (stdout, stderr) after exit 0."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bumblebot", "--config", str(config), "chat",
        env=env_for(tmp_path), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(typed), 60)
    assert proc.returncode == 0, err.decode()
    return out, err


async def test_chat_console_talks_and_persists(tmp_path, llm):
    judges_say_done(llm)
    llm.push(say("hello from the console"), when=is_loop)
    out, _ = await chat(write_config(tmp_path, llm, None), tmp_path, b"hi there\n/status\n")
    assert b"hello from the console" in out
    assert b"Context: ~" in out
    db = sqlite3.connect(tmp_path / "data" / "bumblebot.db")
    assert db.execute("SELECT platform FROM conversations").fetchall() == [("console",)]
    assert db.execute("SELECT COUNT(*) FROM messages").fetchone()[0] >= 3


def test_unusable_data_dir_is_a_config_error(tmp_path):
    (tmp_path / "bumblebot.yaml").write_text("data_dir: /proc/definitely/not/here\n")
    result = run_cli("run", cwd=tmp_path)
    assert result.returncode == 2
    assert "data_dir" in result.stderr and "Traceback" not in result.stderr


async def test_console_survives_a_lone_slash(tmp_path, llm):
    judges_say_done(llm)
    llm.push(say("still here"), when=is_loop)
    out, err = await chat(write_config(tmp_path, llm, None), tmp_path, b"/\nhello\n")
    assert b"Unknown command" in out and b"still here" in out
    assert b"Traceback" not in err


async def test_restart_after_a_crash_resumes_with_what_was_already_said(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(tool_calls(("say", {"text": "part one is done"})), when=is_loop)
    hang = Gate(say("never"))
    llm.push(hang, when=is_loop)
    config = write_config(tmp_path, llm, tg)
    # deliberate ("file"): a reflex turn would end at its first say (one reply)
    await kill_inside_model_call(config, tmp_path, tg, hang, "do the two parts of the file", 23)
    llm.push(say("and part two"), when=is_loop)
    proc = await start_daemon(config, tmp_path)
    try:
        await tg.wait_for("sendMessage", n=2, timeout=20)
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), 20)
    finally:
        if proc.returncode is None:
            proc.kill()
    assert tg.sent(23) == ["part one is done", "and part two"]
    resumed = [r for r in llm.requests if "tools" in r][-1]
    # the model sees its own checkpointed step: the say call and that it was delivered
    assert tool_result(resumed, "say") == [{"delivered": True, "queued": False}]
    assert "part one is done" in contents(resumed)
    assert [m["role"] for m in resumed["messages"][1:]] == ["user", "assistant", "tool", "user"]


async def test_check_says_when_the_daemon_sends_whole_messages(tmp_path, llm, tg):
    """``bumblebot check`` says the daemon sends whole messages when it remembers that the endpoint
    cannot stream (it once said "streaming: on" then)."""
    import json
    import time

    from bumblebot.llm import stream_key
    from bumblebot.store import Store

    judges_say_done(llm)
    llm.push(tool_calls(("ping", {})), when=is_loop)
    config = write_config(tmp_path, llm, tg, delivery={"streaming": "on"})
    async with Store(tmp_path / "data" / "bumblebot.db") as store:
        value = {"mode": "off", "reason": "a streamed request was refused (HTTP 400)", "since": time.time()}
        await store.set_kv(stream_key(llm.base_url), json.dumps(value))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bumblebot", "--config", str(config), "check",
        env=env_for(tmp_path), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, out.decode() + err.decode()
    assert b"streaming: whole messages: the daemon remembers" in out and b"HTTP 400" in out


# -- the CLI as admins expect it -----------------------------------------------------------


async def test_run_with_config_after_the_subcommand_serves(tmp_path, llm, tg):
    """Regression: ``bumblebot run --config x.yaml`` was refused ("unrecognized arguments")."""
    judges_say_done(llm)
    llm.push(say("served"), when=is_loop)
    config = write_config(tmp_path, llm, tg)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bumblebot", "run", "--config", str(config),
        cwd=tmp_path, env=env_for(tmp_path), stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )
    try:
        tg.push_text("hello", chat_id=31)
        await tg.wait_for("sendMessage", timeout=20)
        proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(proc.communicate(), 20)
    finally:
        if proc.returncode is None:
            proc.kill()
    assert proc.returncode == 0, err.decode()
    assert tg.sent(31) == ["served"]


def test_every_subcommand_help_lists_its_options(tmp_path, capsys):
    """The command line's own parser (the entry point's start is covered by the other tests of
    this file, which run the real command)."""
    from bumblebot.app.cli import parser

    for command, option in (("run", "--config"), ("chat", "--config"), ("check", "--chat-only"), ("trace", "--chat"),
                            ("backup", "path"), ("service install", "--dry-run")):
        with pytest.raises(SystemExit) as exit_:
            parser().parse_args([*command.split(), "--help"])
        shown = capsys.readouterr().out
        assert exit_.value.code == 0 and option in shown and "--config" in shown, command


def test_an_unreadable_dotenv_exits_with_one_clear_line(tmp_path):
    """Regression: a root-only .env gave a PermissionError traceback and a restart loop."""
    import os

    if os.geteuid() == 0:  # root reads any file: make it a directory, which no one can read as a file
        (tmp_path / ".env").mkdir()
    else:
        (tmp_path / ".env").write_text("TELEGRAM_BOT_TOKEN=x\n")
        (tmp_path / ".env").chmod(0)
    env = {k: v for k, v in env_for(tmp_path).items() if k not in ("TELEGRAM_BOT_TOKEN", "OPENAI_API_KEY")}
    result = run_cli("run", cwd=tmp_path, env=env)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr
    assert str(tmp_path / ".env") in lines[0] and "EnvironmentFile" in lines[0]


def test_an_unreadable_dotenv_is_no_problem_when_the_secrets_are_in_the_environment(tmp_path):
    (tmp_path / ".env").mkdir()  # unreadable as a file, for root too
    result = run_cli("check", "--chat-only", cwd=tmp_path, env=env_for(tmp_path) | {"OPENAI_BASE_URL": "http://127.0.0.1:9/v1"})
    assert "Traceback" not in result.stderr and "is not readable" in result.stderr
    assert "[FAIL] model endpoint" in result.stdout and "http://127.0.0.1:9/v1/chat/completions" in result.stdout


def test_an_unreadable_dotenv_is_not_worth_a_warning_when_systemd_gave_the_secrets(tmp_path):
    """Regression: the service warned at every start that /etc/bumblebot/.env (root's, read by
    systemd's EnvironmentFile=) was not readable, though the secrets were all there."""
    (tmp_path / ".env").mkdir()  # unreadable as a file, for root too
    env = env_for(tmp_path) | {"INVOCATION_ID": "0123456789abcdef0123456789abcdef"}
    result = run_cli("trace", cwd=tmp_path, env=env)  # loads config and secrets, then finds no database
    assert result.stderr.startswith("bumblebot: no database at"), result.stderr
    assert "is not readable" not in result.stderr
    # under systemd still, but the enabled Telegram's token is missing: the file may have held it
    missing = {k: v for k, v in env.items() if k != "TELEGRAM_BOT_TOKEN"}
    result = run_cli("trace", cwd=tmp_path, env=missing)
    assert "is not readable" in result.stderr and "no database at" in result.stderr


def test_a_discord_only_service_is_not_warned_about_its_dotenv(tmp_path):
    """Regression: the README's Discord setup leaves telegram.enabled at its default (on) with
    no Telegram token, so under systemd the service warned at every start that its .env was not
    readable, though `run` serves Discord with the token systemd gave it."""
    (tmp_path / ".env").mkdir()  # unreadable as a file, for root too
    (tmp_path / "bumblebot.yaml").write_text("discord: {enabled: true}\n")
    env = {k: v for k, v in env_for(tmp_path).items() if k != "TELEGRAM_BOT_TOKEN"}
    env |= {"INVOCATION_ID": "0123456789abcdef0123456789abcdef", "DISCORD_BOT_TOKEN": "x"}
    result = run_cli("trace", cwd=tmp_path, env=env)
    assert result.stderr.startswith("bumblebot: no database at"), result.stderr
    assert "is not readable" not in result.stderr
    # no platform's token came from systemd: `run` would have nothing to serve, the file may hold them
    result = run_cli("trace", cwd=tmp_path, env={k: v for k, v in env.items() if k != "DISCORD_BOT_TOKEN"})
    assert "is not readable" in result.stderr and "no database at" in result.stderr


def test_a_data_dir_that_is_a_file_gives_the_same_message_everywhere(tmp_path):
    """Regression: run, chat and trace said three different things."""
    (tmp_path / "state").write_text("not a directory")
    (tmp_path / "bumblebot.yaml").write_text("data_dir: state\n")
    lines = set()
    for command in ("run", "chat", "trace", "backup"):
        args = [command, str(tmp_path / "b.db")] if command == "backup" else [command]
        result = run_cli(*args, cwd=tmp_path)
        assert result.returncode == 2, (command, result.stderr)
        lines.add(result.stderr.strip())
    [line] = lines
    assert "data_dir" in line and "is a file" in line


async def test_check_chat_only_needs_no_platform_token(tmp_path, llm):
    """Regression: check failed chat-only setups for want of a Telegram token."""
    judges_say_done(llm)
    llm.push(tool_calls(("ping", {})), when=is_loop)
    config = write_config(tmp_path, llm, None, telegram={"enabled": True})
    env = {k: v for k, v in env_for(tmp_path).items() if k != "TELEGRAM_BOT_TOKEN"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bumblebot", "check", "--chat-only", "--config", str(config),
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, out.decode() + err.decode()
    assert b"--chat-only" in out and b"[FAIL]" not in out


async def test_backup_while_running_is_consistent_and_holds_the_turns(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(say("one"), when=is_loop)
    config = write_config(tmp_path, llm, tg)
    proc = await start_daemon(config, tmp_path)
    try:
        tg.push_text("first", chat_id=32)
        await tg.wait_for("sendMessage", timeout=20)
        db = sqlite3.connect(tmp_path / "data" / "bumblebot.db")
        for _ in range(200):  # the turn's row is written once its reply is out
            if db.execute("SELECT COUNT(*) FROM turns WHERE status='done'").fetchone()[0]:
                break
            await asyncio.sleep(0.05)
        db.close()
        backup = await asyncio.to_thread(run_cli, "--config", str(config), "backup", str(tmp_path / "copy.db"), cwd=tmp_path)
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), 20)
    assert backup.returncode == 0, backup.stderr
    assert "integrity ok" in backup.stdout
    copy = sqlite3.connect(tmp_path / "copy.db")
    assert copy.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert copy.execute("SELECT COUNT(*) FROM turns WHERE status='done'").fetchone()[0] == 1
    again = run_cli("--config", str(config), "backup", str(tmp_path / "copy.db"), cwd=tmp_path)
    assert again.returncode == 1 and "exists" in again.stderr  # a backup never overwrites


def test_a_backup_is_private_and_a_missing_directory_is_named(tmp_path):
    """A backup is readable by its owner only, and a missing directory is named (not only "unable
    to open database file")."""
    import stat

    (tmp_path / "bumblebot.yaml").write_text("data_dir: data\n")
    (tmp_path / "data").mkdir()
    db = sqlite3.connect(tmp_path / "data" / "bumblebot.db")
    db.execute("CREATE TABLE turns (id INTEGER, status TEXT)")
    db.execute("CREATE TABLE messages (id INTEGER)")
    db.commit()
    db.close()
    made = run_cli("backup", str(tmp_path / "copy.db"), cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    assert stat.S_IMODE((tmp_path / "copy.db").stat().st_mode) == 0o600
    missing = run_cli("backup", str(tmp_path / "nowhere" / "copy.db"), cwd=tmp_path)
    assert missing.returncode == 1 and f"the directory {tmp_path / 'nowhere'} does not exist" in missing.stderr


def test_chat_with_a_data_dir_it_cannot_create_is_one_line(tmp_path):
    """Regression: ``bumblebot chat`` gave a traceback opening <data_dir>/bumblebot.log."""
    (tmp_path / "afile").write_text("x")
    (tmp_path / "bumblebot.yaml").write_text("data_dir: afile/sub\n")
    result = run_cli("chat", cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "data_dir" in result.stderr


def test_the_dotenv_next_to_the_config_is_read_from_any_directory(tmp_path):
    """Regression: ``check --config /etc/bumblebot/bumblebot.yaml`` from /root ignored the
    service's /etc/bumblebot/.env and blamed the endpoint."""
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "bumblebot.yaml").write_text(f"data_dir: {tmp_path / 'data'}\n")
    (etc / ".env").write_text("OPENAI_BASE_URL=http://127.0.0.1:9/v1\n")
    elsewhere = tmp_path / "home"
    elsewhere.mkdir()
    env = {k: v for k, v in env_for(tmp_path).items() if k != "OPENAI_BASE_URL"}
    result = run_cli("check", "--chat-only", "--config", str(etc / "bumblebot.yaml"), cwd=elsewhere, env=env)
    assert "http://127.0.0.1:9/v1/chat/completions" in result.stdout, result.stdout + result.stderr


async def test_trace_shows_how_a_turn_stopped_with_its_flags(tmp_path, llm, tg):
    """A turn the completion check found unfinished stopped as ``end_turn`` with the flag
    ``unfinished``; ``trace`` printed only ``stop=end_turn`` once the two were stored apart."""
    from conftest import running
    from fakes.openai_server import is_aux, text
    from support import say

    llm.default = lambda r: text("CONTINUE: the request is not done yet") if is_aux(r) else text("plain")
    for i in range(6):
        llm.push(say(f"attempt {i}"), when=is_loop)
    config = write_config(tmp_path, llm, tg)
    async with running(config) as d:
        tg.push_text("do the thing", chat_id=9)
        await d.engine.wait_for_turns(1)
    flags = sqlite3.connect(tmp_path / "data" / "bumblebot.db").execute(
        "SELECT json_extract(trace, '$.stop_flags') FROM turns").fetchone()[0]
    assert "unfinished" in flags
    out = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "bumblebot", "--config", str(config), "trace"],
        capture_output=True, text=True, cwd=tmp_path,
    )
    assert out.returncode == 0 and "stop=end_turn+" in out.stdout and "unfinished" in out.stdout.splitlines()[0]


async def test_chat_goes_on_after_a_line_that_is_not_utf8(tmp_path, llm):
    """A desktop UTF-8 locale reads stdin strictly: the line raised UnicodeDecodeError in the
    console's input thread, which died; the chat hung for ever (EOF included)."""
    judges_say_done(llm)
    llm.push(say("first"), when=is_loop)
    llm.push(say("second"), when=is_loop)
    out = await chat_through_pipes(tmp_path, llm, b"caf\xe9 ok\nsecond line\n", PYTHONIOENCODING="utf-8:strict")
    assert b"second" in out


async def test_the_models_escape_sequences_never_reach_the_terminal(tmp_path, llm):
    """A reply holding ``ESC ] 52`` (set the clipboard) or a title sequence reached the
    terminal byte for byte; a web page the model read can steer what it writes."""
    judges_say_done(llm)
    llm.push(say("x\x1b]52;c;ZWNobyBoaQ==\x1b\\ and \x1b]0;PWNED\x07 done\x9b2J"), when=is_loop)
    out = await chat_through_pipes(tmp_path, llm, b"hello\n")
    assert b"done" in out and b"\x1b" not in out and b"\x07" not in out and "\x9b".encode() not in out


async def chat_through_pipes(tmp_path: Path, llm: Any, typed: bytes, **env: str) -> bytes:
    """What ``bumblebot chat`` prints when ``typed`` comes through a pipe (then end of input)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bumblebot", "--config", str(write_config(tmp_path, llm, None)), "chat",
        env=env_for(tmp_path) | env, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(typed), 30)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return out


async def test_chat_says_when_a_line_was_not_taken_and_goes_on(tmp_path, llm, monkeypatch, capsys):
    """The database failed as a line was journaled: the line was dropped without a word, and
    `bumblebot chat` ended with exit status 0."""
    import io

    from bumblebot.app.cli import run_chat
    from bumblebot.core.config import Secrets, load_settings
    from bumblebot.core.entity import load_entity
    from bumblebot.core.errors import DatabaseError
    from bumblebot.runtime.engine import Engine

    judges_say_done(llm)
    llm.push(say("got the second"), when=is_loop)
    original = Engine.submit
    failures: list[int] = []

    async def failing_once(self, inbound, **kwargs):
        if not failures:
            failures.append(1)
            raise DatabaseError("INSERT INTO journal failed on postgresql://db/bb: connection refused")
        return await original(self, inbound, **kwargs)

    monkeypatch.setattr(Engine, "submit", failing_once)
    settings = load_settings(write_config(tmp_path, llm, None))
    code = await run_chat(settings, Secrets(OPENAI_API_KEY="sk-test"), load_entity("default"),
                          stdin=io.StringIO("first line\nsecond line\n"))
    out = capsys.readouterr().out
    assert code == 0 and failures
    assert "not taken, the database failed" in out and "send it again" in out and "got the second" in out
