"""The engine: intake, one actor per conversation, commands, recovery and shutdown.

Flow of a message: an adapter calls :meth:`Engine.submit`; the message is written to the
journal (for Telegram together with the next update offset) *before* the adapter acknowledges
it to the platform; a duplicate (same platform, chat and message id) is dropped here. The entry
goes to its conversation's :class:`~bumblebot.conversation.ConversationActor`, which runs turns
one at a time (:mod:`bumblebot.turn`). Replies leave through :mod:`bumblebot.delivery`.

Lifecycle: ``start()`` recovers (turns left running by a crash are marked interrupted, pending
journal entries are queued again) and begins accepting; adapters start; ``mark_ready()`` lets
turns run. ``stop()`` stops intake, lets in-flight turns finish within
``engine.shutdown_grace_s``, cancels what is left (its messages stay pending in the journal and
are answered after the next start), then stops the outbox sweeper. The store closes last, in
the CLI.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from bumblebot.adapter import Adapter
from bumblebot.config import Settings
from bumblebot.conversation import ConversationActor
from bumblebot.delivery import Delivery
from bumblebot.events import ChatRef, Inbound, Platform
from bumblebot.gate import CompletionGate
from bumblebot.knowledge import KnowledgeFile
from bumblebot.llm import LLM
from bumblebot.logs import redact_values
from bumblebot.loop import AgentLoop
from bumblebot.context import ConversationContext
from bumblebot.messages import Message, estimate_tools
from bumblebot.prompt import PromptBuilder
from bumblebot.store import Conversation, JournalEntry, Store
from bumblebot.entity import Entity
from bumblebot.toolkit import ToolContext, Toolbox
from bumblebot.turn import TurnRunner

log = logging.getLogger(__name__)

JUDGE_MAX_TOKENS = 64
OUTBOX_SWEEP_S = 30.0


class Engine:
    """The cognition engine. Collaborators come in through the constructor.

    Args:
        settings: the validated configuration.
        store: the open database.
        llm: the chat-completions client.
        toolbox: the tool registry (built by the CLI from ``tools/``).
        entity: the persona.
        secrets: values that must never be stored (tokens, keys); traces are redacted with them.
    """

    def __init__(
        self,
        settings: Settings,
        store: Store,
        llm: LLM,
        toolbox: Toolbox,
        entity: Entity,
        *,
        secrets: list[str] | None = None,
    ) -> None:
        self.settings = settings
        self._secrets = list(secrets or [])
        self.store = store
        self.llm = llm
        self.toolbox = toolbox
        self.knowledge = KnowledgeFile(settings.knowledge_path)
        tool_lines = [
            f"{s['function']['name']}: {s['function'].get('description', '').splitlines()[0] if s['function'].get('description') else ''}"
            for s in toolbox.schemas()
        ]
        self.prompts = PromptBuilder(entity, self.knowledge, tool_lines)
        self.adapters: dict[Platform, Adapter] = {}
        self.delivery = Delivery(store, self.adapters)
        self.gate = CompletionGate(self._judge)
        settings.workspace.mkdir(parents=True, exist_ok=True)
        self.loop = AgentLoop(
            llm=llm,
            toolbox=toolbox,
            gate=self.gate,
            tool_context=ToolContext(workspace=settings.workspace.resolve(), data_dir=settings.data_dir),
        )
        self.runner = TurnRunner(self)
        self.compactor: Any = None
        self.turn_slots = asyncio.Semaphore(settings.engine.max_concurrent_turns)
        self.ready = asyncio.Event()
        self._actors: dict[str, ConversationActor] = {}
        self._actor_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._accepting = False
        self._stopped = False
        self.turns_finished = 0
        self.accepted = 0
        #: reported prompt tokens / our estimate, smoothed, never below 1 (see observe_usage)
        self.token_scale = 1.0
        self._changed = asyncio.Condition()

    # -- lifecycle ---------------------------------------------------------------------------

    def register(self, adapter: Adapter) -> None:
        """Make ``adapter`` the delivery route for its platform."""
        self.adapters[adapter.platform] = adapter

    async def start(self, platforms: set[Platform] | None = None) -> None:
        """Recover from the last run and begin accepting messages.

        Args:
            platforms: the platforms this process serves; only their pending journal entries
                are recovered (``bumblebot chat`` must not answer Telegram messages). ``None``:
                every platform.

        Raises:
            RuntimeError: the engine was already started.
        """
        if self._accepting or self._stopped:
            raise RuntimeError("engine already started" if self._accepting else "engine was stopped")
        interrupted = await self.store.interrupted_turns(
            None if platforms is None else {p.value for p in platforms}
        )
        if interrupted:
            log.warning("%d turn(s) were interrupted by the last shutdown; answering them again", len(interrupted))
        self._accepting = True
        for entry in await self.store.pending_inbound():
            if platforms is None or entry.inbound.chat.platform in platforms:
                await self._dispatch(entry)
        self._spawn(self._sweep_outbox(), "bumblebot:outbox")

    def mark_ready(self) -> None:
        """Adapters are connected: let turns run (recovered ones first)."""
        self.ready.set()

    async def stop(self) -> None:
        """Stop intake, let in-flight turns finish (or cancel them after the grace period)."""
        if self._stopped:
            return
        self._stopped = True
        self._accepting = False
        self.ready.set()
        actors = list(self._actors.values())
        for actor in actors:
            actor.stop()
        running = [a.task for a in actors if a.task is not None]
        if running:
            done, pending = await asyncio.wait(running, timeout=self.settings.engine.shutdown_grace_s)
            for task in pending:
                task.cancel()
            for task in pending:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            if pending:
                log.warning("%d turn(s) did not finish in time; they will be answered after restart", len(pending))
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def observe_usage(self, prompt_tokens: int | None, estimate: int) -> None:
        """Learn how far the spec's ``len // 4`` estimate undercounts this endpoint's tokens.

        The estimate over-counts English (compaction fires early, as the spec intends) but
        undercounts dense text (CJK, code, JSON); a scale above 1 makes compaction fire in
        time there. Smoothed over requests, clamped to [1, 4].
        """
        if not prompt_tokens or estimate <= 0:
            return
        ratio = prompt_tokens / estimate
        self.token_scale = min(4.0, max(1.0, 0.7 * self.token_scale + 0.3 * ratio))

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def turn_committed(self) -> None:
        """Called by the turn runner after each commit (counts turns, wakes waiters)."""
        self.turns_finished += 1
        await self._notify()

    async def wait_until(self, predicate: Callable[[], bool], timeout: float = 10.0) -> None:
        """Wait until ``predicate()`` holds; re-checked whenever a message is accepted, a turn
        commits or a conversation unloads (for tests and tooling).

        Raises:
            TimeoutError: it did not hold within ``timeout`` seconds.
        """
        async with asyncio.timeout(timeout), self._changed:
            await self._changed.wait_for(predicate)

    async def wait_for_turns(self, n: int, timeout: float = 10.0) -> None:
        """Wait until ``n`` turns were committed since start."""
        await self.wait_until(lambda: self.turns_finished >= n, timeout)

    async def drain(self, poll_s: float = 0.05) -> None:
        """Wait until no conversation has a running or queued turn (used by ``bumblebot chat``)."""
        while any(a.busy or a.queued for a in self._actors.values()):
            await asyncio.sleep(poll_s)

    def _spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _sweep_outbox(self) -> None:
        await self.ready.wait()
        while True:
            try:
                await self.delivery.retry_pending()
            except Exception:
                log.exception("outbox sweep failed")
            await asyncio.sleep(OUTBOX_SWEEP_S)

    # -- intake ------------------------------------------------------------------------------

    @property
    def accepting(self) -> bool:
        return self._accepting

    async def submit(self, inbound: Inbound, *, kv: dict[str, str] | None = None) -> bool:
        """Journal ``inbound`` and queue it for its conversation.

        Args:
            inbound: the message.
            kv: durable values written in the same transaction (Telegram's next offset).

        Returns:
            ``True`` if accepted; ``False`` for a duplicate (already journaled) or before the
            engine started. While stopping, a message is journaled but not started: it is
            answered after the next start (platforms such as Discord never redeliver it).
        """
        if not self._accepting and not self._stopped:
            return False
        inbound = inbound.storable()
        journal_id = await self.store.journal(inbound, kv=kv)
        if journal_id is None:
            log.info("duplicate message %s in %s ignored", inbound.message_id, inbound.chat.key)
            return False
        if self._stopped:
            log.info("message %s in %s arrived while stopping; kept for the next start", inbound.message_id, inbound.chat.key)
            return True
        await self._dispatch(JournalEntry(journal_id, inbound, "pending"))
        self.accepted += 1
        await self._notify()
        return True

    async def record_handled(self, inbound: Inbound, *, kv: dict[str, str] | None = None) -> bool:
        """Journal a message answered without a turn (a command, a refusal). ``False`` if duplicate."""
        journal_id = await self.store.journal(inbound, kv=kv)
        if journal_id is None:
            return False
        await self.store.settle_journal([journal_id], "ignored")
        return True

    async def _dispatch(self, entry: JournalEntry) -> None:
        actor = await self.actor(entry.inbound.chat)
        actor.enqueue(entry)

    async def actor(self, chat: ChatRef) -> ConversationActor:
        """The live actor of ``chat`` (loaded on demand)."""
        async with self._actor_lock:
            actor = self._actors.get(chat.key)
            if actor is None:
                conversation = await self.store.conversation(chat)
                actor = ConversationActor(self, conversation)
                self._actors[chat.key] = actor
                actor.task = self._spawn(actor.run(), f"bumblebot:{chat.key}:actor")
            return actor

    def unload(self, actor: ConversationActor) -> None:
        """Forget an idle actor (called by the actor itself)."""
        if self._actors.get(actor.key) is actor:
            del self._actors[actor.key]
            self._spawn(self._notify(), "bumblebot:notify")

    @property
    def loaded_conversations(self) -> int:
        return len(self._actors)

    async def already_told(self, entries: list[JournalEntry]) -> tuple[str, ...]:
        """What interrupted earlier turns of these entries already delivered.

        Only recovered entries carry a ``turn_id`` (set when a turn began and never committed);
        a fresh message costs no query.
        """
        turn_ids = sorted({e.turn_id for e in entries if e.turn_id is not None})
        if not turn_ids:
            return ()
        sent = await self.store.outbox_sent_for_turns(turn_ids)
        return tuple(o.text for o in sent)

    async def summary_message(self, conversation: Conversation) -> Message | None:
        state = await self.store.compaction_state(conversation.id, conversation.session)
        if not state.summary:
            return None
        from bumblebot.compaction import summary_message

        return summary_message(state.summary)

    def redact(self, value: Any) -> Any:
        """``value`` (text or a JSON-like structure) without any secret or token-shaped string,
        for traces stored in SQLite."""
        return redact_values(value, self._secrets)

    # -- judges -------------------------------------------------------------------------------

    async def _judge(self, messages: list[dict[str, Any]]) -> str:
        return await self.llm.text(messages, max_tokens=JUDGE_MAX_TOKENS, temperature=0.0)

    # -- commands -----------------------------------------------------------------------------

    async def command(self, inbound: Inbound, name: str, *, kv: dict[str, str] | None = None) -> str | None:
        """Answer a command (``/start``, ``/reset``, ``/status``, ``/compact``, ``/help``).

        The command message is journaled first (with ``kv``, e.g. Telegram's next offset), so a
        redelivered command is not run twice.

        Returns the text to show, or ``None`` when this message was already handled (duplicate).
        """
        if not await self.record_handled(inbound, kv=kv):
            return None
        name = name.lower()
        if name == "start":
            return self.prompts.entity.start_text()
        if name == "help":
            return (
                "Talk to me normally. Commands: /reset starts a fresh conversation, "
                "/status shows context usage, /compact compacts the conversation now."
            )
        actor = await self.actor(inbound.chat)
        if name == "reset":
            session = await self.store.reset(actor.conversation.id)
            actor.invalidate(Conversation(actor.conversation.id, actor.conversation.chat, session))
            return "Fresh start: I've put our earlier conversation aside."
        if name == "status":
            return await self.status_text(actor)
        if name == "compact":
            if self.compactor is None:
                return "Compaction is not available."
            compactor, chat, conversation_id = self.compactor, inbound.chat, actor.conversation.id

            async def job() -> None:
                report = await compactor.force(actor)
                await self.delivery.send(conversation_id, None, chat, report)

            actor.schedule(job)  # in the actor, between turns; intake is not held up meanwhile
            return "Compacting this conversation; I'll report when it's done."
        return f"Unknown command /{name}. Try /help."

    async def context_between_turns(self, actor: ConversationActor) -> ConversationContext:
        """The conversation as the next request would carry it, without a turn's own messages
        (for ``/status`` and ``/compact``, so both report the same numbers)."""
        history, summary = await actor.load_context()
        return ConversationContext(
            system_prompt=self.prompts.system_prompt(),
            history=history,
            summary_message=summary,
            protect_first_n=self.settings.cognition.history_compression.compaction_protect_first_n,
            preamble="",
            tool_tokens=estimate_tools(self.toolbox.schemas()),
        )

    async def status_text(self, actor: ConversationActor) -> str:
        context = await self.context_between_turns(actor)
        history = context.history
        conv = actor.conversation
        estimate = context.estimate([])
        limit = self.settings.cognition.max_context_tokens
        state = await self.store.compaction_state(conv.id, conv.session)
        return (
            f"Context: ~{estimate} of {limit} tokens ({100 * estimate / limit:.0f}%), "
            f"{len(history)} messages in context.\n"
            f"Summary: {'yes' if state.summary else 'none'}; compactions so far: {state.compactions}."
        )
