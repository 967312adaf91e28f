"""When a scheduled task is due: the ``when`` of ``schedule_task`` read, and the next due time
computed. Pure functions; the clock is always passed in.

``when`` takes four forms, read in a time zone (the entity's ``timezone``):

* an ISO 8601 date and time, ``2026-12-24T18:00+01:00`` (without an offset: in the time zone);
  once;
* ``in N seconds|minutes|hours|days|weeks`` (``in 90 minutes``, ``in 1 day``); once;
* ``every N seconds|minutes|hours|days|weeks``; recurring, the first time N from now (not
  shorter than the caller's minimum, ``automation.min_interval_s``);
* a 5-field cron expression, ``0 9 * * 1-5`` (minute, hour, day of month, month, day of
  week), read by croniter in the time zone, so "9 o'clock" stays 9 o'clock across daylight
  saving time; recurring.

Errors are :class:`WhenError` with a sentence that tells the model how to write it instead.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from typing import Literal
from zoneinfo import ZoneInfo

from croniter import CroniterBadCronError, CroniterBadDateError, croniter

Kind = Literal["once", "every", "cron"]

#: Longest ``when`` read, characters (a tool argument from the model).
MAX_WHEN_CHARS = 100
#: Furthest ahead a task may be due, days.
MAX_AHEAD_DAYS = 3660
_UNITS = {
    "s": 1, "sec": 1, "secs": 1, "second": 1, "seconds": 1,
    "m": 60, "min": 60, "mins": 60, "minute": 60, "minutes": 60,
    "h": 3600, "hr": 3600, "hrs": 3600, "hour": 3600, "hours": 3600,
    "d": 86400, "day": 86400, "days": 86400,
    "w": 604800, "week": 604800, "weeks": 604800,
}
# anchored, no nested quantifiers, on at most MAX_WHEN_CHARS characters: linear
_RELATIVE = re.compile(r"(in|every)\s+(\d{1,7})\s*([a-z]{1,7})", re.IGNORECASE)
HOW = (
    "write when as an ISO 8601 time with its offset (2026-12-24T18:00+01:00), 'in N minutes' "
    "(or seconds, hours, days, weeks), 'every N hours' for a repeat, or a 5-field cron expression "
    "('0 9 * * 1-5' is 9:00 on weekdays)"
)


class WhenError(ValueError):
    """``when`` could not be read; the message says why and how to write it."""


@dataclass(frozen=True, slots=True)
class When:
    """A read ``when``: its kind, its normalised spec (the interval in seconds for ``every``,
    the expression for ``cron``, the ISO time for ``once``) and its first due time (epoch s)."""

    kind: Kind
    spec: str
    first_due: float

    @property
    def recurring(self) -> bool:
        return self.kind != "once"


def parse_when(text: str, tz: ZoneInfo, now: float, *, min_interval_s: float = 60.0) -> When:
    """Read ``text`` (see the module docstring) at ``now`` (epoch seconds) in ``tz``.

    Raises:
        WhenError: unreadable, in the past, too far ahead, or repeating more often than
            ``min_interval_s``.
    """
    raw = " ".join(text.split())
    if not raw:
        raise WhenError(f"when is empty; {HOW}")
    if len(raw) > MAX_WHEN_CHARS:
        raise WhenError(f"when is too long to be a time; {HOW}")
    relative = _RELATIVE.fullmatch(raw)
    if relative is not None:
        word, number, unit = relative.group(1).lower(), int(relative.group(2)), relative.group(3).lower()
        if unit not in _UNITS:
            raise WhenError(f"unknown unit {unit!r} in {raw!r}; {HOW}")
        seconds = number * _UNITS[unit]
        if seconds <= 0:
            raise WhenError(f"{raw!r} is not in the future; {HOW}")
        if seconds > MAX_AHEAD_DAYS * 86400:
            raise WhenError(f"{raw!r} is more than {MAX_AHEAD_DAYS // 365} years ahead")
        if word == "every":
            if seconds < min_interval_s:
                raise WhenError(f"a task may repeat at most every {min_interval_s:g} seconds, not {raw!r}")
            return _checked(When("every", str(seconds), now + seconds), now)
        return _checked(When("once", _iso(now + seconds, tz), now + seconds), now)
    fields = raw.split(" ")
    if len(fields) == 5:  # an ISO time has at most one space
        return _cron(raw, tz, now, min_interval_s)
    try:
        moment = datetime.fromisoformat(raw.replace(" ", "T", 1) if "T" not in raw and ":" in raw else raw)
    except ValueError:
        raise WhenError(f"cannot read {raw!r} as a time; {HOW}") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=tz)
    due = moment.timestamp()
    if due <= now:
        raise WhenError(f"{raw!r} is in the past (it is now {_iso(now, tz)})")
    return _checked(When("once", moment.isoformat(), due), now)


def next_due(kind: Kind, spec: str, tz: ZoneInfo, after: float) -> float | None:
    """The first due time of a task strictly after ``after`` (epoch s): ``None`` for a task
    that runs once. A task missed while the daemon was down is not run once per missed time:
    the next time is counted from ``after`` (the moment it fired)."""
    if kind == "once":
        return None
    if kind == "every":
        return after + float(spec)
    start = datetime.fromtimestamp(after, tz)
    it = croniter(spec, start)
    wall = start.replace(tzinfo=None, second=0, microsecond=0)
    for _ in range(3):
        candidate = float(it.get_next(float))
        # the autumn night repeats an hour: 02:30 comes twice; cron runs it once
        if datetime.fromtimestamp(candidate, tz).replace(tzinfo=None, second=0, microsecond=0) != wall:
            return candidate
    return candidate


def describe(kind: Kind, spec: str) -> str:
    """A task's schedule in words, for ``/tasks`` and ``list_tasks``."""
    if kind == "once":
        return "once"
    if kind == "every":
        return f"every {_duration(float(spec))}"
    return f"cron {spec}"


def _cron(expression: str, tz: ZoneInfo, now: float, min_interval_s: float) -> When:
    if not croniter.is_valid(expression):
        raise WhenError(f"{expression!r} is not a valid 5-field cron expression; {HOW}")
    try:
        it = croniter(expression, datetime.fromtimestamp(now, tz))
        first = float(it.get_next(float))
        second = float(it.get_next(float))
    except (CroniterBadCronError, CroniterBadDateError, ValueError) as exc:
        raise WhenError(f"{expression!r} never comes due ({exc})") from None
    if second - first < min_interval_s:
        raise WhenError(f"a task may repeat at most every {min_interval_s:g} seconds; {expression!r} repeats more often")
    return _checked(When("cron", expression, first), now)


def _checked(when: When, now: float) -> When:
    if when.first_due - now > MAX_AHEAD_DAYS * 86400:
        raise WhenError(f"that is more than {MAX_AHEAD_DAYS // 365} years ahead")
    return when


def _iso(epoch: float, tz: ZoneInfo) -> str:
    return datetime.fromtimestamp(epoch, tz).isoformat(timespec="seconds")


def _duration(seconds: float) -> str:
    for unit, size in (("week", 604800), ("day", 86400), ("hour", 3600), ("minute", 60)):
        if seconds >= size and seconds % size == 0:
            n = int(seconds // size)
            return f"{n} {unit}{'s' if n != 1 else ''}"
    return f"{seconds:g} seconds"


__all__ = ["HOW", "Kind", "When", "WhenError", "describe", "next_due", "parse_when"]
