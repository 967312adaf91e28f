"""One turn, stage by stage: route, prompt, agent loop, finish; and its resumption.

:class:`TurnRunner` is called by a conversation's actor with the journal entries that make a
turn (several waiting messages merge into one), or with a turn the last process left running.
Each step is recorded as it happens (:mod:`bumblebot.runtime.conversation`), so a turn that a crash or a
stop cut off is resumed from its last checkpoint by :meth:`TurnRunner.resume`; it is never
answered a second time from scratch.

Outcomes (what the actor does next):

* :class:`Finished`: the turn is closed (``done`` or ``failed``) with its journal entries.
* :class:`Suspended`: the model endpoint is unreachable (issue 8, "Outages"). The turn stays
  ``running`` with its entries ``pending``; the user got one notice that the answer is
  delayed; the actor calls :meth:`TurnRunner.retry` after ``retry_in`` seconds (backoff
  doubling from 1 s, capped at 60 s). After ``engine.outage_limit_s`` the turn fails with one
  honest message and its entries are marked ``failed``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import random
import sqlite3
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bumblebot.core.adapter import Adapter, Typing
from bumblebot.cognition.budget import REPLY_SHARE, ContextBudget
from bumblebot.cognition.compactor import Compactor
from bumblebot.core.config import CognitionSettings, DeliverySettings, EngineSettings, VoiceSettings
from bumblebot.cognition.context import Requests
from bumblebot.runtime.conversation import DEBOUNCE_MAX_S, Conversation, Session, Turn, merge_text
from bumblebot.delivery import Delivery
from bumblebot.media.documents import describe_size, sniff
from bumblebot.core.errors import ContextTooLong, ModelError, ModelUnavailable
from bumblebot.llm import LLM, SayListener
from bumblebot.core.logs import bind
from bumblebot.core.metrics import NO_METRICS, Metrics
from bumblebot.media import MediaFiles, MediaIntake, MediaUnavailable, answerable, prepared
from bumblebot.cognition.loop import STOPPED_NOTE, AgentLoop, LoopLimits, LoopTrace, TurnPort, max_steps
from bumblebot.core.messages import (
    MESSAGE_OVERHEAD_TOKENS,
    Message,
    estimate_text_tokens,
    estimate_tools,
)
from bumblebot.delivery.preview import LivePreview
from bumblebot.cognition.prompt import PromptBuilder, TurnInfo
from bumblebot.runtime.scheduler import Scheduler
from bumblebot.cognition.router import CLASSIFIER_MAX_TOKENS, CLASSIFIER_TEMPERATURE, Route, RouteDecision, route
from bumblebot.store import JournalEntry, OutboxEntry, RunningTurn
from bumblebot.core.toolkit import SCHEMA_LEVELS, DeliveryReport, Toolbox

log = logging.getLogger(__name__)

#: A turn resumed this many times without finishing is given up (a poison turn must not crash
#: the daemon for ever).
MAX_RESUMES = 3
#: The system prompt and tool schemas together take at most this share of the window.
FIXED_SHARE = 0.25
#: A turn's input longer than this share of the window (at 4 characters a token) is kept as
#: a file the model reads in parts, with an excerpt inline (issue 16: a long paste on a 4k window).
LONG_INPUT_SHARE = 0.4
OUTAGE_RETRY_FIRST_S = 1.0
OUTAGE_RETRY_MAX_S = 60.0
#: The router's classifier call is given up (the turn goes deliberate) after this many seconds.
CLASSIFIER_TIMEOUT_S = 10.0
#: A server's ``Retry-After`` is honoured up to this many seconds (a longer one is a guess).
MAX_RETRY_AFTER_S = 300.0

OUTAGE_NOTICE = (
    "My language model isn't reachable right now. I'll answer as soon as it's back; "
    "no need to send your message again."
)
OUTAGE_GAVE_UP = (
    "I couldn't reach my language model for {waited}, so I couldn't answer your message. "
    "Please send it again later."
)
RESUME_GAVE_UP = (
    "I was interrupted several times while working on this and stopped, to be safe. "
    "Send it again if you still need it."
)
TOO_LONG = (
    "That conversation got too long for my model even after compacting it. "
    "Send /reset to start fresh, or /compact to try again."
)
FILES_DELAYED = (
    "I can't get to the file you sent right now ({why}). I'll answer as soon as I can; no need to "
    "send it again."
)
MODEL_REFUSED = "My language model refused the request ({error}), so I couldn't answer this message."
#: Images sent as photos (by name and content; anything else goes as a document).
PHOTO_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".webp", ".gif"})
CRASHED = "Something went wrong on my side (error id {error_id}), so I couldn't answer this message."
BLIND = "(The model I run on can't see images, so I only read the text that came with your picture.)"
#: ``kv`` key: this conversation was told its images are not seen (:data:`BLIND`), once.
BLIND_TOLD_KEY = "vision.told:{key}"


@dataclass(frozen=True, slots=True)
class Finished:
    """The turn is closed."""

    status: str


@dataclass(frozen=True, slots=True)
class Suspended:
    """The endpoint is down: retry the same turn after ``retry_in`` seconds."""

    turn: Turn
    retry_in: float
    trace: dict[str, Any]
    #: set when the endpoint answers another turn: retry now instead of after ``retry_in``
    recovered: asyncio.Event | None = None


@dataclass(frozen=True, slots=True)
class Postponed:
    """The files of ``entries`` could not be fetched or transcribed for now (the platform or
    the transcription endpoint is down): no turn began; the actor queues them again after
    ``retry_in`` seconds. ``ready``: the messages that were to be answered with them and need
    nothing fetched (text, files already prepared): answered now, without waiting."""

    entries: list[JournalEntry]
    retry_in: float
    ready: list[JournalEntry] = dataclasses.field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Requeued:
    """More messages of a burst came while the turn was prepared (its files, its route): no
    turn began; ``entries`` go back to the head of the inbox and are answered with the rest
    once the burst is over (``cognition.debounce_s``)."""

    entries: list[JournalEntry]


Outcome = Finished | Suspended | Postponed | Requeued


def outage_delay_s(attempt: int) -> float:
    """Seconds before retry ``attempt`` (1, 2, …): 1, 2, 4 … capped at 60, with 20% jitter so
    conversations do not all retry at the same instant."""
    base = min(OUTAGE_RETRY_MAX_S, OUTAGE_RETRY_FIRST_S * 2 ** (attempt - 1))
    return base * random.uniform(0.8, 1.0)


def duration(seconds: float) -> str:
    """``seconds`` in words for a user: "40 seconds", "12 minutes", "2 hours"."""
    if seconds < 90:
        return f"{max(1, round(seconds))} seconds"
    if seconds < 90 * 60:
        return f"{round(seconds / 60)} minutes"
    return f"{round(seconds / 3600)} hours"


class OutageWatch:
    """What this process saw of the endpoint being down, across conversations (in memory).

    A turn that fails while an outage is already going on counts its wait from the start of
    that outage (or from the start its own state recorded, after a restart), and a conversation
    told once during an outage is not told again by a later turn (messages queued behind a
    suspended turn, ``mid_turn_messages: queue``). When any turn gets an answer again,
    :attr:`recovered` is set so every waiting turn retries at once instead of sleeping out its
    backoff.
    """

    def __init__(self) -> None:
        self.down_since: float | None = None
        self.told: set[str] = set()
        #: set when the endpoint answers after an outage; a new event per outage
        self.recovered = asyncio.Event()

    def failed(self, now: float, since: float | None = None) -> float:
        """The endpoint failed at ``now`` (epoch seconds) for a turn that has been waiting since
        ``since`` (``None``: it just started to); returns when the outage began."""
        start = now if since is None else min(since, now)
        if self.down_since is None:
            self.recovered = asyncio.Event()
            self.down_since = start
        else:
            self.down_since = min(self.down_since, start)
        return self.down_since

    def back(self) -> None:
        """The endpoint answered: the outage (if any) is over."""
        if self.down_since is not None:
            self.recovered.set()
        self.down_since = None
        self.told.clear()


async def keep_open_stream(turn: Turn, adapter: Adapter | None, entry: OutboxEntry) -> str:
    """``/stop`` after an outage or a restart: a preview left open stays as it was last
    shown (its Stop button removed); returns that text (``""``: nothing was shown)."""
    if entry.preview_id is None or not entry.text:
        await turn.settle_stream(entry, status="failed", error="stopped before it was shown")
        return ""
    if adapter is not None:
        with contextlib.suppress(Exception):
            await adapter.edit_preview(turn.chat, entry.preview_id, entry.text, final=True)
    await turn.settle_stream(entry, status="sent", text=entry.text)
    return entry.text


async def drop_open_streams(turn: Turn, adapter: Adapter | None) -> None:
    """The turn ends: a preview that a crash or an outage left open and nothing took over is
    deleted (first), then its row closed."""
    for entry in await turn.open_streams():
        turn.claim_stream(entry)
        if entry.preview_id is not None and adapter is not None:
            try:
                await adapter.delete_message(turn.chat, entry.preview_id)
            except Exception as exc:  # gone already, or too old to delete
                log.info("could not delete a preview left open in %s: %s", turn.chat.key, exc)
        await turn.settle_stream(entry, status="failed", error="preview left open; taken down at the turn's end")


class TurnIO(TurnPort):
    """The loop's view of one turn: it records through the :class:`Turn`, delivers through
    :class:`Delivery`, streams ``say`` text into the chat (:class:`LivePreview`), and takes
    messages that arrive mid-turn from the conversation's inbox."""

    def __init__(
        self,
        conversation: Conversation,
        turn: Turn,
        delivery: Delivery,
        outages: OutageWatch,
        *,
        steer: bool,
        trace: Callable[[], dict[str, Any]],
        stream_interval_s: float | None = None,
        prepare: Callable[[list[JournalEntry]], Any] | None = None,
        voice_mirror: bool = False,
        steer_images: bool = True,
    ) -> None:
        self._prepare = prepare
        # only a new turn answering people may be asked again for a burst (not a resumed one,
        # nor a scheduled one); the actor sets the event only when cognition.debounce_s > 0
        fresh = not turn.resumed and bool(turn.entries) and turn.entries[0].inbound.source == "chat"
        self.burst = conversation.burst if fresh else None
        #: ``voice.reply: mirror``: replies to a voice note go out as voice too
        self._voice_mirror = voice_mirror
        #: the turn runs on ``llm.model``: photos sent meanwhile may join it
        self.steer_images = steer_images
        self._conversation = conversation
        self._turn = turn
        self._delivery = delivery
        self._outages = outages
        self._steer = steer
        self._trace = trace
        self.transcript = turn.transcript
        self.stop = turn.stop
        #: the typing indicator of the running turn (``TurnRunner._drive`` sets it)
        self.typing = Typing()
        target = delivery.preview_target(turn.chat) if stream_interval_s is not None else None
        self._target = None if target is None else (target[0], max(target[1], stream_interval_s or 0.0))
        self._clean: Callable[[str], str] = str.strip  # what of a say being written may show (the loop's)
        self._streaming: dict[int, LivePreview] = {}  # this step's, by stream position
        self._bound: dict[str, LivePreview] = {}  # by the say call that takes them over

    async def settle_burst(self) -> None:
        conversation = self._conversation
        loop = asyncio.get_running_loop()
        give_up = loop.time() + DEBOUNCE_MAX_S
        while (left := min(conversation.settle_at, give_up) - loop.time()) > 0:
            await asyncio.sleep(left)  # a message meanwhile moves settle_at on: wait again
        conversation.burst.clear()

    async def take_steering(self, *, burst: bool = False) -> list[Message]:
        # after /reset the running turn belongs to the old session: new messages wait for the next
        if not (self._steer or burst) or self._turn.session is not self._conversation.session or not self._conversation.inbox:
            return []
        if self._turn.entries and self._turn.entries[0].inbound.source != "chat":
            return []  # a scheduled or autonomous turn: what people write gets its own turn
        entries = self._conversation.take_inbox(steering=True)
        if not entries:
            return []
        if self._prepare is not None:  # their files fetched first (recorded in the journal)
            try:
                entries = await self._prepare(entries)
            except MediaUnavailable as exc:  # a file service is down: they get a turn of their own, which waits
                self._conversation.requeue(exc.entries or entries)
                return []
            if not self.steer_images and any(prepared(e).images for e in entries):
                self._conversation.requeue(entries)  # this turn's model may not see: a turn of their own
                return []
        if any(prepared(e).voice for e in entries):
            self._turn.state["voice_reply"] = self._turn.state.get("voice_reply", False) or self._voice_mirror
        return [await self._turn.steer(entries)]


    def _voice(self) -> dict[str, Any] | None:
        """The attachment of a reply of a turn answering a voice note (``voice.reply: mirror``)."""
        return {"kind": "voice", "path": None} if self._turn.state.get("voice_reply") else None

    async def send_file(self, path: str, caption: str, *, tool_call_id: str | None) -> DeliveryReport:
        """The ``send_file`` tool: ``path`` (absolute, checked by the tool) with ``caption``,
        through the outbox: a photo when it is an image within the platform's photo limit, else
        a document."""
        size = os.path.getsize(path)
        image = await asyncio.to_thread(sniff, Path(path), None, os.path.basename(path)) == "image"
        photo = self._delivery.upload_limit(self._turn.chat, "photo")
        kind = "photo" if image and Path(path).suffix.lower() in PHOTO_SUFFIXES and photo and size <= photo else "document"
        limit = self._delivery.upload_limit(self._turn.chat, kind)
        if limit is None:
            return DeliveryReport(delivered=False, error="files cannot be sent to this chat")
        if size > limit:
            return DeliveryReport(
                delivered=False, error=f"the file is {describe_size(size)}, over the {describe_size(limit)} this chat takes",
            )
        attachment = {"kind": kind, "path": path, "name": os.path.basename(path)}
        entry = await self._turn.speak(caption, tool_call_id=tool_call_id, attachment=attachment)
        return await self._delivery.deliver(entry)

    async def record(self, message: Message) -> None:
        await self._turn.record(message, trace=self._trace() if message.role == "assistant" else None)

    async def say(self, text: str, *, tool_call_id: str | None) -> DeliveryReport:
        live = self._bound.pop(tool_call_id, None) if tool_call_id else None
        # a preview too short to have started leaves nothing: an orphan may still need taking over
        stream = (await live.take() if live is not None else None) or await self._orphan()
        entry = await self._turn.speak(text, tool_call_id=tool_call_id, stream=stream, attachment=self._voice())
        return await self._delivery.deliver(entry)

    async def reply(self, message: Message, *, closing: str | None = None) -> DeliveryReport:
        if closing is not None:
            self._turn.state["closing"] = {"status": "done", "stop_reason": closing}
        stream = None if message.note else await self._orphan()
        voice = None if message.note else self._voice()
        return await self._delivery.deliver(
            await self._turn.speak(message.content, shown=message, stream=stream, attachment=voice)
        )

    async def _orphan(self) -> OutboxEntry | None:
        """A streaming row a crash or an outage left open in this turn, for the reply about to
        be sent to take over (its message is edited into the reply, never left half-written)."""
        for entry in await self._turn.open_streams():
            self._turn.claim_stream(entry)
            return entry
        return None

    def on_say(self, clean: Callable[[str], str]) -> SayListener | None:
        self._clean = clean
        return None if self._target is None else self._preview

    def _preview(self, index: int, text: str) -> None:
        live = self._streaming.get(index)
        if live is None:
            assert self._target is not None
            adapter, interval = self._target
            # says stream one after another: an earlier one too short to have started is
            # complete now, and shows first (messages keep call order)
            for earlier, other in self._streaming.items():
                if earlier < index and not other.started:
                    other.add("", start=True)
            live = self._streaming[index] = LivePreview(
                self._turn, adapter, interval_s=interval, key=self._delivery.preview_key,
                on_shown=self.typing.pause, clean=self._clean,
            )
        live.add(text)

    def bind_say(self, index: int, call_id: str) -> None:
        live = self._streaming.pop(index, None)
        if live is not None:
            self._bound[call_id] = live

    def _previews(self) -> list[LivePreview]:
        live = [*self._streaming.values(), *self._bound.values()]
        self._streaming.clear()
        self._bound.clear()
        return live

    async def settle_previews(self) -> None:
        for live in self._previews():
            await live.withdraw()

    def restart_previews(self) -> None:
        for live in self._streaming.values():
            live.restart()

    async def pause_previews(self) -> None:
        """The turn waits (an outage) or the process stops: previews stay as they are, their
        rows open for the turn's next stream to take over."""
        for live in self._previews():
            await live.pause()

    async def keep_previews(self) -> list[str]:
        """``/stop``: what the previews show stays; returns those texts."""
        return [text for live in self._previews() if (text := await live.keep())]

    def waiting(self) -> None:
        self.typing.resume()

    def judging(self) -> None:
        self.typing.pause()

    async def stopped(self) -> None:
        shown = await self.keep_previews()
        for entry in await self._turn.open_streams():  # left open by an outage: kept as shown
            self._turn.claim_stream(entry)
            shown.append(await keep_open_stream(self._turn, self._target[0] if self._target else None, entry))
        shown = [text for text in shown if text]
        # what the user saw of a say that was still being written, then the fact of the stop;
        # recorded with the turn's end, so a crash from here on finishes the turn
        self._turn.state["closing"] = {"status": "done", "stop_reason": "stopped"}
        messages = [Message(role="assistant", content=text) for text in shown]
        await self._turn.record_all([*messages, Message(role="assistant", content=STOPPED_NOTE, note=True)])

    async def outbox(self) -> list[OutboxEntry]:
        return await self._turn.outbox()

    async def answered(self) -> None:
        self._outages.back()
        state = self._turn.state
        if "outage_since" in state:  # the wait is over: the next outage starts a new clock
            state["outage_s"] = round(state.get("outage_s", 0) + time.time() - state.pop("outage_since"), 1)
            state.pop("outage_attempts", None)
            await self._turn.save_state()


class TurnRunner:
    """Runs turns; one per engine, stateless between turns. Collaborators come in here.

    Args:
        cognition: the ``cognition`` settings.
        engine: the ``engine`` settings (typing refresh, outage limit).
        prompts: the system prompt and ``[Turn context]``.
        llm: the endpoint (the router's classifier; model names).
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
        tasks: the scheduler: whether a scheduled or autonomous entry still gets its turn, and
            the task of a chat that cannot be reached any more is cancelled.
        status_lines: more of ``/status`` for a conversation key (the MCP servers), ``""``: none.
    """

    def __init__(
        self,
        *,
        cognition: CognitionSettings,
        engine: EngineSettings,
        prompts: PromptBuilder,
        llm: LLM,
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
    ) -> None:
        self.tasks = tasks
        self.status_lines = status_lines
        self._metrics = NO_METRICS if metrics is None else metrics  # metrics hook (issue 14)
        self.media = media
        self.media_files = media_files
        self.voice = voice
        self.cfg = cognition
        self.streaming = streaming
        self.engine_cfg = engine
        self.prompts = prompts
        self.llm = llm
        self.loop = loop
        self.compactor = compactor
        self.delivery = delivery
        self.budget = budget
        self.toolbox = toolbox
        self.redact = redact
        self.outages = OutageWatch()
        self._fixed_warned = 0
        self._media_waits: dict[int, float] = {}  # journal id -> when its files first could not be fetched
        self._media_told: set[str] = set()  # conversations told their files wait

    def fixed_part(self) -> tuple[int, str, list[dict[str, Any]]]:
        """The compaction level, system prompt and tool schemas of every request, compacted
        until together they take at most :data:`FIXED_SHARE` of the window (small windows,
        issue 9): the lowest level of ``PromptBuilder.system_prompt`` and ``Toolbox.schemas``
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
                "%d-token window; raise cognition.max_context_tokens or offer fewer tools",
                tokens, FIXED_SHARE * 100, self.budget.max_context_tokens,
            )
        return level, prompt, schemas

    async def _classify(self, messages: list[dict[str, Any]]) -> str:
        # bounded: the classifier only saves work, it must never hold a turn up for long
        return await asyncio.wait_for(
            self.llm.text(messages, max_tokens=CLASSIFIER_MAX_TOKENS, temperature=CLASSIFIER_TEMPERATURE),
            CLASSIFIER_TIMEOUT_S,
        )

    async def _skipped(self, entries: list[JournalEntry]) -> str | None:
        """Why the scheduled or autonomous entry of ``entries`` gets no turn now (``None``: it does)."""
        if self.tasks is None or len(entries) != 1 or entries[0].inbound.source == "chat":
            return None
        return await self.tasks.may_run(entries[0])

    async def run(self, conversation: Conversation, entries: list[JournalEntry]) -> Outcome:
        """A new turn answering ``entries``: fetch their files, route it, record its start, run it.

        Files that could not be used are told to the user first, in one note (recorded with
        the turn's state, so a resumed turn never repeats it); when nothing is left for the
        model to answer, that note ends the turn.
        """
        with bind(conversation=conversation.key):  # log context (issue 14): the JSON log's ids
            return await self._run(conversation, entries)

    async def _run(self, conversation: Conversation, entries: list[JournalEntry]) -> Outcome:
        why = await self._skipped(entries)
        if why is not None:
            log.info("%s in %s: no turn (%s)", entries[0].inbound.message_id, conversation.key, why)
            await conversation.drop(entries)
            return Finished("skipped")
        if self.media is not None and any(e.inbound.attachments and e.media is None for e in entries):
            try:
                async with self.delivery.typing(conversation.chat, self.engine_cfg.typing_interval_s):
                    entries = await self.media.prepare(entries, final=self._waited_out(entries))
            except MediaUnavailable as exc:
                known = conversation.after_fence(exc.entries or entries)  # a /reset meanwhile set some aside
                waiting = [e for e in known if e.inbound.attachments and e.media is None]
                ready = [e for e in known if not (e.inbound.attachments and e.media is None)]
                if conversation.stop_pending:  # /stop while they were fetched: not answered after all
                    conversation.stop_pending = False
                    await conversation.drop(waiting)
                    return Postponed([], 0.0, ready)
                if not waiting:  # nothing left to wait for (a /reset set them aside)
                    return Postponed([], 0.0, ready)
                postponed = await self._postpone(conversation, waiting, exc)
                return dataclasses.replace(postponed, ready=ready)
            for entry in entries:
                self._media_waits.pop(entry.id, None)
            self._media_told.discard(conversation.key)
        if conversation.burst.is_set():
            return await self._requeue(conversation, entries)  # the burst goes on: one turn for all of it
        raw = entries
        entries = await self._fold_long(entries)
        state = await self._start_state(entries)
        if conversation.burst.is_set():
            return await self._requeue(conversation, raw)  # as they came: the next turn folds them again
        notices = [n for e in entries for n in prepared(e).notices]
        if any(prepared(e).voice for e in entries) and self.voice is not None and self.voice.reply == "mirror":
            state["voice_reply"] = True
        turn = await conversation.begin_turn(entries, state)
        if turn is None:  # /reset came while it was being prepared: set aside with the old session
            log.info("%d message(s) in %s set aside by /reset", len(entries), conversation.key)
            return Finished("set aside")
        if notices and not any(answerable(e) for e in entries):
            return await self._end(conversation, turn, {}, "done", "files_unusable", "\n".join(notices))
        if notices:
            turn.state["file_notices"] = True
            await self._note(turn, "\n".join(notices))
        return await self._drive(conversation, turn, {})

    async def _prepare_steering(self, entries: list[JournalEntry], turn: Turn) -> list[JournalEntry]:
        """Messages taken mid-turn: their files fetched, a text kept as a file when, with what
        people wrote in the turn so far, it is too long to show (a paste steered in parts)."""
        assert self.media is not None
        said = sum(len(m.content) for m in turn.transcript if m.role == "user")
        return await self._fold_long(await self.media.prepare(entries), already=said)

    async def _fold_long(self, entries: list[JournalEntry], *, already: int = 0) -> list[JournalEntry]:
        """``entries`` whose texts together (with ``already`` characters the turn holds) pass
        :data:`LONG_INPUT_SHARE` of the window (``cognition.max_context_tokens``, 4 characters
        a token) become one excerpt naming the file that keeps the whole text
        (``MediaIntake.keep_long_text``): a long paste on a small window is a document to read,
        not a request the endpoint refuses as too long."""
        limit = int(self.cfg.max_context_tokens * 4 * LONG_INPUT_SHARE)
        if self.media is None or already + sum(len(e.inbound.text) for e in entries) <= limit:
            return entries
        try:
            folded = await self.media.keep_long_text(entries, merge_text(entries))
        except OSError as exc:
            log.warning("a long message in %s could not be kept as a file (%s); it is shown whole", entries[0].inbound.chat.key, exc)
            return entries
        log.info("%d characters in %s kept as a file for the model to read", sum(len(e.inbound.text) for e in entries), entries[0].inbound.chat.key)
        return folded

    @staticmethod
    async def _requeue(conversation: Conversation, entries: list[JournalEntry]) -> Outcome:
        """The burst goes on while ``entries``' turn is prepared: back to the inbox, to be
        answered with the rest. A ``/stop`` that came meanwhile was for them: they are settled
        unanswered and what came after the stop gets a turn of its own."""
        if conversation.stop_pending:
            conversation.stop_pending = False
            await conversation.drop(entries)
            return Finished("stopped")
        return Requeued(entries)

    def _waited_out(self, entries: list[JournalEntry]) -> bool:
        """Whether the files of ``entries`` have waited ``engine.outage_limit_s`` for a service
        that stayed down: then what cannot be fetched is told as failed, not waited for."""
        started = [self._media_waits[e.id] for e in entries if e.id in self._media_waits]
        return bool(started) and time.time() - min(started) >= self.engine_cfg.outage_limit_s

    async def _postpone(self, conversation: Conversation, entries: list[JournalEntry], exc: MediaUnavailable) -> Postponed:
        """A file service is down: the messages wait (journaled, pending) and are tried again;
        the conversation is told once."""
        now = time.time()
        for entry in entries:
            self._media_waits.setdefault(entry.id, now)
        attempt = max(1, round(min(OUTAGE_RETRY_MAX_S, now - min(self._media_waits[e.id] for e in entries))))
        delay = outage_delay_s(min(7, attempt.bit_length()))
        if conversation.key not in self._media_told:
            self._media_told.add(conversation.key)
            await self.delivery.send(conversation.id, conversation.chat, FILES_DELAYED.format(why=exc))
        log.warning("files of %d message(s) in %s not fetched (%s); trying again in %.1f s", len(entries), conversation.key, exc, delay)
        return Postponed(entries, delay)

    async def _start_state(self, entries: list[JournalEntry]) -> dict[str, Any]:
        """A turn's first state: its route (spec, "Routing"), kept for every later resume."""
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
        return self.redact({
            "route": decision.route.value,
            "route_reason": decision.reason,
            "classifier_label": decision.label,
            "classifier_error": decision.classifier_error,
            "resumes": 0,
            "active": True,
            "started": time.time(),
        })

    async def resume(self, conversation: Conversation, running: RunningTurn) -> Outcome:
        """Continue a turn the last process left running, from its last checkpoint.

        A turn that had already queued the note that ends it is only finished. A turn that was
        cut off while it was working counts one resume (a turn that was waiting out an outage,
        or that a stop cut off cleanly, does not); after :data:`MAX_RESUMES` it is given up.
        """
        with bind(conversation=conversation.key, turn=running.id):  # log context (issue 14)
            return await self._resume(conversation, running)

    async def _resume(self, conversation: Conversation, running: RunningTurn) -> Outcome:
        state = await self._start_state(running.entries) if running.legacy and running.entries else {}
        turn = await conversation.resume_turn(running, state)
        if not turn.entries:  # nothing left to answer (settled meanwhile)
            await self.loop.abandon(self._io(conversation, turn), "the turn was not resumed")
            return await self._finish(conversation, turn, dict(running.trace), "failed", "nothing_to_resume", time.monotonic())
        closing = turn.state.get("closing")
        if closing:  # its last note is queued: send it if the crash kept it from going out
            await self.delivery.retry_pending({e.id for e in await turn.outbox() if e.status == "pending"})
            return await self._finish(
                conversation, turn, dict(running.trace), closing["status"], closing["stop_reason"], time.monotonic()
            )
        if turn.state.get("active", True):
            turn.state["resumes"] = int(turn.state.get("resumes", 0)) + 1
        turn.state["active"] = True
        await turn.save_state()  # counted before anything can crash again (a poison turn ends)
        log.warning("resuming turn %s in %s (resume %d)", turn.id, conversation.key, turn.state["resumes"])
        if turn.state["resumes"] > MAX_RESUMES:
            await self.loop.abandon(self._io(conversation, turn), "given up after repeated interruptions")
            return await self._end(conversation, turn, running.trace, "failed", "resume_cap", RESUME_GAVE_UP)
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
            prepare=(lambda entries: self._prepare_steering(entries, turn)) if self.media is not None else None,
            voice_mirror=self.voice is not None and self.voice.reply == "mirror",
            steer_images=steer_images,
        )

    async def retry(self, conversation: Conversation, suspended: Suspended) -> Outcome:
        """Try a suspended turn again (the endpoint may be back)."""
        suspended.turn.state["active"] = True
        return await self._drive(conversation, suspended.turn, suspended.trace)

    def _requests(
        self, session: Session, turn: Turn | None, compactor: Compactor | None, limits: LoopLimits | None = None
    ) -> Requests:
        level, prompt, schemas = self.fixed_part()
        preamble = ""
        if turn is not None:
            state = turn.state
            info = TurnInfo(inbound=turn.entries[-1].inbound, route=state.get("route", ""), now=datetime.now(UTC), level=level)
            preamble = self.prompts.preamble(info)
        return Requests(
            system_prompt=prompt,
            preamble=preamble,
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
        limit = self.cfg.max_context_tokens
        return (
            f"Context: ~{estimate} of {limit} tokens ({100 * estimate / limit:.0f}%), "
            f"{len(session.history)} messages in context.\n"
            f"Summary: {'yes' if session.summary else 'none'}; compactions so far: {session.compaction.compactions}."
        ) + (f"\n{extra}" if self.status_lines is not None and (extra := self.status_lines(conversation.key)) else "")

    async def compact_now(self, conversation: Conversation) -> str:
        """``/compact``: compact the conversation now; returns the report for the user."""
        if self.compactor is None:
            return "Compaction is not available."
        return await self.compactor.force(conversation.session, self.between_turns(conversation).fixed_tokens)

    def _limits(self, reflex: bool, source: str = "chat") -> LoopLimits:
        """The turn's profile (spec, "Routing"). The completion budget is at most
        :data:`REPLY_SHARE` of the window: servers that count prompt plus ``max_tokens``
        against it (vLLM, llama.cpp, OpenAI) would refuse a 2048-token reply in a 4k window."""
        cfg = self.cfg
        cap = int(cfg.max_context_tokens * REPLY_SHARE)
        deliberate = min(cap, cfg.deliberate_max_tokens)
        return LoopLimits(
            max_steps=max_steps(cfg.tool_continuation_rounds),
            max_tokens=min(cap, cfg.reflex_max_tokens) if reflex else deliberate,
            max_messages=cfg.max_messages_per_turn,
            escalate_tokens=deliberate if reflex else None,
            model=self.llm.reflex_model if reflex else self.llm.model,
            thinking=not reflex,
            tool_timeout_s=cfg.tool_timeout_s,
            max_tool_result_chars=int(cfg.max_tool_result_share * cfg.max_context_tokens * 4),
            silent_ok=source != "chat",
        )

    async def _drive(self, conversation: Conversation, turn: Turn, earlier: dict[str, Any]) -> Outcome:
        """Run the loop on ``turn`` until it finishes or the endpoint fails."""
        with bind(conversation=conversation.key, turn=turn.id):  # log context (issue 14)
            return await self._drive_bound(conversation, turn, earlier)

    async def _drive_bound(self, conversation: Conversation, turn: Turn, earlier: dict[str, Any]) -> Outcome:
        started = time.monotonic()
        state = turn.state
        limits = self._limits(state.get("route") == Route.REFLEX.value, turn.entries[0].inbound.source if turn.entries else "chat")
        if limits.model != self.llm.model and any(m.images for m in turn.transcript if m.role == "user"):
            # a reflex model is often a small text-only one: pictures go to the main model
            limits = dataclasses.replace(limits, model=self.llm.model)
        if limits.silent_ok and turn.entries and turn.entries[0].inbound.source == "autonomous":
            limits = dataclasses.replace(limits, max_messages=1)  # unprompted: one message at most
        trace = LoopTrace(
            steps=list(earlier.get("steps", [])), gate=list(earlier.get("gate", [])), cuts=list(earlier.get("cuts", [])),
        )
        compactions = list(earlier.get("compactions", []))
        requests: Requests | None = None

        def snapshot(**extra: Any) -> dict[str, Any]:
            out = {
                key: state.get(key) for key in ("route", "route_reason", "classifier_label", "classifier_error")
            }
            out.update(
                model=limits.model,
                max_tokens=limits.max_tokens,
                journal_ids=turn.journal_ids,
                resumes=state.get("resumes", 0),
                outage_s=state.get("outage_s"),
                steps=trace.steps,
                gate=trace.gate,
                thoughts=trace.thoughts,
                cuts=trace.cuts,
                told=trace.told,
                compactions=compactions + (requests.compactions if requests else []),
                prompt_tokens=[s["prompt_tokens"] for s in trace.steps],
                estimates=[s["estimate"] for s in trace.steps],
                **extra,
            )
            # endpoint errors can echo a key back ("Incorrect API key provided: sk-…")
            return self.redact(json.loads(json.dumps(out, default=str)))

        io = self._io(conversation, turn, snapshot, steer_images=limits.model == self.llm.model)
        try:
            await self._tell_blind(conversation, turn, limits.model)
            requests = self._requests(turn.session, turn, self.compactor, limits)
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
            state["active"] = False
            with contextlib.suppress(Exception):
                await io.pause_previews()
                await turn.save_state()
            raise
        except ModelUnavailable as exc:
            await io.pause_previews()  # the retry's stream takes the shown text over
            return await self._outage(conversation, turn, exc, snapshot(error=str(exc)))
        except ModelError as exc:
            await io.settle_previews()
            log.warning("turn %s in %s failed: %s", turn.id, conversation.key, exc)
            note = TOO_LONG if isinstance(exc, ContextTooLong) else MODEL_REFUSED.format(error=exc.status or "error")
            return await self._end(conversation, turn, snapshot(error=str(exc)), "failed", "model_error", note, started)
        except sqlite3.Error:
            raise  # a write of the turn failed: the actor reads it back and resumes it
        except Exception:
            error_id = uuid.uuid4().hex[:8]
            log.exception("turn %s in %s crashed (error id %s)", turn.id, conversation.key, error_id)
            with contextlib.suppress(Exception):
                await io.settle_previews()
            await self.loop.abandon(io, f"internal error (id {error_id})")
            note = CRASHED.format(error_id=error_id)
            return await self._end(conversation, turn, snapshot(error_id=error_id), "failed", "crash", note, started)
        await self._tell_blind(conversation, turn, limits.model)  # the endpoint refused them just now
        if result.stop_reason.startswith("undeliverable") and self.tasks is not None and turn.entries:
            await self.tasks.retire(turn.entries[0], "the chat cannot be reached")
        return await self._finish(
            conversation, turn, snapshot(delivered=len(result.delivered)), "done", result.stop_reason, started
        )

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

    async def _outage(self, conversation: Conversation, turn: Turn, exc: ModelUnavailable, trace: dict[str, Any]) -> Outcome:
        """The endpoint is down: tell the user once, keep the turn, retry later or give up."""
        state = turn.state
        now = time.time()
        since = state["outage_since"] = self.outages.failed(now, state.get("outage_since"))
        attempt = state["outage_attempts"] = int(state.get("outage_attempts", 0)) + 1
        if now - since >= self.engine_cfg.outage_limit_s:
            log.error("turn %s in %s: model unreachable for %.0f s; giving up", turn.id, conversation.key, now - since)
            note = OUTAGE_GAVE_UP.format(waited=duration(now - since))
            return await self._end(conversation, turn, trace, "failed", "model_unreachable", note)
        state["active"] = False  # waiting is not working: a restart meanwhile is not a crash
        told = state.get("outage_notice") or conversation.key in self.outages.told
        self.outages.told.add(conversation.key)
        state["outage_notice"] = True
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
        self,
        conversation: Conversation,
        turn: Turn,
        trace: dict[str, Any],
        status: str,
        stop_reason: str,
        note: str,
        started: float | None = None,
    ) -> Outcome:
        """End a turn with one honest note. The note and the fact that it ends the turn are
        recorded together, so a crash before the finish finishes it, never says it twice."""
        turn.state["closing"] = {"status": status, "stop_reason": stop_reason}
        await self._note(turn, note)
        return await self._finish(conversation, turn, dict(trace), status, stop_reason, started or time.monotonic())

    async def _finish(
        self,
        conversation: Conversation,
        turn: Turn,
        trace: dict[str, Any],
        status: str,
        stop_reason: str,
        started: float,
    ) -> Outcome:
        trace["stop_reason"] = stop_reason
        trace["wall_s"] = round(time.monotonic() - started, 3)
        target = self.delivery.preview_target(turn.chat)
        await drop_open_streams(turn, target[0] if target else None)
        await turn.finish(status=status, trace=trace, journal_status="done" if status == "done" else "failed")
        self._metrics.turn_finished(status)  # metrics hook (issue 14)
        conversation.turn_done()
        return Finished(status)
