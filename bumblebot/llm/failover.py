"""Failover between endpoints: :class:`Endpoints`, the primary endpoint (``llm``) and its
fallbacks (``llm.fallbacks``) used as one model client.

Each endpoint is one :class:`~bumblebot.llm.client.LLM`, with its own capabilities learned and
remembered (keyed by its base URL, and its model too when an endpoint before it has the same
URL: :func:`memory_keys`) and its own request limiter. A request goes to the first endpoint
that is not cooling down; when that one cannot answer it, the same request goes to the next:

* it cannot answer for now (:class:`~bumblebot.core.errors.ModelUnavailable`: a 429, a 5xx, a
  timeout, unreachable);
* or it refused its own configuration, not the request (:func:`refuses_configuration`: a 401,
  402, 403 or 404, or a 400 saying the model does not exist): a wrong or missing key, a model
  it does not serve. That is logged as an error, once per cooldown.

The endpoint that failed cools down for its ``Retry-After`` (more than 0, at most
:data:`MAX_COOLDOWN_S`), else for a backoff of :data:`BACKOFF_FIRST_S` doubling with each
failure in a row up to :data:`BACKOFF_MAX_S`. Only a request sent after a failure counts: the
failure or answer of one sent before it (still on its way) neither doubles the cooldown nor
ends it. Once its cooldown is over an endpoint is tried first again (the primary before the
fallbacks), by one trial request at a time: the others go on to the next endpoint (or wait for
the trial's answer when there is none) until the trial is answered.

When every endpoint is cooling down, a request tries them anyway, the soonest cooldown end
first (each by one trial at a time), except those whose cooldown is their own ``Retry-After``:
then the turn's outage retries (at most every 60 s) pace the requests, as with one endpoint,
and an endpoint back is noticed at the next of them. A request no endpoint answered raises
:class:`~bumblebot.core.errors.ModelUnavailable` (its ``retry_after``: the shortest cooldown
left when every endpoint cools down for its ``Retry-After``, else none): the turn waits out
an outage as it does with one endpoint (one notice, the answer when an endpoint is back). When
every endpoint refused its configuration, the first refusal is raised, as with one endpoint
(the turn fails with it).

* A request's model is mapped per endpoint: the primary's reflex model to a fallback's
  ``reflex_model`` (else its ``model``), any other model (``llm.model``,
  ``llm.background_model``) to its ``model``.
* A streamed request that failed after its ``say`` text was shown is not sent elsewhere: the
  error goes up (the turn's retry takes the shown text over, as after any stream broken off);
  the endpoint still cools down, so the retry goes to the next one, at once and with no outage
  notice when one is ready (:meth:`Endpoints.standing_by`).
* With fallbacks, every endpoint but the last is built with ``max_retries: 0``: failing over is
  its retry (the client's own retries would hold a request for seconds of backoff on a 429 or
  5xx), and a streamed request it fails with a 5xx is not sent to it again whole
  (:class:`~bumblebot.llm.stream.StreamedRequests`): a step costs a failing endpoint at most two
  requests (with tool forcing's ``"auto"`` one) before the next answers. The last one keeps
  its ``max_retries``.
* With no fallback, requests go to the primary as they are: no cooldown (the turn's outage
  backoff is the only wait).
* An endpoint without a key (no ``api_key_env``, or its variable unset) is sent the placeholder
  key ``not-needed``, as the primary is without ``OPENAI_API_KEY`` (the ``openai`` client sends
  a key always; local servers ignore it).

The :class:`~bumblebot.llm.completion.Completion` says which endpoint and model answered
(``endpoint``, ``model``): each step of a turn's trace records them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

from bumblebot.core.errors import ContextTooLong, ModelError, ModelUnavailable, SpendingLimitReached
from bumblebot.core.metrics import Metrics
from bumblebot.core.settings import FallbackSettings, LLMSettings
from bumblebot.core.usage import Meter
from bumblebot.llm.capabilities import CapabilityMemory, duration, endpoint_key
from bumblebot.llm.client import LLM
from bumblebot.llm.completion import Completion
from bumblebot.llm.forcing import ForcingFallback
from bumblebot.llm.stream import SayListener
from bumblebot.llm.window import WindowSet

log = logging.getLogger(__name__)

#: The first cooldown of an endpoint that failed without a ``Retry-After``, seconds; it doubles
#: with each failure in a row.
BACKOFF_FIRST_S = 10.0
#: The longest backoff, seconds.
BACKOFF_MAX_S = 300.0
#: A ``Retry-After`` is honoured up to this many seconds (as the turn's outage wait honours it).
MAX_COOLDOWN_S = 300.0
#: The statuses of an endpoint refusing its own configuration: the key (401, 403), the account
#: (402: no credit left), the model or the URL (404).
CONFIGURATION_STATUSES = frozenset({401, 402, 403, 404})
#: A 400 or 422 saying the model asked for does not exist (OpenRouter: "x is not a valid model
#: ID"; others: "model not found", "The model `x` does not exist", "unknown model").
_NO_SUCH_MODEL = re.compile(
    r"\bmodel\b[^.]*\b(not found|does not exist|not available)|\b(not a valid|invalid|unknown|no such) model\b",
    re.IGNORECASE,
)
_OUR_PREFIX = re.compile(r"^model endpoint error \d+: (?:Error code: \d+ - )?")  # translate()'s, the client's


def refuses_configuration(exc: ModelError) -> bool:
    """Whether ``exc`` is an endpoint refusing its own configuration (its key, account, model or
    URL) rather than the request: the next endpoint may well answer it."""
    if isinstance(exc, (ModelUnavailable, ContextTooLong, SpendingLimitReached)):
        return False
    if exc.status in CONFIGURATION_STATUSES:
        return True
    return exc.status in (400, 422) and _NO_SUCH_MODEL.search(_OUR_PREFIX.sub("", str(exc))) is not None


@dataclasses.dataclass(slots=True)
class _Health:
    """How an endpoint has been answering: cooling down until ``until`` (the clock's seconds),
    after ``failures`` failures in a row, the last when ``sent_before`` requests had been sent
    (the answers of those are older than it)."""

    until: float = 0.0
    failures: int = 0
    sent_before: int = 0
    #: the cooldown is the endpoint's own ``Retry-After``
    told: bool = False
    #: the cooldown follows a refusal of the endpoint's configuration
    refused: bool = False
    #: a trial request is on its way (it came out of its cooldown): set when it is answered
    trial: asyncio.Event | None = None


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
        self._sent = 0  # requests sent so far, to all endpoints

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
    def windows(self) -> WindowSet:
        """The context windows of every endpoint, for the models each is asked for (the
        primary's ``model``, ``reflex_model`` and ``background_model``; what a fallback is
        asked instead): the budget is sized by the smallest (``docs/models.md``)."""
        primary = [self.primary.model, self.primary.reflex_model]
        primary += [self.background_model] if self.background_model else []
        return WindowSet([(llm.windows, [self.model_on(llm, model) for model in primary]) for llm in self.all])

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

    def _open(self, health: _Health, now: float) -> bool:
        """Whether a request may go to the endpoint of ``health`` now: not cooling down, and no
        trial request of it on its way."""
        return health.until <= now and health.trial is None

    def current(self) -> LLM:
        """The endpoint the next request goes to first: the first that is not cooling down nor
        waiting for a trial's answer (the primary when none is)."""
        now = self.clock()
        return next((llm for llm, h in zip(self.all, self._health, strict=True) if self._open(h, now)), self.primary)

    def standing_by(self) -> bool:
        """Whether a request sent now goes straight to an endpoint that is not cooling down: a
        turn whose request failed is retried at once then, with no outage notice. With one
        endpoint, never (nothing cools down: the turn's outage backoff is its wait)."""
        now = self.clock()
        return len(self.all) > 1 and any(self._open(h, now) for h in self._health)

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
        call: str | None = None,
    ) -> Completion:
        """One chat completion (:meth:`LLM.complete`), from the first endpoint that answers.

        Raises:
            ModelUnavailable: no endpoint answered (``retry_after``: the shortest cooldown left
                when each is its endpoint's ``Retry-After``), or a streamed answer failed after
                text was shown.
            ContextTooLong, SpendingLimitReached, ModelError: as :meth:`LLM.complete`, from the
                endpoint that was asked (not failed over: the next would say the same); a
                refusal of its configuration only when every endpoint refused theirs.
        """
        kwargs: dict[str, Any] = dict(
            max_tokens=max_tokens, temperature=temperature, tools=tools, thinking=thinking, call=call
        )
        if len(self.all) == 1:
            asked = self.model_on(self.primary, model)
            completion = await self.primary.complete(messages, model=asked, on_say=on_say, **kwargs)
            return dataclasses.replace(completion, endpoint=self.primary.base_url, model=asked)
        tried: set[int] = set()
        failures: list[ModelError] = []
        while (picked := await self._next(tried)) is not None:
            index, trial = picked
            tried.add(index)
            llm = self.all[index]
            asked = self.model_on(llm, model)
            heard = _Heard(on_say) if on_say is not None else None
            answer = await self._ask(index, trial, messages, heard, model=asked, **kwargs)
            if isinstance(answer, Completion):
                return dataclasses.replace(answer, endpoint=llm.base_url, model=asked)
            failures.append(answer)
        raise self._all_down(failures)

    async def _next(self, tried: set[int]) -> tuple[int, asyncio.Event | None] | None:
        """The endpoint a request goes to next, of those it has not ``tried``, with the trial
        event it holds when it is that endpoint's trial request; ``None``: there is none.

        The first that is open (:meth:`_open`); else, while a trial is on its way, its answer is
        waited for (an endpoint whose trial failed counts as tried); else, every endpoint
        cooling down, the one whose cooldown ends first, but not one cooling down for its own
        ``Retry-After``."""
        while True:
            now = self.clock()
            pending: int | None = None
            for index, health in enumerate(self._health):
                if index in tried:
                    continue
                if health.trial is not None:
                    pending = index if pending is None else pending
                elif health.until <= now:
                    return index, self._trial(index) if health.failures else None
            if pending is not None:
                trial = self._health[pending].trial
                assert trial is not None
                await trial.wait()
                if self._health[pending].until > self.clock():
                    tried.add(pending)  # its trial failed: that answer stands for this request too
                continue
            cooling = [i for i, h in enumerate(self._health) if i not in tried and not h.told]
            if not cooling:
                return None
            first = min(cooling, key=lambda i: self._health[i].until)
            return first, self._trial(first)

    def _trial(self, index: int) -> asyncio.Event:
        trial = self._health[index].trial = asyncio.Event()
        return trial

    async def _ask(
        self, index: int, trial: asyncio.Event | None, messages: list[dict[str, Any]], heard: _Heard | None,
        **kwargs: Any,
    ) -> Completion | ModelError:
        """Send the request to endpoint ``index``: its completion, or the failure the request
        goes on from (the endpoint cools down); any other error goes up. ``trial``: the request
        is the endpoint's trial, set when it is answered."""
        self._sent += 1
        sent = self._sent
        try:
            completion = await self.all[index].complete(messages, on_say=heard, **kwargs)
        except SpendingLimitReached:
            raise  # nothing was sent
        except ModelUnavailable as exc:
            self._failed(index, exc, sent)
            if heard is not None and heard.said:
                raise  # text of it was shown: the turn's retry takes it over
            return exc
        except ModelError as exc:
            if not refuses_configuration(exc):
                self._answered(index, sent)  # it is there: the request is what it refused
                raise
            self._failed(index, exc, sent)
            return exc
        finally:
            if trial is not None:
                self._health[index].trial = None
                trial.set()
        self._answered(index, sent)
        return completion

    def _failed(self, index: int, exc: ModelError, sent: int) -> None:
        """Endpoint ``index`` could not answer request number ``sent``: it cools down. The
        failure of a request sent before its last failure (on its way meanwhile) does not count
        again."""
        health, now, url = self._health[index], self.clock(), self.all[index].base_url
        if sent <= health.sent_before:
            log.debug("endpoint %s failed again (%s), already cooling down", url, exc)
            return
        health.failures += 1
        health.sent_before = self._sent
        backoff = min(self.backoff_max_s, self.backoff_first_s * 2 ** (health.failures - 1))
        retry_after = exc.retry_after if isinstance(exc, ModelUnavailable) else None
        told = retry_after is not None and retry_after > 0  # "0" or a date gone by: no wait said
        wait = min(retry_after, MAX_COOLDOWN_S) if retry_after is not None and told else backoff
        health.until, health.told, health.refused = now + wait, told, not isinstance(exc, ModelUnavailable)
        others = [llm.base_url for i, llm in enumerate(self.all) if i != index and self._open(self._health[i], now)]
        then = f"{others[0]} takes its requests" if others else "no other endpoint is answering"
        if health.refused:
            log.error(
                "endpoint %s refused its configuration (%s): check its key, model and base URL (llm.base_url or "
                "llm.fallbacks); %s; tried again in %s", url, exc, then, duration(wait),
            )
        else:
            log.warning("endpoint %s failed (%s); %s; tried again in %s", url, exc, then, duration(wait))

    def _answered(self, index: int, sent: int) -> None:
        """Endpoint ``index`` answered request number ``sent``: its cooldown is over, unless the
        request was sent before its last failure."""
        health = self._health[index]
        if sent <= health.sent_before:
            return
        if health.failures:
            log.info("endpoint %s answers again", self.all[index].base_url)
        health.failures, health.until, health.told, health.refused = 0, 0.0, False, False

    def _all_down(self, failures: list[ModelError]) -> ModelError:
        """The error of a request no endpoint answered: the last failure that was an outage,
        with, as its ``retry_after``, the shortest cooldown left when every endpoint cools down
        for its own ``Retry-After`` (else none: the turn's outage backoff paces the next try);
        the first refusal when every endpoint refused its configuration."""
        now = self.clock()
        if failures and all(h.refused for h in self._health):
            return failures[0]
        wait = min(max(0.0, h.until - now) for h in self._health) if all(h.told for h in self._health) else None
        unavailable = [e for e in failures if isinstance(e, ModelUnavailable)]
        if not unavailable:
            again = f"; the first is tried again in {duration(wait)}" if wait is not None else ""
            return ModelUnavailable(f"no model endpoint is answering{again}", retry_after=wait)
        last = unavailable[-1]
        last.retry_after = wait
        return last


def memory_keys(endpoints: Sequence[tuple[str, str]]) -> list[str]:
    """Each endpoint's name in the keys of what it cannot do, for ``(base_url, model)`` in
    order (:func:`~bumblebot.llm.capabilities.endpoint_key`): its base URL, with its model when
    an endpoint before it has the same base URL."""
    seen: set[str] = set()
    keys = []
    for url, model in endpoints:
        keys.append(endpoint_key(url, model) if url.rstrip("/") in seen else url)
        seen.add(url.rstrip("/"))
    return keys


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
            log.error("llm.fallbacks[%d].api_key_env: %s is not set (environment or .env); the endpoint is sent "
                      "the placeholder key not-needed", number, fallback.api_key_env)
        configs.append((fallback_settings(settings, fallback), str(fallback.base_url), key))
    names = memory_keys([(url, own.model) for own, url, _ in configs])
    llms = []
    for position, ((own_settings, url, key), name) in enumerate(zip(configs, names, strict=True)):
        failover = position < len(configs) - 1  # the next endpoint is its retry
        if failover:
            own_settings = own_settings.model_copy(update={"max_retries": 0})
        llms.append(LLM(own_settings, base_url=url, api_key=key, memory_key=name, failover=failover, **shared))
    return Endpoints(llms[0], llms[1:], background_model=settings.background_model)
