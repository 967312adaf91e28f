"""A turn's ``[Turn context]`` block (docs/cognition.md, "System prompt and [Turn context]"):
given to the turn's first user message when the turn starts driving, kept when it is retried
or resumed, built again when compaction summarised the blocks it was built against.

* **Whom it is about.** The block names the person the turn's first user message answers (the
  last of the messages it merges, ``TurnState.speaker_entry``), never a message steered into
  the turn later: those go as user messages of their own, after it.
* **Retried or resumed.** A turn retried after an outage, or resumed after a crash or a stop,
  keeps the block its message was sent with, only its Time line brought up to date: a retry
  within the same minute sends the failed request's prefix again, byte for byte. The block is
  built anew only when the active history no longer says a platform or speaker line the block
  leaves out (a compaction was recorded, the block built again after it was not).
* **After a compaction.** When a compaction (or a shrink after a context-length refusal)
  summarised messages that carried blocks, the turn's block is built again against the active
  history left, with the same time: the lines and facts those blocks showed come back in it.
  The current message is the one part of the request this changes, and the compaction broke
  the prefix before it already.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import UTC, datetime

from bumblebot.cognition.prompt import PromptBuilder, TurnInfo
from bumblebot.core.messages import TurnContext
from bumblebot.runtime.conversation import Turn
from bumblebot.store import JournalEntry

#: How a block's Time line begins.
TIME = "Time: "


def utc_now() -> datetime:
    return datetime.now(UTC)


class TurnContexts:
    """Gives turns their ``[Turn context]`` (module docstring).

    Args:
        prompts: renders the blocks.
        clock: the current time, timezone-aware (a test moves it).
    """

    def __init__(self, prompts: PromptBuilder, clock: Callable[[], datetime] = utc_now) -> None:
        self.prompts = prompts
        self.clock = clock

    async def give(self, turn: Turn, level: int) -> Callable[[], Awaitable[None]]:
        """Give ``turn``'s first user message its block as the turn starts driving, at prompt
        ``level`` (recorded with the message). Returns what builds it again against the active
        history, at the same time, after a compaction."""
        info = TurnInfo(inbound=speaker(turn).inbound, route=turn.state.route, now=self.clock(), level=level)
        fresh = self.prompts.context(info, turn.session.history)
        kept = turn.user_message.context
        block = fresh
        if kept is not None and {line for line in fresh.lines if not line.startswith(TIME)} <= set(kept.lines):
            time = self.prompts.time_line(info.now)
            block = TurnContext(tuple(time if line.startswith(TIME) else line for line in kept.lines), kept.facts)
        if block != kept:
            await turn.set_context(block)

        async def rebuild() -> None:
            await turn.set_context(self.prompts.context(info, turn.session.history))

        return rebuild


def speaker(turn: Turn) -> JournalEntry:
    """The journal entry ``turn``'s block is about: the last its first user message answers (for
    a turn saved without it, the first entry, which that message answers in any case)."""
    wanted = turn.state.speaker_entry
    return next((e for e in turn.entries if e.id == wanted), turn.entries[0])
