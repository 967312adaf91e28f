"""Commands: from a chat (``/stop``, ``/reset``, ``/tasks cancel 3``…) and from the operator.

:class:`EngineCommands` is the part of :class:`~bumblebot.runtime.engine.Engine` that answers
them (the engine is made of it and its intake). A chat's command is journaled first, then run
by its handler. The operator's actions (the web console) go the same way: :meth:`~EngineCommands.operate`
journals a command from the sender ``operator`` (source ``console``, status ``ignored``) in the
chat and runs the same handler with a manager's rights; each is published on the live event bus
(:mod:`bumblebot.core.activity`), so it shows in the journal and on the console.

The operator may also **pause** a conversation (no turn runs there and its tasks do not fire:
messages are journaled and wait, a turn running then finishes; on resume the waiting messages
are answered in one turn, or set aside unanswered like ``/reset`` sets them aside, and a task
that fell due meanwhile fires once) and **block** a person (platform and sender id: their
messages and commands are journaled ``ignored`` and never answered, in any chat). Both survive a
restart (``bumblebot/store/operator.py``); the engine keeps them in memory.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Awaitable, Callable

from bumblebot.cognition.prompt import PromptBuilder
from bumblebot.core.activity import Activity
from bumblebot.core.commands import BY_NAME, help_text, needs_manager
from bumblebot.core.events import ChatKind, ChatRef, Inbound, Platform, storable_text
from bumblebot.delivery import Delivery
from bumblebot.runtime.actor import ConversationActor
from bumblebot.runtime.runner import TurnRunner
from bumblebot.runtime.ownership import Ownership
from bumblebot.runtime.scheduler import Scheduler, TaskError
from bumblebot.runtime.usage_report import UsageReport
from bumblebot.store import Store
from bumblebot.store.connection import FENCE

log = logging.getLogger(__name__)

#: Answers to a command its sender may not run in a shared chat (see ``bumblebot/core/commands.py``).
NOT_MANAGER_TEXT = "Only the admins of this chat can do that here."
NOT_ANSWERED_TEXT = "Only the person I'm answering, or an admin of this chat, can stop this."
NOTHING_TO_STOP_TEXT = "Nothing to stop: I'm not working on anything here."

#: The commands that act on the conversation's actor: run by the worker holding the
#: conversation (relayed there when they arrive at another, ``bumblebot/runtime/ownership.py``).
ACTOR_COMMANDS = frozenset({"stop", "reset", "status", "compact"})
#: The operator's actions on a conversation (:meth:`EngineCommands.operate`).
ACTIONS = ("stop", "reset", "compact", "cancel_task", "pause", "resume", "resume_set_aside")
#: Who the operator's actions are journaled and published as.
OPERATOR = "operator"
#: The journal's ``source`` of the operator's actions.
CONSOLE_SOURCE = "console"
#: The chat id the operator's blocks are journaled in (they belong to no conversation).
OPERATOR_CHAT = "operator"


class EngineCommands:
    """Commands from a chat and the operator's actions: a part of the engine (module docstring)."""

    _store: Store
    _runner: TurnRunner
    _delivery: Delivery
    _prompts: PromptBuilder
    _scheduler: Scheduler | None
    _actors: dict[str, ConversationActor]
    _commands: dict[str, Callable[[Inbound, int, bool], Awaitable[str]]]
    activity: Activity
    #: the keys of the paused conversations, and the blocked ``(platform, sender id)``
    _paused: set[str]
    _blocked: set[tuple[str, str]]
    #: each conversation's title as last written
    _titles: dict[str, str]
    _actor: Callable[[ChatRef], Awaitable[ConversationActor]]
    reply: Callable[[ChatRef, str], Awaitable[None]]
    _elsewhere: Callable[[ChatRef], Awaitable[bool]]
    _ownership: Ownership | None
    relay_command: Callable[[Inbound, str, int, bool], Awaitable[None]]
    relay_operation: Callable[[ChatRef, str, str], Awaitable[None]]
    _operated = itertools.count()  # message ids of the operator's journal rows

    # -- commands from a chat -------------------------------------------------------------------

    async def command(
        self, inbound: Inbound, name: str, *, kv: dict[str, str] | None = None, manager: bool = False
    ) -> str | None:
        """Answer a command (``/start``, ``/stop``, ``/reset``, ``/status``, ``/compact``, ``/help``,
        ``/tasks``, ``/usage``; the arguments, like ``/tasks cancel 3``, are read from ``inbound.text``).

        ``/stop`` is handled here, outside the conversation's actor: it cancels the turn running
        there (its model call is aborted; see ``TurnRunner``), whatever the turn is waiting on.
        In a shared chat only the person being answered and the chat's managers (``manager``:
        the adapter found the sender to be an admin or allowlisted) may stop it.

        The command message is journaled first (with ``kv``, e.g. Telegram's next offset), so a
        redelivered command is not run twice. ``/reset`` is a fence: the running
        turn stops and finishes in the old session, messages sent before it that no turn has
        begun answering are set aside, and what comes after belongs to the new session
        (:meth:`ConversationActor.reset`).

        Returns the text to show (without a secret: adapters show it as it is), or ``None``
        when this message was already handled (duplicate).
        """
        journal_id = await self._store.journal(inbound.storable(), kv=kv, status="ignored")
        if journal_id is None:
            return None
        if self.blocked(inbound):
            log.info("command /%s of blocked sender %s in %s ignored", name, inbound.sender_id, inbound.chat.key)
            return None
        await self._titled(inbound)
        handler = self._commands.get(name.lower())
        if handler is None:
            return f"Unknown command /{name}. Try /help."
        manager = manager or inbound.chat_kind is ChatKind.PRIVATE
        if not manager and needs_manager(name.lower(), inbound.text):
            return NOT_MANAGER_TEXT
        if name.lower() in ACTOR_COMMANDS and await self._elsewhere(inbound.chat):
            await self.relay_command(inbound, name.lower(), journal_id, manager)  # its worker answers
            return None
        return await self._run_command(inbound, name.lower(), journal_id, manager)

    async def _run_command(self, inbound: Inbound, name: str, journal_id: int, manager: bool) -> str:
        """Run command ``name`` here, where its conversation's actor is; the text to show. A
        worker's writes for the conversation carry its lease, as its actor's do."""
        fence = FENCE.set(self._ownership.fence(inbound.chat.key) if self._ownership is not None else None)
        try:
            return self._delivery.redactor.shown(await self._commands[name](inbound, journal_id, manager))
        finally:
            FENCE.reset(fence)

    def _command_handlers(self) -> dict[str, Callable[[Inbound, int, bool], Awaitable[str]]]:
        """Each command of :data:`~bumblebot.core.commands.COMMANDS` with its handler."""
        handlers = {
            "start": self._start_command, "help": self._help_command, "tasks": self._tasks_command,
            "stop": self._stop_command, "reset": self._reset_command, "status": self._status_command,
            "compact": self._compact_command, "usage": UsageReport(self._store).command,
        }
        if set(handlers) != set(BY_NAME):  # a command added to the table needs its handler here
            raise RuntimeError(f"commands without a handler or entry: {sorted(set(handlers) ^ set(BY_NAME))}")
        return handlers

    async def _start_command(self, inbound: Inbound, journal_id: int, manager: bool) -> str:
        return self._prompts.entity.start_text()

    async def _help_command(self, inbound: Inbound, journal_id: int, manager: bool) -> str:
        return help_text()

    async def _stop_command(self, inbound: Inbound, journal_id: int, manager: bool) -> str:
        running = self._actors.get(inbound.chat.key)
        if running is not None and not manager and inbound.sender_id not in running.answering():
            return NOT_ANSWERED_TEXT if running.busy or running.waiting else NOTHING_TO_STOP_TEXT
        if running is None or not running.stop_turn():
            return NOTHING_TO_STOP_TEXT
        return "Stopped."

    async def _reset_command(self, inbound: Inbound, journal_id: int, manager: bool) -> str:
        stopped, aside = await (await self._actor(inbound.chat)).reset(journal_id)
        return _reset_text(stopped, aside)

    async def _status_command(self, inbound: Inbound, journal_id: int, manager: bool) -> str:
        return self._runner.status((await self._actor(inbound.chat)).conversation)

    async def _compact_command(self, inbound: Inbound, journal_id: int, manager: bool) -> str:
        actor = await self._actor(inbound.chat)
        runner, chat, conversation = self._runner, inbound.chat, actor.conversation

        async def job() -> None:
            await self.reply(chat, await runner.compact_now(conversation, inbound.sender_id))

        actor.schedule(job)  # in the actor, between turns; intake is not held up meanwhile
        return "Compacting this conversation; I'll report when it's done."

    async def _tasks_command(self, inbound: Inbound, journal_id: int, manager: bool) -> str:
        """``/tasks`` lists the conversation's tasks; ``/tasks cancel ID`` cancels one."""
        if self._scheduler is None:
            return "Scheduled tasks are not available."
        args = inbound.text.split()[1:]
        key = inbound.chat.key
        if not args:
            return self._scheduler.listing(await self._scheduler.tasks(key))
        number = args[1].lstrip("#") if len(args) == 2 else ""
        if len(args) == 2 and args[0].lower() == "cancel" and number.isascii() and number.isdigit() and len(number) < 12:
            task_id = int(number)
            try:
                await self._scheduler.cancel(key, task_id)
            except TaskError as exc:
                return f"Not cancelled: {exc}."
            return f"Cancelled task #{task_id}."
        return "Use /tasks to list the scheduled tasks here, or /tasks cancel ID to cancel one."



    # -- the operator ---------------------------------------------------------------------------

    async def operate(self, chat: ChatRef, action: str, *, argument: str = "") -> str:
        """Do one of :data:`ACTIONS` in ``chat`` for the operator, with a manager's rights:
        journaled first as the command ``/<action> <argument>`` from :data:`OPERATOR` (source
        :data:`CONSOLE_SOURCE`, ``ignored``), then done as that command from the chat is, and
        published on the live event bus. ``cancel_task`` takes the task id as ``argument``.
        Returns the text to show the operator."""
        if action not in ACTIONS:
            return f"Unknown action {action!r}."
        if await self._elsewhere(chat):  # another worker runs the chat: it does it there
            await self.relay_operation(chat, action, argument)
            return f"Passed to the worker running {chat.key}: /{action} {argument}".strip()
        key = chat.key
        inbound, journal_id = await self._journal_operator(chat, f"/{action} {argument}".strip())
        if action == "pause":
            text = await self._pause(chat)
        elif action in ("resume", "resume_set_aside"):
            text = await self._resume(chat, journal_id if action == "resume_set_aside" else None)
        elif action == "cancel_task":
            text = await self._cancel_task(key, argument)
        elif action == "compact":
            text = await self._operator_compact(chat)
        else:
            handler = self._commands[action]
            text = self._delivery.redactor.shown(await handler(inbound, journal_id, True))
        kind = {"pause": "paused", "resume": "resumed", "resume_set_aside": "resumed"}.get(action, "action")
        self.activity.publish(key, kind, by=OPERATOR, what=action, argument=argument, result=text)
        log.info("operator: /%s %s in %s: %s", action, argument, key, text)
        return text

    async def block(self, platform: Platform, sender_id: str) -> str:
        """Block ``sender_id`` on ``platform`` (journaled in the chat :data:`OPERATOR_CHAT` of
        that platform, published as ``blocked``): their later messages and commands are
        journaled ``ignored`` and never answered, in any chat. Messages already waiting stay."""
        return await self._blocking(Platform(platform), sender_id, block=True)

    async def unblock(self, platform: Platform, sender_id: str) -> str:
        """Undo :meth:`block`: their next messages are answered again."""
        return await self._blocking(Platform(platform), sender_id, block=False)

    def paused(self, key: str) -> bool:
        """Whether the operator paused the conversation ``key``."""
        return key in self._paused

    def blocked(self, inbound: Inbound) -> bool:
        """Whether ``inbound`` is from a person the operator blocked."""
        return inbound.source == "chat" and (inbound.chat.platform.value, inbound.sender_id) in self._blocked

    async def _load_operated(self) -> None:
        """The pauses and blocks as the store keeps them (at start)."""
        self._paused = await self._store.paused_conversations()
        self._blocked = await self._store.blocked_senders()

    async def _titled(self, inbound: Inbound) -> None:
        """Write the chat's title when it is not the one last written (once per change)."""
        key, title = inbound.chat.key, storable_text(inbound.chat_title)
        if title and self._titles.get(key) != title:
            await self._store.set_title(key, title)
            self._titles[key] = title

    async def _journal_operator(self, chat: ChatRef, text: str) -> tuple[Inbound, int]:
        kind = await self._store.chat_kind(chat) if chat.chat_id != OPERATOR_CHAT else ChatKind.PRIVATE
        inbound = Inbound(
            chat=chat, message_id=f"{CONSOLE_SOURCE}:{time.time_ns()}:{next(self._operated)}", sender_id=OPERATOR,
            sender_name=OPERATOR, text=text, chat_kind=kind, source=CONSOLE_SOURCE,
        )
        journal_id = await self._store.journal(inbound, status="ignored")
        assert journal_id is not None  # the message id is new
        return inbound, journal_id

    async def _pause(self, chat: ChatRef) -> str:
        if chat.key in self._paused:
            return "Already paused."
        actor = await self._actor(chat)  # the conversation's row exists from here on
        await self._store.set_paused(chat.key, True)  # first: a restart keeps it paused
        self._paused.add(chat.key)
        actor.set_paused(True)
        running = " The turn running now finishes (stop it to end it now)." if actor.busy else ""
        return f"Paused: messages here wait and its tasks do not fire until you resume it.{running}"

    async def _resume(self, chat: ChatRef, set_aside: int | None) -> str:
        """Resume; with ``set_aside`` (the journal id of the action: a fence, as ``/reset``'s)
        the messages from people that wait are settled unanswered first."""
        if chat.key not in self._paused:
            return "Not paused."
        actor = await self._actor(chat)
        aside = actor.inbox.set_aside(set_aside) if set_aside is not None else []
        if aside:
            await actor.conversation.drop(aside)
        await self._store.set_paused(chat.key, False)
        self._paused.discard(chat.key)
        actor.set_paused(False)
        if self._scheduler is not None:
            self._scheduler.changed.set()  # a task that fell due meanwhile fires now, once
        if aside:
            return f"Resumed; {_messages(len(aside))} set aside, never to be answered."
        waiting = sum(e.inbound.source == "chat" for e in actor.inbox.entries)
        return f"Resumed; {_messages(waiting)} waiting will be answered." if waiting else "Resumed."

    async def _cancel_task(self, key: str, argument: str) -> str:
        number = argument.strip().lstrip("#")
        if self._scheduler is None:
            return "Scheduled tasks are not available."
        if not (number.isascii() and number.isdigit() and len(number) < 12):
            return "Not cancelled: give the task's number."
        try:
            await self._scheduler.cancel(key, int(number))
        except TaskError as exc:
            return f"Not cancelled: {exc}."
        return f"Cancelled task #{int(number)}."

    async def _operator_compact(self, chat: ChatRef) -> str:
        """``/compact`` in the actor, between turns; its report goes to the event bus, not the chat."""
        actor = await self._actor(chat)
        runner, conversation, activity = self._runner, actor.conversation, self.activity

        async def job() -> None:
            report = await runner.compact_now(conversation, OPERATOR)
            activity.publish(chat.key, "action", by=OPERATOR, what="compacted", result=report)

        actor.schedule(job)
        return "Compacting this conversation; the report follows when it is done."

    async def _blocking(self, platform: Platform, sender_id: str, *, block: bool) -> str:
        action = "block" if block else "unblock"
        chat = ChatRef(platform, OPERATOR_CHAT)
        await self._journal_operator(chat, f"/{action} {sender_id}")
        if block:
            changed = await self._store.block_sender(platform.value, sender_id)
            self._blocked.add((platform.value, sender_id))
            text = f"Blocked {platform.value} user {sender_id}." if changed else "Already blocked."
        else:
            changed = await self._store.unblock_sender(platform.value, sender_id)
            self._blocked.discard((platform.value, sender_id))
            text = f"Unblocked {platform.value} user {sender_id}." if changed else "Not blocked."
        self.activity.publish(
            chat.key, "blocked" if block else "unblocked", by=OPERATOR, what=action, platform=platform.value,
            sender=sender_id, result=text,
        )
        log.info("operator: %s %s user %s: %s", action, platform.value, sender_id, text)
        return text


def _messages(n: int) -> str:
    return f"{n} message{'s' if n != 1 else ''}"


def _reset_text(stopped: bool, aside: int) -> str:
    """The answer to ``/reset``: what it stopped and set aside."""
    text = "Fresh start: I've put our earlier conversation aside"
    if stopped:
        text += " and stopped what I was working on"
    if aside:
        text += f"; the {aside} message{'s' if aside > 1 else ''} you sent before it will not be answered"
    return text + "."
