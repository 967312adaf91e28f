"""The context window in estimated tokens, and what the endpoint taught us about counting.

The token estimate (``len(text) // 4 + 10`` per message, :mod:`bumblebot.core.messages`) over-counts
English, so compaction fires early, which is safe, but it undercounts dense text (CJK,
code, JSON). Each completion reports ``usage.prompt_tokens``; :meth:`ContextBudget.observe`
learns the ratio of reported to estimated tokens (smoothed, clamped to [1, 4]) and the window
shrinks by it, so compaction fires in time there too.

The learned scale belongs to the endpoint and model (their tokenizer), not to a conversation:
it is one value per ``(base_url, model)``, persisted in the store's ``kv`` table under
``tokens.scale:<base_url>|<model>`` so a restart does not forget it. It is written only when it
moved by :data:`SAVE_STEP` or more since the last write.

The window itself is ``cognition.max_context_tokens``, unless the endpoint's own is smaller
(:mod:`bumblebot.llm.window`, told by :meth:`ContextBudget.learn` whenever it changes, at start
or from a refusal mid-run): then the endpoint's, for every later request, the reply cap, the
fixed part and compaction alike. A configured window always wins over a larger learned one,
and over one the endpoint did not say but was assumed (Ollama's default ``num_ctx``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bumblebot.llm.window import LearnedWindow

log = logging.getLogger(__name__)

#: A completion's token budget is at most this share of the window (servers that count prompt
#: plus ``max_tokens`` against it, vLLM, llama.cpp, OpenAI, refuse more).
REPLY_SHARE = 0.25
#: The token estimate misses some structure (tool-call JSON): requests are kept this far
#: under the hard limit.
ESTIMATE_MARGIN = 0.9
MIN_SCALE = 1.0
MAX_SCALE = 4.0
#: Weight of the newest observation in the smoothed scale.
SMOOTHING = 0.3
#: The scale is persisted again once it moved by this much.
SAVE_STEP = 0.05


class ContextBudget:
    """The window (in estimated tokens) that requests and compaction must fit.

    Args:
        max_context_tokens: the model's context window, tokens (``cognition.max_context_tokens``).
        threshold_ratio: compaction fires above this share of the window
            (``cognition.history_compression.compaction_threshold_ratio``).
        reply_tokens: the largest completion budget a turn asks for, tokens; a request's prompt
            must leave room for it.
        key: the ``kv`` key of the learned scale (see the module docstring).
        load, save: read and write a ``kv`` value (the store's ``get_kv`` / ``set_kv``).
        configured: ``max_context_tokens`` was set in the configuration (not the default): a
            larger learned window is corrected with a warning, and an assumed one is ignored.
    """

    def __init__(
        self,
        max_context_tokens: int,
        threshold_ratio: float,
        *,
        reply_tokens: int = 0,
        key: str = "",
        load: Callable[[str], Awaitable[str | None]] | None = None,
        save: Callable[[str, str], Awaitable[None]] | None = None,
        configured: bool = False,
    ) -> None:
        #: ``cognition.max_context_tokens``
        self.configured_tokens = max_context_tokens
        self.configured = configured
        #: the endpoint's window when it is smaller and applies (:meth:`learn`), else ``None``
        self.learned: LearnedWindow | None = None
        self.threshold_ratio = threshold_ratio
        self._reply_wanted = reply_tokens
        self.key = key
        self._load, self._save = load, save
        #: reported prompt tokens per estimated token, smoothed; never below 1
        self.scale = MIN_SCALE
        self._saved = MIN_SCALE
        self._told: set[int] = set()  # windows the log was told about, once each
        self._learning: asyncio.Future[object] | None = None

    @property
    def max_context_tokens(self) -> int:
        """The window requests are sized for: the configured one, or the endpoint's when smaller."""
        return self.configured_tokens if self.learned is None else self.learned.tokens

    @property
    def reply_tokens(self) -> int:
        """The largest completion budget a turn asks for, at most :data:`REPLY_SHARE` of the window."""
        return min(self._reply_wanted, int(self.max_context_tokens * REPLY_SHARE))

    def learn(self, window: LearnedWindow | None, model: str = "", *, fallback: bool = False) -> None:
        """The endpoint's window for ``model`` is ``window`` (``None``: unknown): it applies when
        smaller than the configured one and not merely assumed while a window is configured.
        The first time a window corrects the configured one, the log says so once: a warning
        when the operator set the larger one or it is a ``fallback``'s (it shrinks what the
        primary is sent too), else a note."""
        applies = window is not None and window.tokens < self.configured_tokens and not (
            window.assumed and self.configured
        )
        self.learned = window if applies else None
        if window is None or not applies or window.tokens in self._told:
            return
        self._told.add(window.tokens)
        if self.configured or fallback:  # a fallback's window shrinks the primary's requests too
            log.warning(
                "cognition.max_context_tokens is %d, but the endpoint's window for %s is %s; requests are sized "
                "for %d tokens (give that endpoint a larger window, or lower cognition.max_context_tokens to match)",
                self.configured_tokens, model or "the model", window.describe(), window.tokens,
            )
        else:
            log.info(
                "the endpoint's window for %s is %s; requests are sized for it (cognition.max_context_tokens "
                "is not set: %d was assumed)", model or "the model", window.describe(), self.configured_tokens,
            )

    def learning(self, task: asyncio.Future[object]) -> None:
        """The endpoint is being asked its window (``task``): :meth:`settled` waits for it."""
        self._learning = task

    async def settled(self) -> None:
        """Wait until the endpoint was asked its window at start, if it is being asked (the
        asking bounds itself; a caller cancelled meanwhile does not cancel it)."""
        if self._learning is not None and not self._learning.done():
            await asyncio.wait([self._learning])

    @staticmethod
    def key_for(base_url: str, model: str) -> str:
        return f"tokens.scale:{base_url}|{model}"

    async def load(self) -> None:
        """Read the learned scale (a missing or unreadable value leaves 1.0)."""
        if self._load is None or not self.key:
            return
        raw = await self._load(self.key)
        try:
            value = float(raw) if raw is not None else MIN_SCALE
        except ValueError:
            value = MIN_SCALE
        self.scale = self._saved = min(MAX_SCALE, max(MIN_SCALE, value))

    def window(self) -> int:
        """``max_context_tokens`` in estimated tokens: the window shrunk by the learned scale."""
        return int(self.max_context_tokens / self.scale)

    def share_chars(self, share: float) -> int:
        """``share`` of the window in characters (4 a token, the estimate's rate): what one
        tool result may hold (``cognition.max_tool_result_share``)."""
        return int(share * self.window() * 4)

    def reply_cap(self) -> int:
        """The most tokens one completion may ask for (:data:`REPLY_SHARE` of the window)."""
        return int(self.max_context_tokens * REPLY_SHARE)

    def limit(self, reply_tokens: int | None = None) -> int:
        """The largest prompt a request may carry, in estimated tokens: the window less the
        reply budget (``reply_tokens``, the turn's; default the largest a turn asks for),
        shrunk by the learned scale."""
        reply = self.reply_tokens if reply_tokens is None else min(reply_tokens, self.reply_tokens)
        return int((self.max_context_tokens - reply) / self.scale)

    def threshold(self, reply_tokens: int | None = None) -> int:
        """The estimate above which compaction fires (docs/compaction.md, "When compaction triggers"): the share
        ``threshold_ratio`` of the window, or, in a window so small that the reply budget
        leaves less, :data:`ESTIMATE_MARGIN` of :meth:`limit`."""
        return int(min(self.window() * self.threshold_ratio, self.limit(reply_tokens) * ESTIMATE_MARGIN))

    async def refused(self, prompt_tokens: int | None, estimate: int) -> None:
        """The endpoint refused a request estimated at ``estimate`` tokens as too long, having
        counted ``prompt_tokens``: the scale jumps to that ratio (plus 5%) at once, without
        smoothing. A chat whose every request is refused sends no usage to learn from, so a
        lagging scale would keep it dead."""
        if not prompt_tokens or estimate <= 0:
            return
        ratio = prompt_tokens / estimate * 1.05
        if ratio > self.scale:
            self.scale = min(MAX_SCALE, ratio)
            if self._save is not None and self.key:
                self._saved = self.scale
                await self._save(self.key, f"{self.scale:.4f}")

    async def observe(self, prompt_tokens: int | None, estimate: int) -> None:
        """The endpoint reported ``prompt_tokens`` for a request estimated at ``estimate``."""
        if not prompt_tokens or estimate <= 0:
            return
        ratio = prompt_tokens / estimate
        self.scale = min(MAX_SCALE, max(MIN_SCALE, (1 - SMOOTHING) * self.scale + SMOOTHING * ratio))
        if self._save is not None and self.key and abs(self.scale - self._saved) >= SAVE_STEP:
            self._saved = self.scale
            await self._save(self.key, f"{self.scale:.4f}")
