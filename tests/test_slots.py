"""The request slots of an endpoint (bumblebot/llm/slots.py): when every slot is taken, the
request of a turn whose person has seen nothing yet is sent before the later steps of other
chats' turns, and background work comes last. Real openai client against the fake endpoint on
127.0.0.1, real SQLite files for the daemon's run."""

from __future__ import annotations

import asyncio

import pytest
from conftest import running, write_config
from fakes.openai_server import FakeOpenAI
from support import Gate, contents, is_loop_with, judges_say_done, loop_requests, say, until

from bumblebot.cognition.state import LoopState
from bumblebot.core.messages import Message
from bumblebot.core.settings import LLMSettings
from bumblebot.core.usage import (
    BACKGROUND,
    FIRST_WORDS,
    INTERACTIVE,
    answered,
    awaited,
    message_came,
    scoped,
    unanswered,
    unless,
    urgency,
)
from bumblebot.llm import LLM, CapabilityMemory
from bumblebot.llm.slots import RequestSlots


def test_urgency_follows_the_turn_until_it_has_said_something():
    assert urgency() == INTERACTIVE  # outside any turn: a summary, check
    with awaited():
        assert urgency() == FIRST_WORDS
        answered()
        assert urgency() == INTERACTIVE
    with scoped(kind="automation", background=True), awaited():
        assert urgency() == BACKGROUND
    answered()  # outside a turn: nothing to mark
    assert urgency() == INTERACTIVE


def test_a_message_taken_in_mid_turn_makes_the_turn_urgent_again_until_answered():
    """A follow-up steered into a turn that had already said something waited behind every
    other chat's steps, as if nobody were waiting for it."""
    with awaited():
        state = LoopState(lambda name: None)
        state.said("Hello!")
        assert urgency() == INTERACTIVE
        state.on_user(Message(role="user", content="and what about tomorrow?"))
        assert urgency() == FIRST_WORDS
        state.said("Tomorrow is free.")
        assert urgency() == INTERACTIVE
    unanswered()  # outside a turn: nothing to mark
    assert urgency() == INTERACTIVE


async def test_a_freed_slot_goes_to_the_most_urgent_waiter_then_in_order():
    slots, order = RequestSlots(1), []

    async def request(name: str, first_words: bool, background: bool = False) -> None:
        with scoped(background=background), awaited():
            if not first_words:
                answered()
            async with slots:
                order.append(name)

    await slots.__aenter__()  # the request in flight
    names = [("step-a", False), ("task", False, True), ("first-b", True), ("step-c", False), ("first-d", True)]
    tasks = []
    for args in names:
        tasks.append(asyncio.create_task(request(*args)))
        await asyncio.sleep(0)  # let it queue, in this order
    assert slots.waiting == 5
    await slots.__aexit__(None, None, None)
    await asyncio.gather(*tasks)
    assert order == ["first-b", "first-d", "step-a", "step-c", "task"]
    assert slots.waiting == 0


async def test_a_waiter_cancelled_as_it_was_given_the_slot_passes_it_on():
    slots = RequestSlots(1)
    await slots.__aenter__()
    first = asyncio.create_task(slots.__aenter__())
    second = asyncio.create_task(slots.__aenter__())
    await asyncio.sleep(0)
    await slots.__aexit__(None, None, None)  # given to ``first``...
    first.cancel()  # ...which is cancelled before it runs: ``second`` gets the slot
    await asyncio.wait_for(second, 1)
    assert first.cancelled() and slots.waiting == 0
    third = asyncio.create_task(slots.__aenter__())
    await asyncio.sleep(0)
    assert not third.done()  # one slot, held by ``second``
    await slots.__aexit__(None, None, None)
    await asyncio.wait_for(third, 1)


async def test_a_cancelled_waiter_keeps_no_place():
    slots = RequestSlots(1)
    await slots.__aenter__()
    gone = asyncio.create_task(slots.__aenter__())
    await asyncio.sleep(0)
    gone.cancel()
    await asyncio.gather(gone, return_exceptions=True)
    assert slots.waiting == 0
    await slots.__aexit__(None, None, None)
    await asyncio.wait_for(slots.__aenter__(), 1)  # the slot was free, not given to the cancelled one


async def test_requests_through_the_client_wait_for_the_slot_most_urgent_first():
    hold = Gate(say("held"))
    async with FakeOpenAI() as server:
        server.push(hold)
        server.push(say("one"))
        server.push(say("two"))
        llm = LLM(LLMSettings(model="test-model", max_retries=0, timeout_s=10, max_concurrent_requests=1),
                  base_url=server.base_url, api_key="sk-test", capabilities=CapabilityMemory())

        async def ask(text: str, first_words: bool) -> None:
            with awaited():
                if not first_words:
                    answered()
                await llm.complete([{"role": "user", "content": text}], max_tokens=64)

        held = asyncio.create_task(ask("held", True))
        await hold.entered.wait()
        later = asyncio.create_task(ask("a later step", False))
        await until(lambda: llm.waiting == 1)
        new = asyncio.create_task(ask("a new message", True))
        await until(lambda: llm.waiting == 2)
        hold.release.set()
        await asyncio.gather(held, later, new)
        await llm.aclose()
    asked = [r["messages"][-1]["content"] for r in server.requests]
    assert asked == ["held", "a new message", "a later step"]


async def test_a_new_message_goes_before_other_chats_later_steps_at_a_one_slot_server(tmp_path, tg):
    """Chat A's turn is on its third step and chat C's first step holds the only slot when B
    writes: B's first step is sent next, before A's third, though A's came first."""
    a_second, c_first = Gate(say("A two", end=False)), Gate(say("C one"))
    async with FakeOpenAI() as llm:
        judges_say_done(llm)
        llm.push(say("A one", end=False), when=is_loop_with("apple"))
        llm.push(a_second, when=is_loop_with("apple"))
        llm.push(say("A three"), when=is_loop_with("apple"))
        llm.push(c_first, when=is_loop_with("cherry"))
        llm.push(say("B one"), when=is_loop_with("banana"))
        config = write_config(tmp_path, llm, tg, llm={"max_concurrent_requests": 1},
                              cognition={"classifier": False, "debounce_s": 0})
        async with running(config) as d:
            endpoint = d.llm.primary
            tg.push_text("apple", chat_id=2801)
            await asyncio.wait_for(a_second.entered.wait(), 10)  # A said "A one"; its second step holds the slot
            tg.push_text("cherry", chat_id=2803)
            await until(lambda: endpoint.waiting == 1)  # C's first step waits
            a_second.release.set()
            await asyncio.wait_for(c_first.entered.wait(), 10)  # C's first step holds the slot
            await until(lambda: endpoint.waiting == 1)  # A's third step waits
            tg.push_text("banana", chat_id=2802)
            await until(lambda: endpoint.waiting == 2)  # so does B's first
            c_first.release.set()
            await d.engine.wait_for_turns(3)
    order = [next(w for w in ("apple", "banana", "cherry") if w in contents(r)) for r in loop_requests(llm)]
    assert order == ["apple", "apple", "cherry", "banana", "apple"]
    assert tg.shown(2802) == ["B one"] and tg.shown(2801) == ["A one", "A two", "A three"]


async def kept_run(slots: RequestSlots, order: list[str], name: str, steps: int, *, gap: asyncio.Event | None = None,
                   answer_after: int | None = None) -> None:
    """A turn whose person waits: ``steps`` requests one after another (a tool between them)."""
    with awaited():
        for step in range(steps):
            if answer_after is not None and step == answer_after:
                answered()
            async with slots:
                order.append(f"{name}{step}")
                await asyncio.sleep(0)
            if gap is not None:
                await gap.wait()


async def test_a_one_slot_server_keeps_the_slot_for_the_next_step_of_a_waiting_turn():
    """llama-cpp-python keeps one prompt cache: another chat's request between two steps of a
    turn made its next step read the whole conversation again (3,087 tokens, 58 s)."""
    slots, order = RequestSlots(1, keep_s=5), []
    await slots.__aenter__()  # another request in flight
    a = asyncio.create_task(kept_run(slots, order, "a", 3))
    await until(lambda: slots.waiting == 1)
    b = asyncio.create_task(kept_run(slots, order, "b", 1))
    await until(lambda: slots.waiting == 2)
    await slots.__aexit__(None, None, None)
    await asyncio.wait_for(asyncio.gather(a, b), 2)  # well before keep_s: the turn's end released it
    assert order == ["a0", "a1", "a2", "b0"]


async def test_a_kept_slot_is_released_by_the_turns_end_its_answer_a_run_or_the_time():
    ended = RequestSlots(1, keep_s=60)
    await asyncio.wait_for(kept_run(ended, [], "a", 1), 1)
    await asyncio.wait_for(ended.__aenter__(), 1)  # released when the turn ended, not after 60 s

    lapsed, gap = RequestSlots(1, keep_s=0.05), asyncio.Event()
    order: list[str] = []
    a = asyncio.create_task(kept_run(lapsed, order, "a", 2, gap=gap))  # a slow tool after its first step
    await until(lambda: order == ["a0"])
    await asyncio.wait_for(lapsed.__aenter__(), 2)  # another chat gets it once keep_s has passed
    gap.set()
    await asyncio.sleep(0)
    assert order == ["a0"]  # the turn's next step now waits for the slot like any other
    await lapsed.__aexit__(None, None, None)
    await asyncio.wait_for(a, 2)

    answering, order = RequestSlots(1, keep_s=60), []
    await answering.__aenter__()
    a = asyncio.create_task(kept_run(answering, order, "a", 2, answer_after=1))  # said something after a0
    await until(lambda: answering.waiting == 1)
    b = asyncio.create_task(kept_run(answering, order, "b", 1))
    await until(lambda: answering.waiting == 2)
    await answering.__aexit__(None, None, None)
    await asyncio.wait_for(asyncio.gather(a, b), 2)
    assert order == ["a0", "b0", "a1"]  # once answered, a new message's first words go first

    running, order = RequestSlots(1, keep_s=60), []
    await running.__aenter__()
    a = asyncio.create_task(kept_run(running, order, "a", 6))
    await until(lambda: running.waiting == 1)
    b = asyncio.create_task(kept_run(running, order, "b", 1))
    await until(lambda: running.waiting == 2)
    await running.__aexit__(None, None, None)
    await asyncio.wait_for(asyncio.gather(a, b), 2)
    assert order[:5] == ["a0", "a1", "a2", "a3", "b0"]  # KEEP_RUN requests in a row, then the other chat


async def test_several_slots_or_background_work_keep_nothing():
    many, order = RequestSlots(2, keep_s=60), []
    await asyncio.wait_for(kept_run(many, order, "a", 2), 1)
    await many.__aenter__()
    await asyncio.wait_for(many.__aenter__(), 1)  # both free: nothing was kept
    background = RequestSlots(1, keep_s=60)
    with scoped(background=True):
        await asyncio.wait_for(kept_run(background, [], "task", 1), 1)
    await asyncio.wait_for(background.__aenter__(), 1)


async def test_a_kept_run_ends_after_its_time_while_others_wait():
    """Four steps near their deadline on a slow model would hold another chat's first words
    for minutes: the run also ends KEEP_RUN_S after its first request ended."""
    import bumblebot.llm.slots as slots_module

    clock = [1000.0]
    slots, order = RequestSlots(1, keep_s=60, clock=lambda: clock[0]), []

    async def slow_turn() -> None:
        with awaited():
            for step in range(4):
                async with slots:
                    order.append(f"a{step}")
                    clock[0] += slots_module.KEEP_RUN_S * 0.6  # a long step
                await asyncio.sleep(0)

    await slots.__aenter__()
    a = asyncio.create_task(slow_turn())
    await until(lambda: slots.waiting == 1)
    b = asyncio.create_task(kept_run(slots, order, "b", 1))
    await until(lambda: slots.waiting == 2)
    await slots.__aexit__(None, None, None)
    await asyncio.wait_for(asyncio.gather(a, b), 2)
    assert order == ["a0", "a1", "a2", "b0", "a3"]  # a2 ended 1.2 KEEP_RUN_S after a0: no more kept


async def test_a_message_for_a_running_turn_makes_its_waiting_request_urgent():
    """A turn that had answered queued its next step behind other chats' work; a message that
    came for it meanwhile waited behind all of them too (172 s on SmolLM2): the step that
    takes it in was not even sent."""
    from bumblebot.core.usage import message_came

    slots, order = RequestSlots(1, keep_s=0), []

    async def step(name: str, conversation: str | None, first_words: bool) -> None:
        with awaited(conversation):
            if not first_words:
                answered()
            async with slots:
                order.append(name)

    await slots.__aenter__()
    other = asyncio.create_task(step("other-chat-step", None, False))
    await until(lambda: slots.waiting == 1)
    running = asyncio.create_task(step("running-turn-step", "telegram:1", False))
    await until(lambda: slots.waiting == 2)
    first = asyncio.create_task(step("new-message", None, True))
    await until(lambda: slots.waiting == 3)
    message_came("telegram:1")
    message_came("telegram:2")  # no turn running there: nothing to do
    await slots.__aexit__(None, None, None)
    await asyncio.wait_for(asyncio.gather(other, running, first), 2)
    assert order == ["running-turn-step", "new-message", "other-chat-step"]


async def test_a_request_still_waiting_for_a_slot_is_given_up_when_its_event_is_set():
    """Between turns a compaction's summary waited for the one slot while another chat's step
    ran; the person's message came meanwhile, and the summary was still sent (a minute on
    SmolLM2) before the message's turn could begin."""
    from bumblebot.core.usage import GaveUp, unless

    slots, came, sent = RequestSlots(1, keep_s=0), asyncio.Event(), []

    async def summary() -> None:
        with unless(came):
            async with slots:
                sent.append("summary")

    await slots.__aenter__()  # another chat's step is in flight
    waiting = asyncio.create_task(summary())
    await until(lambda: slots.waiting == 1)
    came.set()
    with pytest.raises(GaveUp):
        await asyncio.wait_for(waiting, 1)
    assert slots.waiting == 0
    await slots.__aexit__(None, None, None)
    await asyncio.wait_for(slots.__aenter__(), 1)  # the slot is free, not given to the summary
    assert sent == []
    with unless(came):  # already set, but a free slot: nothing waits, so the request is sent
        await slots.__aexit__(None, None, None)
        async with slots:
            sent.append("sent")
    assert sent == ["sent"]


async def test_a_turn_that_answered_keeps_its_slot_rather_than_hand_it_to_background_work():
    slots, order = RequestSlots(1, keep_s=5), []

    async def background() -> None:
        with scoped(kind="automation", background=True):
            async with slots:
                order.append("automation")

    with awaited("telegram:1"):
        async with slots:
            order.append("turn-step-1")
        task = asyncio.create_task(background())  # an automation asks meanwhile
        await until(lambda: slots.waiting == 1)
        answered()  # the turn said something in its first step
        async with slots:
            order.append("turn-step-2")
    await asyncio.wait_for(task, 2)
    assert order == ["turn-step-1", "turn-step-2", "automation"]


async def test_a_turn_entered_again_is_the_same_turn_to_the_slots_and_to_message_came():
    """TurnRunner.run and its steps each open the turn's scope: the classifier's request kept
    the slot for the outer block, and the first step, another turn to the slots, waited KEEP_S
    with the slot idle; after the inner block message_came no longer reached the turn."""
    from bumblebot.core import usage

    slots = RequestSlots(1, keep_s=60)
    with awaited("telegram:1"):
        outer = usage.awaited_turn()
        async with slots:
            pass  # the classifier
        with awaited("telegram:1"):
            assert usage.awaited_turn() is outer
            await asyncio.wait_for(slots.__aenter__(), 1)  # the kept slot, at once
            await slots.__aexit__(None, None, None)
        answered()
        message_came("telegram:1")
        assert usage.urgency() == FIRST_WORDS
    await asyncio.wait_for(slots.__aenter__(), 1)  # released when the turn ended


async def test_a_request_cancelled_while_it_may_give_up_its_wait_leaves_the_slot_to_the_next():
    """/stop of a capped turn whose request waited for the one slot (inside ``unless``): its
    pending place kept the slot when released, and the endpoint answered nobody again."""
    slots = RequestSlots(1, keep_s=0)
    await slots.__aenter__()  # another request in flight

    async def capped() -> None:
        with unless(asyncio.Event()):
            async with slots:
                pass

    waiting = asyncio.ensure_future(capped())
    await until(lambda: slots.waiting == 1)
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    await slots.__aexit__(None, None, None)

    async def later() -> str:
        async with slots:
            return "sent"

    assert await asyncio.wait_for(later(), 2) == "sent"
