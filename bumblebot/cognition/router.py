"""Routing a turn to the reflex or the deliberate profile (docs/cognition.md, "Routing").

Heuristic first (:func:`heuristic`); only when it is uncertain (80 to 200 characters with no
cue either way), one classifier call on the reflex model labels the input CHAT, GROUNDED,
EXACT or DEEP and only CHAT stays reflex (:func:`route`). Automation and autonomous input, and
entities with ``always_deliberate``, are always deliberate and never reach the classifier.

The reflex profile is for input that is "short, non-technical, and low-intensity", and
for slang, simple reactions and brief questions under 80 characters. The deliberate cues
(code, identity, file, research, emotional) say what is technical or intense; input under 80
characters with none of them is reflex (``brief``), so a plain chat turn costs no classifier
call. A greeting with a name or a few words ("hello Sam", "hi bumblebot how are
you") is reflex by the ``greeting`` rule whatever its length.

Every word and phrase matches on word boundaries, case-insensitively, since a substring
match misroutes ordinary words: "report" is not "repo", "glove" is not "love", "lollipop" is
not "lol". Uncertain input costs one 8-token call; a failed or unreadable classification
goes deliberate, so a mistake costs tokens rather than a thin answer.

Rules of :func:`heuristic`, first match wins (``reason`` starts with the rule name):

====================  ==========  ===============================================================
rule                  route       when
====================  ==========  ===============================================================
``forced``            deliberate  source is automation/autonomous, or ``always_deliberate``
``tiny``              reflex      under 4 characters (stripped)
``greeting``          reflex      the whole input is a greeting or acknowledgement ("hi", "ok")
``reaction``          reflex      no letters or digits at all (emoji, "!!!"), up to 120 chars
``code``              deliberate  code fences, stack traces, coding words ("fix", "python")
``identity``          deliberate  who/what the entity is or can do ("what's your name?")
``file``              deliberate  file names with extensions, "readme", "repo", "workspace"...
``research``          deliberate  "search", "look up", "latest", "news", "compare", URLs, live
                                  data ("weather", "forecast", "exchange rate", "stock price")
``emotional``         deliberate  emotionally deep words ("grief", "lonely", "love")
``long``              deliberate  over 200 characters
``greeting``          reflex      a greeting opening ("hello", "good morning", "thanks") and at
                                  most 4 more words ("hello Sam", "hi bumblebot how are you")
``casual``            reflex      slang or a casual reaction ("wagwan", "lol"), up to 120 chars,
                                  not a question
``reaction``          reflex      a tiny question or exclamation ("WHAT?", "really?"), <= 18 chars
``brief``             reflex      under 80 characters (a brief question or remark, no cue)
(uncertain)           ``None``    everything else: 80 to 200 characters with no cue
====================  ==========  ===============================================================

Every rule is linear in the length of the input: the cue patterns are alternations of fixed
words on word boundaries, and the greeting opening is a look-up of the first two words.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum

__all__ = [
    "Label",
    "Route",
    "RouteDecision",
    "Source",
    "classifier_messages",
    "heuristic",
    "parse_label",
    "route",
]


class Route(StrEnum):
    """The inference profile of a turn (docs/cognition.md, "Routing")."""

    REFLEX = "reflex"
    DELIBERATE = "deliberate"


class Source(StrEnum):
    """Where a turn's input comes from; only ``CHAT`` (a person) is ever routed to reflex."""

    CHAT = "chat"
    AUTOMATION = "automation"
    AUTONOMOUS = "autonomous"


class Label(StrEnum):
    """Classifier labels (docs/cognition.md, "Routing"); only ``CHAT`` keeps reflex."""

    CHAT = "CHAT"
    GROUNDED = "GROUNDED"  # needs tools, files, live data or verification
    EXACT = "EXACT"  # needs a precise value
    DEEP = "DEEP"  # emotionally or intellectually deep


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """The router's answer.

    Args:
        route: reflex or deliberate.
        reason: ``"<rule>: <detail>"``; the rule is a heuristic rule name (module table),
            ``"classifier"`` or ``"uncertain"`` (no classifier given).
        label: the classifier's label when it was asked and answered readably, else ``None``.
        classifier_error: why the classification was unusable (exception or unreadable
            reply), else ``None``.
    """

    route: Route
    reason: str
    label: str | None = None
    classifier_error: str | None = None


#: Characters of input the classifier sees: enough to label a message, so a long paste
#: costs the classifier call no more than this.
CLASSIFIER_INPUT_CHARS = 1500
#: Classifier request parameters, for the caller that sends :func:`classifier_messages`.
CLASSIFIER_MAX_TOKENS = 8
CLASSIFIER_TEMPERATURE = 0.2

TINY_CHARS = 4  # under this many characters → reflex
CASUAL_MAX_CHARS = 120
REACTION_MAX_CHARS = 18
LONG_CHARS = 200  # over this many characters → deliberate
BRIEF_CHARS = 80  # under this many characters, with no deliberate cue → reflex
GREETING_EXTRA_WORDS = 4  # a greeting opening followed by at most this many words → reflex

GREETINGS = (
    "hi", "hii", "hello", "hey", "heya", "hiya", "howdy", "yo", "sup", "hi there", "hey there",
    "hello there", "good morning", "good night", "good evening", "gm", "gn", "morning", "night",
    "thanks", "thank you", "thanks a lot", "thank you so much", "thx", "ty", "tysm", "cheers",
    "ok", "okay", "k", "kk", "ok thanks", "okay thanks", "ok cool", "got it", "sure", "yes", "no",
    "yep", "yup", "nope", "np", "no problem", "bye", "goodbye", "bye bye", "see you", "see ya",
    "cya", "later", "lol", "lmao", "haha", "hahaha", "nice", "cool", "great", "awesome",
)  # fmt: skip
#: Openings of a greeting followed by a name or a few words ("hello Sam", "good morning Alice!").
GREETING_OPENINGS = (
    "hi", "hii", "hello", "hey", "heya", "hiya", "howdy", "yo", "sup", "hi there", "hey there",
    "hello there", "good morning", "good afternoon", "good evening", "good night", "gm", "gn",
    "morning", "evening", "greetings", "thanks", "thank you", "thx", "ty", "cheers", "bye",
    "goodbye", "night", "see you", "see ya", "cya",
)  # fmt: skip
CASUAL_WORDS = (
    "wagwan", "wag1", "sup", "wassup", "whatsup", "nm", "nmu", "nuthin", "nothin", "chillin",
    "chilling", "lol", "lool", "lmao", "lmfao", "rofl", "haha", "hahaha", "hehe", "innit", "nah",
    "yo", "bruh", "bro", "fam", "dude", "yeah", "yea", "ya", "yep", "nope", "nice", "cool",
    "omg", "ikr", "tbh", "ngl", "fr", "lit", "vibes", "vibing", "gg", "xd", "wbu", "hbu", "idk",
    "dunno", "gonna", "wanna", "kinda", "dope", "aight", "ight",
)  # fmt: skip
CODE_WORDS = (
    "write", "create", "fix", "debug", "run it", "run this", "run that", "run the", "run my",
    "run a", "run an", "install", "deploy", "script", "function", "code",
    "coding", "programming", "python", "javascript", "typescript", "java", "rust",
    "golang", "bash", "shell", "terminal", "command", "compile", "compiler", "bug", "error",
    "exception", "traceback", "stack trace", "api", "sql", "database", "regex", "git", "github",
    "docker", "kubernetes", "config", "json", "yaml", "html", "css", "npm", "pip", "algorithm",
    "refactor", "unit test",
)  # fmt: skip
IDENTITY_PHRASES = (
    "who are you", "what kind of bot", "your name", "ur name", "who made you", "who created you",
    "who built you", "are you a bot", "are you an ai", "are you ai", "are you human",
    "are you real", "are you alive", "are you sentient", "are you conscious",
    "what can you do", "what tools", "your tools", "your abilities", "your capabilities",
    "how do you work", "what model",
)  # fmt: skip
FILE_WORDS = (
    "readme", "repo", "repository", "workspace", "directory", "folder", "project root",
    "codebase", "file", "files", "filename", "file path", "list files", "show files", "check files",
)  # fmt: skip
FILE_EXTENSIONS = (
    "md", "txt", "yaml", "yml", "json", "toml", "ini", "cfg", "conf", "env", "py", "js", "ts",
    "tsx", "jsx", "sh", "rs", "go", "java", "c", "cpp", "h", "cs", "rb", "php", "html", "css",
    "sql", "csv", "log", "xml", "pdf", "docx", "xlsx", "ipynb", "lock",
)  # fmt: skip
RESEARCH_WORDS = (
    "search", "look up", "look it up", "lookup", "google", "latest", "news", "headlines",
    "compare", "comparison", "research", "sources", "cite", "citation", "wikipedia",
    "fact check", "fact-check", "weather", "forecast", "exchange rate", "stock price",
    "share price",
)  # fmt: skip
EMOTIONAL_WORDS = (
    "afraid", "scared", "terrified", "fear", "grief", "grieve", "grieving", "mourning", "death",
    "dying", "died", "funeral", "depressed", "depression", "lonely", "loneliness", "love",
    "heartbroken", "heartbreak", "breakup", "broke up", "divorce", "anxious", "anxiety", "panic",
    "suicide", "suicidal", "self-harm", "hopeless", "worthless", "trauma", "crying", "cried",
    "hurt", "hurting", "regret", "ashamed", "guilt", "guilty", "feel", "feeling", "feelings",
    "meaning", "meaning of life", "purpose", "exist", "existence", "existential", "philosophy",
    "philosophical", "consciousness", "mortality", "soul",
)  # fmt: skip


def _words(words: Iterable[str]) -> re.Pattern[str]:
    """One case-insensitive regex matching any of ``words`` on word boundaries."""
    alternatives = sorted({re.escape(w).replace(r"\ ", r"\s+") for w in words}, key=len)
    return re.compile(r"\b(?:" + "|".join(reversed(alternatives)) + r")\b", re.IGNORECASE)


_CASUAL = _words(CASUAL_WORDS)
_LAUGH = re.compile(r"\b(?:a?ha(?:ha)+h?|he(?:he)+|lo+l|lmf?ao+|x+d+)\b", re.IGNORECASE)
_CODE = _words(CODE_WORDS)
_CODE_MARKS = re.compile(
    r"```|`[^`\n]+`|Traceback \(most recent call last\)|\b\w+(?:Error|Exception)\b"
    r"|File \"[^\"]+\", line \d+"
)
_IDENTITY = _words(IDENTITY_PHRASES)
_FILE = _words(FILE_WORDS)
#: A name such as ``my-notes`` before a dot, matched from the start of its run of word
#: characters and hyphens only (``\b[\w-]+\.`` would try every hyphen of ``a-a-a-…`` again:
#: quadratic, seconds on a 10,000-character message).
_NAME_RUN = r"(?<![\w-])-*\w[\w-]*\."
_FILE_NAME = re.compile(
    _NAME_RUN + r"(?:" + "|".join(FILE_EXTENSIONS) + r")\b|\bline\s+\d+\b", re.IGNORECASE
)
_RESEARCH = _words(RESEARCH_WORDS)
_URL = re.compile(r"\bhttps?://\S+|\bwww\.\S+|" + _NAME_RUN + r"(?:com|org|net|io|dev|ai)\b", re.I)
_EMOTIONAL = _words(EMOTIONAL_WORDS)
_GREETINGS = frozenset(GREETINGS)
_GREETING_OPENINGS = frozenset(GREETING_OPENINGS)
_NOT_WORD = re.compile(r"[^\w\s']+")
_WORD_CHAR = re.compile(r"[^\W_]")

_DELIBERATE_CUES: tuple[tuple[str, tuple[re.Pattern[str], ...]], ...] = (
    ("code", (_CODE_MARKS, _CODE)),
    ("identity", (_IDENTITY,)),
    ("file", (_FILE_NAME, _FILE)),
    ("research", (_URL, _RESEARCH)),
    ("emotional", (_EMOTIONAL,)),
)


def heuristic(
    text: str, *, source: str = Source.CHAT, always_deliberate: bool = False
) -> RouteDecision | None:
    """Route ``text`` by the rules in the module table, or return ``None`` when uncertain.

    Args:
        text: the person's message (for automation/autonomous input, the trigger text).
        source: ``"chat"``, ``"automation"`` or ``"autonomous"`` (:class:`Source`).
        always_deliberate: the entity's ``always_deliberate`` setting.

    Raises:
        ValueError: ``source`` is not a :class:`Source` value.
    """
    source = Source(source)
    if source is not Source.CHAT:
        return RouteDecision(Route.DELIBERATE, f"forced: {source} input")
    if always_deliberate:
        return RouteDecision(Route.DELIBERATE, "forced: entity always_deliberate")
    stripped = text.strip()
    if len(stripped) < TINY_CHARS:
        return RouteDecision(Route.REFLEX, f"tiny: {len(stripped)} chars")
    normalised = " ".join(_NOT_WORD.sub(" ", stripped.lower()).split())
    if normalised in _GREETINGS:
        return RouteDecision(Route.REFLEX, f"greeting: {normalised!r}")
    if not _WORD_CHAR.search(stripped) and len(stripped) <= CASUAL_MAX_CHARS:
        return RouteDecision(Route.REFLEX, "reaction: no words")
    for rule, patterns in _DELIBERATE_CUES:
        for pattern in patterns:
            if m := pattern.search(stripped):
                return RouteDecision(Route.DELIBERATE, f"{rule}: {m.group(0)!r}")
    if len(stripped) > LONG_CHARS:
        return RouteDecision(Route.DELIBERATE, f"long: {len(stripped)} chars")
    if greeting := _greeting_opening(normalised):
        opening, more = greeting
        return RouteDecision(Route.REFLEX, f"greeting: {opening!r} and {more} more word(s)")
    question = "?" in stripped
    if len(stripped) <= CASUAL_MAX_CHARS and not question:
        if m := _CASUAL.search(stripped) or _LAUGH.search(stripped):
            return RouteDecision(Route.REFLEX, f"casual: {m.group(0)!r}")
    if len(stripped) <= REACTION_MAX_CHARS and (question or "!" in stripped):
        return RouteDecision(Route.REFLEX, "reaction: tiny question or exclamation")
    if len(stripped) < BRIEF_CHARS:
        return RouteDecision(Route.REFLEX, f"brief: {len(stripped)} chars, no cue")
    return None


def _greeting_opening(normalised: str) -> tuple[str, int] | None:
    """The greeting ``normalised`` opens with and how many words follow it, when at most
    :data:`GREETING_EXTRA_WORDS` do ("hello sam" → ``("hello", 1)``), else ``None``.

    ``normalised`` is lowercased, with punctuation turned into single spaces; the split stops
    after 6 pieces, so the work is linear in its length."""
    words = normalised.split(" ", GREETING_EXTRA_WORDS + 2)  # never more than 7 pieces
    for size in (2, 1):  # the longer opening first: "good morning" before "good"
        opening = " ".join(words[:size])
        if len(words) >= size and opening in _GREETING_OPENINGS:
            more = len(words) - size
            return (opening, more) if more <= GREETING_EXTRA_WORDS else None
    return None


def classifier_messages(text: str) -> list[dict[str, str]]:
    """The classifier prompt: a system message and the input cut to 1500 characters.

    Returns:
        OpenAI chat messages ``[{"role": "system", ...}, {"role": "user", ...}]`` asking for
        exactly one label out of CHAT, GROUNDED, EXACT, DEEP (GROUNDED when unsure, as in the
        reference).
    """
    system = (
        "You route chat messages. Reply with exactly one word: CHAT, GROUNDED, EXACT or DEEP.\n"
        "CHAT: casual talk, greetings, banter, opinions, a simple question a friend could "
        "answer in a sentence or two from general knowledge.\n"
        "GROUNDED: needs tools, files, live or current information (weather, news, prices, "
        "schedules), a web lookup, or verification.\n"
        "EXACT: asks for a precise value: a number, date, quote, calculation, code or a "
        "specific fact that must be right.\n"
        "DEEP: emotionally significant, personal, philosophical, or needs careful reasoning.\n"
        "If unsure, answer GROUNDED. Do not answer the message itself."
    )
    user = f"Message to label:\n{text[:CLASSIFIER_INPUT_CHARS]}"
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


_LABEL_PRIORITY = (Label.EXACT, Label.GROUNDED, Label.DEEP, Label.CHAT)


def parse_label(reply: str) -> Label | None:
    """The label in a classifier reply, tolerant of case, punctuation and a ``Label:`` prefix.

    If several labels appear, the most cautious wins (EXACT, GROUNDED, DEEP, then CHAT), so
    a doubt costs tokens rather than a thin answer. A truncated or unrelated reply gives ``None``.
    """
    words = set(re.findall(r"[a-z]+", reply.lower()))
    return next((label for label in _LABEL_PRIORITY if label.lower() in words), None)


Classify = Callable[[list[dict[str, str]]], Awaitable[str]]


async def route(
    text: str,
    *,
    classify: Classify | None,
    source: str = Source.CHAT,
    always_deliberate: bool = False,
) -> RouteDecision:
    """Decide reflex or deliberate for one turn (docs/cognition.md, "Routing").

    Args:
        text: the input, as for :func:`heuristic`.
        classify: sends the given messages to the **reflex** model with
            ``max_tokens=CLASSIFIER_MAX_TOKENS`` (8) and ``temperature=CLASSIFIER_TEMPERATURE``
            (0.2), thinking off, and returns the raw completion text. Called at most once,
            only when the heuristic is uncertain; any timeout is the caller's to apply (a
            raised exception routes deliberate). ``None`` means uncertain input goes
            deliberate.
        source: ``"chat"``, ``"automation"`` or ``"autonomous"``.
        always_deliberate: the entity's ``always_deliberate`` setting.

    Returns:
        The decision; only a readable CHAT label keeps an uncertain input on reflex.

    Raises:
        ValueError: ``source`` is unknown. Errors from ``classify`` are not raised (they set
        ``classifier_error``); cancellation propagates.
    """
    decision = heuristic(text, source=source, always_deliberate=always_deliberate)
    if decision is not None:
        return decision
    if classify is None:
        return RouteDecision(Route.DELIBERATE, "uncertain: no classifier")
    try:
        reply = await classify(classifier_messages(text))
    except Exception as exc:  # any failure of the model call routes deliberate (the safe side)
        error = f"{type(exc).__name__}: {exc}"
        return RouteDecision(Route.DELIBERATE, "classifier: failed", classifier_error=error)
    label = parse_label(reply)
    if label is None:
        error = f"unreadable reply: {reply[:80]!r}"
        return RouteDecision(Route.DELIBERATE, "classifier: unreadable", classifier_error=error)
    chosen = Route.REFLEX if label is Label.CHAT else Route.DELIBERATE
    return RouteDecision(chosen, f"classifier: {label}", label=label)
