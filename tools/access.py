"""Where each tool may be used: the ``allowed_chats`` rules of work tools and MCP servers.

A bot added to a public group must be safe to leave there, so a tool that reaches beyond the
chat it is used in (a shell, the whole workspace, an MCP server holding the owner's calendar) is
offered by default only where its user is trusted: the terminal, and private chats with
allowlisted users. The operator widens that explicitly, per tool group
(``tools.<group>.allowed_chats``) or per MCP server (``mcp.servers.<name>.allowed_chats``).

A tool learns the chat from ``ToolContext.conversation`` (at call time) and from the conversation
key the turn binds for its logs (``bumblebot.core.logs.bind``, read by ``Registry.schemas``): the
conversation key is the one fact every turn carries. Rules, any of which admits a conversation:

* ``"*"``: everywhere, also outside a conversation;
* ``"private"``: the terminal chat (``console:…``), and private chats with allowlisted users: a
  Telegram chat whose id is positive (a private chat's id is its user's) and listed in
  ``telegram.allowed_user_ids`` or ``telegram.allowed_chat_ids``; a Discord DM, when
  ``discord.allowed_user_ids`` is set (the Discord adapter knows a DM once a message came in it
  since the daemon started: a turn resumed after a restart may not get such tools). With no
  allowlist nobody is "allowlisted": such tools stay in the terminal until ``allowed_chats``
  says otherwise (an open bot must not hand a stranger the owner's shell);
* ``"telegram:*"``: every chat of a platform;
* a conversation key, e.g. ``"telegram:-1001234"``: that chat and its topics.

``allowed_chats: []`` offers the tools nowhere.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

__all__ = [
    "EVERYWHERE",
    "PRIVATE",
    "ChatAccess",
    "ToolAccess",
    "allowlisted_private_chats",
    "describe_rules",
]

#: The rule for every conversation, and the one for trusted private chats.
EVERYWHERE = "*"
PRIVATE = "private"


def _terminal(key: str) -> bool:
    return key.startswith("console:")


@dataclass(frozen=True, slots=True)
class ChatAccess:
    """Where one tool (or one server's tools) may be offered and run (the module docstring
    lists the rules).

    Args:
        rules: ``allowed_chats``.
        trusted: the ``"private"`` rule: whether a conversation key is a private chat with an
            allowlisted user (see :func:`allowlisted_private_chats`).
    """

    rules: tuple[str, ...] = (PRIVATE,)
    trusted: Callable[[str], bool] = field(default=_terminal)

    def permits(self, conversation: str) -> bool:
        """Whether ``conversation`` (a key; ``""`` outside one) may use the tools."""
        for rule in self.rules:
            if rule == EVERYWHERE:
                return True
            if not conversation:
                continue
            if rule == PRIVATE:
                if self.trusted(conversation):
                    return True
            elif rule.endswith(":*"):
                if conversation.startswith(rule[:-1]):
                    return True
            elif conversation == rule or conversation.startswith(rule + ":"):
                return True
        return False


def allowlisted_private_chats(
    *,
    telegram_user_ids: Iterable[int] = (),
    telegram_chat_ids: Iterable[int] = (),
    discord_user_ids: Iterable[int] = (),
    is_private: Callable[[str], bool] | None = None,
) -> Callable[[str], bool]:
    """The ``"private"`` rule from the platforms' allowlists.

    Args:
        telegram_user_ids: ``telegram.allowed_user_ids``.
        telegram_chat_ids: ``telegram.allowed_chat_ids`` (its positive ids are private chats).
        discord_user_ids: ``discord.allowed_user_ids``; the Discord adapter answers nobody else
            in DMs when it is set.
        is_private: whether a conversation key is a private chat, for platforms whose key does
            not say (Discord: a DM's channel id looks like any other); ``None``: Discord chats
            are never trusted by this rule (list them in ``allowed_chats``).

    Returns:
        ``trusted(key)``: ``True`` for the terminal chat and for private chats with allowlisted
        users.
    """
    telegram = {int(i) for i in telegram_user_ids} | {int(i) for i in telegram_chat_ids if int(i) > 0}
    discord = bool(set(discord_user_ids))

    def trusted(key: str) -> bool:
        platform, _, rest = key.partition(":")
        chat = rest.split(":", 1)[0]
        if platform == "console":
            return bool(chat)
        if platform == "telegram":
            try:
                chat_id = int(chat)
            except ValueError:
                return False
            return chat_id > 0 and chat_id in telegram
        if platform == "discord":
            return discord and is_private is not None and is_private(key)
        return False

    return trusted


def describe_rules(rules: Iterable[str]) -> str:
    """``allowed_chats`` in words, for ``check``: ``"everywhere"``, ``"in the terminal and
    allowlisted users' private chats, telegram:-100123"``, ``"nowhere"``."""
    words = []
    for rule in rules:
        if rule == EVERYWHERE:
            return "everywhere"
        if rule == PRIVATE:
            words.append("the terminal and allowlisted users' private chats")
        elif rule.endswith(":*"):
            words.append(f"every {rule[:-2]} chat")
        else:
            words.append(rule)
    return f"in {', '.join(words)}" if words else "nowhere"


@dataclass(frozen=True, slots=True)
class ToolAccess:
    """Where a registry's own tools may be used, and which conversations see the whole workspace.

    Args:
        tools: a tool's rule by its name; a tool not named here is offered everywhere (the
            agency tools, ``say`` and ``end_turn``, always are).
        workspace: the conversations whose file tools reach the whole workspace
            (``tools.files.shared_chats``); elsewhere they reach only the chat's own folder
            (``inbox/<chat>``, where the files people send there land). ``None``: everywhere.
    """

    tools: Mapping[str, ChatAccess] = field(default_factory=dict)
    workspace: ChatAccess | None = None

    def permits(self, name: str, conversation: str) -> bool:
        """Whether tool ``name`` may be offered and run in ``conversation``."""
        rule = self.tools.get(name)
        return rule is None or rule.permits(conversation)

    def whole_workspace(self, conversation: str) -> bool:
        """Whether the file tools of ``conversation`` reach the whole workspace."""
        return self.workspace is None or self.workspace.permits(conversation)

    @property
    def restricts(self) -> bool:
        """Whether any tool is offered somewhere and not elsewhere."""
        return any(rule.rules != (EVERYWHERE,) for rule in self.tools.values())
