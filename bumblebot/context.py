"""The model's view of one turn: how each request is assembled.

A request is::

    [system prompt]
    head of the session's active history (compaction_protect_first_n messages)
    [compaction summary, when one exists]
    rest of the active history
    this turn's messages (the first user message carries the [Turn context] preamble)
    [internal nudge, when the loop has one]

Nothing here owns state: the history and summary are read from the turn's
:class:`~bumblebot.conversation.Session`, the turn's messages from its transcript. The estimate
is incremental: every :class:`~bumblebot.messages.Message` caches its own estimate and the
session keeps a running sum, so estimating a step costs the new messages only. Every request is
checked against the sequence invariant before it is sent.
"""

from __future__ import annotations

import logging
from typing import Any

from bumblebot.budget import ContextBudget
from bumblebot.compaction import head_end
from bumblebot.compactor import Compactor, estimate
from bumblebot.conversation import Session
from bumblebot.loop import RequestBuilder
from bumblebot.messages import Message, estimate_text_tokens
from bumblebot.sequence import InvalidSequence, repair, validate

log = logging.getLogger(__name__)


class Requests(RequestBuilder):
    """Builds the requests of one turn (or, with no transcript, measures the conversation).

    Args:
        system_prompt: the cached system prompt.
        preamble: the ``[Turn context]`` block for the turn's first user message.
        tool_tokens: estimate of the tool schemas sent with every loop request.
        session: the session the turn runs in.
        transcript: the turn's messages so far (the list the turn appends to).
        protect_first_n: how many history messages stay before the summary.
        compactor: compacts before a request that crosses the threshold; ``None``: never.
        budget: the window; it learns from the prompt tokens the endpoint reports.
    """

    def __init__(
        self,
        *,
        system_prompt: str,
        preamble: str,
        tool_tokens: int,
        session: Session,
        transcript: list[Message],
        protect_first_n: int,
        compactor: Compactor | None,
        budget: ContextBudget,
    ) -> None:
        self.system_prompt = system_prompt
        self.preamble = preamble
        self.session = session
        self.transcript = transcript
        self.protect_first_n = protect_first_n
        self._compactor = compactor
        self._budget = budget
        self.fixed_tokens = estimate_text_tokens(system_prompt) + 10 + tool_tokens + estimate_text_tokens(preamble)
        self.last_estimate = 0
        #: trace entries of the compactions this turn ran
        self.compactions: list[dict[str, Any]] = []

    def estimate(self, nudge: str | None = None) -> int:
        """Estimated prompt tokens of the next request (spec heuristic)."""
        nudge_tokens = estimate_text_tokens(nudge) + 10 if nudge else 0
        return estimate(self.session, self.fixed_tokens, self.transcript) + nudge_tokens

    def call_ids(self) -> set[str]:
        return {cid for m in (*self.session.history, *self.transcript) if m.tool_calls for cid in m.tool_call_ids}

    async def observe_usage(self, prompt_tokens: int | None, estimate: int) -> None:
        await self._budget.observe(prompt_tokens, estimate)

    def _note(self, entries: list[dict[str, Any] | None]) -> None:
        for entry in entries:
            if entry and (entry.get("passes") or entry.get("pruned") or entry.get("error")):
                self.compactions.append(entry)  # a skipped compaction (too little to gain) is not news

    async def shrink(self) -> None:
        if self._compactor is not None:
            self._note(await self._compactor.shrink(self.session, self.fixed_tokens, self.transcript))

    def messages(self) -> list[Message]:
        """The message list (without the system prompt) in request order."""
        history = self.session.history
        cut = head_end(history, self.protect_first_n)
        out = [*history[:cut]]
        if self.session.summary_message is not None:
            out.append(self.session.summary_message)
        out.extend(history[cut:])
        out.extend(self.transcript)
        return out

    async def build(self, nudge: str | None) -> tuple[list[dict[str, Any]], int]:
        if self._compactor is not None:
            self._note([await self._compactor.maybe_compact(self.session, self.fixed_tokens, self.transcript)])
        sequence = self.messages()
        try:
            validate(sequence)
        except InvalidSequence as exc:
            log.error("invalid message sequence at %d (%s); repairing before sending", exc.index, exc.reason)
            sequence = repair(sequence)
        api: list[dict[str, Any]] = [{"role": "system", "content": self.system_prompt}]
        first_user = self.transcript[0] if self.transcript else None
        for m in sequence:
            d = m.to_api()
            if m is first_user:
                d["content"] = f"{self.preamble}\n{m.content}"
            api.append(d)
        if nudge:
            api.append({"role": "user", "content": nudge})
        self.last_estimate = self.estimate(nudge)
        return api, self.last_estimate
