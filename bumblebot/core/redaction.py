"""What keeps the configured secrets from leaving: out of every chat, out of everything stored.

:class:`Redactor` replaces each secret value (the bot tokens, the API key, MCP header and env
values: ``Secrets.values()`` and ``mcp_settings.secret_values``) with :data:`MARKER`, the
marker the logs use. The daemon builds one (``Daemon``) and hands it to the store, which
redacts every text it is given (``bumblebot/store/connection.py``), and to ``Delivery``, which
redacts every text, caption and file name it sends, the streamed previews and the commands'
answers. A secret shorter than :data:`MIN_SECRET_CHARS` is not searched for, as in the logs.

Only the configured values count here. The logs also blank anything shaped like a token or a
key (``bumblebot/core/logs.py``); chats and the history do not, so someone else's key that a
person writes about stays as written.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

#: What stands in for a secret, in the logs, the chats and the database.
MARKER = "[REDACTED]"

#: Secrets shorter than this are not searched for (a key like "1" or "none" for a local
#: server would otherwise blank out ordinary text).
MIN_SECRET_CHARS = 8


#: What a chat's Markdown shows as nothing, so a secret written with it in between its
#: characters still reads as the secret there: a backslash escaping punctuation, emphasis,
#: code and spoiler marks, zero-width characters, HTML comments, the brackets and target of
#: a link (``12\\:AB``, ``12`:`AB``, ``1*2*:AB``, ``12<!-- -->:AB``, ``12[:](x)AB``).
_SHOWN_AS_NOTHING = r"(?:\\(?=[^\w\s])|[*_~`|\u200b-\u200f\u2060\ufeff]|<!--.*?-->|\[|\]\([^)\s]*\))*"
#: A JSON ``\uXXXX`` escape: a model may spell any character of its arguments so.
_JSON_ESCAPE = re.compile(r"\\u([0-9a-fA-F]{4})")


def _spellings(secret: str) -> list[str]:
    """``secret`` as written, and as it reads inside a JSON string, or a JSON string inside
    one (a tool call's arguments in the stored history), when those differ."""
    out = [secret]
    for ascii_only in (True, False):
        once = json.dumps(secret, ensure_ascii=ascii_only)[1:-1]
        twice = json.dumps(once, ensure_ascii=ascii_only)[1:-1]
        out += [s for s in (once, twice) if s not in out]
    return out


class Redactor:
    """Replaces every occurrence of each secret by :data:`MARKER`; cheap when nothing matches
    (one substring search per secret) and a no-op when there is no secret.

    Args:
        secrets: the values to hide; those shorter than :data:`MIN_SECRET_CHARS` are ignored.
    """

    def __init__(self, secrets: Iterable[str]) -> None:
        kept = {s for s in secrets if len(s) >= MIN_SECRET_CHARS}
        #: the values as written, longest first (one that contains another goes whole)
        self._secrets = sorted(kept, key=len, reverse=True)
        self._spellings = sorted({v for s in kept for v in _spellings(s)}, key=len, reverse=True)
        self._shown = re.compile(
            "|".join(_SHOWN_AS_NOTHING.join(re.escape(c) for c in s) for s in self._secrets), re.S
        ) if kept else None

    def __bool__(self) -> bool:
        return bool(self._secrets)

    def __call__(self, text: str) -> str:
        """``text`` without a secret (also in its JSON-escaped spellings, and with characters
        written as JSON ``\\uXXXX`` escapes: then the escapes of ``text`` are read first)."""
        for secret in self._spellings:
            if secret in text:
                text = text.replace(secret, MARKER)
        if self._secrets and "\\u" in text:
            read = _JSON_ESCAPE.sub(_unescaped, text)
            if read != text and any(secret in read for secret in self._spellings):
                return self(read)
        return text

    def shown(self, text: str) -> str:
        """``text`` as a chat may show it without a secret: also one written with Markdown that
        shows as nothing between its characters (:data:`_SHOWN_AS_NOTHING`)."""
        text = self(text)
        return self._shown.sub(MARKER, text) if self._shown is not None else text

    def params(self, params: Any) -> Any:
        """SQL parameters (a sequence or a mapping) with every text redacted, the same object
        when there is nothing to hide."""
        if not self._secrets or not params:
            return params
        if isinstance(params, dict):
            return {k: self(v) if isinstance(v, str) else v for k, v in params.items()}
        return tuple(self(v) if isinstance(v, str) else v for v in params)

    def streamed(self, text: str) -> str:
        """What of ``text``, still being written, may show: redacted, and cut before its end
        when that end is the beginning of a secret (the rest may come with the next piece)."""
        text = self.shown(text)
        end = len(text)
        for secret in self._secrets:
            i = text.find(secret[0], max(0, len(text) - len(secret) + 1))
            while i != -1 and i < end:
                if secret.startswith(text[i:]):
                    end = i
                    break
                i = text.find(secret[0], i + 1)
        return text[:end]


def _unescaped(match: re.Match[str]) -> str:
    """A JSON ``\\uXXXX`` escape as its character, unless the character must stay escaped in
    a JSON string (a quote, a backslash, a control character, half a surrogate pair)."""
    char = chr(int(match.group(1), 16))
    return match.group() if char in '"\\' or char < " " or "\ud800" <= char <= "\udfff" else char


#: Nothing to hide (a store or a delivery built without secrets: tests, ``bumblebot trace``).
NO_SECRETS = Redactor(())
