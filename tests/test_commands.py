"""The command table (``bumblebot/core/commands.py``): the engine answers every command in it,
Telegram's menu and Discord's slash commands are made from it, ``/help`` lists it."""

from __future__ import annotations

from conftest import running, write_config
from fakes.openai_server import is_loop

from bumblebot.core.commands import BY_NAME, COMMANDS, asks_manager, help_text, needs_manager


def test_help_names_every_command_but_the_greeting():
    text = help_text()
    for command in COMMANDS:
        assert (f"/{command.name}:" in text) is not command.greeting
    assert "/tasks cancel ID" in text


def test_only_commands_that_change_a_shared_conversation_are_for_managers():
    managing = {c.name for c in COMMANDS if needs_manager(c.name, f"/{c.name}")}
    assert managing == {"reset", "compact"}
    assert needs_manager("tasks", "/tasks cancel 1") and needs_manager("tasks", "/tasks@bee_bot Cancel #2")
    assert not needs_manager("tasks", "/tasks") and not needs_manager("tasks", "/tasks list")
    assert not needs_manager("nosuch", "/nosuch cancel")
    # /stop depends on who asks (the person answered or a manager), so the adapter finds out
    assert asks_manager("stop", "/stop") and not needs_manager("stop", "/stop")
    # anyone may run /usage; a manager sees the whole chat's, so the adapter finds out too
    assert asks_manager("usage", "/usage") and not needs_manager("usage", "/usage")
    assert not asks_manager("status", "/status") and not asks_manager("help", "/help")
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
