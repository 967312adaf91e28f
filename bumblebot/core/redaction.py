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


#: What of a chat's Markdown never shows, whatever it holds: a link's destination and title
#: (``](x "t")``, one level of parentheses inside), a reference (``][r]``), an HTML comment.
_NEVER_SHOWN = (("](", ")"), ("][", "]"), ("<!--", "-->"))
#: How far apart a secret's characters may lie and still be it: with more between them, what
#: lies between is the reply's own words, not a disguise.
SPREAD = 4
#: Marks that show as nothing in a chat and may also be characters of a secret (``_`` emphasis).
_MARKS = frozenset("*_~`|")
#: A JSON ``\\uXXXX`` escape, at any depth of JSON inside JSON (``\\\\u0031`` one level down): a
#: model may spell any character of its arguments so.
_JSON_ESCAPE = re.compile(r"\\+u([0-9a-fA-F]{4})")


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
        #: the characters secrets are made of, with and without the marks
        self._alphabet = frozenset("".join(self._secrets))
        self._bare = [(s, "".join(c for c in s if c not in _MARKS)) for s in self._secrets]

    def __bool__(self) -> bool:
        return bool(self._secrets)

    def __call__(self, text: str) -> str:
        """``text`` without a secret (also in its JSON-escaped spellings, and with characters
        written as JSON ``\\uXXXX`` escapes: then the escapes of ``text`` are read first)."""
        for secret in self._spellings:
            if secret in text:
                text = text.replace(secret, MARKER)
        if self._secrets and "\\u" in text:
            text = self._escaped(text)
        return text

    def _escaped(self, text: str) -> str:
        """``text`` without a secret spelled with JSON ``\\uXXXX`` escapes: found where the
        escapes are read, replaced in ``text`` as written (nothing else of it changes)."""
        read, where, last = [], [], 0  # the text read, and where each of its characters was written
        for match in _JSON_ESCAPE.finditer(text):
            read.append(text[last:match.start()])
            where.extend(range(last, match.start()))
            char = _unescaped(match)
            read.append(char)
            if char == match.group():  # kept as written
                where.extend(range(match.start(), match.end()))
            else:
                where.append(match.start())
            last = match.end()
        if not where:
            return text
        read.append(text[last:])
        where.extend(range(last, len(text)))
        seen = "".join(read)
        spans = []
        for secret in self._spellings:
            at = seen.find(secret)
            while at != -1:
                end = at + len(secret) - 1
                spans.append((where[at], _written_end(text, where[end])))
                at = seen.find(secret, at + len(secret))
        for start, end in sorted(_merged(spans), reverse=True):
            text = text[:start] + MARKER + text[end:]
        return text

    def shown(self, text: str) -> str:
        """``text`` as a chat may show it without a secret: also one whose characters are
        interleaved with what a chat shows as nothing (escapes, emphasis and code marks, spaces,
        invisible characters, an empty link or a comment), found in what is left of the text once
        link tails and comments are taken out and only the characters secrets are made of are
        kept (once with the marks ``*_~`|``, once without)."""
        text = self(text)
        if not self._secrets:
            return text
        hidden = _never_shown(text)
        spans: list[tuple[int, int]] = []
        for bare in (False, True):
            # a letter or digit no secret has breaks a match; other characters may lie between
            kept = [
                i for i, c in enumerate(text)
                if not hidden[i] and (c in self._alphabet or c.isalnum()) and not (bare and c in _MARKS)
            ]
            seen = "".join(text[i] if text[i] in self._alphabet else "\x00" for i in kept)
            for secret, without in self._bare:
                wanted = without if bare else secret
                at = seen.find(wanted) if len(wanted) >= MIN_SECRET_CHARS else -1
                while at != -1:
                    start, end = kept[at], kept[at + len(wanted) - 1] + 1
                    if end - start <= SPREAD * len(secret):
                        spans.append((start, end))
                    at = seen.find(wanted, at + 1)
        for start, end in sorted(_merged(spans), reverse=True):
            text = text[:start] + MARKER + text[end:]
        return text

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


def _never_shown(text: str) -> bytearray:
    """Which characters of ``text`` a chat never shows (:data:`_NEVER_SHOWN`), in linear time:
    once an opening has no closing after it, no later one has either."""
    hidden = bytearray(len(text))
    for opening, closing in _NEVER_SHOWN:
        at = text.find(opening)
        while at != -1:
            end = text.find(closing, at + len(opening))
            if end == -1:
                break
            end += len(closing)
            hidden[at:end] = b"\x01" * (end - at)
            at = text.find(opening, end)
    return hidden


def _written_end(text: str, index: int) -> int:
    """The end of the character written at ``index`` of ``text`` (past a JSON escape there)."""
    match = _JSON_ESCAPE.match(text, index) if text[index] == "\\" else None
    return match.end() if match else index + 1


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Overlapping ``(start, end)`` spans joined."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _unescaped(match: re.Match[str]) -> str:
    """A JSON ``\\uXXXX`` escape as its character, unless the character must stay escaped in
    a JSON string (a quote, a backslash, a control character, half a surrogate pair)."""
    char = chr(int(match.group(1), 16))
    return match.group() if char in '"\\' or char < " " or "\ud800" <= char <= "\udfff" else char


#: Nothing to hide (a store or a delivery built without secrets: tests, ``bumblebot trace``).
NO_SECRETS = Redactor(())
