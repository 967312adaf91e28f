"""Local fake servers (127.0.0.1, port 0) for the real OpenAI and Telegram clients."""

from .openai_server import (
    FakeOpenAI,
    Reply,
    error,
    is_aux,
    is_loop,
    mentions,
    sequence_violation,
    text,
    tool_calls,
)
from .telegram_server import Call, FakeTelegram, bad_request_body, retry_after_body

__all__ = [
    "Call",
    "FakeOpenAI",
    "FakeTelegram",
    "Reply",
    "bad_request_body",
    "error",
    "is_aux",
    "is_loop",
    "mentions",
    "retry_after_body",
    "sequence_violation",
    "text",
    "tool_calls",
]
