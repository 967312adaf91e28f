"""What fetching a message's files gave, as the journal keeps it (``journal.media``) and the
turn reads it: :class:`Prepared`, with the images as :class:`ImageRef` references.

:class:`~bumblebot.media.intake.MediaIntake` makes them; the runtime reads them back from a
journal entry (:func:`prepared`, :func:`answerable`). Every text in one is storable: lone
surrogates (a transcript, a PDF's text, a file's name) are replaced by U+FFFD when it is made.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from bumblebot.core.events import storable_text
from bumblebot.store import JournalEntry

#: The token estimate of an image whose size is not known: a 1024×768 image (4 tiles).
UNKNOWN_IMAGE_TOKENS = 765


def image_tokens(width: int | None, height: int | None) -> int:
    """Estimated prompt tokens of one image, by OpenAI's published rule for ``detail: high``
    (OpenAI, "Images and vision", calculating costs): scaled to fit 2048×2048, then so its
    shortest side is at most 768 px; 170 tokens per 512 px tile plus 85. A 1280×960 photo is
    4 tiles, 765 tokens. Other endpoints count differently (llama.cpp's CLIP models use a fixed
    576 or so); the estimate stays on the safe side for them."""
    if not width or not height:
        return UNKNOWN_IMAGE_TOKENS
    w, h = float(width), float(height)
    scale = min(1.0, 2048 / max(w, h))
    w, h = w * scale, h * scale
    scale = min(1.0, 768 / min(w, h))
    w, h = w * scale, h * scale
    return 85 + 170 * math.ceil(w / 512) * math.ceil(h / 512)


@dataclass(frozen=True, slots=True)
class ImageRef:
    """An image kept for the model: ``path`` relative to ``<data_dir>/media``; pixels."""

    path: str
    mime: str
    width: int
    height: int

    @property
    def tokens(self) -> int:
        return image_tokens(self.width, self.height)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ImageRef:
        return cls(str(data["path"]), str(data.get("mime") or "image/jpeg"), int(data.get("width") or 0), int(data.get("height") or 0))


@dataclass(frozen=True, slots=True)
class Prepared:
    """What a message's files gave (stored as ``journal.media``).

    Args:
        text: what the model reads for the files, after the message's own text (transcripts,
            saved paths and excerpts, image markers); may be ``""``.
        images: the images it shows.
        voice: a voice note came (``voice.reply: mirror`` answers it by voice too).
        document: a document came (the turn goes deliberate: reading it is work).
        notices: sentences for the user about files that could not be used.
        usable: how many files gave the model something.
        spoken: the transcripts alone (what the router reads of a voice note).
        left_out: how many of its files were not fetched at all (over
            ``media.max_attachments_per_turn``).
    """

    text: str = ""
    images: tuple[ImageRef, ...] = ()
    voice: bool = False
    document: bool = False
    notices: tuple[str, ...] = ()
    usable: int = 0
    spoken: str = ""
    left_out: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "text", storable_text(self.text))
        object.__setattr__(self, "spoken", storable_text(self.spoken))
        object.__setattr__(self, "notices", tuple(storable_text(n) for n in self.notices))

    def to_json(self) -> dict[str, Any]:
        return {
            "text": self.text, "images": [i.to_json() for i in self.images], "voice": self.voice,
            "document": self.document, "notices": list(self.notices), "usable": self.usable, "spoken": self.spoken,
            "left_out": self.left_out,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> Prepared:
        if not data:
            return cls()
        return cls(
            text=str(data.get("text") or ""), images=tuple(ImageRef.from_json(i) for i in data.get("images") or ()),
            voice=bool(data.get("voice")), document=bool(data.get("document")),
            notices=tuple(str(n) for n in data.get("notices") or ()), usable=int(data.get("usable") or 0),
            spoken=str(data.get("spoken") or ""), left_out=int(data.get("left_out") or 0),
        )


def prepared(entry: JournalEntry) -> Prepared:
    """The :class:`Prepared` of a journal entry (empty when it had no files)."""
    return Prepared.from_json(entry.media)


def answerable(entry: JournalEntry) -> bool:
    """Whether the model has anything to answer in ``entry``: its text, or a file that gave
    something (a message of only an unreadable file is answered by its notice alone)."""
    return bool(entry.inbound.text.strip()) or not entry.inbound.attachments or prepared(entry).usable > 0
