"""The ``getUpdates`` connection: its answer read update by update, so that one update
python-telegram-bot cannot read never holds up the others.

python-telegram-bot reads a batch whole (``Update.de_list``): one update it cannot read (a
``date`` that is no timestamp, a ``reply_to_message`` chain deeper than its reader goes) fails
the batch, the offset never moves past it, and no chat is served again. :class:`PollingRequest`
is the batch's connection (``ApplicationBuilder.get_updates_request``) and reads its JSON
through ``parse_json_payload``, the hook python-telegram-bot gives for reading JSON: each update
is read on its own (``Update.de_json``) and kept for the poller (:meth:`PollingRequest.take_batch`);
one that fails is logged once with its id and kept as ``None``, for the poller to move the offset
past it. ``Bot.get_updates`` is then only the transport (parameters, timeouts, errors) and
returns an empty tuple: each update is read once.

A body nested too deeply for the standard library's JSON reader cannot be read at all: its
updates are then asked for one at a time (:attr:`PollingRequest.narrow_until`), and the one
that still cannot be read is skipped; its id is found in the raw text (a top-level
``"update_id"`` key: Telegram's other objects have none, and a quote inside a string is escaped).
"""

from __future__ import annotations

import logging
import re
from typing import Any

from telegram import Bot, Update
from telegram.error import NetworkError
from telegram.request import HTTPXRequest

log = logging.getLogger(__name__)

#: An update's id in a raw ``getUpdates`` body: the key's opening quote is no escaped one.
_UPDATE_ID = re.compile(rb'(?<!\\)"update_id"\s*:\s*(-?\d{1,19})')
#: Updates remembered as skipped (each is logged once).
TOLD_KEPT = 1000


class PollingRequest(HTTPXRequest):
    """python-telegram-bot's HTTP request for ``getUpdates`` (one connection, ``read_timeout``
    long enough for a long poll), reading each update on its own (module docstring).

    Args:
        read_timeout: seconds to wait for an answer (the long poll's timeout and a margin).
    """

    def __init__(self, read_timeout: float) -> None:
        super().__init__(connection_pool_size=1, read_timeout=read_timeout)
        #: the poller asks for one update at a time up to this id (a batch that could not be read)
        self.narrow_until = -1
        #: the bot the updates are read for (set once the application is built)
        self.bot: Bot | None = None
        self._batch: list[tuple[int, Update | None]] = []
        self._told: dict[int, None] = {}  # updates skipped lately (insertion order: oldest first)

    def take_batch(self) -> list[tuple[int, Update | None]]:
        """The last answer's updates by id, ``None`` for one that could not be read."""
        batch, self._batch = sorted(self._batch, key=lambda pair: pair[0]), []
        return batch

    def parse_json_payload(self, payload: bytes) -> Any:  # type: ignore[override]
        try:
            data = HTTPXRequest.parse_json_payload(payload)
        except RecursionError:  # nested deeper than the standard library's reader goes
            return self._undecodable(payload)
        result = data.get("result") if isinstance(data, dict) else None
        if not isinstance(result, list) or not data.get("ok"):  # an error's answer
            return data
        self._batch = [self._read(update) for update in result]
        return {**data, "result": []}

    def _read(self, update: Any) -> tuple[int, Update | None]:
        update_id = update.get("update_id") if isinstance(update, dict) else None
        try:
            return int(update_id), Update.de_json(update, self.bot)  # type: ignore[arg-type]
        except Exception as exc:  # noqa: BLE001 - whatever the library fails with, the update is skipped
            if not isinstance(update_id, int):
                raise NetworkError("getUpdates answered an update without an id") from exc
            self._skip(update_id, _why(exc))
            return update_id, None

    def _skip(self, update_id: int, why: str) -> None:
        """Leave an update out, logged the first time (a batch read again, after a failed
        write, holds it again)."""
        if update_id not in self._told:
            log.warning("Telegram: update %s cannot be read (%s); skipped", update_id, why)
        self._told[update_id] = None
        while len(self._told) > TOLD_KEPT:
            self._told.pop(next(iter(self._told)))

    def _undecodable(self, payload: bytes) -> dict[str, Any]:
        ids = [int(m) for m in _UPDATE_ID.findall(payload)]
        if len(ids) == 1:
            self._skip(ids[0], "nested too deeply")
            self._batch = [(ids[0], None)]
        elif ids:
            log.info("Telegram: a batch of updates is nested too deeply to read; reading %d update(s) one at a time", len(ids))
            self.narrow_until = max(ids)
        else:  # not Telegram's answer: the poller waits and asks again
            raise NetworkError("the answer to getUpdates is nested too deeply to read and names no update")
        return {"ok": True, "result": []}


def _why(exc: BaseException) -> str:
    """A short reason for a log line (an exception's first line, at most 200 characters)."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:200]}" if lines else type(exc).__name__
