"""The outbox (bumblebot/delivery/outbox.py): a message resumes where it stopped and is never sent twice."""

from __future__ import annotations

import asyncio

import pytest
from support import FlakyConsole

from bumblebot.core.events import ChatRef, Platform
from bumblebot.delivery import Delivery
from bumblebot.store import Store


def delivery_for(store: Store, adapter: FlakyConsole, attempts: int = 3) -> Delivery:
    delivery = Delivery(store, attempts=attempts)
    delivery.register(adapter)
    return delivery


async def test_retry_resumes_after_the_last_delivered_chunk(tmp_path, store_location):
    chat = ChatRef(Platform.CONSOLE, "c")
    async with Store(store_location) as store:
        conversation = await store.conversation(chat)
        adapter = FlakyConsole(fail_on_call=set(), crash_on_call={3})
        delivery = delivery_for(store, adapter, attempts=1)
        try:
            await delivery.send(conversation.id, chat, "one|two|three")
        except asyncio.CancelledError:
            pass
        assert adapter.sent == ["one", "two"]
        [pending] = await store.outbox_pending()
        assert pending.platform_message_ids == ["1", "2"]
        assert await delivery.retry_pending() == 1
        assert adapter.sent == ["one", "two", "three"]  # no chunk twice
        assert await store.outbox_pending() == []


async def test_sweeper_does_not_resend_a_message_being_delivered(tmp_path, store_location):
    chat = ChatRef(Platform.CONSOLE, "c")
    release = asyncio.Event()

    class Slow(FlakyConsole):
        async def send_chunk(self, chat: ChatRef, text: str, *, key: str = "") -> str:
            await release.wait()
            return await super().send_chunk(chat, text)

    async with Store(store_location) as store:
        conversation = await store.conversation(chat)
        adapter = Slow(fail_on_call=set())
        delivery = delivery_for(store, adapter)
        sending = asyncio.create_task(delivery.send(conversation.id, chat, "hello"))
        while not await store.outbox_pending():
            await asyncio.sleep(0)  # let the send record its outbox row
        sweep = asyncio.create_task(delivery.retry_pending())
        release.set()
        await asyncio.gather(sending, sweep)
        assert adapter.sent == ["hello"]


async def test_the_sweeper_rechecks_a_row_before_sending_it(tmp_path, store_location):
    """Regression: a stale list of pending rows let the sweeper resend a row sent meanwhile."""
    chat = ChatRef(Platform.CONSOLE, "c")
    async with Store(store_location) as store:
        conversation = await store.conversation(chat)
        adapter = FlakyConsole(fail_on_call={1})
        delivery = delivery_for(store, adapter, attempts=1)
        first = await delivery.send(conversation.id, chat, "X")  # fails: left pending
        assert first.queued
        [row] = await store.outbox_pending()
        await store.outbox_progress(row.id, status="sent", message_ids=["9"])  # sent elsewhere meanwhile
        original = store.outbox_pending

        async def stale() -> list:
            return [row]  # the sweeper's snapshot from before the send

        store.outbox_pending = stale  # type: ignore[method-assign]
        try:
            assert await delivery.retry_pending() == 0
        finally:
            store.outbox_pending = original  # type: ignore[method-assign]
        assert adapter.sent == []


async def test_a_row_delivered_by_two_paths_at_once_is_sent_once(tmp_path, llm, tg):
    """A worker that took a chat over retried its unsent row while the resumed turn delivered
    the same row: both sent it (the cluster drill's "answered more than once")."""
    import asyncio

    from conftest import running, write_config

    from bumblebot.core.events import ChatRef, Platform

    chat = ChatRef(Platform.TELEGRAM, "41")
    async with running(write_config(tmp_path, llm, tg)) as d:
        conversation = await d.store.conversation(chat)
        entry = await d.store.outbox_add(conversation.id, None, chat, "just once")
        first, second = await asyncio.gather(d.delivery.deliver(entry), d.delivery.deliver(entry))
    assert first.delivered and second.delivered
    assert tg.sent(41) == ["just once"]


async def test_a_caller_cancelled_while_its_message_is_on_the_way_does_not_leave_it_to_be_sent_again(tmp_path, store_location):
    """A turn stopped (``/stop``, a conversation dropped when its lease is lost) while the
    platform had its message but had not answered yet: the row stayed pending and the
    sweeper sent it a second time."""
    chat = ChatRef(Platform.CONSOLE, "c")
    arrived, answer = asyncio.Event(), asyncio.Event()

    class Slow(FlakyConsole):
        async def send_chunk(self, chat: ChatRef, text: str, *, key: str = "") -> str:
            self.sent.append(text)  # the request reached the platform
            arrived.set()
            await answer.wait()  # its answer has not come back yet
            return "7"

    async with Store(store_location) as store:
        conversation = await store.conversation(chat)
        adapter = Slow(fail_on_call=set())
        delivery = delivery_for(store, adapter)
        caller = asyncio.create_task(delivery.send(conversation.id, chat, "hello"))
        await arrived.wait()
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        answer.set()
        await asyncio.wait(delivery.retrying)
        assert await store.outbox_pending() == []
        assert await delivery.retry_pending() == 0
    assert adapter.sent == ["hello"]


async def test_a_row_recorded_sent_stays_sent(tmp_path, store_location):
    """A worker that lost its chat records a failed attempt after the new worker recorded the
    row sent: the row must not become pending (it would be sent again)."""
    chat = ChatRef(Platform.CONSOLE, "c")
    async with Store(store_location) as store:
        conversation = await store.conversation(chat)
        entry = await store.outbox_add(conversation.id, None, chat, "once")
        await store.outbox_progress(entry.id, status="sent", message_ids=["1"])
        await store.outbox_progress(entry.id, status="pending", message_ids=[], error="network down")
        await store.outbox_progress(entry.id, status="failed", message_ids=[], error="refused")
        row = await store.outbox_entry(entry.id)
    assert row is not None and (row.status, row.platform_message_ids) == ("sent", ["1"])


async def test_a_send_that_fails_after_its_caller_left_is_logged(tmp_path, store_location, caplog):
    """A ``/stop`` left the send going on its own; its failure was never logged anywhere."""
    chat = ChatRef(Platform.CONSOLE, "c")
    arrived, answer = asyncio.Event(), asyncio.Event()

    class Broken(FlakyConsole):
        async def send_chunk(self, chat: ChatRef, text: str, *, key: str = "") -> str:
            arrived.set()
            await answer.wait()
            raise RuntimeError("adapter bug")

    async with Store(store_location) as store:
        conversation = await store.conversation(chat)
        delivery = delivery_for(store, Broken(fail_on_call=set()))
        caller = asyncio.create_task(delivery.send(conversation.id, chat, "hello"))
        await arrived.wait()
        caller.cancel()
        answer.set()
        await asyncio.wait(delivery.retrying)
    assert any("not sent" in r.getMessage() and "adapter bug" in r.getMessage() for r in caplog.records)
