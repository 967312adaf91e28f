"""Speech to text and text to speech through the endpoint's OpenAI-compatible audio API.

* Transcription: ``POST <base>/audio/transcriptions`` (multipart: the file and
  ``llm.transcription_model``, default ``whisper-1``). ``<base>`` is
  ``llm.transcription_base_url`` when set (a local whisper server: whisper.cpp's server,
  faster-whisper-server, LocalAI, vLLM), else the chat endpoint's base URL.
* Speech: ``POST <base>/audio/speech`` (``voice.tts_model``, ``voice.tts_voice``) with
  ``response_format: "opus"``, which OpenAI answers as Ogg/Opus: what Telegram's ``sendVoice``
  needs to show a voice message (Bot API, sendVoice: "the audio must be in an .OGG file
  encoded with OPUS").

Each transcription is admitted and recorded by the meter, as chat completions are (kind
``transcription`` under the scope of the turn whose files are read): its tokens when the
endpoint reports ``usage`` (``type: tokens``), the seconds of audio it reports
(``type: duration``), else the length the platform gave, counted as an estimate. A spending
limit that refuses it is a :class:`~bumblebot.core.errors.MediaError` naming the limit and when
it resets. Each voice reply is admitted and recorded too (kind ``speech``, under the scope of
the turn it answers): the endpoint reports nothing, so it counts the estimated tokens of the
text it reads as prompt tokens (priced at the speech model's ``input`` price); a refused one is
a :class:`~bumblebot.core.errors.MediaError`, and the reply goes out as text alone.

Like ``bumblebot/llm/client.py`` for chat completions, this is the one place ``openai``'s audio API is
used, and its errors leave as :class:`~bumblebot.core.errors.MediaError` with a sentence a user can
read (never the key: the SDK's messages are redacted by the caller's log filter, and the
sentence here names only the status). An answer that is not what the API promises (a body that
is not JSON, a ``text`` that is not a string) is such an error too, and a transcript's lone
surrogates become U+FFFD.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai

from bumblebot.core.errors import MediaError, SpendingLimitReached
from bumblebot.core.events import storable_text
from bumblebot.core.messages import estimate_text_tokens
from bumblebot.core.settings import LLMSettings, VoiceSettings
from bumblebot.core.usage import NO_METER, Meter, Scope, Usage, scoped
from bumblebot.llm.completion import int_or_none

log = logging.getLogger(__name__)

#: ``[words](url)``: bounded character classes, no nesting: linear.
_LINK = re.compile(r"\[([^\]\n]{1,300})\]\([^)\s]{1,2000}\)")
_URL = re.compile(r"https?://[^\s)]{1,2000}")
#: Least seconds a transcription may take (``llm.timeout_s`` when that is longer).
TRANSCRIPTION_TIMEOUT_S = 300.0
#: Statuses after which a later try may work (the endpoint down, busy or rate-limited).
_TRANSIENT = frozenset({408, 409, 429, 500, 502, 503, 504})
#: Why a transcription answer that is not what the API promises is not used.
UNREADABLE = "the transcription service gave an answer that could not be read"


class Speech:
    """The audio endpoints.

    Args:
        llm: the ``llm`` section (transcription model and base URL, timeout).
        voice: the ``voice`` section (speech model and voice).
        base_url: the chat endpoint's effective base URL (the default for both).
        api_key: the key (local servers accept any).
        meter: admits each transcription and voice reply and records what it used; default:
            nothing counted.
    """

    def __init__(
        self, llm: LLMSettings, voice: VoiceSettings, *, base_url: str, api_key: str | None, meter: Meter | None = None
    ) -> None:
        self.meter = NO_METER if meter is None else meter
        self.base_url = base_url
        self.llm = llm
        self.voice = voice
        self.transcription_base_url = llm.transcription_base_url or base_url
        key = api_key or "not-needed"
        self._speech = openai.AsyncOpenAI(base_url=base_url, api_key=key, timeout=llm.timeout_s, max_retries=1)
        # a long recording on a CPU whisper server takes minutes: its own, longer timeout
        self.transcription_timeout_s = max(TRANSCRIPTION_TIMEOUT_S, llm.timeout_s)
        self._stt = openai.AsyncOpenAI(
            base_url=self.transcription_base_url, api_key=key, timeout=self.transcription_timeout_s, max_retries=1
        )

    async def aclose(self) -> None:
        await self._speech.close()
        await self._stt.close()

    async def transcribe(self, data: bytes, *, name: str, mime: str, seconds: float | None = None) -> str:
        """The text spoken in ``data`` (an audio file named ``name`` of type ``mime``, ``seconds``
        long when the platform said), stripped; ``""`` when the model heard nothing.

        Raises:
            MediaError: the endpoint refused or failed (``retryable`` for an outage), or a
                spending limit refused the request.
        """
        model = self.llm.transcription_model
        with scoped(kind="transcription") as scope:
            await self._admit(scope, model)
            result = await self._transcribe(data, name=name, mime=mime)
            await self.meter.record(scope, self._usage(result, seconds))
        return result.text

    async def _admit(self, scope: Scope, model: str) -> None:
        """The meter's say before a request.

        Raises:
            MediaError: a spending limit refuses it (the limit, and when it resets).
        """
        try:
            await self.meter.admit(scope, model)
        except SpendingLimitReached as exc:
            raise MediaError(f"{exc.limit} is reached; it resets {exc.resets(time.time())}") from exc

    def _usage(self, result: _Transcript, seconds: float | None) -> Usage:
        """What a transcription used: the tokens or seconds the endpoint reported, else the
        length the platform gave (an estimate)."""
        url, model, usage = self.transcription_base_url, self.llm.transcription_model, result.usage
        kind = getattr(usage, "type", None)
        if kind == "tokens":
            prompt = int_or_none(getattr(usage, "input_tokens", None))
            completion = int_or_none(getattr(usage, "output_tokens", None))
            if prompt is not None and completion is not None:
                return Usage(url, model, prompt=prompt, completion=completion, seconds=seconds or 0.0)
        reported = getattr(usage, "seconds", None) if kind == "duration" else None
        if isinstance(reported, (int, float)) and reported >= 0:
            return Usage(url, model, seconds=float(reported))
        return Usage(url, model, seconds=seconds or 0.0, estimated=True)

    async def _transcribe(self, data: bytes, *, name: str, mime: str) -> _Transcript:
        """One request to ``/audio/transcriptions``: its text and the ``usage`` it reported."""
        try:
            result = await self._stt.audio.transcriptions.create(
                model=self.llm.transcription_model, file=(name or "audio.ogg", data, mime or "application/octet-stream"),
            )
        except openai.APIStatusError as exc:
            log.warning("transcription at %s failed: HTTP %s %s", self.transcription_base_url, exc.status_code, exc.message)
            raise MediaError(
                f"the transcription service refused it (HTTP {exc.status_code})", retryable=exc.status_code in _TRANSIENT
            ) from exc
        except openai.APITimeoutError as exc:  # slow, not down: sending it again would not help
            raise MediaError(f"the transcription took longer than {self.transcription_timeout_s:g} s") from exc
        except openai.APIConnectionError as exc:
            log.warning("transcription at %s failed: %s", self.transcription_base_url, exc)
            raise MediaError("the transcription service could not be reached", retryable=True) from exc
        except openai.APIError as exc:
            raise MediaError("the transcription service failed") from exc
        except (ValueError, RecursionError) as exc:  # a 200 whose body is not the JSON it says it is
            # (or is nested deeper than the JSON reader goes)
            log.warning("transcription at %s: the answer is not JSON (%s)", self.transcription_base_url, exc)
            raise MediaError(UNREADABLE) from exc
        text = getattr(result, "text", None)
        if not isinstance(text, str):  # not JSON at all, no text, or a text that is no string
            log.warning("transcription at %s: the answer holds no text: %.200r", self.transcription_base_url, result)
            raise MediaError(UNREADABLE)
        return _Transcript(storable_text(text).strip(), getattr(result, "usage", None))

    async def synthesize(self, text: str, dest: Path) -> Path:
        """Speak ``text`` (cut to ``voice.max_chars``) into ``dest`` as Ogg/Opus, written
        atomically (a temporary file renamed into place); returns ``dest``.

        Raises:
            MediaError: a spending limit refused it, the endpoint refused or failed, or it
                answered something that is not Ogg audio (``retryable`` for an outage).
        """
        text, model = speakable(text)[: self.voice.max_chars], self.voice.tts_model
        with scoped(kind="speech") as scope:
            await self._admit(scope, model)
            audio = await self._speak(text)
            await self.meter.record(scope, Usage(self.base_url, model, prompt=estimate_text_tokens(text), estimated=True))
        await asyncio.to_thread(_write, dest, audio)
        return dest

    async def _speak(self, text: str) -> bytes:
        """One request to ``/audio/speech``: the Ogg/Opus audio of ``text``."""
        try:
            response = await self._speech.audio.speech.create(
                model=self.voice.tts_model, voice=self.voice.tts_voice, input=text, response_format="opus",
            )
        except openai.APIStatusError as exc:
            log.warning("speech synthesis failed: HTTP %s %s", exc.status_code, exc.message)
            raise MediaError(
                f"the speech service refused it (HTTP {exc.status_code})", retryable=exc.status_code in _TRANSIENT
            ) from exc
        except openai.APIConnectionError as exc:
            raise MediaError("the speech service could not be reached", retryable=True) from exc
        except openai.APIError as exc:
            raise MediaError("the speech service failed") from exc
        audio = response.content
        if not audio.startswith(b"OggS"):
            raise MediaError("the speech service did not answer with Ogg/Opus audio")
        return audio


@dataclass(frozen=True, slots=True)
class _Transcript:
    """A transcription's text and the ``usage`` the endpoint reported (``None``: none)."""

    text: str
    usage: Any


def _write(dest: Path, data: bytes) -> None:
    """``data`` into ``dest`` atomically (a temporary file renamed into place)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".", suffix=".partial")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def speakable(markdown: str) -> str:
    """The model's Markdown as text to read aloud: code blocks and URLs left out, emphasis,
    headings, list and quote marks removed, links read by their words. Linear in the text."""
    out: list[str] = []
    fenced = False
    for line in markdown.splitlines():
        stripped = line.strip()
        if stripped.startswith("```"):
            if not fenced:
                out.append("(code)")
            fenced = not fenced
            continue
        if fenced:
            continue
        stripped = stripped.lstrip("#>").strip()
        if stripped[:2] in ("- ", "* ", "+ "):
            stripped = stripped[2:]
        out.append(stripped)
    text = "\n".join(out)
    text = _LINK.sub(r"\1", text)
    text = _URL.sub("(a link)", text)
    for mark in ("**", "__", "`", "~~"):
        text = text.replace(mark, "")
    return text.strip()
