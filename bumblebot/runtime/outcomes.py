"""What became of a turn, as its conversation's actor hears it: finished, suspended by an
outage, postponed for files a service could not fetch, or sent back to the inbox for a burst."""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
from typing import Any

from bumblebot.runtime.conversation import Turn
from bumblebot.store import JournalEntry


@dataclass(frozen=True, slots=True)
class Finished:
    """The turn is closed. ``rest``: messages taken with its own that it did not answer (a
    spending limit refused only its own senders): back to the head of the inbox, for a turn of
    their own."""

    status: str
    rest: list[JournalEntry] = dataclasses.field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Suspended:
    """The endpoint is down: retry the same turn after ``retry_in`` seconds."""

    turn: Turn
    retry_in: float
    trace: dict[str, Any]
    #: set when the endpoint answers another turn: retry now instead of after ``retry_in``
    recovered: asyncio.Event | None = None


@dataclass(frozen=True, slots=True)
class Postponed:
    """The files of ``entries`` could not be fetched or transcribed for now (the platform or
    the transcription endpoint is down): no turn began; the actor queues them again after
    ``retry_in`` seconds. ``ready``: the messages that were to be answered with them and need
    nothing fetched (text, files already prepared): answered now, without waiting."""

    entries: list[JournalEntry]
    retry_in: float
    ready: list[JournalEntry] = dataclasses.field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Requeued:
    """More messages of a burst came while the turn was prepared (its files, its route): no
    turn began; ``entries`` go back to the head of the inbox and are answered with the rest
    once the burst is over (``cognition.debounce_s``)."""

    entries: list[JournalEntry]


Outcome = Finished | Suspended | Postponed | Requeued
