"""The request limiter (bumblebot/llm/slots.py): at most so many requests in flight, and a turn's
next request first in line while others wait, so that a one-slot server keeps its cached prompt."""

from __future__ import annotations

import asyncio

from bumblebot.llm import slots as slots_module
from bumblebot.llm.slots import RequestSlots


async def waiting_for(slots: RequestSlots, n: int) -> None:
    """Until ``n`` requests wait for a slot (each wait is entered within one loop pass)."""
    while slots.waiting < n:
        await asyncio.sleep(0)


async def test_a_conversations_next_request_goes_before_the_others_waiting():
    slots = RequestSlots(1, affinity_s=0.05)
    await slots.acquire("telegram:1")
    other = asyncio.ensure_future(slots.acquire("telegram:2"))
    await waiting_for(slots, 1)
    for _ in range(2):  # the next step, then the completion check: each sent first
        slots.release("telegram:1")
        await slots.acquire("telegram:1")
        assert not other.done()
    slots.release("telegram:1")  # the turn is over: after the hold the other chat's request goes
    await asyncio.wait_for(other, 5)
    slots.release("telegram:2")


async def test_a_freed_slot_goes_to_the_first_waiting_when_the_conversation_does_not_come_back():
    slots = RequestSlots(1, affinity_s=0.05)
    await slots.acquire("telegram:1")
    other = asyncio.ensure_future(slots.acquire("telegram:2"))
    await waiting_for(slots, 1)
    slots.release("telegram:1")
    await asyncio.wait_for(other, 5)  # after the hold: the turn ended, or its tool call is slow
    third = asyncio.ensure_future(slots.acquire("telegram:1"))
    await waiting_for(slots, 1)
    assert not third.done()  # the slot is telegram:2's now
    slots.release("telegram:2")
    await asyncio.wait_for(third, 5)
    slots.release("telegram:1")
    await slots.acquire(None)  # free again, at once
    slots.release(None)


async def test_without_contention_nothing_is_held_and_nobody_waits():
    slots = RequestSlots(2, affinity_s=30.0)
    await slots.acquire("telegram:1")
    await slots.acquire("telegram:2")
    slots.release("telegram:1")  # nobody waits: freed, not held
    await asyncio.wait_for(slots.acquire("telegram:3"), 1)
    slots.release("telegram:2")
    slots.release("telegram:3")


async def test_a_slot_is_held_for_one_conversation_only_so_many_times_in_a_row(monkeypatch):
    monkeypatch.setattr(slots_module, "MAX_IN_A_ROW", 3)
    slots = RequestSlots(1, affinity_s=30.0)  # a hold would outlast the test
    await slots.acquire("telegram:1")
    other = asyncio.ensure_future(slots.acquire("telegram:2"))
    await waiting_for(slots, 1)
    for _ in range(2):
        slots.release("telegram:1")
        await slots.acquire("telegram:1")  # held for it: its 2nd and 3rd requests in a row
    assert not other.done()
    slots.release("telegram:1")  # the 3rd in a row ended: the slot goes on at once, not held
    await asyncio.wait_for(other, 1)
    slots.release("telegram:2")  # nobody waits: freed
    await asyncio.wait_for(slots.acquire("telegram:1"), 1)
    slots.release("telegram:1")


async def test_a_waiter_cancelled_as_the_slot_came_to_it_passes_it_on():
    slots = RequestSlots(1, affinity_s=0.01)
    await slots.acquire(None)
    first = asyncio.ensure_future(slots.acquire("telegram:1"))
    second = asyncio.ensure_future(slots.acquire("telegram:2"))
    await waiting_for(slots, 2)
    slots.release(None)  # no conversation: handed to telegram:1 at once
    first.cancel()  # ...which is cancelled (its turn was stopped) before it ran
    await asyncio.wait_for(second, 5)
    assert first.cancelled()
    slots.release("telegram:2")
