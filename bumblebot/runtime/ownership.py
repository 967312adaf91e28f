"""Which conversations this process runs, when several workers share one PostgreSQL store.

Alone (SQLite, or no cluster), the engine runs every conversation. As a worker of a cluster
(``bumblebot/cluster/``), it runs only the conversations whose lease it holds
(:class:`Ownership`): a message it journals for another worker's conversation stays in the
journal for that worker, which reads it there (:meth:`OwnedConversations.collect`); a
conversation nobody holds (new, or its worker died) is claimed by the first worker that sees
work for it, and **adopted**: its turns cut off by the dead worker are resumed and its waiting
messages queued, as a start does for every conversation of a single process. A conversation
whose lease is lost is **dropped** at once: its actor is cancelled, and whatever it had under
way stays recorded for the next holder. Every write of an adopted conversation's actor carries
its lease's fencing token (:data:`~bumblebot.store.connection.FENCE`).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import logging
import random
from typing import Any, Protocol

from bumblebot.core.errors import LeaseLost
from bumblebot.core.events import Attachment, ChatRef, Inbound
from bumblebot.runtime.actor import ConversationActor, Progress
from bumblebot.delivery import Delivery
from bumblebot.store import JournalEntry, Store
from bumblebot.store.connection import FENCE, Fence

log = logging.getLogger(__name__)

#: the role of the one worker that runs retention for the cluster
HOUSEKEEPING_ROLE = "housekeeping"


class Ownership(Protocol):
    """The conversations this worker holds (``bumblebot.cluster.Membership``)."""

    def owns(self, key: str) -> bool:
        """Whether this worker holds conversation ``key`` now."""

    async def claim(self, key: str) -> bool:
        """Take conversation ``key`` if nobody holds it; ``True`` when this worker now does."""

    def fence(self, key: str) -> Fence | None:
        """The fence the writes of conversation ``key`` carry (``None``: not held)."""

    def leads(self, role: str) -> bool:
        """Whether this worker holds the cluster-wide ``role`` now (it is taken when free)."""

    def held(self) -> list[str]:
        """The keys of the conversations this worker holds."""

    async def give_up(self, key: str) -> None:
        """Hold conversation ``key`` no more (released at once, if still held)."""


class OwnedConversations:
    """The engine's side of a cluster: adopting, dropping, and reading the journal for the
    conversations held (part of :class:`~bumblebot.runtime.engine.Engine`)."""

    _store: Store
    _actors: dict[str, ConversationActor]
    _ownership: Ownership | None
    _dispatched: dict[int, str]
    _adopting: set[str]
    _held_back: dict[str, list[JournalEntry]]
    _accepting: bool
    _stopped: bool
    _delivery: Delivery
    progress: Progress

    async def _actor(self, chat: ChatRef) -> ConversationActor: ...

    async def _dispatch(self, entry: JournalEntry, *, adopting: bool = False) -> None: ...

    async def reply(self, chat: ChatRef, text: str) -> None: ...

    async def _load_operated(self) -> None: ...

    async def edit(self, inbound: Inbound) -> bool: ...

    async def _run_command(self, inbound: Inbound, name: str, journal_id: int, manager: bool) -> str: ...

    async def _elsewhere(self, chat: ChatRef) -> bool:
        """Whether another worker holds ``chat`` (a command or an edit for it is relayed there);
        a conversation nobody holds is taken here first."""
        if self._ownership is None or self._ownership.owns(chat.key):
            return False
        return not await self.take(chat)

    async def take(self, chat: ChatRef) -> bool:
        """Claim ``chat`` if nobody holds it, and adopt it; whether this worker holds it now.
        Until its adoption is done, nothing else queues work for it here: a message queued
        before its cut-off turn is resumed would be answered before the messages that turn
        answers."""
        assert self._ownership is not None
        if chat.key in self._adopting:
            return True
        self._adopting.add(chat.key)
        try:
            if not await self._ownership.claim(chat.key):
                return self._ownership.owns(chat.key)
            await self.adopt(chat)
            return True
        finally:
            self._adopting.discard(chat.key)
            for entry in self._held_back.pop(chat.key, []):  # journaled meanwhile: after what adopt queued
                if self._ownership.owns(chat.key):
                    await self._dispatch(entry)

    async def relay_command(self, inbound: Inbound, name: str, journal_id: int, manager: bool) -> None:
        """Pass a command that needs the conversation's actor to the worker holding it; its
        answer is sent from there."""
        await self._store.relay(inbound.chat.key, "command", {"journal_id": journal_id, "name": name, "manager": manager})

    async def relay_operation(self, chat: ChatRef, action: str, argument: str) -> None:
        """Pass an operator's action (the web console's pause, stop, reset…) to the chat's worker."""
        await self._store.relay(chat.key, "operate", {"action": action, "argument": argument})

    async def operate(self, chat: ChatRef, action: str, *, argument: str = "") -> str: ...

    async def relay_edit(self, inbound: Inbound) -> None:
        await self._store.relay(inbound.chat.key, "edit", {
            "message_id": inbound.message_id, "text": inbound.text, "quote": inbound.quote,
            "attachments": [a.to_json() for a in inbound.attachments],
        })

    async def _relayed(self) -> None:
        """Do what other workers relayed for the conversations held here, in order."""
        assert self._ownership is not None
        relayed = await self._store.take_relayed(self._ownership.held())
        for key, kind, payload in relayed:
            if kind == "command":
                entry = await self._store.journal_entry(int(payload["journal_id"]))
                if entry is not None:
                    answer = await self._run_command(entry.inbound, str(payload["name"]), entry.id, bool(payload["manager"]))
                    await self.reply(entry.inbound.chat, answer)
            elif kind == "operate":
                await self.operate(ChatRef.from_key(key), str(payload["action"]), argument=str(payload["argument"]))
            elif kind == "edit":
                chat = ChatRef.from_key(key)
                pending = [e for e in await self._store.pending_inbound() if e.inbound.chat.key == key
                           and e.inbound.message_id == payload["message_id"]]
                if pending:
                    await self.edit(dataclasses.replace(
                        pending[0].inbound, chat=chat, text=str(payload["text"]), quote=str(payload["quote"]),
                        attachments=[Attachment.from_json(a) for a in payload["attachments"]],
                    ))
        if relayed:
            await self.progress.notify()

    def _fenced(self, key: str) -> contextvars.Context | None:
        """The context an actor's task runs in: its conversation's fence set (``None``: alone).

        Raises:
            LeaseLost: a worker of a cluster that does not hold ``key`` runs no actor for it.
        """
        if self._ownership is None:
            return None
        fence = self._ownership.fence(key)
        if fence is None:
            raise LeaseLost(f"{key} is not held by this worker")
        context = contextvars.copy_context()
        context.run(FENCE.set, fence)
        return context

    def _owned(self, entry: JournalEntry) -> bool:
        return self._ownership is None or self._ownership.owns(entry.inbound.chat.key)

    async def adopt(self, chat: ChatRef) -> None:
        """Run conversation ``chat``, just claimed: resume its turns left running, queue its
        waiting messages."""
        if not self._accepting or self._stopped:
            return
        await self._load_operated()  # the operator may have paused it on its last worker
        running = await self._store.running_turns(chat=chat)
        if running:
            log.warning("%s: taking over %d turn(s) another worker left running", chat.key, len(running))
        for turn in running:
            (await self._actor(chat)).resume(turn)
        resumed = {t.id for t in running}
        unsent = {row.id for row in await self._store.outbox_pending(chat) if row.turn_id not in resumed}
        if unsent:  # replies its last worker left unsent (its resumed turns send theirs first): now
            self._delivery.retry_later(unsent)
        for entry in await self._store.pending_inbound(chat):
            if entry.turn_id is None:  # one a resumed turn had taken answers with it
                await self._dispatch(entry, adopting=True)
        await self.progress.notify()

    def at_rest(self, key: str) -> bool:
        """Whether conversation ``key`` has nothing under way here (no turn, job or message
        queued, nothing being sent): a worker over its share may give it up."""
        actor = self._actors.get(key)
        if actor is not None and (actor.working or actor.waiting or actor.compacting or actor.queued):
            return False
        return key not in self._adopting and key not in self._dispatched.values() and not self._delivery.busy(key)

    async def drop(self, key: str, *, released: bool = False) -> None:
        """Stop running conversation ``key`` at once: its lease is gone (another worker may
        hold it already), or this worker gave it up idle (``released``). What its actor had
        under way stays recorded for the next holder."""
        self._dispatched = {i: k for i, k in self._dispatched.items() if k != key}  # the next holder queues them
        self._delivery.forget(key)  # its replies waiting out the platform are the next holder's
        actor = self._actors.pop(key, None)
        if actor is None or actor.task is None:
            return
        if not released:
            log.warning("%s: lease lost; this worker no longer runs it", key)
        actor.stop()
        actor.task.cancel()
        with contextlib.suppress(BaseException):
            await actor.task

    async def let_go(self, key: str, fence: Fence | None) -> None:
        """Its actor, run under ``fence``, found conversation ``key``'s lease lost. Still held
        under that fence (another worker took it, unseen yet; or it lapsed and a renewal
        revived it), it is let go here: taken again by the first worker that sees work for
        it, and adopted, its cut-off turn resumed; never left held with nobody running it. A
        newer hold of it here (a new actor) is left alone."""
        if self._ownership is None or self._ownership.fence(key) != fence:
            return
        await self.drop(key, released=True)
        await self._ownership.give_up(key)

    async def catch_up(self, chat: ChatRef, before: int) -> None:
        """Queue the messages of ``chat`` journaled before ``before`` by other workers that this
        one has not read yet (by webhook any worker journals): a message taken here must not go
        before them."""
        for entry in await self._store.pending_inbound(chat):
            if entry.id < before and entry.turn_id is None:
                await self._dispatch(entry)

    async def collect(self) -> None:
        """Read the journal for work of this worker: messages another worker journaled for a
        conversation held here, then what other workers relayed here, and the conversations
        with work that nobody holds (claimed, then adopted). Called by the cluster's loop."""
        if self._ownership is None or not self._accepting or self._stopped:
            return
        queued = set(self._dispatched)  # before the read: those not pending in it are settled for good
        pending = await self._store.pending_inbound()
        for settled in queued - {e.id for e in pending}:
            self._dispatched.pop(settled, None)
        fresh = [e for e in pending if e.turn_id is None and e.id not in self._dispatched
                 and self._ownership.owns(e.inbound.chat.key) and e.inbound.chat.key not in self._adopting]
        for entry in fresh:
            await self._dispatch(entry)  # journaled by another worker
        if fresh:
            await self.progress.notify()
        await self._relayed()  # after: an edit relayed here finds its message queued
        unheld = [chat for chat in await self._store.unheld_work() if chat.key not in self._adopting]
        random.shuffle(unheld)  # the workers reading together do not all reach for the same ones first
        await asyncio.gather(*(self.take(chat) for chat in unheld))  # a dead worker's many chats at once


def spawn_in(context: contextvars.Context | None, **kwargs: Any) -> dict[str, Any]:
    """``asyncio.create_task`` keywords that run a task in ``context`` (if any)."""
    return {**kwargs, "context": context} if context is not None else kwargs
