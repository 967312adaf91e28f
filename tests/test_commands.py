"""The command table (``bumblebot/core/commands.py``): the engine answers every command in it,
Telegram's menu and Discord's slash commands are made from it, ``/help`` lists it."""

from __future__ import annotations

from conftest import running, write_config
from fakes.openai_server import is_loop

from bumblebot.core.commands import BY_NAME, COMMANDS, MANAGING_COMMANDS, help_text


def test_help_names_every_command_but_the_greeting():
    text = help_text()
    for command in COMMANDS:
        assert (f"/{command.name}:" in text) is not command.greeting
    assert "/tasks cancel ID" in text


def test_only_commands_that_change_a_shared_conversation_are_for_managers():
    assert MANAGING_COMMANDS == {"reset", "compact"}
    assert all(len(c.line()) <= 100 for c in COMMANDS)  # Discord's limit of a slash description


async def test_telegram_offers_the_table_and_the_engine_answers_each_command(tmp_path, llm, tg):
    async with running(write_config(tmp_path, llm, tg)):
        sent = 0
        for command in COMMANDS:
            tg.push_text(f"/{command.name}", chat_id=301)
            sent += 2 if command.name == "compact" else 1  # an acknowledgement, then the report
            await tg.wait_for("sendMessage", n=sent)
        tg.push_text("/nosuch", chat_id=301)
        await tg.wait_for("sendMessage", n=sent + 1)
    [menu] = tg.commands.values()
    assert [(c["command"], c["description"]) for c in menu] == [(c.name, c.line()) for c in COMMANDS]
    answers = tg.sent(301)
    assert not any(a.startswith("Unknown command") for a in answers[:-1])
    assert answers[-1] == "Unknown command /nosuch. Try /help."
    assert help_text() in answers and len(answers) == len(BY_NAME) + 2
    assert not [r for r in llm.requests if is_loop(r)]  # commands never start a turn
