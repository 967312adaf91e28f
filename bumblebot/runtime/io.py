"""The turn port: the one object through which the agent loop and the agency tools act on a
running turn (it records, delivers, streams previews, takes messages that arrive mid-turn)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from bumblebot.cognition.notes import STOPPED_NOTE, SUPERSEDED_NOTE
from bumblebot.cognition.port import TurnPort
from bumblebot.cognition.speech import DeliveryRule
from bumblebot.cognition.trace import StopReason
from bumblebot.core.adapter import Adapter, Typing
from bumblebot.core.messages import Message
from bumblebot.core.toolkit import DeliveryReport
from bumblebot.core.usage import rescope
from bumblebot.delivery import Delivery
from bumblebot.delivery.preview import LivePreview
from bumblebot.delivery.staging import FileTooLarge, StagingError
from bumblebot.llm import SayListener
from bumblebot.media import MediaUnavailable, prepared
from bumblebot.media.documents import describe_size
from bumblebot.media.kinds import sniff
from bumblebot.runtime.conversation import Conversation, Turn
from bumblebot.runtime.outage import OutageWatch
from bumblebot.runtime.turnstate import Closing
from bumblebot.store import JournalEntry, OutboxEntry

log = logging.getLogger(__name__)

#: Images sent as photos (by name and content; anything else goes as a document).
PHOTO_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".webp", ".gif"})


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
    """The turn port (:class:`~bumblebot.cognition.port.TurnPort`): the one object the agent
    loop and the agency tools use. A ``say`` comes here from the tool; the loop's delivery
    rule says whether it goes out; it is recorded through the :class:`Turn` (its outbox row)
    and sent by :class:`Delivery`, taking over the preview that streamed it
    (:class:`LivePreview`). Messages that arrive mid-turn come from the conversation's inbox."""

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
        refused: Callable[[list[JournalEntry]], Awaitable[Mapping[str, Any]]] | None = None,
    ) -> None:
        self._prepare = prepare
        #: the senders of messages a spending limit refuses now (they are not taken in)
        self._refused = refused
        # only a new turn answering people may be asked again for a burst (not a resumed one,
        # nor a scheduled one); the actor sets the event only when cognition.debounce_s > 0
        fresh = not turn.resumed and bool(turn.entries) and turn.entries[0].inbound.source == "chat"
        self.burst = conversation.inbox.burst if fresh else None
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
        self._rule: DeliveryRule | None = None

    def begin(self, rule: DeliveryRule) -> None:
        self._rule = rule

    @property
    def rule(self) -> DeliveryRule:
        if self._rule is None:
            raise RuntimeError("no agent loop runs this turn")
        return self._rule

    async def settle_burst(self) -> None:
        await self._conversation.inbox.burst_settled()

    def message_waiting(self) -> bool:
        # a paused conversation's messages wait for the resume: the running turn finishes
        return self._conversation.inbox.person_waiting and not self._conversation.paused

    def arrival(self) -> asyncio.Event:
        return self._conversation.inbox.arrival()

    async def take_steering(self, *, burst: bool = False) -> list[Message]:
        # after /reset the running turn belongs to the old session: new messages wait for the next
        inbox = self._conversation.inbox
        if not (self._steer or burst) or self._turn.session is not self._conversation.session or not inbox:
            return []
        if self._conversation.paused:
            return []  # the operator paused the conversation: new messages wait for the resume
        if self._turn.entries and self._turn.entries[0].inbound.source != "chat":
            return []  # a scheduled or autonomous turn: what people write gets its own turn
        entries = await self._admitted(inbox.take_steering())
        if not entries:
            return []
        if self._prepare is not None:  # their files fetched first (recorded in the journal)
            try:
                entries = await self._prepare(entries)
            except MediaUnavailable as exc:  # a file service is down: they get a turn of their own, which waits
                inbox.requeue(exc.entries or entries)
                return []
            if not self.steer_images and any(prepared(e).images for e in entries):
                inbox.requeue(entries)  # this turn's model may not see: a turn of their own
                return []
        if any(prepared(e).voice for e in entries):
            self._turn.state.voice_reply = self._turn.state.voice_reply or self._voice_mirror
        rescope(sender=entries[-1].inbound.sender_id)  # the turn answers them now: its next requests are theirs
        return [await self._turn.steer(entries)]

    async def _admitted(self, entries: list[JournalEntry]) -> list[JournalEntry]:
        """``entries`` without the messages of people a spending limit refuses now: those go
        back to the inbox, for a turn of their own that tells them the limit."""
        refused = await self._refused(entries) if self._refused is not None and entries else {}
        if refused:
            self._conversation.inbox.requeue([e for e in entries if e.inbound.sender_id in refused])
        return [e for e in entries if e.inbound.sender_id not in refused]

    def _voice(self) -> dict[str, Any] | None:
        """The attachment of a reply of a turn answering a voice note (``voice.reply: mirror``)."""
        return {"kind": "voice", "path": None} if self._turn.state.voice_reply else None

    async def send_file(self, path: Path, caption: str, *, call_id: str | None = None) -> DeliveryReport:
        """The ``send_file`` tool: ``path`` (absolute, checked by the tool) with ``caption``,
        through the outbox, if the delivery rule lets it go: a photo when it is an image within
        the platform's photo limit, else a document."""
        rule = self.rule
        async with rule.order:  # in call order with the step's says
            caption, shown, held = rule.admit_file(caption, str(path), call_id)
            if held is not None:
                return held
            report = await self._send_file(str(path), caption, call_id)
            report = rule.sent(shown, report, call_id=call_id)
        return report

    async def _send_file(self, path: str, caption: str, call_id: str | None) -> DeliveryReport:
        name = os.path.basename(path)
        limits = [self._delivery.upload_limit(self._turn.chat, kind) for kind in ("photo", "document")]
        if not any(limits):
            return DeliveryReport(delivered=False, error="files cannot be sent to this chat")
        try:  # what is sent, now or after a retry, is the file the tool checked: a copy of it
            path = str(await self._delivery.stage(Path(path), max(limit or 0 for limit in limits)))
        except FileTooLarge as exc:
            error = f"the file is {describe_size(exc.size)}, over the {describe_size(exc.limit)} this chat takes"
            return DeliveryReport(delivered=False, error=error)
        except (StagingError, OSError) as exc:
            return DeliveryReport(delivered=False, error=str(exc) if isinstance(exc, StagingError) else "the file could not be read")
        size = os.path.getsize(path)
        image = await asyncio.to_thread(sniff, Path(path), None, name) == "image"
        photo = self._delivery.upload_limit(self._turn.chat, "photo")
        kind = "photo" if image and Path(name).suffix.lower() in PHOTO_SUFFIXES and photo and size <= photo else "document"
        limit = self._delivery.upload_limit(self._turn.chat, kind)
        if limit is None or size > limit:
            with contextlib.suppress(OSError):
                os.unlink(path)  # the copy is not queued
        if limit is None:
            return DeliveryReport(delivered=False, error="files cannot be sent to this chat")
        if size > limit:
            return DeliveryReport(
                delivered=False, error=f"the file is {describe_size(size)}, over the {describe_size(limit)} this chat takes",
            )
        attachment = {"kind": kind, "path": self._delivery.stored_path(Path(path)), "name": name}
        entry = await self._turn.speak(caption, tool_call_id=call_id, attachment=attachment)
        return await self._delivery.deliver(entry)

    async def record(self, message: Message) -> None:
        await self._turn.record(message, trace=self._trace() if message.role == "assistant" else None)

    async def say(self, text: str, *, call_id: str | None = None) -> DeliveryReport:
        """The ``say`` tool: ``text`` as the delivery rule lets it go, recorded in the turn's
        outbox (linked to its call) and sent, taking over the preview that streamed it."""
        rule = self.rule
        async with rule.order:  # several says of one step keep call order
            text, held = rule.admit_say(text, call_id)
            if held is not None:
                return held
            live = self._bound.pop(call_id, None) if call_id else None
            # a preview too short to have started leaves nothing: an orphan may still need taking over
            stream = (await live.take() if live is not None else None) or await self._orphan()
            entry = await self._turn.speak(text, tool_call_id=call_id, stream=stream, attachment=self._voice())
            report = await self._delivery.deliver(entry)
            report = rule.sent(text, report, call_id=call_id)
        return report

    def end_turn(self) -> None:
        self.rule.end_turn()

    def think(self, thought: str) -> None:
        self.rule.think(thought)

    async def reply(self, message: Message, *, closing: str | None = None) -> DeliveryReport:
        if closing is not None:
            self._turn.state.closing = Closing("done", closing)
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
                on_shown=self.typing.pause, clean=self._clean, redactor=self._delivery.redactor,
                still_ours=self._delivery.store.holds_fence,
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
        self._turn.state.closing = Closing("done", StopReason.STOPPED.value)
        messages = [Message(role="assistant", content=text) for text in shown]
        await self._turn.record_all([*messages, Message(role="assistant", content=STOPPED_NOTE, note=True)])

    async def superseded(self) -> None:
        # recorded with the turn's end, so a crash from here on finishes the turn
        self._turn.state.closing = Closing("done", StopReason.MESSAGE_WAITING.value)
        await self._turn.record_all([Message(role="assistant", content=SUPERSEDED_NOTE, note=True)])

    async def outbox(self) -> list[OutboxEntry]:
        return await self._turn.outbox()

    async def answered(self) -> None:
        self._outages.back()
        if self._turn.state.outage_over(time.time()):  # the next outage starts a new clock
            await self._turn.save_state()
