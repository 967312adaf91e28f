"""Secrets never appear in log output (field-bugs.md item 29)."""

from __future__ import annotations

import io
import logging

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
