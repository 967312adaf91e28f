"""Secrets never appear in log output or in stored turn traces (bumblebot/core/logs.py)."""

from __future__ import annotations

import io
import logging

from conftest import TOKEN, running, write_config
from fakes.openai_server import error, is_loop
from support import judges_say_done, say

from bumblebot.core.logs import redact, setup_logging


def test_redact_known_secrets_and_token_shapes():
    text = (
        "GET https://api.telegram.org/bot123456789:AAHdqTcvCH1vGWJxfSeofSAs0K5PALDsawq/getMe "
        "key=sk-proj-abcdefghijklmnop1234 Authorization: Bot MTIzNDU2.secret.value my-own-secret"
    )
    out = redact(text, ["my-own-secret"])
    assert "AAHdqTcvCH1vGWJxfSeofSAs0K5PALDsawq" not in out
    assert "sk-proj-abcdefghijklmnop1234" not in out
    assert "MTIzNDU2.secret.value" not in out
    assert "my-own-secret" not in out
    assert out.count("[REDACTED]") == 4


def test_daemon_handler_redacts_messages_and_tracebacks():
    stream = io.StringIO()
    setup_logging("INFO", ["hunter2-secret"], stream=stream)
    log = logging.getLogger("bumblebot.test")
    log.info("token is %s", "hunter2-secret")
    try:
        raise RuntimeError("failed with hunter2-secret inside")
    except RuntimeError:
        log.exception("boom")
    out = stream.getvalue()
    assert "hunter2-secret" not in out
    assert out.count("[REDACTED]") >= 2 and "RuntimeError" in out


# -- secrets in the traces of stored turns -----------------------------------------------------


async def test_a_key_echoed_by_the_endpoint_is_not_stored_in_the_trace(tmp_path, llm, tg):
    llm.push(error(401, "Incorrect API key provided: sk-test-key-not-real-000000"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("hi", chat_id=13)
        await tg.wait_for("sendMessage")
        await d.engine.wait_for_turns(1)
        trace = (await d.store.recent_turns())[0]["trace"]
    blob = (tmp_path / "data" / "bumblebot.db").read_bytes()
    wal = tmp_path / "data" / "bumblebot.db-wal"
    blob += wal.read_bytes() if wal.exists() else b""
    assert "[REDACTED]" in trace["error"]
    assert b"sk-test-key-not-real" not in blob


async def test_a_short_api_key_does_not_break_saving_turns(tmp_path, llm, tg):
    """Regression: OPENAI_API_KEY=1 (fine for a local server) corrupted every trace's JSON."""
    from bumblebot.app.cli import Daemon
    from bumblebot.core.config import Secrets, load_settings
    from bumblebot.core.entity import load_entity

    judges_say_done(llm)
    llm.push(say("first answer"), when=is_loop)
    config = write_config(tmp_path, llm, tg)
    daemon = Daemon(load_settings(config), Secrets(TELEGRAM_BOT_TOKEN=TOKEN, OPENAI_API_KEY="1"), load_entity("default"))
    await daemon.start()
    try:
        tg.push_text("hi 1 null true", chat_id=22)
        await tg.wait_for("sendMessage")
        await daemon.engine.wait_for_turns(1)
        pending = await daemon.store.pending_inbound()
        trace = (await daemon.store.recent_turns())[0]["trace"]
    finally:
        await daemon.stop()
    assert pending == [] and trace["stop_reason"] == "end_turn"
