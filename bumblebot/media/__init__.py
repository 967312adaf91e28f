"""Files people send, made into something the model can read: photos checked and scaled,
voice notes transcribed, documents saved to the chat's inbox and excerpted.

The names below are loaded on first use: the PDF reader runs as ``python -m
bumblebot.media.documents`` in a process of its own, which must not pay for importing the
intake (and the model client behind it) before it reads a page.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bumblebot.media.intake import (
        ImageRef,
        MediaFiles,
        MediaIntake,
        MediaUnavailable,
        Prepared,
        answerable,
        image_tokens,
        normalise_image,
        prepared,
    )

__all__ = [
    "ImageRef", "MediaFiles", "MediaIntake", "MediaUnavailable", "Prepared", "answerable", "image_tokens",
    "normalise_image", "prepared",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("bumblebot.media.intake"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
