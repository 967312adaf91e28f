"""Discord markup made readable for the model (pure functions, no discord.py import).

Discord message content carries mention tokens (Discord developer docs, "Message Formatting"):
``<@id>`` and the legacy ``<@!id>`` (user), ``<#id>`` (channel), ``<@&id>`` (role),
``<:name:id>`` / ``<a:name:id>`` (custom emoji), ``</name:id>`` (slash command) and
``<t:unix[:style]>`` (timestamp). The model should read what a person sees, so
:func:`readable_text` turns them into ``@Display Name``, ``#channel-name``, ``@role-name``,
``:name:``, ``/name`` and an ISO date; ids it cannot name become ``@unknown-user``,
``#unknown-channel`` and ``@unknown-role``. The bot's own mention (its user, or its managed
role) is removed, because "@bot hello" addresses the bot and is not part of what was said.
Tokens inside code spans are rewritten too (rare, and harmless for the model).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime

__all__ = ["MentionNames", "mentions_user", "readable_text"]

_TOKEN = re.compile(
    r"<(?P<kind>@!?|@&|#)(?P<id>\d{1,20})>"
    r"|<a?:(?P<emoji>\w{1,32}):\d{1,20}>"
    r"|</(?P<command>[\w -]{1,100}):\d{1,20}>"
    r"|<t:(?P<unix>-?\d{1,13})(?::[tTdDfFR])?>"
)
_SELF = "\x00"  # marks where the bot's own mention stood until the clean-up below
_LEADING_SELF = re.compile(rf"^(?:\s*{_SELF}[\s,:;]*)+")
_INNER_SELF = re.compile(rf"(?<![ \t])[ \t]*+{_SELF}")  # starts where a run of blanks does: linear


@dataclass(frozen=True, slots=True)
class MentionNames:
    """What the ids in one message are called.

    Args:
        users: user id -> display name (server nickname, else global name, else username).
        channels: channel or thread id -> name (without ``#``).
        roles: role id -> name (``@everyone`` may keep its ``@``).
        bot_user_id: the bot's own user id; its mention is removed.
        bot_role_ids: the bot's managed role(s); mentioning one addresses the bot too.
    """

    users: Mapping[int, str] = field(default_factory=dict)
    channels: Mapping[int, str] = field(default_factory=dict)
    roles: Mapping[int, str] = field(default_factory=dict)
    bot_user_id: int | None = None
    bot_role_ids: frozenset[int] = frozenset()


def readable_text(content: str, names: MentionNames) -> str:
    """``content`` with Discord's tokens replaced by readable names; the bot's mention removed.

    Whitespace and the ``,``/``:`` that follow a leading bot mention go with it
    (``"<@bot>, hi"`` -> ``"hi"``); an inner one takes the spaces before it
    (``"thanks <@bot>!"`` -> ``"thanks!"``). The result is stripped; it is ``""`` when the
    message was only the bot's mention.
    """

    def replace(m: re.Match[str]) -> str:
        if m["emoji"] is not None:
            return f":{m['emoji']}:"
        if m["command"] is not None:
            return f"/{m['command']}"
        if m["unix"] is not None:
            try:
                when = datetime.fromtimestamp(int(m["unix"]), UTC)
            except (OverflowError, OSError, ValueError):
                return m[0]
            return when.strftime("%Y-%m-%d %H:%M UTC")
        kind, ident = m["kind"], int(m["id"])
        if kind.startswith("@") and kind != "@&":
            if ident == names.bot_user_id:
                return _SELF
            name = names.users.get(ident)
            return f"@{name}" if name else "@unknown-user"
        if kind == "@&":
            if ident in names.bot_role_ids:
                return _SELF
            role = names.roles.get(ident)
            return f"@{role.lstrip('@')}" if role else "@unknown-role"
        channel = names.channels.get(ident)
        return f"#{channel}" if channel else "#unknown-channel"

    text = _TOKEN.sub(replace, content.replace(_SELF, ""))
    text = _LEADING_SELF.sub("", text)
    text = _INNER_SELF.sub("", text)
    return text.strip()


def mentions_user(content: str, user_id: int) -> bool:
    """Whether ``content`` literally contains ``<@user_id>`` or ``<@!user_id>``.

    A reply pings the replied-to author without any token in the content; this tells a typed
    mention apart from that automatic one, which would otherwise let two bots that reply to
    each other count every reply as a mention and talk for ever.
    """
    return f"<@{user_id}>" in content or f"<@!{user_id}>" in content
