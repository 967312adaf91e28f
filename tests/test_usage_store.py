"""The ``usage`` table: a day's row per chat, sender, kind and model, summed by the queries."""

from __future__ import annotations

from pathlib import Path

import pytest

from bumblebot.core.usage import Scope, Usage
from bumblebot.store import Store


async def test_requests_add_to_their_days_row_and_sum_per_chat_and_sender(tmp_path: Path, store_location) -> None:
    alice = Scope(conversation="telegram:1", sender="11", kind="turn")
    bob = Scope(conversation="telegram:1", sender="22", kind="turn")
    task = Scope(conversation="telegram:2", kind="automation", background=True)
    used = Usage("http://127.0.0.1:1/v1", "m", prompt=100, cached=40, completion=10, reasoning=3)
    async with Store(store_location) as store:
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


async def test_usage_by_groups_the_days_rows_costliest_first(tmp_path: Path, store_location) -> None:
    used = Usage("http://127.0.0.1:1/v1", "big", prompt=100, completion=10)
    small = Usage("http://127.0.0.1:1/v1", "small", prompt=1000, completion=10)
    async with Store(store_location) as store:
        await store.add_usage("2026-11-01", Scope(conversation="telegram:1", sender="1", kind="turn"), used, 9.0)
        await store.add_usage("2026-12-01", Scope(conversation="telegram:1", sender="1", kind="turn"), used, 0.5)
        await store.add_usage("2026-12-02", Scope(conversation="telegram:2", sender="2", kind="judge"), small, None)
        await store.add_usage("2026-12-02", Scope(conversation="telegram:3", sender="3", kind="turn"), used, None)
        chats = await store.usage_by("conversation", "2026-12-01")
        assert [(key, t.requests, t.cost) for key, t in chats] == [
            ("telegram:1", 1, 0.5), ("telegram:2", 1, 0.0), ("telegram:3", 1, 0.0)
        ]
        assert [key for key, _ in await store.usage_by("conversation", "2026-12-01", limit=2)] == ["telegram:1", "telegram:2"]
        assert [(k, t.tokens) for k, t in await store.usage_by("model", "2026-12-01")] == [("big", 220), ("small", 1010)]
        assert [k for k, _ in await store.usage_by("kind", "2026-12-02", conversation="telegram:2")] == ["judge"]
        with pytest.raises(ValueError):
            await store.usage_by("cost; DROP TABLE usage", "2026-12-01")  # type: ignore[arg-type]


async def test_background_and_foreground_requests_of_one_chat_and_kind_keep_their_own_rows(tmp_path: Path, store_location) -> None:
    """A compaction in a scheduled turn (background) and a ``/compact`` (not) in one chat on one
    day are both kind ``summary`` for nobody: each is counted as what it was."""
    background = Scope(conversation="telegram:5", kind="summary", background=True)
    foreground = Scope(conversation="telegram:5", kind="summary", background=False)
    async with Store(store_location) as store:
        await store.add_usage("2026-12-02", background, Usage("u", "m", prompt=100), None)
        await store.add_usage("2026-12-02", foreground, Usage("u", "m", prompt=5000), None)
        await store.add_usage("2026-12-02", background, Usage("u", "m", prompt=20), None)
        assert (await store.usage_totals("2026-12-02", background=True)).prompt == 120
        assert (await store.usage_totals("2026-12-02", background=False)).prompt == 5000
        assert (await store.usage_totals("2026-12-02", conversation="telegram:5")).requests == 3
