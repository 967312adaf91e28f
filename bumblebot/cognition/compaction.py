"""Context compaction: keep a conversation's prompt under the context window (docs/compaction.md).

Vocabulary. The *history* is the active message list sent after the system prompt. Compaction
splits it into a protected **head** (first ``protect_first_n`` messages), a **middle** and a
protected **tail** (recent messages, by token budget, at least ``protect_last_n``). Boundaries
never separate an assistant ``tool_calls`` message from its results. The middle is replaced by
a structured summary, which is injected after the head (:func:`summary_message`,
:func:`with_summary`); the summary itself is not part of the history.

Budgets (all in estimated tokens, :mod:`bumblebot.core.messages`):

* trigger: ``fixed_tokens + history + summary > max_context_tokens * threshold_ratio``;
* target: ``max_context_tokens * target_ratio``. Each pass gives the tail what is left of the
  target after ``fixed_tokens``, the head and a reserve for the summary, so one pass lands
  under the target whenever ``protect_last_n`` messages allow it. Passes repeat (up to
  ``max_passes``) while the estimate is above the target and there is a middle left.

Failure policy: a flush failure is recorded and compaction goes on (it only costs some facts
not remembered); a summary failure drops nothing (the pass stops, ``summary_failed`` is set),
because messages dropped without a summary would be forgotten for good.

Everything here is pure except :func:`compact`, which awaits ``complete`` and appends to the
knowledge file; callers run it inside the conversation's actor, so no turn writes the history
while it is being summarised.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from bumblebot.cognition.compaction_prompts import (
    SUMMARY_HEADINGS,
    FlushParseError,
    flush_request,
    parse_flush,
    serialize,
    serialize_message,
    summary_request,
)
from bumblebot.cognition.knowledge import KnowledgeFile
from bumblebot.core.messages import Message, estimate_messages
from bumblebot.core.textrules import strip_reasoning

__all__ = [
    "PLACEHOLDER", "SUMMARY_HEADER", "SUMMARY_HEADINGS", "CompactionOutcome", "FlushParseError",
    "RunningEstimate", "cap_tool_result", "compact", "find_boundaries", "flush_request",
    "head_end", "parse_flush", "prune_tool_results", "serialize", "summary_budget",
    "summary_message", "summary_request", "with_summary",
]  # fmt: skip

#: What an old tool result becomes when pruned (docs/compaction.md, "One compaction, pass by pass").
PLACEHOLDER = "[Old tool output cleared to save context space]"
#: First line of the injected summary message.
SUMMARY_HEADER = "[Conversation summary: earlier messages were compacted]\n"

MIN_SUMMARY_CHARS = 30
#: An old assistant message's tool calls are shown cut when they take more estimated tokens.
CLIP_CALL_TOKENS = 100
#: Characters an extractive summary keeps of each message.
EXTRACT_CHARS = 120
#: A summary must name at least this many of the seven :data:`SUMMARY_HEADINGS`.
MIN_SUMMARY_HEADINGS = 5
FLUSH_MAX_TOKENS = 2000
FLUSH_TEMPERATURE = 0.15
SUMMARY_TEMPERATURE = 0.25
#: A middle whose transcript is shorter than this is not worth a flush call.
MIN_FLUSH_CHARS = 100
#: Tokens of instructions around a transcript in a summary or flush request.
PROMPT_OVERHEAD_TOKENS = 600

#: ``complete(messages, max_tokens, temperature) -> text``: one chat completion.
Complete = Callable[[list[dict[str, Any]], int, float], Awaitable[str]]


class RunningEstimate:
    """Token estimate of a growing history, O(1) per added message (no re-walk).

    ``total`` equals ``estimate_messages`` of the messages added minus those removed.
    """

    __slots__ = ("total",)

    def __init__(self, messages: Iterable[Message] = ()) -> None:
        self.total = sum(m.tokens for m in messages)

    def add(self, message: Message) -> int:
        """Count ``message``; returns the new total."""
        self.total += message.tokens
        return self.total

    def remove(self, message: Message) -> int:
        """Uncount ``message`` (pruned, compacted away); returns the new total."""
        self.total -= message.tokens
        return self.total


def prune_tool_results(
    messages: Sequence[Message], tail_start: int, min_chars: int = 200
) -> tuple[list[Message], list[int]]:
    """Replace tool results before ``tail_start`` longer than ``min_chars`` by :data:`PLACEHOLDER`,
    and show the tool calls of assistant messages there that take over
    :data:`CLIP_CALL_TOKENS` with their long arguments cut (``Message.with_clipped_calls``).

    Returns the new list (other messages are the same objects) and the indexes replaced.
    Replacements are copies with ``pruned=True``; already pruned messages are left alone.
    """
    out = list(messages)
    pruned: list[int] = []
    for i in range(min(tail_start, len(out))):
        m = out[i]
        if m.role == "tool" and not m.pruned and len(m.content) > min_chars:
            out[i] = m.with_content(PLACEHOLDER, pruned=True)
            pruned.append(i)
        elif m.role == "assistant" and m.tool_calls and not m.pruned and m.tokens > CLIP_CALL_TOKENS:
            out[i] = m.with_clipped_calls()  # a long write_file or say of an old step
            pruned.append(i)
    return out, pruned


def head_end(messages: Sequence[Message], protect_first_n: int) -> int:
    """End of the protected head: ``protect_first_n``, moved forward past tool results so the
    head never ends inside a tool group. O(head)."""
    n = len(messages)
    end = min(max(protect_first_n, 0), n)
    while end < n and messages[end].role == "tool":
        end += 1
    return end


def find_boundaries(
    messages: Sequence[Message],
    *,
    protect_first_n: int,
    protect_last_n: int,
    tail_token_budget: int,
) -> tuple[int, int]:
    """``(middle_start, middle_end)``: head is ``[:middle_start]``, tail ``[middle_end:]``.

    The head is :func:`head_end`. The tail grows backward from the end while it stays within
    ``tail_token_budget`` tokens, and always takes at least ``protect_last_n`` messages (as
    many as exist after the head). If the cut then falls inside a tool group, the group moves
    into the tail. ``middle_start <= middle_end``; the middle may be empty. Cost O(head + tail):
    only tail messages' cached ``tokens`` are read.
    """
    n = len(messages)
    start = head_end(messages, protect_first_n)
    end, used = n, 0
    while end > start:
        cost = messages[end - 1].tokens
        if n - end >= protect_last_n and used + cost > tail_token_budget:
            break
        used += cost
        end -= 1
    while start < end < n and messages[end].role == "tool":
        end -= 1
    return start, end


def cap_tool_result(text: str, max_chars: int) -> str:
    """``text`` cut to at most ``max_chars`` characters, keeping its head (2/3) and tail (1/3)
    around a marker line ``[... N characters cut ...]``; unchanged when already short enough.
    Each tool result is capped when it is recorded, so no single result can overflow the
    window on its own."""
    if len(text) <= max_chars:
        return text
    widest = f"\n[... {len(text)} characters cut ...]\n"
    keep = max_chars - len(widest)
    if keep <= 0:
        return text[:max_chars]
    head = keep * 2 // 3
    tail = keep - head
    return f"{text[:head]}\n[... {len(text) - keep} characters cut ...]\n{text[len(text) - tail :]}"


def extractive_summary(chunk: Sequence[Message], previous: str | None, max_chars: int) -> str:
    """A summary made without the model, when it could not make one: the previous summary,
    then the start of each message of ``chunk`` (user and assistant text, the tools used with
    the start of their first text argument: what a ``say`` said), in the summary's headings,
    at most ``max_chars`` characters. The previous summary keeps at most half of them (its
    start, where the goal is); when the lines of ``chunk`` do not all fit, its oldest (where
    the person said what they wanted) take up to a third of the rest, its newest the others."""
    lines = []
    for m in chunk:
        if m.role == "tool" or m.note:
            continue
        if m.tool_calls:
            for call in m.tool_calls:
                fn = call.get("function", {})
                said = _first_text_argument(fn.get("arguments"))
                name = fn.get("name", "?")
                shown = f": {_first_words(said, EXTRACT_CHARS)}" if said else ""
                lines.append(f"- assistant used {name}{shown}")
        elif m.content.strip():
            lines.append(f"- {m.role}: {_first_words(strip_reasoning(m.content), EXTRACT_CHARS)}")
    body = "## Progress\n(the model could not summarise these messages; their start, in order)\n"
    head = ""
    if previous and previous.strip():
        # the previous summary goes first, whole or its start (its Goal and Constraints come
        # first) within half the room: what the person asked for outlives the latest chatter
        old, room = previous.strip(), max(0, max_chars - len(body)) // 2
        head = (old if len(old) <= room else old[: max(0, room - 1)].rstrip() + "…") + "\n\n"
    room = max_chars - len(head) - len(body) - len("- …\n")
    oldest = _fitting(lines, room // 3)  # where the conversation began: what was asked, often
    newest = _fitting(lines[len(oldest):][::-1], room - sum(len(line) + 1 for line in oldest))[::-1]
    kept = oldest + (["- …"] if len(oldest) + len(newest) < len(lines) else []) + newest
    return (head + body + "\n".join(kept)).strip()


def _fitting(lines: list[str], room: int) -> list[str]:
    """The leading ``lines`` that fit ``room`` characters (each with its line break)."""
    out: list[str] = []
    for line in lines:
        if len(line) + 1 > room:
            break
        out.append(line)
        room -= len(line) + 1
    return out


def _first_text_argument(arguments: object) -> str:
    """The first string value of a tool call's JSON arguments ('' when there is none)."""
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        return arguments if isinstance(arguments, str) else ""
    if isinstance(parsed, dict):
        for value in parsed.values():
            if isinstance(value, str) and value.strip():
                return strip_reasoning(value)
    return ""


def _first_words(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1].rsplit(" ", 1)[0] + "…"


def summary_message(summary: str) -> Message:
    """The user message carrying ``summary`` into a prompt (never truncated)."""
    return Message(role="user", content=SUMMARY_HEADER + summary)


def with_summary(
    messages: Sequence[Message], summary: str | None, *, protect_first_n: int
) -> list[Message]:
    """The history as sent: ``head + [summary_message] + rest`` (a copy of ``messages`` when
    ``summary`` is ``None``). The head is :func:`head_end`, as in compaction."""
    out = list(messages)
    if summary:
        out.insert(head_end(out, protect_first_n), summary_message(summary))
    return out


def summary_budget(middle_tokens: int, previous_summary_tokens: int, target_tokens: int) -> int:
    """Length asked of the summary, tokens: 20% of the middle plus the previous summary,
    at least 256, at most :func:`_summary_cap` (30% of the target, 128..8000)."""
    return min(_summary_cap(target_tokens), max(256, middle_tokens // 5 + previous_summary_tokens))


def _summary_cap(target_tokens: int) -> int:
    return max(128, min(8000, int(0.3 * target_tokens)))


def _summary_ok(text: str) -> bool:
    folded = text.casefold()
    found = sum(1 for h in SUMMARY_HEADINGS if h.casefold() in folded)
    return len(text) >= MIN_SUMMARY_CHARS and found >= MIN_SUMMARY_HEADINGS


def _clean_summary(text: str) -> str:
    text = strip_reasoning(text)
    if text.startswith("```") and text.endswith("```"):
        text = text[3:-3].partition("\n")[2].strip()
    return text


def _fit_chunk(middle: Sequence[Message], input_tokens: int) -> int:
    """How many leading messages of ``middle`` fit a request of ``input_tokens`` (at least the
    first tool group), cut only between tool groups."""
    used, k = 0, 0
    while k < len(middle):
        used += len(serialize_message(middle[k])) // 4 + 1
        if used > input_tokens:
            break
        k += 1
    if k < len(middle):
        while k > 0 and middle[k].role == "tool":
            k -= 1
        if k == 0:
            k = 1
            while k < len(middle) and middle[k].role == "tool":
                k += 1
    return k


@dataclass(slots=True)
class CompactionOutcome:
    """What :func:`compact` did.

    Attributes:
        messages: the new history (head + tail, pruning applied; the summary is NOT in it).
        summary: the latest summary (the previous one when no new summary was made).
        covered_ids: ids of messages moved into the summary (messages without an id are
            dropped all the same but not listed).
        pruned_ids: ids of tool results replaced by :data:`PLACEHOLDER` that stay in
            ``messages`` (disjoint from ``covered_ids``).
        passes: passes run (0: not triggered).
        flushed: titles appended to the knowledge file.
        summary_failed: a summary call failed or gave an unusable summary; that pass dropped
            nothing (earlier successful passes of the same call stand).
        extractive: a pass summarised without the model (:func:`extractive_summary`).
        flushed_through: the id of the newest message a flush call that answered has read
            (its facts saved, none found, or an answer with no facts to read: SmolLM2 never
            wrote the JSON), ``None`` when no flush answered.
        interrupted: the caller's ``interrupted`` held before a model call: the run stopped
            there (earlier passes stand).
        error: what failed (flush and/or summary), ``None`` if nothing did.
        estimate_before, estimate_after: total prompt estimate (``fixed_tokens`` + history +
            summary message), tokens.
    """

    messages: list[Message]
    summary: str | None
    covered_ids: list[int] = field(default_factory=list)
    pruned_ids: list[int] = field(default_factory=list)
    passes: int = 0
    flushed: list[str] = field(default_factory=list)
    summary_failed: bool = False
    extractive: bool = False
    flushed_through: int | None = None
    interrupted: bool = False
    error: str | None = None
    estimate_before: int = 0
    estimate_after: int = 0


class UnusableSummary(ValueError):
    """The model answered, but not with a summary (too short, or without the headings asked)."""


async def _flush(chunk: list[Message], knowledge: KnowledgeFile, complete: Complete, max_tokens: int) -> list[str]:
    titles = await asyncio.to_thread(knowledge.titles)
    text = await complete(flush_request(chunk, titles), max_tokens, FLUSH_TEMPERATURE)
    items = parse_flush(text)
    return await asyncio.to_thread(knowledge.append_sections, items)


async def compact(
    history: list[Message],
    *,
    previous_summary: str | None,
    complete: Complete,
    knowledge: KnowledgeFile | None,
    fixed_tokens: int,
    max_context_tokens: int,
    threshold_ratio: float,
    target_ratio: float,
    protect_first_n: int,
    protect_last_n: int,
    max_passes: int,
    flush: bool,
    force: bool = False,
    min_gain_tokens: int = 0,
    request_limit: int | None = None,
    threshold_tokens: int | None = None,
    extract_on_failure: bool = False,
    flushed_through: int | None = None,
    interrupted: Callable[[], bool] | None = None,
) -> CompactionOutcome:
    """Compact ``history`` if its prompt estimate is over the threshold (or ``force``).

    Each pass: find boundaries (tail budget = target - fixed - head - summary reserve); on the
    first pass, flush the middle's durable facts to ``knowledge`` (if ``flush``); prune tool
    results outside the tail; if that is enough to be under the target (and not ``force``),
    stop; otherwise summarise the middle, updating the previous summary, in a request that
    fits ``max_context_tokens`` (a middle too big for one request is summarised oldest-first
    over several passes). ``history`` is not modified.

    Args:
        history: the active history, oldest first, without the summary message.
        previous_summary: the summary currently injected, or ``None``.
        complete: one chat completion, ``(messages, max_tokens, temperature) -> text``.
        knowledge: where flushed facts go; ``None`` disables the flush.
        fixed_tokens: tokens of the rest of the request (system prompt, tool schemas, this
            turn's messages).
        min_gain_tokens: unless ``force``, do nothing while the middle is smaller than this
            and the request still fits ``request_limit``: with a small window the fixed
            prompt and the protected tail can keep the estimate near the threshold, and
            summarising two messages per turn would cost two LLM calls every turn.
        request_limit: the largest prompt one turn's request may carry (the window less the
            reply budget), tokens; default ``max_context_tokens``. (A summary request fits the
            window with its own reply budget.)
        threshold_tokens: the estimate above which to compact, when the caller decided it
            (``ContextBudget.threshold``); default ``max_context_tokens * threshold_ratio``.
        extract_on_failure: when the model answers with an unusable summary, summarise
            extractively (:func:`extractive_summary`) instead of keeping the messages; the
            caller sets it when the previous attempt failed too (a model that cannot
            summarise would otherwise keep every message until the window overflows). An
            error of the endpoint (a rate limit, an outage) never counts: it keeps them.
        flushed_through: messages up to this id were read by an earlier flush (a run whose
            summary then failed): the flush reads only newer ones.
        interrupted: checked before each model call; when it holds, the run stops there (a
            request in flight is never abandoned: a server that answers one at a time would
            still be busy with it).

    Returns:
        The outcome; ``with_summary(outcome.messages, outcome.summary, ...)`` is valid
        (:func:`bumblebot.cognition.sequence.validate`) whenever ``history`` was. Errors of ``complete``
        and of the knowledge file are caught and reported in ``error``; cancellation is not.
    """
    return await _Compaction(
        history, previous_summary, complete, knowledge, fixed_tokens=fixed_tokens,
        window=max_context_tokens,
        threshold=int(max_context_tokens * threshold_ratio) if threshold_tokens is None else threshold_tokens,
        target=int(max_context_tokens * target_ratio),
        limit=max_context_tokens if request_limit is None else request_limit,
        protect_first_n=protect_first_n, protect_last_n=protect_last_n, max_passes=max_passes,
        flush=flush and knowledge is not None, force=force, min_gain_tokens=min_gain_tokens,
        extract_on_failure=extract_on_failure, flushed_through=flushed_through, interrupted=interrupted,
    ).run()


class _Compaction:
    """One run of :func:`compact`: the history as it shrinks pass by pass, and what it cost."""

    def __init__(
        self, history: list[Message], summary: str | None, complete: Complete, knowledge: KnowledgeFile | None, *,
        fixed_tokens: int, window: int, threshold: int, target: int, limit: int, protect_first_n: int,
        protect_last_n: int, max_passes: int, flush: bool, force: bool, min_gain_tokens: int,
        extract_on_failure: bool = False, flushed_through: int | None = None,
        interrupted: Callable[[], bool] | None = None,
    ) -> None:
        self.msgs, self.summary = list(history), summary
        self.complete, self.knowledge = complete, knowledge
        self.fixed_tokens, self.window, self.threshold, self.target, self.limit = (
            fixed_tokens, window, threshold, target, limit,
        )
        self.protect_first_n, self.protect_last_n, self.max_passes = protect_first_n, protect_last_n, max_passes
        self.flush, self.force, self.min_gain_tokens = flush, force, min_gain_tokens
        self.extract_on_failure, self.flushed_through = extract_on_failure, flushed_through
        self.interrupted = interrupted
        self.model_failed = False  # its summary failed in this run: later passes do not ask again
        self.errors: list[str] = []
        self.out = CompactionOutcome(messages=self.msgs, summary=summary, estimate_before=self.total())

    def summary_tokens(self) -> int:
        return summary_message(self.summary).tokens if self.summary else 0

    def total(self) -> int:
        return self.fixed_tokens + estimate_messages(self.msgs) + self.summary_tokens()

    async def run(self) -> CompactionOutcome:
        out = self.out
        if self.force or out.estimate_before > self.threshold:
            while out.passes < self.max_passes and (out.passes == 0 or self.total() > self.target):
                if not await self._pass():
                    break
        covered = set(out.covered_ids)
        out.pruned_ids = [i for i in out.pruned_ids if i not in covered]
        out.messages, out.summary = self.msgs, self.summary
        out.error = "; ".join(self.errors) or None
        out.estimate_after = self.total()
        return out

    async def _pass(self) -> bool:
        """One pass: prune and summarise the middle; ``False`` when there is no more to do."""
        out, msgs, target = self.out, self.msgs, self.target
        head_tokens = estimate_messages(msgs[: head_end(msgs, self.protect_first_n)])
        reserve = max(self.summary_tokens(), _summary_cap(target))
        start, end = find_boundaries(
            msgs, protect_first_n=self.protect_first_n, protect_last_n=self.protect_last_n,
            tail_token_budget=max(0, target - self.fixed_tokens - head_tokens - reserve),
        )
        middle = msgs[start:end]
        if (not self.force and out.passes == 0 and estimate_messages(middle) < self.min_gain_tokens
                and self.total() <= self.limit):
            return False  # too little to gain for two LLM calls; wait until the middle is worth it
        self.msgs, pruned = prune_tool_results(msgs, end)
        if not middle and not pruned:
            return False
        out.passes += 1
        out.pruned_ids += [i for i in (self.msgs[j].id for j in pruned) if i is not None]
        budget = summary_budget(estimate_messages(middle), self.summary_tokens(), target)
        max_out = min(8000, 2 * budget)
        room = self.window - max_out - self.summary_tokens() - PROMPT_OVERHEAD_TOKENS
        chunk = middle[: _fit_chunk(middle, room)]
        first = out.passes == 1
        unread = [m for m in chunk if self.flushed_through is None or m.id is None or m.id > self.flushed_through]
        if self.flush and first and self.knowledge is not None and len(serialize(unread)) >= MIN_FLUSH_CHARS:
            if self._stop():
                return False
            read = max((m.id for m in unread if m.id is not None), default=None)
            try:
                # its reply budget shares the window with the chunk, like the summary's
                out.flushed = await _flush(unread, self.knowledge, self.complete, min(FLUSH_MAX_TOKENS, max_out))
                out.flushed_through = read
            except FlushParseError as exc:  # it answered, but no facts could be read: asking again reads the same
                out.flushed_through = read
                self.errors.append(f"flush: {type(exc).__name__}: {exc}")
            except Exception as exc:  # best effort: record and go on
                self.errors.append(f"flush: {type(exc).__name__}: {exc}")
        if not chunk or (self.total() <= target and not (self.force and first)):
            return False
        if not self.model_failed and self._stop():
            return False
        new = await self._summarise(chunk, budget, max_out)
        if new is None:
            return False
        self.summary = new
        out.covered_ids += [m.id for m in chunk if m.id is not None]
        self.msgs = self.msgs[:start] + self.msgs[start + len(chunk):]
        return True

    def _stop(self) -> bool:
        """Whether the caller asked the run to stop before its next model call."""
        if self.interrupted is not None and self.interrupted():
            self.out.interrupted = True
        return self.out.interrupted

    async def _summarise(self, chunk: list[Message], budget: int, max_out: int) -> str | None:
        """The summary updated with ``chunk``; ``None`` when it failed and the messages can stay."""
        if self.model_failed:  # an earlier pass of this run fell back: the model is not asked again
            return extractive_summary(chunk, self.summary, budget * 4)
        try:
            text = await self.complete(summary_request(chunk, self.summary, budget), max_out, SUMMARY_TEMPERATURE)
            new = _clean_summary(text)
            if not _summary_ok(new):
                raise UnusableSummary(f"unusable summary ({len(new)} chars): {new[:80]!r}")
        except Exception as exc:  # keep the transcript: nothing is dropped unsummarised
            self.out.summary_failed = True
            self.errors.append(f"summary: {type(exc).__name__}: {exc}")
            unable = self.extract_on_failure and isinstance(exc, UnusableSummary)
            if not unable and self.total() <= (self.limit if self.force else self.window):
                return None  # the request can still be sent: keep every message (docs/compaction.md, "Failure policy")
            # the model failed to summarise twice in a row, or the prompt alone would overflow the window,
            # or the server already refused it (a model too weak to summarise, a small
            # window): an extractive summary keeps the conversation alive and its requests
            # small; the messages stay in the database (covered, never deleted)
            self.out.extractive = self.model_failed = True
            return extractive_summary(chunk, self.summary, budget * 4)
        return new
