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
    from bumblebot.media.fetched import ImageRef, Prepared, answerable, image_tokens, prepared
    from bumblebot.media.intake import MediaFiles, MediaIntake, MediaUnavailable, normalise_image

#: Each name and the module it is loaded from.
_HOMES = {
    "ImageRef": "fetched", "MediaFiles": "intake", "MediaIntake": "intake", "MediaUnavailable": "intake",
    "Prepared": "fetched", "answerable": "fetched", "image_tokens": "fetched",
    "normalise_image": "intake", "prepared": "fetched",
}
__all__ = list(_HOMES)


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(f"bumblebot.media.{_HOMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
