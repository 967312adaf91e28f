"""What the client learns about an endpoint, and where it remembers it.

Endpoints differ, and Bumblebot must work with all of them (OpenAI, Ollama, llama.cpp server,
vLLM, OpenRouter). What one cannot do is learnt from its refusals and remembered in the store's
``kv`` table (through :class:`CapabilityMemory`), so that it survives restarts, under a key of
the endpoint (its name, :func:`endpoint_key`) or of one of its models:

* :func:`tool_choice_key`: the endpoint gets ``tool_choice="auto"`` instead of ``"required"``
  (:mod:`bumblebot.llm.forcing`);
* :func:`named_choice_key`: it refuses a ``tool_choice`` that names the tool to call
  (:class:`~bumblebot.llm.forcing.NamedChoice`);
* :func:`stream_key`: it gets whole answers instead of streams (:mod:`bumblebot.llm.stream`);
* :func:`stream_usage_key`: its streamed requests do not ask for usage
  (``stream_options``, :mod:`bumblebot.llm.stream`);
* :func:`vision_key`: the model cannot see images (:mod:`bumblebot.llm.images`);
* :func:`thinking_key`: the model refuses ``reasoning_effort`` (:mod:`bumblebot.llm.thinking`).

No lesson is for good: each is tried again after a while. All but the first are remembered
refusals (:class:`Refusals`): a reason and the time it was learnt, forgotten once older than
their retry period.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import openai

log = logging.getLogger(__name__)

#: Longest refusal message kept as a remembered reason, characters.
REASON_CHARS = 200
_STATUS_PREFIX = re.compile(r"^Error code: \d+(?: - )?")  # the openai client's own prefix


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

    def known(self) -> dict[str, str]:
        """What this process has read or learned so far, by key (the operator's console shows
        it); keys never asked are not loaded for it."""
        return {key: value for key, value in self._cache.items() if value}

    async def clear(self, key: str) -> None:
        self._cache[key] = None
        if self._delete:
            await self._delete(key)
        elif self._save:
            await self._save(key, "")


def endpoint_key(base_url: str, model: str | None = None) -> str:
    """An endpoint's name in the keys of what it cannot do: its base URL, or ``<base_url>|<model>``
    for an endpoint that shares its base URL with one before it (two models at one provider,
    such as OpenRouter, learn apart; the first endpoint at a URL, the primary above all, keeps
    the bare URL its lessons were always remembered under)."""
    return base_url if model is None else f"{base_url}|{model}"


def tool_choice_key(endpoint: str) -> str:
    """The ``kv`` key of the tool_choice fallback of ``endpoint`` (:func:`endpoint_key`)."""
    return f"llm.tool_choice:{endpoint}"


def named_choice_key(endpoint: str) -> str:
    """The ``kv`` key recording that ``endpoint`` (:func:`endpoint_key`) refuses a ``tool_choice``
    naming a tool: JSON ``{"reason": str, "since": float}`` (epoch seconds)."""
    return f"llm.named_choice:{endpoint}"


def stream_key(endpoint: str) -> str:
    """The ``kv`` key recording that ``endpoint`` (:func:`endpoint_key`) gets whole answers.

    Its value is JSON ``{"mode": "off", "reason": str, "since": float}`` (epoch seconds).
    """
    return f"llm.stream:{endpoint}"


def stream_usage_key(endpoint: str) -> str:
    """The ``kv`` key recording that ``endpoint`` (:func:`endpoint_key`) refuses
    ``stream_options`` (the ask for usage in a stream): JSON ``{"reason": str, "since": float}``
    (epoch seconds)."""
    return f"llm.stream_usage:{endpoint}"


def vision_key(base_url: str, model: str) -> str:
    """The ``kv`` key recording that ``model`` at ``base_url`` cannot see images: JSON
    ``{"reason": str, "since": float}`` (epoch seconds)."""
    return f"llm.vision:{base_url}|{model}"


def thinking_key(base_url: str, model: str) -> str:
    """The ``kv`` key recording that ``model`` at ``base_url`` refuses ``reasoning_effort``:
    JSON ``{"reason": str, "since": float}`` (epoch seconds)."""
    return f"llm.thinking:{base_url}|{model}"


class Refusals:
    """The remembered refusals of one endpoint: ``kv`` values in JSON with a ``reason`` and a
    ``since`` (epoch seconds).

    Args:
        memory: where they are kept.
        base_url: the endpoint (named in the log).
        clock: the wall clock, epoch seconds.
        endpoint: its name in the keys of the endpoint's own refusals (:func:`endpoint_key`;
            default: ``base_url``).
    """

    def __init__(
        self, memory: CapabilityMemory, base_url: str, clock: Callable[[], float], *, endpoint: str | None = None
    ) -> None:
        self.memory = memory
        self.base_url = base_url
        self.clock = clock
        self.endpoint = endpoint or base_url

    async def active(self, key: str, retry_s: float, again: str) -> bool:
        """Whether ``key`` remembers a refusal younger than ``retry_s``; an older one is
        forgotten (logged as ``again``)."""
        raw = await self.memory.get(key)
        if not raw:
            return False
        try:
            since = float(json.loads(raw).get("since") or 0)
        except (ValueError, AttributeError, TypeError):
            since = 0.0
        if self.clock() - since >= retry_s:
            await self.memory.clear(key)
            log.info("endpoint %s: %s", self.base_url, again)
            return False
        return True

    async def reason(self, key: str) -> str | None:
        """The ``reason`` a remembered refusal under ``key`` gives, ``None`` when there is none."""
        raw = await self.memory.get(key)
        if not raw:
            return None
        try:
            return str(json.loads(raw).get("reason") or "reason not recorded")
        except (ValueError, AttributeError):
            return "reason not recorded"

    async def remember(self, key: str, reason: str, **extra: str) -> None:
        """Remember a refusal under ``key``, learnt now: ``{**extra, "reason", "since"}``."""
        value = json.dumps({**extra, "reason": reason, "since": self.clock()}, ensure_ascii=False)
        await self.memory.set(key, value)


def refusal(exc: openai.APIStatusError) -> str:
    """A refusal as a remembered reason: ``HTTP <status>: <message>``, the message clipped to
    :data:`REASON_CHARS`."""
    message = _STATUS_PREFIX.sub("", " ".join(str(exc.message).split())) or "no message"
    if len(message) > REASON_CHARS:
        message = message[: REASON_CHARS - 1] + "…"
    return f"HTTP {exc.status_code}: {message}"


def utc(epoch: float) -> str:
    """A time the log and ``bumblebot check`` show: ``2026-05-28 20:26 UTC``."""
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(epoch))


def duration(seconds: float) -> str:
    """A delay the log and ``bumblebot check`` show: ``6 h``, ``30 min``, ``12 s``."""
    if seconds >= 3600:
        return f"{seconds / 3600:.3g} h"
    if seconds >= 60:
        return f"{seconds / 60:.3g} min"
    return f"{max(seconds, 0):.3g} s"
