"""What the engine says in a turn: to the model, the notes that steer it (they live only in
the next request, never in history), and to the user, plain notes for when the model cannot
give the words itself."""

from __future__ import annotations

from bumblebot.cognition.limits import REPEAT_LIMIT
from bumblebot.cognition.trace import StopReason
from bumblebot.core.toolkit import ToolResult

# -- to the model ---------------------------------------------------------------------------

INTERRUPTED = (
    "Interrupted: the daemon restarted while this call was running. It may or may not have "
    "taken effect; check before you repeat it."
)
NEVER_SENT = "interrupted before it was sent; it was not delivered"
#: The result of a tool call ``/stop`` cut off.
STOPPED_RESULT = "Stopped: the user stopped this turn (/stop) before the call finished."

#: The last try is a short plain answer (servers that ignore ``max_tokens`` are cut to it).
LAST_CHANCE_MAX_TOKENS = 512
LAST_CHANCE_NUDGE = "[Same turn] No tools now. Write your answer to the user's last message as plain text."
#: Closing words are a sentence or two.
CLOSING_MAX_TOKENS = 160
CLOSING_NUDGE = (
    "[Same turn] No tools now: your turn is over ({why}). Write to the user, in the language they "
    "wrote in, a short plain message: your answer if you have one; otherwise honestly what you did, "
    "what is left, and that they can ask you to go on."
)
#: Why a turn stopped at a limit, as the model is told when asked for its closing words.
LIMIT_WHY = {
    StopReason.STEP_CAP: "you used every step one turn may take",
    StopReason.LOOPING: "your last steps repeated themselves without progress",
    StopReason.BUDGET: "your replies kept running past the length limit",
}

LENGTH_ADVICE_FILE = (
    "Your last replies hit the length limit three times in a row. Put long output in a file with "
    "write_file, then say() a short summary and where the file is."
)
LENGTH_ADVICE = (
    "Your last replies hit the length limit three times in a row. Say less at a time: several "
    "short say() calls instead of one long one."
)


#: How much of each message the post-tool note quotes, and of the check's reason the closing
#: request and note do.
QUOTE_CHARS = 80
REASON_CHARS = 120


def model_words(delivered: list[str], reason: str | None) -> list[str]:
    """The model's own words that notes quote (its messages, whole and as the post-tool note
    clips them; the completion check's reason): never material for the echo rule."""
    return [*delivered, *(clip(t, QUOTE_CHARS) for t in delivered), *([reason, clip(reason, REASON_CHARS)] if reason else [])]


def post_tool_nudge(failed: list[str], delivered: list[str]) -> str:
    """The short note after a tool round (docs/cognition.md, "The agent loop")."""
    # failures share the marked sentence: a weak model that echoes it echoes the marker too
    failures = f"; failed: {', '.join(dict.fromkeys(failed))}" if failed else ""
    parts = [f"[Same turn] Tool results are ready{failures}."]
    if delivered:
        told = "; ".join(f'"{clip(t, QUOTE_CHARS)}"' for t in delivered[-3:])
        parts.append(f"Already told the user (do not repeat): {told}.")
    parts.append("Next: call more tools, say() to talk to the user, or end_turn() when done.")
    return " ".join(parts)


def refused(name: str) -> ToolResult:
    """The result of a call the repeat guard refused."""
    return ToolResult.error(
        f"Not executed: {name} already ran in your last {REPEAT_LIMIT - 1} steps, and the same tool "
        "a third time in a row is refused. Use the results above, try a different tool, or tell the "
        "user what you found and call end_turn."
    )


# -- to the user ------------------------------------------------------------------------------

STEP_CAP_MESSAGE = (
    "I had to stop here: this took more steps than I'm allowed in one turn. "
    "Tell me to continue and I'll pick it up from where I stopped."
)
LOOPING_MESSAGE = "Sorry, I got stuck on that and couldn't finish. Could you put it another way?"
BUDGET_MESSAGE = "Sorry, my answer kept running past the length I'm allowed, so I stopped. Ask me for a shorter part?"
CONTEXT_FULL_MESSAGE = (
    "I had to stop here: this conversation filled my memory. Tell me to continue and I'll go on from a summary."
)
NO_REPLY_MESSAGE = "Sorry, I couldn't put an answer together this time. Could you say that again?"
UNFINISHED_MESSAGE = "Sorry, I didn't get that done this time{why}. Tell me if I should try again."
#: The plain note of each limit.
LIMIT_NOTES = {
    StopReason.STEP_CAP: STEP_CAP_MESSAGE, StopReason.LOOPING: LOOPING_MESSAGE, StopReason.BUDGET: BUDGET_MESSAGE,
}
#: What history keeps of a stopped turn, after what the user saw of it.
STOPPED_NOTE = "[The user stopped this turn with /stop; it ended here.]"
#: recorded when a turn at its message cap ends because the user wrote again
SUPERSEDED_NOTE = (
    "[This turn had sent all the messages it may and ended here, before its next step, because the user "
    "wrote again; anything it had not done yet is not done.]"
)


def clip(text: str, n: int) -> str:
    """``text`` on one line, at most ``n`` characters."""
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "…"
