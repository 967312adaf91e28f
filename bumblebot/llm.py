"""The chat-completions client: the only module that imports ``openai``.

Endpoints differ, and Bumblebot must work with all of them (OpenAI, Ollama, llama.cpp
server, vLLM, OpenRouter):

* ``tool_choice="required"`` is rejected by some local servers (HTTP 400/422/500). Such a
  request is retried at once with ``"auto"``. When the refusal clearly concerns forcing (its
  message names tools or tool_choice), or an unexplained one repeats on consecutive requests,
  the endpoint (by base URL) is switched to ``"auto"``; the choice is remembered in the
  store's ``kv`` table so it survives restarts.
* Assistant messages are always sent with ``content: ""``, never ``null``.
* Reasoning text (``<think>…</think>`` in content, ``reasoning_content`` fields) is stripped
  and never reaches the user.

Errors are translated here, once: :class:`~bumblebot.errors.ModelTimeout`,
:class:`~bumblebot.errors.ContextTooLong` and :class:`~bumblebot.errors.ModelError`.
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import openai
from openai.types.chat import ChatCompletion

from bumblebot.config import LLMSettings
from bumblebot.errors import ContextTooLong, ModelError, ModelTimeout, ModelUnavailable

log = logging.getLogger(__name__)

_THINK_CLOSED = re.compile(r"<(think|thinking|reasoning)>.*?</\1>", re.DOTALL | re.IGNORECASE)
_THINK_LEADING_OPEN = re.compile(r"^\s*<(think|thinking|reasoning)>.*\Z", re.DOTALL | re.IGNORECASE)
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
_TOOLS_RE = re.compile(r"tool|function.?call", re.IGNORECASE)
#: Consecutive unexplained refusals of ``tool_choice="required"`` before ``"auto"`` is remembered.
FORCING_STRIKES = 2


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One tool call the model asked for. ``arguments`` is the raw JSON text."""

    id: str
    name: str
    arguments: str

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

    @property
    def hit_length(self) -> bool:
        return self.finish_reason in LENGTH_FINISHES


def strip_reasoning(text: str) -> str:
    """Remove ``<think>``-style reasoning: closed blocks anywhere, and an unclosed block only
    when the text starts with it (a model cut off mid-thought). A tag merely mentioned in the
    middle of a reply ("write a <thinking> tag") is left alone."""
    text = _THINK_CLOSED.sub("", text or "")
    return _THINK_LEADING_OPEN.sub("", text).strip()


class CapabilityMemory:
    """Where per-endpoint capabilities are remembered (the store's ``kv`` in production)."""

    def __init__(
        self,
        load: Callable[[str], Awaitable[str | None]] | None = None,
        save: Callable[[str, str], Awaitable[None]] | None = None,
    ) -> None:
        self._load, self._save = load, save
        self._cache: dict[str, str | None] = {}

    async def get(self, key: str) -> str | None:
        if key not in self._cache:
            self._cache[key] = await self._load(key) if self._load else None
        return self._cache[key]

    async def set(self, key: str, value: str) -> None:
        self._cache[key] = value
        if self._save:
            await self._save(key, value)


class LLM:
    """Chat completions against one OpenAI-compatible endpoint.

    Args:
        settings: the ``llm`` config section.
        base_url: the effective base URL (config, else ``OPENAI_BASE_URL``, else OpenAI's).
        api_key: the key; local servers accept any non-empty value.
        capabilities: where tool_choice fallbacks are remembered.
    """

    def __init__(
        self,
        settings: LLMSettings,
        *,
        base_url: str,
        api_key: str | None,
        capabilities: CapabilityMemory | None = None,
    ) -> None:
        self.settings = settings
        self.base_url = base_url
        self._client = openai.AsyncOpenAI(
            base_url=base_url,
            api_key=api_key or "not-needed",
            timeout=settings.timeout_s,
            max_retries=settings.max_retries,
        )
        self.capabilities = capabilities or CapabilityMemory()
        self._forcing_strikes = 0

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
        if t.mode == "reasoning_effort":
            return {"reasoning_effort": t.reasoning_effort} if thinking else {}
        if t.mode == "extra_body":
            return dict(t.extra_body_on if thinking else t.extra_body_off)
        return {}

    def _tool_choice_key(self) -> str:
        return f"llm.tool_choice:{self.base_url}"

    async def complete(
        self,
        messages: list[dict[str, Any]],
        *,
        model: str | None = None,
        max_tokens: int,
        temperature: float | None = None,
        tools: list[dict[str, Any]] | None = None,
        thinking: bool = False,
    ) -> Completion:
        """One chat completion.

        Args:
            messages: OpenAI-form messages (assistant ``content`` must not be ``None``).
            model: defaults to ``llm.model``.
            max_tokens: completion budget, tokens.
            temperature: defaults to ``llm.temperature``.
            tools: tool schemas; when given, tool forcing applies (``llm.tool_choice`` or the
                remembered fallback).
            thinking: request thinking (per ``llm.thinking``); reasoning is always stripped.

        Raises:
            ModelTimeout: no answer within ``llm.timeout_s`` (after the client's retries).
            ModelUnavailable: unreachable, rate-limited or a server error (after the retries).
            ContextTooLong: the endpoint says the prompt is over its context window.
            ModelError: any other failure, with the HTTP status when there was one.
        """
        model = model or self.settings.model
        params: dict[str, Any] = {
            "model": model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": self.settings.temperature if temperature is None else temperature,
            **self._thinking_params(thinking),
        }
        choice: str | None = None
        if tools:
            remembered = await self.capabilities.get(self._tool_choice_key())
            choice = remembered or self.settings.tool_choice
            params["tools"] = tools
            params["tool_choice"] = choice
        try:
            response = await self._create(params)
        except openai.APIStatusError as exc:
            if choice != "required" or exc.status_code not in (400, 422, 500):
                raise self._translate(exc) from exc
            if self._is_context_error(exc):
                raise self._translate(exc) from exc
            log.warning(
                "endpoint %s refused a request with tool_choice=required (HTTP %s); retrying with 'auto'",
                self.base_url, exc.status_code,
            )
            params["tool_choice"] = choice = "auto"
            try:
                response = await self._create(params)
            except openai.APIError as exc2:
                raise self._translate(exc2) from exc2
            await self._note_forcing_refused(exc)
        except openai.APIError as exc:
            raise self._translate(exc) from exc
        else:
            if choice == "required":
                self._forcing_strikes = 0
        return self._normalise(response, choice)

    async def _note_forcing_refused(self, exc: openai.APIStatusError) -> None:
        """Remember ``"auto"`` for this endpoint once the refusal is clearly about forcing.

        An error that names tools/tool_choice counts at once; an unexplained 400/422/500 that
        ``"auto"`` then survives counts only when it happens on consecutive requests
        (:data:`FORCING_STRIKES`), so one upstream hiccup never turns tool forcing off for good.
        """
        about_tools = bool(_TOOLS_RE.search(str(exc.message)))
        self._forcing_strikes += 1
        if about_tools or self._forcing_strikes >= FORCING_STRIKES:
            await self.capabilities.set(self._tool_choice_key(), "auto")
            log.warning("endpoint %s does not support tool_choice=required; using 'auto' from now on", self.base_url)

    async def text(
        self, messages: list[dict[str, Any]], *, model: str | None = None, max_tokens: int, temperature: float
    ) -> str:
        """A tool-less completion returning its visible text (classifier, judges, summaries)."""
        completion = await self.complete(
            messages, model=model or self.reflex_model, max_tokens=max_tokens, temperature=temperature
        )
        return completion.content

    async def _create(self, params: dict[str, Any]) -> ChatCompletion:
        # The request is already in wire form; ``client.post`` sends it as is. The typed
        # ``chat.completions.create`` re-walks every message and tool schema through the SDK's
        # TypedDict transformer, which cost ~18 ms of CPU per step here (bench/bench_turn.py).
        return await self._client.post("/chat/completions", cast_to=ChatCompletion, body=params)

    @staticmethod
    def _is_context_error(exc: openai.APIStatusError) -> bool:
        return bool(_CONTEXT_RE.search(str(exc.message)))

    def _translate(self, exc: openai.APIError) -> ModelError:
        if isinstance(exc, openai.APITimeoutError):
            return ModelTimeout(f"the model endpoint did not answer within {self.settings.timeout_s:g} s")
        if isinstance(exc, openai.APIStatusError):
            if exc.status_code in (400, 413) and self._is_context_error(exc):
                return ContextTooLong(f"the prompt is too long for the model: {exc.message}", status=exc.status_code)
            if exc.status_code in TRANSIENT_STATUSES or exc.status_code >= 500:
                return ModelUnavailable(f"model endpoint error {exc.status_code}: {exc.message}", status=exc.status_code)
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
