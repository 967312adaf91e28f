"""The model's view of one conversation: how each request is assembled.

A request is::

    [system prompt]
    head of the active history (compaction_protect_first_n messages)
    [compaction summary, when one exists]
    rest of the active history
    this turn's messages (the first user message carries the [Turn context] preamble)
    [internal nudge, when the loop has one]

The estimate is incremental: every :class:`~bumblebot.messages.Message` caches its own
estimate, and the history total is kept as a running sum, so estimating a step costs the new
messages only. Every request is checked against the sequence invariant before it is sent.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from bumblebot.compaction import head_end
from bumblebot.loop import RequestBuilder
from bumblebot.messages import Message, estimate_text_tokens
from bumblebot.sequence import InvalidSequence, repair, validate

log = logging.getLogger(__name__)


class ConversationContext(RequestBuilder):
    """Builds the requests of one turn.

    Args:
        system_prompt: the cached system prompt.
        history: the active history (not covered by a summary), oldest first.
        summary_message: the compaction summary as a message, or ``None``.
        protect_first_n: how many history messages stay before the summary.
        preamble: the ``[Turn context]`` block for this turn's first user message.
        tool_tokens: estimate of the tool schemas sent with every loop request.
        steering: returns messages that arrived mid-turn (steer mode) with their journal ids.
        before_request: compaction hook, awaited with the estimate before each request; it may
            change ``history`` / ``summary_message`` through :meth:`replace_history`.
        shrink: awaited when the endpoint refused the prompt as too long (forced compaction,
            then pruning), before the one retry.
    """

    def __init__(
        self,
        *,
        system_prompt: str,
        history: list[Message],
        summary_message: Message | None,
        protect_first_n: int,
        preamble: str,
        tool_tokens: int,
        steering: Callable[[], list[tuple[Message, list[int]]]] | None = None,
        before_request: Callable[[ConversationContext, list[Message]], Awaitable[None]] | None = None,
        shrink: Callable[[ConversationContext, list[Message]], Awaitable[None]] | None = None,
        on_usage: Callable[[int | None, int], None] | None = None,
    ) -> None:
        self.system_prompt = system_prompt
        self.preamble = preamble
        self.tool_tokens = tool_tokens
        self.protect_first_n = protect_first_n
        self._steering = steering
        self._before_request = before_request
        self._shrink = shrink
        self._on_usage = on_usage
        self.history: list[Message] = []
        self.summary_message: Message | None = None
        self._history_tokens = 0
        self.replace_history(history, summary_message)
        self.fixed_tokens = estimate_text_tokens(system_prompt) + 10 + tool_tokens + estimate_text_tokens(preamble)
        self.last_estimate = 0
        self.compactions: list[dict[str, Any]] = []
        #: every mid-turn message taken by this turn, with its journal ids (settled at commit)
        self.steered: list[tuple[Message, list[int]]] = []

    def replace_history(self, history: list[Message], summary_message: Message | None) -> None:
        """Swap in a compacted history (the running token sum is recomputed once)."""
        self.history = history
        self.summary_message = summary_message
        self._history_tokens = sum(m.tokens for m in history) + (summary_message.tokens if summary_message else 0)

    def estimate(self, turn_messages: list[Message], nudge: str | None = None) -> int:
        """Estimated prompt tokens for a request with these turn messages (spec heuristic)."""
        nudge_tokens = estimate_text_tokens(nudge) + 10 if nudge else 0
        return self.fixed_tokens + self._history_tokens + sum(m.tokens for m in turn_messages) + nudge_tokens

    def take_steering(self) -> list[tuple[Message, list[int]]]:
        taken = self._steering() if self._steering else []
        self.steered.extend(taken)
        return taken

    def observe_usage(self, prompt_tokens: int | None, estimate: int) -> None:
        if self._on_usage is not None:
            self._on_usage(prompt_tokens, estimate)

    def call_ids(self) -> set[str]:
        return {cid for m in self.history if m.tool_calls for cid in m.tool_call_ids}

    async def shrink(self, turn_messages: list[Message]) -> None:
        if self._shrink is not None:
            await self._shrink(self, turn_messages)

    def messages(self, turn_messages: list[Message], nudge: str | None) -> list[Message]:
        """The message list (without the system prompt) in request order."""
        cut = head_end(self.history, self.protect_first_n)
        head, rest = self.history[:cut], self.history[cut:]
        out = [*head]
        if self.summary_message is not None:
            out.append(self.summary_message)
        out.extend(rest)
        out.extend(turn_messages)
        return out

    async def build(self, turn_messages: list[Message], nudge: str | None) -> tuple[list[dict[str, Any]], int]:
        if self._before_request is not None:
            await self._before_request(self, turn_messages)
        sequence = self.messages(turn_messages, nudge)
        try:
            validate(sequence)
        except InvalidSequence as exc:
            log.error("invalid message sequence at %d (%s); repairing before sending", exc.index, exc.reason)
            sequence = repair(sequence)
        api: list[dict[str, Any]] = [{"role": "system", "content": self.system_prompt}]
        first_user = turn_messages[0] if turn_messages else None
        for m in sequence:
            d = m.to_api()
            if m is first_user:
                d["content"] = f"{self.preamble}\n{m.content}"
            api.append(d)
        if nudge:
            api.append({"role": "user", "content": nudge})
        self.last_estimate = self.estimate(turn_messages, nudge)
        return api, self.last_estimate
