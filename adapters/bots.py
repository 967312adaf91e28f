"""A brake on answering other bots, shared by the platform adapters: two bots allowed to
answer bots would otherwise answer each other for ever."""

from __future__ import annotations

import time
from collections import deque

__all__ = ["BotTurnBudget"]


class BotTurnBudget:
    """At most ``limit`` bot-authored messages answered per channel within ``window_s`` seconds.

    A brake for ``allow_bots``: two bots told to talk to each other stop after a few rounds.
    Memory is bounded by the number of channels that saw bot traffic.
    """

    def __init__(self, limit: int = 5, window_s: float = 60.0) -> None:
        self.limit = limit
        self.window_s = window_s
        self._seen: dict[str, deque[float]] = {}

    def allow(self, channel_key: str, now: float | None = None) -> bool:
        """Record one bot message in ``channel_key``; ``False`` when the budget is spent."""
        now = time.monotonic() if now is None else now
        times = self._seen.setdefault(channel_key, deque())
        while times and now - times[0] >= self.window_s:
            times.popleft()
        if len(times) >= self.limit:
            return False
        times.append(now)
        return True
