"""Streaming a ``say`` call: its text read out of the arguments as the model writes them.

A streamed completion delivers a tool call's arguments in fragments of JSON text
(``{"te``, ``xt": "Hel``, ``lo"}``). :class:`JsonStringField` reads the value of one
top-level string field (``text`` for ``say``) out of those fragments as they arrive, decoding
escapes, so the chat can show it before the call is complete. It is a character-level state
machine: each character is looked at once, whatever the fragment sizes (``O(total length)``;
re-parsing the growing prefix on every fragment would be quadratic).

What it accepts is deliberately narrow: the field must be a key of the top-level object and
its value a JSON string. Anything else (the field missing, a number, a malformed document)
simply yields no text; the complete arguments are judged by the agent loop afterwards, as for
any call.
"""

from __future__ import annotations

__all__ = ["JsonStringField"]

_SIMPLE_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}

# states
_SEEK = 0  # outside any string, looking for a key at depth 1
_KEY = 1  # inside a string at depth 1 that is in key position
_OTHER_STRING = 2  # inside some other string (a value, or a nested key)
_AFTER_KEY = 3  # the wanted key was read; expecting ':'
_BEFORE_VALUE = 4  # after the ':'; expecting the opening quote
_VALUE = 5  # inside the wanted string value
_DONE = 6  # the value is complete (or can never come)


class JsonStringField:
    """The value of ``field`` in a JSON object fed in fragments.

    Usage::

        reader = JsonStringField("text")
        reader.feed('{"te')        # -> "" (nothing new)
        reader.feed('xt": "Hel')   # -> "Hel"
        reader.feed('lo\\\\n"}')   # -> "lo\\n"
        reader.value                # "Hello\\n"; reader.complete is True

    Args:
        field: the top-level key whose string value is wanted.
    """

    def __init__(self, field: str) -> None:
        self._field = field
        self._state = _SEEK
        self._depth = 0
        self._escape = False  # the previous character of a string was a backslash
        self._unicode: str | None = None  # hex digits of a \\uXXXX escape read so far
        self._high: int | None = None  # a high surrogate waiting for its pair
        self._key: list[str] = []
        self._key_position = True  # at depth 1, the next string is a key
        self._out: list[str] = []

    @property
    def value(self) -> str:
        """The decoded text of the field so far (``""`` before it starts)."""
        return "".join(self._out)

    @property
    def complete(self) -> bool:
        """The closing quote of the value was read (or the value can no longer come)."""
        return self._state == _DONE

    def feed(self, fragment: str) -> str:
        """Read the next ``fragment`` of the arguments; returns the text it added to the
        value (``""``: none). Work is proportional to ``len(fragment)``."""
        start = len(self._out)
        for ch in fragment:
            if self._state == _DONE:
                break
            self._step(ch)
        return "".join(self._out[start:])

    def _step(self, ch: str) -> None:
        state = self._state
        if state in (_KEY, _OTHER_STRING, _VALUE):
            self._in_string(ch)
        elif state == _SEEK:
            self._structure(ch)
        elif state == _AFTER_KEY:
            if ch == ":":
                self._state = _BEFORE_VALUE
            elif not ch.isspace():
                self._state = _DONE
        elif state == _BEFORE_VALUE:
            if ch == '"':
                self._state = _VALUE
            elif not ch.isspace():
                self._state = _DONE  # the field is not a string

    def _structure(self, ch: str) -> None:
        if ch == '"':
            self._state = _KEY if self._depth == 1 and self._key_position else _OTHER_STRING
            self._key.clear()
        elif ch in "{[":
            self._depth += 1
            self._key_position = ch == "{"
        elif ch in "}]":
            self._depth -= 1
            if self._depth <= 0:
                self._state = _DONE  # the top-level object closed without the field
        elif ch == ":":
            self._key_position = False
        elif ch == ",":
            self._key_position = True

    def _in_string(self, ch: str) -> None:
        if self._unicode is not None:
            self._unicode += ch
            if len(self._unicode) == 4:
                self._emit_code(self._unicode)
                self._unicode = None
            return
        if self._escape:
            self._escape = False
            if ch == "u":
                self._unicode = ""
            else:
                self._emit(_SIMPLE_ESCAPES.get(ch, ch))
            return
        if ch == "\\":
            self._escape = True
        elif ch == '"':
            self._close_string()
        else:
            self._emit(ch)

    def _close_string(self) -> None:
        if self._state == _VALUE:
            self._flush_high()
            self._state = _DONE
        elif self._state == _KEY:
            wanted = "".join(self._key) == self._field
            self._state = _AFTER_KEY if wanted else _SEEK
            self._key_position = False
        else:
            self._state = _SEEK

    def _emit(self, text: str) -> None:
        if self._state == _KEY:
            self._key.append(text)
        elif self._state == _VALUE:
            self._flush_high()
            self._out.append(text)

    def _emit_code(self, digits: str) -> None:
        try:
            code = int(digits, 16)
        except ValueError:
            return  # a broken escape: skipped, the final arguments decide
        if self._state != _VALUE:
            self._emit(chr(code) if not 0xD800 <= code <= 0xDFFF else "")
            return
        if 0xD800 <= code <= 0xDBFF:
            self._flush_high()
            self._high = code
        elif 0xDC00 <= code <= 0xDFFF and self._high is not None:
            self._out.append(chr(0x10000 + ((self._high - 0xD800) << 10) + (code - 0xDC00)))
            self._high = None
        elif not 0xD800 <= code <= 0xDFFF:
            self._flush_high()
            self._out.append(chr(code))

    def _flush_high(self) -> None:
        self._high = None  # a lone surrogate is not text: dropped
