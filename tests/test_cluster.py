"""Workers sharing one PostgreSQL store: leases, fencing, ownership, the one Telegram poller.

The workers here are daemons in this process (each its own data directory and name); the
drill with killed processes is ``tests/test_cluster_drill.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from conftest import running, write_config
from fakes.openai_server import Reply, is_aux, text, tool_calls
from fakes.postgres_server import PostgresServer

from bumblebot.core.errors import LeaseLost
from bumblebot.store import Store, postgres
from bumblebot.store.connection import FENCE, Fence

# -- leases ---------------------------------------------------------------------------------


async def test_a_lease_is_held_until_it_expires_then_taken_with_a_new_token(postgres_server: PostgresServer):
    url = await postgres_server.database()
    async with Store(url) as store:
        assert await store.acquire("conversation:a", "w1", 30) == 1
        assert await store.acquire("conversation:a", "w2", 30) is None  # held
        assert await store.renew(["conversation:a", "conversation:b"], "w1", 30) == [("conversation:a", 1)]
        assert await store.renew(["conversation:a"], "w2", 30) == []  # not theirs
        await store.release("conversation:a", "w1", 1)
        assert await store.acquire("conversation:a", "w2", 30) == 2  # released: taken at once
        assert await store.acquire("conversation:a", "w2", 30) == 3  # its own again (a restart): new token
        assert [(x.name, x.owner, x.token) for x in await store.leases("conversation:")] == [("conversation:a", "w2", 3)]
        conn = await asyncpg.connect(url)
        await conn.execute("UPDATE leases SET expires_at = expires_at - 60")  # w2 stopped renewing
        await conn.close()
        assert await store.renew(["conversation:a"], "w2", 30) == [("conversation:a", 3)]  # late, but nobody took it
        await store.heartbeat("w2", "host", 42, 1.0)
        assert [(w.name, w.pid) for w in await store.workers()] == [("w2", 42)]


async def test_a_write_under_a_lease_taken_over_is_refused_and_changes_nothing(postgres_server: PostgresServer):
    url = await postgres_server.database()
    async with Store(url) as old, Store(url) as new:
        token = await old.acquire("conversation:a", "w1", 30)
        assert token is not None
        FENCE.set(Fence("conversation:a", "w1", token))
        await old.set_kv("before", "1")  # held: written
        conn = await asyncpg.connect(url)
        await conn.execute("UPDATE leases SET expires_at = 0")  # w1 stalled past its lease
        await conn.close()
        FENCE.set(None)
        assert await new.acquire("conversation:a", "w2", 30) == token + 1
        FENCE.set(Fence("conversation:a", "w1", token))
        with pytest.raises(LeaseLost):
            await old.set_kv("after", "1")
        with pytest.raises(LeaseLost):
            async with old.transaction() as db:
                await db.execute("INSERT INTO kv (key, value) VALUES ('inside', '1')")
        assert not await old.holds_fence()
        FENCE.set(None)
        assert await new.get_kv("before") == "1"
        assert await new.get_kv("after") is None and await new.get_kv("inside") is None
        assert not old.db.in_transaction


async def test_a_send_check_extends_the_lease_so_no_other_worker_can_take_it_meanwhile(postgres_server: PostgresServer):
    """A worker checks its lease before each send; another may take the lease only once it has
    expired. Without the extension, a check made just before the expiry let the next worker
    resume the turn and send the same row while this one's send was still on its way."""
    url = await postgres_server.database()
    async with Store(url) as old, Store(url) as new:
        token = await old.acquire("conversation:a", "w1", 1)  # a second left: the renewal is late
        assert token is not None
        FENCE.set(Fence("conversation:a", "w1", token, 30.0))
        assert await old.holds_fence()
        FENCE.set(None)
        [lease] = await old.leases("conversation:")
        assert lease.expires_in > 20
        assert await new.acquire("conversation:a", "w2", 30) is None


async def test_a_send_whose_chat_was_taken_over_meanwhile_is_recorded_and_never_sent_again(postgres_server: PostgresServer):
    """The lease was lost while the platform took the message: recording it as sent was
    refused like any write of a worker that lost its lease, so the next worker sent it again."""
    from support import FlakyConsole

    from bumblebot.core.events import ChatRef, Platform
    from bumblebot.delivery import Delivery

    url = await postgres_server.database()
    chat = ChatRef(Platform.CONSOLE, "c")
    async with Store(url) as old, Store(url) as new:

        class TakenOverMeanwhile(FlakyConsole):
            async def send_chunk(self, chat: ChatRef, text: str, *, key: str = "") -> str:
                sent = await super().send_chunk(chat, text, key=key)
                conn = await asyncpg.connect(url)  # w1 stalled past its lease; w2 took the chat
                await conn.execute("UPDATE leases SET expires_at = 0")
                await conn.close()
                unset = FENCE.set(None)
                self.taken = await new.acquire("conversation:" + chat.key, "w2", 30)
                FENCE.reset(unset)
                return sent

        conversation = await old.conversation(chat)
        entry = await old.outbox_add(conversation.id, None, chat, "once")
        token = await old.acquire("conversation:" + chat.key, "w1", 30)
        assert token is not None
        adapter = TakenOverMeanwhile(fail_on_call=set())
        first, second = Delivery(old), Delivery(new)
        first.register(adapter)
        second.register(adapter)
        FENCE.set(Fence("conversation:" + chat.key, "w1", token, 30.0))
        await first.deliver(entry)
        FENCE.set(None)
        assert adapter.taken == token + 1
        assert await new.outbox_pending() == []
        assert await second.retry_pending() == 0
    assert adapter.sent == ["once"]


async def test_a_dead_workers_conversations_are_split_among_the_others_at_once(postgres_server: PostgresServer):
    """Its twenty leases lapsed together: the share counted only the leases held, so the first
    worker to look took one and left the rest for a second later. (Which worker wins each is
    the race of the claims; a worker left over its share gives idle ones up at its renewal.)"""
    from bumblebot.cluster.membership import Membership

    url = await postgres_server.database()
    keys = [f"telegram:{300 + i}" for i in range(20)]
    async with Store(url) as dead, Store(url) as s2, Store(url) as s3:
        await dead.heartbeat("w1", "host", 1, 1.0)
        for key in keys:
            assert await dead.acquire("conversation:" + key, "w1", 30) is not None
        conn = await asyncpg.connect(url)
        await conn.execute("UPDATE leases SET expires_at = expires_at - 31")  # w1 was killed
        await conn.execute("UPDATE workers SET seen_at = seen_at - 31")
        await conn.close()
        w2, w3 = (Membership(s, n, 30.0, poll_s=10.0) for s, n in ((s2, "w2"), (s3, "w3")))  # no timing in play
        for _ in range(2):  # each has seen the other's heartbeat
            await w2._renew()
            await w3._renew()
        for _ in range(5):  # reads of the journal: a claim lost to a lock wait is tried again
            free = [key for key in keys if not w2.owns(key) and not w3.owns(key)]
            await asyncio.gather(*(w.claim(key) for key in free for w in (w2, w3)))
    assert len(w2.held()) + len(w3.held()) == 20  # within the share, (20 + 1) / 2: none left for later


async def test_a_lone_worker_takes_every_new_chat_at_once(postgres_server: PostgresServer):
    """Counting its claims under way in the share made a lone worker take one of ten new chats
    at once and the others a second later: the store benchmark's p99 first reply doubled."""
    from bumblebot.cluster.membership import Membership

    url = await postgres_server.database()
    async with Store(url) as store:
        alone = Membership(store, "w1", 30.0, poll_s=10.0)
        await alone._renew()
        taken = await asyncio.gather(*(alone.claim(f"telegram:{400 + i}") for i in range(10)))
    assert all(taken)


async def test_a_worker_over_its_share_gives_up_idle_conversations_to_a_worker_started_again(postgres_server: PostgresServer):
    """After a kill, the survivors took the dead worker's conversations and kept them: the
    worker started again got none back, and the next kill left one worker twenty to take over."""
    from bumblebot.cluster.membership import Membership

    url = await postgres_server.database()
    keys = [f"telegram:{300 + i}" for i in range(10)]
    async with Store(url) as s1, Store(url) as s2:
        w1, w2 = Membership(s1, "w1", 30.0), Membership(s2, "w2", 30.0)
        for key in keys:  # alone, it takes them all
            await w1._renew()
            assert await w1.claim(key)
        dropped: list[str] = []

        async def drop(key: str, *, released: bool = False) -> None:
            dropped.append(key)

        async def collect() -> None: ...

        w1.bind(collect, drop, at_rest=lambda key: key != keys[0])  # keys[0] has a turn running
        await w2._renew()  # w2 (re)started: two live workers
        await w1._renew()
        await w1._shed()
        assert len(w1.held()) == 7  # its share, (10 + 1) / 2 = 6, plus one
        assert keys[0] in w1.held() and len(dropped) == 3 and keys[0] not in dropped
        for key in dropped:
            assert await w2.claim(key)  # released: taken at once, no lease to wait out


async def test_a_send_begun_under_an_earlier_hold_is_not_joined_by_the_holder_now(postgres_server: PostgresServer):
    """A worker's send went on after its actor was dropped; the worker took the chat again (a
    new token) and its resumed turn delivered the same row: it joined the old send, whose next
    chunk's check failed on the old token, and the holder's turn ended as if taken over."""
    from support import FlakyConsole

    from bumblebot.core.events import ChatRef, Platform
    from bumblebot.delivery import Delivery

    url = await postgres_server.database()
    chat = ChatRef(Platform.CONSOLE, "c")
    name = "conversation:" + chat.key
    first_out, gate = asyncio.Event(), asyncio.Event()

    class Slow(FlakyConsole):
        async def send_chunk(self, chat: ChatRef, text: str, *, key: str = "") -> str:
            sent = await super().send_chunk(chat, text, key=key)
            if text == "one":
                first_out.set()
                await gate.wait()
            return sent

    async with Store(url) as store:
        conversation = await store.conversation(chat)
        entry = await store.outbox_add(conversation.id, None, chat, "one|two")
        old = await store.acquire(name, "w1", 30)
        assert old is not None
        adapter = Slow(fail_on_call=set())
        delivery = Delivery(store)
        delivery.register(adapter)
        FENCE.set(Fence(name, "w1", old, 30.0))
        dropped = asyncio.create_task(delivery.deliver(entry))
        await first_out.wait()
        dropped.cancel()  # the actor was dropped; its send goes on
        FENCE.set(None)
        new = await store.acquire(name, "w1", 30)  # taken again: a new token
        FENCE.set(Fence(name, "w1", new, 30.0))
        holder = asyncio.create_task(delivery.deliver(entry))
        gate.set()
        report = await holder
        FENCE.set(None)
        row = await store.outbox_entry(entry.id)
    assert report.delivered and row is not None and row.status == "sent"
    assert adapter.sent == ["one", "two"]  # each chunk once


async def test_a_lease_given_up_or_lapsed_is_not_revived_by_a_send_check(postgres_server: PostgresServer):
    """A send still carrying the fence of a lease given up (or lapsed) extended it again: no
    other worker could take the chat for lease_s, and this one no longer ran it."""
    url = await postgres_server.database()
    async with Store(url) as w1, Store(url) as w2:
        for lapse in ("release", "expire"):
            name = f"conversation:{lapse}"
            token = await w1.acquire(name, "w1", 10)
            assert token is not None
            if lapse == "release":
                await w1.release(name, "w1", token)
            else:
                conn = await asyncpg.connect(url)
                await conn.execute("UPDATE leases SET expires_at = expires_at - 60 WHERE name = $1", name)
                await conn.close()
            FENCE.set(Fence(name, "w1", token, 10.0))
            assert not await w1.holds_fence()
            FENCE.set(None)
            assert await w2.acquire(name, "w2", 10) == token + 1


async def test_a_send_that_outlived_its_dropped_actor_stops_at_its_next_try(postgres_server: PostgresServer):
    """The platform was down; the chat was dropped meanwhile. The send went on retrying, and
    each try's check extended the lease: nobody else could take the chat."""
    from support import FlakyConsole

    from bumblebot.core.events import ChatRef, Platform
    from bumblebot.delivery import Delivery

    url = await postgres_server.database()
    chat = ChatRef(Platform.CONSOLE, "c")
    name = "conversation:" + chat.key
    tried = asyncio.Event()

    class Down(FlakyConsole):
        async def send_chunk(self, chat: ChatRef, text: str, *, key: str = "") -> str:
            tried.set()
            return await super().send_chunk(chat, text, key=key)

    async with Store(url) as w1, Store(url) as w2:
        conversation = await w1.conversation(chat)
        entry = await w1.outbox_add(conversation.id, None, chat, "hello")
        token = await w1.acquire(name, "w1", 30)
        assert token is not None
        held: dict[str, Fence] = {chat.key: Fence(name, "w1", token, 30.0)}
        delivery = Delivery(w1, attempts=3, base_delay_s=0.2)
        delivery.register(Down(fail_on_call={1, 2, 3}))
        delivery.fence_of = held.get
        FENCE.set(held[chat.key])
        caller = asyncio.create_task(delivery.deliver(entry))
        await tried.wait()
        caller.cancel()  # dropped: the lease is given up
        FENCE.set(None)
        del held[chat.key]
        await w1.release(name, "w1", token)
        await asyncio.wait(delivery.retrying)
        assert await w2.acquire(name, "w2", 30) == token + 1  # not extended meanwhile
        [row] = await w1.outbox_pending()
    assert row.id == entry.id


# -- workers --------------------------------------------------------------------------------


def echo(request: dict[str, Any]) -> Reply:
    """Answers each turn with the texts it was asked, and judges with DONE."""
    if is_aux(request):
        return text("DONE: ok")
    asked = []
    for m in reversed(request["messages"]):
        if m["role"] == "assistant":
            break
        if m["role"] == "user":
            asked.insert(0, str(m["content"]).rsplit("\n", 1)[-1])
    return tool_calls(("say", {"text": "re: " + " ".join(asked)}), ("end_turn", {}))


def worker_config(tmp_path: Path, name: str, llm: Any, tg: Any, url: str, lease_s: float = 10.0) -> Path:
    folder = tmp_path / name
    folder.mkdir(exist_ok=True)
    return write_config(folder, llm, tg, store={"url": url}, cluster={"worker": name, "lease_s": lease_s})


async def owners(url: str) -> dict[str, str]:
    conn = await asyncpg.connect(url)
    try:
        rows = await conn.fetch("SELECT name, owner FROM leases WHERE expires_at > EXTRACT(EPOCH FROM clock_timestamp())")
    finally:
        await conn.close()
    return {r["name"]: r["owner"] for r in rows}


async def test_two_workers_share_the_chats_one_polls_and_each_message_is_answered_once(tmp_path, llm, tg, postgres_server):
    url = await postgres_server.database()
    llm.default = echo
    chats = [101, 102, 103, 104, 105, 106]
    async with running(worker_config(tmp_path, "a", llm, tg, url)) as a, running(worker_config(tmp_path, "b", llm, tg, url)) as b:
        for worker in (a, b, a):  # each has seen the other alive (a worker alone takes every chat)
            assert worker.membership is not None
            await worker.membership._renew()
        for chat in chats:
            tg.push_text(f"hello {chat}", chat_id=chat)
        for chat in chats:
            await tg.wait_for("sendMessage", predicate=lambda p, c=chat: p.get("chat_id") == c)
        held = await owners(url)
        for chat in chats:
            tg.push_text(f"again {chat}", chat_id=chat)
        for chat in chats:
            await tg.wait_for("sendMessage", predicate=lambda p, c=chat: p.get("chat_id") == c and "again" in p.get("text", ""))
        await asyncio.gather(a.engine.wait_until(lambda: a.engine.settled), b.engine.wait_until(lambda: b.engine.settled))
    assert {chat: tg.sent(chat) for chat in chats} == {chat: [f"re: hello {chat}", f"re: again {chat}"] for chat in chats}
    conversations = {k: v for k, v in held.items() if k.startswith("conversation:")}
    assert len(conversations) == len(chats) and set(conversations.values()) == {"a", "b"}  # both work
    assert list(held.values()).count("a") + list(held.values()).count("b") == len(held)
    assert "telegram.poller" in held


async def test_a_worker_that_stops_hands_its_chats_over_at_once(tmp_path, llm, tg, postgres_server):
    url = await postgres_server.database()
    llm.default = echo
    async with running(worker_config(tmp_path, "b", llm, tg, url)) as b:
        async with running(worker_config(tmp_path, "a", llm, tg, url)):
            for chat in (201, 202, 203, 204):
                tg.push_text(f"one {chat}", chat_id=chat)
            for chat in (201, 202, 203, 204):
                await tg.wait_for("sendMessage", predicate=lambda p, c=chat: p.get("chat_id") == c)
            before = await owners(url)
        for chat in (201, 202, 203, 204):
            tg.push_text(f"two {chat}", chat_id=chat)
        for chat in (201, 202, 203, 204):
            await tg.wait_for("sendMessage", predicate=lambda p, c=chat: p.get("chat_id") == c and "two" in p.get("text", ""))
        after = await owners(url)
        await b.engine.wait_until(lambda: b.engine.settled)
    assert "a" in before.values()
    assert set(after.values()) == {"b"}  # everything, the poller role too
    assert all(tg.sent(chat) == [f"re: one {chat}", f"re: two {chat}"] for chat in (201, 202, 203, 204))


async def test_a_message_journaled_just_as_its_chat_is_given_up_stays_for_the_next_holder(tmp_path, llm, tg, postgres_server):
    """The chat was given up (or lost) between its message's journaling and its queueing: the
    engine raised LeaseLost, so the Telegram poller failed the update and waited 2 s before
    trying it again, holding up every chat's messages (a webhook answered 500)."""
    from bumblebot.core.events import ChatKind, ChatRef, Inbound, Platform
    from bumblebot.store import JournalEntry

    url = await postgres_server.database()
    llm.default = echo
    chat = ChatRef(Platform.TELEGRAM, "150")
    async with running(worker_config(tmp_path, "a", llm, tg, url)) as a:
        tg.push_text("one", chat_id=150)
        await tg.wait_for("sendMessage", predicate=lambda p: p.get("chat_id") == 150)
        await a.engine.wait_until(lambda: a.engine.settled)
        await a.engine.collect()  # a read of the journal: its message is seen answered
        assert a.engine.at_rest(chat.key)
        a.membership._held.pop("conversation:" + chat.key)  # as Membership._shed gives it up
        await a.engine.drop(chat.key, released=True)
        inbound = Inbound(chat, "77", "150", "Ann", "two", ChatKind.PRIVATE)
        journal_id = await a.store.journal(inbound)
        await a.engine._dispatch(JournalEntry(journal_id, inbound, "pending"))  # raised LeaseLost
        assert chat.key not in a.engine._actors  # no actor without a task left behind
        [pending] = [e for e in await a.store.pending_inbound(chat)]
        assert pending.id == journal_id  # for the next holder (this worker too, once it claims it)


async def test_a_chat_whose_actor_found_its_lease_lapsed_is_taken_again_and_answered(tmp_path, llm, tg, postgres_server):
    """A send found the lease lapsed (nobody had taken it yet) and the actor ended as if taken
    over, but the worker's next renewal kept the lease: the chat stayed held with nobody
    running it, its turn never resumed."""
    url = await postgres_server.database()
    lapsed = False

    async def model(request: dict[str, Any]) -> Reply:
        nonlocal lapsed
        if not is_aux(request) and not lapsed:  # the worker stalls past its lease before the send
            lapsed = True
            conn = await asyncpg.connect(url)
            await conn.execute("UPDATE leases SET expires_at = expires_at - 60 WHERE name = 'conversation:telegram:160'")
            await conn.close()
        return echo(request)

    llm.default = model
    async with running(worker_config(tmp_path, "a", llm, tg, url, lease_s=60.0)) as a:
        tg.push_text("hi", chat_id=160)
        await tg.wait_for("sendMessage", predicate=lambda p: p.get("chat_id") == 160, timeout=15)
        await a.engine.wait_until(lambda: a.engine.settled)
    assert lapsed and tg.sent(160) == ["re: hi"]


async def test_a_stalled_workers_chats_are_taken_over_and_its_late_writes_refused(tmp_path, llm, tg, postgres_server):
    """Worker a stops renewing (its loop is stuck) while its turn waits on the model: after
    ``lease_s`` worker b takes the chat, resumes the turn and answers; a's own late answer is
    neither written nor sent."""
    url = await postgres_server.database()
    held = asyncio.Event()
    release = asyncio.Event()

    async def slow_first(request: dict[str, Any]) -> Reply:
        if not held.is_set() and not is_aux(request):
            held.set()
            await release.wait()  # a's turn: answered only after the takeover
        return echo(request)

    llm.default = slow_first
    async with running(worker_config(tmp_path, "a", llm, tg, url, lease_s=1.0)) as a:
        tg.push_text("hi there", chat_id=301)
        await held.wait()
        assert (await owners(url)).get("conversation:telegram:301") == "a"
        assert a._membership_task is not None
        a._membership_task.cancel()  # a stalls: no renewal
        with contextlib.suppress(asyncio.CancelledError):
            await a._membership_task
        async with running(worker_config(tmp_path, "b", llm, tg, url, lease_s=1.0)) as b:
            await tg.wait_for("sendMessage", predicate=lambda p: p.get("chat_id") == 301)
            assert (await owners(url)).get("conversation:telegram:301") == "b"
            release.set()  # a's model call returns now: its say must not get out
            await b.engine.wait_until(lambda: b.engine.settled)
            await a.engine.wait_until(lambda: a.engine.idle)
    assert tg.sent(301) == ["re: hi there"]


async def test_one_worker_runs_retention_for_the_cluster_once_a_day(tmp_path, llm, tg, postgres_server):
    url = await postgres_server.database()
    llm.default = echo
    async with running(worker_config(tmp_path, "a", llm, tg, url)) as a, running(worker_config(tmp_path, "b", llm, tg, url)) as b:
        roles = {w: asyncio.ensure_future(w.membership.role("housekeeping").wait()) for w in (a, b)}
        done, pending = await asyncio.wait(roles.values(), timeout=10, return_when=asyncio.FIRST_COMPLETED)
        for waiting in pending:
            waiting.cancel()
        leader = next(w for w, waiting in roles.items() if waiting in done)
        other = b if leader is a else a
        assert not other.membership.leads("housekeeping")
        await other.engine._housekeep()
        assert await other.store.get_kv("housekeeping.last") is None
        await leader.store.heartbeat("long-gone", "old-host", 1, 0.0)
        await leader.store.relay("telegram:1", "command", {"journal_id": 1, "name": "stop", "manager": True})
        conn = await asyncpg.connect(url)
        await conn.execute("UPDATE workers SET seen_at = 0 WHERE name = 'long-gone'")
        await conn.execute("UPDATE relayed SET created_at = 0")
        await conn.close()
        await leader.engine._housekeep()
        ran = await leader.store.get_kv("housekeeping.last")
        assert ran is not None
        assert sorted(w.name for w in await leader.store.workers()) == ["a", "b"]  # the gone one forgotten
        assert await leader.store.take_relayed(["telegram:1"]) == []
        await leader.engine._housekeep()  # not due again today
        assert await leader.store.get_kv("housekeeping.last") == ran


async def test_bumblebot_cluster_shows_each_worker_its_chats_roles_and_backlog(tmp_path, llm, tg, postgres_server, capsys):
    from bumblebot.app.cluster import cluster_state, run_cluster
    from bumblebot.core.config import load_settings

    url = await postgres_server.database()
    llm.default = echo
    config_a = worker_config(tmp_path, "a", llm, tg, url)
    async with running(config_a) as a, running(worker_config(tmp_path, "b", llm, tg, url)) as b:
        for chat in (401, 402, 403):
            tg.push_text(f"hi {chat}", chat_id=chat)
        for chat in (401, 402, 403):
            await tg.wait_for("sendMessage", predicate=lambda p, c=chat: p.get("chat_id") == c)
        await asyncio.gather(a.engine.wait_until(lambda: a.engine.settled), b.engine.wait_until(lambda: b.engine.settled))
        state = await cluster_state(load_settings(config_a))
        assert await run_cluster(load_settings(config_a), as_json=False) == 0
    shown = {w["name"]: w for w in state["workers"]}
    assert set(shown) == {"a", "b"} and all(w["alive"] for w in shown.values())
    assert sum(w["conversations"] for w in shown.values()) == 3
    assert sorted(r for w in shown.values() for r in w["roles"]) == ["housekeeping", "telegram.poller"]
    assert all(w["waiting"] == 0 for w in shown.values()) and state["unheld"]["waiting"] == 0
    out = capsys.readouterr().out
    assert "telegram.poller" in out and out.count("\n  a ") + out.count("\n  b ") == 2


async def test_bumblebot_cluster_on_sqlite_says_there_is_no_cluster(tmp_path, llm, capsys):
    from bumblebot.app.cli import main

    config = write_config(tmp_path, llm)
    assert await asyncio.to_thread(main, ["cluster", "--config", str(config)]) == 1
    assert "PostgreSQL store (store.url" in capsys.readouterr().err


async def test_stop_status_and_an_edit_that_arrive_at_another_worker_reach_the_chats_worker(
    tmp_path, llm, tg, postgres_server
):
    """A command or an edit may arrive at any worker (the Telegram poller is one of them): the
    one holding the chat runs it, and answers in the chat."""
    from bumblebot.core.events import ChatKind, ChatRef, Inbound, Platform

    url = await postgres_server.database()
    first = asyncio.Event()
    release = asyncio.Event()

    async def slow_first(request: dict[str, Any]) -> Reply:
        if not first.is_set() and not is_aux(request):
            first.set()
            await release.wait()  # the first turn runs until /stop cancels it
        return echo(request)

    llm.default = slow_first
    sections = {"cognition": {"classifier": False, "debounce_s": 0, "mid_turn_messages": "queue"}}
    configs = []
    for name in ("a", "b"):
        folder = tmp_path / name
        folder.mkdir()
        configs.append(write_config(folder, llm, tg, store={"url": url}, cluster={"worker": name}, **sections))
    async with running(configs[0]) as a, running(configs[1]) as b:
        tg.push_text("long one", chat_id=501)
        await first.wait()
        holder = a if (await owners(url)).get("conversation:telegram:501") == "a" else b
        other = b if holder is a else a
        chat = ChatRef(Platform.TELEGRAM, "501")

        def said(text: str, message_id: str) -> Inbound:
            return Inbound(chat, message_id, "501", "Ada", text, ChatKind.PRIVATE)

        queued = said("typo", "9001")
        assert await other.engine.submit(queued)  # waits behind the running turn, at its worker
        assert await other.engine.edit(said("fixed", "9001"))  # at once: before the holder read the message
        assert await other.engine.command(said("/status", "9002"), "status") is None  # relayed
        await tg.wait_for("sendMessage", predicate=lambda p: p.get("chat_id") == 501)
        assert await other.engine.command(said("/stop", "9003"), "stop") is None
        await tg.wait_for("sendMessage", predicate=lambda p: p.get("text") == "Stopped.")
        await tg.wait_for("sendMessage", predicate=lambda p: p.get("text") == "re: fixed")
        release.set()
        await holder.engine.wait_until(lambda: holder.engine.settled)
    texts = tg.sent(501)
    assert texts[1:] == ["Stopped.", "re: fixed"] and "re: long one" not in texts
    assert other.engine.loaded_conversations == 0  # nothing of the chat ran at the other worker


async def test_two_workers_behind_one_webhook_answer_each_message_once(tmp_path, llm, tg, postgres_server):
    """Telegram posts to one public URL; the proxy spreads the requests over the workers; an
    update posted again (to the other worker) is journaled once, and its chat's worker answers."""
    import socket

    url = await postgres_server.database()
    llm.default = echo
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(int(s.getsockname()[1]))
    tg.webhook_targets = [f"http://127.0.0.1:{port}/hook" for port in ports]
    configs = []
    for name, port in zip(("a", "b"), ports):
        folder = tmp_path / name
        folder.mkdir()
        configs.append(write_config(
            folder, llm, tg, store={"url": url}, cluster={"worker": name},
            telegram={"enabled": True, "base_url": tg.base_url, "base_file_url": tg.base_file_url,
                      "webhook_url": "https://bot.example.org/hook", "webhook_listen": f"127.0.0.1:{port}"},
        ))
    secret = "s3cret-for-the-webhook"
    async with running(configs[0], webhook_secret=secret) as a, running(configs[1], webhook_secret=secret) as b:
        for chat in (601, 602, 603, 604):
            tg.push_text(f"hello {chat}", chat_id=chat)
        tg.push_update(dict(tg.updates[0], update_id=999))  # the first one again
        for chat in (601, 602, 603, 604):
            await tg.wait_for("sendMessage", predicate=lambda p, c=chat: p.get("chat_id") == c)
        await asyncio.gather(a.engine.wait_until(lambda: a.engine.settled), b.engine.wait_until(lambda: b.engine.settled))
    assert {chat: tg.sent(chat) for chat in (601, 602, 603, 604)} == {c: [f"re: hello {c}"] for c in (601, 602, 603, 604)}
    assert {target for target, _, status in tg.webhook_posts if status == "200"} == set(tg.webhook_targets)
    assert [c for c in tg.calls if c.method == "getUpdates"] == []


# -- what a review found (each with its input) --------------------------------------------------


async def test_a_worker_frozen_inside_a_fenced_write_does_not_freeze_the_others(tmp_path, llm, tg, postgres_server):
    """A worker stopped (SIGSTOP, a partition) between two statements of a fenced write keeps its
    lease row locked: the next worker's takeover waited on it, holding its own writes and its
    renewals, so every chat went unanswered."""
    url = await postgres_server.database()
    llm.default = echo
    async with Store(url) as s:
        token = await s.acquire("conversation:telegram:701", "ghost", 0.0)  # already expired
    ghost = await asyncpg.connect(url, server_settings=postgres.SESSION)  # a worker's session, as the store opens it
    await ghost.execute("BEGIN")
    await ghost.execute("SELECT 1 FROM leases WHERE name = $1 AND owner = 'ghost' AND token = $2 FOR SHARE",
                        "conversation:telegram:701", token)
    try:
        async with running(worker_config(tmp_path, "b", llm, tg, url, lease_s=3.0)):
            tg.push_text("to the frozen worker's chat", chat_id=701)
            tg.push_text("hello", chat_id=702)  # a chat nobody held
            await tg.wait_for("sendMessage", predicate=lambda p: p.get("chat_id") == 702, timeout=10)
            # the server ends the frozen transaction (idle_in_transaction_session_timeout): 701 goes on
            await tg.wait_for("sendMessage", predicate=lambda p: p.get("chat_id") == 701, timeout=20)
    finally:
        await ghost.close()
    assert tg.sent(701) == ["re: to the frozen worker's chat"] and tg.sent(702) == ["re: hello"]


async def test_a_reply_left_unsent_in_a_chat_nobody_holds_is_sent(tmp_path, llm, tg, postgres_server):
    """A worker stopped with a reply still pending (a long flood wait): nobody claimed the chat
    until a new message came, so the reply waited until it expired."""
    from bumblebot.core.events import ChatRef, Platform

    url = await postgres_server.database()
    llm.default = echo
    chat = ChatRef(Platform.TELEGRAM, "801")
    async with Store(url) as s:  # what a worker that stopped left behind
        await s.outbox_add((await s.conversation(chat)).id, None, chat, "the answer left pending")
    async with running(worker_config(tmp_path, "a", llm, tg, url)):
        await tg.wait_for("sendMessage", predicate=lambda p: p.get("chat_id") == 801, timeout=10)
    assert tg.sent(801) == ["the answer left pending"]


async def test_an_operators_pause_at_another_worker_reaches_the_chats_worker(tmp_path, llm, tg, postgres_server):
    """The web console's pause at a worker that does not hold the chat paused nothing there
    (and loaded an unfenced actor); the holder went on answering."""
    from bumblebot.core.events import ChatRef, Platform

    url = await postgres_server.database()
    llm.default = echo
    async with running(worker_config(tmp_path, "a", llm, tg, url)) as a, running(worker_config(tmp_path, "b", llm, tg, url)) as b:
        tg.push_text("hi", chat_id=901)
        await tg.wait_for("sendMessage", predicate=lambda p: p.get("chat_id") == 901)
        holder = a if (await owners(url)).get("conversation:telegram:901") == "a" else b
        other = b if holder is a else a
        said = await other.engine.operate(ChatRef(Platform.TELEGRAM, "901"), "pause")
        assert said.startswith("Passed to the worker running telegram:901")
        await holder.engine.wait_until(lambda: holder.engine.paused("telegram:901"))
        assert other.engine.loaded_conversations == 0


async def test_a_command_relayed_to_a_worker_that_died_is_run_by_the_next(tmp_path, llm, tg, postgres_server):
    """A relayed command waited for a chat nobody held any more until that chat had work again."""
    from bumblebot.core.events import ChatKind, ChatRef, Inbound, Platform

    url = await postgres_server.database()
    llm.default = echo
    chat = ChatRef(Platform.TELEGRAM, "951")
    async with Store(url) as s:  # /status came at a worker while "gone" held the chat, which then died
        journal_id = await s.journal(Inbound(chat, "1", "951", "Ann", "/status", ChatKind.PRIVATE), status="ignored")
        await s.relay(chat.key, "command", {"journal_id": journal_id, "name": "status", "manager": True})
    async with running(worker_config(tmp_path, "a", llm, tg, url)):
        await tg.wait_for("sendMessage", predicate=lambda p: p.get("chat_id") == 951, timeout=10)
    assert len(tg.sent(951)) == 1 and "Context" in tg.sent(951)[0]
