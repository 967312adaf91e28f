"""What model requests cost: the price of a model (an entry of ``llm.prices``) and the cost of
one request at it.

Prices are per million tokens, in the currency ``llm.currency`` names, as the providers list
them: ``input`` for prompt tokens, ``cached_input`` for the prompt tokens the endpoint served
from its prompt cache (the providers' discounted rate; default: ``input``), ``output`` for
completion tokens (reasoning included, as the providers bill it). A transcription model may be
priced per minute of audio instead (``audio_minute``). No model is priced by default: a request
to a model without a price has no cost (``None``, shown as tokens), which is not a cost of 0.
"""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field, model_validator

from bumblebot.core.usage import Usage

#: Prices are per this many tokens.
PER_TOKENS = 1_000_000


class ModelPrice(BaseModel):
    """One model's price (``llm.prices.<model>``): ``input`` and ``output``, or ``audio_minute``."""

    model_config = ConfigDict(extra="forbid")

    input: float | None = Field(None, ge=0, description="per million prompt tokens not served from the cache")
    cached_input: float | None = Field(None, ge=0, description="per million cached prompt tokens; default: input")
    output: float | None = Field(None, ge=0, description="per million completion tokens, reasoning included")
    audio_minute: float | None = Field(None, ge=0, description="per minute of audio transcribed")

    @model_validator(mode="after")
    def _priced(self) -> ModelPrice:
        tokens = (self.input is not None, self.output is not None)
        if any(tokens) and not all(tokens):
            raise ValueError("a price per token needs both input and output (0 for a free one)")
        if not any(tokens) and self.audio_minute is None:
            raise ValueError("give input and output (per million tokens), or audio_minute")
        return self

    def cost(self, usage: Usage) -> float | None:
        """What ``usage`` cost at this price: per minute when ``audio_minute`` is set and the
        audio's length is known, else per token; ``None`` when neither applies."""
        if self.audio_minute is not None and usage.seconds > 0:
            return usage.seconds / 60 * self.audio_minute
        if self.input is None or self.output is None:
            return None
        cached = min(max(usage.cached, 0), usage.prompt)
        cached_input = self.input if self.cached_input is None else self.cached_input
        return ((usage.prompt - cached) * self.input + cached * cached_input + usage.completion * self.output) / PER_TOKENS


def cost_of(prices: Mapping[str, ModelPrice], usage: Usage) -> float | None:
    """What ``usage`` cost at ``prices`` (``llm.prices``), ``None`` when its model has no price."""
    price = prices.get(usage.model)
    return None if price is None else price.cost(usage)
