"""The ``usage`` table: a day's row per chat, sender, kind and model, summed by the queries."""

from __future__ import annotations

from pathlib import Path

from bumblebot.core.usage import Scope, Usage
from bumblebot.store import Store


async def test_requests_add_to_their_days_row_and_sum_per_chat_and_sender(tmp_path: Path) -> None:
    alice = Scope(conversation="telegram:1", sender="11", kind="turn")
    bob = Scope(conversation="telegram:1", sender="22", kind="turn")
    task = Scope(conversation="telegram:2", kind="automation", background=True)
    used = Usage("http://127.0.0.1:1/v1", "m", prompt=100, cached=40, completion=10, reasoning=3)
    async with Store(tmp_path / "b.db") as store:
        await store.add_usage("2026-12-01", alice, used, 0.5)
        await store.add_usage("2026-12-02", alice, used, 0.5)
        await store.add_usage("2026-12-02", alice, used, None)
        await store.add_usage("2026-12-02", bob, Usage("u", "m", prompt=7, completion=1, estimated=True), None)
        await store.add_usage("2026-12-02", task, used, 1.0)
        today_alice = await store.usage_totals("2026-12-02", sender="11")
        assert (today_alice.requests, today_alice.prompt, today_alice.cached, today_alice.completion) == (2, 200, 80, 20)
        assert (today_alice.reasoning, today_alice.cost, today_alice.priced) == (6, 0.5, 1)
        chat = await store.usage_totals("2026-12-01", conversation="telegram:1")
        assert (chat.requests, chat.tokens, chat.estimated) == (4, 3 * 110 + 8, 1)
        background = await store.usage_totals("2026-12-02", background=True)
        assert (background.requests, background.cost) == (1, 1.0)
        nothing = await store.usage_totals("2026-12-03")
        assert nothing.requests == 0 and nothing.tokens == 0
