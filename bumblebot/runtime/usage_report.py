"""What model requests used, told in words: the answer to ``/usage`` in a chat.

``/usage`` shows the chat's requests, tokens and cost today, over the last 7 and the last 30
UTC days (today included), read from the ``usage`` table. In a private chat it is the chat's;
in a group (or a guild channel, a topic) the chat's managers see the whole chat's, everyone
else their own there. Cost is shown when the requests had a price (``llm.prices``), "not
priced" otherwise. ``bumblebot usage`` (:mod:`bumblebot.app.usage`) is the operator's view.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from bumblebot.core.events import ChatKind, Inbound
from bumblebot.runtime.limits import money
from bumblebot.store import Store
from bumblebot.store.usage import UsageTotals

#: The periods ``/usage`` shows: their name and how many UTC days they span (today included).
PERIODS = (("today", 1), ("last 7 days", 7), ("last 30 days", 30))


def since_day(now: float, days: int) -> str:
    """The first UTC day of the ``days`` days ending today (``days=1``: today)."""
    return (datetime.fromtimestamp(now, UTC).date() - timedelta(days=days - 1)).isoformat()


def cost_words(totals: UsageTotals) -> str:
    """``"cost 0.42"``, ``"cost 0.42 (3 of 5 requests priced)"``, or ``"not priced"``."""
    if totals.priced == 0:
        return "not priced"
    cost = money(totals.cost)
    if totals.priced < totals.requests:
        return f"cost {cost} ({totals.priced} of {totals.requests} requests priced)"
    return f"cost {cost}"


def totals_words(totals: UsageTotals) -> str:
    """One period in words: requests, tokens (prompt, of them cached, completion) and cost."""
    if totals.requests == 0:
        return "nothing"
    requests = f"{totals.requests:,} request{'s' if totals.requests != 1 else ''}"
    cached = f", {totals.cached:,} of them cached" if totals.cached else ""
    tokens = f"{totals.tokens:,} tokens ({totals.prompt:,} prompt{cached}; {totals.completion:,} completion)"
    return f"{requests}, {tokens}; {cost_words(totals)}"


class UsageReport:
    """Answers ``/usage`` (the engine binds :meth:`command` to it).

    Args:
        store: the database, whose ``usage`` table it reads.
        clock: epoch seconds (tests pass one).
    """

    def __init__(self, store: Store, clock: Callable[[], float] = time.time) -> None:
        self._store = store
        self._clock = clock

    async def command(self, inbound: Inbound, journal_id: int, manager: bool) -> str:
        """The chat's usage, or in a shared chat the sender's own unless they manage it."""
        key = inbound.chat.key
        shared = inbound.chat_kind is not ChatKind.PRIVATE
        sender = inbound.sender_id if shared and not manager else None
        if sender is not None:
            title = "Your usage in this chat (UTC days):"
        elif shared:
            title = "Usage of this chat, everyone in it (UTC days):"
        else:
            title = "Usage of this chat (UTC days):"
        now = self._clock()
        lines = [title]
        for name, days in PERIODS:
            totals = await self._store.usage_totals(since_day(now, days), conversation=key, sender=sender)
            lines.append(f"{name}: {totals_words(totals)}")
        return "\n".join(lines)
