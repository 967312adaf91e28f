"""What a turn must remember across a crash or a restart: saved as JSON with each of its
checkpoints (``turns.state``), read back when it is resumed."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Closing:
    """The note that ends the turn is queued (with this state): a resumed turn only finishes,
    as ``status`` (``done``/``failed``) for the stop ``stop`` (``str(Stop)``)."""

    status: str
    stop: str


@dataclass(slots=True)
class TurnState:
    """A turn's resumable state."""

    #: the router's decision (docs/cognition.md, "Routing"), kept for every later resume
    route: str = ""
    route_reason: str = ""
    classifier_label: str | None = None
    classifier_error: str | None = None
    #: what the classifier's request used (``requests_usage``), ``None``: none was made
    classifier_usage: dict[str, Any] | None = None
    #: when the turn began, epoch seconds
    started: float | None = None
    #: the journal entry its ``[Turn context]`` is about (who speaks): the last of those its
    #: first user message answers, never one steered in later; ``None`` for a turn saved without it
    speaker_entry: int | None = None
    #: times it was resumed after being cut off while working (the trace's ``resumes``)
    resumes: int = 0
    #: of those, the ones since its model's last step: a poison turn, cut off again and again
    #: at the same point, is given up (a turn whose workers were killed while it progressed is not)
    stalled_resumes: int = 0
    #: working: a crash now counts a resume (not while it waits out an outage, or after a clean stop)
    active: bool = True
    #: the outage it waits out: since when (epoch seconds), how many tries, whether the chat was told
    outage_since: float | None = None
    outage_attempts: int = 0
    outage_notice: bool = False
    #: seconds it waited for the endpoint in all
    outage_s: float | None = None
    #: it answers a voice note and ``voice.reply: mirror`` is on: its replies go out as voice too
    voice_reply: bool = False
    #: the files of its messages that could not be used were told before its answer
    file_notices: bool = False
    closing: Closing | None = None

    def as_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["closing"] = None if self.closing is None else {"status": self.closing.status, "stop_reason": self.closing.stop}
        return out

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> TurnState:
        """The state a checkpoint saved (keys it does not know, from another version, are left out)."""
        raw = dict(raw or {})
        closing = raw.pop("closing", None)
        known = {f.name for f in dataclasses.fields(cls)}
        state = cls(**{k: v for k, v in raw.items() if k in known})
        if isinstance(closing, dict):
            state.closing = Closing(str(closing.get("status", "done")), str(closing.get("stop_reason", "end_turn")))
        return state

    def outage_over(self, now: float) -> bool:
        """The endpoint answered: the wait (if any) is added up; ``True`` when there was one
        (the state must be saved)."""
        if self.outage_since is None:
            return False
        self.outage_s = round((self.outage_s or 0) + now - self.outage_since, 1)
        self.outage_since = None
        self.outage_attempts = 0
        return True
