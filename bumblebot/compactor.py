"""Runs compaction for a conversation and persists it (spec, "Context compaction").

:mod:`bumblebot.compaction` plans and summarises; this module decides *when* and records the
result. It is called before every completion of a turn (so growth inside a turn is compacted
too) and by ``/compact`` (scheduled as a job of the conversation's actor). Both run inside the
actor, so no turn of the conversation can write its history meanwhile (field-bugs.md item 10).

Failure policy: if the summary call fails nothing is dropped; the failure is recorded and the
next request retries at once, later failures back off (60 s, 120 s, 240 s … up to an hour,
:func:`backoff_s`). Meanwhile, when the request would overflow, old tool results are pruned
(no LLM call) so the turn can go on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from bumblebot.compaction import compact, find_boundaries, prune_tool_results, summary_message
from bumblebot.context import ConversationContext
from bumblebot.messages import Message

if TYPE_CHECKING:
    from bumblebot.conversation import ConversationActor
    from bumblebot.engine import Engine

log = logging.getLogger(__name__)

#: A compaction must free at least max_context_tokens / this (10%) to be worth its LLM calls.
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


class Compactor:
    """Compaction for the engine's conversations."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @property
    def cfg(self) -> Any:
        return self.engine.settings.cognition.history_compression

    async def _complete(self, messages: list[dict[str, Any]], max_tokens: int, temperature: float) -> str:
        return await self.engine.llm.text(
            messages, model=self.engine.llm.model, max_tokens=max_tokens, temperature=temperature
        )

    def before_request(
        self, actor: ConversationActor
    ) -> Callable[[ConversationContext, list[Message]], Awaitable[None]]:
        """The hook :class:`ConversationContext` awaits before each request of a turn."""

        session = actor.conversation.session  # the turn's session, even if /reset comes meanwhile

        async def hook(context: ConversationContext, turn_messages: list[Message]) -> None:
            if actor.conversation.session == session:
                await self.maybe_compact(actor, context, turn_messages)

        return hook

    def shrinker(
        self, actor: ConversationActor
    ) -> Callable[[ConversationContext, list[Message]], Awaitable[None]]:
        """The hook for a context-length refusal: force a compaction, then prune if needed."""

        session = actor.conversation.session

        async def shrink(context: ConversationContext, turn_messages: list[Message]) -> None:
            if actor.conversation.session != session:
                return  # /reset meanwhile: the old session is left as it is
            await self.maybe_compact(actor, context, turn_messages, force=True)
            await self._prune_only(actor, context, turn_messages, always=True, everything=True)

        return shrink

    def _window(self) -> int:
        """The context window in *estimated* tokens: ``max_context_tokens`` shrunk by how much
        the endpoint's reported prompt tokens exceed our estimate (``Engine.token_scale``), so
        text that tokenises densely (other scripts, code, JSON) still compacts in time."""
        return int(self.engine.settings.cognition.max_context_tokens / self.engine.token_scale)

    def _threshold(self) -> int:
        return int(self._window() * self.cfg.compaction_threshold_ratio)

    async def maybe_compact(
        self,
        actor: ConversationActor,
        context: ConversationContext,
        turn_messages: list[Message],
        *,
        force: bool = False,
    ) -> dict[str, Any] | None:
        """Compact when the request estimate exceeds the threshold (or ``force``).

        Returns a trace entry when something ran, else ``None``.
        """
        if not force and (not self.cfg.enabled or context.estimate(turn_messages) <= self._threshold()):
            return None
        conversation = actor.conversation
        store = self.engine.store
        state = await store.compaction_state(conversation.id, conversation.session)
        fixed = context.fixed_tokens + sum(m.tokens for m in turn_messages)
        if not force and state.next_retry_at > time.time():
            return await self._prune_only(actor, context, turn_messages)
        outcome = await compact(
            context.history,
            previous_summary=state.summary,
            complete=self._complete,
            knowledge=self.engine.knowledge if self.cfg.compaction_flush_to_knowledge else None,
            fixed_tokens=fixed,
            max_context_tokens=self._window(),
            threshold_ratio=self.cfg.compaction_threshold_ratio,
            target_ratio=self.cfg.compaction_target_ratio,
            protect_first_n=self.cfg.compaction_protect_first_n,
            protect_last_n=self.cfg.compaction_protect_last_n,
            max_passes=self.cfg.compaction_max_passes,
            flush=self.cfg.compaction_flush_to_knowledge,
            force=force,
            min_gain_tokens=self._window() // MIN_GAIN_DIVISOR,
        )
        failed = outcome.summary_failed and not outcome.covered_ids
        await store.save_compaction(
            conversation,
            summary=outcome.summary,
            covered_ids=outcome.covered_ids,
            pruned_ids=outcome.pruned_ids,
            passes=outcome.passes,
            failed=failed,
            next_retry_at=time.time() + backoff_s(state.failures + 1) if failed else 0.0,
        )
        if outcome.flushed:
            log.info("compaction in %s saved %d fact(s) to knowledge.md", actor.key, len(outcome.flushed))
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
        context.replace_history(outcome.messages, summary_message(outcome.summary) if outcome.summary else None)
        actor.replace_history(outcome.messages)
        if outcome.passes or outcome.error:  # a skipped compaction (too little to gain) is not news
            context.compactions.append(entry)
        if failed and context.estimate(turn_messages) > self._window():
            await self._prune_only(actor, context, turn_messages)
        return entry

    async def _prune_only(
        self,
        actor: ConversationActor,
        context: ConversationContext,
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
        if not always and context.estimate(turn_messages) <= self._window():
            return None
        if everything:
            tail_start = len(context.history)
        else:
            _, tail_start = find_boundaries(
                context.history,
                protect_first_n=self.cfg.compaction_protect_first_n,
                protect_last_n=self.cfg.compaction_protect_last_n,
                tail_token_budget=0,
            )
        pruned, indexes = prune_tool_results(context.history, tail_start)
        if not indexes:
            return None
        ids = [pruned[i].id for i in indexes if pruned[i].id is not None]
        await self.engine.store.mark_pruned(ids)
        context.replace_history(pruned, context.summary_message)
        actor.replace_history(pruned)
        entry = {"passes": 0, "pruned": len(indexes), "prune_only": True}
        context.compactions.append(entry)
        return entry

    async def force(self, actor: ConversationActor) -> str:
        """``/compact``: compact the conversation now; returns a short report for the user."""
        context = await self.engine.context_between_turns(actor)
        before = context.estimate([])
        entry = await self.maybe_compact(actor, context, [], force=True)
        if context.estimate([]) > self._threshold():
            pruned = await self._prune_only(actor, context, [], always=True, everything=True)
            if pruned:
                entry = {**(entry or {}), "pruned": (entry or {}).get("pruned", 0) + pruned["pruned"]}
        after = context.estimate([])
        if entry is None or (not entry.get("covered") and not entry.get("pruned")):
            if entry and entry.get("summary_failed"):
                return "Compaction failed (the summary could not be made); nothing was dropped. I'll retry later."
            return f"Nothing to compact yet (~{before} tokens in context)."
        return (
            f"Compacted: ~{before} → ~{after} tokens; {entry.get('covered', 0)} messages summarised, "
            f"{entry.get('pruned', 0)} old tool outputs cleared."
        )
