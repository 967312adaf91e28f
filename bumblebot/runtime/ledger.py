"""The daemon's meter: :class:`Ledger` counts what every model request used and cost, and asks
the spending limits before each one (:class:`~bumblebot.core.usage.Meter`).

Each answered request (a turn's step, a judge, the classifier, a summary, a transcription) is
added to its UTC day's row of the ``usage`` table, under the conversation, sender and kind of
its :class:`~bumblebot.core.usage.Scope` and the endpoint and model that answered, with its cost
at ``llm.prices`` (:mod:`bumblebot.core.prices`); and counted in the Prometheus series
``bumblebot_model_tokens_total``, ``bumblebot_model_cost_total`` and
``bumblebot_audio_seconds_total`` (labelled by model and kind, never by conversation).

The write is part of the turn like any other: a database error is not caught here. It
propagates out of the turn, and the conversation's actor reads the conversation back and
resumes it, as after any failed write of a turn (``bumblebot/core/errors.py``).

Whom a turn's requests are for is set where the turn starts (:func:`turn_scope`, by the
``TurnRunner``); a message from another person taken into the running turn makes its later
requests theirs (``TurnIO.take_steering``); judges, the classifier, summaries, transcriptions
and voice replies narrow only its kind. What the requests of a block used is collected for the
turn's trace where it asks (:func:`~bumblebot.core.usage.tallied`: a judge's, the classifier's,
a compaction's).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Protocol

from bumblebot.core.metrics import NO_METRICS, Metrics
from bumblebot.core.prices import ModelPrice, cost_of
from bumblebot.core.usage import BACKGROUND_KINDS, Scope, Usage, awaited, scoped, tally
from bumblebot.store import JournalEntry, Store


class Limits(Protocol):
    """The spending limits the ledger asks before each request."""

    async def admit(self, scope: Scope, model: str) -> None:
        """Raises ``SpendingLimitReached`` when a limit covering ``scope`` is reached."""


class Ledger:
    """Counts and prices model requests; the spending limits admit them.

    Args:
        store: where each request is added (``usage``).
        prices: ``llm.prices``: each model's price.
        metrics: where tokens and cost are counted; default: not counted.
        limits: asked before each request (may raise ``SpendingLimitReached``); ``None``: no
            limit.
        currency: ``llm.currency``, the ``currency`` label of the cost counter.
        clock: the wall clock, epoch seconds (the UTC day a request is counted on).
    """

    def __init__(
        self,
        store: Store,
        prices: Mapping[str, ModelPrice],
        metrics: Metrics = NO_METRICS,
        limits: Limits | None = None,
        *,
        currency: str = "USD",
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.prices = prices
        self.metrics = metrics
        self.limits = limits
        self.currency = currency
        self.clock = clock

    async def admit(self, scope: Scope, model: str) -> None:
        """Before a request: the limits' say, when there are limits.

        Raises:
            SpendingLimitReached: a limit covering ``scope`` is reached.
        """
        if self.limits is not None:
            await self.limits.admit(scope, model)

    async def record(self, scope: Scope, usage: Usage) -> float | None:
        """An answered request: counted, priced and added to its day's row; returns its cost
        (``None``: its model has no price).

        Raises:
            sqlite3.Error, DatabaseError: the row could not be written.
        """
        cost = cost_of(self.prices, usage)
        self.metrics.model_usage(scope.kind, usage, cost, self.currency)
        await self.store.add_usage(utc_day(self.clock()), scope, usage, cost)
        tally(usage, cost)
        return cost


def utc_day(epoch: float) -> str:
    """The UTC date of ``epoch`` (``2026-12-02``): the day a request is counted on."""
    return time.strftime("%Y-%m-%d", time.gmtime(epoch))


@contextmanager
def turn_scope(conversation: str, entries: Sequence[JournalEntry]) -> Iterator[Scope]:
    """Run the block as the turn answering ``entries`` in ``conversation``: a person's turn is
    kind ``turn`` for the sender of its last message (the one it answers), a scheduled or
    autonomous one is background work of that kind, for nobody."""
    source = entries[0].inbound.source if entries else "chat"
    if source in BACKGROUND_KINDS:
        with scoped(conversation=conversation, sender=None, kind=source, background=True) as scope:
            yield scope
        return
    sender = next((e.inbound.sender_id for e in reversed(entries) if e.inbound.source == "chat"), None)
    with scoped(conversation=conversation, sender=sender, kind="turn", background=False) as scope, \
            awaited(conversation):
        yield scope
