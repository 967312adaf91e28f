"""The only code that speaks to model endpoints: chat completions (what each endpoint can
do, learned and remembered), a ``say``'s text read out of a stream, and speech."""

from bumblebot.llm.client import (
    FORCING_RETRY_S,
    IMAGE_NOT_SHOWN,
    LLM,
    THINKING_RETRY_S,
    CapabilityMemory,
    Completion,
    ForcingFallback,
    SayListener,
    ToolCall,
    has_images,
    stream_key,
    thinking_key,
    tool_choice_key,
    vision_key,
    without_images,
)

__all__ = [
    "FORCING_RETRY_S", "IMAGE_NOT_SHOWN", "LLM", "THINKING_RETRY_S", "CapabilityMemory", "Completion",
    "ForcingFallback", "SayListener", "ToolCall", "has_images", "stream_key", "thinking_key", "tool_choice_key",
    "vision_key", "without_images",
]
