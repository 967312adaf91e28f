"""Failover between endpoints: :class:`Endpoints`, the primary endpoint (``llm``) and its
fallbacks (``llm.fallbacks``) used as one model client.

Each endpoint is one :class:`~bumblebot.llm.client.LLM`, with its own capabilities learned and
remembered (keyed by its base URL) and its own request limiter. A request goes to the first
endpoint that is not cooling down; when that one cannot answer for now
(:class:`~bumblebot.core.errors.ModelUnavailable`: a 429, a 5xx, a timeout, unreachable), the
same request goes to the next. The endpoint that failed cools down for its ``Retry-After`` (at
most :data:`MAX_COOLDOWN_S`), else for a backoff of :data:`BACKOFF_FIRST_S` doubling with each
failure in a row up to :data:`BACKOFF_MAX_S`; after it, it is tried first again (the primary
before the fallbacks). When every endpoint failed or is cooling down, the request raises
:class:`~bumblebot.core.errors.ModelUnavailable` with the shortest cooldown left as its
``retry_after``: the turn waits out an outage as it does with one endpoint (one notice, the
answer when an endpoint is back).

* A request's model is mapped per endpoint: the primary's reflex model to a fallback's
  ``reflex_model`` (else its ``model``), any other model (``llm.model``,
  ``llm.background_model``) to its ``model``.
* A streamed request that failed after its ``say`` text was shown is not sent elsewhere: the
  error goes up (the turn's retry takes the shown text over, as after any stream broken off);
  the endpoint still cools down, so the retry goes to the next one.
* With fallbacks, every endpoint but the last is built with ``max_retries: 0``: failing over is
  its retry (the client's own retries would hold a request for seconds of backoff on a 429 or
  5xx). The last one keeps its ``max_retries``.
* With no fallback, requests go to the primary as they are: no cooldown (the turn's outage
  backoff is the only wait).

The :class:`~bumblebot.llm.completion.Completion` says which endpoint and model answered
(``endpoint``, ``model``): each step of a turn's trace records them.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from bumblebot.core.errors import ModelUnavailable
from bumblebot.core.metrics import Metrics
from bumblebot.core.settings import FallbackSettings, LLMSettings
from bumblebot.core.usage import Meter
from bumblebot.llm.capabilities import CapabilityMemory, duration
from bumblebot.llm.client import LLM
from bumblebot.llm.completion import Completion
from bumblebot.llm.forcing import ForcingFallback
from bumblebot.llm.stream import SayListener
from bumblebot.llm.window import Windows

log = logging.getLogger(__name__)

#: The first cooldown of an endpoint that failed without a ``Retry-After``, seconds; it doubles
#: with each failure in a row.
BACKOFF_FIRST_S = 10.0
#: The longest backoff, seconds.
BACKOFF_MAX_S = 300.0
#: A ``Retry-After`` is honoured up to this many seconds (as the turn's outage wait honours it).
MAX_COOLDOWN_S = 300.0


@dataclasses.dataclass(slots=True)
class _Health:
    """How an endpoint has been answering: cooling down until ``until`` (the clock's seconds),
    after ``failures`` failures in a row."""

    until: float = 0.0
    failures: int = 0


class _Heard:
    """A say listener that notes whether it heard anything (text was shown)."""

    def __init__(self, listener: SayListener) -> None:
        self.listener = listener
        self.said = False

    def __call__(self, index: int, text: str) -> None:
        self.said = True
        self.listener(index, text)


class Endpoints:
    """The primary endpoint and its fallbacks, used as one; the surface of
    :class:`~bumblebot.llm.client.LLM` that the rest of Bumblebot uses.

    Args:
        primary: the ``llm`` endpoint.
        fallbacks: the ``llm.fallbacks`` endpoints, in order.
        background_model: ``llm.background_model`` (on the primary), ``None``: none.
        clock: monotonic seconds, for cooldowns (tests inject one).
        backoff_first_s: the first cooldown without a ``Retry-After``.
        backoff_max_s: the longest one.
    """

    def __init__(
        self,
        primary: LLM,
        fallbacks: Sequence[LLM] = (),
        *,
        background_model: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        backoff_first_s: float = BACKOFF_FIRST_S,
        backoff_max_s: float = BACKOFF_MAX_S,
    ) -> None:
        self.primary = primary
        #: every endpoint, the primary first
        self.all: list[LLM] = [primary, *fallbacks]
        self.background_model = background_model
        self.backoff_first_s = backoff_first_s
        self.backoff_max_s = backoff_max_s
        self.clock = clock
        self._health = [_Health() for _ in self.all]

    # -- the primary's face -------------------------------------------------------------------------

    @property
    def settings(self) -> LLMSettings:
        return self.primary.settings

    @property
    def base_url(self) -> str:
        return self.primary.base_url

    @property
    def model(self) -> str:
        return self.primary.model

    @property
    def reflex_model(self) -> str:
        return self.primary.reflex_model

    @property
    def capabilities(self) -> CapabilityMemory:
        return self.primary.capabilities

    @property
    def meter(self) -> Meter:
        return self.primary.meter

    @property
    def windows(self) -> Windows:
        """The primary's context windows: the budget is sized by them (a fallback needs at least
        the primary's window, ``docs/models.md``)."""
        return self.primary.windows

    async def aclose(self) -> None:
        for llm in self.all:
            await llm.aclose()

    # -- which endpoint ---------------------------------------------------------------------------

    def model_on(self, llm: LLM, model: str | None = None) -> str:
        """The model asked of ``llm`` for a request for ``model`` (default ``llm.model``)."""
        model = model or self.primary.model
        if llm is self.primary:
            return model
        primary = self.primary
        if model == primary.reflex_model and primary.reflex_model != primary.model:
            return llm.reflex_model
        return llm.model

    def cooling(self, llm: LLM) -> float:
        """Seconds before ``llm`` is tried again (0: it is not cooling down)."""
        return max(0.0, self._health[self.all.index(llm)].until - self.clock())

    def current(self) -> LLM:
        """The endpoint the next request goes to first: the first not cooling down (the
        primary when all are)."""
        now = self.clock()
        return next((llm for llm, h in zip(self.all, self._health, strict=True) if h.until <= now), self.primary)

    async def sees_images(self, model: str | None = None) -> bool:
        """Whether requests to ``model`` carry images (:meth:`LLM.sees_images`), on the endpoint
        that would answer now."""
        llm = self.current()
        return await llm.sees_images(self.model_on(llm, model))

    async def vision_refusal(self, model: str | None = None) -> str | None:
        llm = self.current()
        return await llm.vision_refusal(self.model_on(llm, model))

    async def thinks(self, model: str | None = None) -> bool:
        llm = self.current()
        return await llm.thinks(self.model_on(llm, model))

    async def thinking_refusal(self, model: str | None = None) -> str | None:
        llm = self.current()
        return await llm.thinking_refusal(self.model_on(llm, model))

    async def streams(self) -> bool:
        return await self.current().streams()

    async def stream_fallback(self) -> str | None:
        return await self.current().stream_fallback()

    async def forcing_fallback(self) -> ForcingFallback | None:
        return await self.current().forcing_fallback()

    # -- completions ------------------------------------------------------------------------------

    async def text(
        self, messages: list[dict[str, Any]], *, model: str | None = None, max_tokens: int, temperature: float
    ) -> str:
        """A tool-less completion returning its visible text (classifier, judges, summaries)."""
        completion = await self.complete(
            messages, model=model or self.reflex_model, max_tokens=max_tokens, temperature=temperature
        )
        return completion.content

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
        """One chat completion (:meth:`LLM.complete`), from the first endpoint that answers.

        Raises:
            ModelUnavailable: every endpoint failed or is cooling down (``retry_after``: the
                shortest cooldown left), or a streamed answer failed after text was shown.
            ContextTooLong, SpendingLimitReached, ModelError: as :meth:`LLM.complete`, from the
                endpoint that was asked (not failed over: the next would say the same).
        """
        kwargs: dict[str, Any] = dict(max_tokens=max_tokens, temperature=temperature, tools=tools, thinking=thinking)
        if len(self.all) == 1:
            asked = self.model_on(self.primary, model)
            completion = await self.primary.complete(messages, model=asked, on_say=on_say, **kwargs)
            return dataclasses.replace(completion, endpoint=self.primary.base_url, model=asked)
        last: ModelUnavailable | None = None
        for index in self._ready():
            llm = self.all[index]
            asked = self.model_on(llm, model)
            heard = _Heard(on_say) if on_say is not None else None
            try:
                completion = await llm.complete(messages, model=asked, on_say=heard, **kwargs)
            except ModelUnavailable as exc:
                self._failed(index, exc)
                if heard is not None and heard.said:
                    raise  # text of it was shown: the turn's retry takes it over
                last = exc
                continue
            self._answered(index)
            return dataclasses.replace(completion, endpoint=llm.base_url, model=asked)
        raise self._all_down(last)

    def _ready(self) -> list[int]:
        """The endpoints not cooling down, in order."""
        now = self.clock()
        return [i for i, h in enumerate(self._health) if h.until <= now]

    def _failed(self, index: int, exc: ModelUnavailable) -> None:
        """Endpoint ``index`` could not answer: it cools down (a failure while it already does,
        of a request sent before, does not count again)."""
        health, now = self._health[index], self.clock()
        if health.until <= now:
            health.failures += 1
        backoff = min(self.backoff_max_s, self.backoff_first_s * 2 ** (health.failures - 1))
        wait = backoff if exc.retry_after is None else min(exc.retry_after, MAX_COOLDOWN_S)
        health.until = max(health.until, now + wait)
        others = [llm.base_url for i, llm in enumerate(self.all) if i != index and self._health[i].until <= now]
        log.warning(
            "endpoint %s failed (%s); %s; tried again in %s", self.all[index].base_url, exc,
            f"{others[0]} takes its requests" if others else "no other endpoint is answering", duration(wait),
        )

    def _answered(self, index: int) -> None:
        health = self._health[index]
        if health.failures:
            log.info("endpoint %s answers again", self.all[index].base_url)
        health.failures, health.until = 0, 0.0

    def _all_down(self, last: ModelUnavailable | None) -> ModelUnavailable:
        """The error of a request no endpoint answered: the last failure's, with the shortest
        cooldown left as its ``retry_after``."""
        now = self.clock()
        wait = min(max(0.0, h.until - now) for h in self._health)
        if last is None:
            return ModelUnavailable(f"no model endpoint is answering; the first is tried again in {duration(wait)}",
                                    retry_after=wait)
        last.retry_after = wait
        return last


def fallback_settings(primary: LLMSettings, fallback: FallbackSettings) -> LLMSettings:
    """A fallback's own ``llm`` settings: what it sets, else the primary's (its models and
    key are its own)."""
    values = primary.model_dump()
    values.update(fallback.model_dump(exclude_none=True, exclude={"base_url", "api_key_env"}))
    values.update(
        base_url=fallback.base_url, model=fallback.model or primary.model, reflex_model=fallback.reflex_model,
        background_model=None, fallbacks=[],
    )
    return LLMSettings.model_validate(values)


def build_endpoints(
    settings: LLMSettings,
    *,
    base_url: str,
    api_key: str | None,
    key_of: Callable[[str], str | None],
    capabilities: CapabilityMemory | None = None,
    metrics: Metrics | None = None,
    meter: Meter | None = None,
) -> Endpoints:
    """The primary endpoint and its fallbacks as :class:`Endpoints`.

    Args:
        settings: the ``llm`` section.
        base_url: the primary's effective base URL.
        api_key: the primary's key (``OPENAI_API_KEY``).
        key_of: a fallback's key by its ``api_key_env`` name (the environment, then ``.env``).
        capabilities, metrics, meter: shared by every endpoint (:class:`LLM`).
    """
    shared: dict[str, Any] = dict(capabilities=capabilities or CapabilityMemory(), metrics=metrics, meter=meter)
    configs: list[tuple[LLMSettings, str, str | None]] = [(settings, base_url, api_key)]
    for number, fallback in enumerate(settings.fallbacks):
        key = key_of(fallback.api_key_env) if fallback.api_key_env else None
        if fallback.api_key_env and key is None:
            log.warning("llm.fallbacks[%d].api_key_env: %s is not set (environment or .env); it is sent no key",
                        number, fallback.api_key_env)
        configs.append((fallback_settings(settings, fallback), str(fallback.base_url), key))
    llms = []
    for position, (own_settings, url, key) in enumerate(configs):
        if position < len(configs) - 1:  # the next endpoint is its retry
            own_settings = own_settings.model_copy(update={"max_retries": 0})
        llms.append(LLM(own_settings, base_url=url, api_key=key, **shared))
    return Endpoints(llms[0], llms[1:], background_model=settings.background_model)
