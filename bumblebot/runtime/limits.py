"""Spending limits: a model request is refused before it is sent once a daily limit covering it
is reached (``limits`` in the configuration; ``docs/usage.md``).

Four limits, each in tokens and/or in cost, per UTC day (they reset at 00:00 UTC):

* ``sender``: what the turns answering one person used, all chats together (their judges and
  summaries included);
* ``chat``: what one conversation used, its scheduled and autonomous turns included;
* ``background``: what scheduled tasks and autonomous turns used, all chats together;
* ``bot``: everything the bot used.

:meth:`SpendingLimits.admit` runs before every model request (the model client asks its meter,
the meter asks this): it reads the day's sums from the ``usage`` table and raises
:class:`LimitReached` when a limit covering the request's :class:`~bumblebot.core.usage.Scope`
is at or over its ceiling. What a request uses is known only once it was answered, so the
request that crosses a limit is answered and the next one is refused; requests in flight at
the same time may go over by what they use. With no limit set it returns at once.

Who is told: the operator once per limit and day (per person or chat for those limits): a log
warning and, with ``limits.notify_chat``, a message there. The chat once per limit and day:
:meth:`SpendingLimits.notice` gives the text the first time and ``None`` after it, and the turn
runner ends a refused turn with it, or quietly.

Before a turn begins (and before a message is taken into a running turn) each person's messages
are admitted under their own limits (:meth:`SpendingLimits.refused_senders`): those of a person
a limit refuses get a turn of their own that ends with the limit, never an answer inside
someone else's turn. A scheduled or autonomous input a limit refuses gets no turn at all
(:meth:`SpendingLimits.refused`); for a scheduled task the chat is told it did not run
(:func:`task_text`).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from bumblebot.core.errors import SpendingLimitReached
from bumblebot.core.events import ChatRef
from bumblebot.core.settings import LimitsSettings, Settings
from bumblebot.core.usage import Scope
from bumblebot.store import JournalEntry, Store, TaskRecord
from bumblebot.store.usage import UsageTotals

log = logging.getLogger(__name__)

DAY_S = 86400.0
#: ``kv``: the limits the operator was told of today (``{"day": …, "keys": […]}``).
NOTIFIED_KEY = "limits.notified"
#: ``kv``: the limits a conversation was told of today.
TOLD_KEY = "limits.told:{conversation}"
#: The limits in the order a request is checked against them: the narrowest first, so a person
#: hears of their own limit before the chat's or the bot's.
ORDER = ("sender", "chat", "background", "bot")
#: What the user reads of each limit (``{what}``: "limit of 50,000 tokens", "spending limit of 2.00").
WHOSE = {
    "sender": "your daily {what}",
    "chat": "this chat's daily {what}",
    "background": "the daily {what} for scheduled and autonomous work",
    "bot": "the daily {what} for all chats together",
}
LIMIT_TEXT = "A spending limit stops me here: {limit} has been reached. It resets {resets}."
#: Added to :data:`LIMIT_TEXT` for a scheduled task that did not run.
TASK_NOT_RUN = "So scheduled task #{id} did not run: {text}"
#: Characters of a task's text the chat is shown when it did not run.
TASK_TEXT_CHARS = 300


def utc_day(now: float) -> str:
    """The UTC date of epoch seconds ``now`` (``2026-12-02``), as the ``usage`` table keys days."""
    return datetime.fromtimestamp(now, UTC).strftime("%Y-%m-%d")


def next_midnight(now: float) -> float:
    """The next 00:00 UTC after ``now``, epoch seconds (POSIX days are 86,400 s long)."""
    return (math.floor(now / DAY_S) + 1) * DAY_S


def money(value: float) -> str:
    """A cost in the currency of ``llm.prices``: ``2.00``, ``0.35``, ``0.0042``."""
    return f"{value:,.2f}" if value >= 0.01 or value == 0 else f"{value:.4f}"


class LimitReached(SpendingLimitReached):
    """A limit of :class:`SpendingLimits` refused a request.

    Args:
        limit: the words a user reads.
        resets_at: the next 00:00 UTC, epoch seconds.
        key: which limit, and whom it covers (``sender:42/tokens``, ``chat:telegram:5/cost``,
            ``bot/tokens``): what "once a day" is counted by.
        setting: the configuration key (``limits.sender_daily_tokens``).
        ceiling: the configured value, as the operator reads it.
        subject: whom it covers, as the operator reads it ("person 42 (telegram:42)").
    """

    def __init__(self, limit: str, *, resets_at: float, key: str, setting: str, ceiling: str, subject: str) -> None:
        super().__init__(limit, resets_at=resets_at)
        self.key, self.setting, self.ceiling, self.subject = key, setting, ceiling, subject


@dataclass(frozen=True, slots=True)
class Limit:
    """One of the four limits, as configured."""

    name: str
    tokens: int | None
    cost: float | None

    def covers(self, scope: Scope) -> bool:
        if self.name == "sender":
            return bool(scope.sender)
        if self.name == "chat":
            return bool(scope.conversation)
        if self.name == "background":
            return scope.background
        return True

    def reached(self, totals: UsageTotals) -> str | None:
        """``"tokens"`` or ``"cost"`` when ``totals`` are at or over that ceiling, else ``None``."""
        if self.tokens is not None and totals.tokens >= self.tokens:
            return "tokens"
        if self.cost is not None and totals.cost >= self.cost:
            return "cost"
        return None

    def ceiling(self, unit: str) -> str:
        return f"{self.tokens:,} tokens" if unit == "tokens" else money(self.cost or 0.0)

    def words(self, unit: str) -> str:
        what = f"limit of {self.ceiling(unit)}" if unit == "tokens" else f"spending limit of {self.ceiling(unit)}"
        return WHOSE[self.name].format(what=what)


def configured(settings: LimitsSettings) -> list[Limit]:
    """The limits ``settings`` set, in :data:`ORDER`."""
    out = []
    for name in ORDER:
        tokens, cost = getattr(settings, f"{name}_daily_tokens"), getattr(settings, f"{name}_daily_cost")
        if tokens is not None or cost is not None:
            out.append(Limit(name, tokens, cost))
    return out


class SpendingLimits:
    """The daily spending limits, checked before each model request.

    Args:
        settings: the ``limits`` section.
        store: where the day's sums are read and who was told is remembered.
        reply: sends a text to a chat outside any turn (``Engine.reply``), for
            ``limits.notify_chat``; may be set after construction (the engine is built later).
        clock: epoch seconds (tests pass one).
    """

    def __init__(
        self, settings: LimitsSettings, store: Store, *,
        reply: Callable[[ChatRef, str], Awaitable[None]] | None = None, clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.limits = configured(settings)
        self.reply = reply
        self._store = store
        self._clock = clock
        self._notified: tuple[str, set[str]] = ("", set())  # the day, and the limits the operator was told of

    async def admit(self, scope: Scope, model: str) -> None:
        """Return when no limit covering ``scope`` is reached today.

        Raises:
            LimitReached: one is (the first in :data:`ORDER`); nothing may be sent.
        """
        if not self.limits:
            return
        now = self._clock()
        day = utc_day(now)
        for limit in self.limits:
            if not limit.covers(scope):
                continue
            unit = limit.reached(await self._totals(limit, scope, day))
            if unit is None:
                continue
            refusal = self._refusal(limit, unit, scope, now)
            await self._tell_operator(refusal, day)
            raise refusal

    async def refused(self, scope: Scope) -> LimitReached | None:
        """The refusal a request for ``scope`` would meet now (the operator is told as by
        :meth:`admit`), ``None`` when it would be admitted."""
        try:
            await self.admit(scope, "")
        except LimitReached as exc:
            return exc
        return None

    async def refused_senders(self, conversation: str, entries: Sequence[JournalEntry]) -> dict[str, LimitReached]:
        """The people among the senders of ``entries`` whose messages a limit refuses now, each
        with the refusal: every message is admitted under its own sender's limit (and the
        chat's and the bot's), not under the limit of whoever else it is answered with.
        Scheduled and autonomous entries are not people's: left out."""
        if not self.limits:
            return {}
        out = {}
        for sender in dict.fromkeys(e.inbound.sender_id for e in entries if e.inbound.source == "chat"):
            refusal = await self.refused(Scope(conversation=conversation, sender=sender, kind="turn"))
            if refusal is not None:
                out[sender] = refusal
        return out

    async def _totals(self, limit: Limit, scope: Scope, day: str) -> UsageTotals:
        if limit.name == "sender":
            return await self._store.usage_totals(day, sender=scope.sender)
        if limit.name == "chat":
            return await self._store.usage_totals(day, conversation=scope.conversation)
        if limit.name == "background":
            return await self._store.usage_totals(day, background=True)
        return await self._store.usage_totals(day)

    @staticmethod
    def _refusal(limit: Limit, unit: str, scope: Scope, now: float) -> LimitReached:
        subject = {
            "sender": f"sender:{scope.sender}", "chat": f"chat:{scope.conversation}",
        }.get(limit.name, limit.name)
        readable = {
            "sender": f"person {scope.sender} (writing in {scope.conversation})",
            "chat": str(scope.conversation), "background": "scheduled and autonomous work", "bot": "the whole bot",
        }[limit.name]
        return LimitReached(
            limit.words(unit), resets_at=next_midnight(now), key=f"{subject}/{unit}",
            setting=f"limits.{limit.name}_daily_{unit}", ceiling=limit.ceiling(unit), subject=readable,
        )

    async def _tell_operator(self, refusal: LimitReached, day: str) -> None:
        """Once per limit and day: a log warning and, with ``limits.notify_chat``, a message there.
        Marked before it is said: a crash costs the notice, never doubles it."""
        if self._notified[0] != day:
            self._notified = (day, set())
        if refusal.key in self._notified[1]:
            return
        self._notified[1].add(refusal.key)  # before any await: two requests refused at once tell once
        if not await self._first(NOTIFIED_KEY, day, refusal.key):
            return  # told before a restart
        text = (
            f"Spending limit reached: {refusal.setting} ({refusal.ceiling}) for {refusal.subject}. "
            "Requests it covers are refused until 00:00 UTC."
        )
        log.warning("%s", text)
        if self.settings.notify_chat is None or self.reply is None:
            return
        try:
            await self.reply(ChatRef.from_key(self.settings.notify_chat), text)
        except Exception:  # the refusal stands whether or not the operator could be told
            log.exception("could not tell %s that a spending limit was reached", self.settings.notify_chat)

    async def notice(self, conversation: str, refusal: SpendingLimitReached) -> str | None:
        """What to tell ``conversation`` of ``refusal``: the limit and when it resets, the first
        time today it meets that limit; ``None`` after that (the chat knows already)."""
        now = self._clock()
        key = refusal.key if isinstance(refusal, LimitReached) else refusal.limit
        if not await self._first(TOLD_KEY.format(conversation=conversation), utc_day(now), key):
            return None
        return limit_text(refusal, now)

    async def notices(self, conversation: str, refusals: Iterable[SpendingLimitReached]) -> str | None:
        """:meth:`notice` of each of ``refusals`` (the people of one burst may meet different
        limits), each text once; ``None`` when the chat knows them all already."""
        texts = [await self.notice(conversation, refusal) for refusal in refusals]
        return "\n".join(dict.fromkeys(t for t in texts if t)) or None

    async def tell_task(self, chat: ChatRef, refusal: SpendingLimitReached, task: TaskRecord) -> None:
        """Scheduled task ``task`` did not run, ``refusal`` kept it from it: the chat is told, with
        the task's text (:func:`task_text`; a reminder's words still reach it), outside any turn
        and not in the history. A one-shot task every time (what it was to do is lost
        otherwise); a repeating one, which runs again at its next time, once a day per limit,
        as a refused turn is."""
        first = await self.notice(chat.key, refusal) is not None
        if (first or task.kind == "once") and self.reply is not None:
            await self.reply(chat, task_text(refusal, task.id, task.text, self._clock()))

    async def _first(self, kv_key: str, day: str, mark: str) -> bool:
        """Whether ``mark`` is new today under ``kv_key`` (then it is added)."""
        raw = await self._store.get_kv(kv_key)
        seen: dict[str, Any] = {}
        if raw:
            try:
                seen = json.loads(raw)
            except ValueError:
                seen = {}
        marks = list(seen.get("keys", [])) if seen.get("day") == day else []
        if mark in marks:
            return False
        await self._store.set_kv(kv_key, json.dumps({"day": day, "keys": [*marks, mark]}))
        return True


def limit_text(refusal: SpendingLimitReached, now: float) -> str:
    """The message a chat gets: which limit, and when it resets."""
    return LIMIT_TEXT.format(limit=refusal.limit, resets=refusal.resets(now))


def task_text(refusal: SpendingLimitReached, task_id: int, text: str, now: float) -> str:
    """The message a chat gets for a scheduled task a limit kept from running: the limit, when
    it resets, and the task's text (a reminder's words still reach the chat)."""
    words = " ".join(text.split())
    if len(words) > TASK_TEXT_CHARS:
        words = words[: TASK_TEXT_CHARS - 1] + "…"
    return f"{limit_text(refusal, now)} {TASK_NOT_RUN.format(id=task_id, text=words)}"


def check_lines(settings: Settings) -> list[str]:
    """What ``bumblebot check`` says of the limits: each one set, and a warning for cost limits
    while a configured model has no price (its requests would count as costing nothing)."""
    limits = configured(settings.limits)
    if not limits:
        return ["none set"]
    parts = []
    for limit in limits:
        ceilings = [limit.ceiling(u) for u, v in (("tokens", limit.tokens), ("cost", limit.cost)) if v is not None]
        parts.append(f"{limit.name} {' or '.join(ceilings)} a day")
    lines = ["; ".join(parts) + " (reset at 00:00 UTC)"]
    if any(limit.cost is not None for limit in limits):
        llm = settings.llm
        named = [llm.model, llm.reflex_model, llm.background_model]
        named += [m for f in llm.fallbacks for m in (f.model, f.reflex_model)]
        models = dict.fromkeys(m for m in named if m)
        prices = llm.prices
        unpriced = [m for m in models if m not in prices]
        if unpriced:
            lines.append(
                f"WARNING: cost limits are set but {', '.join(unpriced)} has no price in llm.prices: "
                "its requests count as costing nothing"
            )
    return lines
