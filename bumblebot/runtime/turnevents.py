"""What a turn tells the live event bus (:mod:`bumblebot.core.activity`) as it is recorded.

:class:`TurnEvents` is held by the :class:`~bumblebot.runtime.conversation.Turn`, the one
writer of a turn's record, and called where it writes: so an event is published exactly when
the store has what it describes (``turn_started`` with the turn's row, ``step`` with the
assistant message, before its tools run, ``tool_result`` with each result, ``said`` with each
outbox row, ``turn_ended`` with the turn's finish). Texts are cut to
:data:`~bumblebot.core.activity.CUT` characters; the bus redacts them.
"""

from __future__ import annotations

from typing import Any

from bumblebot.core.activity import Activity, cut
from bumblebot.core.messages import Message


class TurnEvents:
    """The events of one turn.

    Args:
        activity: the bus (``NO_ACTIVITY``: nothing is built or published).
        key: the conversation key.
        turn_id: the turn's row id.
    """

    def __init__(self, activity: Activity, key: str, turn_id: int) -> None:
        self._activity = activity
        self._key = key
        self._turn = turn_id
        self._step = 0  # the last step recorded (1-based)

    def started(self, route: str | None, reason: str | None, entries: int, *, resumed: bool = False) -> None:
        extra = {"resumed": True} if resumed else {}
        self._publish("turn_started", route=route, reason=reason, entries=entries, **extra)

    def recorded(self, message: Message, trace: dict[str, Any] | None = None) -> None:
        """An assistant message (a step) or a tool result was checkpointed."""
        if not self._activity.watched:
            return
        if message.role == "assistant":
            steps = (trace or {}).get("steps") or []
            self._step = len(steps) if steps else self._step + 1
            last = steps[-1] if steps else {}
            calls = [
                {"name": str(c.get("function", {}).get("name", "")),
                 "arguments": cut(str(c.get("function", {}).get("arguments", "")))}
                for c in message.tool_calls or ()
            ]
            self._publish(
                "step", step=self._step, tool_calls=calls, content=cut(message.content),
                finish_reason=last.get("finish_reason"), usage=last.get("usage"),
                **({"note": True} if message.note else {}),
            )
        elif message.role == "tool":
            self._publish(
                "tool_result", step=self._step, name=message.name or "", result=cut(message.content),
                ok=bool(message.ok), call=message.tool_call_id,
            )

    def said(self, text: str, *, note: bool = False) -> None:
        self._publish("said", text=cut(text, 4 * 4096), **({"note": True} if note else {}))

    def ended(self, status: str, stop: str | None) -> None:
        self._publish("turn_ended", status=status, stop=stop)

    def _publish(self, kind: str, **data: Any) -> None:
        self._activity.publish(self._key, kind, turn=self._turn, **data)
