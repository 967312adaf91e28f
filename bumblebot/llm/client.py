"""The chat-completions client: :class:`LLM`, against one OpenAI-compatible endpoint.

Endpoints differ, and Bumblebot must work with all of them (OpenAI, Ollama, llama.cpp server,
vLLM, OpenRouter). :meth:`LLM.complete` sends a request through one step per difference; each
answers its kind of refusal at once with the same request made plainer, and remembers what the
endpoint cannot do (:mod:`bumblebot.llm.capabilities`) so that later requests start plain:

1. thinking (:mod:`bumblebot.llm.thinking`): a request that asks for thinking is refused; it is
   sent again without the ask;
2. images (:mod:`bumblebot.llm.images`): a request with images is refused, or its images are
   read as text; it is sent again without them (when it was refused);
3. tool forcing (:mod:`bumblebot.llm.forcing`): ``tool_choice="required"`` is refused; the
   request is sent again with ``"auto"``;
4. streaming (:mod:`bumblebot.llm.stream`): a streamed request is refused or dropped, or its
   tool calls come out broken; it is sent again whole.

Also:

* Assistant messages are always sent with ``content: ""``, never ``null``.
* At most ``llm.max_concurrent_requests`` requests are in flight at once (turns, judges, the
  classifier and summaries alike); nothing else caps concurrency. Waiting requests go most
  urgent first (:mod:`bumblebot.llm.slots`).
* Errors are translated where requests are sent, once
  (:func:`~bumblebot.llm.completion.translate`): :class:`~bumblebot.core.errors.ModelTimeout`,
  :class:`~bumblebot.core.errors.ContextTooLong` and :class:`~bumblebot.core.errors.ModelError`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import openai
from openai.types.chat import ChatCompletion

from bumblebot.core.errors import ContextTooLong, ModelError, ModelUnavailable
from bumblebot.core.messages import estimate_text_tokens, estimate_tools, json_text
from bumblebot.core.metrics import NO_METRICS, Metrics
from bumblebot.core.settings import LLMSettings
from bumblebot.core.usage import NO_METER, Meter, Usage, current_scope
from bumblebot.llm.capabilities import CapabilityMemory, Refusals
from bumblebot.llm.completion import Completion, normalise, translate, usage_counts
from bumblebot.llm.forcing import (
    FORCING_RETRY_REQUESTS,
    FORCING_RETRY_S,
    ForcingFallback,
    NamedChoice,
    ToolForcing,
    may_refuse_forcing,
    named,
)
from bumblebot.llm.images import Vision, about_images, has_images, read_as_text, without_images
from bumblebot.llm.overruns import Overruns, bounded_tools, overran
from bumblebot.llm.pace import Bound, Overran, Pace
from bumblebot.llm.slots import RequestSlots
from bumblebot.llm.stream import SayListener, StreamedRequests, post_whole
from bumblebot.llm.thinking import Thinking
from bumblebot.llm.window import Windows

log = logging.getLogger(__name__)


class LLM:
    """Chat completions against one OpenAI-compatible endpoint.

    Args:
        settings: the ``llm`` config section.
        base_url: the effective base URL (config, else ``OPENAI_BASE_URL``, else OpenAI's).
        api_key: the key; local servers accept any non-empty value.
        capabilities: where what the endpoint cannot do is remembered.
        forcing_retry_requests: tool requests under the ``"auto"`` fallback before
            ``"required"`` is tried again.
        forcing_retry_s: seconds under the fallback before it is tried again (whichever of
            the two comes first).
        clock: the wall clock, epoch seconds (tests inject one).
        metrics: counts each :meth:`complete` and times it (``bumblebot_model_requests_total``,
            ``bumblebot_model_request_seconds``); default: not counted.
        meter: admits each :meth:`complete` before it is sent (spending limits) and records
            what it used, for the :class:`~bumblebot.core.usage.Scope` of the task sending it;
            the completion returned carries that ``usage`` and the ``cost`` the meter priced it
            at; default: nothing counted or refused.
        memory_key: the endpoint's name in the keys of what it cannot do
            (:func:`~bumblebot.llm.capabilities.endpoint_key`; default: ``base_url``).
        failover: a next endpoint answers what this one cannot (``llm.fallbacks``): a streamed
            request this one fails with a 5xx is not sent again whole (:class:`StreamedRequests`).
    """

    def __init__(
        self,
        settings: LLMSettings,
        *,
        base_url: str,
        api_key: str | None,
        capabilities: CapabilityMemory | None = None,
        forcing_retry_requests: int = FORCING_RETRY_REQUESTS,
        forcing_retry_s: float = FORCING_RETRY_S,
        clock: Callable[[], float] = time.time,
        metrics: Metrics | None = None,
        meter: Meter | None = None,
        memory_key: str | None = None,
        failover: bool = False,
    ) -> None:
        self.settings = settings
        self.meter = NO_METER if meter is None else meter
        self._metrics = NO_METRICS if metrics is None else metrics
        self.base_url = base_url
        self.memory_key = memory_key or base_url
        self._client = openai.AsyncOpenAI(
            base_url=base_url,
            api_key=api_key or "not-needed",
            timeout=settings.timeout_s,
            max_retries=settings.max_retries,
        )
        self.capabilities = capabilities or CapabilityMemory()
        self._clock = clock
        self._slots = RequestSlots(settings.max_concurrent_requests)
        refusals = Refusals(self.capabilities, base_url, clock, endpoint=self.memory_key)
        self._forcing = ToolForcing(
            self.capabilities, base_url, clock, retry_requests=forcing_retry_requests, retry_s=forcing_retry_s,
            endpoint=self.memory_key,
        )
        self._thinking = Thinking(settings, refusals)
        self._named = NamedChoice(refusals)
        self._vision = Vision(settings, refusals)
        self._streamed = StreamedRequests(
            self._client, self._slots, settings, refusals, discarded=self._discarded, failover=failover
        )
        #: the models' context windows, asked and learned from refusals (:mod:`bumblebot.llm.window`)
        self.windows = Windows(self.capabilities, base_url, api_key, clock)
        #: the models seen writing past ``max_tokens``, and each model's speed: every request is
        #: bounded by its budget (:mod:`bumblebot.llm.pace`)
        self.overruns = Overruns(self.capabilities, self.memory_key, clock)
        self.pace = Pace(self.capabilities, self.memory_key)
        #: requests forcing a tool call go without the client's retries (:meth:`_send_forced`)
        self._once = self._client.with_options(max_retries=0)
        self._fewer_retries = self._client.with_options(max_retries=max(0, settings.max_retries - 1))

    @property
    def model(self) -> str:
        return self.settings.model

    @property
    def reflex_model(self) -> str:
        return self.settings.reflex_model or self.settings.model

    @property
    def waiting(self) -> int:
        """Requests waiting for a slot under ``max_concurrent_requests``."""
        return self._slots.waiting

    @property
    def forcing_retry_requests(self) -> int:
        """Tool requests under the ``"auto"`` fallback before ``"required"`` is tried again."""
        return self._forcing.retry_requests

    @forcing_retry_requests.setter
    def forcing_retry_requests(self, value: int) -> None:
        self._forcing.retry_requests = value

    @property
    def forcing_retry_s(self) -> float:
        """Seconds under the fallback before ``"required"`` is tried again."""
        return self._forcing.retry_s

    @forcing_retry_s.setter
    def forcing_retry_s(self, value: float) -> None:
        self._forcing.retry_s = value

    def retry_forcing(self) -> None:
        """The next tool request re-tries ``"required"`` under a remembered fallback, whatever
        its timer says (:meth:`ToolForcing.retry_now <bumblebot.llm.forcing.ToolForcing.retry_now>`)."""
        self._forcing.retry_now()

    async def aclose(self) -> None:
        await self._client.close()
        try:
            await self.pace.flush()  # the speeds measured since their last save
        except Exception as exc:  # a store closed first: only speeds lost, measured again
            log.info("endpoint %s: the speeds measured last were not saved: %s", self.base_url, exc)

    # -- what the endpoint has shown -------------------------------------------------------------

    async def forcing_fallback(self) -> ForcingFallback | None:
        """The remembered ``"auto"`` fallback of this endpoint, ``None`` while forcing is on."""
        return await self._forcing.fallback()

    async def sees_images(self, model: str | None = None) -> bool:
        """Whether requests to ``model`` (default ``llm.model``) carry images: ``llm.vision``,
        and under ``auto`` whether the endpoint has not refused them (within
        :data:`~bumblebot.llm.images.VISION_RETRY_S`)."""
        return await self._vision.sees(model or self.settings.model)

    async def vision_refusal(self, model: str | None = None) -> str | None:
        """Why ``model`` is remembered as unable to see images, ``None`` when it is not."""
        return await self._vision.refusal(model or self.settings.model)

    async def thinks(self, model: str | None = None) -> bool:
        """Whether deliberate requests to ``model`` ask for thinking: ``llm.thinking.mode``,
        and under ``auto`` whether the endpoint has not refused it (within
        :data:`~bumblebot.llm.thinking.THINKING_RETRY_S`)."""
        return await self._thinking.asks(model or self.settings.model)

    async def thinking_refusal(self, model: str | None = None) -> str | None:
        """Why ``model`` is remembered as refusing thinking, ``None`` when it is not."""
        return await self._thinking.refusal(model or self.settings.model)

    async def streams(self) -> bool:
        """Whether the endpoint gets streamed requests (not remembered as unable to, or the
        memory is older than :data:`~bumblebot.llm.stream.STREAM_RETRY_S`)."""
        return await self._streamed.streams()

    async def stream_fallback(self) -> str | None:
        """Why the endpoint gets whole answers instead of streams, ``None`` while it streams."""
        return await self._streamed.fallback()

    async def streams_usage(self) -> bool:
        """Whether streamed requests ask for usage (``stream_options``; not remembered as
        refused within :data:`~bumblebot.llm.stream.STREAM_RETRY_S`)."""
        return await self._streamed.asks_usage()

    # -- completions -----------------------------------------------------------------------------

    async def complete(
        self,
        messages: list[dict[str, Any]],
        *,
        model: str | None = None,
        max_tokens: int,
        temperature: float | None = None,
        tools: list[dict[str, Any]] | None = None,
        thinking: bool = False,
        on_say: SayListener | None = None,
        call: str | None = None,
    ) -> Completion:
        """One chat completion.

        Messages may carry ``image_url`` parts: they are sent when the model sees images
        (:meth:`sees_images`), else replaced by a note; under ``llm.vision: auto`` a refusal
        of them is answered by the same request without them, and remembered.

        Args:
            messages: OpenAI-form messages (assistant ``content`` must not be ``None``).
            model: defaults to ``llm.model``.
            max_tokens: completion budget, tokens.
            temperature: defaults to ``llm.temperature``.
            tools: tool schemas; when given, tool forcing applies (``llm.tool_choice`` or the
                remembered fallback).
            thinking: request thinking (per ``llm.thinking``); reasoning is always stripped.
            on_say: stream the completion and report the text of each ``say`` call as it
                grows (:data:`SayListener`); the completion returned is the same as unstreamed.
                Ignored while the endpoint is remembered as unable to stream.
            call: with ``tools``, the tool the model must call: the request's ``tool_choice``
                names it (an endpoint that refuses that gets its usual tool forcing).

        Raises:
            ModelTimeout: no answer within ``llm.timeout_s`` (after the client's retries).
            ModelUnavailable: unreachable, rate-limited or a server error (after the retries).
            ContextTooLong: the endpoint says the prompt is over its context window.
            SpendingLimitReached: a spending limit covers the request's scope; nothing was sent.
            ModelError: any other failure, with the HTTP status when there was one.
        """
        scope, model = current_scope(), model or self.settings.model
        await self.meter.admit(scope, model)
        with self._metrics.model_request():  # counted as one request, with its outcome and latency
            try:
                completion = await self._complete_any(
                    messages, model=model, max_tokens=max_tokens, temperature=temperature, tools=tools,
                    thinking=thinking, on_say=on_say, call=call,
                )
            except ContextTooLong as exc:
                if exc.window is not None:  # later requests are sized for it
                    await self.windows.refused(model, exc.window)
                raise
        usage = self._usage(completion, model, messages, tools)
        if completion.cut is not None:
            usage = dataclasses.replace(usage, cut=completion.cut.as_dict())
        cost = await self.meter.record(scope, usage)
        return dataclasses.replace(completion, usage=usage, cost=cost)

    def _usage(
        self, completion: Completion, model: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> Usage:
        """What ``completion`` used as the endpoint reported it (cached and reasoning tokens
        included), else the token estimate (images counted as the note that replaces them, not
        as the text of their data URLs)."""
        if completion.prompt_tokens is not None and completion.completion_tokens is not None:
            return Usage(
                self.base_url, model, prompt=completion.prompt_tokens, completion=completion.completion_tokens,
                cached=completion.cached_tokens or 0, reasoning=completion.reasoning_tokens or 0,
            )
        sent = without_images(messages) if has_images(messages) else messages
        prompt = estimate_text_tokens(json_text(sent)) + estimate_tools(tools or [])
        written = estimate_text_tokens(completion.content + "".join(c.arguments for c in completion.tool_calls))
        if completion.cut is not None and completion.cut.by == "deadline":
            written = completion.cut.budget  # unseen, but written (and billed) until the cut, at least
        return Usage(self.base_url, model, prompt=prompt, completion=written, estimated=True)

    async def _discarded(self, completion: Completion, params: dict[str, Any]) -> None:
        """A streamed answer set aside for the same request answered whole (its tool calls came
        out garbled): the endpoint billed it too, so the meter records it as well."""
        usage = self._usage(completion, params["model"], params["messages"], params.get("tools"))
        await self.meter.record(current_scope(), usage)

    async def text(
        self, messages: list[dict[str, Any]], *, model: str | None = None, max_tokens: int, temperature: float
    ) -> str:
        """A tool-less completion returning its visible text (classifier, judges, summaries)."""
        completion = await self.complete(
            messages, model=model or self.reflex_model, max_tokens=max_tokens, temperature=temperature
        )
        return completion.content

    async def _complete_any(
        self,
        messages: list[dict[str, Any]],
        *,
        model: str | None,
        max_tokens: int,
        temperature: float | None,
        tools: list[dict[str, Any]] | None,
        thinking: bool,
        on_say: SayListener | None,
        call: str | None,
    ) -> Completion:
        """:meth:`complete` without its metrics: thinking asked for or not (``auto``: unless
        the endpoint refused it), then :meth:`_complete_seeing`."""
        model = model or self.settings.model
        kwargs: dict[str, Any] = dict(
            model=model, max_tokens=max_tokens, temperature=temperature, tools=tools, on_say=on_say, call=call
        )
        if not thinking or self.settings.thinking.mode != "auto":
            return await self._complete_seeing(messages, thinking=thinking, **kwargs)
        if not await self.thinks(model):
            return await self._complete_seeing(messages, thinking=False, **kwargs)
        try:
            completion = await self._complete_seeing(messages, thinking=True, **kwargs)
        except ModelError as exc:
            if isinstance(exc, ContextTooLong) or exc.status not in (400, 422):
                raise
            refusal = exc
        else:
            self._thinking.answered()
            return completion
        try:  # the same request without asking for thinking: answered, it was the ask
            completion = await self._complete_seeing(messages, thinking=False, **kwargs)
        except (ModelUnavailable, ContextTooLong):
            raise  # an outage, or the window: theirs to handle, not a refusal
        except ModelError:
            raise refusal from None  # not about thinking
        await self._thinking.refused(model, refusal)
        return completion

    async def _complete_seeing(
        self, messages: list[dict[str, Any]], *, model: str, max_tokens: int, temperature: float | None,
        tools: list[dict[str, Any]] | None, thinking: bool, on_say: SayListener | None, call: str | None,
    ) -> Completion:
        """One completion with images sent, left out, or retried without."""
        kwargs: dict[str, Any] = dict(
            model=model, max_tokens=max_tokens, temperature=temperature, tools=tools, thinking=thinking,
            on_say=on_say, call=call,
        )
        if not has_images(messages):
            return await self._complete(messages, **kwargs)
        if not await self.sees_images(model):
            return await self._complete(without_images(messages), **kwargs)
        if self.settings.vision == "on":
            return await self._complete(messages, **kwargs)
        try:
            completion = await self._complete(messages, **kwargs)
        except ContextTooLong as exc:
            # a server without a vision projector tokenizes the data URL as text
            # (llama-cpp-python: 22,766 tokens for a 28 KB JPEG): the same request without it
            stripped = await self._complete(without_images(messages), **kwargs)
            if read_as_text(messages, exc.prompt_tokens):
                await self._vision.blind(model, f"it read the image as text ({exc})")
            else:
                log.info("endpoint %s: a request with images was too long; answered without them", self.base_url)
            return dataclasses.replace(stripped, scale_sample=False)  # its usage counts; its scale does not
        except ModelError as exc:
            if not about_images(exc):
                raise
            try:
                stripped = await self._complete(without_images(messages), **kwargs)
            except ContextTooLong:
                raise  # without the images it is too long: compaction's business
            except ModelError:
                raise exc from None  # not the images' fault
            await self._vision.blind(model, str(exc))
            return dataclasses.replace(stripped, scale_sample=False)
        if read_as_text(messages, completion.prompt_tokens):
            await self._vision.blind(model, f"it read the image as text ({completion.prompt_tokens} prompt tokens)")
            return dataclasses.replace(completion, scale_sample=False)
        return completion

    async def _complete(
        self,
        messages: list[dict[str, Any]],
        *,
        model: str,
        max_tokens: int,
        temperature: float | None,
        tools: list[dict[str, Any]] | None,
        thinking: bool,
        on_say: SayListener | None,
        call: str | None = None,
    ) -> Completion:
        """One completion with tool forcing as configured or remembered: a refusal of
        ``"required"`` that may be about forcing is answered by the same request with
        ``"auto"`` (:mod:`bumblebot.llm.forcing`). With ``call``, the request names that tool
        as the one to call, unless the endpoint refused that before
        (:class:`~bumblebot.llm.forcing.NamedChoice`)."""
        params: dict[str, Any] = {
            "model": model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": self.settings.temperature if temperature is None else temperature,
            **self._thinking.params(thinking),
        }
        named_refusal: openai.APIStatusError | None = None
        if tools:
            params["tools"] = bounded_tools(tools, max_tokens) if await self.overruns.seen(model) else tools
            if call is not None and self.settings.tool_choice == "required" and await self._named.usable():
                named_answer = await self._send_named(params, call, on_say)
                if isinstance(named_answer, Completion):
                    return named_answer
                named_refusal = named_answer
        choice: str | None = None
        probing = False
        if tools:
            choice, probing = await self._tool_choice()
            params["tool_choice"] = choice
        completion = await self._send_usual(params, choice, probing, on_say)
        if named_refusal is not None:  # the same request without the name was answered: the name was refused
            await self._named.refused(named_refusal)
        return completion

    async def _send_usual(
        self, params: dict[str, Any], choice: str | None, probing: bool, on_say: SayListener | None
    ) -> Completion:
        """The completion of ``params`` with its usual tool_choice ``choice`` (``probing``: a
        re-try of ``"required"`` under the fallback)."""
        try:
            response = await (self._send_forced(params, on_say) if choice == "required" else self._create(params, on_say))
        except openai.APIStatusError as exc:
            if choice != "required" or not may_refuse_forcing(exc, params):
                raise self._translate(exc) from exc
            log.warning(
                "endpoint %s refused a request with tool_choice=required (HTTP %s); retrying with 'auto'",
                self.base_url, exc.status_code,
            )
            params["tool_choice"] = choice = "auto"
            try:
                response = await self._create(params, on_say)
            except openai.APIError as exc2:
                translated = self._translate(exc2)
                if isinstance(translated, ContextTooLong):  # "auto" got past where "required" failed
                    await self._forcing.refused(exc, probing=probing)
                raise translated from exc2
            await self._forcing.refused(exc, probing=probing)
        except openai.APIError as exc:
            raise self._translate(exc) from exc
        else:
            if choice == "required":
                await self._forcing.accepted(probing=probing)
        finally:
            if probing:  # answered either way, or inconclusive (an outage): the next one decides
                self._forcing.probe_done()
        return _as_completion(response, choice)

    async def _send_named(
        self, params: dict[str, Any], call: str, on_say: SayListener | None
    ) -> Completion | openai.APIStatusError:
        """The completion of ``params`` with a tool_choice naming ``call``, or the refusal that
        may be about the name: the caller then sends its usual choice, and remembers the refusal
        only once that is answered. Sent without the client's retries for the same reason as
        :meth:`_send_forced`."""
        params = {**params, "tool_choice": named(call)}
        try:
            response = await self._send_forced(params, on_say)
        except openai.APIStatusError as exc:
            if not may_refuse_forcing(exc, params):
                raise self._translate(exc) from exc
            return exc
        except openai.APIError as exc:
            raise self._translate(exc) from exc
        self._named.accepted()
        return _as_completion(response, call)

    async def _tool_choice(self) -> tuple[str, bool]:
        """The tool_choice of the next tool request, and whether it re-tries ``"required"``
        (:meth:`ToolForcing.choose <bumblebot.llm.forcing.ToolForcing.choose>`)."""
        if self.settings.tool_choice != "required":
            return self.settings.tool_choice, False
        return await self._forcing.choose()

    async def _send_forced(self, params: dict[str, Any], on_say: SayListener | None) -> ChatCompletion | Completion:
        """Send a request with ``tool_choice="required"`` without the client's own retries: a
        server that refuses forcing answers it with a 500 (llama-cpp-python), which the retries would
        only repeat before the ``"auto"`` request. An error that cannot be such a refusal and
        that the client retries (a timeout, no connection, 408, 409, 429, 502, 503…) is sent
        again with the retries left, so an outage is waited out as for any request."""
        try:
            return await self._create(params, on_say, self._once)
        except openai.APIStatusError as exc:
            if may_refuse_forcing(exc, params) or not _retried(exc.status_code) or not self.settings.max_retries:
                raise
        except openai.APIConnectionError:  # a timeout too
            if not self.settings.max_retries:
                raise
        return await self._create(params, on_say, self._fewer_retries)

    async def _create(
        self, params: dict[str, Any], on_say: SayListener | None = None, client: openai.AsyncOpenAI | None = None
    ) -> ChatCompletion | Completion:
        """Send one request (through ``client``, default the endpoint's): streamed when
        ``on_say`` is given and the endpoint streams (a :class:`Completion` comes back, or a
        ``ChatCompletion`` when the stream failed and the request was answered whole), else
        whole (a ``ChatCompletion``)."""
        client = client or self._client
        model, budget = params["model"], params["max_tokens"]
        overruns = await self.overruns.seen(model)
        bound = await self.pace.bound(
            model, params["messages"], budget, "tools" if params.get("tools") else "text", overruns=overruns,
        )
        streamed = on_say is not None and await self.streams()
        try:
            if streamed:
                assert on_say is not None
                response: ChatCompletion | Completion = await self._streamed.send(params, on_say, client, bound)
            else:
                response = await post_whole(client, self._slots, params, bound)
        except Overran as over:
            log.warning("endpoint %s, model %s: a request was %s", self.base_url, model, over.cut.describe())
            return Completion(content="", finish_reason="length", cut=over.cut)
        await self._timed(model, params, response, bound)
        return response

    async def _timed(
        self, model: str, params: dict[str, Any], response: ChatCompletion | Completion, bound: Bound
    ) -> None:
        """What an answered request showed of the endpoint's pace (:class:`~bumblebot.llm.pace.Pace`),
        and whether it wrote past its budget (:class:`~bumblebot.llm.pace.Overruns`)."""
        if isinstance(response, Completion):
            counts, streamed = {"completion_tokens": response.completion_tokens,
                                "reasoning_tokens": response.reasoning_tokens}, True
        else:
            counts, streamed = usage_counts(getattr(response, "usage", None)), False
        written = counts["completion_tokens"]
        estimated = written is None
        if written is None:
            text = (response.content + "".join(c.arguments for c in response.tool_calls)
                    if isinstance(response, Completion) else _whole_text(response))
            written = estimate_text_tokens(text)
        if isinstance(response, Completion) and response.cut is not None:
            written = response.cut.written or written  # counted chunk by chunk
            await self.overruns.saw(model, f"a stream went past its budget of {bound.budget} tokens")
        elif not self._thinking.asked(params) and overran(written - (counts["reasoning_tokens"] or 0), bound.budget,
                                                    estimated=estimated):
            # reasoning is left out: some servers do not count it against max_tokens
            how = "about " if estimated else ""
            await self.overruns.saw(model, f"wrote {how}{written} tokens with max_tokens {bound.budget}")
        await self.pace.observe(model, written, bound, streamed=streamed, reasoned=bool(counts["reasoning_tokens"]))

    def _translate(self, exc: openai.APIError) -> ModelError:
        return translate(exc, base_url=self.base_url, timeout_s=self.settings.timeout_s, clock=self._clock)


def _whole_text(response: Any) -> str:
    """The text and arguments of a whole answer (for its size, when it reports no usage)."""
    choices = getattr(response, "choices", None) or []
    if not choices:
        return ""
    message = choices[0].message
    calls = "".join(c.function.arguments or "" for c in message.tool_calls or () if getattr(c, "function", None))
    return (message.content or "") + calls


def _retried(status: int) -> bool:
    """Whether the ``openai`` client retries a response with ``status`` (its own rule)."""
    return status in (408, 409, 429) or status >= 500


def _as_completion(response: ChatCompletion | Completion, choice: str | None) -> Completion:
    """An answer asked with tool_choice ``choice`` as a :class:`Completion`: a whole one
    normalised, or one that is already (streamed, or cut at its deadline: ``streamed`` says
    whether the text arrived as a stream)."""
    if isinstance(response, Completion):
        streamed = response.cut is None or response.cut.by == "tokens"
        return dataclasses.replace(response, tool_choice=choice, streamed=streamed)
    return normalise(response, choice)
