"""What a turn tells the chat when it cannot answer as asked: the texts, in one place, and
which "too long" text fits a conversation."""

from __future__ import annotations

from bumblebot.runtime.conversation import Turn

RESUME_GAVE_UP = (
    "I was interrupted several times while working on this and stopped, to be safe. "
    "Send it again if you still need it."
)
TOO_LONG = (
    "That conversation got too long for my model even after compacting it. "
    "Send /reset to start fresh, or /compact to try again."
)
#: Too long, and nothing was compacted: the conversation has history compaction could not shrink
#: this time (its summary failed, or compaction is off).
TOO_LONG_UNCOMPACTED = (
    "That conversation got too long for my model, and I could not compact it this time. "
    "Send /compact to try again, or /reset to start fresh."
)
#: Too long in a conversation with nothing before it: the message itself (or my instructions)
#: does not fit the model's window.
TOO_LONG_MESSAGE = "That message is too long for my model's context window. Send it in shorter parts, or as a file."
MODEL_REFUSED = "My language model refused the request ({error}), so I couldn't answer this message."
CRASHED = "Something went wrong on my side (error id {error_id}), so I couldn't answer this message."
BLIND = "(The model I run on can't see images, so I only read the text that came with your picture.)"
#: ``kv`` key: this conversation was told its images are not seen (:data:`BLIND`), once.
BLIND_TOLD_KEY = "vision.told:{key}"


def too_long(turn: Turn) -> str:
    """What a turn refused as too long for the window says: "even after compacting it" only
    about a conversation that was compacted (this turn's compactions included)."""
    session = turn.session
    if session.summary or session.compaction.compactions:
        return TOO_LONG
    return TOO_LONG_UNCOMPACTED if session.history else TOO_LONG_MESSAGE
