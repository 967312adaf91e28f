"""Logging setup with secret redaction (field-bugs.md item 29).

httpx logs every request URL at INFO, and Telegram URLs contain the bot token, so the HTTP
libraries are held at WARNING. A filter on the root handler replaces every configured secret
and anything shaped like a bot token or an API key with ``[REDACTED]``.
"""

from __future__ import annotations

import logging
import re
import sys

_PATTERNS = [
    re.compile(r"\b\d{6,12}:[A-Za-z0-9_-]{30,}\b"),  # Telegram bot token
    re.compile(r"\bsk-[A-Za-z0-9_-]{16,}\b"),  # OpenAI-style keys
    re.compile(r"(?i)(authorization:\s*(bot|bearer)\s+)\S+"),
]


class RedactingFilter(logging.Filter):
    """Removes secrets from every record's final message."""

    def __init__(self, secrets: list[str]) -> None:
        super().__init__()
        self.secrets = [s for s in secrets if len(s) >= 6]

    def redact(self, text: str) -> str:
        for secret in self.secrets:
            text = text.replace(secret, "[REDACTED]")
        for pattern in _PATTERNS:
            text = pattern.sub(lambda m: (m.group(1) if m.lastindex else "") + "[REDACTED]", text)
        return text

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.exc_info:
            message += "\n" + logging.Formatter().formatException(record.exc_info)
            record.exc_info = None
            record.exc_text = None
        record.msg = self.redact(message)
        record.args = None
        return True


def setup_logging(level: str, secrets: list[str], *, stream: object = None) -> None:
    """Configure the root logger once: a redacting stream handler on stderr."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "_bumblebot", False):
            root.removeHandler(handler)
    handler = logging.StreamHandler(stream or sys.stderr)  # type: ignore[arg-type]
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.addFilter(RedactingFilter(secrets))
    handler._bumblebot = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(level)
    for noisy in ("httpx", "httpcore", "telegram", "discord", "openai", "aiosqlite", "hpack"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLevelName(level)))
