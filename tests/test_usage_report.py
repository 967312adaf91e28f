"""What model requests used, as a chat reads it (``/usage``, bumblebot/runtime/usage_report.py)
and as the operator does (``bumblebot usage``, bumblebot/app/usage.py).

``/usage`` runs in a daemon in this event loop against the fake Bot API; ``bumblebot usage``
through the CLI's ``main``, next to nothing else, and as a subprocess next to a running daemon.
The ``usage`` table is filled as the daemon's meter fills it.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import running, write_config

from bumblebot.app.cli import main
from bumblebot.core.usage import Scope, Usage
from bumblebot.runtime.limits import utc_day
from bumblebot.store import Store

GROUP = -500
URL = "http://127.0.0.1:1/v1"
DAY_S = 86400


def _rows(now: float) -> list[tuple[str, Scope, Usage, float | None]]:
    """Alice (7) in her private chat and in the group, Bob (9) in the group, a scheduled task in
    the group, and a row too old for any report."""
    def day(ago: int) -> str:
        return utc_day(now - ago * DAY_S)

    alice, alice_group = Scope("telegram:7", "7", "turn"), Scope(f"telegram:{GROUP}", "7", "turn")
    bob = Scope(f"telegram:{GROUP}", "9", "turn")
    task = Scope(f"telegram:{GROUP}", None, "automation", background=True)
    return [
        (day(0), alice, Usage(URL, "test-model", prompt=1000, cached=400, completion=50), None),
        (day(5), alice, Usage(URL, "test-model", prompt=2000, completion=100), 0.5),
        (day(20), alice, Usage(URL, "test-model", prompt=3000, completion=300), 0.25),
        (day(40), alice, Usage(URL, "test-model", prompt=9999, completion=1), 9.0),
        (day(0), Scope("telegram:7", "7", "judge"), Usage(URL, "reflex-model", prompt=100, completion=2), None),
        (day(0), alice_group, Usage(URL, "test-model", prompt=500, completion=20), None),
        (day(1), bob, Usage(URL, "test-model", prompt=700, completion=30), None),
        (day(0), task, Usage(URL, "test-model", prompt=200, completion=10), None),
    ]


async def _seed(db_path: Path, now: float) -> None:
    async with Store(db_path) as store:
        for day, scope, usage, cost in _rows(now):
            await store.add_usage(day, scope, usage, cost)


# -- /usage ------------------------------------------------------------------------------------


async def test_usage_in_a_private_chat_shows_that_chat_today_7_and_30_days(tmp_path, llm, tg):
    await _seed(tmp_path / "data" / "bumblebot.db", time.time())
    async with running(write_config(tmp_path, llm, tg)):
        tg.push_text("/usage", chat_id=7)
        await tg.wait_for("sendMessage")
    [answer] = tg.sent(7)
    title, today, week, month = answer.splitlines()
    assert title == "Usage of this chat (UTC days):"
    assert today == "today: 2 requests, 1,152 tokens (1,100 prompt, 400 of them cached; 52 completion); not priced"
    assert week == (
        "last 7 days: 3 requests, 3,252 tokens (3,100 prompt, 400 of them cached; 152 completion); "
        "cost 0.50 (1 of 3 requests priced)"
    )
    assert month.startswith("last 30 days: 4 requests, 6,552 tokens") and month.endswith("cost 0.75 (2 of 4 requests priced)")
    assert llm.requests == []


async def test_usage_in_a_group_shows_an_admin_the_group_and_a_member_their_own(tmp_path, llm, tg):
    tg.member_status[(GROUP, 8)] = "administrator"
    await _seed(tmp_path / "data" / "bumblebot.db", time.time())
    async with running(write_config(tmp_path, llm, tg)):
        tg.push_text("/usage", chat_id=GROUP, user_id=7, chat_type="group")
        await tg.wait_for("sendMessage")
        tg.push_text("/usage@fake_bot", chat_id=GROUP, user_id=8, chat_type="group")
        await tg.wait_for("sendMessage", n=2)
    member, admin = tg.sent(GROUP)
    assert member.splitlines() == [
        "Your usage in this chat (UTC days):",
        "today: 1 request, 520 tokens (500 prompt; 20 completion); not priced",
        "last 7 days: 1 request, 520 tokens (500 prompt; 20 completion); not priced",
        "last 30 days: 1 request, 520 tokens (500 prompt; 20 completion); not priced",
    ]
    assert admin.splitlines()[0] == "Usage of this chat, everyone in it (UTC days):"
    assert admin.splitlines()[1] == "today: 2 requests, 730 tokens (700 prompt; 30 completion); not priced"
    assert admin.splitlines()[2] == "last 7 days: 3 requests, 1,460 tokens (1,400 prompt; 60 completion); not priced"
    assert [c.params["user_id"] for c in tg.calls if c.method == "getChatMember"] == [7, 8]


# -- bumblebot usage -------------------------------------------------------------------------------


def test_bumblebot_usage_shows_totals_top_chats_models_and_kinds(tmp_path, llm, capsys):
    config = write_config(tmp_path, llm)
    asyncio.run(_seed(tmp_path / "data" / "bumblebot.db", time.time()))
    assert main(["usage", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    totals = lines[lines.index("Totals") + 2:lines.index("Totals") + 5]
    assert totals[0].split()[:3] == ["today", "4", "1,882"]
    assert totals[1].split()[:5] == ["last", "7", "days", "6", "4,712"]
    assert totals[2].split()[:5] == ["last", "30", "days", "7", "8,012"] and totals[2].endswith("0.75 (2 of 7 priced)")
    chats = lines[lines.index("Top chats, last 30 days") + 2:]
    assert chats[0].split()[:3] == ["telegram:7", "4", "6,552"]  # the costliest first
    assert chats[1].split()[:3] == [f"telegram:{GROUP}", "3", "1,460"] and chats[1].endswith("not priced")
    assert "reflex-model" in out and "automation" in out and "judge" in out
    assert "9,999" not in out and "10,000" not in out  # 40 days ago


def test_bumblebot_usage_json_and_days(tmp_path, llm, capsys):
    config = write_config(tmp_path, llm)
    asyncio.run(_seed(tmp_path / "data" / "bumblebot.db", time.time()))
    assert main(["usage", "--json", "--days", "3", "--config", str(config)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["days"] == 3 and data["today"] == utc_day(time.time())
    assert [t["period"] for t in data["totals"]] == ["today", "last 7 days", "last 30 days", "last 3 days"]
    three = data["totals"][3]
    assert (three["requests"], three["tokens"], three["cached"], three["cost"]) == (5, 2612, 400, None)
    assert {c["chat"]: c["requests"] for c in data["chats"]} == {"telegram:7": 2, f"telegram:{GROUP}": 3}
    assert {m["model"]: m["requests"] for m in data["models"]} == {"test-model": 4, "reflex-model": 1}
    assert {k["kind"]: k["tokens"] for k in data["kinds"]} == {"turn": 2300, "judge": 102, "automation": 210}


def test_bumblebot_usage_days_out_of_range_is_a_usage_error_not_a_crash(tmp_path, llm, capsys):
    config = write_config(tmp_path, llm)
    asyncio.run(_seed(tmp_path / "data" / "bumblebot.db", time.time()))
    for days in ("100000000", "3661", "0"):
        with pytest.raises(SystemExit) as exited:
            main(["usage", "--days", days, "--config", str(config)])
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert "--days" in err and "Traceback" not in err
    assert main(["usage", "--json", "--days", "3660", "--config", str(config)]) == 0
    assert json.loads(capsys.readouterr().out)["days"] == 3660


def test_bumblebot_usage_without_a_database_says_so(tmp_path, llm, capsys):
    assert main(["usage", "--config", str(write_config(tmp_path, llm))]) == 1
    assert "no database" in capsys.readouterr().err


async def test_bumblebot_usage_reads_next_to_a_running_daemon(tmp_path, llm, tg):
    config = write_config(tmp_path, llm, tg)
    await _seed(tmp_path / "data" / "bumblebot.db", time.time())
    async with running(config):
        out = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "bumblebot", "usage", "--json", "--config", str(config)],
            capture_output=True, text=True, cwd=tmp_path,
        )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["totals"][0]["requests"] == 4
