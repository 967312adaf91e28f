"""The endpoint's real context window: asked where the server tells it, read from its
context-length refusals, and remembered per endpoint and model.

Servers run a model with a window of their own (llama.cpp ``-c``, vLLM ``--max-model-len``,
Ollama ``num_ctx``), often much smaller than what Bumblebot assumes (``cognition.max_context_tokens``,
32,768 by default). :class:`Windows` learns it:

* **asked** (:meth:`Windows.ask`, by the daemon at start and by ``bumblebot check``), each a
  short GET or POST that a server without it answers 404:

  - llama.cpp server: ``GET <root>/props``, ``default_generation_settings.n_ctx`` (a slot's
    context: what one request may use), else a top-level ``n_ctx``;
  - vLLM (and OpenRouter, Groq…): ``GET <base_url>/models``, the model's ``max_model_len``
    (``context_length``, ``context_window``);
  - Ollama: the running model's ``context_length`` in ``GET <root>/api/ps``, else ``num_ctx``
    from the model's parameters (``POST <root>/api/show``). Neither: Ollama runs the model with
    its default ``num_ctx`` (:data:`OLLAMA_DEFAULT_NUM_CTX` on most machines, ``OLLAMA_CONTEXT_LENGTH``
    when set), not with the model's own ``<arch>.context_length``, and silently drops the start
    of a longer prompt; so that default is **assumed** (capped by the model's length), marked
    so: a window the operator configured wins over an assumption, never over what a server said.

  ``<root>`` is the base URL without its ``/v1``. llama-cpp-python's server tells none of these.
* **read from a refusal** (:meth:`Windows.refused`, :func:`window_in_refusal`): "maximum
  context length is 4096 tokens" (OpenAI, vLLM, llama-cpp-python, OpenRouter), llama.cpp's
  ``exceed_context_size_error`` body with its ``n_ctx``, and the like.

What is learned is remembered in the store's ``kv`` (:func:`window_key`) as JSON
``{"tokens", "source", "since", "assumed"}``, so a restart starts with it, and forgotten after
:data:`WINDOW_RETRY_S` (a server restarted with a bigger window is then believed again); each
answer of the server at start renews it. Listeners (:meth:`Windows.listen`) hear each change:
the daemon's :class:`~bumblebot.cognition.budget.ContextBudget` sizes every later request by the
smallest window of every endpoint that may answer it (:class:`WindowSet`: the primary's models,
and each fallback's).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from bumblebot.llm.capabilities import CapabilityMemory, duration

log = logging.getLogger(__name__)

#: Seconds a learned window is kept without the endpoint saying it again.
WINDOW_RETRY_S = 24 * 3600.0
#: Seconds each question to the endpoint may take, and all of them together (turns wait for
#: the asking at start: a server that hangs costs no more).
ASK_TIMEOUT_S = 5.0
ASK_TOTAL_S = 10.0
#: The context Ollama runs a model with when neither the model's parameters nor the running
#: model say otherwise (its default on machines with under 24 GiB of VRAM).
OLLAMA_DEFAULT_NUM_CTX = 4096
#: Windows smaller than this are not believed (a misread number, not a model's context).
MIN_WINDOW = 256

#: The window a refusal states, by server.
_REFUSAL_RES = (
    re.compile(r"maximum context length is (\d+)", re.IGNORECASE),  # OpenAI, vLLM, llama-cpp-python, OpenRouter
    re.compile(r"(\d+) maximum context length", re.IGNORECASE),  # Mistral
    re.compile(r"context length of only (\d+)", re.IGNORECASE),  # LM Studio
    re.compile(r"context window of (\d+)", re.IGNORECASE),  # llama-cpp-python's own words
    re.compile(r"must be <= (\d+)", re.IGNORECASE),  # text-generation-inference
    re.compile(r"tokens? > (\d+) maximum", re.IGNORECASE),  # Anthropic through a proxy
    re.compile(r"maximum number of tokens allowed \((\d+)\)", re.IGNORECASE),  # Gemini
)


def window_key(base_url: str, model: str) -> str:
    """The ``kv`` key of the window learned for ``model`` at ``base_url``."""
    return f"llm.window:{base_url}|{model}"


@dataclass(frozen=True, slots=True)
class LearnedWindow:
    """A model's context window as the endpoint showed it.

    Args:
        tokens: the window, prompt and reply together.
        source: where it was learned ("/props", "a context-length refusal"…), for the log and
            ``bumblebot check``.
        since: when, epoch seconds.
        assumed: not said by the server but inferred (Ollama's default ``num_ctx``): a
            configured window wins over it.
    """

    tokens: int
    source: str
    since: float = 0.0
    assumed: bool = False

    @classmethod
    def parse(cls, raw: str | None) -> LearnedWindow | None:
        """The window a ``kv`` value records, ``None`` when it records none."""
        if not raw:
            return None
        try:
            data = json.loads(raw)
            tokens = data["tokens"]
        except (ValueError, TypeError, KeyError):
            return None
        if not isinstance(tokens, int) or tokens < MIN_WINDOW:
            return None
        since = data.get("since")
        return cls(
            tokens, str(data.get("source") or "not recorded"), float(since) if isinstance(since, int | float) else 0.0,
            bool(data.get("assumed")),
        )

    def dump(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False)

    def describe(self) -> str:
        """``4096 tokens (from /props)``, or ``4096 tokens (assumed: …)``."""
        return f"{self.tokens} tokens ({'assumed: ' if self.assumed else 'from '}{self.source})"


def window_in_refusal(message: str, body: object = None) -> int | None:
    """The window a context-length refusal states: llama.cpp's ``n_ctx`` in its error body
    (``{"error": {"type": "exceed_context_size_error", "n_prompt_tokens", "n_ctx"}}``), else a
    number its message gives (:data:`_REFUSAL_RES`). ``None``: it says none."""
    error = body.get("error", body) if isinstance(body, dict) else None
    n_ctx = error.get("n_ctx") if isinstance(error, dict) else None
    if isinstance(n_ctx, int) and n_ctx >= MIN_WINDOW:
        return n_ctx
    for pattern in _REFUSAL_RES:
        found = pattern.search(message)
        if found and int(found.group(1)) >= MIN_WINDOW:
            return int(found.group(1))
    return None


def server_root(base_url: str) -> str:
    """The server's own root: the base URL without its trailing ``/v1``."""
    base = base_url.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


class Windows:
    """What one endpoint has shown of its models' context windows (module docstring).

    Args:
        memory: where they are remembered (the store's ``kv`` in production).
        base_url: the endpoint.
        api_key: sent to the endpoint's own routes as it is to the chat completions.
        clock: the wall clock, epoch seconds.
    """

    def __init__(
        self, memory: CapabilityMemory, base_url: str, api_key: str | None, clock: Callable[[], float]
    ) -> None:
        self.memory = memory
        self.base_url = base_url
        self._api_key = api_key
        self._clock = clock
        self._known: dict[str, LearnedWindow] = {}
        self._listeners: list[Callable[[], None]] = []

    def listen(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` after each change of a known window."""
        self._listeners.append(callback)

    def get(self, model: str) -> LearnedWindow | None:
        """The window known for ``model`` (after :meth:`load`, :meth:`ask` or a refusal)."""
        return self._known.get(model)

    async def load(self, models: list[str]) -> None:
        """Read the windows remembered for ``models``; one older than :data:`WINDOW_RETRY_S` is forgotten."""
        for model in dict.fromkeys(models):
            known = LearnedWindow.parse(await self.memory.get(window_key(self.base_url, model)))
            if known is not None and self._clock() - known.since >= WINDOW_RETRY_S:
                await self.memory.clear(window_key(self.base_url, model))
                log.info("endpoint %s: forgetting the window learned for %s %s ago", self.base_url, model,
                         duration(self._clock() - known.since))
                known = None
            if known is not None:
                self._known[model] = known
        self._changed()

    async def ask(self, models: list[str]) -> dict[str, LearnedWindow | None]:
        """Ask the endpoint the window of each of ``models`` and remember what it says; an
        assumption never replaces a window a server said. Returns what it said (``None``:
        nothing, or it could not be asked); it never raises."""
        said: dict[str, LearnedWindow | None] = {}
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        try:
            async with asyncio.timeout(ASK_TOTAL_S), httpx.AsyncClient(timeout=ASK_TIMEOUT_S, headers=headers) as http:
                for model in dict.fromkeys(models):
                    said[model] = found = await self._ask_one(http, model)
                    known = self._known.get(model)
                    if found is not None and not (found.assumed and known is not None and not known.assumed):
                        await self._remember(model, found)
        except TimeoutError:
            log.info("endpoint %s: no answer about its context window within %g s", self.base_url, ASK_TOTAL_S)
        except Exception:  # noqa: BLE001 - asking is a courtesy; the refusals teach the rest
            log.exception("endpoint %s: asking its context window failed", self.base_url)
        return said

    async def refused(self, model: str, tokens: int) -> None:
        """The endpoint refused a request to ``model`` as too long, stating its window ``tokens``."""
        known = self._known.get(model)
        if known is not None and known.tokens == tokens and not known.assumed:
            return
        await self._remember(model, LearnedWindow(tokens, "a context-length refusal", self._clock()))

    async def _remember(self, model: str, window: LearnedWindow) -> None:
        known = self._known.get(model)
        self._known[model] = window
        await self.memory.set(window_key(self.base_url, model), window.dump())
        if known is None or known.tokens != window.tokens:
            log.info("endpoint %s: the context window of %s is %s", self.base_url, model, window.describe())
        self._changed()

    def _changed(self) -> None:
        for callback in self._listeners:
            callback()

    async def _ask_one(self, http: httpx.AsyncClient, model: str) -> LearnedWindow | None:
        """The window of ``model`` as the first route that knows it says."""
        root, now = server_root(self.base_url), self._clock()
        props = await _json(http.get(f"{root}/props", params={"model": model}))
        if isinstance(props, dict):
            settings = props.get("default_generation_settings")
            n_ctx = settings.get("n_ctx") if isinstance(settings, dict) else None
            tokens = _tokens(n_ctx if n_ctx is not None else props.get("n_ctx"))
            if tokens:
                return LearnedWindow(tokens, "/props", now)
        listed = await _json(http.get(f"{self.base_url.rstrip('/')}/models"))
        for entry in listed.get("data") or () if isinstance(listed, dict) else ():
            if isinstance(entry, dict) and entry.get("id") == model:
                for field in ("max_model_len", "context_length", "context_window"):
                    if tokens := _tokens(entry.get(field)):
                        return LearnedWindow(tokens, f"/models {field}", now)
        return await self._ask_ollama(http, root, model, now)

    @staticmethod
    async def _ask_ollama(http: httpx.AsyncClient, root: str, model: str, now: float) -> LearnedWindow | None:
        """Ollama: the running model's context, else the model's ``num_ctx``, else its default assumed."""
        running = await _json(http.get(f"{root}/api/ps"))
        for entry in running.get("models") or () if isinstance(running, dict) else ():
            names = {entry.get("name"), entry.get("model")} if isinstance(entry, dict) else set()
            if (model in names or f"{model}:latest" in names) and (tokens := _tokens(entry.get("context_length"))):
                return LearnedWindow(tokens, "/api/ps (the running model)", now)
        shown = await _json(http.post(f"{root}/api/show", json={"model": model, "name": model}))
        if not isinstance(shown, dict):
            return None
        parameters = shown.get("parameters")
        found = re.search(r"^\s*num_ctx\s+(\d+)", parameters, re.MULTILINE) if isinstance(parameters, str) else None
        if found and (tokens := _tokens(int(found.group(1)))):
            return LearnedWindow(tokens, "/api/show num_ctx", now)
        info = shown.get("model_info")
        lengths = [v for k, v in info.items() if k.endswith(".context_length")] if isinstance(info, dict) else []
        longest = _tokens(lengths[0]) if lengths else None
        if longest is None:
            return None
        return LearnedWindow(
            min(longest, OLLAMA_DEFAULT_NUM_CTX),
            f"Ollama's default num_ctx; the model allows {longest} (set num_ctx or OLLAMA_CONTEXT_LENGTH, "
            "and cognition.max_context_tokens to match)", now, assumed=True,
        )


class WindowSet:
    """The windows of every endpoint that may answer a request, each for the models it is asked
    for there (``Endpoints``: the primary's, its ``background_model`` too, and each fallback's):
    a request is sized for the smallest known, since a fallback with a smaller window would
    refuse what the primary takes (``docs/models.md``, "Fallback endpoints").

    Args:
        members: ``(windows, models)`` per endpoint, the primary first.
    """

    def __init__(self, members: list[tuple[Windows, list[str]]]) -> None:
        self.members = [(windows, list(dict.fromkeys(models))) for windows, models in members]

    def listen(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` after each change of a window of any endpoint (a refusal included)."""
        for windows, _ in self.members:
            windows.listen(callback)

    async def load(self) -> None:
        """Read what each endpoint's windows were remembered as (:meth:`Windows.load`)."""
        for windows, models in self.members:
            await windows.load(models)

    async def ask(self) -> None:
        """Ask every endpoint at once (:meth:`Windows.ask`, each bounded by :data:`ASK_TOTAL_S`)."""
        await asyncio.gather(*(windows.ask(models) for windows, models in self.members))

    def smallest(self, *, assumed: bool = True) -> tuple[str, LearnedWindow, bool] | None:
        """The smallest window known, with whose it is (the model, ``at <base_url>`` for a
        fallback's), and whether it is a fallback's; ``assumed``: windows only assumed (Ollama's
        default) count too, the primary's only (a fallback's guess never shrinks what the primary
        is sent)."""
        known = [
            (model if position == 0 else f"{model} at {windows.base_url}", window, position > 0)
            for position, (windows, models) in enumerate(self.members) for model in models
            if (window := windows.get(model)) is not None and (not window.assumed or (assumed and position == 0))
        ]
        return min(known, key=lambda found: found[1].tokens, default=None)


def _tokens(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= MIN_WINDOW else None


async def _json(request: Any) -> Any:
    """The JSON of a response to ``request`` (an awaitable), ``None`` when it failed or is not JSON."""
    try:
        response = await request
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    try:
        return response.json()
    except ValueError:
        return None
