"""The ``llm`` section of the configuration: the primary endpoint, its fallbacks, thinking
control and prices; and the pieces every section is built from (:class:`Section`,
:func:`on_off`). :mod:`bumblebot.core.settings` puts the sections together."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from bumblebot.core.prices import ModelPrice


class Section(BaseModel):
    """A configuration section: unknown keys are errors, defaults are validated."""

    model_config = ConfigDict(extra="forbid", validate_default=True)


def off_is_text(value: Any) -> Any:
    """YAML 1.1 reads a bare ``off`` as ``False``; for keys whose value may be "off", take it back."""
    return "off" if value is False else value


class ThinkingSettings(Section):
    """How this endpoint is asked to think (deliberate) or not (reflex). Reasoning text is never shown."""

    mode: Literal["auto", "off", "reasoning_effort", "extra_body"] = Field(
        "auto",
        description="auto: send OpenAI's reasoning_effort on deliberate turns unless the endpoint refuses "
        "it (then not, remembered per endpoint and model, tried again a day later); off: never request "
        "thinking; reasoning_effort: always send it; extra_body: merge extra_body_on / extra_body_off "
        "into the request",
    )
    reasoning_effort: Literal["minimal", "low", "medium", "high"] = Field(
        "medium", description="value of reasoning_effort on deliberate turns (modes auto and reasoning_effort)"
    )
    extra_body_on: dict[str, Any] = Field(
        default_factory=dict,
        description='extra request fields for deliberate turns, e.g. {"chat_template_kwargs": {"enable_thinking": true}}',
    )
    extra_body_off: dict[str, Any] = Field(
        default_factory=dict, description="extra request fields for reflex turns, judges and summaries"
    )

    @field_validator("mode", mode="before")
    @classmethod
    def _mode_off(cls, value: Any) -> Any:
        return off_is_text(value)


class FallbackSettings(Section):
    """One endpoint of ``llm.fallbacks``, tried when the ones before it are down. A key left
    unset (null) is the primary's (``llm.<key>``), but for the models and the API key."""

    base_url: str | None = Field(None, description="endpoint base URL (required)")
    model: str | None = Field(
        None, description="model answering what llm.model (and llm.background_model) would; default: llm.model"
    )
    reflex_model: str | None = Field(
        None, description="model answering what llm.reflex_model would; default: this fallback's model"
    )
    api_key_env: str | None = Field(
        None,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="NAME of the environment variable (or .env line) holding this endpoint's key, e.g. "
        "OPENROUTER_API_KEY; never the key itself; null: the placeholder key not-needed is sent (the primary's is "
        "never sent elsewhere)",
    )
    timeout_s: float | None = Field(None, gt=0, description="per-request timeout, seconds; default: llm.timeout_s")
    max_retries: int | None = Field(
        None, ge=0, le=10,
        description="client retries; used by the last endpoint only (the others fail over at once); "
        "default: llm.max_retries",
    )
    tool_choice: Literal["required", "auto"] | None = Field(None, description="tool forcing; default: llm.tool_choice")
    thinking: ThinkingSettings | None = Field(None, description="thinking control; default: llm.thinking")
    max_concurrent_requests: int | None = Field(
        None, ge=1, description="requests in flight to this endpoint at once; default: llm.max_concurrent_requests"
    )
    vision: Literal["auto", "on", "off"] | None = Field(None, description="send images; default: llm.vision")

    @field_validator("vision", mode="before")
    @classmethod
    def _visionon_off(cls, value: Any) -> Any:
        return on_off(value)

    @model_validator(mode="after")
    def _has_base_url(self) -> FallbackSettings:
        if not (self.base_url or "").strip():
            raise ValueError("a fallback endpoint needs its base_url")
        return self


class LLMSettings(Section):
    """The OpenAI-compatible chat-completions endpoint."""

    base_url: str | None = Field(
        None, description="endpoint base URL; default: env OPENAI_BASE_URL, else OpenAI's"
    )
    model: str = Field("gpt-4o-mini", description="model for deliberate turns")
    reflex_model: str | None = Field(
        None, description="model for reflex turns, the classifier and judges; default: model"
    )
    timeout_s: float = Field(60.0, gt=0, description="per-request timeout, seconds")
    max_retries: int = Field(
        2, ge=0, le=10,
        description="client retries on 429/5xx/network errors; with llm.fallbacks only the last endpoint retries",
    )
    temperature: float = Field(0.7, ge=0, le=2, description="sampling temperature of turns")
    tool_choice: Literal["required", "auto"] = Field(
        "required",
        description="tool forcing; on an endpoint that rejects 'required' the bot falls back to "
        "'auto' by itself and remembers it",
    )
    thinking: ThinkingSettings = Field(default_factory=ThinkingSettings, description="thinking control")
    max_concurrent_requests: int = Field(
        64, ge=1,
        description="requests in flight to this endpoint at once (turns, judges, the classifier, "
        "summaries); the only cap on concurrency",
    )
    vision: Literal["auto", "on", "off"] = Field(
        "auto",
        description="send images to the model: auto (until the endpoint refuses them; that is "
        "remembered per endpoint and model), on (always), off (never; the model is told a photo came)",
    )
    transcription_model: str = Field(
        "whisper-1", description="speech-to-text model of voice notes and audio (POST /audio/transcriptions)"
    )
    transcription_base_url: str | None = Field(
        None, description="base URL of the transcription endpoint (a local whisper server); default: base_url"
    )
    background_model: str | None = Field(
        None,
        description="model (on this endpoint) of the steps of automations and autonomous turns; their "
        "judges and summaries keep the usual models; default: the usual models",
    )
    fallbacks: list[FallbackSettings] = Field(
        default_factory=list,
        description="endpoints tried in order when the one before is down (429, 5xx, a timeout, "
        "unreachable) or refuses its own key, account or model (401, 402, 403, 404); see docs/models.md, "
        "Fallback endpoints",
    )
    prices: dict[str, ModelPrice] = Field(
        default_factory=dict,
        description="per model name: input, cached_input (default: input) and output per million tokens, "
        "or audio_minute; a model without a price is counted in tokens only",
    )
    currency: str = Field("USD", min_length=1, description="the currency of llm.prices, named in metrics and reports")

    @field_validator("vision", mode="before")
    @classmethod
    def _visionon_off(cls, value: Any) -> Any:
        return on_off(value)


def on_off(value: Any) -> Any:
    """YAML 1.1 reads bare ``on``/``off`` (and yes/no, true/false) as booleans, an env
    override arrives as text: both are taken as ``on``/``off``."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, str):
        word = value.strip().lower()
        if word in ("on", "true", "yes", "1"):
            return "on"
        if word in ("off", "false", "no", "0"):
            return "off"
    return value
