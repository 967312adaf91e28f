"""One turn, from its start to its finish: it is begun, driven through the agent loop, resumed
after a crash, retried after an outage, and finished.

:class:`TurnRunner` is called by a conversation's actor with the journal entries that make a
turn (several waiting messages merge into one; :class:`~bumblebot.runtime.preparing.TurnPreparer`
makes them ready), or with a turn the last process left running. Each step is recorded as it
happens (:mod:`bumblebot.runtime.conversation`), so a turn that a crash or a stop cut off is
resumed from its last checkpoint by :meth:`TurnRunner.resume`; it is never answered a second
time from scratch.

Outcomes (:mod:`bumblebot.runtime.outcomes`, what the actor does next):

* :class:`Finished`: the turn is closed (``done`` or ``failed``) with its journal entries.
* :class:`Suspended`: the model endpoint is unreachable. The turn stays ``running`` with its
  entries ``pending``; the user got one notice that the answer is delayed; the actor calls
  :meth:`TurnRunner.retry` after ``retry_in`` seconds (backoff doubling from 1 s, capped at
  60 s, or the endpoint's ``Retry-After`` up to 300 s); when another endpoint is ready
  (failover), at once and untold. After ``engine.outage_limit_s`` the turn fails with one
  honest message and its entries are marked ``failed``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from bumblebot.cognition.budget import ContextBudget
from bumblebot.cognition.compactor import Compactor
from bumblebot.cognition.context import Requests
from bumblebot.cognition.limits import LoopLimits, max_steps
from bumblebot.cognition.loop import AgentLoop
from bumblebot.cognition.prompt import PromptBuilder
from bumblebot.cognition.router import Route
from bumblebot.cognition.trace import LoopTrace, Stop, StopReason
from bumblebot.core.adapter import Typing
from bumblebot.core.errors import ContextTooLong, ModelError, ModelUnavailable, SpendingLimitReached, STORE_FAILURES
from bumblebot.core.logs import bind
from bumblebot.core.messages import (
    MESSAGE_OVERHEAD_TOKENS,
    Message,
    estimate_text_tokens,
    estimate_tools,
)
from bumblebot.core.metrics import NO_METRICS, Metrics
from bumblebot.core.settings import (
    CognitionSettings,
    DeliverySettings,
    EngineSettings,
    VoiceSettings,
)
from bumblebot.core.toolkit import SCHEMA_LEVELS, Toolbox
from bumblebot.core.usage import current_scope, scoped, unless
from bumblebot.delivery import Delivery
from bumblebot.llm import Endpoints
from bumblebot.media import MediaFiles, MediaIntake, answerable, prepared
from bumblebot.runtime.conversation import Conversation, Session, Turn
from bumblebot.runtime.io import TurnIO, drop_open_streams
from bumblebot.runtime.limits import SpendingLimits, limit_text
from bumblebot.runtime.notices import (
    BLIND,
    BLIND_TOLD_KEY,
    CRASHED,
    MODEL_REFUSED,
    RESUME_GAVE_UP,
    too_long,
)
from bumblebot.runtime.ledger import turn_scope
from bumblebot.runtime.outage import (
    MAX_RETRY_AFTER_S,
    OUTAGE_GAVE_UP,
    OUTAGE_NOTICE,
    OutageWatch,
    duration,
    outage_delay_s,
)
from bumblebot.runtime.outcomes import Finished, Outcome, Postponed, Suspended
from bumblebot.runtime.preparing import Refolded, TurnPreparer, requeue
from bumblebot.runtime.scheduler import Scheduler
from bumblebot.runtime.snapshot import TraceSnapshot
from bumblebot.runtime.turncontext import TurnContexts
from bumblebot.runtime.turnstate import Closing, TurnState
from bumblebot.store import JournalEntry, RunningTurn

log = logging.getLogger(__name__)

#: A turn resumed this many times in a row without a new step of its model is given up (a poison
#: turn must not crash the daemon for ever; a turn whose worker was killed while it progressed
#: is not one).
MAX_RESUMES = 3
#: ... and one resumed this many times in all, even with steps between (a tool that crashes
#: the process after each step of the model).
MAX_TOTAL_RESUMES = 10
#: The system prompt and tool schemas together take at most this share of the window.
FIXED_SHARE = 0.25



class TurnRunner:
    """Runs turns; one per engine, stateless between turns. Collaborators come in here.

    Args:
        cognition: the ``cognition`` settings.
        engine: the ``engine`` settings (typing refresh, outage limit).
        prompts: the system prompt and ``[Turn context]``.
        llm: the endpoints (the router's classifier; model names, ``llm.background_model``).
        loop: the agent loop.
        compactor: compaction before requests; ``None`` disables it.
        delivery: the outbox and the typing indicator.
        budget: the context window.
        toolbox: the tools offered (their schemas are part of every request's fixed size).
        redact: removes secrets from a trace before it is stored.
        streaming: the ``delivery`` settings (``None``: nothing is streamed).
        media: fetches the files of messages before a turn takes them (``None``: files are
            only named).
        media_files: where requests read images from (``None``: images are never shown).
        voice: the ``voice`` settings (``reply: mirror`` answers voice notes by voice too).
        metrics: counts finished turns by status (``bumblebot_turns_total``); default: not counted.
        tasks: the scheduler: the task of a chat that cannot be reached any more is cancelled.
        status_lines: more of ``/status`` for a conversation key (the MCP servers), ``""``: none.
        preparer: makes a turn's input ready (its files, its route); default: built from the above.
        spending: the spending limits: which refusals a chat is told of (once a day per limit);
            ``None``: every refusal is told.
    """

    def __init__(
        self,
        *,
        cognition: CognitionSettings,
        engine: EngineSettings,
        prompts: PromptBuilder,
        llm: Endpoints,
        loop: AgentLoop,
        compactor: Compactor | None,
        delivery: Delivery,
        budget: ContextBudget,
        toolbox: Toolbox,
        redact: Callable[[Any], Any],
        streaming: DeliverySettings | None = None,
        media: MediaIntake | None = None,
        media_files: MediaFiles | None = None,
        voice: VoiceSettings | None = None,
        metrics: Metrics | None = None,
        tasks: Scheduler | None = None,
        status_lines: Callable[[str], str] | None = None,
        preparer: TurnPreparer | None = None,
        spending: SpendingLimits | None = None,
    ) -> None:
        self.spending = spending
        self.tasks = tasks
        self.status_lines = status_lines
        self._metrics = NO_METRICS if metrics is None else metrics
        self.media = media
        self.media_files = media_files
        self.voice = voice
        self.cfg = cognition
        self.streaming = streaming
        self.engine_cfg = engine
        self.prompts = prompts
        self.contexts = TurnContexts(prompts)
        self.llm = llm
        self.loop = loop
        self.compactor = compactor
        self.delivery = delivery
        self.budget = budget
        self.toolbox = toolbox
        self.redact = redact
        self.outages = OutageWatch()
        self._fixed_warned = 0
        self.preparer = preparer or TurnPreparer(
            cognition=cognition, engine=engine, prompts=prompts, llm=llm, delivery=delivery, window=budget,
            outages=self.outages, redact=redact, media=media, tasks=tasks,
        )

    def fixed_part(self) -> tuple[int, str, list[dict[str, Any]]]:
        """The compaction level, system prompt and tool schemas of every request, compacted
        until together they take at most :data:`FIXED_SHARE` of the window (a small local
        window would be full before the conversation began): the lowest level of ``PromptBuilder.system_prompt`` and ``Toolbox.schemas``
        that fits. Returns the most compact one (and logs it once) when even that does not fit."""
        budget = int(self.budget.window() * FIXED_SHARE)
        for level in range(SCHEMA_LEVELS):
            prompt, schemas = self.prompts.system_prompt(level), self.toolbox.schemas(level)
            tokens = estimate_text_tokens(prompt) + MESSAGE_OVERHEAD_TOKENS + estimate_tools(schemas)
            if tokens <= budget:
                return level, prompt, schemas
        if self._fixed_warned != tokens:
            self._fixed_warned = tokens
            log.warning(
                "the system prompt and tool schemas take ~%d tokens even compacted, over %d%% of the "
                "%d-token window; a larger window (the server's context size, and cognition.max_context_tokens) "
                "or fewer tools would leave the conversation more room",
                tokens, FIXED_SHARE * 100, self.budget.max_context_tokens,
            )
        return level, prompt, schemas

    async def run(self, conversation: Conversation, entries: list[JournalEntry]) -> Outcome:
        """A new turn answering ``entries``: fetch their files, route it, record its start, run it.

        Files that could not be used are told to the user first, in one note (recorded with
        the turn's state, so a resumed turn never repeats it); when nothing is left for the
        model to answer, that note ends the turn.
        """
        # the JSON log's ids, and whom the turn's model requests are for
        with bind(conversation=conversation.key), turn_scope(conversation.key, entries):
            return await self._run(conversation, entries)

    async def _run(self, conversation: Conversation, entries: list[JournalEntry]) -> Outcome:
        preparer, inbox = self.preparer, conversation.inbox
        why, refusal = await preparer.skipped(entries), None
        if why is None and self.spending is not None and entries[0].inbound.source != "chat":
            refusal = await self.spending.refused(current_scope())  # background work: no turn, no history
            why = None if refusal is None else str(refusal)
        if why is not None:
            log.info("%s in %s: no turn (%s)", entries[0].inbound.message_id, conversation.key, why)
            await conversation.drop(entries)
            if refusal is not None:
                await self._task_refused(conversation, entries[0], refusal)
            return Finished("skipped")
        if self.spending and (refused := await self.spending.refused_senders(conversation.key, entries)):
            return await self._refuse(conversation, entries, dict(refused))
        fetched = await preparer.fetch(conversation, entries)
        if isinstance(fetched, Postponed):
            return fetched
        entries = fetched
        if inbox.burst.is_set():
            return await requeue(conversation, entries)  # the burst goes on: one turn for all of it
        raw = entries
        await self.budget.settled()  # the endpoint's window, when it is being asked at start
        entries = await preparer.fold_long(entries)
        state = await preparer.start_state(entries)
        if inbox.burst.is_set():
            return await requeue(conversation, raw)  # as they came: the next turn folds them again
        notices = [n for e in entries for n in prepared(e).notices]
        if any(prepared(e).voice for e in entries) and self.voice is not None and self.voice.reply == "mirror":
            state.voice_reply = True
        turn = await conversation.begin_turn(entries, state)
        if turn is None:  # /reset came while it was being prepared: set aside with the old session
            log.info("%d message(s) in %s set aside by /reset", len(entries), conversation.key)
            return Finished("set aside")
        if notices and not any(answerable(e) for e in entries):
            return await self._end(conversation, turn, {}, "done", Stop(StopReason.FILES_UNUSABLE), "\n".join(notices))
        if notices:
            turn.state.file_notices = True
            await self._note(turn, "\n".join(notices))
        return await self._drive(conversation, turn, {})

    async def _refuse(
        self, conversation: Conversation, entries: list[JournalEntry], refused: dict[str, SpendingLimitReached]
    ) -> Outcome:
        """The messages of people a spending limit refuses get no model request: a turn of their
        own (in the history, as a turn a limit cut is) that ends at once with the limit, told
        once a day per limit; the others go back to the head of the inbox for a turn of their own."""
        rest = [e for e in entries if e.inbound.sender_id not in refused]
        turn = await conversation.begin_turn([e for e in entries if e.inbound.sender_id in refused], TurnState())
        if turn is None:  # /reset came meanwhile: set aside
            return Finished("set aside", rest)
        log.info("turn %s in %s: refused by a spending limit", turn.id, conversation.key)
        note = await self.spending.notices(conversation.key, refused.values()) if self.spending else None
        trace, stop = {"error": str(next(iter(refused.values())))}, Stop(StopReason.SPENDING_LIMIT)
        ended = await (
            self._end(conversation, turn, trace, "done", stop, note) if note
            else self._finish(conversation, turn, trace, "done", stop, time.monotonic())
        )
        return dataclasses.replace(ended, rest=rest)

    async def _task_refused(self, conversation: Conversation, entry: JournalEntry, refusal: SpendingLimitReached) -> None:
        """A scheduled task a spending limit kept from running: the chat is told (after it was
        settled: a crash costs the message, never doubles it)."""
        task = await self.tasks.task_of(entry) if self.tasks is not None else None
        if task is not None and self.spending is not None:
            await self.spending.tell_task(conversation.chat, refusal, task)

    async def resume(self, conversation: Conversation, running: RunningTurn) -> Outcome:
        """Continue a turn the last process left running, from its last checkpoint.

        A turn that had already queued the note that ends it is only finished. A turn that was
        cut off while it was working counts one resume (a turn that was waiting out an outage,
        or that a stop cut off cleanly, does not); after :data:`MAX_RESUMES` with no step of
        the model between them, or :data:`MAX_TOTAL_RESUMES` in all, it is given up.
        """
        with bind(conversation=conversation.key, turn=running.id), turn_scope(conversation.key, running.entries):
            return await self._resume(conversation, running)

    async def _resume(self, conversation: Conversation, running: RunningTurn) -> Outcome:
        legacy = running.legacy and running.entries
        state = await self.preparer.start_state(running.entries) if legacy else TurnState()
        turn = await conversation.resume_turn(running, state)
        if not turn.entries:  # nothing left to answer (settled meanwhile)
            await self.loop.abandon(self._io(conversation, turn), "the turn was not resumed")
            stop = Stop(StopReason.NOTHING_TO_RESUME)
            return await self._finish(conversation, turn, dict(running.trace), "failed", stop, time.monotonic())
        closing = turn.state.closing
        if closing is not None:  # its last note is queued: send it if the crash kept it from going out
            await self.delivery.retry_pending({e.id for e in await turn.outbox() if e.status == "pending"})
            stop = Stop.parse(closing.stop)
            return await self._finish(conversation, turn, dict(running.trace), closing.status, stop, time.monotonic())
        # its rows left pending (cut off mid-send) go first: its next reply must not overtake them
        await self.delivery.retry_pending({e.id for e in await turn.outbox() if e.status == "pending"})
        if turn.state.active:
            turn.state.resumes += 1
            turn.state.stalled_resumes += 1
        turn.state.active = True
        await turn.save_state()  # counted before anything can crash again (a poison turn ends)
        log.warning("resuming turn %s in %s (resume %d)", turn.id, conversation.key, turn.state.resumes)
        if turn.state.stalled_resumes > MAX_RESUMES or turn.state.resumes > MAX_TOTAL_RESUMES:
            await self.loop.abandon(self._io(conversation, turn), "given up after repeated interruptions")
            return await self._end(conversation, turn, running.trace, "failed", Stop(StopReason.RESUME_CAP), RESUME_GAVE_UP)
        return await self._drive(conversation, turn, running.trace)

    def _io(
        self, conversation: Conversation, turn: Turn, trace: Callable[[], dict[str, Any]] = dict, *,
        steer_images: bool = True,
    ) -> TurnIO:
        streams = self.streaming is not None and self.streaming.streaming == "on"
        return TurnIO(
            conversation, turn, self.delivery, self.outages,
            steer=self.cfg.mid_turn_messages == "steer", trace=trace,
            stream_interval_s=self.streaming.stream_edit_interval_s if streams and self.streaming else None,
            prepare=(lambda entries: self.preparer.steering(entries, turn)) if self.media is not None else None,
            refused=None if self.spending is None else functools.partial(self.spending.refused_senders, conversation.key),
            voice_mirror=self.voice is not None and self.voice.reply == "mirror",
            steer_images=steer_images,
        )

    async def retry(self, conversation: Conversation, suspended: Suspended) -> Outcome:
        """Try a suspended turn again (the endpoint may be back)."""
        suspended.turn.state.active = True
        with turn_scope(conversation.key, suspended.turn.entries):
            return await self._drive(conversation, suspended.turn, suspended.trace)

    def _requests(
        self, session: Session, turn: Turn | None, compactor: Compactor | None, limits: LoopLimits | None = None,
        rebuild_context: Callable[[], Awaitable[None]] | None = None,
    ) -> Requests:
        _, prompt, schemas = self.fixed_part()
        return Requests(
            system_prompt=prompt,
            known_facts=self.prompts.known_facts(session.key),
            tool_schemas=schemas,
            session=session,
            turn=turn,
            protect_first_n=self.cfg.history_compression.compaction_protect_first_n,
            compactor=compactor,
            budget=self.budget,
            limits=limits,
            media=self.media_files,
            sees_images=self.llm.sees_images,
            image_tail=self.cfg.history_compression.compaction_protect_last_n,
            history_images=limits is None or limits.model == self.llm.model,
            rebuild_context=rebuild_context,
            refold=None if turn is None else functools.partial(self.preparer.refold, turn),
        )

    def between_turns(self, conversation: Conversation) -> Requests:
        """The conversation as the next request would carry it, without a turn's own messages
        (``/status`` and ``/compact`` report the same numbers)."""
        return self._requests(conversation.session, None, None)

    def status(self, conversation: Conversation) -> str:
        """``/status``: context usage and compaction, in two lines."""
        requests = self.between_turns(conversation)
        session = conversation.session
        estimate = requests.estimate()
        limit = self.budget.window()  # the estimate's own units: the window shrunk by the learned scale
        return (
            f"Context: ~{estimate} of {limit} tokens ({100 * estimate / limit:.0f}%), "
            f"{len(session.history)} messages in context.\n"
            f"Summary: {'yes' if session.summary else 'none'}; compactions so far: {session.compaction.compactions}."
        ) + (f"\n{extra}" if self.status_lines is not None and (extra := self.status_lines(conversation.key)) else "")

    async def compact_now(self, conversation: Conversation, sender: str | None = None) -> str:
        """``/compact`` from ``sender``: compact the conversation now, its summaries counted for
        them; returns the report for the user (the limit, when one refuses them)."""
        if self.compactor is None:
            return "Compaction is not available."
        with scoped(conversation=conversation.key, sender=sender, kind="summary", background=False) as scope:
            refusal = await self.spending.refused(scope) if self.spending is not None else None
            if refusal is not None:
                return limit_text(refusal, time.time())
            return await self.compactor.force(conversation.session, self.between_turns(conversation).fixed_tokens)

    async def compact_idle(self, conversation: Conversation, interrupt: asyncio.Event) -> None:
        """Between turns: compact a conversation its last turn left over the threshold (its
        first step deferred that while the person waited), unless ``interrupt`` is set first."""
        if self.compactor is not None:
            with scoped(conversation=conversation.key, kind="summary", background=False) as scope, \
                    unless(interrupt):
                if self.spending is None or await self.spending.refused(scope) is None:
                    fixed = self.between_turns(conversation).fixed_tokens
                    entry = await self.compactor.maybe_compact(conversation.session, fixed, [], interrupt=interrupt)
                    if entry and (entry.get("passes") or entry.get("pruned") or entry.get("error")):
                        log.info("%s compacted between turns: %s", conversation.key, entry)

    def _limits(self, reflex: bool, source: str = "chat") -> LoopLimits:
        """The turn's profile (docs/cognition.md, "Routing"). The completion budget is at most
        :data:`REPLY_SHARE` of the window: servers that count prompt plus ``max_tokens``
        against it (vLLM, llama.cpp, OpenAI) would refuse a 2048-token reply in a 4k window."""
        cfg = self.cfg
        cap = self.budget.reply_cap()
        deliberate = min(cap, cfg.deliberate_max_tokens)
        return LoopLimits(
            max_steps=max_steps(cfg.tool_continuation_rounds),
            max_tokens=min(cap, cfg.reflex_max_tokens) if reflex else deliberate,
            max_messages=cfg.max_messages_per_turn,
            escalate_tokens=deliberate if reflex else None,
            model=self._model(reflex, source),
            thinking=not reflex,
            tool_timeout_s=cfg.tool_timeout_s,
            max_tool_result_chars=self.budget.share_chars(cfg.max_tool_result_share),
            silent_ok=source != "chat",
            first_words_s=cfg.first_words_s or None,
        )

    def _model(self, reflex: bool, source: str) -> str:
        """The model of a turn's steps: ``llm.background_model`` for a scheduled or autonomous
        turn when one is set, else the route's."""
        if source != "chat" and self.llm.background_model:
            return self.llm.background_model
        return self.llm.reflex_model if reflex else self.llm.model

    async def _drive(self, conversation: Conversation, turn: Turn, earlier: dict[str, Any]) -> Outcome:
        """Run the loop on ``turn`` until it finishes or the endpoint fails."""
        with bind(conversation=conversation.key, turn=turn.id), turn_scope(conversation.key, turn.entries):
            return await self._drive_bound(conversation, turn, earlier)

    async def _drive_bound(self, conversation: Conversation, turn: Turn, earlier: dict[str, Any]) -> Outcome:
        started = time.monotonic()
        await self.budget.settled()
        limits = self._turn_limits(turn)
        trace = LoopTrace(
            steps=list(earlier.get("steps", [])), gate=list(earlier.get("gate", [])), cuts=list(earlier.get("cuts", [])),
        )
        snapshot = TraceSnapshot(turn, limits, trace, list(earlier.get("compactions", [])), self.redact)
        io = self._io(conversation, turn, snapshot, steer_images=limits.model == self.llm.model)
        try:
            await self._tell_blind(conversation, turn, limits.model)
            rebuild = await self.contexts.give(turn, self.fixed_part()[0])
            requests = snapshot.requests = self._requests(turn.session, turn, self.compactor, limits, rebuild)
            # a scheduled or autonomous turn may stay silent: no "typing…" for it
            typing_scope = (
                contextlib.nullcontext(Typing()) if limits.silent_ok
                else self.delivery.typing(turn.chat, self.engine_cfg.typing_interval_s)
            )
            async with typing_scope as typing:
                io.typing = typing
                result = await self.loop.run(io, requests, limits, trace, conversation=conversation.key)
        except asyncio.CancelledError:
            # a stop past the grace period: the turn stays running and is resumed at start,
            # without counting as a crash (a preview's row stays open for it to take over)
            turn.state.active = False
            with contextlib.suppress(Exception):
                await io.pause_previews()
                await turn.save_state()
            raise
        except SpendingLimitReached as exc:  # not an outage: nothing to wait for but the day's end
            return await self._limited(conversation, turn, io, exc, snapshot(error=str(exc)), started)
        except ModelUnavailable as exc:
            await io.pause_previews()  # the retry's stream takes the shown text over
            return await self._outage(conversation, turn, exc, snapshot(error=str(exc)))
        except Refolded:  # the input that filled a window learned just now is a file: the step again, fitted to it
            await io.settle_previews()
            return await self._drive_bound(conversation, turn, snapshot())
        except ModelError as exc:
            await io.settle_previews()
            log.warning("turn %s in %s failed: %s", turn.id, conversation.key, exc)
            note = too_long(turn) if isinstance(exc, ContextTooLong) else MODEL_REFUSED.format(error=exc.status or "error")
            return await self._end(conversation, turn, snapshot(error=str(exc)), "failed", Stop(StopReason.MODEL_ERROR), note, started)
        except STORE_FAILURES:
            raise  # a write of the turn failed: the actor reads it back and resumes it
        except Exception:
            error_id = uuid.uuid4().hex[:8]
            log.exception("turn %s in %s crashed (error id %s)", turn.id, conversation.key, error_id)
            with contextlib.suppress(Exception):
                await io.settle_previews()
            await self.loop.abandon(io, f"internal error (id {error_id})")
            note = CRASHED.format(error_id=error_id)
            return await self._end(conversation, turn, snapshot(error_id=error_id), "failed", Stop(StopReason.CRASH), note, started)
        await self._tell_blind(conversation, turn, limits.model)  # the endpoint refused them just now
        if result.stop.reason is StopReason.UNDELIVERABLE and self.tasks is not None and turn.entries:
            await self.tasks.retire(turn.entries[0], "the chat cannot be reached")
        return await self._finish(conversation, turn, snapshot(delivered=len(result.delivered)), "done", result.stop, started)

    def _turn_limits(self, turn: Turn) -> LoopLimits:
        """The loop's limits for ``turn``: its route's, with the main model for pictures and one
        message at most for an autonomous cycle."""
        source = turn.entries[0].inbound.source if turn.entries else "chat"
        limits = self._limits(turn.state.route == Route.REFLEX.value, source)
        if limits.model != self.llm.model and any(m.images for m in turn.transcript if m.role == "user"):
            # a reflex model is often a small text-only one: pictures go to the main model
            limits = dataclasses.replace(limits, model=self.llm.model)
        if limits.silent_ok and source == "autonomous":
            limits = dataclasses.replace(limits, max_messages=1)  # unprompted: one message at most
        return limits

    async def _tell_blind(self, conversation: Conversation, turn: Turn, model: str) -> None:
        """The turn carries images the model does not see: say so, once per conversation
        (the mark is written before the note: a crash costs the note, never doubles it)."""
        if self.media_files is None or not any(m.images for m in turn.transcript if m.role == "user"):
            return
        if await self.llm.sees_images(model):
            return
        key = BLIND_TOLD_KEY.format(key=conversation.key)
        if await self.llm.capabilities.get(key):
            return
        await self.llm.capabilities.set(key, "1")
        await self._note(turn, BLIND)

    async def _limited(
        self, conversation: Conversation, turn: Turn, io: TurnIO, exc: SpendingLimitReached, trace: dict[str, Any],
        started: float,
    ) -> Outcome:
        """A spending limit refused the turn's next request: the turn ends here, done, with what
        it said delivered as it was. The chat is told which limit and when it resets, once a day
        per limit (:meth:`SpendingLimits.notice`); a later turn it refuses ends without a word,
        and so does an autonomous one; a scheduled one that had said nothing yet is told as a
        task that did not run."""
        await io.settle_previews()
        await self.loop.abandon(io, "a spending limit was reached")
        log.info("turn %s in %s: %s", turn.id, conversation.key, exc)
        stop, note = Stop(StopReason.SPENDING_LIMIT), None
        source = turn.entries[0].inbound.source if turn.entries else ""
        if source == "chat":
            spending = self.spending
            note = await spending.notice(conversation.key, exc) if spending else limit_text(exc, time.time())
        if note is not None:
            return await self._end(conversation, turn, trace, "done", stop, note, started)
        unsaid = source == "automation" and not await turn.outbox()  # a scheduled task cut before a word
        outcome = await self._finish(conversation, turn, trace, "done", stop, started)
        if unsaid:
            await self._task_refused(conversation, turn.entries[0], exc)
        return outcome

    async def _outage(self, conversation: Conversation, turn: Turn, exc: ModelUnavailable, trace: dict[str, Any]) -> Outcome:
        """The endpoint is down: tell the user once, keep the turn, retry later or give up. When
        another endpoint is ready (failover), the turn is retried on it at once, untold."""
        if self.llm.standing_by():
            log.info("turn %s in %s: %s; retried at once on another endpoint", turn.id, conversation.key, exc)
            return Suspended(turn, 0.0, trace)
        state = turn.state
        now = time.time()
        since = state.outage_since = self.outages.failed(now, state.outage_since)
        state.outage_attempts += 1
        attempt = state.outage_attempts
        if now - since >= self.engine_cfg.outage_limit_s:
            log.error("turn %s in %s: model unreachable for %.0f s; giving up", turn.id, conversation.key, now - since)
            note = OUTAGE_GAVE_UP.format(waited=duration(now - since))
            return await self._end(conversation, turn, trace, "failed", Stop(StopReason.MODEL_UNREACHABLE), note)
        state.active = False  # waiting is not working: a restart meanwhile is not a crash
        told = state.outage_notice or conversation.key in self.outages.told
        self.outages.told.add(conversation.key)
        state.outage_notice = True
        if told:
            await turn.save_state()
        else:  # the flag is saved with the notice's outbox row: a crash never sends it twice
            await self._note(turn, OUTAGE_NOTICE)
        delay = outage_delay_s(attempt)
        if exc.retry_after is not None:  # the server said when (429/503 Retry-After), within reason
            delay = max(delay, min(exc.retry_after, MAX_RETRY_AFTER_S))
        log.warning("turn %s in %s: %s; retry %d in %.1f s", turn.id, conversation.key, exc, attempt, delay)
        return Suspended(turn, delay, trace, self.outages.recovered)

    async def _note(self, turn: Turn, text: str) -> None:
        """A message from the daemon itself: recorded (with the turn's state) and delivered.
        Not for a scheduled or autonomous turn (nobody wrote: no outage or failure notice
        there); its state is saved all the same."""
        if turn.entries and turn.entries[0].inbound.source != "chat":
            log.info("turn %s in %s (%s): not told: %s", turn.id, turn.chat.key, turn.entries[0].inbound.source, text)
            await turn.save_state()
            return
        shown = Message(role="assistant", content=text, note=True)
        await self.delivery.deliver(await turn.speak(text, shown=shown))

    async def _end(
        self, conversation: Conversation, turn: Turn, trace: dict[str, Any], status: str, stop: Stop, note: str,
        started: float | None = None,
    ) -> Outcome:
        """End a turn with one honest note. The note and the fact that it ends the turn are
        recorded together, so a crash before the finish finishes it, never says it twice."""
        turn.state.closing = Closing(status, str(stop))
        await self._note(turn, note)
        return await self._finish(conversation, turn, dict(trace), status, stop, started or time.monotonic())

    async def _finish(
        self, conversation: Conversation, turn: Turn, trace: dict[str, Any], status: str, stop: Stop, started: float
    ) -> Outcome:
        trace["stop_reason"] = stop.reason.value
        trace["stop_flags"] = sorted(stop.flags)
        trace["wall_s"] = round(time.monotonic() - started, 3)
        target = self.delivery.preview_target(turn.chat)
        await drop_open_streams(turn, target[0] if target else None)
        await turn.finish(status=status, trace=trace, journal_status="done" if status == "done" else "failed")
        self._metrics.turn_finished(status)
        conversation.turn_done()
        return Finished(status)
