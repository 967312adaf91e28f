"""Logging setup with secret redaction, as text or JSON lines.

httpx logs every request URL at INFO, and Telegram URLs contain the bot token, so the HTTP
libraries are held at WARNING. The daemon's handler formats through :class:`RedactingFormatter`,
which replaces every configured secret, and anything shaped like a bot token or an API key, with
``[REDACTED]`` in the final text (tracebacks included). Records themselves are not modified.

``log_format: json`` formats through :class:`JsonFormatter` instead: one JSON object
per record per line, with ``time`` (ISO 8601, UTC), ``level``, ``logger``, ``message``, the
``conversation`` key and ``turn`` id when known, and ``exception`` (the traceback) when the record
has one. Every string in it is redacted the same way as the text output.

The conversation and turn come from context variables that :func:`bind` sets around a turn
(``bumblebot/runtime/runner.py``). They follow the turn into the tasks and threads it starts, because
``asyncio`` copies the context into each new task and ``asyncio.to_thread`` does too. A record
may also carry them itself (``log.info(..., extra={"conversation": key})``).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import re
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, TextIO

from bumblebot.core.redaction import MARKER, MIN_SECRET_CHARS

_PATTERNS = [
    re.compile(r"(?<!\d)\d{6,12}:[A-Za-z0-9_-]{30,}"),  # Telegram bot token
    re.compile(r"\bsk-[A-Za-z0-9_-]{16,}\b"),  # OpenAI-style keys
    re.compile(r"(?i)(authorization:\s*(?:bot|bearer)\s+)\S+"),
]


def redact(text: str, secrets: list[str]) -> str:
    """``text`` with each secret and each token-shaped string replaced by ``[REDACTED]``.

    Secrets shorter than :data:`~bumblebot.core.redaction.MIN_SECRET_CHARS` are not searched
    for; token-shaped strings are caught anyway."""
    for secret in secrets:
        if len(secret) >= MIN_SECRET_CHARS:
            text = text.replace(secret, MARKER)
    for pattern in _PATTERNS:
        text = pattern.sub(lambda m: (m.group(1) if m.groups() else "") + MARKER, text)
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


TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

_conversation: contextvars.ContextVar[str | None] = contextvars.ContextVar("bumblebot_conversation", default=None)
_turn: contextvars.ContextVar[int | str | None] = contextvars.ContextVar("bumblebot_turn", default=None)


@contextlib.contextmanager
def bind(*, conversation: str | None = None, turn: int | str | None = None) -> Iterator[None]:
    """Records logged inside the block (in this task, and in the tasks and threads it starts
    meanwhile) carry ``conversation`` and ``turn`` in the JSON output.

    An argument left ``None`` keeps what an outer :func:`bind` set. Both are restored when
    the block ends.

    Args:
        conversation: the conversation key, e.g. ``telegram:42``.
        turn: the turn id.
    """
    tokens: list[tuple[contextvars.ContextVar[Any], contextvars.Token[Any]]] = []
    if conversation is not None:
        tokens.append((_conversation, _conversation.set(conversation)))
    if turn is not None:
        tokens.append((_turn, _turn.set(turn)))
    try:
        yield
    finally:
        for var, token in reversed(tokens):
            var.reset(token)


def bound() -> dict[str, Any]:
    """What :func:`bind` set here: ``conversation`` and ``turn``, only those that are set."""
    out: dict[str, Any] = {}
    if (conversation := _conversation.get()) is not None:
        out["conversation"] = conversation
    if (turn := _turn.get()) is not None:
        out["turn"] = turn
    return out


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line, with every string redacted.

    Keys, in order: ``time`` (ISO 8601 UTC, milliseconds, ``Z``), ``level``, ``logger``,
    ``message``, then ``conversation`` and ``turn`` when known, ``exception`` when the record
    has ``exc_info``, and ``stack`` when it has ``stack_info``.
    """

    def __init__(self, secrets: list[str]) -> None:
        super().__init__()
        self.secrets = list(secrets)

    def format(self, record: logging.LogRecord) -> str:
        stamp = datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds")
        out: dict[str, Any] = {
            "time": stamp.replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key in ("conversation", "turn"):
            value = getattr(record, key, None)  # given with ``extra=``, else bound here
            if value is None:
                value = bound().get(key)
            if value is not None:
                out[key] = value
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            out["exception"] = record.exc_text
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(redact_values(out, self.secrets), ensure_ascii=False, default=str)


LogFormat = Literal["text", "json"]


def setup_logging(
    level: str,
    secrets: list[str],
    *,
    stream: TextIO | None = None,
    fmt: LogFormat = "text",
    file: Path | None = None,
) -> logging.Handler:
    """Configure the root logger with one redacting handler (replacing an earlier one).

    Args:
        level: the root level (``log_level``).
        secrets: the values to redact (``Secrets.values()``).
        stream: where records go (default: stderr); ignored when ``file`` is given.
        fmt: ``text`` (one line per record) or ``json`` (:class:`JsonFormatter`; ``log_format``).
        file: append the records to this file instead of a stream. Its directory is created
            (``bumblebot chat`` logs to ``<data_dir>/bumblebot.log``, never into the
            conversation).

    Returns:
        the handler installed. A later call removes and closes it.

    Raises:
        ValueError: ``fmt`` is neither ``text`` nor ``json``.
        OSError: ``file`` cannot be created or opened for appending (the error names it).
    """
    if fmt not in ("text", "json"):
        raise ValueError(f"log format must be 'text' or 'json', not {fmt!r}")
    handler: logging.Handler
    if file is not None:
        file.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(file, encoding="utf-8")
    else:
        handler = logging.StreamHandler(stream or sys.stderr)
    root = logging.getLogger()
    for old in list(root.handlers):
        if getattr(old, "_bumblebot", False):
            root.removeHandler(old)
            old.close()  # a file handler closes its file; a stream handler leaves its stream open
    handler.setFormatter(JsonFormatter(secrets) if fmt == "json" else RedactingFormatter(TEXT_FORMAT, secrets))
    handler._bumblebot = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(level)
    for noisy in ("httpx", "httpcore", "httpx2", "httpcore2", "telegram", "discord", "openai", "aiosqlite", "hpack"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLevelName(level)))
    return handler
