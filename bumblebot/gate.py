"""The completion gate: may the agent loop end this turn?

Spec, "Completion gate". The gate judges **all user-visible text of the turn** (everything
delivered by ``say`` plus the final reply). Only *work* tools count for grounding; agency tools
(``say``, ``think``, ``wait``, ``end_turn``) do not. Order:

1. cheap heuristics: nothing visible at all; a plain-text ending that is only progress chatter
   ("on it", "let me check") with no successful work tool (an explicit ``end_turn`` always goes
   to the judge below, as the spec asks);
2. a reflex chat turn (``GateInput.chat_reflex``: the router sent it to reflex, so it is casual
   chat that asks for no work) where no work tool ran, the user did not demand tools and the
   visible reply promises no work (:func:`promises_work`: "I'll look into it", "let me
   check") ends with no judge: the router already decided that (issue 11, a deliberate
   refinement of the spec, docs/cognition.md section 5). A reply that promises work is the
   adequacy judge's to weigh, as on a deliberate turn;
3. if work tools ran (even if they all failed: the reply must then report the failure), or the
   user demanded tool grounding: the **grounding judge** (reflex model, ``DONE:``/``CONTINUE:``)
   checks the visible reply reflects the tool results;
4. otherwise (no work tool ran): the **action-adequacy judge** decides, from intent and in any
   language, whether tangible work was asked for and only promised. This runs on ``end_turn``
   too.

Judges see no tools. A judge that errors or answers anything but ``DONE``/``CONTINUE`` lets
the turn end (fail-open), and the loop caps gate continues, so every turn ends.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

#: A judge is called with chat messages and returns the raw completion text.
Judge = Callable[[list[dict[str, Any]]], Awaitable[str]]

MAX_GATE_CONTINUES = 2

#: Texts longer than this many characters (after stripping) are never "progress only". An
#: announcement of work is a sentence or two ("On it! Let me check that for you..." is 35);
#: anything longer is left to the judges, and the check stays cheap whatever the model writes.
PROGRESS_ONLY_MAX_CHARS = 300

#: Announcements that are complete in themselves ("ok", "on it", "will do").
_CLOSED_PHRASES = (
    "ok", "okay", "sure", "alright", "got it", "on it", "one sec", "one second", "one moment",
    "give me a sec", "give me a second", "give me a moment", "give me a minute", "hold on",
    "working on it", "working on that", "do", "do it", "will do", "will do it", "coming up",
    "coming right up",
)  # fmt: skip
#: Openings that announce work; the rest of their sentence (up to ``.``, ``!``, ``?`` or a
#: line break) belongs to them: "let me check the logs for you".
_OPEN_PHRASES = (
    *(f"let me {verb}" for verb in (
        "check", "look", "see", "do", "try", "find", "get", "think", "write", "search", "handle")),
    *(f"{i} {doing}" for i in ("i'm", "i am")
      for doing in ("on it", "working on it", "working on that", "checking", "looking")),
    *(f"{i} {verb}" for i in ("i'll", "i will")
      for verb in ("do", "check", "look", "get", "write", "find", "handle", "take care of")),
)  # fmt: skip


def _phrase_index() -> dict[str, tuple[tuple[tuple[str, ...], bool], ...]]:
    """First word -> ``((words, opens_sentence), ...)`` for every phrase above."""
    index: dict[str, list[tuple[tuple[str, ...], bool]]] = {}
    for phrases, is_open in ((_CLOSED_PHRASES, False), (_OPEN_PHRASES, True)):
        for phrase in phrases:
            words = tuple(phrase.split())
            index.setdefault(words[0], []).append((words, is_open))
    return {first: tuple(entries) for first, entries in index.items()}


_PHRASES = _phrase_index()
_WORD = re.compile(r"[\w']+")  # one character class, one quantifier: linear
_SENTENCE_END = frozenset(".!?\n")
_DEMANDS_TOOLS = re.compile(
    r"\b(use (the |your )?tools?|check (the |my |that )?(file|folder|directory|workspace)|look it up"
    r"|search (for|the web)|read (the |my )?(file|readme)|run (it|the|this|that)|actually (check|run|look))\b",
    re.IGNORECASE,
)


@dataclass(frozen=True, slots=True)
class Preview:
    """First 280 characters of a work tool's result (spec: last 8 are kept for the gate)."""

    tool: str
    ok: bool
    text: str


@dataclass(slots=True)
class GateInput:
    user_text: str
    visible: list[str]
    work_calls: int
    work_ok: int
    previews: list[Preview] = field(default_factory=list)
    ended_by: str = "end_turn"  # or "text"
    last_hit_length: bool = False
    continues_so_far: int = 0
    #: the router sent this turn to reflex and no later message joined it: casual chat whose
    #: input asks for no work, so a plain reply needs no adequacy judge
    chat_reflex: bool = False
    #: a scheduled or autonomous turn: ending without a message is an answer (issue 13)
    silent_ok: bool = False


@dataclass(frozen=True, slots=True)
class GateDecision:
    done: bool
    reason: str
    judge: str | None = None  # "grounding", "adequacy" or None (heuristic)
    nudge: str | None = None
    raw: str | None = None


#: A reply that promises work ("I'll dig through your notes", "let me check", "I'll get back
#: to you"): a reflex turn that says this gets the adequacy judge after all. A first-person
#: future is a promise only with a verb of work within three words ("I'll be honest" is not);
#: fixed words and a repeat bounded at two: linear in the text.
_PROMISES = re.compile(
    r"\b(?:(?:i'll|i will|i'm going to|i am going to|let me)\s+(?:\w+\s+){0,2}?"
    r"(?:check|look|find|dig|get|search|go|add|set|make|create|write|send|do|handle|take|remind"
    r"|research|figure|fetch|read|run|note|save|put|track|pull|grab|gather|compile|prepare|draft)\b"
    r"|get back to you|give me a (?:sec|second|moment|minute)|one moment|working on (?:it|that))",
    re.IGNORECASE,
)


def promises_work(text: str) -> bool:
    """``text`` announces work still to come, in any of the forms of :data:`_PROMISES`."""
    return bool(_PROMISES.search(text.replace("\u2019", "'")))


def user_demands_tools(text: str) -> bool:
    """The user explicitly asked for tool grounding ("check the file", "look it up", ...).

    Linear in ``len(text)``: the pattern is fixed phrases (each at most about 30 characters)
    on word boundaries, with no repeated group.
    """
    return bool(_DEMANDS_TOOLS.search(text))


def progress_only(text: str) -> bool:
    """Visible text is only an announcement of work ("On it! Let me check...").

    The text, stripped, must be one or more announcements (:data:`_CLOSED_PHRASES`, or an
    opening of :data:`_OPEN_PHRASES` with the rest of its sentence) separated by anything
    that is not a word (punctuation, spaces, emoji). Matching is case-insensitive, on whole
    words; the words of a phrase are separated by spaces or tabs. Texts over
    :data:`PROGRESS_ONLY_MAX_CHARS` (300) characters are never progress only.

    Work is linear in ``len(text)`` (spec: nothing blocks the event loop); the check used to
    be a backtracking regex that held the loop for 20 s on ``"let me check, " * 12 + "... 42"``,
    four to five times longer for each further clause.
    """
    stripped = text.strip()
    return 0 < len(stripped) <= PROGRESS_ONLY_MAX_CHARS and _announcements_only(stripped)


def _announcements_only(text: str) -> bool:
    """The unbounded scan behind :func:`progress_only`: ``O(len(text))`` time and memory.

    The text is cut into words (letters, digits, ``_`` and ``'``); ``reach[i]`` says whether
    the words before word ``i`` are whole announcements. A closed phrase at ``i`` reaches
    the word after it, an opening reaches the first word of the next sentence. Each word is
    tried against the few phrases starting with it (at most 13, of at most 5 words).
    """
    words: list[str] = []
    joined: list[bool] = []  # the gap before word i is spaces or tabs only
    breaks: list[bool] = []  # the gap before word i ends a sentence
    text = text.lower().replace("\u2019", "'")  # may change the length: slice this one only
    end = 0
    for m in _WORD.finditer(text):
        raw = m.group()
        word = raw.strip("'")
        if not word:
            continue
        start = m.start() + len(raw) - len(raw.lstrip("'"))
        gap = text[end:start]
        joined.append(not gap.strip(" \t"))
        breaks.append(not _SENTENCE_END.isdisjoint(gap))
        words.append(word)
        end = start + len(word)
    n = len(words)
    after = [n] * n  # after[i]: the first word of the sentence after word i's
    for i in range(n - 2, -1, -1):
        after[i] = i + 1 if breaks[i + 1] else after[i + 1]
    reach = [False] * (n + 1)
    reach[0] = n > 0
    for i in range(n):
        if not reach[i]:
            continue
        for phrase, is_open in _PHRASES.get(words[i], ()):
            k = len(phrase)
            if tuple(words[i : i + k]) == phrase and all(joined[i + 1 : i + k]):
                reach[after[i + k - 1] if is_open else i + k] = True
    return reach[n]


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def grounding_messages(inp: GateInput) -> list[dict[str, Any]]:
    previews = "\n".join(
        f"- {p.tool} ({'ok' if p.ok else 'FAILED'}): {_clip(p.text, 220)}" for p in inp.previews
    ) or "(no tool results)"
    return [
        {
            "role": "system",
            "content": "You check an assistant's reply before it is final. Answer with exactly one line "
            "starting with DONE: or CONTINUE: followed by a short reason. CONTINUE when the visible "
            "reply ignores or contradicts the tool results, is only a thin acknowledgement, or does not "
            "tell the user what the tools found (or that they failed). DONE when it reports the results.",
        },
        {
            "role": "user",
            "content": f"User asked:\n{_clip(inp.user_text, 1200)}\n\nTool results:\n{previews}\n\n"
            f"Visible reply to the user:\n{_clip(chr(10).join(inp.visible), 1500)}",
        },
    ]


def adequacy_messages(inp: GateInput) -> list[dict[str, Any]]:
    return [
        {
            "role": "system",
            "content": "You check whether an assistant delivered what the user asked for. The assistant "
            "has tools to write files, run commands and fetch web pages, and used none successfully "
            "this turn. Judge by intent, in any language or tone. If the user asked for tangible work "
            "(code, a file, a command run, live data, a lookup) and the reply only promised, announced "
            "or hand-waved it, answer CONTINUE: <what is missing>. If the user only chatted, asked "
            "something answerable from knowledge, or the reply delivers what was asked (or honestly "
            "explains why it cannot), answer DONE: <reason>. One line, starting with DONE: or CONTINUE:.",
        },
        {
            "role": "user",
            "content": f"User wrote:\n{_clip(inp.user_text, 1200)}\n\n"
            f"Everything the assistant showed the user this turn:\n{_clip(chr(10).join(inp.visible), 2000)}",
        },
    ]


def parse_verdict(raw: str) -> tuple[bool | None, str]:
    """``(True, reason)`` for DONE, ``(False, reason)`` for CONTINUE, ``(None, raw)`` otherwise."""
    text = raw.strip().strip("*`\"' ")
    m = re.match(r"^(DONE|CONTINUE)\b[\s*_:\-–]*(.*)", text, re.IGNORECASE | re.DOTALL)
    if not m:
        return None, raw.strip()
    return m.group(1).upper() == "DONE", m.group(2).strip().splitlines()[0] if m.group(2).strip() else ""


class CompletionGate:
    """Decides whether a turn may end. ``judge`` sends tool-less requests to the reflex model."""

    def __init__(self, judge: Judge) -> None:
        self._judge = judge

    async def check(self, inp: GateInput) -> GateDecision:
        if inp.continues_so_far >= MAX_GATE_CONTINUES:
            return GateDecision(True, f"gate continue cap ({MAX_GATE_CONTINUES}) reached")
        visible = "\n".join(t for t in inp.visible if t.strip())
        if not visible.strip() and inp.silent_ok:
            return GateDecision(True, "nothing to say: a scheduled or autonomous turn may stay silent")
        if not visible.strip():
            why = "the last completion hit the length limit" if inp.last_hit_length else "nothing was said"
            return GateDecision(
                False,
                f"no visible reply ({why})",
                nudge="You have not said anything to the user in this turn. Call say() with your reply "
                "(keep it within the length budget), then end_turn().",
            )
        if inp.ended_by == "text" and inp.work_ok == 0 and progress_only(visible):
            return GateDecision(
                False,
                "progress-only reply without work",
                nudge="You only announced work. Do it now with the work tools (for example write_file or "
                "read_file), then say() what the tools returned, or tell the user plainly that you cannot.",
            )
        demanded = user_demands_tools(inp.user_text)
        if inp.chat_reflex and inp.work_calls == 0 and not demanded and not promises_work(visible):
            return GateDecision(True, "reflex chat turn: no judge (router decided)")
        if inp.work_calls > 0 or demanded:
            return await self._ask("grounding", grounding_messages(inp), grounding=True)
        return await self._ask("adequacy", adequacy_messages(inp), grounding=False)

    async def _ask(self, name: str, messages: list[dict[str, Any]], *, grounding: bool) -> GateDecision:
        try:
            raw = await self._judge(messages)
        except Exception as exc:  # a failing judge never blocks the turn
            return GateDecision(True, f"{name} judge failed ({type(exc).__name__}); ending", judge=name)
        verdict, reason = parse_verdict(raw)
        if verdict is None:
            return GateDecision(True, f"{name} judge answer unreadable; ending", judge=name, raw=raw)
        if verdict:
            return GateDecision(True, reason or "done", judge=name, raw=raw)
        if grounding:
            nudge = (
                f"Your reply to the user does not yet reflect the tool results ({reason}). Tell the user "
                "what the tools actually returned, with say(), then end_turn()."
            )
        else:
            nudge = (
                f"The user asked for real work that was not done yet ({reason}). Do it now with the work "
                "tools (write_file, read_file, run_command, fetch_url, ...), then say() the result and "
                "end_turn(). If it truly cannot be done, say so plainly."
            )
        return GateDecision(False, reason or "continue", judge=name, nudge=nudge, raw=raw)
