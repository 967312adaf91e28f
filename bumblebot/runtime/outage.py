"""Waiting out a model endpoint that is down: the backoff between tries, and what this process
saw of an outage across conversations (so a chat is told once, and every waiting turn retries
at once when the endpoint answers again)."""

from __future__ import annotations

import asyncio
import random

OUTAGE_RETRY_FIRST_S = 1.0
OUTAGE_RETRY_MAX_S = 60.0
#: A server's ``Retry-After`` is honoured up to this many seconds (a longer one is a guess).
MAX_RETRY_AFTER_S = 300.0

OUTAGE_NOTICE = (
    "My language model isn't reachable right now. I'll answer as soon as it's back; "
    "no need to send your message again."
)
OUTAGE_GAVE_UP = (
    "I couldn't reach my language model for {waited}, so I couldn't answer your message. "
    "Please send it again later."
)


def outage_delay_s(attempt: int) -> float:
    """Seconds before retry ``attempt`` (1, 2, …): 1, 2, 4 … capped at 60, with 20% jitter so
    conversations do not all retry at the same instant."""
    base = min(OUTAGE_RETRY_MAX_S, OUTAGE_RETRY_FIRST_S * 2 ** (attempt - 1))
    return base * random.uniform(0.8, 1.0)


def duration(seconds: float) -> str:
    """``seconds`` in words for a user: "40 seconds", "12 minutes", "2 hours"."""
    if seconds < 90:
        return f"{max(1, round(seconds))} seconds"
    if seconds < 90 * 60:
        return f"{round(seconds / 60)} minutes"
    return f"{round(seconds / 3600)} hours"


class OutageWatch:
    """What this process saw of the endpoint being down, across conversations (in memory).

    A turn that fails while an outage is already going on counts its wait from the start of
    that outage (or from the start its own state recorded, after a restart), and a conversation
    told once during an outage is not told again by a later turn (messages queued behind a
    suspended turn, ``mid_turn_messages: queue``). When any turn gets an answer again,
    :attr:`recovered` is set so every waiting turn retries at once instead of sleeping out its
    backoff.
    """

    def __init__(self) -> None:
        self.down_since: float | None = None
        self.told: set[str] = set()
        #: set when the endpoint answers after an outage; a new event per outage
        self.recovered = asyncio.Event()

    def failed(self, now: float, since: float | None = None) -> float:
        """The endpoint failed at ``now`` (epoch seconds) for a turn that has been waiting since
        ``since`` (``None``: it just started to); returns when the outage began."""
        start = now if since is None else min(since, now)
        if self.down_since is None:
            self.recovered = asyncio.Event()
            self.down_since = start
        else:
            self.down_since = min(self.down_since, start)
        return self.down_since

    def back(self) -> None:
        """The endpoint answered: the outage (if any) is over."""
        if self.down_since is not None:
            self.recovered.set()
        self.down_since = None
        self.told.clear()
