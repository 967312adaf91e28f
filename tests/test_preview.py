"""A streamed ``say``'s preview (bumblebot/delivery/preview.py) on its own, on an event loop with
virtual time (:class:`support.VirtualClockLoop`), so every wait it makes is exact. The
end-to-end behaviour through the real clients is in test_streaming.py."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from support import now, virtual

from bumblebot.core.errors import DeliveryFailed
from bumblebot.core.events import ChatRef, Platform
from bumblebot.delivery.preview import LivePreview
from bumblebot.store import OutboxEntry

CHAT = ChatRef(Platform.TELEGRAM, "7", "")


class Rows:
    """The turn's streaming rows, in memory (``StreamRows``)."""

    chat = CHAT

    def __init__(self) -> None:
        self.shown: list[str] = []

    async def open_stream(self) -> OutboxEntry:
        return OutboxEntry(1, 1, 1, CHAT, "", "pending", [], 0, None, streaming=True)

    async def stream_previewed(self, entry: OutboxEntry, preview_id: str, shown: str) -> OutboxEntry:
        self.shown.append(shown)
        return dataclasses.replace(entry, preview_id=preview_id, text=shown)

    def release_stream(self, entry: OutboxEntry) -> None:
        pass

    async def settle_stream(self, entry: OutboxEntry, **_: Any) -> None:
        pass


class RefusingPlatform:
    """An adapter whose preview sends are refused with ``refusal``."""

    def __init__(self, refusal: DeliveryFailed) -> None:
        self.refusal = refusal
        self.tries = 0

    async def send_preview(self, chat: ChatRef, text: str, *, key: str) -> str:
        self.tries += 1
        raise self.refusal

    async def edit_preview(self, chat: ChatRef, message_id: str, text: str, *, final: bool = False) -> None:
        raise AssertionError("nothing was shown to edit")


async def _key(_: int) -> str:
    return "k"


def _take_after_refusal(refusal: DeliveryFailed) -> tuple[float, int]:
    """Seconds ``take()`` waited once the say was complete, and the sends tried."""

    async def main() -> tuple[float, int]:
        platform = RefusingPlatform(refusal)
        live = LivePreview(Rows(), platform, interval_s=1.0, key=_key)  # type: ignore[arg-type]
        live.add("Hello there, how are you?")
        while platform.tries == 0:
            await asyncio.sleep(0)
        start = now()
        entry = await live.take()
        assert entry is not None and entry.preview_id is None  # nothing shown: the final is sent whole
        return now() - start, platform.tries

    return virtual(main())


def test_a_preview_the_pacer_skipped_does_not_hold_the_final_text():
    """A preview refused because another call had the turn (no ``retry_after``: the platform
    asked nothing) lets the final text go at once. It once held it for the edit interval, and at
    100 chats every reply that lost its preview came a second late."""
    waited, tries = _take_after_refusal(DeliveryFailed("another call to the chat goes first: skipped", retryable=True))
    assert waited == 0.0 and tries == 1


def test_a_preview_refused_with_a_429_holds_the_final_text_until_the_flood_window_ends():
    waited, tries = _take_after_refusal(DeliveryFailed("Flood control exceeded", retryable=True, retry_after=3.0))
    assert waited == 3.0 and tries == 1


class ShowingPlatform:
    """An adapter that shows every preview (its sends and edits, in order)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    async def send_preview(self, chat: ChatRef, text: str, *, key: str) -> str:
        self.calls.append(("send", text))
        return "m1"

    async def edit_preview(self, chat: ChatRef, message_id: str, text: str, *, final: bool = False) -> None:
        self.calls.append(("edit", text))


def test_a_preview_stops_once_another_worker_holds_the_conversation():
    """A worker that woke after its conversation was taken over went on editing its preview
    (or posting a new one) over what the new worker shows."""
    held = [True]

    async def still_ours() -> bool:
        return held[0]

    async def main() -> list[tuple[str, str]]:
        platform = ShowingPlatform()
        live = LivePreview(Rows(), platform, interval_s=1.0, key=_key, still_ours=still_ours)  # type: ignore[arg-type]
        live.add("Hello there")
        while not platform.calls:
            await asyncio.sleep(0.1)
        held[0] = False  # taken over
        live.add(", and more text")
        await asyncio.sleep(5)  # virtual time: several edit intervals
        await live.take()
        return platform.calls

    assert virtual(main()) == [("send", "Hello there")]
