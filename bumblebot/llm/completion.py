"""What an endpoint's reply becomes: a :class:`Completion` (its calls as :class:`ToolCall`), or
one of Bumblebot's model errors.

* Reasoning in the text (``<think>…</think>``, a lone ``</think>``) is stripped by
  :func:`bumblebot.core.textrules.strip_reasoning`, and reasoning fields
  (``reasoning_content``) are never read: none of it reaches the user.
* A tool call the server sent without an id gets one (:func:`new_call_id`); one without a
  name is dropped.
* What the request used is read as the endpoint reports it, from a whole answer's ``usage`` or
  a stream's last chunk (:func:`usage_counts`): prompt and completion tokens, the cached prompt
  tokens and the reasoning tokens.
* A lone surrogate (a ``"\\ud800"`` escape in the server's JSON) becomes U+FFFD in the text
  and in the calls' arguments: nothing the model wrote can then fail a write to the store or
  the next request's encoding.
* Errors are translated here, once (:func:`translate`): :class:`~bumblebot.core.errors.ModelTimeout`,
  :class:`~bumblebot.core.errors.ContextTooLong` (with the prompt's size and the window when
  the endpoint tells them), :class:`~bumblebot.core.errors.ModelUnavailable` for what may pass (unreachable,
  408/409/429, 5xx; with the ``Retry-After`` delay) and :class:`~bumblebot.core.errors.ModelError`
  for the rest.
"""

from __future__ import annotations

import email.utils
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import openai

from bumblebot.core.errors import ContextTooLong, ModelError, ModelTimeout, ModelUnavailable
from bumblebot.core.events import storable_text
from bumblebot.core.messages import storable_arguments
from bumblebot.core.textrules import strip_reasoning
from bumblebot.core.usage import Usage
from bumblebot.llm.pace import Cut
from bumblebot.llm.window import window_in_refusal

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


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One tool call the model asked for. ``arguments`` is the raw JSON text; ``index`` is its
    position in a streamed completion (what a :data:`~bumblebot.llm.stream.SayListener` was
    told), else ``None``."""

    id: str
    name: str
    arguments: str
    index: int | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "arguments", storable_arguments(self.arguments))

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
        endpoint: the base URL of the endpoint that answered (set by
            :class:`~bumblebot.llm.failover.Endpoints`), ``None`` when not told.
        model: the model that answered there.
        cached_tokens: prompt tokens served from the endpoint's prompt cache
            (``usage.prompt_tokens_details.cached_tokens``), ``None`` when not reported.
        reasoning_tokens: completion tokens spent reasoning
            (``usage.completion_tokens_details.reasoning_tokens``), ``None`` when not reported.
        usage: what the request used as the model client recorded it (reported or estimated),
            set by ``LLM.complete``.
        cost: what it cost at ``llm.prices``, ``None`` when the model has no price.
        scale_sample: its ``prompt_tokens`` measure the request as it was estimated; ``False``
            when its images were left out or read as text (the prompt sent is not the one
            estimated): its usage is recorded as reported, but it teaches the token scale
            nothing (:attr:`sample_tokens`).
        cut: the client cut the request at its budget (:mod:`bumblebot.llm.pace`): its
            ``finish_reason`` is ``length``, and it holds what was written until then.
    """

    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str = "stop"
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    tool_choice: str | None = None
    streamed: bool = False
    endpoint: str | None = None
    model: str | None = None
    cached_tokens: int | None = None
    reasoning_tokens: int | None = None
    usage: Usage | None = None
    cost: float | None = None
    scale_sample: bool = True
    cut: Cut | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "content", storable_text(self.content))

    @property
    def sample_tokens(self) -> int | None:
        """``prompt_tokens`` as a sample of the token scale, ``None`` when it is not one."""
        return self.prompt_tokens if self.scale_sample else None

    @property
    def hit_length(self) -> bool:
        return self.finish_reason in LENGTH_FINISHES


def new_call_id() -> str:
    """An id for a tool call the server sent without one."""
    return f"call_{uuid.uuid4().hex[:12]}"


def int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) else None


def _field(holder: Any, name: str) -> Any:
    """``holder[name]`` of a streamed chunk's dict, or ``holder.name`` of a typed answer."""
    return holder.get(name) if isinstance(holder, dict) else getattr(holder, name, None)


def usage_counts(usage: Any) -> dict[str, int | None]:
    """The token counts of an answer's ``usage`` (a typed object, or a streamed chunk's dict) as
    :class:`Completion` fields: prompt and completion tokens, the cached prompt tokens
    (``prompt_tokens_details.cached_tokens``; DeepSeek's ``prompt_cache_hit_tokens``) and the
    reasoning tokens (``completion_tokens_details.reasoning_tokens``); ``None`` for each one
    not reported."""
    cached = int_or_none(_field(_field(usage, "prompt_tokens_details"), "cached_tokens"))
    return {
        "prompt_tokens": int_or_none(_field(usage, "prompt_tokens")),
        "completion_tokens": int_or_none(_field(usage, "completion_tokens")),
        "cached_tokens": cached if cached is not None else int_or_none(_field(usage, "prompt_cache_hit_tokens")),
        "reasoning_tokens": int_or_none(_field(_field(usage, "completion_tokens_details"), "reasoning_tokens")),
    }


def normalise(response: Any, choice: str | None) -> Completion:
    """A whole (unstreamed) answer as a :class:`Completion`, asked with tool_choice ``choice``.

    Raises:
        ModelError: the answer holds no choices.
    """
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
                id=call.id or new_call_id(),
                name=fn.name,
                arguments=fn.arguments or "{}",
            )
        )
    return Completion(
        content=strip_reasoning(message.content or ""),
        tool_calls=calls,
        finish_reason=first.finish_reason or "stop",
        tool_choice=choice,
        **usage_counts(getattr(response, "usage", None)),
    )


def is_context_error(exc: openai.APIError) -> bool:
    """Whether an endpoint's error says the prompt is over the model's context window."""
    return bool(_CONTEXT_RE.search(str(exc.message)))


#: The parameters every chat request may carry; any other (``reasoning_effort``, an
#: ``extra_body`` key) is optional, and an error that names one is about it.
BASIC_PARAMS = frozenset({"model", "messages", "max_tokens", "temperature", "tools", "tool_choice", "stream",
                          "stream_options"})


def names_optional_param(exc: openai.APIError, params: dict[str, Any]) -> bool:
    """Whether an endpoint's error names an optional parameter the request sent (by its key:
    "Unrecognized request argument supplied: reasoning_effort"), so that it is about that
    parameter, not about streaming or tool forcing."""
    message = str(exc.message)
    return any(key in message for key in params if key not in BASIC_PARAMS)


def translate(
    exc: openai.APIError, *, base_url: str, timeout_s: float, clock: Callable[[], float]
) -> ModelError:
    """The model error an ``openai`` error means (the caller chains it with ``from``).

    Args:
        exc: what the ``openai`` client raised.
        base_url: the endpoint, named when it cannot be reached.
        timeout_s: ``llm.timeout_s``, named in a timeout.
        clock: the wall clock, epoch seconds (an HTTP-date ``Retry-After`` is read against it).
    """
    if isinstance(exc, openai.APITimeoutError):
        return ModelTimeout(f"the model endpoint did not answer within {timeout_s:g} s")
    if isinstance(exc, openai.APIStatusError):
        if exc.status_code in (400, 413) and is_context_error(exc):
            counted = _PROMPT_COUNT_RE.search(str(exc.message))
            body = exc.body.get("error", exc.body) if isinstance(exc.body, dict) else {}
            # llama.cpp server: {"error": {"type": "exceed_context_size_error", "n_prompt_tokens": N, ...}}
            n_prompt = int_or_none(body.get("n_prompt_tokens")) if isinstance(body, dict) else None
            return ContextTooLong(
                f"the prompt is too long for the model: {exc.message}", status=exc.status_code,
                prompt_tokens=int(counted.group(1)) if counted else n_prompt,
                window=window_in_refusal(str(exc.message), exc.body),
            )
        if exc.status_code in TRANSIENT_STATUSES or exc.status_code >= 500:
            return ModelUnavailable(
                f"model endpoint error {exc.status_code}: {exc.message}", status=exc.status_code,
                retry_after=retry_after_s(exc.response.headers.get("retry-after"), clock()),
            )
        return ModelError(f"model endpoint error {exc.status_code}: {exc.message}", status=exc.status_code)
    if isinstance(exc, openai.APIConnectionError):
        return ModelUnavailable(f"cannot reach the model endpoint at {base_url}: {exc.message}")
    return ModelError(f"model endpoint error: {exc}")


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
