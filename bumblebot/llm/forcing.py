"""Tool forcing: ``tool_choice="required"``, the fallback to ``"auto"``, and its re-try; and
the ``tool_choice`` that names the one tool to call (:class:`NamedChoice`).

``tool_choice="required"`` is rejected by some local servers (HTTP 400/422/500;
llama-cpp-python answers a 500 with no message). Such a request is sent without the client's own
retries, and a refusal is answered at once by the same request with ``"auto"``
(:class:`~bumblebot.llm.client.LLM`; which refusals qualify: :func:`may_refuse_forcing`). The
endpoint (by base URL) is switched to ``"auto"`` when the refusal clearly concerns forcing (its
message names tools or tool_choice), or when an endpoint never seen accepting forcing refuses it
without a reason, or when one that accepted it before refuses it on :data:`FORCING_STRIKES`
consecutive requests (a flaky upstream); the fallback, with its reason and time
(:class:`ForcingFallback`), is remembered in the store's ``kv`` table so it survives restarts.
So is an endpoint's first accepted ``"required"`` (``{"mode": "required", "since"}``). It is not for good: after
:data:`FORCING_RETRY_REQUESTS` tool requests or :data:`FORCING_RETRY_S` under the fallback,
whichever comes first, one tool request tries ``"required"`` again. Accepted: forcing is back and
the memory is cleared. Refused: that request is answered with ``"auto"`` as before and the timer
starts again (:class:`ToolForcing`).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from bumblebot.llm.capabilities import (
    CapabilityMemory,
    Refusals,
    duration,
    named_choice_key,
    refusal,
    tool_choice_key,
    utc,
)
from bumblebot.llm.completion import is_context_error, names_optional_param
from bumblebot.llm.images import has_images, names_images

if TYPE_CHECKING:
    import openai

log = logging.getLogger(__name__)

#: A refusal that names forcing itself: counts at once, whatever the status.
_CHOICE_RE = re.compile(r"tool.?choice", re.IGNORECASE)
#: A client error (400/422) that names tools: counts at once. A 500 naming tools does not
#: ("Failed to parse tool call arguments" is the model's output, not the endpoint's rule).
_TOOLS_RE = re.compile(r"tool|function.?call", re.IGNORECASE)
#: Consecutive unexplained refusals of ``tool_choice="required"``, by an endpoint that accepted
#: it before, before ``"auto"`` is remembered (one is enough from an endpoint never seen accepting it).
FORCING_STRIKES = 3
#: Tool requests answered under the ``"auto"`` fallback before ``"required"`` is tried again.
#: A refusing endpoint answers a retry with a fast 400, so this costs at most one extra
#: request in 50 (2 %); at a few steps per turn it is a retry every 15 to 25 turns.
FORCING_RETRY_REQUESTS = 50
#: Seconds under the fallback before ``"required"`` is tried again, whichever comes first: a
#: quiet bot whose endpoint had one bad evening gets forcing back the same day.
FORCING_RETRY_S = 6 * 3600.0
#: Seconds a refusal of a named ``tool_choice`` is remembered before one is sent again.
NAMED_RETRY_S = 24 * 3600.0


@dataclass(frozen=True, slots=True)
class ForcingFallback:
    """Why and since when an endpoint gets ``tool_choice="auto"`` instead of ``"required"``.

    Stored in ``kv`` ``llm.tool_choice:<endpoint>`` as JSON:
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
        since = f" since {utc(self.since)}" if self.since is not None else ""
        retried = f" (re-tried {self.retries} time(s) since, refused)" if self.retries else ""
        every = f"re-tried every {retry_requests} tool requests or {duration(retry_s)}, whichever comes first"
        if self.checked_at is None:
            when = "next at the first tool request"
        else:
            left = self.checked_at + retry_s - now
            when = f"next within {duration(left)}" if left > 0 else "next at the first tool request"
        return f"auto{since}: {self.reason}{retried}; {every} ({when})"


def may_refuse_forcing(exc: openai.APIStatusError, params: dict[str, Any]) -> bool:
    """Whether a refusal of a request sent with ``tool_choice="required"`` may be about forcing,
    so that the request is tried again with ``"auto"``: a 400, 422 or 500 that is not about
    the request's images (the image step tells those apart), nor about the context window,
    nor names an optional parameter the request sent (``reasoning_effort``: the thinking
    step handles that one)."""
    if exc.status_code not in (400, 422, 500) or names_optional_param(exc, params):
        return False
    messages = params["messages"]
    if has_images(messages) and names_images(str(exc.message)):
        return False
    return not is_context_error(exc)


class ToolForcing:
    """What one endpoint has shown of tool forcing: the remembered fallback, the refusals in a
    row that have not turned it on yet, and the re-try of ``"required"`` under way.

    Args:
        memory: where the fallback is remembered (:func:`tool_choice_key`).
        base_url: the endpoint.
        clock: the wall clock, epoch seconds.
        retry_requests: tool requests under the fallback before ``"required"`` is tried again.
        retry_s: seconds under the fallback before it is tried again (whichever of the two
            comes first).
        endpoint: its name in the key (:func:`~bumblebot.llm.capabilities.endpoint_key`;
            default: ``base_url``).
    """

    def __init__(
        self, memory: CapabilityMemory, base_url: str, clock: Callable[[], float], *, retry_requests: int,
        retry_s: float, endpoint: str | None = None,
    ) -> None:
        self.memory = memory
        self.base_url = base_url
        self.endpoint = endpoint or base_url
        self.retry_requests = retry_requests
        self.retry_s = retry_s
        self._clock = clock
        self._strikes = 0
        self._auto_requests = 0  # tool requests under the fallback since its timer started
        self._probing = False  # one request at a time tries "required" again
        self._accepted = False  # "required" was answered (known in this process)
        self._due = False  # the next tool request re-tries "required", its time come or not

    def _key(self) -> str:
        return tool_choice_key(self.endpoint)

    async def fallback(self) -> ForcingFallback | None:
        """The remembered ``"auto"`` fallback of this endpoint, ``None`` while forcing is on."""
        return ForcingFallback.parse(await self.memory.get(self._key()))

    async def choose(self) -> tuple[str, bool]:
        """The tool_choice of the next tool request when ``llm.tool_choice`` is ``"required"``,
        and whether it re-tries ``"required"``.

        Under a remembered fallback ``"auto"`` is used, except for one request at a time once
        :attr:`retry_requests` requests or :attr:`retry_s` seconds have passed since the
        fallback (or its last refused retry). A re-try ends with :meth:`probe_done`.
        """
        fallback = await self.fallback()
        if fallback is None:
            return "required", False
        if not self._probing and self._retry_due(fallback):
            self._probing = True
            log.info(
                "endpoint %s: trying tool_choice=required again (it has used 'auto' since %s)",
                self.base_url, "an older version" if fallback.since is None else utc(fallback.since),
            )
            return "required", True
        self._auto_requests += 1
        return "auto", False

    def retry_now(self) -> None:
        """The next tool request under the fallback re-tries ``"required"`` (``bumblebot check``
        does so: what it shows is then the state after that re-try)."""
        self._due = True

    def _retry_due(self, fallback: ForcingFallback) -> bool:
        if fallback.checked_at is None or self._due:
            self._due = False
            return True
        return (
            self._auto_requests >= self.retry_requests
            or self._clock() - fallback.checked_at >= self.retry_s
        )

    def probe_done(self) -> None:
        """The re-try of ``"required"`` is over, answered or not: the next one may start."""
        self._probing = False

    async def accepted(self, *, probing: bool) -> None:
        """A request with ``"required"`` was answered (``probing``: it was a re-try). The first
        one is remembered: unexplained refusals from then on may be an upstream's hiccups."""
        self._strikes = 0
        if probing:
            await self._recovered()
        elif not self._accepted and not await self._ever_accepted():
            await self.memory.set(self._key(), json.dumps({"mode": "required", "since": self._clock()}))
        self._accepted = True

    async def _ever_accepted(self) -> bool:
        """Whether this endpoint was seen answering ``"required"`` (now or remembered)."""
        if self._accepted:
            return True
        try:
            return json.loads(await self.memory.get(self._key()) or "{}").get("mode") == "required"
        except (ValueError, AttributeError):
            return False

    async def refused(self, exc: openai.APIStatusError, *, probing: bool) -> None:
        """A request with ``"required"`` was refused with ``exc``, and the same request with
        ``"auto"`` answered (``probing``: it was a re-try)."""
        if probing:
            await self._still_refused(exc)
        else:
            await self._note_refused(exc)

    async def _note_refused(self, exc: openai.APIStatusError) -> None:
        """Fall back to ``"auto"`` for this endpoint once the refusal is clearly about forcing.

        An error that names ``tool_choice``, or a 400/422 that names tools, counts at once; so
        does any other refusal that ``"auto"`` then survives (answered, or refused only as too
        long: it got past where ``"required"`` failed) from an endpoint never seen
        accepting ``"required"`` (llama-cpp-python's bare 500), unless it names tools (a 500
        "Failed to parse tool call arguments" is about the model's output). From an endpoint
        that accepted it before, such a refusal counts only when it happens on
        :data:`FORCING_STRIKES` consecutive tool requests (a flaky upstream that fails one
        request in three does not switch forcing off). Either way the fallback is re-tried later
        (:meth:`choose`), so no error turns tool forcing off for good.
        """
        message = str(exc.message)
        about_tools = bool(_CHOICE_RE.search(message)) or (
            exc.status_code in (400, 422) and bool(_TOOLS_RE.search(message))
        )
        self._strikes += 1
        first = not _TOOLS_RE.search(message) and not await self._ever_accepted()
        if not (about_tools or first or self._strikes >= FORCING_STRIKES):
            return
        why = refusal(exc)
        if about_tools:
            reason = why
        elif first:
            reason = f"{why}; the same request with 'auto' was not"
        else:
            reason = f"{self._strikes} unexplained refusals in a row (last: {why})"
        now = self._clock()
        await self.memory.set(self._key(), ForcingFallback(reason, now, now).dump())
        self._auto_requests = 0
        log.warning(
            "endpoint %s does not support tool_choice=required (%s); using 'auto', trying 'required' again "
            "after %d tool requests or %s",
            self.base_url, reason, self.retry_requests, duration(self.retry_s),
        )

    async def _still_refused(self, exc: openai.APIStatusError) -> None:
        """A re-try of ``"required"`` was refused: the fallback stays and its timer restarts."""
        old = await self.fallback()
        now = self._clock()
        fallback = ForcingFallback(
            refusal(exc), old.since if old else now, now, (old.retries if old else 0) + 1
        )
        await self.memory.set(self._key(), fallback.dump())
        self._auto_requests = 0
        log.info(
            "endpoint %s still refuses tool_choice=required (%s); 'auto' stays, next try after %d tool "
            "requests or %s", self.base_url, fallback.reason, self.retry_requests,
            duration(self.retry_s),
        )

    async def _recovered(self) -> None:
        """A re-try of ``"required"`` was accepted: forcing is back, the memory is cleared."""
        old = await self.fallback()
        await self.memory.clear(self._key())
        self._auto_requests = 0
        self._accepted = True
        log.warning(
            "endpoint %s accepts tool_choice=required again; tool forcing is back (it used 'auto' since %s)",
            self.base_url, "an older version" if old is None or old.since is None else utc(old.since),
        )


def named(tool: str) -> dict[str, Any]:
    """The ``tool_choice`` that makes the model call ``tool`` (OpenAI's form, which vLLM,
    llama-cpp-python and most gateways follow)."""
    return {"type": "function", "function": {"name": tool}}


class NamedChoice:
    """Whether one endpoint takes a ``tool_choice`` naming the tool to call.

    Most do. A request refused with a 400, 422 or 500 that may be about forcing
    (:func:`may_refuse_forcing`) is sent again at once with the usual choice. When that one is
    answered, the refusal is remembered under
    :func:`~bumblebot.llm.capabilities.named_choice_key`, and the endpoint gets no named choice
    for :data:`NAMED_RETRY_S`, if it was about the name: it names ``tool_choice``, or is a 400 or
    422, or is a 500 from an endpoint not seen accepting a named choice since the daemon started
    (a passing 500 from one that did is an upstream's hiccup). Servers that ignore the field
    (Ollama; llama.cpp's server reads a tool_choice that is not a string as ``"auto"``) answer
    as if it were not there: nothing is lost but the choice.

    Args:
        refusals: the endpoint's remembered refusals.
    """

    def __init__(self, refusals: Refusals) -> None:
        self._refusals = refusals
        self._accepted = False  # a named choice was answered, since the daemon started

    def _key(self) -> str:
        return named_choice_key(self._refusals.endpoint)

    async def usable(self) -> bool:
        """Whether the next request may name its tool."""
        return not await self._refusals.active(self._key(), NAMED_RETRY_S, "naming the tool to call again")

    def accepted(self) -> None:
        """A request naming its tool was answered."""
        self._accepted = True

    async def refused(self, exc: openai.APIStatusError) -> None:
        """A request naming its tool was refused with ``exc``, and answered without the name."""
        about = bool(_CHOICE_RE.search(str(exc.message))) or exc.status_code in (400, 422)
        if not about and self._accepted:
            log.info("endpoint %s: a request naming its tool failed once (%s)", self._refusals.base_url, refusal(exc))
            return
        reason = refusal(exc)
        await self._refusals.remember(self._key(), reason)
        log.warning(
            "endpoint %s refused a tool_choice naming the tool (%s); its usual tool_choice is sent instead "
            "for %s", self._refusals.base_url, reason, duration(NAMED_RETRY_S),
        )
