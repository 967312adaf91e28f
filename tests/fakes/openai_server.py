"""A scripted OpenAI-compatible chat-completions server for tests.

Real TCP on 127.0.0.1 (port 0), so the real ``openai.AsyncOpenAI`` client works against it, both
in-process and from a subprocess (e.g. ``bumblebot run``) pointed at :attr:`FakeOpenAI.base_url`.

Usage::

    async with FakeOpenAI() as llm:
        llm.push(tool_calls(("send_message", {"text": "hi"})), when=is_loop)
        llm.push(text("a summary"), when=is_aux)
        client = openai.AsyncOpenAI(base_url=llm.base_url, api_key="sk-test", max_retries=0)
        ...
        await llm.wait_for_requests(2)

Endpoints: ``POST /v1/chat/completions`` and ``GET /v1/models``. Error bodies follow OpenAI's
shape ``{"error": {"message", "type", "code"}}``.

Context window: ``FakeOpenAI(context_window=4096)`` refuses a chat request whose prompt (the
fake's own count, as in ``usage.prompt_tokens``) does not fit, the way ``context_error`` says:
``"llama.cpp"`` (the default; HTTP 400 ``exceed_context_size_error`` with ``n_prompt_tokens`` and
``n_ctx`` in the body, the prompt alone counted) or ``"openai"`` (HTTP 400 "This model's maximum
context length is N tokens. However, you requested …", prompt plus ``max_tokens`` counted, as
vLLM and llama-cpp-python say it); refusals are recorded in ``context_refused``. Where the window
is told is ``tells_window``: ``"props"`` (llama.cpp: ``GET /props``
``default_generation_settings.n_ctx``), ``"models"`` (vLLM: ``max_model_len`` in ``GET /v1/models``),
``"ollama"`` (``POST /api/show``: ``num_ctx`` in ``parameters``, the model's own 131072 in
``model_info``), ``"ollama_running"`` (``GET /api/ps``: the running model's ``context_length``),
``"ollama_default"`` (``/api/show`` with no ``num_ctx``: Ollama's default applies) or ``None``
(told nowhere, as llama-cpp-python's server: those routes answer 404).

Streaming: a request with ``"stream": true`` is answered as server-sent events, the way
OpenAI streams (``chat.completion.chunk`` objects, tool-call arguments in fragments keyed by
``index``, a usage chunk when ``stream_options.include_usage`` is set, then ``data: [DONE]``).
A :class:`Reply` shapes its stream: ``stream_chars`` per fragment, ``stream_delay`` between
chunks, ``stream_hold`` (an :class:`asyncio.Event` awaited after ``stream_hold_after``
chunks), ``stream_cut_after`` (the connection drops after that many chunks) and
``stream_mode`` for endpoints that stream tool calls badly (``"repeat_args"``: every fragment
repeats the arguments so far; ``"text_calls"``: the calls arrive as content text; ``"empty"``:
nothing arrives but a finish reason, as llama-cpp-python streams function calls),
``stream_error_after`` (an ``{"error": …}`` event after that many chunks, as OpenRouter sends
when a provider fails mid-stream) and ``stream_truncated`` (the body ends after half the
chunks, with no finish reason and no ``[DONE]``).
``fail_completions(status, times=None, retry_after=None)`` answers the next ``times``
chat-completions requests (every one until ``stop_failing()`` when ``None``) with ``status``
and an OpenAI error, with a ``Retry-After`` header when given, as a server that is down or
rate-limited does; scripts stay unused.
``reject_tool_choice_required=500`` answers ``tool_choice: "required"`` with that status and
``tool_choice_refusal`` as the message (``""``: a bare 500, as llama-cpp-python's).
``reject_named_tool_choice=400`` answers a ``tool_choice`` naming a tool (an object) with that
status, as servers that take only ``"auto"``, ``"none"`` or ``"required"`` do.
``FakeOpenAI(tokens_per_s=50)`` writes at that pace: a whole answer comes after its completion
tokens at it, each streamed chunk after its own; ``streams_abandoned`` counts the streams the
client closed before their end.
``FakeOpenAI(reject_stream=400)`` refuses every streamed request, as servers without
streaming do; ``streamed`` counts the streamed answers. ``reject_stream_options=400`` refuses
a streamed request that carries ``stream_options`` (naming it), as servers that do not know the
parameter do.

Usage: every answer reports ``usage`` counted from the request and the reply (a quarter of
the JSON's characters). A :class:`Reply`'s ``usage`` is merged over it (e.g.
``{"prompt_tokens_details": {"cached_tokens": 80}, "completion_tokens_details":
{"reasoning_tokens": 12}}``), whole and streamed alike; ``report_usage=False`` sends none, as
servers that count nothing do. ``transcript_usage`` is the ``usage`` of transcriptions
(default ``{"type": "duration", "seconds": 1}``; ``None``: none). ``reject_reasoning_effort=True``
refuses any request carrying ``reasoning_effort`` with the 400 OpenAI gives for a model that
does not reason.

Strictness (on by default, like the strictest real endpoints): a history holding tool-call
arguments that are not a JSON object is refused with 400 (vLLM), and so is a user or
assistant text that shows nothing, e.g. only ``"\u200b"`` (Anthropic through OpenRouter);
both are recorded in ``violations``. Turn off with ``reject_invalid_arguments=False`` /
``reject_blank_text=False``.

Vision: content may be a list of parts (``{"type": "text", "text"}`` and ``{"type":
"image_url", "image_url": {"url": "data:image/png;base64,..."}}``); :func:`mentions` reads the
text parts and :func:`image_parts` returns a request's image URLs. ``reject_images(status=400,
message=...)`` makes every chat-completions request with an ``image_url`` part answer that
OpenAI error (``param`` names the part) without consuming a scripted reply, as a text-only
model does; such requests are still in ``requests``/``request_log`` and also in ``rejected``
and ``images_rejected``. ``accept_images()`` turns it off.

Audio (a second instance serves a separate ``transcription_base_url`` just as well):

- ``POST /v1/audio/transcriptions`` (multipart ``file``, ``model``, optional
  ``response_format``/``language``/``prompt``/``temperature``): answers the next queued
  transcript, ``push_transcript(text)``, or error, ``push_transcript_error(status,
  message)``, or a body as it is, ``push_transcript_body(body, content_type)`` (a server
  answering garbage with a 200); with nothing queued, "fake transcript". ``response_format`` ``json`` (default)
  answers ``{"text"}``, ``verbose_json`` adds ``task``/``language``/``duration``/
  ``segments``, ``text``/``srt``/``vtt`` answer plain text. Records ``transcriptions``:
  dicts ``{model, filename, data, content_type, response_format, language, prompt, headers,
  status}``. A file over 25 MB answers 413; a missing ``file`` or ``model`` 400.
- ``POST /v1/audio/speech`` (JSON ``{model, input, voice, response_format, ...}``): answers
  audio bytes with the format's Content-Type (``mp3`` audio/mpeg, the default; ``opus``
  audio/ogg, bytes starting ``b"OggS"``; ``aac`` audio/aac; ``flac`` audio/flac; ``wav``
  audio/wav; ``pcm`` audio/pcm), or the bytes queued with ``push_speech(data)``. Records
  ``speech_requests`` (the JSON bodies). ``fail_speech(status, message, times=1)`` fails the
  next requests; ``input`` over 4096 characters, or no ``model``/``voice``/``input``,
  answers 400.
- ``wait_for_transcriptions(n)`` / ``wait_for_speech(n)`` wait for arrivals.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

Request = dict[str, Any]
Predicate = Callable[[Request], bool]

_call_ids = itertools.count(1)
_completion_ids = itertools.count(1)
MAX_TRANSCRIPTION_BYTES = 25 * 1024 * 1024  # audio/transcriptions: "File uploads are limited to 25 MB"
MAX_SPEECH_INPUT = 4096  # audio/speech: "The maximum length is 4096 characters"
IMAGE_REJECTION = "Invalid content type. image_url is only supported by certain models."
# speech response_format -> (Content-Type, leading bytes of a plausible file)
SPEECH_FORMATS = {
    "mp3": ("audio/mpeg", b"ID3\x04\x00\x00\x00\x00\x00\x00\xff\xfb\x90\x00"),
    "opus": ("audio/ogg", b"OggS\x00\x02" + b"\x00" * 20 + b"\x01\x13OpusHead\x01\x01"),
    "aac": ("audio/aac", b"\xff\xf1\x50\x80\x02\x1f\xfc"),
    "flac": ("audio/flac", b"fLaC\x00\x00\x00\x22"),
    "wav": ("audio/wav", (b"RIFF\x24\x00\x00\x00WAVEfmt \x10\x00\x00\x00\x01\x00\x01\x00"
                          b"\xc0\x5d\x00\x00\x80\xbb\x00\x00\x02\x00\x10\x00data\x00\x00\x00\x00")),
    "pcm": ("audio/pcm", b"\x00\x00" * 16),
}
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 429: "rate_limit_error"}


@dataclass
class Reply:
    """One scripted answer: HTTP ``status`` plus either an assistant ``message`` or a ``body``."""

    status: int = 200
    message: dict[str, Any] | None = None
    finish_reason: str = "stop"
    body: dict[str, Any] | None = None
    delay: float = 0.0  # seconds awaited before answering (latency injection)
    headers: dict[str, str] | None = None  # extra response headers (e.g. Retry-After)
    stream_chars: int = 6  # characters of content or arguments per streamed chunk
    stream_delay: float = 0.0  # seconds between streamed chunks
    stream_hold: asyncio.Event | None = None  # awaited once ``stream_hold_after`` chunks are out
    stream_hold_after: int = 3
    stream_cut_after: int | None = None  # drop the connection after this many chunks
    stream_mode: str = "normal"  # "repeat_args" | "text_calls": a server that streams calls badly
    stream_error_after: int | None = None  # an error event (OpenRouter style) after this many chunks
    stream_truncated: bool = False  # the body ends cleanly without a finish reason or [DONE]
    stream_empty_body: bool = False  # headers, then a clean end with no data at all
    usage: dict[str, Any] | None = None  # merged over the counted usage (cached, reasoning tokens)
    report_usage: bool = True  # False: the answer carries no usage at all


@dataclass
class RequestRecord:
    """One arrival: monotonic ``time`` (s), ``headers``, JSON ``body``, answered ``status``."""

    time: float
    headers: dict[str, str]
    body: Request
    status: int | None = None


def tool_calls(*calls: tuple[Any, ...], content: str = "", finish_reason: str = "tool_calls",
               delay: float = 0.0, usage: dict[str, Any] | None = None) -> Reply:
    """Reply with tool calls; each call is ``(name, args)`` or ``(name, args, call_id)``.

    Ids default to unique ``call_<n>``; arguments are encoded with ``json.dumps``. Empty
    ``content`` is sent as JSON null, as OpenAI does for tool-call replies.
    """
    encoded = []
    for call in calls:
        name, args = call[0], call[1]
        call_id = call[2] if len(call) > 2 else f"call_{next(_call_ids)}"
        encoded.append({"id": call_id, "type": "function",
                        "function": {"name": name, "arguments": json.dumps(args)}})
    message = {"role": "assistant", "content": content or None, "tool_calls": encoded}
    return Reply(message=message, finish_reason=finish_reason, delay=delay, usage=usage)


def text(content: str, finish_reason: str = "stop", delay: float = 0.0,
         usage: dict[str, Any] | None = None) -> Reply:
    """Reply with a plain assistant message (``usage`` merged over the counted usage)."""
    return Reply(message={"role": "assistant", "content": content},
                 finish_reason=finish_reason, delay=delay, usage=usage)


def error(status: int, message: str = "fake error", delay: float = 0.0,
          body: dict[str, Any] | None = None, headers: dict[str, str] | None = None) -> Reply:
    """Reply with HTTP ``status`` and an OpenAI-style error body (or ``body`` verbatim), plus
    any extra response ``headers``."""
    return Reply(status=status, body=body or _error_body(status, message), delay=delay, headers=headers)


def _error_body(status: int, message: str, code: str | None = None) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "code": code}}


def is_loop(request: Request) -> bool:
    """Predicate: the request offers tools (an agent-loop turn)."""
    return bool(request.get("tools"))


def is_last_chance(request: Request) -> bool:
    """Predicate: one of the loop's tool-less requests for plain words: a last try for an
    answer (``LAST_CHANCE_NUDGE``) or closing words at a limit (``CLOSING_NUDGE``)."""
    return not is_loop(request) and any(
        "[Same turn] No tools now" in _content_text(m.get("content")) for m in request.get("messages", [])
    )


def is_aux(request: Request) -> bool:
    """Predicate: the request offers no tools (an auxiliary call such as compaction)."""
    return not is_loop(request)


def mentions(needle: str) -> Predicate:
    """Predicate factory: some message's content (string or text parts) contains ``needle``."""
    def predicate(request: Request) -> bool:
        return any(needle in _content_text(m.get("content")) for m in request.get("messages", []))
    return predicate


def _content_text(content: Any) -> str:
    """The text of a message's content: a string, or the text parts of a list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(p.get("text", "")) for p in content
                         if isinstance(p, dict) and p.get("type", "text") in ("text", "input_text"))
    return ""


def image_parts(request: Request) -> list[str]:
    """The image URLs (usually ``data:image/...;base64,...``) of a request's ``image_url``
    content parts, in message order."""
    urls = []
    for message in request.get("messages", []):
        content = message.get("content")
        for part in content if isinstance(content, list) else []:
            if isinstance(part, dict) and part.get("type") == "image_url":
                image = part.get("image_url")
                urls.append(str(image.get("url", "") if isinstance(image, dict) else image))
    return urls


def _first_image_param(request: Request) -> str | None:
    for i, message in enumerate(request.get("messages", [])):
        content = message.get("content")
        for j, part in enumerate(content if isinstance(content, list) else []):
            if isinstance(part, dict) and part.get("type") == "image_url":
                return f"messages.[{i}].content.[{j}].type"
    return None


def sequence_violation(messages: list[dict[str, Any]]) -> str | None:
    """Why ``messages`` is not a valid chat sequence, or None if it is.

    OpenAI's rule: the ``role: "tool"`` messages directly following an assistant message with
    ``tool_calls`` must answer exactly those calls, each exactly once; a tool message anywhere
    else is rejected ("messages with role 'tool' must be a response to a preceding message with
    'tool_calls'").
    """
    i = 0
    while i < len(messages):
        message = messages[i]
        if message.get("role") == "tool":
            return (f"messages[{i}]: tool message does not follow an assistant message "
                    "with tool_calls")
        calls = (message.get("tool_calls") or []) if message.get("role") == "assistant" else []
        i += 1
        if not calls:
            continue
        expected = [c.get("id") for c in calls]
        if len(set(expected)) != len(expected):
            return f"messages[{i - 1}]: duplicate tool call ids {expected}"
        answered: list[str] = []
        while i < len(messages) and messages[i].get("role") == "tool":
            call_id = messages[i].get("tool_call_id")
            if call_id not in expected:
                return f"messages[{i}]: tool_call_id {call_id!r} is not among {expected}"
            if call_id in answered:
                return f"messages[{i}]: second result for tool_call_id {call_id!r}"
            answered.append(call_id)
            i += 1
        missing = [c for c in expected if c not in answered]
        if missing:
            return (f"tool calls {missing} have no tool message directly after their "
                    "assistant message")
    return None


def _strict_json(text: str) -> Any:
    def refuse(name: str) -> Any:
        raise ValueError(f"{name} is not valid JSON")
    return json.loads(text, parse_constant=refuse)


def invalid_arguments(messages: list[dict[str, Any]]) -> str | None:
    """Why a history holds tool-call arguments a strict server refuses, or None.

    vLLM reads every tool call's ``arguments`` of the history as JSON when it renders the chat
    template, and answers 400 for one that is not a JSON object (strictly: no ``NaN``)."""
    for i, message in enumerate(messages):
        for call in (message.get("tool_calls") or []) if message.get("role") == "assistant" else []:
            arguments = (call.get("function") or {}).get("arguments")
            try:
                value = _strict_json(arguments if isinstance(arguments, str) else "")
            except (ValueError, RecursionError) as exc:
                return f"messages[{i}]: tool call arguments are not valid JSON ({exc})"
            if not isinstance(value, dict):
                return f"messages[{i}]: tool call arguments are not a JSON object"
    return None


def _shows_nothing(text: str) -> bool:
    import unicodedata
    return all(ch.isspace() or unicodedata.category(ch) in ("Cf", "Cc", "Zs") for ch in text)


def blank_text(messages: list[dict[str, Any]]) -> str | None:
    """Why a request holds a text block an Anthropic model (through OpenRouter) refuses, or None:
    a user message, or an assistant message without tool calls, whose text is empty or only
    whitespace and zero-width characters ("text content blocks must contain non-whitespace text")."""
    for i, message in enumerate(messages):
        role = message.get("role")
        if role not in ("user", "assistant") or (role == "assistant" and message.get("tool_calls")):
            continue
        content = message.get("content")
        if isinstance(content, list):
            if any(p.get("type") != "text" for p in content):
                continue  # an image: not blank
            content = "".join(p.get("text", "") for p in content)
        if isinstance(content, str) and _shows_nothing(content):
            return f"messages[{i}]: text content blocks must contain non-whitespace text"
    return None


@dataclass(frozen=True)
class _RawBody:
    """A transcription answer served as it is (:meth:`FakeOpenAI.push_transcript_body`)."""

    body: str
    content_type: str


class FakeOpenAI:
    """Scripted chat-completions endpoint; see the module docstring.

    Recorded state: ``requests`` (every body, arrival order), ``request_log``
    (:class:`RequestRecord`), ``unscripted``, ``rejected`` (tool_choice, stream and image
    quirks), ``images_rejected`` and ``violations`` (``(reason, body)`` for null content /
    invalid sequence); for audio ``transcriptions`` and ``speech_requests``.
    """

    def __init__(self, models: Iterable[str] = ("test-model", "reflex-model"), *,
                 reject_tool_choice_required: int | None = None,
                 reject_named_tool_choice: int | None = None,
                 reject_null_content: bool = True, validate_sequence: bool = True,
                 default: Callable[[Request], Any] | None = None,
                 reject_stream: int | None = None, reject_invalid_arguments: bool = True,
                 reject_blank_text: bool = True, reject_reasoning_effort: bool = False,
                 reject_stream_options: int | None = None,
                 context_window: int | None = None, tells_window: str | None = "props",
                 context_error: str = "llama.cpp",
                 tool_choice_refusal: str = "tool_choice 'required' is not supported by this endpoint",
                 tokens_per_s: float | None = None) -> None:
        self.models = list(models)
        #: the server's writing speed: a whole answer comes after its completion tokens at this
        #: pace, a streamed chunk after its own (``None``: at once)
        self.tokens_per_s = tokens_per_s
        #: streamed answers whose client closed the connection before their end (the server
        #: stopped writing them there)
        self.streams_abandoned = 0
        #: set when a stream is abandoned so
        self.stream_abandoned = asyncio.Event()
        #: the window chat requests must fit (``None``: any size), where it is told, how refused
        self.context_window = context_window
        self.tells_window = tells_window
        self.context_error = context_error
        self.context_refused: list[Request] = []
        self.tool_choice_refusal = tool_choice_refusal
        #: refuse a streamed request carrying ``stream_options`` with this status
        self.reject_stream_options = reject_stream_options
        #: the ``usage`` of transcription answers (``None``: none)
        self.transcript_usage: dict[str, Any] | None = {"type": "duration", "seconds": 1}
        #: refuse ``reasoning_effort`` with OpenAI's 400, as its models without reasoning do
        self.reject_reasoning_effort = reject_reasoning_effort
        #: refuse a history with tool-call arguments that are not a JSON object (as vLLM does)
        self.reject_invalid_arguments = reject_invalid_arguments
        #: refuse blank user/assistant text (as Anthropic models through OpenRouter do)
        self.reject_blank_text = reject_blank_text
        self.reject_stream = reject_stream
        self.streamed = 0
        #: set each time a streamed answer has sent its first chunk
        self.stream_started = asyncio.Event()
        self.reject_tool_choice_required = reject_tool_choice_required
        self.reject_named_tool_choice = reject_named_tool_choice
        self.reject_null_content = reject_null_content
        self.validate_sequence = validate_sequence
        self.default = default
        self.requests: list[Request] = []
        self.request_log: list[RequestRecord] = []
        self.unscripted: list[Request] = []
        self.rejected: list[Request] = []
        self.violations: list[tuple[str, Request]] = []
        self.images_rejected: list[Request] = []
        self.transcriptions: list[dict[str, Any]] = []
        self.speech_requests: list[Request] = []
        self._image_rejection: tuple[int, str] | None = None
        self._failing: tuple[int, str, dict[str, str], int | None] | None = None  # status, message, headers, times
        self._transcripts: list[tuple[int, Any]] = []  # (status, text, error message or _RawBody)
        self._speech_audio: list[tuple[bytes, str | None]] = []
        self._speech_failures: list[tuple[int, str]] = []
        self._script: list[tuple[Any, Predicate | None]] = []
        self._arrived = asyncio.Condition()
        self._runner: web.AppRunner | None = None
        self.base_url = ""

    @property
    def pending(self) -> int:
        """Scripted replies not consumed yet (assert 0 to prove a script was used up)."""
        return len(self._script)

    def push(self, reply: Any, when: Predicate | None = None) -> None:
        """Queue ``reply`` (a :class:`Reply` or a callable ``request -> reply``) for the first
        request matching ``when`` (any request if None)."""
        self._script.append((reply, when))

    def reject_images(self, status: int = 400, message: str = IMAGE_REJECTION) -> None:
        """From now on answer every chat-completions request holding an ``image_url`` part with
        ``status`` and an OpenAI error ``message`` (a text-only model); scripts stay unused."""
        self._image_rejection = (status, message)

    def accept_images(self) -> None:
        """Undo :meth:`reject_images`."""
        self._image_rejection = None

    def fail_completions(self, status: int = 500, message: str = "fake outage", *, times: int | None = None,
                         retry_after: float | str | None = None) -> None:
        """Answer the next ``times`` chat-completions requests (``None``: every one until
        :meth:`stop_failing`) with ``status`` and an OpenAI error, plus ``Retry-After:
        <retry_after>`` when given; scripts stay unused."""
        headers = {} if retry_after is None else {"Retry-After": str(retry_after)}
        self._failing = (status, message, headers, times)

    def stop_failing(self) -> None:
        """Undo :meth:`fail_completions`."""
        self._failing = None

    def push_transcript(self, text: str) -> None:
        """Queue the text of the next ``audio/transcriptions`` answer."""
        self._transcripts.append((200, text))

    def push_transcript_error(self, status: int, message: str = "fake transcription error") -> None:
        """Queue an error (OpenAI error body) as the next ``audio/transcriptions`` answer."""
        self._transcripts.append((status, message))

    def push_transcript_body(self, body: str, content_type: str = "application/json") -> None:
        """Queue a 200 answer of ``body`` as it is (``'{"text": 12345}'``, ``"<html>oops"``) as
        the next ``audio/transcriptions`` answer."""
        self._transcripts.append((200, _RawBody(body, content_type)))

    def push_speech(self, data: bytes, content_type: str | None = None) -> None:
        """Queue the bytes (and optionally Content-Type) of the next ``audio/speech`` answer."""
        self._speech_audio.append((data, content_type))

    def fail_speech(self, status: int, message: str = "fake speech error", times: int = 1) -> None:
        """Answer the next ``times`` ``audio/speech`` requests with ``status`` and an error."""
        self._speech_failures.extend([(status, message)] * times)

    async def wait_for_transcriptions(self, n: int = 1, timeout: float = 5.0) -> list[dict[str, Any]]:
        """Wait until ``n`` transcription requests arrived; return them. AssertionError on timeout."""
        await self._wait_count(lambda: len(self.transcriptions), n, timeout, "transcription requests")
        return list(self.transcriptions)

    async def wait_for_speech(self, n: int = 1, timeout: float = 5.0) -> list[Request]:
        """Wait until ``n`` speech requests arrived; return them. AssertionError on timeout."""
        await self._wait_count(lambda: len(self.speech_requests), n, timeout, "speech requests")
        return list(self.speech_requests)

    async def _wait_count(self, count: Callable[[], int], n: int, timeout: float, what: str) -> None:
        try:
            async with asyncio.timeout(timeout):
                async with self._arrived:
                    await self._arrived.wait_for(lambda: count() >= n)
        except TimeoutError:
            raise AssertionError(f"FakeOpenAI: expected {n} {what} within {timeout}s, "
                                 f"got {count()}") from None

    async def wait_for_requests(self, n: int, timeout: float = 5.0) -> list[Request]:
        """Wait until at least ``n`` requests arrived; return them. AssertionError on timeout."""
        try:
            async with asyncio.timeout(timeout):
                async with self._arrived:
                    await self._arrived.wait_for(lambda: len(self.requests) >= n)
        except TimeoutError:
            raise AssertionError(f"FakeOpenAI: expected {n} requests within {timeout}s, "
                                 f"got {len(self.requests)}") from None
        return list(self.requests)

    async def __aenter__(self) -> FakeOpenAI:
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_post("/v1/chat/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/props", self._props)
        app.router.add_get("/api/ps", self._ollama_ps)
        app.router.add_post("/api/show", self._ollama_show)
        app.router.add_post("/v1/audio/transcriptions", self._transcription)
        app.router.add_post("/v1/audio/speech", self._speech)
        self._runner = web.AppRunner(app, shutdown_timeout=0.25, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        port = self._runner.addresses[0][1]
        self.base_url = f"http://127.0.0.1:{port}/v1"
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _models(self, _request: web.Request) -> web.Response:
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "fake"} for m in self.models]
        if self.context_window and self.tells_window == "models":
            data = [{**d, "max_model_len": self.context_window} for d in data]
        return web.json_response({"object": "list", "data": data})

    def _tells(self, where: str) -> bool:
        return self.context_window is not None and self.tells_window == where

    async def _props(self, _request: web.Request) -> web.Response:
        if not self._tells("props"):
            return web.json_response({"error": {"code": 404, "message": "File Not Found"}}, status=404)
        return web.json_response({"default_generation_settings": {"n_ctx": self.context_window, "params": {}},
                                  "total_slots": 1, "model_path": "fake.gguf"})

    async def _ollama_ps(self, _request: web.Request) -> web.Response:
        if not self._tells("ollama_running"):
            return web.Response(status=404, text="404 page not found")
        return web.json_response({"models": [{"name": f"{m}:latest", "model": f"{m}:latest",
                                              "context_length": self.context_window} for m in self.models]})

    async def _ollama_show(self, http: web.Request) -> web.Response:
        if not (self._tells("ollama") or self._tells("ollama_default")):
            return web.Response(status=404, text="404 page not found")
        body = await http.json()
        parameters = f"num_ctx                        {self.context_window}\nstop \"<|im_end|>\"" \
            if self.tells_window == "ollama" else 'stop "<|im_end|>"'
        return web.json_response({"modelfile": "", "parameters": parameters, "template": "",
                                  "model_info": {"general.architecture": "qwen2", "qwen2.context_length": 131072},
                                  "details": {"family": "qwen2"}, "model": body.get("model")})

    def _too_long(self, body: Request) -> Reply | None:
        """The refusal of a request over ``context_window`` (module docstring), else ``None``."""
        if self.context_window is None:
            return None
        prompt = self._prompt_tokens(body)
        wanted = prompt + int(body.get("max_tokens") or 0) if self.context_error == "openai" else prompt
        if wanted <= self.context_window and prompt < self.context_window:
            return None
        self.context_refused.append(body)
        if self.context_error == "openai":
            message = (f"This model's maximum context length is {self.context_window} tokens. However, you requested "
                       f"{wanted} tokens ({prompt} in the messages, {body.get('max_tokens')} in the completion). "
                       "Please reduce the length of the messages or completion.")
            return error(400, message, body={"error": {"message": message, "type": "invalid_request_error",
                                                       "param": "messages", "code": "context_length_exceeded"}})
        return error(400, body={"error": {"code": 400, "message": "the request exceeds the available context size, try "
                                          "increasing it", "type": "exceed_context_size_error",
                                          "n_prompt_tokens": prompt, "n_ctx": self.context_window}})

    async def _transcription(self, http: web.Request) -> web.Response:
        form = await http.post()
        upload = form.get("file")
        data, filename, ctype = b"", None, None
        if isinstance(upload, web.FileField):
            data, filename, ctype = upload.file.read(), upload.filename, upload.content_type
        elif isinstance(upload, (str, bytes, bytearray)):
            data = upload.encode() if isinstance(upload, str) else bytes(upload)
        fields = {k: v for k, v in form.items() if isinstance(v, str)}
        response_format = fields.get("response_format") or "json"
        record: dict[str, Any] = {
            "model": fields.get("model"), "filename": filename, "data": data,
            "content_type": ctype, "response_format": response_format,
            "language": fields.get("language"), "prompt": fields.get("prompt"),
            "headers": dict(http.headers), "status": None}
        async with self._arrived:
            self.transcriptions.append(record)
            self._arrived.notify_all()
        if upload is None or not fields.get("model"):
            missing = "file" if upload is None else "model"
            status, text_ = 400, f"you must provide a {missing} parameter"
        elif len(data) > MAX_TRANSCRIPTION_BYTES:
            status = 413
            text_ = f"Maximum content size limit ({MAX_TRANSCRIPTION_BYTES}) exceeded ({len(data)} bytes read)"
        else:
            status, text_ = self._transcripts.pop(0) if self._transcripts else (200, "fake transcript")
        record["status"] = status
        if isinstance(text_, _RawBody):
            return web.Response(text=text_.body, content_type=text_.content_type)
        if status != 200:
            return web.json_response(_error_body(status, text_), status=status)
        if response_format in ("text", "srt", "vtt"):
            if response_format == "srt":
                text_ = f"1\n00:00:00,000 --> 00:00:01,000\n{text_}\n"
            elif response_format == "vtt":
                text_ = f"WEBVTT\n\n00:00:00.000 --> 00:00:01.000\n{text_}\n"
            return web.Response(text=text_, content_type="text/plain")
        if response_format == "verbose_json":
            return web.json_response({
                "task": "transcribe", "language": fields.get("language") or "english",
                "duration": 1.0, "text": text_,
                "segments": [{"id": 0, "seek": 0, "start": 0.0, "end": 1.0, "text": text_,
                              "tokens": [], "temperature": 0.0, "avg_logprob": -0.1,
                              "compression_ratio": 1.0, "no_speech_prob": 0.0}]})
        answer: dict[str, Any] = {"text": text_}
        if self.transcript_usage is not None:
            answer["usage"] = self.transcript_usage
        return web.json_response(answer)

    async def _speech(self, http: web.Request) -> web.Response:
        body: Request = await http.json()
        async with self._arrived:
            self.speech_requests.append(body)
            self._arrived.notify_all()
        if self._speech_failures:
            status, message = self._speech_failures.pop(0)
            return web.json_response(_error_body(status, message), status=status)
        missing = [k for k in ("model", "input", "voice") if not body.get(k)]
        if missing:
            return web.json_response(_error_body(400, f"Missing required parameter: '{missing[0]}'."),
                                     status=400)
        if len(str(body["input"])) > MAX_SPEECH_INPUT:
            return web.json_response(_error_body(
                400, f"[{{'type': 'string_too_long', 'loc': ('body', 'input'), 'msg': 'String "
                     f"should have at most {MAX_SPEECH_INPUT} characters'}}]"), status=400)
        fmt = body.get("response_format") or "mp3"
        if fmt not in SPEECH_FORMATS:
            return web.json_response(_error_body(
                400, f"Invalid value: '{fmt}'. Supported values are: {', '.join(SPEECH_FORMATS)}."),
                status=400)
        ctype, header = SPEECH_FORMATS[fmt]
        if self._speech_audio:
            data, queued_type = self._speech_audio.pop(0)
            ctype = queued_type or ctype
        else:
            data = header + str(body["input"]).encode()[:64]
        return web.Response(body=data, headers={"Content-Type": ctype})

    async def _completions(self, http: web.Request) -> web.StreamResponse:
        body: Request = await http.json()
        record = RequestRecord(time.monotonic(), dict(http.headers), body)
        async with self._arrived:
            self.requests.append(body)
            self.request_log.append(record)
            self._arrived.notify_all()
        reply = await self._answer(body)
        if reply.delay:
            await asyncio.sleep(reply.delay)
        record.status = reply.status
        if reply.status != 200:
            return web.json_response(reply.body, status=reply.status, headers=reply.headers)
        if body.get("stream"):
            return await self._stream(http, body, reply)
        answer = reply.body or self._completion(body, reply)
        if self.tokens_per_s:
            await asyncio.sleep(answer.get("usage", {}).get("completion_tokens", 1) / self.tokens_per_s)
        return web.json_response(answer)

    async def _stream(self, http: web.Request, body: Request, reply: Reply) -> web.StreamResponse:
        """Answer ``reply`` as server-sent events, chunk by chunk (module docstring)."""
        full = self._completion(body, reply)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(http)
        self.streamed += 1
        sent = 0
        if reply.stream_empty_body:  # llama-cpp-python when its handler raised after the headers
            await response.write_eof()
            return response
        chunks = _chunks(full, reply)
        if reply.stream_truncated:
            chunks = chunks[: max(1, len(chunks) // 2)]
        for chunk in chunks:
            if reply.stream_error_after is not None and sent >= reply.stream_error_after:
                event = {"error": {"message": "Provider returned error", "code": 502}}
                await response.write(f"data: {json.dumps(event)}\n\n".encode())
                await response.write_eof()
                return response
            if reply.stream_cut_after is not None and sent >= reply.stream_cut_after:
                assert http.transport is not None
                http.transport.close()  # the server died mid-stream
                return response
            if reply.stream_hold is not None and sent == reply.stream_hold_after:
                await reply.stream_hold.wait()
            elif sent and reply.stream_delay:
                await asyncio.sleep(reply.stream_delay)
            if self.tokens_per_s:
                await asyncio.sleep(max(1, len(_delta_text(chunk)) // 4) / self.tokens_per_s)
            try:
                await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
            except ConnectionResetError:  # the client closed it: a real server stops generating
                self.streams_abandoned += 1
                self.stream_abandoned.set()
                return response
            sent += 1
            if sent == 1:
                self.stream_started.set()
        if reply.stream_truncated:
            await response.write_eof()
            return response
        if (body.get("stream_options") or {}).get("include_usage") and "usage" in full:
            usage = {**_chunk_base(full), "choices": [], "usage": full["usage"]}
            await response.write(f"data: {json.dumps(usage)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _answer(self, body: Request) -> Reply:
        if self._failing is not None:
            status, message, headers, times = self._failing
            self._failing = None if times == 1 else (status, message, headers, None if times is None else times - 1)
            return error(status, message, headers=headers)
        if self.reject_null_content and any(
                "content" in m and m["content"] is None for m in body.get("messages", [])):
            return self._violation("a message has null content", body)
        reason = sequence_violation(body.get("messages", [])) if self.validate_sequence else None
        if reason:
            return self._violation(reason, body)
        reason = invalid_arguments(body.get("messages", [])) if self.reject_invalid_arguments else None
        reason = reason or (blank_text(body.get("messages", [])) if self.reject_blank_text else None)
        if reason:
            return self._violation(reason, body)
        param = _first_image_param(body) if self._image_rejection else None
        if self._image_rejection and param:
            self.rejected.append(body)
            self.images_rejected.append(body)
            status, message = self._image_rejection
            error_body = _error_body(status, message)
            error_body["error"]["param"] = param
            return Reply(status=status, body=error_body)
        if self.reject_reasoning_effort and "reasoning_effort" in body:
            self.rejected.append(body)
            error_body = _error_body(400, "Unsupported parameter: 'reasoning_effort' is not supported with this model.",
                                     "unsupported_parameter")
            error_body["error"]["param"] = "reasoning_effort"
            return Reply(status=400, body=error_body)
        if self.reject_stream and body.get("stream"):
            self.rejected.append(body)
            return error(self.reject_stream, "stream: streaming is not supported by this server")
        if self.reject_stream_options and body.get("stream") and "stream_options" in body:
            self.rejected.append(body)
            return error(self.reject_stream_options, "Unrecognized request argument supplied: stream_options")
        if self.reject_tool_choice_required and body.get("tool_choice") == "required":
            # before the window: llama-cpp-python fails a forced request whatever its length
            self.rejected.append(body)
            status = self.reject_tool_choice_required
            return error(status, body=_error_body(status, self.tool_choice_refusal))
        if self.reject_named_tool_choice and isinstance(body.get("tool_choice"), dict):
            self.rejected.append(body)
            return error(self.reject_named_tool_choice, "tool_choice must be one of 'auto', 'none' or 'required'")
        too_long = self._too_long(body)
        if too_long is not None:
            return too_long
        for index, (reply, when) in enumerate(self._script):
            if when is None or when(body):
                del self._script[index]
                return await _resolve(reply, body)
        if self.default is not None:
            return await _resolve(self.default, body)
        self.unscripted.append(body)
        return error(500, "unscripted request")

    def _violation(self, reason: str, body: Request) -> Reply:
        self.violations.append((reason, body))
        return Reply(status=400, body=_error_body(400, f"Invalid 'messages': {reason}",
                                                  "invalid_request_error"))

    @staticmethod
    def _prompt_tokens(body: Request) -> int:
        """The prompt's tokens as this server counts them: a real server counts the tool
        schemas too (they are part of the prompt)."""
        return (len(json.dumps(body.get("messages", []))) + len(json.dumps(body.get("tools", [])))) // 4

    def _completion(self, body: Request, reply: Reply) -> dict[str, Any]:
        message = dict(reply.message or {"role": "assistant", "content": ""})
        if not message.get("tool_calls"):
            message.pop("tool_calls", None)
        prompt_tokens = self._prompt_tokens(body)
        completion_tokens = max(1, len(json.dumps(message)) // 4)
        answer = {
            "id": f"chatcmpl-fake{next(_completion_ids)}", "object": "chat.completion",
            "created": int(time.time()), "model": body.get("model", "unknown"),
            "choices": [{"index": 0, "message": message, "finish_reason": reply.finish_reason,
                         "logprobs": None}],
        }
        if reply.report_usage:
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}
            usage.update(reply.usage or {})
            usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
            answer["usage"] = usage
        return answer


def _delta_text(chunk: dict[str, Any]) -> str:
    """The text a streamed chunk carries: content, and tool-call arguments."""
    delta = chunk["choices"][0]["delta"] if chunk.get("choices") else {}
    calls = "".join(str((c.get("function") or {}).get("arguments") or "") for c in delta.get("tool_calls") or ())
    return str(delta.get("content") or "") + calls


def _chunk_base(full: dict[str, Any]) -> dict[str, Any]:
    return {"id": full["id"], "object": "chat.completion.chunk", "created": full["created"], "model": full["model"]}


def _pieces(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), max(1, size))]


def _chunks(full: dict[str, Any], reply: Reply) -> list[dict[str, Any]]:
    """The ``chat.completion.chunk`` objects of a streamed ``full`` completion."""
    choice = full["choices"][0]
    message = choice["message"]
    size = reply.stream_chars

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {**_chunk_base(full), "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}

    out = [chunk({"role": "assistant", "content": ""})]
    content = message.get("content") or ""
    calls = message.get("tool_calls") or []
    if reply.stream_mode == "empty":  # llama-cpp-python's chatml-function-calling, streamed
        return [out[0], chunk({}, "stop")]
    if reply.stream_mode == "text_calls" and calls:
        content += "".join(
            f'<tool_call>{{"name": "{c["function"]["name"]}", "arguments": {c["function"]["arguments"]}}}</tool_call>'
            for c in calls
        )
        calls = []
    out += [chunk({"content": piece}) for piece in _pieces(content, size)]
    for index, call in enumerate(calls):
        fn = call["function"]
        out.append(chunk({"tool_calls": [{"index": index, "id": call["id"], "type": "function",
                                          "function": {"name": fn["name"], "arguments": ""}}]}))
        so_far = ""
        for piece in _pieces(fn["arguments"], size):
            so_far += piece
            fragment = so_far if reply.stream_mode == "repeat_args" else piece
            out.append(chunk({"tool_calls": [{"index": index, "function": {"arguments": fragment}}]}))
    finish = choice["finish_reason"]
    if reply.stream_mode == "text_calls" and finish == "tool_calls":
        finish = "stop"
    out.append(chunk({}, finish))
    return out


async def _resolve(reply: Any, body: Request) -> Reply:
    """Call dynamic replies (sync or async) until a :class:`Reply` comes out."""
    while not isinstance(reply, Reply):
        if not callable(reply):
            raise TypeError(f"FakeOpenAI: a reply must be a Reply or a callable, got {reply!r}")
        reply = reply(body)
        if inspect.isawaitable(reply):
            reply = await reply
    return reply
