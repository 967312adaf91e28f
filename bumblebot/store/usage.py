"""What model requests used: the ``usage`` table, one row per UTC day, conversation, sender,
kind of request, background work or not, endpoint and model, added to as requests are answered.

The day is the UTC date (``2026-12-02``): daily limits reset at 00:00 UTC, as the providers'
own daily counters do. ``conversation`` and ``sender`` are ``""`` for requests outside any
chat (``bumblebot check``). ``cost`` is what the request cost at the prices configured when it
was answered (``llm.prices``); ``priced`` counts the requests a price was known for, so a
report can tell "free" from "not priced".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from bumblebot.core.usage import Scope, Usage
from bumblebot.store.connection import Database


@dataclass(frozen=True, slots=True)
class UsageTotals:
    """Sums over ``usage`` rows."""

    requests: int = 0
    prompt: int = 0
    cached: int = 0
    completion: int = 0
    reasoning: int = 0
    estimated: int = 0
    cost: float = 0.0
    priced: int = 0

    @property
    def tokens(self) -> int:
        return self.prompt + self.completion


_SUMS = (
    "COALESCE(SUM(requests), 0), COALESCE(SUM(prompt_tokens), 0), COALESCE(SUM(cached_tokens), 0),"
    " COALESCE(SUM(completion_tokens), 0), COALESCE(SUM(reasoning_tokens), 0), COALESCE(SUM(estimated), 0),"
    " COALESCE(SUM(cost), 0.0), COALESCE(SUM(priced), 0)"
)


#: What :meth:`UsageTables.usage_by` may group by.
Grouping = Literal["conversation", "sender", "kind", "model", "endpoint", "day"]
_GROUPINGS = frozenset(Grouping.__args__)  # type: ignore[attr-defined]


class UsageTables(Database):
    """The ``usage`` table (part of :class:`bumblebot.store.Store`)."""

    async def add_usage(self, day: str, scope: Scope, usage: Usage, cost: float | None) -> None:
        """Add one answered request to its day's row (``cost`` ``None``: no price known)."""
        await self.write(
            "INSERT INTO usage (day, conversation, sender, kind, background, endpoint, model, requests,"
            " prompt_tokens, cached_tokens, completion_tokens, reasoning_tokens, estimated, audio_seconds,"
            " cost, priced) VALUES (?, ?, ?, ?, ?, ?, ?, 1, ?, ?, ?, ?, ?, ?, ?, ?)"
            " ON CONFLICT (day, conversation, sender, kind, background, endpoint, model) DO UPDATE SET"
            " requests = usage.requests + 1, prompt_tokens = usage.prompt_tokens + excluded.prompt_tokens,"
            " cached_tokens = usage.cached_tokens + excluded.cached_tokens,"
            " completion_tokens = usage.completion_tokens + excluded.completion_tokens,"
            " reasoning_tokens = usage.reasoning_tokens + excluded.reasoning_tokens,"
            " estimated = usage.estimated + excluded.estimated, audio_seconds = usage.audio_seconds + excluded.audio_seconds,"
            " cost = usage.cost + excluded.cost, priced = usage.priced + excluded.priced",
            (
                day, scope.conversation or "", scope.sender or "", scope.kind, int(scope.background),
                usage.endpoint, usage.model, usage.prompt, usage.cached, usage.completion, usage.reasoning,
                int(usage.estimated), usage.seconds, cost or 0.0, int(cost is not None),
            ),
        )

    async def usage_totals(
        self, since_day: str, *, conversation: str | None = None, sender: str | None = None,
        background: bool | None = None,
    ) -> UsageTotals:
        """Sums of the rows from ``since_day`` (inclusive) on, narrowed to a conversation, a
        sender and/or background work when given."""
        where, params = ["day >= ?"], [since_day]
        if conversation is not None:
            where.append("conversation = ?")
            params.append(conversation)
        if sender is not None:
            where.append("sender = ?")
            params.append(sender)
        if background is not None:
            where.append("background = ?")
            params.append(int(background))
        row = await self._one(f"SELECT {_SUMS} FROM usage WHERE {' AND '.join(where)}", tuple(params))
        return UsageTotals(*row) if row is not None else UsageTotals()

    async def usage_by(
        self, grouping: Grouping, since_day: str, *, conversation: str | None = None, limit: int = 10
    ) -> list[tuple[str, UsageTotals]]:
        """Sums of the rows from ``since_day`` on (a range of the primary key, which begins
        with the day), one per value of ``grouping``, the costliest first, then the most tokens;
        at most ``limit`` of them. ``conversation``: only that conversation's rows."""
        if grouping not in _GROUPINGS:
            raise ValueError(f"cannot group usage by {grouping!r}")
        where, params = "day >= ?", [since_day]
        if conversation is not None:
            where += " AND conversation = ?"
            params.append(conversation)
        rows = await self._all(
            f"SELECT {grouping}, {_SUMS} FROM usage WHERE {where} GROUP BY {grouping}"
            " ORDER BY SUM(cost) DESC, SUM(prompt_tokens + completion_tokens) DESC, 1 LIMIT ?",
            (*params, limit),
        )
        return [(str(row[0]), UsageTotals(*row[1:])) for row in rows]
