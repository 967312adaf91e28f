"""Files people send, made into something the model can read: photos checked and scaled,
voice notes transcribed, documents saved to the chat's inbox and excerpted."""

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
