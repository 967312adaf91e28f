"""Runs compaction for a conversation's session and persists it (spec, "Context compaction").

:mod:`bumblebot.compaction` plans and summarises; this module decides *when*, and the
:class:`~bumblebot.conversation.Session` it acts on records the result (it is the only writer
of history and compaction state). It is called before every completion of a turn (so growth
inside a turn is compacted too) and by ``/compact`` (scheduled as a job of the conversation's
actor). Both run inside the actor, so no turn of the conversation can write its history
meanwhile (field-bugs.md item 10).

Failure policy: if the summary call fails nothing is dropped; the failure is recorded and the
next request retries at once, later failures back off (60 s, 120 s, 240 s … up to an hour,
:func:`backoff_s`). Meanwhile, when the request would overflow, old tool results are pruned
(no LLM call) so the turn can go on.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from bumblebot.budget import ContextBudget
from bumblebot.compaction import compact, find_boundaries, prune_tool_results
from bumblebot.config import HistoryCompression
from bumblebot.conversation import Session
from bumblebot.knowledge import KnowledgeFile
from bumblebot.llm import LLM
from bumblebot.messages import Message

log = logging.getLogger(__name__)

#: A compaction must free at least the window / this (10%) to be worth its LLM calls.
MIN_GAIN_DIVISOR = 10
BACKOFF_BASE_S = 60.0
BACKOFF_MAX_S = 3600.0


def backoff_s(failures: int) -> float:
    """Seconds before the next summary attempt after ``failures`` consecutive failures.

    The first failure is retried on the very next request (often a passing fault); then
    60 s, 120 s, 240 s … capped at an hour.
    """
    if failures <= 1:
        return 0.0
    return min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2 ** (failures - 2))


def estimate(session: Session, fixed_tokens: int, turn_messages: list[Message]) -> int:
    """Estimated prompt tokens: the fixed part, the session (history and summary), the turn."""
    return fixed_tokens + session.tokens + sum(m.tokens for m in turn_messages)


class Compactor:
    """Compaction of sessions.

    Args:
        settings: ``cognition.history_compression``.
        llm: summaries and the memory flush use ``llm.model``.
        knowledge: ``knowledge.md``, for the memory flush.
        budget: the window and threshold in estimated tokens (learned scale applied).
    """

    def __init__(self, settings: HistoryCompression, llm: LLM, knowledge: KnowledgeFile, budget: ContextBudget) -> None:
        self.cfg = settings
        self.llm = llm
        self.knowledge = knowledge
        self.budget = budget

    async def _complete(self, messages: list[dict[str, Any]], max_tokens: int, temperature: float) -> str:
        return await self.llm.text(messages, model=self.llm.model, max_tokens=max_tokens, temperature=temperature)

    async def shrink(self, session: Session, fixed_tokens: int, turn_messages: list[Message]) -> list[dict[str, Any]]:
        """The endpoint refused the prompt as too long: force a compaction, then prune even the
        protected tail's tool outputs. Returns the trace entries of what ran."""
        entries = [await self.maybe_compact(session, fixed_tokens, turn_messages, force=True)]
        entries.append(await self._prune_only(session, fixed_tokens, turn_messages, always=True, everything=True))
        return [e for e in entries if e is not None and (e.get("passes") or e.get("pruned") or e.get("error"))]

    async def maybe_compact(
        self,
        session: Session,
        fixed_tokens: int,
        turn_messages: list[Message],
        *,
        force: bool = False,
    ) -> dict[str, Any] | None:
        """Compact when the request estimate exceeds the threshold (or ``force``).

        Args:
            fixed_tokens: the part of every request compaction cannot shrink (system prompt,
                tool schemas, ``[Turn context]``), estimated tokens.
            turn_messages: the running turn's messages (never compacted).

        Returns a trace entry when something ran, else ``None``.
        """
        if not force and (not self.cfg.enabled or estimate(session, fixed_tokens, turn_messages) <= self.budget.threshold()):
            return None
        state = session.compaction
        fixed = fixed_tokens + sum(m.tokens for m in turn_messages)
        if not force and state.next_retry_at > time.time():
            return await self._prune_only(session, fixed_tokens, turn_messages)
        window = self.budget.window()
        outcome = await compact(
            session.history,
            previous_summary=state.summary,
            complete=self._complete,
            knowledge=self.knowledge if self.cfg.compaction_flush_to_knowledge else None,
            fixed_tokens=fixed,
            max_context_tokens=window,
            threshold_ratio=self.cfg.compaction_threshold_ratio,
            target_ratio=self.cfg.compaction_target_ratio,
            protect_first_n=self.cfg.compaction_protect_first_n,
            protect_last_n=self.cfg.compaction_protect_last_n,
            max_passes=self.cfg.compaction_max_passes,
            flush=self.cfg.compaction_flush_to_knowledge,
            force=force,
            min_gain_tokens=window // MIN_GAIN_DIVISOR,
        )
        failed = outcome.summary_failed and not outcome.covered_ids
        await session.apply_compaction(
            outcome, failed=failed, next_retry_at=time.time() + backoff_s(state.failures + 1) if failed else 0.0
        )
        if outcome.flushed:
            log.info("compaction saved %d fact(s) to knowledge.md", len(outcome.flushed))
        entry = {
            "passes": outcome.passes,
            "covered": len(outcome.covered_ids),
            "pruned": len(outcome.pruned_ids),
            "flushed": outcome.flushed,
            "summary_failed": outcome.summary_failed,
            "error": outcome.error,
            "estimate_before": outcome.estimate_before,
            "estimate_after": outcome.estimate_after,
        }
        if failed and estimate(session, fixed_tokens, turn_messages) > window:
            pruned = await self._prune_only(session, fixed_tokens, turn_messages)
            if pruned:
                entry["pruned"] += pruned["pruned"]
        return entry

    async def _prune_only(
        self,
        session: Session,
        fixed_tokens: int,
        turn_messages: list[Message],
        *,
        always: bool = False,
        everything: bool = False,
    ) -> dict[str, Any] | None:
        """Clear old tool outputs (no LLM call) so the request still fits.

        Used while summaries are backing off (outside the protected tail), and, with
        ``everything``, when the endpoint refused the prompt as too long or ``/compact`` could
        not get under the threshold: then the protected tail's tool outputs go too, because a
        tail that alone overflows would otherwise lock the conversation (field-bugs.md item 12).
        """
        if not always and estimate(session, fixed_tokens, turn_messages) <= self.budget.window():
            return None
        if everything:
            tail_start = len(session.history)
        else:
            _, tail_start = find_boundaries(
                session.history,
                protect_first_n=self.cfg.compaction_protect_first_n,
                protect_last_n=self.cfg.compaction_protect_last_n,
                tail_token_budget=0,
            )
        pruned, indexes = prune_tool_results(session.history, tail_start)
        if not indexes:
            return None
        await session.prune(pruned, [pruned[i].id for i in indexes if pruned[i].id is not None])
        return {"passes": 0, "pruned": len(indexes), "prune_only": True}

    async def force(self, session: Session, fixed_tokens: int) -> str:
        """``/compact``: compact the session now; returns a short report for the user."""
        before = estimate(session, fixed_tokens, [])
        entry = await self.maybe_compact(session, fixed_tokens, [], force=True)
        if estimate(session, fixed_tokens, []) > self.budget.threshold():
            pruned = await self._prune_only(session, fixed_tokens, [], always=True, everything=True)
            if pruned:
                entry = {**(entry or {}), "pruned": (entry or {}).get("pruned", 0) + pruned["pruned"]}
        after = estimate(session, fixed_tokens, [])
        if entry is None or (not entry.get("covered") and not entry.get("pruned")):
            if entry and entry.get("summary_failed"):
                return "Compaction failed (the summary could not be made); nothing was dropped. I'll retry later."
            return f"Nothing to compact yet (~{before} tokens in context)."
        return (
            f"Compacted: ~{before} → ~{after} tokens; {entry.get('covered', 0)} messages summarised, "
            f"{entry.get('pruned', 0)} old tool outputs cleared."
        )
