"""Pure logic of the Discord adapter: mention rewriting, who is answered, text commands."""

from __future__ import annotations

import warnings

import pytest

from adapters.bots import BotTurnBudget
from adapters.discord.mentions import MentionNames, mentions_user, readable_text
from adapters.discord.policy import MessageFacts, Verdict, command_target, decide, parse_command
from bumblebot.core.settings import DiscordSettings

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", "'audioop' is deprecated", DeprecationWarning)
    import discord

    from adapters.discord.client import describe_failure

BOT = 1000
ALICE = 2000
OTHER_BOT = 3000
CHANNEL = 500
THREAD = 501
NAMES = MentionNames(
    users={ALICE: "Alice A.", 2001: "bob"},
    channels={CHANNEL: "general", THREAD: "planning"},
    roles={77: "moderators", 78: "@everyone"},
    bot_user_id=BOT,
    bot_role_ids=frozenset({99}),
)


# -- mention rewriting ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (f"<@{BOT}> hello", "hello"),
        (f"<@!{BOT}>, what time is it?", "what time is it?"),
        (f"<@{BOT}>: <@{BOT}> twice", "twice"),
        (f"<@{BOT}>\nline two", "line two"),
        (f"thanks <@{BOT}>!", "thanks!"),
        (f"thanks <@{BOT}> for that", "thanks for that"),
        ("<@&99> are you there", "are you there"),
        (f"<@{BOT}>", ""),
        (f"ask <@{ALICE}> and <@!2001>", "ask @Alice A. and @bob"),
        ("who is <@42>?", "who is @unknown-user?"),
        (f"see <#{CHANNEL}> and <#{THREAD}> not <#9>", "see #general and #planning not #unknown-channel"),
        ("ping <@&77>, <@&78> and <@&5>", "ping @moderators, @everyone and @unknown-role"),
        ("nice <:party:123> <a:dance:456>", "nice :party: :dance:"),
        ("use </status:789>", "use /status"),
        ("at <t:0:R> or <t:1700000000>", "at 1970-01-01 00:00 UTC or 2023-11-14 22:13 UTC"),
        ("plain @everyone text, <not a token>", "plain @everyone text, <not a token>"),
        ("stray \x00 marker", "stray  marker"),
    ],
)
def test_readable_text(content: str, expected: str) -> None:
    assert readable_text(content, NAMES) == expected


def test_readable_text_keeps_markdown_and_inner_lines() -> None:
    content = f"<@{BOT}> look:\n```py\nx = 1\n```\n**bold** <@{ALICE}>"
    assert readable_text(content, NAMES) == "look:\n```py\nx = 1\n```\n**bold** @Alice A."


def test_without_a_bot_id_every_user_mention_is_named() -> None:
    assert readable_text(f"<@{BOT}> hi", MentionNames(users={BOT: "Bumble"})) == "@Bumble hi"


def test_mentions_user_is_literal() -> None:
    assert mentions_user(f"hey <@{BOT}>", BOT) and mentions_user(f"<@!{BOT}>", BOT)
    assert not mentions_user(f"<@{BOT}0>", BOT) and not mentions_user("hey bot", BOT)


# -- who is answered -----------------------------------------------------------------------


def settings(**kw: object) -> DiscordSettings:
    return DiscordSettings(enabled=True, **kw)


def dm(author: int = ALICE, **kw: object) -> MessageFacts:
    return MessageFacts(author_id=author, author_is_bot=False, is_dm=True, channel_ids=(CHANNEL,), **kw)


def guild(author: int = ALICE, channels: tuple[int, ...] = (CHANNEL,), **kw: object) -> MessageFacts:
    return MessageFacts(author_id=author, author_is_bot=False, is_dm=False, channel_ids=channels, **kw)


def test_dms_are_always_answered_and_guilds_need_addressing_by_default() -> None:
    s = settings()
    assert decide(dm(), s, BOT) is Verdict.ANSWER
    assert decide(guild(), s, BOT) is Verdict.IGNORE
    assert decide(guild(mentioned=True), s, BOT) is Verdict.ANSWER
    assert decide(guild(typed_mention=True), s, BOT) is Verdict.ANSWER
    assert decide(guild(replies_to_bot=True), s, BOT) is Verdict.ANSWER


def test_respond_in_guilds_all_and_off() -> None:
    assert decide(guild(), settings(respond_in_guilds="all"), BOT) is Verdict.ANSWER
    off = settings(respond_in_guilds="off")
    assert decide(guild(mentioned=True), off, BOT) is Verdict.IGNORE
    assert decide(dm(), off, BOT) is Verdict.ANSWER


def test_never_itself_and_bots_only_when_allowed_and_typed() -> None:
    def bot_message(author: int, **kw: object) -> MessageFacts:
        return MessageFacts(author_id=author, author_is_bot=True, is_dm=False, channel_ids=(CHANNEL,), **kw)

    itself = bot_message(BOT, typed_mention=True)
    other = bot_message(OTHER_BOT, mentioned=True)
    typed = bot_message(OTHER_BOT, typed_mention=True)
    for s in (settings(), settings(allow_bots=True, respond_in_guilds="all")):
        assert decide(itself, s, BOT) is Verdict.IGNORE
    assert decide(typed, settings(), BOT) is Verdict.IGNORE
    assert decide(other, settings(allow_bots=True), BOT) is Verdict.IGNORE  # a reply's auto-ping
    assert decide(other, settings(allow_bots=True, respond_in_guilds="all"), BOT) is Verdict.IGNORE
    assert decide(typed, settings(allow_bots=True), BOT) is Verdict.ANSWER


def test_user_allowlist_refuses_dms_and_ignores_guild_messages() -> None:
    s = settings(allowed_user_ids=[ALICE])
    assert decide(dm(), s, BOT) is Verdict.ANSWER
    assert decide(dm(author=4000), s, BOT) is Verdict.REFUSE
    assert decide(guild(author=4000, mentioned=True), s, BOT) is Verdict.IGNORE
    assert decide(guild(mentioned=True), s, BOT) is Verdict.ANSWER


def test_channel_allowlist_covers_threads_of_allowed_channels_only_in_guilds() -> None:
    s = settings(allowed_channel_ids=[CHANNEL], respond_in_guilds="all")
    assert decide(guild(), s, BOT) is Verdict.ANSWER
    assert decide(guild(channels=(THREAD, CHANNEL)), s, BOT) is Verdict.ANSWER
    assert decide(guild(channels=(600,)), s, BOT) is Verdict.IGNORE
    dm_elsewhere = MessageFacts(author_id=ALICE, author_is_bot=False, is_dm=True, channel_ids=(600,))
    assert decide(dm_elsewhere, s, BOT) is Verdict.ANSWER


# -- text commands -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("/status", "status"),
        ("  /Reset@bumblebot  ", "reset"),
        ("/Reset@BumbleBot", "reset"),
        ("/status@ now", "status"),  # "/status@<@bot>" once the bot's mention is removed
        ("/reset@other_bot", None),
        ("/reset@@other_bot", None),  # "/reset@<@other>" made readable
        ("/help me please", "help"),
        ("/compact", "compact"),
        ("/start", "start"),
        ("/shrug", None),
        ("a /status", None),
        ("/", None),
        ("/status-report", None),
        ("", None),
    ],
)
def test_parse_command(text: str, expected: str | None) -> None:
    assert parse_command(text, {"bumblebot", "Bumble Bee"}) == expected


def test_a_command_naming_another_bot_is_not_ours() -> None:
    """``/reset@other_bot`` is another bot's command (it used to reset this bot's conversation)."""
    names = {"fakebot"}
    assert command_target("/reset@other_bot", names) == "other"
    assert command_target("/shrug@other_bot hi", names) == "other"
    assert command_target("/reset@FakeBot", names) == "self"
    assert command_target("/reset", names) == "self"
    assert command_target("hello /reset@other_bot", names) is None


# -- bot budget ----------------------------------------------------------------------------


def test_bot_turn_budget_caps_per_channel_and_window() -> None:
    budget = BotTurnBudget(limit=2, window_s=60)
    assert budget.allow("discord:1", now=0) and budget.allow("discord:1", now=1)
    assert not budget.allow("discord:1", now=2)
    assert budget.allow("discord:2", now=2)  # another channel has its own budget
    assert budget.allow("discord:1", now=60.5)  # the first one left the window


# -- start-up failures ---------------------------------------------------------------------


def test_failures_are_explained() -> None:
    s = settings()
    assert "DISCORD_BOT_TOKEN" in describe_failure(discord.LoginFailure("Improper token"), s)
    intents = describe_failure(discord.PrivilegedIntentsRequired(None), s)
    assert "Message Content Intent" in intents and "developer portal" in intents
    assert s.api_base_url in describe_failure(OSError("connection refused"), s)
