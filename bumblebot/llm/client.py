"""The chat-completions client: the only module that imports ``openai``.

Endpoints differ, and Bumblebot must work with all of them (OpenAI, Ollama, llama.cpp
server, vLLM, OpenRouter):

* ``tool_choice="required"`` is rejected by some local servers (HTTP 400/422/500). Such a
  request is retried at once with ``"auto"``. When the refusal clearly concerns forcing (its
  message names tools or tool_choice), or an unexplained one repeats on consecutive requests,
  the endpoint (by base URL) is switched to ``"auto"``; the fallback, with its reason and
  time (:class:`ForcingFallback`), is remembered in the store's ``kv`` table so it survives
  restarts. It is not for good: after :data:`FORCING_RETRY_REQUESTS` tool requests or
  :data:`FORCING_RETRY_S` under the fallback, whichever comes first, one tool request tries
  ``"required"`` again. Accepted: forcing is back and the memory is cleared. Refused: that
  request is answered with ``"auto"`` as before and the timer starts again.
* Assistant messages are always sent with ``content: ""``, never ``null``.
* Reasoning text (``<think>…</think>``, a lone ``</think>``, ``reasoning_content`` fields) is
  stripped by :func:`bumblebot.reasoning.strip_reasoning` and never reaches the user.
* Streaming (``delivery.streaming``): a request with a ``say`` listener is sent with
  ``stream: true``, and the text of each ``say`` call is reported as its arguments arrive
  (:class:`~bumblebot.llm.streaming.JsonStringField`). An endpoint that refuses a streamed request
  that it answers unstreamed, or whose streamed tool calls come out broken (arguments that are
  not JSON, calls written as text) where the unstreamed answer is sound, is switched to whole
  answers; that is remembered in ``kv`` ``llm.stream:<base_url>`` (:data:`STREAM_RETRY_S`).
* Images (``llm.vision: auto``): a request with ``image_url`` parts that the endpoint refuses
  (400, 415, 422, or a 500 that names images) is sent again at once with the images replaced
  by a note; when that one is answered, the model (by base URL and model name) is remembered
  as unable to see images in ``kv`` ``llm.vision:<base_url>|<model>``, tried again after
  :data:`VISION_RETRY_S`. ``on`` always sends them, ``off`` never.
* At most ``llm.max_concurrent_requests`` requests are in flight at once (turns, judges, the
  classifier and summaries alike); nothing else caps concurrency.

Errors are translated here, once: :class:`~bumblebot.core.errors.ModelTimeout`,
:class:`~bumblebot.core.errors.ContextTooLong` and :class:`~bumblebot.core.errors.ModelError`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import email.utils
import json
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
from openai.types.chat import ChatCompletion

from bumblebot.core.config import LLMSettings
from bumblebot.core.errors import ContextTooLong, ModelError, ModelTimeout, ModelUnavailable
from bumblebot.core.metrics import NO_METRICS, Metrics
from bumblebot.core.textrules import holds_call, strip_reasoning
from bumblebot.llm.streaming import JsonStringField

log = logging.getLogger(__name__)

#: The prompt's size in a context-length refusal (vLLM, OpenAI): "(4145 in the messages".
_PROMPT_COUNT_RE = re.compile(r"\((\d{1,9}) in the messages")
_CONTEXT_RE = re.compile(
    r"context.{0,20}(length|window|too long)|maximum context|too many tokens|prompt is too long"
    r"|exceeds? (the )?(model'?s? )?(max|context)"
    r"|exceeds? the available context|exceed_context_size|context size"  # llama.cpp server
    r"|tokens? \+ `?max_new_tokens`? must be <="  # text-generation-inference
    r"|input (is )?too long|too long for (the )?(model|context)",
    re.IGNORECASE,
)
#: HTTP statuses that mean "not now" rather than "never": timeout, conflict, rate limit.
TRANSIENT_STATUSES = frozenset({408, 409, 429})
LENGTH_FINISHES = frozenset({"length", "max_tokens", "max_length"})
#: A refusal that names forcing itself: counts at once, whatever the status.
_CHOICE_RE = re.compile(r"tool.?choice", re.IGNORECASE)
#: A client error (400/422) that names tools: counts at once. A 500 naming tools does not
#: ("Failed to parse tool call arguments" is the model's output, not the endpoint's rule).
_TOOLS_RE = re.compile(r"tool|function.?call", re.IGNORECASE)
#: Consecutive unexplained refusals of ``tool_choice="required"`` before ``"auto"`` is remembered.
FORCING_STRIKES = 3
#: Tool requests answered under the ``"auto"`` fallback before ``"required"`` is tried again.
#: A refusing endpoint answers a retry with a fast 400, so this costs at most one extra
#: request in 50 (2 %); at a few steps per turn it is a retry every 15 to 25 turns.
FORCING_RETRY_REQUESTS = 50
#: Seconds under the fallback before ``"required"`` is tried again, whichever comes first: a
#: quiet bot whose endpoint had one bad evening gets forcing back the same day.
FORCING_RETRY_S = 6 * 3600.0
#: Longest refusal message kept as the fallback's reason, characters.
_REASON_CHARS = 200
_STATUS_PREFIX = re.compile(r"^Error code: \d+(?: - )?")  # the openai client's own prefix
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

#: Seconds before a model remembered as unable to see images is sent one again.
VISION_RETRY_S = 24 * 3600.0
#: Seconds before a model that refused ``reasoning_effort`` is asked to think again.
THINKING_RETRY_S = 24 * 3600.0
#: A refusal that names the thinking parameter (OpenAI: "Unsupported parameter: 'reasoning_effort'").
_REASONING_RE = re.compile(r"reasoning", re.IGNORECASE)
#: Refusals in a row, each answered without thinking, before an unexplained one is remembered.
THINKING_STRIKES = 3
#: A 500 that is about the images of the request (llama.cpp server without a projector:
#: "image input is not supported - hint: ... mmproj").
_IMAGE_RE = re.compile(r"image|vision|multimodal|mmproj|content.{0,20}(type|part)", re.IGNORECASE)
IMAGE_NOT_SHOWN = "(an image was here; it is not shown: this model cannot see images)"

#: ``on_say(index, text)``: more text (appended to what came before) of the ``say`` call at
#: position ``index`` of a completion being streamed. Called synchronously from the stream:
#: it must not block.
SayListener = Callable[[int, str], None]


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One tool call the model asked for. ``arguments`` is the raw JSON text; ``index`` is its
    position in a streamed completion (what a :data:`SayListener` was told), else ``None``."""

    id: str
    name: str
    arguments: str
    index: int | None = field(default=None, compare=False)

    def to_api(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True, slots=True)
class Completion:
    """One completion, normalised.

    Args:
        content: visible text with reasoning stripped (``""`` if none).
        tool_calls: the calls asked for, in order (ids filled in when the server left them out).
        finish_reason: the server's finish reason (``"stop"``, ``"tool_calls"``, ``"length"``…).
        prompt_tokens: ``usage.prompt_tokens`` as reported, ``None`` if the server sent none.
        completion_tokens: ``usage.completion_tokens`` as reported.
        tool_choice: the tool_choice actually used (``"required"``, ``"auto"`` or ``None``).
    """

    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str = "stop"
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    tool_choice: str | None = None
    streamed: bool = False

    @property
    def hit_length(self) -> bool:
        return self.finish_reason in LENGTH_FINISHES


class CapabilityMemory:
    """Where per-endpoint capabilities are remembered (the store's ``kv`` in production).

    Values are text, cached after the first read. ``clear`` forgets a key: through ``delete``
    when one is given (``Store.delete_kv``), else by saving ``""``, which reads back as
    nothing, so the two wirings behave alike.

    Args:
        load: reads a key (``None`` when absent).
        save: writes a key.
        delete: removes a key.
    """

    def __init__(
        self,
        load: Callable[[str], Awaitable[str | None]] | None = None,
        save: Callable[[str, str], Awaitable[None]] | None = None,
        delete: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        self._load, self._save, self._delete = load, save, delete
        self._cache: dict[str, str | None] = {}

    async def get(self, key: str) -> str | None:
        if key not in self._cache:
            self._cache[key] = await self._load(key) if self._load else None
        return self._cache[key] or None

    async def set(self, key: str, value: str) -> None:
        self._cache[key] = value
        if self._save:
            await self._save(key, value)

    async def clear(self, key: str) -> None:
        self._cache[key] = None
        if self._delete:
            await self._delete(key)
        elif self._save:
            await self._save(key, "")


def tool_choice_key(base_url: str) -> str:
    """The ``kv`` key of the tool_choice fallback of the endpoint at ``base_url``."""
    return f"llm.tool_choice:{base_url}"


class _StreamDropped(ModelUnavailable):
    """A streamed request got no answer at all: the connection closed before the first chunk."""


def vision_key(base_url: str, model: str) -> str:
    """The ``kv`` key recording that ``model`` at ``base_url`` cannot see images: JSON
    ``{"reason": str, "since": float}`` (epoch seconds)."""
    return f"llm.vision:{base_url}|{model}"


def has_images(messages: list[dict[str, Any]]) -> bool:
    """Whether any message of a request carries an ``image_url`` part."""
    return any(
        isinstance(m.get("content"), list) and any(p.get("type") == "image_url" for p in m["content"])
        for m in messages
    )


def without_images(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's messages with every ``image_url`` part replaced by
    :data:`IMAGE_NOT_SHOWN` (content parts joined back into text)."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            texts = [p.get("text", "") if p.get("type") == "text" else IMAGE_NOT_SHOWN for p in content]
            m = {**m, "content": "\n".join(t for t in texts if t)}
        out.append(m)
    return out


def thinking_key(base_url: str, model: str) -> str:
    """The ``kv`` key recording that ``model`` at ``base_url`` refuses ``reasoning_effort``:
    JSON ``{"reason": str, "since": float}`` (epoch seconds)."""
    return f"llm.thinking:{base_url}|{model}"


def stream_key(base_url: str) -> str:
    """The ``kv`` key recording that the endpoint at ``base_url`` gets whole answers.

    Its value is JSON ``{"mode": "off", "reason": str, "since": float}`` (epoch seconds).
    """
    return f"llm.stream:{base_url}"


@dataclass(frozen=True, slots=True)
class ForcingFallback:
    """Why and since when an endpoint gets ``tool_choice="auto"`` instead of ``"required"``.

    Stored in ``kv`` ``llm.tool_choice:<base_url>`` as JSON:
    ``{"mode": "auto", "reason": str, "since": float, "checked_at": float, "retries": int}``.
    The plain ``auto`` written by older versions reads as a fallback of unknown reason and
    time, which is tried again at the next tool request.

    Args:
        reason: the refusal that caused it (the latest one, after a failed retry).
        since: when forcing was first turned off, epoch seconds (``None``: unknown).
        checked_at: when the retry timer started (the fallback, or the last refused retry),
            epoch seconds (``None``: unknown, a retry is due).
        retries: retries of ``"required"`` refused since.
    """

    reason: str
    since: float | None = None
    checked_at: float | None = None
    retries: int = 0

    @classmethod
    def parse(cls, raw: str | None) -> ForcingFallback | None:
        """The fallback a ``kv`` value records, ``None`` when forcing is on (no value)."""
        if not raw:
            return None
        try:
            data = json.loads(raw)
        except ValueError:
            data = raw.strip()
        if not isinstance(data, dict):  # "auto" from a version before the re-try
            if data != "auto":
                return None
            return cls("remembered by an older version; reason not recorded")
        if data.get("mode") != "auto":
            return None
        since, checked, retries = data.get("since"), data.get("checked_at"), data.get("retries")
        return cls(
            reason=str(data.get("reason") or "reason not recorded"),
            since=float(since) if isinstance(since, int | float) else None,
            checked_at=float(checked) if isinstance(checked, int | float) else None,
            retries=retries if isinstance(retries, int) else 0,
        )

    def dump(self) -> str:
        return json.dumps(
            {"mode": "auto", "reason": self.reason, "since": self.since, "checked_at": self.checked_at,
             "retries": self.retries},
            ensure_ascii=False,
        )

    def describe(self, now: float, retry_requests: int = FORCING_RETRY_REQUESTS, retry_s: float = FORCING_RETRY_S) -> str:
        """One line for ``bumblebot check``: ``auto since <time>: <reason>; re-tried every …``."""
        since = f" since {_utc(self.since)}" if self.since is not None else ""
        retried = f" (re-tried {self.retries} time(s) since, refused)" if self.retries else ""
        every = f"re-tried every {retry_requests} tool requests or {_duration(retry_s)}, whichever comes first"
        if self.checked_at is None:
            when = "next at the first tool request"
        else:
            left = self.checked_at + retry_s - now
            when = f"next within {_duration(left)}" if left > 0 else "next at the first tool request"
        return f"auto{since}: {self.reason}{retried}; {every} ({when})"


#: A request whose images were read as text counts at least this many prompt tokens per
#: character of their data URLs (base64 tokenizes at 0.3 to 0.8 tokens a character); a vision
#: model counts a few hundred tokens an image, whatever its size.
IMAGE_AS_TEXT_TOKENS_PER_CHAR = 0.15
#: Data URLs shorter than this (characters, a 15 KB image) are too small to tell the two apart.
IMAGE_AS_TEXT_MIN_CHARS = 20_000


def _read_as_text(messages: list[dict[str, Any]], prompt_tokens: int | None) -> bool:
    """Whether the endpoint counted the request's images as text: its prompt tokens exceed a
    generous count of the text (a third of its characters) by
    :data:`IMAGE_AS_TEXT_TOKENS_PER_CHAR` per character of the data URLs."""
    if prompt_tokens is None:
        return False
    url_chars = text_chars = 0
    for m in messages:
        content = m.get("content")
        parts = content if isinstance(content, list) else [{"type": "text", "text": content or ""}]
        for part in parts:
            if part.get("type") == "image_url":
                url_chars += len(str((part.get("image_url") or {}).get("url", "")))
            else:
                text_chars += len(str(part.get("text") or ""))
        text_chars += len(json.dumps(m.get("tool_calls") or []))
    if url_chars < IMAGE_AS_TEXT_MIN_CHARS:
        return False
    return prompt_tokens - text_chars / 3 >= IMAGE_AS_TEXT_TOKENS_PER_CHAR * url_chars


def _about_images(exc: ModelError) -> bool:
    """Whether a refusal of a request with images may be about the images: a 400, 415 or 422
    (not a context-length one), or a 500 whose message names images."""
    if isinstance(exc, ContextTooLong) or exc.status is None:
        return False
    if exc.status in (400, 415, 422):
        return True
    return exc.status == 500 and bool(_IMAGE_RE.search(str(exc)))


def retry_after_s(value: str | None, now: float) -> float | None:
    """A ``Retry-After`` header (RFC 9110 §10.2.3: delay-seconds or an HTTP-date) as seconds
    from ``now`` (epoch seconds); ``None`` when absent or unreadable, never negative."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        return None
    return max(0.0, when.timestamp() - now)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) else None


def _refusal(exc: openai.APIStatusError) -> str:
    """``HTTP <status>: <message>``, the message clipped to :data:`_REASON_CHARS`."""
    message = _STATUS_PREFIX.sub("", " ".join(str(exc.message).split())) or "no message"
    if len(message) > _REASON_CHARS:
        message = message[: _REASON_CHARS - 1] + "…"
    return f"HTTP {exc.status_code}: {message}"


def _utc(epoch: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(epoch))


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.3g} h"
    if seconds >= 60:
        return f"{seconds / 60:.3g} min"
    return f"{max(seconds, 0):.3g} s"


class LLM:
    """Chat completions against one OpenAI-compatible endpoint.

    Args:
        settings: the ``llm`` config section.
        base_url: the effective base URL (config, else ``OPENAI_BASE_URL``, else OpenAI's).
        api_key: the key; local servers accept any non-empty value.
        capabilities: where tool_choice fallbacks are remembered.
        forcing_retry_requests: tool requests under the ``"auto"`` fallback before
            ``"required"`` is tried again.
        forcing_retry_s: seconds under the fallback before it is tried again (whichever of
            the two comes first).
        clock: the wall clock, epoch seconds (tests inject one).
        metrics: counts each :meth:`complete` and times it (``bumblebot_model_requests_total``,
            ``bumblebot_model_request_seconds``); default: not counted.
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
    ) -> None:
        self.settings = settings
        self._metrics = NO_METRICS if metrics is None else metrics  # metrics hook (issue 14)
        self.base_url = base_url
        self._client = openai.AsyncOpenAI(
            base_url=base_url,
            api_key=api_key or "not-needed",
            timeout=settings.timeout_s,
            max_retries=settings.max_retries,
        )
        self.capabilities = capabilities or CapabilityMemory()
        self.forcing_retry_requests = forcing_retry_requests
        self.forcing_retry_s = forcing_retry_s
        self._clock = clock
        self._forcing_strikes = 0
        self._auto_requests = 0  # tool requests under the fallback since its timer started
        self._probing = False  # one request at a time tries "required" again
        self._slots = asyncio.Semaphore(settings.max_concurrent_requests)
        self._stream_checks = 0  # unstreamed re-checks that found the model, not the stream, broken
        self._stream_strikes = 0  # streamed requests in a row that failed where a whole one was answered
        self._thinking_strikes = 0  # unexplained refusals in a row that a request without thinking survived

    @property
    def model(self) -> str:
        return self.settings.model

    @property
    def reflex_model(self) -> str:
        return self.settings.reflex_model or self.settings.model

    async def aclose(self) -> None:
        await self._client.close()

    def _thinking_params(self, thinking: bool) -> dict[str, Any]:
        t = self.settings.thinking
        if t.mode in ("auto", "reasoning_effort"):
            return {"reasoning_effort": t.reasoning_effort} if thinking else {}
        if t.mode == "extra_body":
            return dict(t.extra_body_on if thinking else t.extra_body_off)
        return {}

    def _tool_choice_key(self) -> str:
        return tool_choice_key(self.base_url)

    async def forcing_fallback(self) -> ForcingFallback | None:
        """The remembered ``"auto"`` fallback of this endpoint, ``None`` while forcing is on."""
        return ForcingFallback.parse(await self.capabilities.get(self._tool_choice_key()))

    async def sees_images(self, model: str | None = None) -> bool:
        """Whether requests to ``model`` (default ``llm.model``) carry images: ``llm.vision``,
        and under ``auto`` whether the endpoint has not refused them (within
        :data:`VISION_RETRY_S`)."""
        if self.settings.vision != "auto":
            return self.settings.vision == "on"
        key = vision_key(self.base_url, model or self.settings.model)
        return not await self._refused(key, VISION_RETRY_S, f"sending images to {model or self.settings.model} again")

    async def _refused(self, key: str, retry_s: float, again: str) -> bool:
        """Whether ``key`` remembers a refusal (JSON with ``since``, epoch s) younger than
        ``retry_s``; an older one is forgotten (logged as ``again``)."""
        raw = await self.capabilities.get(key)
        if not raw:
            return False
        try:
            since = float(json.loads(raw).get("since") or 0)
        except (ValueError, AttributeError, TypeError):
            since = 0.0
        if self._clock() - since >= retry_s:
            await self.capabilities.clear(key)
            log.info("endpoint %s: %s", self.base_url, again)
            return False
        return True

    async def vision_refusal(self, model: str | None = None) -> str | None:
        """Why ``model`` is remembered as unable to see images, ``None`` when it is not."""
        return await self._reason_of(vision_key(self.base_url, model or self.settings.model))

    async def _reason_of(self, key: str) -> str | None:
        """The ``reason`` a remembered refusal under ``key`` gives, ``None`` when there is none."""
        raw = await self.capabilities.get(key)
        if not raw:
            return None
        try:
            return str(json.loads(raw).get("reason") or "reason not recorded")
        except (ValueError, AttributeError):
            return "reason not recorded"

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

        Raises:
            ModelTimeout: no answer within ``llm.timeout_s`` (after the client's retries).
            ModelUnavailable: unreachable, rate-limited or a server error (after the retries).
            ContextTooLong: the endpoint says the prompt is over its context window.
            ModelError: any other failure, with the HTTP status when there was one.
        """
        with self._metrics.model_request():  # metrics hook (issue 14): outcome and latency
            return await self._complete_any(
                messages, model=model, max_tokens=max_tokens, temperature=temperature, tools=tools,
                thinking=thinking, on_say=on_say,
            )

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
    ) -> Completion:
        """:meth:`complete` without its metrics: thinking asked for or not (``auto``: unless
        the endpoint refused it), then :meth:`_complete_seeing`."""
        model = model or self.settings.model
        kwargs: dict[str, Any] = dict(
            model=model, max_tokens=max_tokens, temperature=temperature, tools=tools, on_say=on_say
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
            self._thinking_strikes = 0
            return completion
        try:  # the same request without asking for thinking: answered, it was the ask
            completion = await self._complete_seeing(messages, thinking=False, **kwargs)
        except (ModelUnavailable, ContextTooLong):
            raise  # an outage, or the window: theirs to handle, not a refusal
        except ModelError:
            raise refusal from None  # not about thinking
        await self._thinking_refused(model, refusal)
        return completion

    async def thinks(self, model: str | None = None) -> bool:
        """Whether deliberate requests to ``model`` ask for thinking: ``llm.thinking.mode``,
        and under ``auto`` whether the endpoint has not refused it (within
        :data:`THINKING_RETRY_S`)."""
        mode = self.settings.thinking.mode
        if mode != "auto":
            return mode != "off"
        model = model or self.settings.model
        return not await self._refused(thinking_key(self.base_url, model), THINKING_RETRY_S, f"asking {model} to think again")

    async def _thinking_refused(self, model: str, refusal: ModelError) -> None:
        """A request asking for thinking was refused and the same without it answered. A
        refusal that names the parameter counts at once; another only when it happens on
        :data:`THINKING_STRIKES` such requests in a row (a passing 400 from an upstream proxy
        must not turn thinking off for a day)."""
        self._thinking_strikes += 1
        if _REASONING_RE.search(str(refusal)) or self._thinking_strikes >= THINKING_STRIKES:
            await self._no_thinking(model, str(refusal))

    async def _no_thinking(self, model: str, reason: str) -> None:
        """Remember that ``model`` refuses to be asked for thinking (:func:`thinking_key`)."""
        self._thinking_strikes = 0
        reason = reason[:_REASON_CHARS]
        value = json.dumps({"reason": reason, "since": self._clock()}, ensure_ascii=False)
        await self.capabilities.set(thinking_key(self.base_url, model), value)
        log.warning(
            "endpoint %s: model %s refuses reasoning_effort (%s); deliberate turns do not ask it to think "
            "from now on (tried again in %s)", self.base_url, model, reason, _duration(THINKING_RETRY_S),
        )

    async def thinking_refusal(self, model: str | None = None) -> str | None:
        """Why ``model`` is remembered as refusing thinking, ``None`` when it is not."""
        return await self._reason_of(thinking_key(self.base_url, model or self.settings.model))

    async def _complete_seeing(
        self, messages: list[dict[str, Any]], *, model: str, max_tokens: int, temperature: float | None,
        tools: list[dict[str, Any]] | None, thinking: bool, on_say: SayListener | None,
    ) -> Completion:
        """One completion with images sent, left out, or retried without."""
        kwargs: dict[str, Any] = dict(
            model=model, max_tokens=max_tokens, temperature=temperature, tools=tools, thinking=thinking, on_say=on_say
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
            if _read_as_text(messages, exc.prompt_tokens):
                await self._blind(model, f"it read the image as text ({exc})")
            else:
                log.info("endpoint %s: a request with images was too long; answered without them", self.base_url)
            return dataclasses.replace(stripped, prompt_tokens=None)  # not a sample of the token scale
        except ModelError as exc:
            if not _about_images(exc):
                raise
            try:
                stripped = await self._complete(without_images(messages), **kwargs)
            except ContextTooLong:
                raise  # without the images it is too long: compaction's business
            except ModelError:
                raise exc from None  # not the images' fault
            await self._blind(model, str(exc))
            return dataclasses.replace(stripped, prompt_tokens=None)
        if _read_as_text(messages, completion.prompt_tokens):
            await self._blind(model, f"it read the image as text ({completion.prompt_tokens} prompt tokens)")
            return dataclasses.replace(completion, prompt_tokens=None)
        return completion

    async def _blind(self, model: str, reason: str) -> None:
        """Remember that ``model`` does not see images (:func:`vision_key`)."""
        reason = reason[:_REASON_CHARS]
        value = json.dumps({"reason": reason, "since": self._clock()}, ensure_ascii=False)
        await self.capabilities.set(vision_key(self.base_url, model), value)
        log.warning(
            "endpoint %s: model %s does not see images (%s); they are not sent to it from now on (tried again in %s)",
            self.base_url, model, reason, _duration(VISION_RETRY_S),
        )

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
    ) -> Completion:
        params: dict[str, Any] = {
            "model": model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": self.settings.temperature if temperature is None else temperature,
            **self._thinking_params(thinking),
        }
        choice: str | None = None
        probing = False
        if tools:
            choice, probing = await self._tool_choice()
            params["tools"] = tools
            params["tool_choice"] = choice
        try:
            response = await self._create(params, on_say)
        except openai.APIStatusError as exc:
            if choice != "required" or exc.status_code not in (400, 422, 500):
                raise self._translate(exc) from exc
            if has_images(messages) and _IMAGE_RE.search(str(exc.message)):
                raise self._translate(exc) from exc  # the images, not forcing: complete() tells them apart
            if self._is_context_error(exc):
                raise self._translate(exc) from exc
            log.warning(
                "endpoint %s refused a request with tool_choice=required (HTTP %s); retrying with 'auto'",
                self.base_url, exc.status_code,
            )
            params["tool_choice"] = choice = "auto"
            try:
                response = await self._create(params, on_say)
            except openai.APIError as exc2:
                raise self._translate(exc2) from exc2
            if probing:
                await self._forcing_still_refused(exc)
            else:
                await self._note_forcing_refused(exc)
        except openai.APIError as exc:
            raise self._translate(exc) from exc
        else:
            if choice == "required":
                self._forcing_strikes = 0
                if probing:
                    await self._forcing_recovered()
        finally:
            if probing:  # answered either way, or inconclusive (an outage): the next one decides
                self._probing = False
        if isinstance(response, Completion):
            return Completion(
                response.content, response.tool_calls, response.finish_reason, response.prompt_tokens,
                response.completion_tokens, choice, streamed=True,
            )
        return self._normalise(response, choice)

    async def _tool_choice(self) -> tuple[str, bool]:
        """The tool_choice of the next tool request, and whether it re-tries ``"required"``.

        Under a remembered fallback ``"auto"`` is used, except for one request at a time once
        :attr:`forcing_retry_requests` requests or :attr:`forcing_retry_s` seconds have passed
        since the fallback (or its last refused retry).
        """
        if self.settings.tool_choice != "required":
            return self.settings.tool_choice, False
        fallback = await self.forcing_fallback()
        if fallback is None:
            return "required", False
        if not self._probing and self._retry_due(fallback):
            self._probing = True
            log.info(
                "endpoint %s: trying tool_choice=required again (it has used 'auto' since %s)",
                self.base_url, "an older version" if fallback.since is None else _utc(fallback.since),
            )
            return "required", True
        self._auto_requests += 1
        return "auto", False

    def _retry_due(self, fallback: ForcingFallback) -> bool:
        if fallback.checked_at is None:
            return True
        return (
            self._auto_requests >= self.forcing_retry_requests
            or self._clock() - fallback.checked_at >= self.forcing_retry_s
        )

    async def _note_forcing_refused(self, exc: openai.APIStatusError) -> None:
        """Fall back to ``"auto"`` for this endpoint once the refusal is clearly about forcing.

        An error that names ``tool_choice``, or a 400/422 that names tools, counts at once; any
        other refusal that ``"auto"`` then survives counts only when it happens on
        :data:`FORCING_STRIKES` consecutive tool requests (a flaky upstream that fails one
        request in three does not switch forcing off). Either way the fallback is re-tried later
        (:meth:`_tool_choice`), so no error turns tool forcing off for good.
        """
        message = str(exc.message)
        about_tools = bool(_CHOICE_RE.search(message)) or (
            exc.status_code in (400, 422) and bool(_TOOLS_RE.search(message))
        )
        self._forcing_strikes += 1
        if not (about_tools or self._forcing_strikes >= FORCING_STRIKES):
            return
        refusal = _refusal(exc)
        reason = refusal if about_tools else f"{self._forcing_strikes} unexplained refusals in a row (last: {refusal})"
        now = self._clock()
        await self.capabilities.set(self._tool_choice_key(), ForcingFallback(reason, now, now).dump())
        self._auto_requests = 0
        log.warning(
            "endpoint %s does not support tool_choice=required (%s); using 'auto', trying 'required' again "
            "after %d tool requests or %s",
            self.base_url, reason, self.forcing_retry_requests, _duration(self.forcing_retry_s),
        )

    async def _forcing_still_refused(self, exc: openai.APIStatusError) -> None:
        """A re-try of ``"required"`` was refused: the fallback stays and its timer restarts."""
        old = await self.forcing_fallback()
        now = self._clock()
        fallback = ForcingFallback(
            _refusal(exc), old.since if old else now, now, (old.retries if old else 0) + 1
        )
        await self.capabilities.set(self._tool_choice_key(), fallback.dump())
        self._auto_requests = 0
        log.info(
            "endpoint %s still refuses tool_choice=required (%s); 'auto' stays, next try after %d tool "
            "requests or %s", self.base_url, fallback.reason, self.forcing_retry_requests,
            _duration(self.forcing_retry_s),
        )

    async def _forcing_recovered(self) -> None:
        """A re-try of ``"required"`` was accepted: forcing is back, the memory is cleared."""
        old = await self.forcing_fallback()
        await self.capabilities.clear(self._tool_choice_key())
        self._auto_requests = 0
        log.warning(
            "endpoint %s accepts tool_choice=required again; tool forcing is back (it used 'auto' since %s)",
            self.base_url, "an older version" if old is None or old.since is None else _utc(old.since),
        )

    async def text(
        self, messages: list[dict[str, Any]], *, model: str | None = None, max_tokens: int, temperature: float
    ) -> str:
        """A tool-less completion returning its visible text (classifier, judges, summaries)."""
        completion = await self.complete(
            messages, model=model or self.reflex_model, max_tokens=max_tokens, temperature=temperature
        )
        return completion.content

    async def _create(self, params: dict[str, Any], on_say: SayListener | None = None) -> ChatCompletion | Completion:
        """Send one request: streamed when ``on_say`` is given and the endpoint streams
        (a :class:`Completion` comes back), else whole (a ``ChatCompletion``)."""
        if on_say is None or not await self.streams():
            return await self._post(params)
        try:
            streamed = await self._post_streamed(params, on_say)
        except openai.APITimeoutError:
            raise  # slow, not unable to stream: an outage as any timeout is
        except openai.APIStatusError as exc:
            if exc.status_code in _NOT_ABOUT_STREAMING or self._is_context_error(exc):
                raise
            response = await self._post(params)  # the same request, whole: if it fails too, not our business
            why = f"a streamed request was refused ({_refusal(exc)}); an unstreamed one was answered"
            await self._stream_failed(why, at_once=exc.status_code < 500)  # a 5xx may be a passing one
            return response
        except (openai.APIConnectionError, _StreamDropped) as exc:
            # no answer at all to a streamed request: the endpoint may be down, or it may be
            # one that drops streamed requests it cannot serve (llama-cpp-python does, for
            # tool_choice "required"). One whole request tells them apart.
            why = f"a streamed request was dropped unanswered ({exc}); an unstreamed one was answered"
            try:
                try:
                    response = await self._post(params)
                except openai.APIConnectionError:
                    # a server that aborted a stream can leave its kept-alive connection broken
                    # (llama-cpp-python): one more try, on a fresh connection
                    response = await self._post(params)
            except openai.APIConnectionError:
                raise exc from None  # down: an outage, as it was
            except openai.APIStatusError as status:
                # a 500 is the endpoint itself failing the request (llama-cpp-python refuses a
                # forced tool call so): it is up, the stream is suspect; 502/503/504/429 are not
                if status.status_code == 500:
                    await self._stream_failed(why)
                raise
            await self._stream_failed(why)
            return response
        broken = self._broken_stream(streamed, params)
        if broken is None:
            self._stream_checks = self._stream_strikes = 0
            return streamed
        if self._stream_checks >= STREAM_CHECKS:
            return streamed
        response = await self._post(params)
        whole = self._normalise(response, params.get("tool_choice"))
        if self._broken_stream(whole, params) is None:
            why = f"streamed tool calls came out broken ({broken}); the unstreamed answer did not"
            # garbled calls are the stream's format; an empty answer may be one unlucky sample
            await self._stream_failed(why, at_once=broken != EMPTY_ANSWER)
        else:
            self._stream_checks += 1  # the model's own mess; after a few in a row, stop paying for checks
        return response

    async def _post(self, params: dict[str, Any]) -> ChatCompletion:
        # The request is already in wire form; ``client.post`` sends it as is. The typed
        # ``chat.completions.create`` re-walks every message and tool schema through the SDK's
        # TypedDict transformer, which cost ~18 ms of CPU per step here (bench/bench_turn.py).
        async with self._slots:
            return await self._client.post("/chat/completions", cast_to=ChatCompletion, body=params)

    async def _post_streamed(self, params: dict[str, Any], on_say: SayListener) -> Completion:
        """One streamed request, read to the end; ``on_say`` hears each ``say`` call's text.

        Raises:
            openai.APIError: the endpoint refused the request or sent an error event.
            ModelTimeout, ModelUnavailable: the stream stalled or broke off.
        """
        body = {**params, "stream": True, "stream_options": {"include_usage": True}}
        content: list[str] = []
        calls: dict[int, dict[str, Any]] = {}
        finish: str | None = None
        usage: Any = None
        received = 0
        async with self._slots:
            # chunks come as plain dicts (``AsyncStream[object]``): building a typed object per
            # chunk doubled the CPU of a streamed turn (bench/bench_chat.py)
            stream = await self._client.post(
                "/chat/completions", cast_to=ChatCompletion, body=body, stream=True,
                stream_cls=openai.AsyncStream[object],
            )
            try:
                async for chunk in stream:
                    received += 1
                    if not isinstance(chunk, dict):
                        continue
                    usage = chunk.get("usage") or usage
                    for choice in chunk.get("choices") or ():
                        delta = choice.get("delta") or {}
                        if delta.get("content"):
                            content.append(delta["content"])
                        for part in delta.get("tool_calls") or ():
                            self._take_call_part(calls, part, on_say)
                        finish = choice.get("finish_reason") or finish
            # the openai client wraps what httpx raises while a stream is read in its own
            # APITimeoutError / APIConnectionError; both are caught here, the raw ones too
            except (httpx.TimeoutException, openai.APITimeoutError) as exc:
                raise ModelTimeout(f"the model endpoint stopped streaming for {self.settings.timeout_s:g} s") from exc
            except (httpx.HTTPError, openai.APIConnectionError) as exc:
                if not received:
                    raise _StreamDropped(f"the endpoint at {self.base_url} closed the stream before any answer: {exc}") from exc
                raise ModelUnavailable(f"the stream from the model endpoint at {self.base_url} broke off: {exc}") from exc
            except openai.APIStatusError:
                raise
            except openai.APIError as exc:  # an error event mid-stream (OpenRouter: a provider failed)
                if self._is_context_error(exc):
                    raise ContextTooLong(f"the prompt is too long for the model: {exc.message}") from exc
                raise ModelUnavailable(f"the model endpoint reported an error mid-stream: {exc.message}") from exc
            finally:
                await stream.close()
        if not received:  # headers, then nothing: llama-cpp-python, when its handler failed
            raise _StreamDropped(f"the endpoint at {self.base_url} ended the stream without sending anything")
        tool_calls = [
            ToolCall(
                id=c["id"] or f"call_{uuid.uuid4().hex[:12]}", name=c["name"], arguments="".join(c["args"]) or "{}",
                index=index,
            )
            for index, c in sorted(calls.items()) if c["name"]
        ]
        return Completion(
            content=strip_reasoning("".join(content)),
            tool_calls=tool_calls,
            finish_reason=finish or "",
            prompt_tokens=_int(usage.get("prompt_tokens")) if isinstance(usage, dict) else None,
            completion_tokens=_int(usage.get("completion_tokens")) if isinstance(usage, dict) else None,
        )

    @staticmethod
    def _take_call_part(calls: dict[int, dict[str, Any]], part: Any, on_say: SayListener) -> None:
        """Add one streamed fragment of a tool call (a ``delta.tool_calls`` item, keyed by
        ``index``) and report the text of a ``say`` call that grew."""
        if not isinstance(part, dict):
            return
        index = part.get("index")
        index = index if isinstance(index, int) else max(calls, default=0)
        call = calls.setdefault(index, {"id": "", "name": "", "args": [], "reader": None})
        call["id"] = call["id"] or str(part.get("id") or "")
        fn = part.get("function")
        if not isinstance(fn, dict):
            return
        call["name"] = call["name"] or str(fn.get("name") or "")
        arguments = fn.get("arguments")
        if not isinstance(arguments, str) or not arguments:
            return
        call["args"].append(arguments)
        if call["name"] != "say":
            return
        reader = call["reader"]
        if reader is None:
            reader = call["reader"] = JsonStringField("text")
            reader.feed("".join(call["args"][:-1]))
        added = reader.feed(arguments)
        if added:
            on_say(index, added)

    @staticmethod
    def _broken_stream(completion: Completion, params: dict[str, Any]) -> str | None:
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

    async def streams(self) -> bool:
        """Whether the endpoint gets streamed requests (not remembered as unable to, or the
        memory is older than :data:`STREAM_RETRY_S`)."""
        return not await self._refused(stream_key(self.base_url), STREAM_RETRY_S, "trying streamed requests again")

    async def stream_fallback(self) -> str | None:
        """Why the endpoint gets whole answers instead of streams, ``None`` while it streams."""
        return await self._reason_of(stream_key(self.base_url))

    async def _stream_failed(self, reason: str, *, at_once: bool = False) -> None:
        """A streamed request failed where a whole one was answered: streaming is switched
        off for the endpoint at once (a client error that names the request), or after
        :data:`STREAM_STRIKES` such failures in a row (a drop or a 5xx may be a passing fault)."""
        self._stream_strikes += 1
        if at_once or self._stream_strikes >= STREAM_STRIKES:
            await self._stream_refused(reason if at_once else f"{self._stream_strikes} times in a row: {reason}")

    async def _stream_refused(self, reason: str) -> None:
        value = json.dumps({"mode": "off", "reason": reason, "since": self._clock()}, ensure_ascii=False)
        await self.capabilities.set(stream_key(self.base_url), value)
        log.warning(
            "endpoint %s: %s; replies are sent whole from now on (streaming is tried again in %s)",
            self.base_url, reason, _duration(STREAM_RETRY_S),
        )

    @staticmethod
    def _is_context_error(exc: openai.APIStatusError) -> bool:
        return bool(_CONTEXT_RE.search(str(exc.message)))

    def _translate(self, exc: openai.APIError) -> ModelError:
        if isinstance(exc, openai.APITimeoutError):
            return ModelTimeout(f"the model endpoint did not answer within {self.settings.timeout_s:g} s")
        if isinstance(exc, openai.APIStatusError):
            if exc.status_code in (400, 413) and self._is_context_error(exc):
                counted = _PROMPT_COUNT_RE.search(str(exc.message))
                body = exc.body.get("error", exc.body) if isinstance(exc.body, dict) else {}
                # llama.cpp server: {"error": {"type": "exceed_context_size_error", "n_prompt_tokens": N, ...}}
                n_prompt = _int(body.get("n_prompt_tokens")) if isinstance(body, dict) else None
                return ContextTooLong(
                    f"the prompt is too long for the model: {exc.message}", status=exc.status_code,
                    prompt_tokens=int(counted.group(1)) if counted else n_prompt,
                )
            if exc.status_code in TRANSIENT_STATUSES or exc.status_code >= 500:
                return ModelUnavailable(
                    f"model endpoint error {exc.status_code}: {exc.message}", status=exc.status_code,
                    retry_after=retry_after_s(exc.response.headers.get("retry-after"), self._clock()),
                )
            return ModelError(f"model endpoint error {exc.status_code}: {exc.message}", status=exc.status_code)
        if isinstance(exc, openai.APIConnectionError):
            return ModelUnavailable(f"cannot reach the model endpoint at {self.base_url}: {exc.message}")
        return ModelError(f"model endpoint error: {exc}")

    @staticmethod
    def _normalise(response: Any, choice: str | None) -> Completion:
        if not getattr(response, "choices", None):
            raise ModelError("the model endpoint returned no choices")
        first = response.choices[0]
        message = first.message
        calls = []
        for call in message.tool_calls or ():
            fn = getattr(call, "function", None)
            if fn is None or not fn.name:
                continue
            calls.append(
                ToolCall(
                    id=call.id or f"call_{uuid.uuid4().hex[:12]}",
                    name=fn.name,
                    arguments=fn.arguments or "{}",
                )
            )
        usage = getattr(response, "usage", None)
        return Completion(
            content=strip_reasoning(message.content or ""),
            tool_calls=calls,
            finish_reason=first.finish_reason or "stop",
            prompt_tokens=getattr(usage, "prompt_tokens", None),
            completion_tokens=getattr(usage, "completion_tokens", None),
            tool_choice=choice,
        )
