"""Pacing (adapters/telegram/pacing.py): one scheduler per adapter for every call to a chat, and a
typing indicator that honours a 429.

The unit tests run :class:`~adapters.telegram.pacing.Pacer` with Telegram's published limits on an
event loop with virtual time (:class:`support.VirtualClockLoop`: when nothing is ready, the
clock jumps to the next timer), so a minute of pacing takes no time and every instant is exact. The
end-to-end tests run the real python-telegram-bot against tests/fakes/telegram_server.py
with a scaled-down interval, asserting only lower bounds of the spacing the fake recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator
from itertools import pairwise
from typing import Any

import pytest
from conftest import running, write_config
from fakes.openai_server import is_loop
from fakes.telegram_server import retry_after_body
from support import Gate, now, say, virtual

from adapters.telegram.pacing import MIN_TRACKED, PaceLimits, Pacer
from bumblebot.core.adapter import Adapter
from bumblebot.core.errors import DeliveryFailed
from bumblebot.core.events import ChatRef, Platform

TELEGRAM = PaceLimits()  # the published limits: 1 s per chat, 20 a minute per group, 30 a second


class Recorder:
    """Calls made through a pacer: (name, start, end) in the order they started."""

    def __init__(self, pacer: Pacer, call_s: float = 0.0) -> None:
        self.pacer, self.call_s = pacer, call_s
        self.calls: list[tuple[str, float, float]] = []

    async def call(self, chat: str, name: str, *, group: bool = False, **slot: Any) -> None:
        async with self.pacer.slot(chat, group=group, **slot):
            start = now()
            await asyncio.sleep(self.call_s)  # the platform's answer takes a while
            self.calls.append((name, start, now()))

    def names(self) -> list[str]:
        return [n for n, _, _ in self.calls]

    def starts(self) -> list[float]:
        return [s for _, s, _ in self.calls]


# -- the pacer with Telegram's limits ----------------------------------------------------------


def test_the_defaults_are_telegrams_published_limits():
    assert (TELEGRAM.per_chat_interval_s, TELEGRAM.group_per_minute, TELEGRAM.global_per_second) == (1.0, 20, 30)
    assert TELEGRAM.per_chat_burst == 3
    with pytest.raises(ValueError):
        PaceLimits(group_per_minute=0)


def test_twenty_messages_to_one_chat_in_one_second_go_a_second_apart_in_order():
    async def main() -> Recorder:
        rec = Recorder(Pacer(TELEGRAM), call_s=0.05)
        # the failing input: 20 replies to one chat asked for within one second
        tasks = []
        for i in range(20):
            tasks.append(asyncio.create_task(rec.call("1001", f"reply {i}")))
            await asyncio.sleep(0.04)
        await asyncio.gather(*tasks)
        return rec

    rec = virtual(main())
    assert rec.names() == [f"reply {i}" for i in range(20)]  # in order, none dropped
    burst = TELEGRAM.per_chat_burst
    for (_, _, end), (_, start, _) in zip(rec.calls, rec.calls[burst:]):
        assert start - end >= 1.0  # beyond the burst allowance: one call a second
    assert rec.starts()[burst - 1] - rec.starts()[0] < 1.0  # the first three are not held back
    assert rec.starts()[-1] - rec.starts()[0] >= 20 - burst  # not 20 sends within a second


def test_the_21st_message_to_a_group_in_a_minute_waits_for_the_window():
    async def main() -> Recorder:
        rec = Recorder(Pacer(TELEGRAM), call_s=0.1)
        await asyncio.gather(*(rec.call("-100123", f"m{i}", group=True) for i in range(25)))
        return rec

    rec = virtual(main())
    assert rec.names() == [f"m{i}" for i in range(25)]
    ends = [e for _, _, e in rec.calls]
    starts = rec.starts()
    assert starts[19] - starts[0] < 60  # the first 20 only need the per-chat pace
    for i in range(20, 25):
        assert starts[i] >= ends[i - 20] + 60.0  # never more than 20 in any minute
    # a private chat (no group window) is not held by it
    rec2 = virtual(_private_burst(25))
    assert rec2.starts()[-1] - rec2.starts()[0] < 60


async def _private_burst(n: int) -> Recorder:
    rec = Recorder(Pacer(TELEGRAM), call_s=0.1)
    await asyncio.gather(*(rec.call("1001", f"m{i}") for i in range(n)))
    return rec


def test_no_more_than_thirty_calls_a_second_across_chats():
    async def main() -> Recorder:
        rec = Recorder(Pacer(TELEGRAM))
        await asyncio.gather(*(rec.call(str(chat), f"{chat}.{i}") for i in range(3) for chat in range(40)))
        return rec

    rec = virtual(main())
    assert len(rec.calls) == 120
    starts = sorted(rec.starts())
    for i in range(len(starts) - 30):
        assert starts[i + 30] - starts[i] >= 1.0  # any 31 calls span at least a second
    for chat in range(40):  # each chat's own calls still in order
        mine = [(n, s) for n, s, _ in rec.calls if n.startswith(f"{chat}.")]
        assert [n for n, _ in mine] == [f"{chat}.{i}" for i in range(3)]


def test_a_429_pauses_the_chat_and_its_retry_keeps_its_place():
    async def main() -> tuple[Recorder, float]:
        pacer = Pacer(TELEGRAM)
        rec = Recorder(pacer, call_s=0.05)
        refused_at: list[float] = []

        async def first_is_refused() -> None:  # as Delivery does: refused, wait retry_after, retry
            with contextlib.suppress(DeliveryFailed):
                async with pacer.slot("7", ticket="row1.0", max_wait_s=30):
                    refused_at.append(now())
                    pacer.pause("7", 5.0)
                    raise DeliveryFailed("429", retryable=True, retry_after=5.0)
            await asyncio.sleep(5.0)
            await rec.call("7", "row1 (retried)", ticket="row1.0", max_wait_s=30)

        tasks = [asyncio.create_task(first_is_refused())]
        await asyncio.sleep(0)
        tasks += [asyncio.create_task(rec.call("7", f"row{i}", ticket=f"row{i}.0")) for i in range(2, 5)]
        tasks.append(asyncio.create_task(rec.call("8", "other chat")))
        assert pacer.paused_for("8") == 0.0
        await asyncio.gather(*tasks)
        return rec, refused_at[0]

    rec, refused_at = virtual(main())
    in_7 = [(n, s) for n, s, _ in rec.calls if n != "other chat"]
    assert [n for n, _ in in_7] == ["row1 (retried)", "row2", "row3", "row4"]  # order kept, nothing lost
    assert in_7[0][1] >= refused_at + 5.0  # nothing to the chat inside retry_after
    other = next(s for n, s, _ in rec.calls if n == "other chat")
    assert other < refused_at + 1.0  # another chat is not held up


def test_a_pause_longer_than_the_wait_bound_is_refused_at_once_and_paused_for_reports_it():
    async def main() -> tuple[float, DeliveryFailed, float]:
        pacer = Pacer(TELEGRAM)
        pacer.pause("9", 120.0)
        left = pacer.paused_for("9")
        start = now()
        with pytest.raises(DeliveryFailed) as refused:
            async with pacer.slot("9", max_wait_s=30):
                raise AssertionError("sent inside the pause")
        return left, refused.value, now() - start

    left, refused, waited = virtual(main())
    assert left == 120.0
    assert refused.retryable and refused.retry_after == pytest.approx(120.0)
    assert waited == 0.0  # refused at once, not after 30 s


def test_a_droppable_call_never_queues_behind_others():
    async def main() -> list[str]:
        pacer = Pacer(TELEGRAM)
        rec = Recorder(pacer, call_s=0.5)
        busy = asyncio.create_task(rec.call("3", "message"))
        await asyncio.sleep(0.1)
        with pytest.raises(DeliveryFailed):
            async with pacer.slot("3", droppable=True):
                raise AssertionError("an edit went before the message")
        await busy
        await rec.call("3", "edit", droppable=True, max_wait_s=2.0)  # free again: it goes
        return rec.names()

    assert virtual(main()) == ["message", "edit"]


def test_a_cancelled_waiter_does_not_hold_the_queue():
    async def main() -> list[str]:
        rec = Recorder(Pacer(dataclasses.replace(TELEGRAM, per_chat_burst=1)), call_s=0.1)
        tasks = [asyncio.create_task(rec.call("5", f"m{i}")) for i in range(4)]
        await asyncio.sleep(0.5)  # m0 sent; m1 waits for the spacing, m2 and m3 queue
        tasks[2].cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return rec.names()

    assert virtual(main()) == ["m0", "m1", "m3"]


def test_memory_stays_bounded_with_many_chats():
    async def main() -> tuple[int, int, int]:
        pacer = Pacer(TELEGRAM)
        peak = 0
        for chat in range(3000):  # a chat is forgotten a second after its call
            async with pacer.slot(str(chat)):
                pass
            peak = max(peak, pacer.tracked)
        for chat in range(300):  # a group is remembered for its window (a minute)
            async with pacer.slot(str(-chat - 1), group=True):
                pass
        groups = pacer.tracked
        await asyncio.sleep(61.0)
        for chat in range(3000, 3600):
            async with pacer.slot(str(chat)):
                pass
        return peak, groups, pacer.tracked

    peak, groups, after = virtual(main())
    assert peak <= 2 * MIN_TRACKED  # 3000 chats used, a few dozen remembered at a time
    assert groups >= 300  # still inside their window
    assert after <= 2 * MIN_TRACKED  # forgotten once the window is over


# -- typing holds for a 429's retry_after ---------------------------------------------------------


class TypingOnly(Adapter):
    """An adapter whose typing indicator Telegram refuses once with retry_after."""

    platform = Platform.CONSOLE

    def __init__(self, retry_after: float) -> None:
        self.retry_after = retry_after
        self.sent: list[float] = []

    async def start(self) -> None: ...
    async def stop(self) -> None: ...
    def chunks(self, text: str) -> list[str]:
        return [text]
    async def send_chunk(self, chat: ChatRef, chunk: Any, *, key: str) -> str:
        return "1"

    async def send_typing(self, chat: ChatRef) -> None:
        self.sent.append(now())
        if len(self.sent) == 1:
            raise DeliveryFailed("429", retryable=True, retry_after=self.retry_after)


def test_typing_refresh_waits_out_retry_after_not_its_interval():
    async def main() -> list[float]:
        adapter = TypingOnly(retry_after=3.0)
        async with adapter.typing(ChatRef(Platform.CONSOLE, "1"), interval_s=0.5) as handle:
            await asyncio.sleep(2.0)
            handle.pause()  # the first words show, then the turn waits on the model again
            await asyncio.sleep(0.1)
            handle.resume()
            await asyncio.sleep(3.0)
        return adapter.sent

    sent = virtual(main())
    assert sent[1] - sent[0] >= 3.0  # not the fixed 0.5 s inside the flood window
    assert all(b - a >= 0.5 for a, b in pairwise(sent[1:]))  # then the interval again


# -- end to end: real python-telegram-bot against the fake -------------------------------------------

FAST = PaceLimits(per_chat_interval_s=0.05)  # the published ones, one chat's spacing scaled down


@contextlib.asynccontextmanager
async def paced_daemon(tmp_path, llm, tg, pace: PaceLimits = FAST, **sections: Any) -> AsyncIterator[Any]:
    async with running(write_config(tmp_path, llm, tg, **sections), pace=pace) as daemon:
        yield daemon


def spacing(calls: list[Any], burst: int = FAST.per_chat_burst) -> list[float]:
    """Seconds between each call and the one ``burst`` calls later: a token bucket of
    ``burst`` calls lets no more than ``burst`` calls into any one interval."""
    return [b.time - a.time for a, b in zip(calls, calls[burst:])]


async def test_twenty_commands_in_one_second_are_answered_spaced_in_order(tmp_path, llm, tg):
    async with paced_daemon(tmp_path, llm, tg):
        for i in range(20):  # the failing input: 20 commands to one chat within one second
            tg.push_text(f"/nosuch{i}", chat_id=1301)
        calls = await tg.wait_for("sendMessage", n=20, timeout=20, predicate=lambda p: p.get("chat_id") == 1301)
    assert [c.params["text"] for c in calls] == [f"Unknown command /nosuch{i}. Try /help." for i in range(20)]
    assert min(spacing(calls)) >= FAST.per_chat_interval_s


async def test_commands_paced_in_one_chat_do_not_hold_up_another_chat(tmp_path, llm, tg):
    """20 commands from one chat do not hold up another chat's next update (a command's answer
    was once sent inside Telegram's poller, so the other chat waited until they were all out)."""
    from support import judges_say_done, say

    judges_say_done(llm)
    llm.push(say("Hello, other chat."), when=lambda r: "tools" in r)
    async with paced_daemon(tmp_path, llm, tg, pace=PaceLimits(per_chat_interval_s=0.5)):
        for i in range(10):
            tg.push_text(f"/nosuch{i}", chat_id=1305)  # 10 answers at 0.5 s each: 4.5 s of pace
        tg.push_text("hi", chat_id=1306)
        [other] = await tg.wait_for("sendMessage", predicate=lambda p: p.get("chat_id") == 1306, timeout=10)
        calls = await tg.wait_for("sendMessage", n=10, timeout=20, predicate=lambda p: p.get("chat_id") == 1305)
    assert other.params["text"] == "Hello, other chat."
    assert other.time < calls[-1].time  # answered while the first chat's answers were still paced
    assert [c.params["text"] for c in calls] == [f"Unknown command /nosuch{i}. Try /help." for i in range(10)]


async def queued(d: Any, chat: ChatRef, texts: list[str]) -> list[Any]:
    """Outbox rows for ``texts`` to ``chat``, written in order (nothing sent yet)."""
    conversation = await d.store.conversation(chat)
    return [await d.store.outbox_add(conversation.id, None, chat, t) for t in texts]


async def test_replies_queued_at_once_reach_the_chat_spaced_and_in_order(tmp_path, llm, tg):
    texts = [f"reply {i:02d}" for i in range(20)]
    async with paced_daemon(tmp_path, llm, tg) as d:
        first, *rest = await queued(d, ChatRef(Platform.TELEGRAM, "1302"), texts)
        reports = [await d.delivery.deliver(first)]
        reports += await asyncio.gather(*(d.delivery.deliver(row) for row in rest))  # 19 at the same instant
    assert all(r.delivered for r in reports)
    calls = [c for c in tg.calls if c.method == "sendMessage" and c.params.get("chat_id") == 1302]
    assert [c.params["text"] for c in calls] == texts  # in order, none dropped, once each
    assert min(spacing(calls)) >= FAST.per_chat_interval_s


class WatchedPacer(Pacer):
    """A pacer that records when it paused a chat (the test waits for it)."""

    def __init__(self, limits: PaceLimits) -> None:
        super().__init__(limits)
        self.paused_at: list[float] = []
        self.paused = asyncio.Event()

    def pause(self, chat_key: str, seconds: float) -> None:
        super().pause(chat_key, seconds)
        self.paused_at.append(now())
        self.paused.set()


async def test_a_429_pauses_that_chat_only_and_order_is_kept(tmp_path, llm, tg, monkeypatch):
    texts = [f"paused {i}" for i in range(4)]
    async with paced_daemon(tmp_path, llm, tg) as d:
        adapter = d.adapters[0]
        pacer = WatchedPacer(FAST)
        monkeypatch.setattr(adapter, "pacer", pacer)
        paused, other = ChatRef(Platform.TELEGRAM, "1303"), ChatRef(Platform.TELEGRAM, "1304")
        rows = await queued(d, paused, texts)
        [elsewhere] = await queued(d, other, ["not held up"])
        tg.fail_next("sendMessage", 429, retry_after_body(1))
        first = asyncio.create_task(d.delivery.deliver(rows[0]))
        await tg.wait_for("sendMessage", predicate=lambda p: p.get("chat_id") == 1303)  # it has the turn
        rest = [asyncio.create_task(d.delivery.deliver(row)) for row in rows[1:]]  # queued behind it
        await asyncio.wait_for(pacer.paused.wait(), 5)  # refused: 429, retry_after 1
        await adapter.send_typing(paused)  # skipped inside the pause: no call
        assert (await d.delivery.deliver(elsewhere)).delivered
        reports = await asyncio.gather(first, *rest)
    assert all(r.delivered for r in reports)
    to_paused = [c for c in tg.calls if c.params.get("chat_id") == 1303]
    assert [c.method for c in to_paused] == ["sendMessage"] * 5  # no typing inside the pause
    _, *after = to_paused
    assert [c.params["text"] for c in after] == texts  # the refused one goes first when retried
    assert after[0].time - pacer.paused_at[0] >= 1.0  # nothing to that chat within retry_after
    [answered] = [c for c in tg.calls if c.params.get("chat_id") == 1304]
    assert answered.time < after[0].time  # the other chat was answered meanwhile
    assert min(spacing(after)) >= FAST.per_chat_interval_s


async def test_a_typing_429_holds_the_next_chat_action_for_retry_after(tmp_path, llm, tg):
    slow = Gate(say("done thinking"))
    llm.push(slow, when=is_loop)
    tg.fail_next("sendChatAction", 429, retry_after_body(1))
    async with paced_daemon(tmp_path, llm, tg, engine={"typing_interval_s": 0.05, "shutdown_grace_s": 5}):
        tg.push_text("take your time", chat_id=1305)
        actions = await tg.wait_for("sendChatAction", n=3, timeout=10)
        slow.release.set()
        await tg.wait_for("sendMessage", predicate=lambda p: p.get("chat_id") == 1305)
    # the failing input: a 0.05 s refresh after a 429 that asked for 1 s
    assert actions[1].time - actions[0].time >= 1.0
    assert actions[2].time - actions[1].time >= 0.05


async def test_a_429_longer_than_the_inline_wait_mid_reply_keeps_the_reply_in_order(tmp_path, llm, tg, monkeypatch):
    """The second chunk of a reply gets a 429 longer than the inline wait: the rows wait for the
    pause's end and go in order (left to the sweeper, 30 s later, the chunk once came after the
    answer to the next message, sent as the pause ended). (The 30 s inline wait is scaled to 1 s
    and the 429's retry_after to 2 s.)"""
    from fakes.telegram_server import retry_after_body
    from support import judges_say_done, say

    import adapters.telegram.sending as telegram_sending
    import bumblebot.delivery.outbox as delivery

    monkeypatch.setattr(delivery, "MAX_INLINE_WAIT_S", 1.0)
    monkeypatch.setattr(telegram_sending, "MAX_INLINE_WAIT_S", 1.0)
    judges_say_done(llm)
    long = "\n".join(f"paragraph {i}: " + "words " * 20 for i in range(60))  # two messages
    llm.push(say(long), when=lambda r: "tools" in r)
    llm.push(say("answer to the second message"), when=lambda r: "tools" in r)
    async with paced_daemon(tmp_path, llm, tg) as daemon:
        tg.push_text("write a lot", chat_id=1310)
        await tg.wait_for("sendMessage", predicate=lambda p: p.get("chat_id") == 1310)
        tg.fail_next("sendMessage", 429, retry_after_body(2))
        await daemon.engine.wait_for_turns(1, timeout=10)
        tg.push_text("and now?", chat_id=1310)
        await tg.wait_for("sendMessage", predicate=lambda p: p.get("text") == "answer to the second message", timeout=10)
    shown = tg.shown(1310)
    assert len(shown) == 3 and shown[2] == "answer to the second message"
    assert shown[0].startswith("paragraph 0:") and shown[1].startswith("paragraph ")  # the reply whole, first
    assert "\n".join(shown[:2]).count("paragraph") == 60


# -- waits that end: the rows of a wait go out in order, each chat on its own --------------------

THREE = "\n".join(f"paragraph {i}: " + "words " * 20 for i in range(90))  # three messages


def _scaled_inline_wait(monkeypatch: Any, seconds: float = 1.0) -> None:
    import adapters.telegram.sending as telegram_sending
    import bumblebot.delivery.outbox as delivery

    monkeypatch.setattr(delivery, "MAX_INLINE_WAIT_S", seconds)
    monkeypatch.setattr(telegram_sending, "MAX_INLINE_WAIT_S", seconds)


async def test_a_second_429_as_a_long_wait_ends_still_keeps_the_reply_in_order(tmp_path, llm, tg, monkeypatch):
    """Chunk 2 gets a long 429, then a short one when retried at the wait's end: the rest of the
    reply still goes before the next answer (the row was once left to the sweeper)."""
    from fakes.telegram_server import retry_after_body
    from support import judges_say_done, say

    _scaled_inline_wait(monkeypatch)
    judges_say_done(llm)
    llm.push(say(THREE), when=lambda r: "tools" in r)
    llm.push(say("answer to the next message"), when=lambda r: "tools" in r)
    async with paced_daemon(tmp_path, llm, tg) as daemon:
        tg.push_text("write a lot", chat_id=1450)
        await tg.wait_for("sendMessage", predicate=lambda p: p.get("chat_id") == 1450)
        tg.fail_next("sendMessage", 429, retry_after_body(2))  # longer than the (scaled) inline wait
        tg.fail_next("sendMessage", 429, retry_after_body(1))  # and a short one at its retry
        await daemon.engine.wait_for_turns(1, timeout=10)
        tg.push_text("and now?", chat_id=1450)
        await tg.wait_for("sendMessage", predicate=lambda p: p.get("text") == "answer to the next message", timeout=15)
    shown = tg.shown(1450)
    assert [s.split(":")[0] for s in shown] == ["paragraph 0", "paragraph 30", "paragraph 60", "answer to the next message"]


async def test_a_stop_while_waiting_rows_go_out_sends_none_twice_after_the_restart(tmp_path, llm, tg, monkeypatch):
    """The daemon stops while the rows of a wait go out: no row is sent twice after the restart
    (the store once closed under the retry, and a sent row stayed pending and went again)."""
    from fakes.telegram_server import retry_after_body

    _scaled_inline_wait(monkeypatch)
    slow = PaceLimits(per_chat_interval_s=0.3, per_chat_burst=1)
    chat = ChatRef(Platform.TELEGRAM, "1511")
    async with paced_daemon(tmp_path, llm, tg, pace=slow) as d:
        conversation = await d.store.conversation(chat)
        rows = [await d.store.outbox_add(conversation.id, None, chat, f"x{i}") for i in range(6)]
        tg.fail_next("sendMessage", 429, retry_after_body(2))
        for row in rows:
            assert (await d.delivery.deliver(row)).queued
        await tg.wait_for("sendMessage", timeout=10, predicate=lambda p: p.get("text") == "x5")  # stopped as the last goes out
    async with paced_daemon(tmp_path, llm, tg, pace=slow) as d:
        await d.engine.sweep_outbox()  # whatever is still pending goes now
    assert tg.shown(1511) == [f"x{i}" for i in range(6)]  # each once, in order


async def test_one_chats_wait_does_not_hold_up_another_chats(tmp_path, llm, tg, monkeypatch):
    """A chat whose wait ends later does not wait for another chat's whole paced batch (the
    retries at a wait's end once ran under the sweeper's lock)."""
    from fakes.telegram_server import retry_after_body

    _scaled_inline_wait(monkeypatch)
    slow = PaceLimits(per_chat_interval_s=0.5, per_chat_burst=1)
    x, y = ChatRef(Platform.TELEGRAM, "1501"), ChatRef(Platform.TELEGRAM, "1502")
    async with paced_daemon(tmp_path, llm, tg, pace=slow) as d:
        cx, cy = await d.store.conversation(x), await d.store.conversation(y)
        xs = [await d.store.outbox_add(cx.id, None, x, f"x{i}") for i in range(10)]  # 10 at 0.5 s: 4.5 s
        tg.fail_next("sendMessage", 429, retry_after_body(2))
        for row in xs:
            assert (await d.delivery.deliver(row)).queued
        yrow = await d.store.outbox_add(cy.id, None, y, "y0")
        tg.fail_next("sendMessage", 429, retry_after_body(2))
        assert (await d.delivery.deliver(yrow)).queued
        await tg.wait_for("sendMessage", n=2, timeout=20, predicate=lambda p: p.get("text") == "y0")  # refused, then sent
        await tg.wait_for("sendMessage", timeout=20, predicate=lambda p: p.get("text") == "x9")
    # the last call with each text is the one that got through
    sent = {c.params["text"]: c.time for c in tg.calls if c.method == "sendMessage" and c.params.get("chat_id") in (1501, 1502)}
    assert sent["y0"] < sent["x9"]  # y went when its own wait ended, not after all of x
    assert tg.shown(1501) == [f"x{i}" for i in range(10)]


async def test_a_streamed_answer_does_not_jump_into_a_reply_that_waits_for_a_full_group_window(tmp_path, llm, tg, monkeypatch):
    """In a group whose 20-a-minute window is full, the rest of a reply waits; the next turn's
    streamed preview once went out in the middle of it. No preview is streamed
    into a chat whose rows wait; the answer comes after them. (The window is scaled to 3 calls
    in 4 s and the inline wait to 1 s.)"""
    from support import judges_say_done, say

    import adapters.telegram.pacing as pacing
    import adapters.telegram.sending as telegram_sending

    _scaled_inline_wait(monkeypatch)
    monkeypatch.setattr(pacing, "GROUP_WINDOW_S", 4.0)
    monkeypatch.setattr(telegram_sending, "GROUP_EDIT_INTERVAL_S", 0.2)
    judges_say_done(llm)
    llm.push(say(THREE + "\n" + THREE), when=lambda r: "tools" in r)  # six messages
    second = say("answer to the second message, streamed slowly so the preview is tried while the window is full and as it frees")
    second.stream_chars, second.stream_delay = 3, 0.1
    llm.push(second, when=lambda r: "tools" in r)
    # the six messages are one say of about 5,000 tokens: a budget it fits (a stream past its
    # budget is cut, as from a server that does not stop at max_tokens)
    config = write_config(tmp_path, llm, tg, delivery={"streaming": "on", "stream_edit_interval_s": 0.2},
                          telegram={"respond_in_groups": "always"},
                          cognition={"classifier": False, "debounce_s": 0, "reflex_max_tokens": 8192,
                                     "deliberate_max_tokens": 8192})
    async with running(config, pace=PaceLimits(per_chat_interval_s=0.01, group_per_minute=3)) as daemon:
        tg.push_text("write a lot", chat_id=-1420, chat_type="group")
        await daemon.engine.wait_for_turns(1, timeout=20)
        tg.push_text("and now?", chat_id=-1420, chat_type="group")
        await daemon.engine.wait_for_turns(2, timeout=40)
        answer = second.message["tool_calls"][0]["function"]["arguments"]
        text = json.loads(answer)["text"]
        await tg.wait_for("sendMessage", timeout=30, predicate=lambda p: p.get("text") == text)
    shown = tg.shown(-1420)
    assert len(shown) >= 4 and shown[-1] == text  # the whole reply first (3 messages or more), then the answer
    assert all(s.startswith("paragraph ") for s in shown[:-1])


def test_a_droppable_call_gives_way_when_the_overall_window_is_full():
    """A streamed preview gives way when the 30-a-second overall window is full (at 100 chats a
    preview and its final edit each took a slot, halving the replies that got out)."""
    async def main() -> tuple[list[str], bool]:
        pacer = Pacer(TELEGRAM)
        rec = Recorder(pacer)
        await asyncio.gather(*(rec.call(str(chat), f"m{chat}") for chat in range(30)))  # the window is full
        refused = False
        try:
            async with pacer.slot("99", droppable=True, max_wait_s=2.0):
                pass
        except DeliveryFailed:
            refused = True
        return rec.names(), refused

    names, refused = virtual(main())
    assert len(names) == 30 and refused


def test_a_droppable_call_gives_way_to_messages_waiting_for_the_overall_window():
    """When a slot of the overall window frees while messages of other chats wait for it, a
    preview arriving at that instant gives way to them (100 chats at an instant model: previews
    took the freed slots, each reply cost two calls, and every reply waited about a second)."""
    async def main() -> tuple[list[str], bool]:
        pacer = Pacer(TELEGRAM)
        rec = Recorder(pacer)
        await asyncio.gather(*(rec.call(str(chat), f"m{chat}") for chat in range(30)))  # the window is full
        waiting = [asyncio.ensure_future(rec.call(str(chat), f"w{chat}")) for chat in range(30, 35)]
        await asyncio.sleep(1.0)  # the window's first slot is free again; the five are due now
        refused = False
        try:
            async with pacer.slot("99", droppable=True):
                pass
        except DeliveryFailed:
            refused = True
        await asyncio.gather(*waiting)
        return rec.names(), refused

    names, refused = virtual(main())
    assert refused
    assert sorted(names[30:]) == [f"w{chat}" for chat in range(30, 35)]  # no order across chats


async def test_three_short_429s_in_a_row_keep_the_turns_messages_in_order(tmp_path, llm, tg):
    """Three 429s in a row (retry_after 1 s) on a turn's first say use up its attempts: the row
    waits and goes before the second say (it was once left to the sweeper, 30 s, and the second
    say went first)."""
    from fakes.telegram_server import retry_after_body
    from support import judges_say_done, say

    judges_say_done(llm)
    llm.push(say("part one", "part two"), when=lambda r: "tools" in r)
    tg.fail_next("sendMessage", 429, retry_after_body(1), times=3)
    async with paced_daemon(tmp_path, llm, tg) as daemon:
        tg.push_text("tell me in two parts", chat_id=1520)
        await daemon.engine.wait_for_turns(1, timeout=20)
        await tg.wait_for("sendMessage", n=4, timeout=15, predicate=lambda p: p.get("text") == "part one")  # 3 refused
        await tg.wait_for("sendMessage", timeout=15, predicate=lambda p: p.get("text") == "part two")
    assert tg.shown(1520) == ["part one", "part two"]


def test_a_chat_paused_by_a_429_does_not_hold_previews_back_everywhere():
    """A message to a chat a 429 paused, arriving while the overall window was full, counted as
    waiting for that window for its whole pause: every preview of every chat gave way meanwhile,
    long after the window had room."""
    async def main() -> bool:
        pacer = Pacer(dataclasses.replace(TELEGRAM, per_chat_interval_s=0, global_per_second=2))
        for key in ("1", "2"):  # the overall window is full
            async with pacer.slot(key):
                pass
        pacer.pause("3", 5.0)
        waiting = asyncio.ensure_future(Recorder(pacer).call("3", "after the pause"))
        await asyncio.sleep(1.5)  # the window has room again; chat 3 waits for its pause
        try:
            async with pacer.slot("4", droppable=True):
                return True
        except DeliveryFailed:
            return False
        finally:
            await waiting

    assert virtual(main())
