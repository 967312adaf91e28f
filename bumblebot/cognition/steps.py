"""The pieces of a step: waiting on the model or the tools unless ``/stop`` (or a burst)
comes first, running a step's calls together, fitting their results into one budget, and
reading back what a crash cut off."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import uuid
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from bumblebot.cognition.compaction import cap_tool_result
from bumblebot.cognition.limits import MIN_RESULT_SHARE
from bumblebot.cognition.notes import NEVER_SENT
from bumblebot.core.messages import Message, valid_arguments
from bumblebot.core.toolkit import DeliveryReport, ToolResult
from bumblebot.core.usage import unless
from bumblebot.llm import Completion, ToolCall
from bumblebot.store import OutboxEntry

log = logging.getLogger(__name__)
_T = TypeVar("_T")

#: Tools not run under the tool timeout: a delivery is bounded by the delivery policy itself.
UNTIMED = frozenset({"say", "send_file"})
#: Side-effect free agency tools: a call cut off by a crash is simply completed on resume.
COMPLETED_ON_RESUME = {"end_turn": "ending turn", "think": "noted", "wait": "waited 0 s (interrupted)"}


class StepBudget:
    """One step's results share ``max_tool_result_chars`` (each is already capped alone):
    parallel calls must not overflow the window between them. Results
    are fitted as they complete, so each can be recorded at once."""

    def __init__(self, budget: int, calls: int) -> None:
        self._left = budget
        self._waiting = calls

    def fit(self, result: ToolResult) -> ToolResult:
        self._waiting -= 1
        allowed = max(MIN_RESULT_SHARE, self._left - MIN_RESULT_SHARE * self._waiting)
        if len(result.content) > allowed:
            result = ToolResult(cap_tool_result(result.content, allowed), ok=result.ok)
        self._left = max(0, self._left - len(result.content))
        return result


class Stopped(Exception):
    """``/stop`` came while the loop waited (:func:`unless_stopped`)."""


class Superseded(Exception):
    """A person's message came while a turn that can say no more (at its message cap) waited
    for a slot to send its next request (:func:`given_up_for`): the request was never sent,
    and the turn ends so that the message gets a turn of its own."""


@contextmanager
def given_up_for(event: asyncio.Event | None) -> Iterator[None]:
    """Send the block's model requests only while ``event`` is not set
    (:func:`~bumblebot.core.usage.unless`): one still waiting for a slot when it is set is
    never sent, and :class:`Superseded` is raised. One already sent is answered: a server
    answering one request at a time goes on with it anyway, and the calls it brings are work
    the model decided on."""
    if event is None:
        yield
        return
    with unless(event):
        try:
            yield
        except asyncio.CancelledError:  # a request given up inside a task ends it as cancelled
            current = asyncio.current_task()
            if not event.is_set() or (current is not None and current.cancelling()):
                raise  # a shutdown, or a cancellation of the call's own
            raise Superseded from None


class Burst(Exception):
    """More messages of a burst came while the turn's first completion was awaited
    (:func:`unless_stopped` with ``burst``): it was aborted, to be asked again with them."""


async def unless_stopped(
    stop: asyncio.Event, coro: Coroutine[Any, Any, _T], *,
    burst: asyncio.Event | None = None, may_restart: Callable[[], bool] = lambda: True,
) -> _T:
    """Await ``coro`` unless ``stop`` is set first: then it is cancelled (an HTTP request is
    aborted, a tool's process is stopped the way its timeout stops it) and :class:`Stopped`
    is raised. A ``coro`` that completes as the stop comes keeps its result.

    ``burst`` (the turn's first completion): when it is set and ``may_restart()`` (nothing of
    the completion is on screen yet), ``coro`` is cancelled the same way and :class:`Burst`
    raised; otherwise it is cleared and the wait goes on."""
    if stop.is_set():
        coro.close()
        raise Stopped
    task = asyncio.ensure_future(coro)
    restart = False
    while True:
        waiters = [asyncio.ensure_future(stop.wait())]
        if burst is not None:
            waiters.append(asyncio.ensure_future(burst.wait()))
        try:
            await asyncio.wait({task, *waiters}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # we are cancelled ourselves (a shutdown): so is the call
            task.cancel()
            raise
        finally:
            for waiter in waiters:
                waiter.cancel()
        if task.done():
            return task.result()
        if stop.is_set() or burst is None:
            break
        burst.clear()
        if may_restart():
            restart = True
            break
        burst = None  # something is shown already: the new messages wait for the next step
    task.cancel()
    try:
        return await task  # it may finish anyway, catching the cancellation
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise  # a shutdown came meanwhile
    except Exception as exc:  # what the cancelled call raised on its way out
        log.debug("a call stopped by /stop raised %s", type(exc).__name__)
    raise Burst if restart else Stopped


async def all_or_none(coros: list[Coroutine[Any, Any, _T]]) -> list[_T]:
    """Run ``coros`` concurrently; their results in order. When one raises (a result that
    could not be recorded), the others are cancelled and waited for before its error is
    raised: no tool goes on running after the turn has failed, to record a result after the
    turn was told it did not complete (``asyncio.gather`` leaves them running)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        pending = [t for t in tasks if not t.done()]
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)
    for task in tasks:
        if not task.cancelled() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]
    return [t.result() for t in tasks]


def delivery_of(entry: OutboxEntry | None) -> DeliveryReport:
    """What became of a ``say`` or ``send_file`` whose call a crash cut off, from its outbox row."""
    if entry is None:
        return DeliveryReport(delivered=False, error=NEVER_SENT)
    if entry.status == "sent":
        return DeliveryReport(delivered=True)
    if entry.status == "pending":
        return DeliveryReport(delivered=False, queued=True)
    return DeliveryReport(delivered=False, error=entry.last_error or "the platform refused the message")


def last_block(transcript: list[Message]) -> list[Message]:
    """The last assistant message with tool calls and the results after it."""
    start = len(transcript)
    while start > 0 and transcript[start - 1].role == "tool":
        start -= 1
    return transcript[start - 1 :] if start > 0 else []


def open_calls(transcript: list[Message]) -> list[dict[str, Any]]:
    """Calls of the last step that have no result (a crash cut them off)."""
    block = last_block(transcript)
    if not block or block[0].role != "assistant" or not block[0].tool_calls:
        return []
    answered = {m.tool_call_id for m in block[1:]}
    return [c for c in block[0].tool_calls if c.get("id") not in answered]


_ALNUM9 = re.compile(r"^[A-Za-z0-9]{9}$")


def unique_id(call: ToolCall, used: set[str]) -> ToolCall:
    """``call`` with an id not used before in this conversation.

    Some servers (llama.cpp among them) reuse one id for every call; a repeated id would make
    the history an invalid sequence. A replacement keeps the original's shape when it is the
    9-character alphanumeric form some APIs (Mistral) insist on.
    """
    new_id = call.id
    while new_id in used:
        token = uuid.uuid4().hex
        new_id = token[:9] if _ALNUM9.match(call.id) else f"call_{token[:24]}"
    used.add(new_id)
    return call if new_id == call.id else ToolCall(id=new_id, name=call.name, arguments=call.arguments, index=call.index)


def cut_short(completion: Completion) -> bool:
    """The completion stopped at ``max_tokens`` with a reply that cannot be used as it is:
    plain text cut mid-way, or a tool call whose arguments are not a whole JSON object."""
    if not completion.hit_length:
        return False
    if not completion.tool_calls:
        return True
    return not all(valid_arguments(call.arguments) for call in completion.tool_calls)


def lost(result: Message) -> bool:
    """A ``say`` result that reports a message that did not get out (not one the engine
    dropped on purpose: a repeat or past the turn's message limit)."""
    if result.name != "say" or result.ok is not False:
        return False
    try:
        payload = json.loads(result.content)
    except ValueError:
        return True
    return not (isinstance(payload, dict) and payload.get("dropped"))
