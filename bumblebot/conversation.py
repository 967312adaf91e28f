"""One actor per conversation: turns in a conversation run strictly one at a time.

Messages that arrive while a turn runs wait in the actor's queue; in ``steer`` mode the running
turn takes them at its next step boundary, otherwise the next turn takes them all at once
(several waiting messages merge into one turn). An actor idle for ``engine.idle_unload_s``
unloads itself (its history cache goes with it) so memory stays bounded; the next message loads
the conversation again from SQLite.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from bumblebot.messages import Message
from bumblebot.store import Conversation, JournalEntry
from bumblebot.turn import merge_text

if TYPE_CHECKING:
    from bumblebot.engine import Engine

log = logging.getLogger(__name__)


class ConversationActor:
    """Serialises the turns of one conversation. Created and owned by the engine."""

    def __init__(self, engine: Engine, conversation: Conversation) -> None:
        self.engine = engine
        self.conversation = conversation
        self._queue: list[JournalEntry] = []
        self._jobs: list[Callable[[], Awaitable[None]]] = []
        self._wake = asyncio.Event()
        self._history: list[Message] | None = None
        self._stopping = False
        self.busy = False
        self.turns = 0
        self.task: asyncio.Task[None] | None = None

    @property
    def key(self) -> str:
        return self.conversation.chat.key

    @property
    def queued(self) -> int:
        return len(self._queue)

    def enqueue(self, entry: JournalEntry) -> None:
        self._queue.append(entry)
        self._wake.set()

    def schedule(self, job: Callable[[], Awaitable[None]]) -> None:
        """Run ``job`` in this actor between turns (e.g. ``/compact``), never during one."""
        self._jobs.append(job)
        self._wake.set()

    def stop(self) -> None:
        """Finish the running turn, then exit; queued entries stay pending in the journal."""
        self._stopping = True
        self._wake.set()

    def take_steering(self) -> list[tuple[Message, list[int]]]:
        """Messages that arrived during the turn, as one user message (steer mode)."""
        if not self._queue or self._stopping:
            return []
        batch, self._queue = self._queue, []
        return [(Message(role="user", content=merge_text(batch)), [e.id for e in batch])]

    async def load_context(self) -> tuple[list[Message], Message | None]:
        """The active history (cached while the actor lives) and the summary message."""
        store = self.engine.store
        if self._history is None:
            self._history = await store.history(self.conversation.id, self.conversation.session)
        summary = await self.engine.summary_message(self.conversation)
        return list(self._history), summary

    def append_history(self, messages: list[Message], session: int) -> None:
        """Add a committed turn to the cache, unless ``/reset`` started a new session meanwhile."""
        if self._history is not None and session == self.conversation.session:
            self._history.extend(messages)

    def replace_history(self, messages: list[Message]) -> None:
        self._history = list(messages)

    def invalidate(self, conversation: Conversation | None = None) -> None:
        """Drop the cached history (after /reset or an external change)."""
        if conversation is not None:
            self.conversation = conversation
        self._history = None

    async def run(self) -> None:
        """The actor's task: wait for messages, run turns, unload when idle."""
        idle = self.engine.settings.engine.idle_unload_s
        await self.engine.ready.wait()
        while True:
            if self._stopping:
                return
            if self._jobs:
                job = self._jobs.pop(0)
                try:
                    await job()
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("job in %s failed", self.key)
                continue
            if not self._queue:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), idle)
                except TimeoutError:
                    if not self._queue and not self._jobs:
                        self.engine.unload(self)
                        return
                continue
            batch, self._queue = self._queue, []
            async with self.engine.turn_slots:
                self.busy = True
                try:
                    await self.engine.runner.run(self, batch)
                    self.turns += 1
                except asyncio.CancelledError:
                    raise
                except Exception:
                    # commit failed (database trouble): the journal keeps the entries pending,
                    # so they are answered after a restart; drop the cache to stay consistent.
                    log.exception("turn in %s could not be recorded", self.key)
                    self._history = None
                finally:
                    self.busy = False
