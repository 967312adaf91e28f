"""The model's view of one turn: how each request is assembled.

A request is::

    [system prompt]
    head of the session's active history (compaction_protect_first_n messages)
    [compaction summary, when one exists]
    rest of the active history
    this turn's messages (the first user message carries the [Turn context] preamble)
    [internal nudge, when the loop has one]

The first user message of every turn is sent with the ``[Turn context]`` it was first sent with
(``Message.context``, recorded with it): a request repeats the previous one of the conversation
as a prefix, up to that request's nudge, so endpoints with a prompt cache reuse it. Only a fact
no longer in the knowledge files is left out of an earlier block. When a compaction summarised
messages that carried blocks, the current turn's block is built again against the history left
(``rebuild_context``), so the request still names the platform, the speaker and the facts.

Images: a user message's images are sent as ``image_url`` parts (data URLs,
:class:`~bumblebot.media.intake.MediaFiles`) while the message is in the request's protected tail:
this turn's messages and the last ``image_tail`` messages of the history
(``cognition.history_compression.compaction_protect_last_n``). Older ones are named in the text
only ("[Image 1280×960] (no longer shown)"), and so are all of them when the model cannot see
images (``llm.vision``, or the endpoint refused them). Each image shown adds its
:func:`~bumblebot.media.intake.image_tokens` to the estimate; the messages' own estimates count text.

Nothing here owns state: the history and summary are read from the turn's
:class:`~bumblebot.runtime.conversation.Session`, the turn's messages from its transcript. The estimate
is incremental: every :class:`~bumblebot.core.messages.Message` caches its own estimate and the
session keeps a running sum, so estimating a step costs the new messages only. Every request is
checked against the sequence invariant before it is sent.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from bumblebot.cognition.budget import ContextBudget
from bumblebot.cognition.compaction import head_end
from bumblebot.cognition.compactor import Compactor, estimate
from bumblebot.cognition.history import History, Transcript
from bumblebot.cognition.limits import LoopLimits
from bumblebot.cognition.sequence import InvalidSequence, repair, validate
from bumblebot.core.messages import Message, TurnContext, estimate_text_tokens, estimate_tools
from bumblebot.core.usage import FIRST_WORDS, urgency
from bumblebot.media import ImageRef, MediaFiles

log = logging.getLogger(__name__)


class Requests:
    """Builds the requests of one turn (or, with no transcript, measures the conversation).

    Args:
        system_prompt: the cached system prompt.
        known_facts: the facts the knowledge files hold now (``PromptBuilder.known_facts``):
            an earlier ``[Turn context]`` is sent without the facts it showed that are gone.
        tool_schemas: the tool schemas sent with every loop request (compacted to the window).
        session: the session the turn runs in.
        turn: the turn (its transcript is the list it appends to); ``None`` between turns.
        protect_first_n: how many history messages stay before the summary.
        compactor: compacts before a request that crosses the threshold; ``None``: never.
        budget: the window; it learns from the prompt tokens the endpoint reports.
        limits: the turn's profile; its completion budget is room the prompt must leave
            (read at each request: a reply cut by the reflex budget raises it).
        media: where images are read from (``None``: images are named, never shown).
        sees_images: whether the model sees images (``LLM.sees_images``), asked per request.
        image_tail: how many of the last history messages show their images.
        history_images: whether history messages show their images at all (not to a reflex
            model other than ``llm.model``: it did not see them, and may well be text-only).
        rebuild_context: builds the turn's ``[Turn context]`` again against the active history;
            called when a compaction summarised messages that carried one (their lines and
            facts go in the turn's block again).
        refold: keeps the turn's long inputs as files when a refusal taught a smaller window
            (``TurnPreparer.refold``), before :meth:`shrink` compacts; it raises when it did (the
            step is asked again, its request fitted to that window).
    """

    def __init__(
        self,
        *,
        system_prompt: str,
        known_facts: frozenset[str],
        tool_schemas: list[dict[str, Any]],
        session: History,
        turn: Transcript | None,
        protect_first_n: int,
        compactor: Compactor | None,
        budget: ContextBudget,
        limits: LoopLimits | None = None,
        media: MediaFiles | None = None,
        sees_images: Callable[[str | None], Awaitable[bool]] | None = None,
        image_tail: int = 12,
        history_images: bool = True,
        rebuild_context: Callable[[], Awaitable[None]] | None = None,
        refold: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.system_prompt = system_prompt
        self.known_facts = known_facts
        self.tool_schemas = tool_schemas
        tool_tokens = estimate_tools(tool_schemas)
        self.session = session
        self._turn = turn
        self.transcript: list[Message] = turn.transcript if turn is not None else []
        self.protect_first_n = protect_first_n
        self._compactor = compactor
        self._budget = budget
        self._limits = limits
        self.fixed_tokens = estimate_text_tokens(system_prompt) + 10 + tool_tokens
        self.last_estimate = 0
        self._media = media
        self._sees_images = sees_images
        self._image_tail = image_tail if history_images else 0
        self._sees = media is not None  # as the last request found; the estimate follows it
        self._rebuild_context = rebuild_context
        self._refold = refold
        #: trace entries of the compactions this turn ran
        self.compactions: list[dict[str, Any]] = []

    def estimate(self, nudge: str | None = None) -> int:
        """Estimated prompt tokens of the next request (the token estimate, docs/compaction.md)."""
        nudge_tokens = estimate_text_tokens(nudge) + 10 if nudge else 0
        return estimate(self.session, self._fixed(), self.transcript) + nudge_tokens

    def _tail(self) -> list[Message]:
        """The messages whose images a request shows: the history's last ``image_tail`` and
        this turn's."""
        history = self.session.history
        return [*history[max(0, len(history) - self._image_tail):], *self.transcript]

    def _fixed(self) -> int:
        """The fixed part of every request, plus the images it shows."""
        if not self._sees:
            return self.fixed_tokens
        return self.fixed_tokens + sum(ImageRef.from_json(i).tokens for m in self._tail() for i in m.images or ())

    def call_ids(self) -> set[str]:
        return {cid for m in (*self.session.history, *self.transcript) if m.tool_calls for cid in m.tool_call_ids}

    async def observe_usage(self, prompt_tokens: int | None, estimate: int) -> None:
        await self._budget.observe(prompt_tokens, estimate)

    async def observe_refusal(self, prompt_tokens: int | None) -> None:
        """The last request built was refused as too long after the endpoint counted
        ``prompt_tokens`` (see ``ContextBudget.refused``). A smaller window the refusal taught
        (``ContextBudget.learn``) caps the turn's reply budget from its retry on."""
        await self._budget.refused(prompt_tokens, self.last_estimate)
        if self._limits is not None:
            cap = self._budget.reply_cap()
            self._limits.max_tokens = min(self._limits.max_tokens, cap)
            if self._limits.escalate_tokens is not None:
                self._limits.escalate_tokens = min(self._limits.escalate_tokens, cap)

    def _note(self, entries: list[dict[str, Any] | None]) -> None:
        for entry in entries:
            if entry and (entry.get("passes") or entry.get("pruned") or entry.get("error")):
                self.compactions.append(entry)  # a skipped compaction (too little to gain) is not news

    @property
    def reply_tokens(self) -> int | None:
        return self._limits.max_tokens if self._limits is not None else None

    def _blocks(self) -> list[TurnContext]:
        """The ``[Turn context]`` blocks of the active history, in order."""
        return [m.context for m in self.session.history if m.context is not None]

    async def _blocks_gone(self, blocks: list[TurnContext]) -> None:
        """A compaction took blocks out of the history (``blocks``: those it had): the turn's
        own block, which left out what they showed, is built again against what is left."""
        if self._rebuild_context is not None and self._blocks() != blocks:
            await self._rebuild_context()

    async def shrink(self) -> None:
        if self._refold is not None:
            await self._refold()  # the turn's input that filled the window, a file
        if self._compactor is not None:
            blocks = self._blocks()
            reply = self.reply_tokens
            self._note(await self._compactor.shrink(self.session, self._fixed(), self.transcript, reply_tokens=reply))
            if self._turn is not None:
                self._note([await self._compactor.fit_turn(
                    self.session, self._fixed(), self._turn, force=True, reply_tokens=reply
                )])
            await self._blocks_gone(blocks)

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
        if self._media is not None and self._sees_images is not None and any(m.images for m in self._tail()):
            self._sees = await self._sees_images(self._limits.model if self._limits else None)
        if self._compactor is not None:
            blocks, reply = self._blocks(), self.reply_tokens
            # a person waiting for first words does not also wait for a summary the window can
            # still do without: the request after the first words compacts
            self._note([await self._compactor.maybe_compact(
                self.session, self._fixed(), self.transcript, reply_tokens=reply, defer=urgency() == FIRST_WORDS
            )])
            if self._turn is not None:  # the turn's own growth, when compacting the history was not enough
                self._note([await self._compactor.fit_turn(self.session, self._fixed(), self._turn, reply_tokens=reply)])
            await self._blocks_gone(blocks)
        sequence = self.messages()
        try:
            validate(sequence)
        except InvalidSequence as exc:
            log.error("invalid message sequence at %d (%s); repairing before sending", exc.index, exc.reason)
            sequence = repair(sequence)
        api: list[dict[str, Any]] = [{"role": "system", "content": self.system_prompt}]
        shown = {id(m) for m in self._tail()} if self._sees else set()
        for m in sequence:
            d = m.to_api()
            if m.role == "user" and m.context is not None:
                d["content"] = f"{m.context.text(self.known_facts)}\n{m.content}"
            if m.images:
                d["content"] = await self._with_images(d["content"], m.images, show=id(m) in shown)
            api.append(d)
        if nudge:
            api.append({"role": "user", "content": nudge})
        self.last_estimate = self.estimate(nudge)
        return api, self.last_estimate

    async def _with_images(self, text: str, images: list[dict[str, Any]], *, show: bool) -> Any:
        """A user message's content with its images: text plus ``image_url`` parts when shown,
        else the text saying why they are not."""
        urls = []
        if show and self._media is not None:
            for raw in images:
                url = await self._media.data_url(ImageRef.from_json(raw))
                if url is not None:
                    urls.append(url)
        if not urls:
            why = "no longer shown" if self._sees else "not shown: you cannot see images, only read the text"
            return f"{text}\n({len(images)} image{'s' if len(images) != 1 else ''} {why})"
        return [{"type": "text", "text": text}, *({"type": "image_url", "image_url": {"url": u}} for u in urls)]
