"""The chat commands: one table that the engine answers from and every adapter offers.

Each :class:`Command` names what it does (the line a platform's command menu shows, and
``/help``) and who may run it. The engine binds each name to its handler and refuses to start
when the two disagree (``bumblebot.runtime.engine``); the Telegram adapter registers the table
with ``setMyCommands``, the Discord adapter as slash commands and text commands, the console
reads ``/name`` lines.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Command:
    """One chat command.

    Attributes:
        name: what follows the slash (lower case, as every platform wants it).
        summary: one line for a platform's command menu (Discord allows 100 characters).
        managers_only: it changes a shared conversation for everyone in it, so in a group or a
            guild channel only the chat's administrators (and allowlisted users) may run it.
        managing_args: the first arguments that make it such a command (``/tasks cancel 3``
            cancels the group's task; ``/tasks`` alone only lists them).
        answered_or_managers: in a shared chat only the person being answered and the chat's
            managers may run it (``/stop``: a member must not cut another's answer off).
        managers_see_more: anyone may run it, but in a shared chat its managers get more
            (``/usage``: the whole chat's, a member only their own).
        usage: how its arguments are used (``"/tasks cancel ID cancels one"``); ``""`` for none.
        greeting: the platform's own first message (Telegram sends ``/start`` when a person
            opens the chat); a platform without that convention leaves it out of its menu.
    """

    name: str
    summary: str
    managers_only: bool = False
    managing_args: tuple[str, ...] = ()
    answered_or_managers: bool = False
    managers_see_more: bool = False
    usage: str = ""
    greeting: bool = False

    def line(self) -> str:
        """What a command menu and ``/help`` say of it."""
        return f"{self.summary} ({self.usage})" if self.usage else self.summary


COMMANDS: tuple[Command, ...] = (
    Command("start", "About this bot", greeting=True),
    Command("stop", "Stop the answer in progress", answered_or_managers=True),
    Command("reset", "Start a fresh conversation", managers_only=True),
    Command("status", "Context usage and compaction"),
    Command("compact", "Compact the conversation now", managers_only=True),
    Command("tasks", "Scheduled tasks here", managing_args=("cancel",), usage="/tasks cancel ID cancels one"),
    Command("usage", "Tokens and cost used here", managers_see_more=True),
    Command("help", "What I can do"),
)
BY_NAME = {c.name: c for c in COMMANDS}


def needs_manager(name: str, text: str = "") -> bool:
    """Whether ``/name`` written as ``text`` (with its arguments) is for a shared chat's managers
    only: a :attr:`~Command.managers_only` command, or one with a
    :attr:`~Command.managing_args` argument."""
    command = BY_NAME.get(name)
    if command is None:
        return False
    if command.managers_only:
        return True
    args = text.split()[1:2]
    return bool(args) and args[0].lower() in command.managing_args


def asks_manager(name: str, text: str = "") -> bool:
    """Whether running ``/name`` in a shared chat depends on whether its sender manages the chat
    (:func:`needs_manager`, :attr:`~Command.answered_or_managers` or
    :attr:`~Command.managers_see_more`): the adapter then finds out."""
    command = BY_NAME.get(name)
    return needs_manager(name, text) or (
        command is not None and (command.answered_or_managers or command.managers_see_more)
    )


def help_text() -> str:
    """The answer to ``/help``: how to talk to the entity, then every command and what it does."""
    lines = ["Talk to me normally; ask me to remind you of something and I will. Commands:"]
    lines += [f"/{c.name}: {c.line()}" for c in COMMANDS if not c.greeting]
    return "\n".join(lines)
