"""The only code that speaks to model endpoints: chat completions (what each endpoint can
do, learned and remembered), a ``say``'s text read out of a stream, and speech."""

from bumblebot.llm.capabilities import (
    CapabilityMemory,
    stream_key,
    thinking_key,
    tool_choice_key,
    vision_key,
)
from bumblebot.llm.client import LLM
from bumblebot.llm.completion import Completion, ToolCall
from bumblebot.llm.failover import Endpoints, build_endpoints
from bumblebot.llm.forcing import FORCING_RETRY_S, ForcingFallback
from bumblebot.llm.images import IMAGE_NOT_SHOWN, has_images, without_images
from bumblebot.llm.stream import SayListener
from bumblebot.llm.thinking import THINKING_RETRY_S

__all__ = [
    "FORCING_RETRY_S", "IMAGE_NOT_SHOWN", "LLM", "THINKING_RETRY_S", "CapabilityMemory", "Completion",
    "Endpoints", "ForcingFallback", "SayListener", "ToolCall", "build_endpoints", "has_images", "stream_key",
    "thinking_key", "tool_choice_key", "vision_key", "without_images",
]
