"""Runs compaction for a conversation's session and persists it (docs/compaction.md).

:mod:`bumblebot.cognition.compaction` plans and summarises; this module decides *when*, and the
:class:`~bumblebot.runtime.conversation.Session` it acts on records the result (it is the only writer
of history and compaction state). It is called before every completion of a turn (so growth
inside a turn is compacted too; not before a waiting person's first words while the request
still fits), between turns, and by ``/compact`` (scheduled as a job of the conversation's
actor). All run inside the actor, so no turn of the conversation can write its history
meanwhile (a message added while the middle is being summarised would be lost with it).

Failure policy: if the summary call fails nothing is dropped; the failure is recorded and the
next request retries at once, its flush reading only messages the failed run's did not;
when the model then answers with an unusable summary again the messages are summarised
extractively; a failure that covered nothing backs off (60 s, 120 s,
240 s … up to an hour, :func:`backoff_s`). Meanwhile, when the request would overflow, old
tool results are pruned (no LLM call) so the turn can go on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import Any

from bumblebot.cognition.budget import ContextBudget
from bumblebot.cognition.compaction import (
    CLIP_CALL_TOKENS,
    PLACEHOLDER,
    CompactionOutcome,
    compact,
    find_boundaries,
    prune_tool_results,
)
from bumblebot.cognition.history import History, Transcript
from bumblebot.cognition.knowledge import Memory
from bumblebot.cognition.trace import requests_usage
from bumblebot.core.messages import Message
from bumblebot.core.settings import HistoryCompression
from bumblebot.llm import Endpoints
from bumblebot.core.usage import GaveUp, scoped, tallied

log = logging.getLogger(__name__)

#: The protected tail takes at most this share of a request (small windows, long messages).
TAIL_SHARE = 0.4
MIN_TAIL = 2
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


def estimate(session: History, fixed_tokens: int, turn_messages: list[Message]) -> int:
    """Estimated prompt tokens: the fixed part, the session (history and summary), the turn."""
    return fixed_tokens + session.tokens + sum(m.tokens for m in turn_messages)


class Compactor:
    """Compaction of sessions.

    Args:
        settings: ``cognition.history_compression``.
        llm: summaries and the memory flush use ``llm.model``.
        memory: where the memory flush writes (the conversation's own facts, never the global
            ``knowledge.md``, which every conversation reads: a fact learned in one chat is
            private to it).
        budget: the window and threshold in estimated tokens (learned scale applied).
    """

    def __init__(self, settings: HistoryCompression, llm: Endpoints, memory: Memory, budget: ContextBudget) -> None:
        self.cfg = settings
        self.llm = llm
        self.memory = memory
        self.budget = budget
        #: per session key, the newest message id a flush has read (lost on restart: the next
        #: run then flushes those messages again, and the titles dedupe what it finds)
        self._flushed: dict[str, int] = {}

    async def _complete(self, messages: list[dict[str, Any]], max_tokens: int, temperature: float) -> str:
        with scoped(kind="summary"):  # counted for the conversation as a summary, background or not
            return await self.llm.text(messages, model=self.llm.model, max_tokens=max_tokens, temperature=temperature)

    async def shrink(
        self, session: History, fixed_tokens: int, turn_messages: list[Message], *, reply_tokens: int | None = None
    ) -> list[dict[str, Any]]:
        """The endpoint refused the prompt as too long: force a compaction, then prune even the
        protected tail's tool outputs. Returns the trace entries of what ran."""
        entries = [await self.maybe_compact(
            session, fixed_tokens, turn_messages, force=True, emergency=True, reply_tokens=reply_tokens
        )]
        entries.append(
            await self._prune_only(session, fixed_tokens, turn_messages, always=True, everything=True, reply_tokens=reply_tokens)
        )
        return [e for e in entries if e is not None and (e.get("passes") or e.get("pruned") or e.get("error"))]

    async def maybe_compact(
        self,
        session: History,
        fixed_tokens: int,
        turn_messages: list[Message],
        *,
        force: bool = False,
        emergency: bool = False,
        reply_tokens: int | None = None,
        defer: bool = False,
        interrupt: asyncio.Event | None = None,
    ) -> dict[str, Any] | None:
        """Compact when the request estimate exceeds the threshold (or ``force``).

        Args:
            fixed_tokens: the part of every request compaction cannot shrink (system prompt,
                tool schemas), estimated tokens.
            turn_messages: the running turn's messages (never compacted).
            reply_tokens: the turn's completion budget (default: the largest a turn asks for).
            defer: a person waits for the turn's first words: over the threshold, nothing runs
                while the request still fits the window (the next request after the first
                words compacts; docs/compaction.md, "When compaction triggers").
            interrupt: between turns: once it is set (a message came), the run stops before
                its next model call (one already sent is answered first; one still waiting for
                a slot is given up, the caller's :func:`~bumblebot.core.usage.unless`) and
                writes nothing unless an earlier pass covered messages (facts already flushed
                stay).

        Returns a trace entry when something ran, else ``None``.
        """
        if not force and (not self.cfg.enabled or estimate(session, fixed_tokens, turn_messages) <= self.budget.threshold(reply_tokens)):
            return None
        if defer and not force and estimate(session, fixed_tokens, turn_messages) <= self.budget.limit(reply_tokens):
            return None
        state = session.compaction
        fixed = fixed_tokens + sum(m.tokens for m in turn_messages)
        if not force and state.next_retry_at > time.time():
            return await self._prune_only(session, fixed_tokens, turn_messages, reply_tokens=reply_tokens)
        with tallied() as used:  # its summaries' requests, for the trace
            try:
                outcome = await self._compact(session, fixed, force, emergency, reply_tokens, interrupt)
            except GaveUp:  # its request still waited for a slot when the message came: never sent
                return None
        if outcome.flushed_through is not None:
            self._flushed[session.key] = outcome.flushed_through
        if outcome.interrupted and not outcome.covered_ids:
            return None
        failed = outcome.summary_failed and not outcome.covered_ids
        if outcome.passes or outcome.covered_ids or outcome.pruned_ids or outcome.flushed or failed:
            # a run that changed nothing writes nothing (and keeps a summary failure's backoff)
            await session.apply_compaction(
                outcome, failed=failed, next_retry_at=time.time() + backoff_s(state.failures + 1) if failed else 0.0
            )
        if outcome.flushed:
            log.info("compaction saved %d fact(s) to knowledge.md", len(outcome.flushed))
        entry = _trace_entry(outcome)
        if used:
            entry["usage"] = requests_usage(used)
        if failed and estimate(session, fixed_tokens, turn_messages) > self.budget.limit(reply_tokens):
            pruned = await self._prune_only(session, fixed_tokens, turn_messages, reply_tokens=reply_tokens)
            if pruned:
                entry["pruned"] += pruned["pruned"]
        if not force and not outcome.summary_failed and estimate(session, fixed_tokens, turn_messages) > self.budget.limit(reply_tokens):
            # the protected head and tail left too little to summarise: one forced pass (a
            # failed summary instead keeps every message and backs off: docs/compaction.md, "Failure policy")
            again = await self.maybe_compact(
                session, fixed_tokens, turn_messages, force=True, emergency=True, reply_tokens=reply_tokens,
                interrupt=interrupt,
            )
            if again is not None:
                entry["forced"] = again
        return entry

    def _compact(
        self, session: History, fixed: int, force: bool, emergency: bool, reply_tokens: int | None,
        interrupt: asyncio.Event | None,
    ) -> Awaitable[CompactionOutcome]:
        """The :func:`~bumblebot.cognition.compaction.compact` run of :meth:`maybe_compact`
        (``fixed``: the fixed part and the turn's messages, tokens)."""
        state = session.compaction
        window, limit = self.budget.window(), self.budget.limit(reply_tokens)  # limit: the reply budget left out
        # ``emergency`` (refused, or still over the request limit after a normal pass): no
        # protected tail, or a small window with long messages leaves no middle to summarise
        # and the chat dies; the turn's own messages stay as they are. ``/compact`` forces a
        # pass with the usual boundaries.
        return compact(
            session.history,
            previous_summary=state.summary,
            complete=self._complete,
            knowledge=self.memory.of(session.key) if self.cfg.compaction_flush_to_knowledge else None,
            fixed_tokens=fixed,
            max_context_tokens=window,
            threshold_ratio=self.cfg.compaction_threshold_ratio,
            target_ratio=self._target_ratio(fixed, window, limit),
            # the head stays: the summary is rendered right after it (``Requests``)
            protect_first_n=self.cfg.compaction_protect_first_n,
            protect_last_n=0 if emergency else self._protected_tail(session.history, limit),
            max_passes=self.cfg.compaction_max_passes,
            flush=self.cfg.compaction_flush_to_knowledge,
            # what an earlier run's flush read (its summary failed, or it was interrupted) is
            # not read again
            flushed_through=self._flushed.get(session.key),
            # the summary failed before: an unusable one this time is taken as final
            extract_on_failure=state.failures > 0,
            interrupted=None if interrupt is None else interrupt.is_set,
            force=force,
            min_gain_tokens=window // MIN_GAIN_DIVISOR,
            request_limit=limit,
            threshold_tokens=self.budget.threshold(reply_tokens),  # the one that decided to come here
        )

    def _target_ratio(self, fixed: int, window: int, limit: int) -> float:
        """``compaction_target_ratio``, or in a small window, where the fixed part alone can
        exceed that share, the same share of the room left after it (else every compaction
        runs all its passes)."""
        ratio = self.cfg.compaction_target_ratio
        if fixed >= window * ratio:
            return (fixed + (limit - fixed) * ratio) / window
        return ratio

    def _protected_tail(self, history: list[Message], limit: int) -> int:
        """``compaction_protect_last_n``, unless those messages alone would take more than
        :data:`TAIL_SHARE` of the request limit (a small window with long messages): then as
        many recent messages as fit in it, at least :data:`MIN_TAIL` (the last exchange)."""
        n = self.cfg.compaction_protect_last_n
        room, used, count = int(limit * TAIL_SHARE), 0, 0
        for m in reversed(history[-n:] if n else []):
            used += m.tokens
            if used > room:
                break
            count += 1
        return n if count >= n else max(MIN_TAIL, count)

    async def fit_turn(
        self, session: History, fixed_tokens: int, turn: Transcript, *, force: bool = False, reply_tokens: int | None = None
    ) -> dict[str, Any] | None:
        """Growth inside a turn: when the request is still over the threshold after
        the history was compacted, the turn's own older tool results (all but the latest
        step's) are cleared to the placeholder, oldest first, until it fits; if it still does
        not fit the window, the history's tool outputs go too. The latest step's results are
        already capped together (``cognition.max_tool_result_share``). ``force`` (the endpoint
        refused the prompt as too long) clears every older result of the turn. When clearing
        results is not enough, the long arguments of older steps' tool calls are shown cut
        (``Message.with_clipped_calls``, recorded as ``pruned``)."""
        if not force and estimate(session, fixed_tokens, turn.transcript) <= self.budget.threshold(reply_tokens):
            return None
        transcript = list(turn.transcript)
        latest = len(transcript)
        while latest > 0 and transcript[latest - 1].role == "tool":
            latest -= 1
        pruned: list[int] = []
        for i in range(latest):
            if not force and estimate(session, fixed_tokens, transcript) <= self.budget.threshold(reply_tokens):
                break
            m = transcript[i]
            if m.role == "tool" and not m.pruned and len(m.content) > 200:
                transcript[i] = m.with_content(PLACEHOLDER, pruned=True)
                pruned.append(i)
        for i in range(latest - 1):  # still over: the long arguments of older steps (a write_file, a long say)
            if not force and estimate(session, fixed_tokens, transcript) <= self.budget.threshold(reply_tokens):
                break
            m = transcript[i]
            if m.role == "assistant" and m.tool_calls and not m.pruned and m.tokens > CLIP_CALL_TOKENS:
                transcript[i] = m.with_clipped_calls()
                pruned.append(i)
        if pruned:
            await turn.prune(transcript, [transcript[i].id for i in pruned if transcript[i].id is not None])
        entry = {"passes": 0, "pruned": len(pruned), "in_turn": True} if pruned else None
        if estimate(session, fixed_tokens, turn.transcript) > self.budget.limit(reply_tokens):
            more = await self._prune_only(
                session, fixed_tokens, turn.transcript, always=True, everything=True, reply_tokens=reply_tokens
            )
            if more:
                entry = {"passes": 0, "pruned": (entry or {}).get("pruned", 0) + more["pruned"], "in_turn": True}
        return entry

    async def _prune_only(
        self,
        session: History,
        fixed_tokens: int,
        turn_messages: list[Message],
        *,
        always: bool = False,
        everything: bool = False,
        reply_tokens: int | None = None,
    ) -> dict[str, Any] | None:
        """Clear old tool outputs (no LLM call) so the request still fits.

        Used while summaries are backing off (outside the protected tail), and, with
        ``everything``, when the endpoint refused the prompt as too long or ``/compact`` could
        not get under the threshold: then the protected tail's tool outputs go too, because a
        tail that alone overflows would otherwise lock the conversation: every request refused.
        """
        if not always and estimate(session, fixed_tokens, turn_messages) <= self.budget.limit(reply_tokens):
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

    async def force(self, session: History, fixed_tokens: int) -> str:
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
        how = " (the model could not summarise: their start was kept)" if entry.get("extractive") else ""
        return (
            f"Compacted: ~{before} → ~{after} tokens; {entry.get('covered', 0)} messages summarised{how}, "
            f"{entry.get('pruned', 0)} old tool outputs cleared."
        )


def _trace_entry(outcome: CompactionOutcome) -> dict[str, Any]:
    """What a compaction pass shows in the turn's trace."""
    return {
        "passes": outcome.passes,
        "covered": len(outcome.covered_ids),
        "pruned": len(outcome.pruned_ids),
        "flushed": outcome.flushed,
        "summary_failed": outcome.summary_failed,
        "extractive": outcome.extractive,
        "error": outcome.error,
        "estimate_before": outcome.estimate_before,
        "estimate_after": outcome.estimate_after,
    }
