"""Bumblebot's exception tree.

::

    BumblebotError
    ├── ConfigError            bad config file or value (exit code 2); carries file, key, expected
    ├── ModelError             the LLM endpoint failed after retries
    │   ├── ModelUnavailable   unreachable, timed out, overloaded (429, 5xx): worth waiting for
    │   │   └── ModelTimeout
    │   ├── ContextTooLong     the endpoint said the prompt is over its context window
    │   └── SpendingLimitReached  a spending limit covers the request: nothing was sent
    ├── AdapterError           a platform call failed
    │   └── DeliveryFailed     a message could not be delivered; ``retryable`` says if it may work later
    ├── StoreError             the database could not be opened or migrated
    ├── DatabaseError          a PostgreSQL statement or connection failed (SQLite's are ``sqlite3.Error``)
    │   └── LeaseLost          a write's worker no longer holds its conversation's lease
    ├── DataDirInUse           another process holds the data directory's lock
    └── MediaError             a file sent could not be fetched, read or transcribed (text for the user)

Foreign errors (``openai``, ``telegram``, ``discord``) are translated into these in exactly one
place per dependency and chained with ``from``: ``bumblebot/llm/completion.py`` (chat completions),
``bumblebot/llm/speech.py`` (transcription and speech), each adapter.

A database error from the store during a turn (:data:`STORE_FAILURES`: ``sqlite3.Error`` on
SQLite, :class:`DatabaseError` on PostgreSQL) is deliberately *not* translated or caught on
the way: it means the turn's own record could not be written (a locked or failing database),
so it is never turned into a tool result or a crash note. It propagates out of the turn, and
the conversation's actor reads the conversation back and resumes it (``actor._recover``).
"""

from __future__ import annotations

import sqlite3


class BumblebotError(Exception):
    """Base of every error Bumblebot raises on purpose."""


class ConfigError(BumblebotError):
    """The configuration is invalid.

    Args:
        source: the file (or ``"environment"``) the bad value came from.
        key: dotted path of the key, e.g. ``"cognition.max_context_tokens"``.
        expected: what a valid value looks like.
    """

    def __init__(self, source: str, key: str, expected: str) -> None:
        self.source, self.key, self.expected = source, key, expected
        super().__init__(f"{source}: {key}: {expected}" if key else f"{source}: {expected}")


class ModelError(BumblebotError):
    """The chat-completions endpoint failed (after the client's own retries)."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        self.status = status
        super().__init__(message)


class ModelUnavailable(ModelError):
    """The endpoint cannot answer for now: connection refused or reset, a timeout, a rate
    limit (429), or a server error (5xx). A turn waits for it (``docs/cognition.md``, "Outages").

    Args:
        retry_after: the endpoint's ``Retry-After`` (RFC 9110 §10.2.3), seconds, when it sent one.
    """

    def __init__(self, message: str, *, status: int | None = None, retry_after: float | None = None) -> None:
        super().__init__(message, status=status)
        self.retry_after = retry_after


class ModelTimeout(ModelUnavailable):
    """The endpoint did not answer within ``llm.timeout_s``."""


class ContextTooLong(ModelError):
    """The endpoint rejected the request because the prompt exceeds its context window.

    ``prompt_tokens``: what the endpoint counted for the prompt, when its message says
    (vLLM and OpenAI: "… you requested 5169 tokens (4145 in the messages, …)"), else ``None``.
    ``window``: the context window it states ("maximum context length is 4096 tokens",
    llama.cpp's ``n_ctx``), else ``None``.
    """

    def __init__(
        self, message: str, *, status: int | None = None, prompt_tokens: int | None = None, window: int | None = None
    ) -> None:
        super().__init__(message, status=status)
        self.prompt_tokens = prompt_tokens
        self.window = window


class SpendingLimitReached(ModelError):
    """A spending limit (``limits``) covers the request; it was not sent.

    Args:
        limit: which limit, in the words a user reads ("your daily limit of 50,000 tokens").
        resets_at: when it resets, epoch seconds.
    """

    def __init__(self, limit: str, *, resets_at: float) -> None:
        super().__init__(f"spending limit reached: {limit}")
        self.limit = limit
        self.resets_at = resets_at

    def resets(self, now: float) -> str:
        """When it resets, as a user reads it: ``"at 00:00 UTC, in 5 h 12 min"``."""
        return f"at 00:00 UTC, in {wait_words(self.resets_at - now)}"


def wait_words(seconds: float) -> str:
    """``"5 h 12 min"``, ``"12 min"``, ``"less than a minute"``."""
    minutes = int(seconds // 60)
    if minutes < 1:
        return "less than a minute"
    hours, minutes = divmod(minutes, 60)
    if not hours:
        return f"{minutes} min"
    return f"{hours} h {minutes} min" if minutes else f"{hours} h"


class AdapterError(BumblebotError):
    """A platform adapter failed."""


class DeliveryFailed(AdapterError):
    """A message could not be delivered.

    Args:
        retryable: ``True`` for transient failures (network, 5xx, rate limit past its wait);
            ``False`` when the platform refused the message for good (forbidden, bad request).
        retry_after: seconds the platform asked to wait (rate limit), if it said.
        chat_unreachable: no message can reach this chat now (the user blocked the bot, the
            chat or channel is gone, no permission to write there).
    """

    def __init__(
        self, message: str, *, retryable: bool, retry_after: float | None = None, chat_unreachable: bool = False
    ) -> None:
        self.retryable = retryable
        self.retry_after = retry_after
        self.chat_unreachable = chat_unreachable
        super().__init__(message)


class StoreError(BumblebotError):
    """The database could not be opened, locked or migrated."""


class DatabaseError(BumblebotError):
    """A statement failed on PostgreSQL, or its connection did (``bumblebot/store/postgres.py``
    translates asyncpg's errors; SQLite's stay ``sqlite3.Error``)."""


class LeaseLost(DatabaseError):
    """A write was refused: its worker no longer holds the conversation's lease with the token
    the write carries (another worker took the conversation over; ``bumblebot/store/leases.py``)."""


#: what a store write can raise on either database: caught where a write may fail
STORE_FAILURES: tuple[type[Exception], ...] = (sqlite3.Error, DatabaseError)


class DataDirInUse(BumblebotError):
    """Another Bumblebot process holds the data directory (one process per data directory).

    Args:
        data_dir: the directory.
        pid: the holder's process id, when it recorded one.
    """

    def __init__(self, data_dir: object, pid: int | None) -> None:
        self.data_dir, self.pid = data_dir, pid
        by = f" by another Bumblebot (pid {pid})" if pid else " by another Bumblebot"
        super().__init__(
            f"data directory {data_dir} is in use{by}; stop that process first, or give this one "
            "another data_dir"
        )


class MediaError(BumblebotError):
    """A file someone sent could not be fetched, read or transcribed, or a file to send could
    not be made. ``str(exc)`` is written for the user ("the file is over the 20 MB limit");
    ``retryable`` is ``True`` when trying again later may work (the platform or the
    transcription endpoint was unreachable)."""

    def __init__(self, message: str, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable
