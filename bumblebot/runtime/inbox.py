"""Everything of one conversation that waits for a turn, in one place.

* **Messages** waiting, oldest first: the next turn takes those at the head that merge (the
  messages of people) or one scheduled or autonomous entry; a running turn may take the
  messages of people as they come (steering).
* **Bursts** (``cognition.debounce_s``): messages from people that follow each other within
  ``debounce_s`` are one turn. A lone message's turn begins at once; when the next follows
  within ``debounce_s`` while that turn is prepared or awaits its first completion (nothing
  shown yet), :attr:`Inbox.burst` is set and the turn is asked again with it. Once a burst is
  on, the next turn waits until ``debounce_s`` after its last message (1.5 s after a part of
  a paste the client cut, ``Inbound.paste_part``, which its adapter marks), at most
  :data:`DEBOUNCE_MAX_S` after the first.
* **Albums**: the parts of a Telegram album (photos sent together arrive as separate
  messages) wait :data:`ALBUM_SETTLE_S` for each other, so the album is one turn.
* **Files a service could not fetch** (the platform or the transcription endpoint is down):
  their messages wait, postponed, and are tried again after a backoff; how long they have
  waited, and that the chat was told once.
* **A pending stop**: ``/stop`` that came before the turn it is for began (while it was routed).
* **The /reset fence**: messages from people journaled before the last ``/reset`` belong to the
  session it put aside; no turn answers them in the new one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from bumblebot.store import JournalEntry

#: Longest a burst of messages is waited for (``cognition.debounce_s``), seconds from its first
#: message: a chat that never stops writing still gets its answer.
DEBOUNCE_MAX_S = 10.0
#: Quiet seconds a part of a long paste (``Inbound.paste_part``) asks for before the burst counts as
#: over: a client cuts a long paste into parts it sends a moment apart.
PASTE_SETTLE_S = 1.5
#: Seconds after the last part of an album before its turn starts, and the longest wait for
#: its parts, seconds from its first.
ALBUM_SETTLE_S = 1.0
ALBUM_MAX_WAIT_S = 5.0


class Inbox:
    """One conversation's waiting messages and what they wait for (module docstring).

    Args:
        debounce_s: ``cognition.debounce_s`` (``0``: every turn starts at once).
        clock: loop time, seconds (tests pass their own).
    """

    def __init__(self, *, debounce_s: float = 0.0, clock: Callable[[], float] | None = None) -> None:
        self._debounce_s = debounce_s
        self._clock = clock or (lambda: asyncio.get_running_loop().time())
        #: journal entries waiting for a turn, oldest first
        self.entries: list[JournalEntry] = []
        #: entries taken for the next turn that has not begun yet (its files, its route)
        self.taken: list[JournalEntry] = []
        #: journal id of the last ``/reset``
        self.fence = 0
        #: ``/stop`` came before the turn began (while it was routed): it stops at once
        self.stop_pending = False
        #: set when a message continues the burst the turn being prepared (or awaiting its
        #: first completion) began with: it is asked again with it
        self.burst = asyncio.Event()
        #: set by the next message from a person (:meth:`arrival`)
        self._arrival = asyncio.Event()
        #: loop time until which the burst goes on: the last message's arrival plus the quiet it asks for
        self.settle_at = 0.0
        self._burst_at = -1e9  # when the last message from a person arrived
        self._burst_since = 0.0  # when the first message of the burst arrived
        self._turn_burst = -1e9  # ``_burst_since`` of the burst the running turn began with
        self._album_at = 0.0
        self._album_since = 0.0
        #: messages whose files wait for a service that is down, and when they are tried again
        self.postponed: list[JournalEntry] = []
        self.postponed_due = 0.0
        self._file_waits: dict[int, float] = {}  # journal id -> when its files first could not be fetched
        #: the chat was told its files wait (once per wait)
        self.files_told = False

    def __len__(self) -> int:
        return len(self.entries)

    def __bool__(self) -> bool:
        return bool(self.entries)

    @property
    def person_waiting(self) -> bool:
        """A message from a person waits here for a turn."""
        return any(e.inbound.source == "chat" for e in self.entries)

    def arrival(self) -> asyncio.Event:
        """An event set when the next message from a person is added (each message sets the
        event handed out before it, and a new one is handed out after it)."""
        return self._arrival

    def add(self, entry: JournalEntry, *, busy: bool) -> None:
        """A journaled message for this conversation; ``busy``: a turn is running."""
        now = self._clock()
        inbound = entry.inbound
        if inbound.source == "chat":
            self._arrival.set()
            self._arrival = asyncio.Event()
        if inbound.album:
            if not self.entries or self.entries[-1].inbound.album != inbound.album:
                self._album_since = now
            self._album_at = now
        if inbound.source == "chat" and self._debounce_s > 0:
            continues = now <= self.settle_at  # within the quiet the last message asked for
            if not continues:
                self._burst_since = now
            self._burst_at = now
            quiet = max(self._debounce_s, PASTE_SETTLE_S) if inbound.paste_part else self._debounce_s
            self.settle_at = now + quiet
            if (continues and busy and not inbound.album and self._burst_since == self._turn_burst
                    and now - self._burst_since < DEBOUNCE_MAX_S):
                # the turn that began with this burst is asked again with it (not for ever: a
                # chat that never stops writing gets its answer, the rest steered in as usual);
                # a burst that began after the turn did waits for its own
                self.burst.set()
        self.entries.append(entry)

    def settle_wait(self) -> float:
        """Seconds to wait before the next turn takes the inbox (0: take it now): for more
        parts of an album, or for the rest of a burst."""
        if not self.entries:
            return 0.0
        last = self.entries[-1].inbound
        if last.album:
            until = min(self._album_at + ALBUM_SETTLE_S, self._album_since + ALBUM_MAX_WAIT_S)
        elif last.source == "chat" and self._debounce_s > 0:
            if not last.paste_part and self._burst_since == self._burst_at:
                return 0.0  # a lone message: its turn begins at once (and is asked again if one follows)
            # a burst is on (or a paste has begun): wait for the quiet its last message asked for
            until = min(self.settle_at, self._burst_since + DEBOUNCE_MAX_S)
        else:
            return 0.0
        return max(0.0, until - self._clock())

    async def burst_settled(self) -> None:
        """Wait until the burst the running turn began with is over: ``debounce_s`` with no new
        message (a message meanwhile moves the end on), at most :data:`DEBOUNCE_MAX_S`."""
        give_up = self._clock() + DEBOUNCE_MAX_S
        while (left := min(self.settle_at, give_up) - self._clock()) > 0:
            await asyncio.sleep(left)
        self.burst.clear()

    def take(self) -> list[JournalEntry]:
        """What the next turn answers, in arrival order: the messages from people waiting at
        the head (they merge into one turn), or one scheduled or autonomous entry (each is a
        turn of its own, never merged)."""
        self.burst.clear()
        self._turn_burst = self._burst_since
        if not self.entries:
            return []
        if self.entries[0].inbound.source != "chat":
            batch, self.entries = self.entries[:1], self.entries[1:]
        else:
            n = next((i for i, e in enumerate(self.entries) if e.inbound.source != "chat"), len(self.entries))
            batch, self.entries = self.entries[:n], self.entries[n:]
        self.taken = batch
        return batch

    def take_steering(self) -> list[JournalEntry]:
        """For the running turn: every message from a person waiting, and nothing else (not the
        parts of an album: they wait for each other, and make a turn of their own)."""
        steers = [e.inbound.source == "chat" and not e.inbound.album for e in self.entries]
        batch = [e for e, s in zip(self.entries, steers, strict=True) if s]
        self.entries = [e for e, s in zip(self.entries, steers, strict=True) if not s]
        return batch

    def requeue(self, entries: list[JournalEntry]) -> None:
        """Put ``entries`` (taken by a turn that did not begin) back at the head, except those a
        ``/reset`` set aside meanwhile."""
        self.entries[:0] = self.after_fence(entries)

    def began(self) -> None:
        """The turn that took :attr:`taken` has begun: they are its own now."""
        self.taken = []

    def after_fence(self, entries: list[JournalEntry]) -> list[JournalEntry]:
        """``entries`` without the messages from people a ``/reset`` set aside."""
        return [e for e in entries if not (e.inbound.source == "chat" and e.id < self.fence)]

    def set_aside(self, fence: int) -> list[JournalEntry]:
        """``/reset``, journaled as ``fence``: the messages from people before it that no turn
        has begun answering (waiting, or taken by a turn still being prepared) leave the
        inbox; returns them."""
        aside = [e for e in (*self.taken, *self.entries) if e.inbound.source == "chat" and e.id < fence]
        ids = {e.id for e in aside}
        self.entries = [e for e in self.entries if e.id not in ids]
        self.fence = max(self.fence, fence)
        return aside

    def find(self, message_id: str) -> JournalEntry | None:
        """The waiting entry (in the inbox, or for its files) of a person's ``message_id``."""
        waiting = [*self.entries, *self.postponed]
        return next((e for e in waiting if e.inbound.message_id == message_id and e.inbound.source == "chat"), None)

    def replace(self, entry: JournalEntry) -> bool:
        """Put ``entry`` (an edited message) where the waiting entry with its id is; ``False``
        when it no longer waits."""
        for waiting in (self.entries, self.postponed):
            for i, queued in enumerate(waiting):
                if queued.id == entry.id:
                    waiting[i] = entry
                    return True
        return False

    def replace_all(self, entries: list[JournalEntry], taken: set[int]) -> None:
        """After the conversation was read back from the store: ``entries`` (the journal's
        pending ones) first, then what waited here and is neither among them nor ``taken``."""
        known = {e.id for e in entries}
        self.entries = entries + [e for e in self.entries if e.id not in known and e.id not in taken]

    # -- files a service could not fetch ------------------------------------------------------

    def postpone(self, entries: list[JournalEntry], retry_in: float) -> None:
        """``entries`` wait for their files; tried again after ``retry_in`` seconds."""
        self.postponed = entries
        self.postponed_due = self._clock() + retry_in

    def postponed_ready(self) -> bool:
        return bool(self.postponed) and self.postponed_due <= self._clock()

    def release_postponed(self) -> None:
        """The file service may be back: the waiting messages go first again."""
        self.requeue(self.postponed)
        self.postponed = []

    def drop_postponed(self) -> list[JournalEntry]:
        """``/stop`` while messages wait for their files: they are not answered after all."""
        dropped, self.postponed = self.postponed, []
        return dropped

    def file_wait_began(self, entries: list[JournalEntry], now: float) -> float:
        """Their files could not be fetched at ``now`` (epoch seconds); returns when the first
        of them began to wait."""
        for entry in entries:
            self._file_waits.setdefault(entry.id, now)
        return min(self._file_waits[e.id] for e in entries)

    def file_waited(self, entries: list[JournalEntry], now: float) -> float:
        """Seconds the longest waiting of ``entries`` has waited for its files (0: none waits)."""
        started = [self._file_waits[e.id] for e in entries if e.id in self._file_waits]
        return now - min(started) if started else 0.0

    def files_fetched(self, entries: list[JournalEntry]) -> None:
        """The files of ``entries`` were fetched (or given up): the wait is over."""
        for entry in entries:
            self._file_waits.pop(entry.id, None)
        self.files_told = False

    # -- /stop ---------------------------------------------------------------------------------

    def request_stop(self) -> bool:
        """``/stop`` before the turn it is for began; ``False`` when already asked."""
        if self.stop_pending:
            return False
        self.stop_pending = True
        return True

    def take_stop(self) -> bool:
        """Whether a ``/stop`` waits for the turn beginning now (it is taken)."""
        stop, self.stop_pending = self.stop_pending, False
        return stop
