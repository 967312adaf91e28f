"""``bumblebot usage``: what model requests used and cost, for the operator.

Totals today, over the last 7 and 30 UTC days (and the last ``--days`` when that is another
span), then over the last ``--days`` days (30 by default): the top chats, each model, each kind
of request (turns, automations, autonomous turns, judges, the classifier, summaries,
transcriptions, voice replies). ``--days`` is 1 to :data:`MAX_DAYS`. ``--json`` prints the same as one JSON object. The database is opened
read-only, so it runs safely next to a running daemon.
"""

from __future__ import annotations

import json
import sqlite3
import sys
import time
from dataclasses import dataclass
from typing import Any

from bumblebot.core.errors import DatabaseError
from bumblebot.core.settings import Settings
from bumblebot.runtime.limits import money
from bumblebot.runtime.usage_report import PERIODS, since_day
from bumblebot.store import Store
from bumblebot.store.usage import UsageTotals

#: How many chats ``bumblebot usage`` lists.
TOP_CHATS = 10
#: The longest span ``--days`` may ask for (ten years and a bit).
MAX_DAYS = 3660
#: Rows per breakdown (models and kinds are few; this only bounds a strange database).
MAX_ROWS = 50
COLUMNS = ("requests", "tokens", "prompt", "cached", "completion", "cost")


def _cost(totals: UsageTotals) -> str:
    if totals.priced == 0:
        return "not priced" if totals.requests else "-"
    if totals.priced < totals.requests:
        return f"{money(totals.cost)} ({totals.priced} of {totals.requests} priced)"
    return money(totals.cost)


def _cells(totals: UsageTotals) -> list[str]:
    numbers = (totals.requests, totals.tokens, totals.prompt, totals.cached, totals.completion)
    return [f"{n:,}" for n in numbers] + [_cost(totals)]


def _as_json(totals: UsageTotals) -> dict[str, Any]:
    return {
        "requests": totals.requests, "tokens": totals.tokens, "prompt": totals.prompt, "cached": totals.cached,
        "completion": totals.completion, "reasoning": totals.reasoning, "estimated": totals.estimated,
        "cost": totals.cost if totals.priced else None, "priced": totals.priced,
    }


def _table(title: str, first: str, rows: list[tuple[str, UsageTotals]]) -> list[str]:
    """``rows`` as aligned columns under ``title`` (numbers right-aligned)."""
    body = [[name, *_cells(totals)] for name, totals in rows]
    header = [first, *COLUMNS]
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.ljust(w) if i in (0, len(cells) - 1) else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    return [title, "  " + line(header), *("  " + line(r) for r in body)] if body else [title, "  nothing"]


@dataclass(frozen=True, slots=True)
class Report:
    """What ``bumblebot usage`` shows.

    Attributes:
        today: the UTC day it was made.
        days: the span of the breakdowns (``--days``).
        totals: ``(period, first day, sums)`` for today, 7 and 30 days (and ``days``).
        chats, models, kinds: the breakdowns over ``days``, the costliest first.
    """

    today: str
    days: int
    totals: list[tuple[str, str, UsageTotals]]
    chats: list[tuple[str, UsageTotals]]
    models: list[tuple[str, UsageTotals]]
    kinds: list[tuple[str, UsageTotals]]

    def as_json(self) -> dict[str, Any]:
        return {
            "today": self.today, "days": self.days,
            "totals": [{"period": name, "since": since, **_as_json(t)} for name, since, t in self.totals],
            "chats": [{"chat": key, **_as_json(t)} for key, t in self.chats],
            "models": [{"model": key, **_as_json(t)} for key, t in self.models],
            "kinds": [{"kind": key, **_as_json(t)} for key, t in self.kinds],
        }

    def text(self) -> str:
        """The report as aligned tables."""
        span = f"last {self.days} days" if self.days != 1 else "today"
        lines = [f"Model usage by UTC day (today is {self.today}); tokens are prompt (cached included) plus completion.", ""]
        lines += _table("Totals", "period", [(name, t) for name, _, t in self.totals])
        lines += ["", *_table(f"Top chats, {span}", "chat", [(key or "(outside any chat)", t) for key, t in self.chats])]
        lines += ["", *_table(f"By model, {span}", "model", self.models)]
        lines += ["", *_table(f"By kind of request, {span}", "kind", self.kinds)]
        return "\n".join(lines)


async def report(settings: Settings, days: int, now: float | None = None) -> Report:
    """The report, read from the database opened read-only.

    Raises:
        StoreError: the database cannot be opened.
        sqlite3.Error, DatabaseError: it has no ``usage`` table (written by an older Bumblebot).
    """
    now = time.time() if now is None else now
    periods = list(PERIODS) + ([(f"last {days} days", days)] if days not in (d for _, d in PERIODS) else [])
    since = since_day(now, days)
    async with Store(settings.store_location, readonly=True) as store:
        totals = [(name, since_day(now, n), await store.usage_totals(since_day(now, n))) for name, n in periods]
        chats = await store.usage_by("conversation", since, limit=TOP_CHATS)
        models = await store.usage_by("model", since, limit=MAX_ROWS)
        kinds = await store.usage_by("kind", since, limit=MAX_ROWS)
    return Report(since_day(now, 1), days, totals, chats, models, kinds)


async def run_usage(settings: Settings, days: int, as_json: bool) -> int:
    """``bumblebot usage [--days N] [--json]``; 1 when there is no database to read."""
    if not settings.store_exists():
        print(f"bumblebot: no database at {settings.db_path} yet (nothing has run here)", file=sys.stderr)
        return 1
    try:
        data = await report(settings, days)
    except (sqlite3.OperationalError, DatabaseError) as exc:
        print(f"bumblebot: no usage recorded in {settings.store_shown} yet ({exc}); start the daemon once", file=sys.stderr)
        return 1
    print(json.dumps(data.as_json(), indent=2) if as_json else data.text())
    return 0
