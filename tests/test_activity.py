"""The live event bus (``bumblebot/core/activity.py``): subscriptions, the backlog, bounded
queues that drop their oldest events, redaction, and a publisher that never waits or raises."""

from __future__ import annotations

import asyncio

from bumblebot.core.activity import KINDS, NO_ACTIVITY, Activity, Event, cut
from bumblebot.core.redaction import MARKER, Redactor

SECRET = "sk-very-secret-value-123456"


async def test_a_subscription_gets_its_conversations_events_in_order_and_all_gets_every_one():
    activity = Activity()
    one, every = activity.subscribe("telegram:1"), activity.subscribe()
    activity.publish("telegram:1", "turn_started", turn=7, route="reflex", reason="short", entries=1)
    activity.publish("telegram:2", "queued", waiting=3)
    activity.publish("telegram:1", "turn_ended", turn=7, status="done", stop="ended")
    got = [await anext(one), await anext(one)]
    assert [(e.kind, e.data.get("turn")) for e in got] == [("turn_started", 7), ("turn_ended", 7)]
    assert [e.conversation for e in [await anext(every) for _ in range(3)]] == ["telegram:1", "telegram:2", "telegram:1"]
    assert got[0].seq < got[1].seq and all(isinstance(e, Event) for e in got)
    assert got[0].data == {"turn": 7, "route": "reflex", "reason": "short", "entries": 1}


async def test_a_reader_waits_for_the_next_event_and_closing_ends_the_iteration():
    activity = Activity()
    seen: list[str] = []

    async def read() -> None:
        async with activity.subscribe("c") as events:
            async for event in events:
                seen.append(event.kind)
                if event.kind == "turn_ended":
                    break

    reader = asyncio.create_task(read())
    await asyncio.sleep(0)  # the reader is waiting now
    activity.publish("c", "said", turn=1, text="hi")
    activity.publish("c", "turn_ended", turn=1, status="done", stop="ended")
    await asyncio.wait_for(reader, 5)
    assert seen == ["said", "turn_ended"]
    assert activity._subscriptions == []  # the context manager unsubscribed

    sub = activity.subscribe()
    waiting = asyncio.create_task(anext(sub, None))
    await asyncio.sleep(0)
    sub.close()
    assert await asyncio.wait_for(waiting, 5) is None
    activity.publish("c", "said", turn=1, text="after")  # nobody left: nothing queued anywhere
    assert not sub._queue


async def test_a_slow_subscriber_loses_its_oldest_events_and_is_told_how_many():
    activity = Activity(queue_size=3)
    slow, other = activity.subscribe(), activity.subscribe("elsewhere")
    for i in range(10):
        activity.publish("c", "queued", waiting=i)  # never waits, however full the queue is
    first = await anext(slow)
    assert first.data == {"waiting": 7, "dropped": 7}
    assert [(await anext(slow)).data for _ in range(2)] == [{"waiting": 8}, {"waiting": 9}]
    assert not other._queue


async def test_every_string_is_redacted_and_data_made_json():
    activity = Activity(Redactor([SECRET]))
    sub = activity.subscribe()
    activity.publish(
        "c", "step", turn=1, step=1, content=f"the key is {SECRET}",
        tool_calls=[{"name": "fetch_url", "arguments": f'{{"url": "https://x/?k={SECRET}"}}'}],
        finish_reason="tool_calls", usage={"prompt": 10, "nested": (SECRET, 1)},
    )
    event = await anext(sub)
    assert SECRET not in repr(event) and SECRET not in repr(activity.recent())
    assert event.data["content"] == f"the key is {MARKER}"
    assert event.data["usage"] == {"prompt": 10, "nested": [MARKER, 1]}


async def test_the_backlog_keeps_the_last_events_per_conversation_oldest_first():
    activity = Activity(backlog=4)
    for i in range(6):
        activity.publish("a" if i % 2 else "b", "queued", waiting=i)
    assert [e.data["waiting"] for e in activity.recent()] == [2, 3, 4, 5]
    assert [e.data["waiting"] for e in activity.recent("a")] == [3, 5]


def test_publishing_never_raises_and_unknown_kinds_are_dropped(caplog):
    activity = Activity(lambda s: 1 / 0)  # type: ignore[arg-type,return-value]  # a redactor that fails
    activity.publish("c", "said", turn=1, text="x")
    Activity().publish("c", "no-such-kind", x=1)
    assert activity.recent() == [] and "activity event" in caplog.text


def test_no_activity_keeps_nothing_and_cut_marks_what_it_cut():
    NO_ACTIVITY.publish("c", "said", turn=1, text="x")
    assert NO_ACTIVITY.recent() == [] and not NO_ACTIVITY.watched
    assert "action" in KINDS and len(KINDS) == 11
    assert cut("x" * 10, 5) == "xxxx…" and cut("short") == "short" and len(cut("y" * 5000)) == 2000
