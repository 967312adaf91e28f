"""Server-sent events: ``/events`` (every conversation) and ``/events?conversation=KEY``.

One :class:`~bumblebot.core.activity.Activity` subscription per stream, taken before the
backlog is read so nothing falls between. Each event goes as ``id: <seq>``, ``event: <kind>``
and ``data: <JSON of conversation, kind, data, at, seq>``. A reconnecting browser sends
``Last-Event-ID`` (a page may pass ``?after=SEQ`` for its first connection): the events of the
backlog after it are sent first. A comment line every :data:`KEEPALIVE_S` keeps proxies from
closing an idle stream. The events' data is redacted by the bus itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
from typing import TYPE_CHECKING, Any

from aiohttp import web

from bumblebot.core.activity import Event

if TYPE_CHECKING:
    from bumblebot.web.server import WebConsole

KEEPALIVE_S = 15.0


class Streams:
    """The open event streams, ended together when the server stops."""

    def __init__(self) -> None:
        self.stopping = asyncio.Event()
        self.open = 0

    def close(self) -> None:
        self.stopping.set()


def routes(app: web.Application, server: WebConsole) -> None:
    app.router.add_get("/events", functools.partial(stream, server))


def encode(event: Event) -> bytes:
    body = json.dumps(
        {"conversation": event.conversation, "kind": event.kind, "data": event.data, "at": event.at, "seq": event.seq},
        default=str, ensure_ascii=False,
    )
    return f"id: {event.seq}\nevent: {event.kind}\ndata: {body}\n\n".encode()


def _after(request: web.Request) -> int | None:
    value = request.headers.get("Last-Event-ID") or request.query.get("after")
    try:
        return int(value) if value else None
    except ValueError:
        return None


async def stream(server: WebConsole, request: web.Request) -> web.StreamResponse:
    from bumblebot.web.server import HEADERS

    key = request.query.get("conversation") or None
    activity, streams = server.console.activity, server.streams
    response = web.StreamResponse(headers={
        **HEADERS, "Content-Type": "text/event-stream", "Cache-Control": "no-store", "X-Accel-Buffering": "no",
    })
    async with activity.subscribe(key) as subscription:
        sent = _after(request)
        await response.prepare(request)
        streams.open += 1
        events = aiter(subscription)
        following: asyncio.Future[Any] = asyncio.ensure_future(anext(events))
        stopping = asyncio.ensure_future(streams.stopping.wait())
        try:
            await response.write(b"retry: 2000\n\n")
            if sent is not None:
                for event in activity.recent(key):
                    if event.seq > sent:
                        await response.write(encode(event))
                        sent = event.seq
            while not streams.stopping.is_set():
                done, _ = await asyncio.wait({following, stopping}, timeout=KEEPALIVE_S, return_when=asyncio.FIRST_COMPLETED)
                if following not in done:
                    if not done:
                        await response.write(b": keep-alive\n\n")
                    continue
                try:
                    event = following.result()
                except StopAsyncIteration:
                    break
                following = asyncio.ensure_future(anext(events))
                if sent is None or event.seq > sent:
                    await response.write(encode(event))
                    sent = event.seq
        except ConnectionResetError:  # the browser went away
            pass
        finally:
            streams.open -= 1
            for future in (following, stopping):
                future.cancel()
                with contextlib.suppress(BaseException):
                    await future
    return response
