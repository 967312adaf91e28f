"""Sending a request: whole (:func:`post_whole`), or streamed, read chunk by chunk so that each
``say`` is heard as it is written, with the fallback to whole answers for endpoints that cannot
stream (:class:`StreamedRequests`).

A request with a ``say`` listener (``delivery.streaming``) is sent with ``stream: true``, and the
text of each ``say`` call is reported as its arguments arrive (:data:`SayListener`, read by
:class:`~bumblebot.llm.streaming.JsonStringField`); the :class:`~bumblebot.llm.completion.Completion`
read out of the stream is the one the same request would get whole. An endpoint is switched to
whole answers when a streamed request fails where the same request sent whole is answered:

* it refuses the streamed request: a client error at once, a 5xx after :data:`STREAM_STRIKES`
  in a row (a 401, 403, 408, 409 or 429, a timeout or a context-length refusal says nothing
  about streaming: it is not sent again whole; nor is a 5xx when a fallback endpoint follows
  this one: it goes there, so a failing endpoint costs one request per step, two with the
  ``"auto"`` request of tool forcing);
* it drops it unanswered (the connection closes before the first chunk, or the stream ends
  empty: llama-cpp-python does so when it cannot serve a request, e.g. ``tool_choice``
  ``"required"``), after :data:`STREAM_STRIKES` in a row;
* its streamed tool calls come out broken (:func:`broken_stream`: arguments that are not JSON,
  calls written as text, at once; an empty answer, after :data:`STREAM_STRIKES` in a row)
  where the unstreamed answer is sound. When the unstreamed answer is as broken, the model is to
  blame: after :data:`STREAM_CHECKS` such answers in a row, broken streamed answers are no
  longer checked.

That is remembered in ``kv`` ``llm.stream:<endpoint>``, and streaming is tried again after
:data:`STREAM_RETRY_S`.

A streamed request asks for its usage (``stream_options: {"include_usage": true}``: a last
chunk with the token counts). An endpoint that refuses that parameter (a 400 or 422 naming
``stream_options``) gets the same streamed request again without it, and that is remembered in
``kv`` ``llm.stream_usage:<endpoint>`` (asked again after :data:`STREAM_RETRY_S`); its usage
is then what the stream reports by itself, or Bumblebot's estimate. A streamed answer set
aside for a re-check was answered, and billed, as well: it is counted too (``discarded``).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import openai
from openai.types.chat import ChatCompletion

from bumblebot.core.errors import ContextTooLong, ModelTimeout, ModelUnavailable
from bumblebot.core.settings import LLMSettings
from bumblebot.core.textrules import holds_call, strip_reasoning
from bumblebot.llm.capabilities import Refusals, duration, refusal, stream_key, stream_usage_key
from bumblebot.llm.completion import (
    Completion,
    ToolCall,
    is_context_error,
    names_optional_param,
    new_call_id,
    normalise,
    usage_counts,
)
from bumblebot.llm.pace import Bound, Cut, TokenCount
from bumblebot.llm.slots import RequestSlots
from bumblebot.llm.streaming import JsonStringField
from bumblebot.llm.window import window_in_refusal

log = logging.getLogger(__name__)

#: ``on_say(index, text)``: more text (appended to what came before) of the ``say`` call at
#: position ``index`` of a completion being streamed. Called synchronously from the stream:
#: it must not block.
SayListener = Callable[[int, str], None]

#: Seconds before an endpoint that could not stream is given a streamed request again.
STREAM_RETRY_S = 24 * 3600.0
#: Statuses of a streamed request that say nothing about streaming: never retried unstreamed.
_NOT_ABOUT_STREAMING = frozenset({401, 403, 408, 409, 429})
EMPTY_ANSWER = "the answer came out empty"
#: Streamed requests in a row that get no answer (dropped, a 5xx) where the same request sent
#: whole is answered, before the endpoint gets whole requests only.
STREAM_STRIKES = 3
#: Streamed answers in a row whose unstreamed re-check came out just as broken before re-checks
#: stop (a sound streamed answer starts the count again):
#: the model writes broken calls, the stream is not to blame.
STREAM_CHECKS = 3


async def post_whole(
    client: openai.AsyncOpenAI, slots: RequestSlots, params: dict[str, Any], bound: Bound | None = None
) -> ChatCompletion:
    """One request sent whole (unstreamed), through the request limiter ``slots``, within the
    deadline of ``bound`` (from when a slot was had; none without one).

    Raises:
        Overran: the deadline passed (:mod:`bumblebot.llm.pace`).
    """
    # The request is already in wire form; ``client.post`` sends it as is. The typed
    # ``chat.completions.create`` re-walks every message and tool schema through the SDK's
    # TypedDict transformer, which cost ~18 ms of CPU per step here (bench/bench_turn.py).
    async with slots:
        if bound is None:
            return await client.post("/chat/completions", cast_to=ChatCompletion, body=params)
        return await bound.whole(lambda: client.post(
            "/chat/completions", cast_to=ChatCompletion, body=params, options=_within(bound, client)
        ))


def _within(bound: Bound, client: openai.AsyncOpenAI) -> dict[str, Any]:
    """The client's options for a whole request with a deadline: a timeout past it, so that the
    deadline (a ``length`` finish) ends a request that runs long, not the timeout (an outage);
    and no retries, which would send a runaway again to a server still writing the first."""
    if bound.deadline_s is None:
        return {}
    timeout = client.timeout if isinstance(client.timeout, float | int) else None
    return {"timeout": max(float(timeout or 0.0), bound.deadline_s + 5.0), "max_retries": 0}


class _StreamDropped(ModelUnavailable):
    """A streamed request got no answer at all: the connection closed before the first chunk."""


class StreamedRequests:
    """Streamed requests to one endpoint, and what it has shown of streaming.

    Args:
        client: the endpoint's ``openai`` client.
        slots: the request limiter, shared with whole requests.
        settings: the ``llm`` config section (a stall names its ``timeout_s``).
        refusals: the endpoint's remembered refusals, where the fallback is kept.
        discarded: told of a streamed answer that was set aside for the same request sent
            whole (:meth:`_recheck`), with that request: it was answered, and billed, too.
        failover: a next endpoint takes what this one cannot answer (``llm.fallbacks``): a
            streamed request refused with a 5xx goes there at once, not again whole here.
    """

    def __init__(
        self, client: openai.AsyncOpenAI, slots: RequestSlots, settings: LLMSettings, refusals: Refusals,
        *, discarded: Callable[[Completion, dict[str, Any]], Awaitable[None]] | None = None, failover: bool = False,
    ) -> None:
        self._discarded = discarded
        self.failover = failover
        self._client = client
        self._slots = slots
        self.settings = settings
        self._refusals = refusals
        self._checks = 0  # unstreamed re-checks that found the model, not the stream, broken
        self._strikes = 0  # streamed requests in a row that failed where a whole one was answered

    @property
    def base_url(self) -> str:
        return self._refusals.base_url

    async def streams(self) -> bool:
        """Whether the endpoint gets streamed requests (not remembered as unable to, or the
        memory is older than :data:`STREAM_RETRY_S`)."""
        key = stream_key(self._refusals.endpoint)
        return not await self._refusals.active(key, STREAM_RETRY_S, "trying streamed requests again")

    async def fallback(self) -> str | None:
        """Why the endpoint gets whole answers instead of streams, ``None`` while it streams."""
        return await self._refusals.reason(stream_key(self._refusals.endpoint))

    async def send(
        self, params: dict[str, Any], on_say: SayListener, client: openai.AsyncOpenAI | None = None,
        bound: Bound | None = None,
    ) -> ChatCompletion | Completion:
        """Send one request streamed (a :class:`Completion` comes back), or whole (a
        ``ChatCompletion``) when the stream failed, or its tool calls came out garbled, and the
        same request sent whole was answered; through ``client`` (default the endpoint's: a
        request forcing a tool call goes without the client's retries). ``bound``: the stream
        is cut past its budget, a request sent whole at its deadline (:mod:`bumblebot.llm.pace`).

        Raises:
            Overran: the request was sent again whole, and outlasted its deadline.
            openai.APIError: the endpoint refused the request (streamed, or whole when it was
                sent again so), or sent an error event.
            ModelTimeout, ModelUnavailable: the stream stalled or broke off.
        """
        client = client or self._client
        try:
            streamed = await self._read_with_usage(params, on_say, client, bound)
        except openai.APITimeoutError:
            raise  # slow, not unable to stream: an outage as any timeout is
        except openai.APIStatusError as exc:
            if exc.status_code in _NOT_ABOUT_STREAMING or is_context_error(exc) or names_optional_param(exc, params):
                raise
            if exc.status_code >= 500 and self.failover:
                # most 5xx are the endpoint failing whatever the request's form: sent whole it
                # would get the same, and its forcing fallback (another request) too; the next
                # endpoint is this request's retry
                raise
            response = await self._whole(params, client, bound)  # the same request, whole: if it fails too, not our business
            why = f"a streamed request was refused ({refusal(exc)}); an unstreamed one was answered"
            await self._failed(why, at_once=exc.status_code < 500)  # a 5xx may be a passing one
            return response
        except (openai.APIConnectionError, _StreamDropped) as exc:
            return await self._send_dropped(params, exc, client, bound)
        broken = broken_stream(streamed, params)
        if broken is None:
            self._checks = self._strikes = 0
            return streamed
        if self._checks >= STREAM_CHECKS:
            return streamed
        if self._discarded is not None:  # answered and billed, whatever the re-check finds
            await self._discarded(streamed, params)
        return await self._recheck(params, broken, client, bound)

    async def _send_dropped(
        self, params: dict[str, Any], exc: openai.APIConnectionError | _StreamDropped, client: openai.AsyncOpenAI,
        bound: Bound | None,
    ) -> ChatCompletion:
        """No answer at all to a streamed request: the endpoint may be down, or it may be one
        that drops streamed requests it cannot serve (llama-cpp-python does, for tool_choice
        "required"). One whole request tells them apart: answered, the stream is suspect."""
        why = f"a streamed request was dropped unanswered ({exc}); an unstreamed one was answered"
        try:
            try:
                response = await self._whole(params, client, bound)
            except openai.APIConnectionError:
                # a server that aborted a stream can leave its kept-alive connection broken
                # (llama-cpp-python): one more try, on a fresh connection
                response = await self._whole(params, client, bound)
        except openai.APIConnectionError:
            raise exc from None  # down: an outage, as it was
        except openai.APIStatusError as status:
            # a 500 is the endpoint itself failing the request (llama-cpp-python refuses a
            # forced tool call so): it is up, the stream is suspect; 502/503/504/429 are not
            if status.status_code == 500:
                await self._failed(why)
            raise
        await self._failed(why)
        return response

    async def _recheck(
        self, params: dict[str, Any], broken: str, client: openai.AsyncOpenAI, bound: Bound | None
    ) -> ChatCompletion:
        """A streamed answer looks garbled (``broken`` says how): the same request, whole,
        tells the stream's fault from the model's. The whole answer is the one used."""
        response = await self._whole(params, client, bound)
        whole = normalise(response, params.get("tool_choice"))
        if broken_stream(whole, params) is None:
            why = f"streamed tool calls came out broken ({broken}); the unstreamed answer did not"
            # garbled calls are the stream's format; an empty answer may be one unlucky sample
            await self._failed(why, at_once=broken != EMPTY_ANSWER)
        else:
            self._checks += 1  # the model's own mess; after a few in a row, stop paying for checks
        return response

    async def _whole(self, params: dict[str, Any], client: openai.AsyncOpenAI, bound: Bound | None) -> ChatCompletion:
        return await post_whole(client, self._slots, params, bound)

    async def asks_usage(self) -> bool:
        """Whether streamed requests carry ``stream_options.include_usage`` (not remembered as
        refused, or the memory is older than :data:`STREAM_RETRY_S`)."""
        key = stream_usage_key(self._refusals.endpoint)
        return not await self._refusals.active(key, STREAM_RETRY_S, "asking for usage in streams again")

    async def _read_with_usage(
        self, params: dict[str, Any], on_say: SayListener, client: openai.AsyncOpenAI, bound: Bound | None
    ) -> Completion:
        """:meth:`_read`, asking for usage unless the endpoint refused that; a refusal naming
        ``stream_options`` is answered by the same request without it, and remembered."""
        if not await self.asks_usage():
            return await self._read(params, on_say, client, bound, usage=False)
        try:
            return await self._read(params, on_say, client, bound, usage=True)
        except openai.APIStatusError as exc:
            if exc.status_code not in (400, 422) or "stream_options" not in str(exc.message):
                raise
            await self._refusals.remember(stream_usage_key(self._refusals.endpoint), refusal(exc))
            log.warning(
                "endpoint %s refused stream_options (%s); streams do not ask for usage from now on "
                "(asked again in %s)", self.base_url, refusal(exc), duration(STREAM_RETRY_S),
            )
        return await self._read(params, on_say, client, bound, usage=False)

    async def _read(
        self, params: dict[str, Any], on_say: SayListener, client: openai.AsyncOpenAI, bound: Bound | None,
        *, usage: bool,
    ) -> Completion:
        """One streamed request, read to the end, or until its answer goes past the budget of
        ``bound`` (then closed, and answered as a ``length`` finish with its :class:`Cut`);
        ``on_say`` hears each ``say`` call's text; ``usage``: ask for the token counts
        (``stream_options``).

        Raises:
            openai.APIError: the endpoint refused the request or sent an error event.
            ModelTimeout, ModelUnavailable: the stream stalled or broke off.
        """
        body = {**params, "stream": True}
        if usage:
            body["stream_options"] = {"include_usage": True}
        answer = _StreamedAnswer(on_say, bound)
        async with self._slots:
            if bound is not None:
                bound.start()
            # chunks come as plain dicts (``AsyncStream[object]``): building a typed object per
            # chunk doubled the CPU of a streamed turn (bench/bench_chat.py)
            try:
                stream = await client.post(
                    "/chat/completions", cast_to=ChatCompletion, body=body, stream=True,
                    stream_cls=openai.AsyncStream[object],
                )
            except BaseException:
                if bound is not None:
                    bound.end()
                raise
            try:
                async for chunk in stream:
                    if answer.take(chunk):
                        break  # past its budget: the stream is closed below, the server stops
            # the openai client wraps what httpx raises while a stream is read in its own
            # APITimeoutError / APIConnectionError; both are caught here, the raw ones too
            except (httpx.TimeoutException, openai.APITimeoutError) as exc:
                raise ModelTimeout(f"the model endpoint stopped streaming for {self.settings.timeout_s:g} s") from exc
            except (httpx.HTTPError, openai.APIConnectionError) as exc:
                if not answer.received:
                    raise _StreamDropped(f"the endpoint at {self.base_url} closed the stream before any answer: {exc}") from exc
                raise ModelUnavailable(f"the stream from the model endpoint at {self.base_url} broke off: {exc}") from exc
            except openai.APIStatusError:
                raise
            except openai.APIError as exc:  # an error event mid-stream (OpenRouter: a provider failed)
                if is_context_error(exc):
                    raise ContextTooLong(
                        f"the prompt is too long for the model: {exc.message}",
                        window=window_in_refusal(str(exc.message), exc.body),
                    ) from exc
                raise ModelUnavailable(f"the model endpoint reported an error mid-stream: {exc.message}") from exc
            finally:
                try:
                    await stream.close()
                finally:
                    if bound is not None:
                        bound.end()
        if not answer.received:  # headers, then nothing: llama-cpp-python, when its handler failed
            raise _StreamDropped(f"the endpoint at {self.base_url} ended the stream without sending anything")
        return answer.completion()

    async def _failed(self, reason: str, *, at_once: bool = False) -> None:
        """A streamed request failed where a whole one was answered: streaming is switched
        off for the endpoint at once (a client error that names the request), or after
        :data:`STREAM_STRIKES` such failures in a row (a drop or a 5xx may be a passing fault)."""
        self._strikes += 1
        if at_once or self._strikes >= STREAM_STRIKES:
            await self._refused(reason if at_once else f"{self._strikes} times in a row: {reason}")

    async def _refused(self, reason: str) -> None:
        await self._refusals.remember(stream_key(self._refusals.endpoint), reason, mode="off")
        log.warning(
            "endpoint %s: %s; replies are sent whole from now on (streaming is tried again in %s)",
            self.base_url, reason, duration(STREAM_RETRY_S),
        )


class _StreamedAnswer:
    """A completion read out of a stream, chunk by chunk, counted against the budget of
    ``bound`` (none without one)."""

    def __init__(self, on_say: SayListener, bound: Bound | None) -> None:
        self.on_say = on_say
        self.bound = bound
        self.count = TokenCount(bound.budget) if bound is not None else None
        self.content: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}
        self.finish: str | None = None
        self.reported: Any = None
        self.received = 0
        self.cut: Cut | None = None

    def take(self, chunk: Any) -> bool:
        """Read one chunk; whether the answer is now past its budget (:attr:`cut`)."""
        self.received += 1
        if not isinstance(chunk, dict):
            return False
        self.reported = chunk.get("usage") or self.reported
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            written = delta.get("content") or ""
            if written:
                self.content.append(written)
            for part in delta.get("tool_calls") or ():
                written += _take_call_part(self.calls, part, self.on_say)
            self.finish = choice.get("finish_reason") or self.finish
            bound, count = self.bound, self.count
            if written and bound is not None and count is not None:
                bound.first = bound.first or time.monotonic()
                if count.add(written):
                    self.cut = Cut("tokens", bound.budget, bound.elapsed_s, written=count.chunks)
                    self.finish = "length"
                    return True
        return False

    def completion(self) -> Completion:
        tool_calls = [
            ToolCall(id=c["id"] or new_call_id(), name=c["name"], arguments="".join(c["args"]) or "{}", index=index)
            for index, c in sorted(self.calls.items()) if c["name"]
        ]
        return Completion(
            content=strip_reasoning("".join(self.content)),
            tool_calls=tool_calls,
            finish_reason=self.finish or "",
            cut=self.cut,
            **usage_counts(self.reported if isinstance(self.reported, dict) else None),
        )


def _take_call_part(calls: dict[int, dict[str, Any]], part: Any, on_say: SayListener) -> str:
    """Add one streamed fragment of a tool call (a ``delta.tool_calls`` item, keyed by
    ``index``) and report the text of a ``say`` call that grew; returns the arguments added."""
    if not isinstance(part, dict):
        return ""
    index = part.get("index")
    index = index if isinstance(index, int) else max(calls, default=0)
    call = calls.setdefault(index, {"id": "", "name": "", "args": [], "reader": None})
    call["id"] = call["id"] or str(part.get("id") or "")
    fn = part.get("function")
    if not isinstance(fn, dict):
        return ""
    call["name"] = call["name"] or str(fn.get("name") or "")
    arguments = fn.get("arguments")
    if not isinstance(arguments, str) or not arguments:
        return ""
    call["args"].append(arguments)
    if call["name"] != "say":
        return arguments
    reader = call["reader"]
    if reader is None:
        reader = call["reader"] = JsonStringField("text")
        reader.feed("".join(call["args"][:-1]))
    added = reader.feed(arguments)
    if added:
        on_say(index, added)
    return arguments


def broken_stream(completion: Completion, params: dict[str, Any]) -> str | None:
    """Why a streamed completion looks like the stream garbled it, or ``None``. Arguments
    cut at the token budget (``length``), or by a stream that ended without a finish
    reason, say nothing about the endpoint's streaming."""
    if not params.get("tools") or completion.hit_length or completion.finish_reason == "":
        return None
    for call in completion.tool_calls:
        try:
            json.loads(call.arguments)
        except ValueError:
            return f"arguments of {call.name} are not JSON"
    names = {t.get("function", {}).get("name") for t in params["tools"] if isinstance(t, dict)}
    # a call in template markup, in or as the text: the stream failed to deliver it as a call
    if not completion.tool_calls and holds_call(completion.content, names):
        return "tool calls arrived as text"
    if not completion.tool_calls and not completion.content.strip():
        return EMPTY_ANSWER  # llama-cpp-python streams function calls as nothing
    return None
