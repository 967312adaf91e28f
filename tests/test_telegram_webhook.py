"""Telegram's updates by webhook (``adapters/telegram/webhook.py``): the fake Telegram POSTs each
update, with the secret token, to the daemon's ``telegram.webhook_listen``."""

from __future__ import annotations

import socket

import aiohttp
import pytest
from conftest import running, write_config
from fakes.openai_server import is_loop
from support import judges_say_done, say

from bumblebot.core.errors import ConfigError

SECRET = "webhook-secret_0123456789"
PUBLIC = "https://bot.example.org/telegram/hook"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def webhook_config(tmp_path, llm, tg, port: int, **sections):
    return write_config(tmp_path, llm, tg, telegram={
        "enabled": True, "base_url": tg.base_url, "base_file_url": tg.base_file_url, "poll_timeout_s": 1,
        "webhook_url": PUBLIC, "webhook_listen": f"127.0.0.1:{port}",
    }, **sections)


async def test_updates_come_by_webhook_with_the_secret_and_are_answered_once(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(say("hello by webhook"), when=is_loop)
    port = free_port()
    tg.webhook_targets = [f"http://127.0.0.1:{port}/telegram/hook"]
    update = {"update_id": 700, "message": {"message_id": 5, "date": 1700000000, "text": "hi",
              "chat": {"id": 71, "type": "private"}, "from": {"id": 71, "is_bot": False, "first_name": "Bo"}}}
    async with running(webhook_config(tmp_path, llm, tg, port), webhook_secret=SECRET) as d:
        assert tg.webhook is not None and tg.webhook["url"] == PUBLIC and tg.webhook["secret_token"] == SECRET
        tg.push_update(update)
        tg.push_update(dict(update, update_id=701))  # Telegram sends the same message again
        await tg.wait_for("sendMessage", predicate=lambda p: p.get("chat_id") == 71)
        await d.engine.wait_until(lambda: d.engine.settled)
        async with aiohttp.ClientSession() as session:  # no secret, a wrong one: refused, nothing journaled
            for headers in ({}, {"X-Telegram-Bot-Api-Secret-Token": "wrong"}):
                async with session.post(tg.webhook_targets[0], json=dict(update, update_id=702), headers=headers) as answer:
                    assert answer.status == 403
        journaled = await d.store._all("SELECT message_id FROM journal")
    assert tg.sent(71) == ["hello by webhook"]
    assert [r[0] for r in journaled] == ["5"]
    assert [c for c in tg.calls if c.method == "getUpdates"] == []  # nobody polls
    assert [status for _, _, status in tg.webhook_posts] == ["200", "200"]


async def test_an_update_the_database_could_not_take_is_sent_again_by_telegram(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(say("got it"), when=is_loop)
    port = free_port()
    tg.webhook_targets = [f"http://127.0.0.1:{port}/telegram/hook"]
    async with running(webhook_config(tmp_path, llm, tg, port), webhook_secret=SECRET) as d:
        original = d.store.journal
        failures: list[int] = []

        async def locked_once(*args, **kwargs):
            if not failures:
                failures.append(1)
                import aiosqlite

                raise aiosqlite.OperationalError("database is locked")
            return await original(*args, **kwargs)

        d.store.journal = locked_once
        tg.push_text("are you there?", chat_id=72)
        await tg.wait_for("sendMessage", predicate=lambda p: p.get("chat_id") == 72)
    assert failures and tg.sent(72) == ["got it"]
    assert [status for _, _, status in tg.webhook_posts] == ["500", "200"]


async def test_a_webhook_without_its_secret_is_a_configuration_error(tmp_path, llm, tg):
    with pytest.raises(ConfigError, match="TELEGRAM_WEBHOOK_SECRET"):
        async with running(webhook_config(tmp_path, llm, tg, free_port())):
            pass
