"""A turn's input, made ready before the turn begins: its files fetched (or, while a file
service is down, its messages postponed), a text too long for the window kept as a file for
the model to read, and its route (docs/cognition.md, "Routing")."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from bumblebot.cognition.budget import ContextBudget
from bumblebot.cognition.prompt import PromptBuilder
from bumblebot.cognition.router import (
    CLASSIFIER_MAX_TOKENS,
    CLASSIFIER_TEMPERATURE,
    Route,
    RouteDecision,
    route,
)
from bumblebot.cognition.trace import requests_usage
from bumblebot.core.settings import CognitionSettings, EngineSettings
from bumblebot.core.usage import scoped, tallied
from bumblebot.delivery import Delivery
from bumblebot.llm import Endpoints
from bumblebot.media import MediaIntake, MediaUnavailable, prepared
from bumblebot.runtime.conversation import Conversation, Turn, merge_text
from bumblebot.runtime.outage import OUTAGE_RETRY_MAX_S, OutageWatch, outage_delay_s
from bumblebot.runtime.outcomes import Finished, Outcome, Postponed, Requeued
from bumblebot.runtime.scheduler import Scheduler
from bumblebot.runtime.turnstate import TurnState
from bumblebot.store import JournalEntry

log = logging.getLogger(__name__)

#: A turn's input longer than this share of the window (at 4 characters a token) is kept as a
#: file the model reads in parts, with an excerpt inline: a long paste on a 4k window.
LONG_INPUT_SHARE = 0.4
#: The router's classifier call is given up (the turn goes deliberate) after this many seconds.
CLASSIFIER_TIMEOUT_S = 10.0
FILES_DELAYED = (
    "I can't get to the file you sent right now ({why}). I'll answer as soon as I can; no need to "
    "send it again."
)


class Refolded(Exception):
    """A refusal taught a smaller window and an input of the turn was kept as a file
    (:meth:`TurnPreparer.refold`): the runner asks the step again, with the system prompt, tool
    schemas and reply budget fitted to that window (a request built for the larger one would
    be refused again)."""


class TurnPreparer:
    """Makes a turn's input ready (module docstring). Collaborators come in here.

    Args:
        cognition, engine: the settings (the classifier, the outage limit, typing).
        prompts: the entity (``always_deliberate``).
        llm: the classifier's endpoint.
        delivery: tells a chat its files wait; the typing indicator while they are fetched.
        window: the context window (a long input is a share of it).
        outages: what this process saw of the model endpoint being down.
        redact: removes secrets from what is stored (a classifier error may echo a key).
        media: fetches files (``None``: files are only named).
        tasks: whether a scheduled or autonomous entry still gets its turn.
    """

    def __init__(
        self, *, cognition: CognitionSettings, engine: EngineSettings, prompts: PromptBuilder, llm: Endpoints,
        delivery: Delivery, window: ContextBudget, outages: OutageWatch, redact: Callable[[Any], Any],
        media: MediaIntake | None = None, tasks: Scheduler | None = None,
    ) -> None:
        self.cfg = cognition
        self.engine_cfg = engine
        self.prompts = prompts
        self.llm = llm
        self.delivery = delivery
        self.window = window
        self.outages = outages
        self.redact = redact
        self.media = media
        self.tasks = tasks

    async def skipped(self, entries: list[JournalEntry]) -> str | None:
        """Why the scheduled or autonomous entry of ``entries`` gets no turn now (``None``: it does)."""
        if self.tasks is None or len(entries) != 1 or entries[0].inbound.source == "chat":
            return None
        return await self.tasks.may_run(entries[0])

    async def fetch(self, conversation: Conversation, entries: list[JournalEntry]) -> list[JournalEntry] | Postponed:
        """``entries`` with their files fetched, or what waits for a file service that is down
        (and what is ready without files, answered meanwhile)."""
        inbox = conversation.inbox
        if self.media is None or not any(e.inbound.attachments and e.media is None for e in entries):
            return entries
        waited_out = inbox.file_waited(entries, time.time()) >= self.engine_cfg.outage_limit_s
        try:
            async with self.delivery.typing(conversation.chat, self.engine_cfg.typing_interval_s):
                # after engine.outage_limit_s what cannot be fetched is told as failed, not waited for
                entries = await self.media.prepare(entries, final=waited_out)
        except MediaUnavailable as exc:
            known = inbox.after_fence(exc.entries or entries)  # a /reset meanwhile set some aside
            waiting = [e for e in known if e.inbound.attachments and e.media is None]
            ready = [e for e in known if not (e.inbound.attachments and e.media is None)]
            if inbox.take_stop():  # /stop while they were fetched: not answered after all
                await conversation.drop(waiting)
                return Postponed([], 0.0, ready)
            if not waiting:  # nothing left to wait for (a /reset set them aside)
                return Postponed([], 0.0, ready)
            return Postponed(waiting, await self._postpone(conversation, waiting, exc), ready)
        inbox.files_fetched(entries)
        return entries

    async def _postpone(self, conversation: Conversation, entries: list[JournalEntry], exc: MediaUnavailable) -> float:
        """A file service is down: the messages wait (journaled, pending) and are tried again
        after the returned delay; the conversation is told once."""
        inbox = conversation.inbox
        now = time.time()
        waited = now - inbox.file_wait_began(entries, now)
        delay = outage_delay_s(min(7, max(1, round(min(OUTAGE_RETRY_MAX_S, waited))).bit_length()))
        if not inbox.files_told:
            inbox.files_told = True
            await self.delivery.send(conversation.id, conversation.chat, FILES_DELAYED.format(why=exc))
        log.warning("files of %d message(s) in %s not fetched (%s); trying again in %.1f s", len(entries), conversation.key, exc, delay)
        return delay

    async def steering(self, entries: list[JournalEntry], turn: Turn) -> list[JournalEntry]:
        """Messages taken mid-turn: their files fetched, a text kept as a file when, with what
        people wrote in the turn so far, it is too long to show (a paste steered in parts)."""
        assert self.media is not None
        said = sum(len(m.content) for m in turn.transcript if m.role == "user")
        return await self.fold_long(await self.media.prepare(entries), already=said)

    async def fold_long(self, entries: list[JournalEntry], *, already: int = 0) -> list[JournalEntry]:
        """``entries`` whose texts together (with ``already`` characters the turn holds) pass
        :data:`LONG_INPUT_SHARE` of the window (4 characters a token) become one excerpt naming
        the file that keeps the whole text (``MediaIntake.keep_long_text``): a long paste on a
        small window is a document to read, not a request the endpoint refuses as too long."""
        limit = self.window.share_chars(LONG_INPUT_SHARE)  # the learned scale applies: CJK text is dense
        if self.media is None or already + sum(len(e.inbound.text) for e in entries) <= limit:
            return entries
        chat = entries[0].inbound.chat.key
        try:
            folded = await self.media.keep_long_text(entries, merge_text(entries))
        except OSError as exc:
            log.warning("a long message in %s could not be kept as a file (%s); it is shown whole", chat, exc)
            return entries
        log.info("%d characters in %s kept as a file for the model to read", sum(len(e.inbound.text) for e in entries), chat)
        return folded

    async def refold(self, turn: Turn) -> None:
        """The endpoint refused a request of the turn as too long and taught a smaller window
        meanwhile (``ContextBudget.learn``): each input of the turn (its first message, and each
        taken mid-turn: ``Turn.inputs``) that now passes :data:`LONG_INPUT_SHARE` of the window,
        with what people wrote in the turn before it, is kept as a file as it would have been
        had the window been known, its user message the excerpt (``Turn.refold``). Called
        before the loop's compacting retry (``Requests.shrink``), which cannot help then.

        Raises:
            Refolded: an input was kept as a file: the step is asked again from the start.
        """
        if self.media is None:
            return
        folded_any, said = False, 0
        for position in range(len(turn.inputs)):
            message, entries = turn.inputs[position]
            folded = await self.fold_long(entries, already=said)
            if folded is not entries:
                await turn.refold(message, folded)
                folded_any = True
            said += len(turn.inputs[position][0].content)
        if folded_any:
            raise Refolded

    async def start_state(self, entries: list[JournalEntry]) -> TurnState:
        """A turn's first state: its route (docs/cognition.md, "Routing"), kept for every later resume."""
        with tallied() as used:  # the classifier's request, for the trace
            if any(prepared(e).document for e in entries):  # reading a file is work
                decision = RouteDecision(Route.DELIBERATE, "a document came")
            else:
                decision = await route(
                    # the words, not "[Speaker]: " prefixes; a voice note's are its transcript
                    "\n\n".join(filter(None, (w for e in entries for w in (e.inbound.text, prepared(e).spoken)))),
                    # during an outage the classifier would only fail slowly: the turn goes deliberate
                    # and reaches the outage notice at once
                    classify=self._classify if self.cfg.classifier and self.outages.down_since is None else None,
                    source=entries[-1].inbound.source,
                    always_deliberate=self.prompts.entity.always_deliberate,
                )
        # a classifier error can echo the key back ("Incorrect API key provided: sk-…")
        return TurnState.from_dict(self.redact({
            "route": decision.route.value,
            "route_reason": decision.reason,
            "classifier_label": decision.label,
            "classifier_error": decision.classifier_error,
            "classifier_usage": requests_usage(used),
            "started": time.time(),
        }))

    async def _classify(self, messages: list[dict[str, Any]]) -> str:
        # bounded: the classifier only saves work, it must never hold a turn up for long
        with scoped(kind="classifier"):
            return await asyncio.wait_for(
                self.llm.text(messages, max_tokens=CLASSIFIER_MAX_TOKENS, temperature=CLASSIFIER_TEMPERATURE),
                CLASSIFIER_TIMEOUT_S,
            )


async def requeue(conversation: Conversation, entries: list[JournalEntry]) -> Outcome:
    """The burst goes on while ``entries``' turn is prepared: back to the inbox, to be answered
    with the rest. A ``/stop`` that came meanwhile was for them: they are settled unanswered and
    what came after the stop gets a turn of its own."""
    if conversation.inbox.take_stop():
        await conversation.drop(entries)
        return Finished("stopped")
    return Requeued(entries)
