"""Images in a request (``llm.vision``), and models that cannot see them.

A message may carry ``image_url`` parts (data URLs). ``llm.vision: on`` always sends them,
``off`` never: each is replaced by :data:`IMAGE_NOT_SHOWN` (:func:`without_images`). Under
``auto`` they are sent until the endpoint shows, in one of two ways, that the model cannot
see them (:class:`~bumblebot.llm.client.LLM` reads each request's outcome so):

* it refuses the request (400, 415, 422, or a 500 that names images: :func:`about_images`) and
  answers the same request without them;
* it counts the images as text (:func:`read_as_text`): a server without a vision projector
  tokenizes the data URL (llama-cpp-python: 22,766 tokens for a 28 KB JPEG), so the request
  comes back answered with a huge prompt, or refused as over the context window and answered
  without the images.

The model (by base URL and model name) is then remembered as unable to see images in ``kv``
``llm.vision:<base_url>|<model>`` (:class:`Vision`), and sent images again after
:data:`VISION_RETRY_S`. A request with images refused as too long for any other reason is
answered without them, and nothing is remembered.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from bumblebot.core.errors import ContextTooLong, ModelError
from bumblebot.core.settings import LLMSettings
from bumblebot.llm.capabilities import REASON_CHARS, Refusals, duration, vision_key

log = logging.getLogger(__name__)

#: Seconds before a model remembered as unable to see images is sent one again.
VISION_RETRY_S = 24 * 3600.0
#: A 500 that is about the images of the request (llama.cpp server without a projector:
#: "image input is not supported - hint: ... mmproj").
_IMAGE_RE = re.compile(r"image|vision|multimodal|mmproj|content.{0,20}(type|part)", re.IGNORECASE)
IMAGE_NOT_SHOWN = "(an image was here; it is not shown: this model cannot see images)"
#: A request whose images were read as text counts at least this many prompt tokens per
#: character of their data URLs (base64 tokenizes at 0.3 to 0.8 tokens a character); a vision
#: model counts a few hundred tokens an image, whatever its size.
IMAGE_AS_TEXT_TOKENS_PER_CHAR = 0.15
#: Data URLs shorter than this (characters, a 15 KB image) are too small to tell the two apart.
IMAGE_AS_TEXT_MIN_CHARS = 20_000


def has_images(messages: list[dict[str, Any]]) -> bool:
    """Whether any message of a request carries an ``image_url`` part."""
    return any(
        isinstance(m.get("content"), list) and any(p.get("type") == "image_url" for p in m["content"])
        for m in messages
    )


def without_images(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's messages with every ``image_url`` part replaced by
    :data:`IMAGE_NOT_SHOWN` (content parts joined back into text)."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            texts = [p.get("text", "") if p.get("type") == "text" else IMAGE_NOT_SHOWN for p in content]
            m = {**m, "content": "\n".join(t for t in texts if t)}
        out.append(m)
    return out


def names_images(message: str) -> bool:
    """Whether an endpoint's error message is about images (a projector, a content part)."""
    return bool(_IMAGE_RE.search(message))


def read_as_text(messages: list[dict[str, Any]], prompt_tokens: int | None) -> bool:
    """Whether the endpoint counted the request's images as text: its prompt tokens exceed a
    generous count of the text (a third of its characters) by
    :data:`IMAGE_AS_TEXT_TOKENS_PER_CHAR` per character of the data URLs."""
    if prompt_tokens is None:
        return False
    url_chars = text_chars = 0
    for m in messages:
        content = m.get("content")
        parts = content if isinstance(content, list) else [{"type": "text", "text": content or ""}]
        for part in parts:
            if part.get("type") == "image_url":
                url_chars += len(str((part.get("image_url") or {}).get("url", "")))
            else:
                text_chars += len(str(part.get("text") or ""))
        text_chars += len(json.dumps(m.get("tool_calls") or []))
    if url_chars < IMAGE_AS_TEXT_MIN_CHARS:
        return False
    return prompt_tokens - text_chars / 3 >= IMAGE_AS_TEXT_TOKENS_PER_CHAR * url_chars


def about_images(exc: ModelError) -> bool:
    """Whether a refusal of a request with images may be about the images: a 400, 415 or 422
    (not a context-length one), or a 500 whose message names images."""
    if isinstance(exc, ContextTooLong) or exc.status is None:
        return False
    if exc.status in (400, 415, 422):
        return True
    return exc.status == 500 and names_images(str(exc))


class Vision:
    """Whether requests to a model carry images: ``llm.vision``, and under ``auto`` what the
    endpoint has shown (:func:`~bumblebot.llm.capabilities.vision_key`).

    Args:
        settings: the ``llm`` config section.
        refusals: the endpoint's remembered refusals.
    """

    def __init__(self, settings: LLMSettings, refusals: Refusals) -> None:
        self.settings = settings
        self._refusals = refusals

    async def sees(self, model: str) -> bool:
        """Whether requests to ``model`` carry images: ``llm.vision``, and under ``auto``
        whether the endpoint has not refused them (within :data:`VISION_RETRY_S`)."""
        if self.settings.vision != "auto":
            return self.settings.vision == "on"
        key = vision_key(self._refusals.base_url, model)
        return not await self._refusals.active(key, VISION_RETRY_S, f"sending images to {model} again")

    async def refusal(self, model: str) -> str | None:
        """Why ``model`` is remembered as unable to see images, ``None`` when it is not."""
        return await self._refusals.reason(vision_key(self._refusals.base_url, model))

    async def blind(self, model: str, reason: str) -> None:
        """Remember that ``model`` does not see images."""
        reason = reason[:REASON_CHARS]
        await self._refusals.remember(vision_key(self._refusals.base_url, model), reason)
        log.warning(
            "endpoint %s: model %s does not see images (%s); they are not sent to it from now on (tried again in %s)",
            self._refusals.base_url, model, reason, duration(VISION_RETRY_S),
        )
