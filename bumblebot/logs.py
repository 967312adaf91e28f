"""Logging setup with secret redaction (field-bugs.md item 29).

httpx logs every request URL at INFO, and Telegram URLs contain the bot token, so the HTTP
libraries are held at WARNING. The daemon's handler formats through :class:`RedactingFormatter`,
which replaces every configured secret, and anything shaped like a bot token or an API key, with
``[REDACTED]`` in the final text (tracebacks included). Records themselves are not modified.
"""

from __future__ import annotations

import logging
import re
import sys
from typing import Any, TextIO

_PATTERNS = [
    re.compile(r"(?<!\d)\d{6,12}:[A-Za-z0-9_-]{30,}"),  # Telegram bot token
    re.compile(r"\bsk-[A-Za-z0-9_-]{16,}\b"),  # OpenAI-style keys
    re.compile(r"(?i)(authorization:\s*(?:bot|bearer)\s+)\S+"),
]


#: Secrets shorter than this are not searched for (a key like "1" or "none" for a local
#: server would otherwise blank out ordinary text); token-shaped strings are caught anyway.
MIN_SECRET_CHARS = 8


def redact(text: str, secrets: list[str]) -> str:
    """``text`` with each secret and each token-shaped string replaced by ``[REDACTED]``."""
    for secret in secrets:
        if len(secret) >= MIN_SECRET_CHARS:
            text = text.replace(secret, "[REDACTED]")
    for pattern in _PATTERNS:
        text = pattern.sub(lambda m: (m.group(1) if m.groups() else "") + "[REDACTED]", text)
    return text


def redact_values(value: Any, secrets: list[str]) -> Any:
    """A copy of a JSON-like structure with every string redacted (keys and structure kept)."""
    if isinstance(value, str):
        return redact(value, secrets)
    if isinstance(value, dict):
        return {k: redact_values(v, secrets) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redact_values(v, secrets) for v in value]
    return value


class RedactingFormatter(logging.Formatter):
    """A formatter whose output never contains the given secrets."""

    def __init__(self, fmt: str, secrets: list[str]) -> None:
        super().__init__(fmt)
        self.secrets = list(secrets)

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record), self.secrets)


def setup_logging(level: str, secrets: list[str], *, stream: TextIO | None = None) -> None:
    """Configure the root logger: one redacting handler on stderr (replacing an earlier one)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "_bumblebot", False):
            root.removeHandler(handler)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(RedactingFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s", secrets))
    handler._bumblebot = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(level)
    for noisy in ("httpx", "httpcore", "httpx2", "httpcore2", "telegram", "discord", "openai", "aiosqlite", "hpack"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLevelName(level)))
