"""Thinking (``llm.thinking``): how a request asks the model to think, and models that refuse it.

``llm.thinking.mode``: ``reasoning_effort`` sends ``reasoning_effort`` with every request that
asks for thinking, ``extra_body`` sends ``extra_body_on`` or ``extra_body_off``, ``off`` never
asks. Under ``auto`` a request asking for thinking that is refused (a 400 or 422, not a
context-length one) is sent again at once without the ask (:class:`~bumblebot.llm.client.LLM`).
When that one is answered, the refusal counts against thinking (:class:`Thinking`): at once when
it names the parameter (OpenAI: "Unsupported parameter: 'reasoning_effort'"), any other only when
it happens on :data:`THINKING_STRIKES` such requests in a row, as a passing 400 from an upstream
proxy must not turn thinking off for a day. The model (by base URL and model name) is then
remembered as refusing it in ``kv`` ``llm.thinking:<base_url>|<model>``, and asked to think again
after :data:`THINKING_RETRY_S`.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from bumblebot.core.errors import ModelError
from bumblebot.core.settings import LLMSettings
from bumblebot.llm.capabilities import REASON_CHARS, Refusals, duration, thinking_key

log = logging.getLogger(__name__)

#: Seconds before a model that refused ``reasoning_effort`` is asked to think again.
THINKING_RETRY_S = 24 * 3600.0
#: A refusal that names the thinking parameter (OpenAI: "Unsupported parameter: 'reasoning_effort'").
_REASONING_RE = re.compile(r"reasoning", re.IGNORECASE)
#: Refusals in a row, each answered without thinking, before an unexplained one is remembered.
THINKING_STRIKES = 3


class Thinking:
    """What a request sends to ask for thinking, and what the endpoint has shown of it.

    Args:
        settings: the ``llm`` config section.
        refusals: the endpoint's remembered refusals.
    """

    def __init__(self, settings: LLMSettings, refusals: Refusals) -> None:
        self.settings = settings
        self._refusals = refusals
        self._strikes = 0  # unexplained refusals in a row that a request without thinking survived

    def params(self, thinking: bool) -> dict[str, Any]:
        """The request parameters that ask for thinking (``thinking``) or not."""
        t = self.settings.thinking
        if t.mode in ("auto", "reasoning_effort"):
            return {"reasoning_effort": t.reasoning_effort} if thinking else {}
        if t.mode == "extra_body":
            return dict(t.extra_body_on if thinking else t.extra_body_off)
        return {}

    def asked(self, params: dict[str, Any]) -> bool:
        """Whether a request's ``params`` ask for thinking (as :meth:`params` made them)."""
        on = self.params(True)
        return bool(on) and all(params.get(key) == value for key, value in on.items())

    async def asks(self, model: str) -> bool:
        """Whether deliberate requests to ``model`` ask for thinking: ``llm.thinking.mode``,
        and under ``auto`` whether the endpoint has not refused it (within
        :data:`THINKING_RETRY_S`)."""
        mode = self.settings.thinking.mode
        if mode != "auto":
            return mode != "off"
        key = thinking_key(self._refusals.base_url, model)
        return not await self._refusals.active(key, THINKING_RETRY_S, f"asking {model} to think again")

    async def refusal(self, model: str) -> str | None:
        """Why ``model`` is remembered as refusing thinking, ``None`` when it is not."""
        return await self._refusals.reason(thinking_key(self._refusals.base_url, model))

    def answered(self) -> None:
        """A request asking for thinking was answered: the refusals in a row start again."""
        self._strikes = 0

    async def refused(self, model: str, refusal: ModelError) -> None:
        """A request asking for thinking was refused and the same without it answered. A
        refusal that names the parameter counts at once; another only when it happens on
        :data:`THINKING_STRIKES` such requests in a row."""
        self._strikes += 1
        if _REASONING_RE.search(str(refusal)) or self._strikes >= THINKING_STRIKES:
            await self._remember(model, str(refusal))

    async def _remember(self, model: str, reason: str) -> None:
        """Remember that ``model`` refuses to be asked for thinking."""
        self._strikes = 0
        reason = reason[:REASON_CHARS]
        await self._refusals.remember(thinking_key(self._refusals.base_url, model), reason)
        log.warning(
            "endpoint %s: model %s refuses reasoning_effort (%s); deliberate turns do not ask it to think "
            "from now on (tried again in %s)", self._refusals.base_url, model, reason, duration(THINKING_RETRY_S),
        )
