"""Tests for bumblebot.cognition.router (spec: cognition.md "Routing")."""

from __future__ import annotations

import pytest
from conftest import running, write_config

from bumblebot.cognition.router import (
    CLASSIFIER_INPUT_CHARS,
    Label,
    Route,
    RouteDecision,
    classifier_messages,
    heuristic,
    parse_label,
    route,
)


class RecordingClassifier:
    """A classifier that records each call and answers with a fixed reply or error."""

    def __init__(self, reply: str = "CHAT", error: Exception | None = None) -> None:
        self.reply = reply
        self.error = error
        self.calls: list[list[dict[str, str]]] = []

    async def __call__(self, messages: list[dict[str, str]]) -> str:
        self.calls.append(messages)
        if self.error is not None:
            raise self.error
        return self.reply


#: Unclear input: between 80 and 200 characters, no cue either way (the classifier decides).
UNCLEAR = (
    "so my sister and I were arguing last night about whether a tomato counts as a fruit "
    "or a vegetable, who is right?"
)
assert 80 <= len(UNCLEAR) <= 200


def rule(decision: RouteDecision | None) -> str | None:
    return None if decision is None else decision.reason.split(":")[0]


# --- acceptance scenarios: inputs and the route each must take --------------------------------


async def test_hi_is_reflex_without_classifier():
    classify = RecordingClassifier()
    decision = await route("hi", classify=classify)
    assert decision.route is Route.REFLEX
    assert decision.label is None
    assert classify.calls == []


@pytest.mark.parametrize("text", ["nah nuthin much, wagwan", "WHAT?"])
async def test_slang_and_tiny_reactions_are_reflex_without_classifier(text):
    classify = RecordingClassifier(reply="DEEP")
    decision = await route(text, classify=classify)
    assert decision.route is Route.REFLEX
    assert classify.calls == []


async def test_whats_your_name_is_deliberate_without_classifier():
    classify = RecordingClassifier()
    decision = await route("what's your name?", classify=classify)
    assert decision.route is Route.DELIBERATE
    assert rule(decision) == "identity"
    assert classify.calls == []


@pytest.mark.parametrize(
    ("kwargs", "expected_rule"),
    [
        ({"source": "automation"}, "forced"),
        ({"source": "autonomous"}, "forced"),
        ({"always_deliberate": True}, "forced"),
    ],
)
async def test_forced_deliberate_skips_classifier(kwargs, expected_rule):
    classify = RecordingClassifier()
    decision = await route("hi", classify=classify, **kwargs)
    assert decision.route is Route.DELIBERATE
    assert rule(decision) == expected_rule
    assert classify.calls == []


async def test_unknown_source_is_rejected():
    with pytest.raises(ValueError):
        await route("hi", classify=None, source="webhook")


@pytest.mark.parametrize(
    ("reply", "expected_route", "expected_label"),
    [
        ("CHAT", Route.REFLEX, Label.CHAT),
        ("GROUNDED", Route.DELIBERATE, Label.GROUNDED),
        ("EXACT", Route.DELIBERATE, Label.EXACT),
        ("DEEP", Route.DELIBERATE, Label.DEEP),
        ("the weather is nice", Route.DELIBERATE, None),
    ],
)
async def test_uncertain_input_asks_the_classifier_once(reply, expected_route, expected_label):
    text = UNCLEAR
    assert heuristic(text) is None
    classify = RecordingClassifier(reply=reply)
    decision = await route(text, classify=classify)
    assert classify.calls == [classifier_messages(text)]
    assert decision.route is expected_route
    assert decision.label == expected_label
    assert (decision.classifier_error is None) == (expected_label is not None)


async def test_classifier_exception_routes_deliberate_with_the_error():
    classify = RecordingClassifier(error=TimeoutError("reflex model timed out"))
    decision = await route(UNCLEAR, classify=classify)
    assert len(classify.calls) == 1
    assert decision.route is Route.DELIBERATE
    assert decision.label is None
    assert decision.classifier_error == "TimeoutError: reflex model timed out"


async def test_uncertain_without_classifier_is_deliberate():
    decision = await route(UNCLEAR, classify=None)
    assert decision.route is Route.DELIBERATE
    assert rule(decision) == "uncertain"


# --- heuristic rules ---------------------------------------------------------------------------


def test_long_technical_question_is_deliberate():
    text = (
        "I have a Python service that reads a YAML config at startup and crashes with a "
        "KeyError when the database section is missing; how should I restructure the loader so "
        "defaults apply and the error message says which key is absent?"
    )
    decision = heuristic(text)
    assert decision is not None and decision.route is Route.DELIBERATE
    assert rule(decision) == "code"


def test_report_is_not_repo():
    decision = heuristic("can you send me the report?")
    assert rule(decision) != "file"
    assert rule(heuristic("can you check the repo?")) == "file"


def test_glove_is_not_love():
    assert rule(heuristic("I lost my glove")) != "emotional"
    assert rule(heuristic("I lost someone I love")) == "emotional"


def test_lollipop_is_not_lol():
    assert rule(heuristic("I want a lollipop")) != "casual"
    assert rule(heuristic("lol that is so true")) == "casual"


@pytest.mark.parametrize(
    ("text", "expected_rule", "expected_route"),
    [
        ("hello!", "greeting", Route.REFLEX),
        ("Thank you!!", "greeting", Route.REFLEX),
        ("ok", "tiny", Route.REFLEX),
        ("😂😂😂😂", "reaction", Route.REFLEX),
        ("really?", "reaction", Route.REFLEX),
        ("haha that's wild", "casual", Route.REFLEX),
        ("what can you do?", "identity", Route.DELIBERATE),
        ("please open notes.md", "file", Route.DELIBERATE),
        ("What's in the README", "file", Route.DELIBERATE),
        ("look at line 42", "file", Route.DELIBERATE),
        ("```\nprint(1)\n```", "code", Route.DELIBERATE),
        ("Traceback (most recent call last): boom", "code", Route.DELIBERATE),
        ("yo fix my script", "code", Route.DELIBERATE),
        ("search for the latest news on the election", "research", Route.DELIBERATE),
        ("what is https://example.org about", "research", Route.DELIBERATE),
        ("I'm so lonely tonight", "emotional", Route.DELIBERATE),
        ("what is the meaning of life", "emotional", Route.DELIBERATE),
        ("tell me a story " * 15, "long", Route.DELIBERATE),
    ],
)
def test_heuristic_rules(text, expected_rule, expected_route):
    decision = heuristic(text)
    assert decision is not None
    assert (rule(decision), decision.route) == (expected_rule, expected_route)


@pytest.mark.parametrize(
    "text",
    [
        "what did you have for breakfast today?",
        "I lost my glove",
        "lol what are you up to this weekend?",  # a question: "casual" does not take it, "brief" does
        "how was your day",
        "do you prefer cats or dogs?",
        "x" * 79,
    ],
)
async def test_brief_inputs_without_cues_are_reflex_without_classifier(text):
    """Spec: brief questions under 80 characters go reflex without a classifier call (one request
    a turn)."""
    assert rule(heuristic(text)) == "brief"
    classify = RecordingClassifier(reply="DEEP")
    decision = await route(text, classify=classify)
    assert decision.route is Route.REFLEX
    assert classify.calls == []


@pytest.mark.parametrize(
    "text",
    [
        "hello Sam",
        "hey there buddy",
        "good morning Alice!",
        "hi bumblebot how are you",
        "Thanks, see you tomorrow!",
        # a greeting with a long name is still a greeting, past the 80 characters of "brief"
        "Good evening, Professor Maximilianus Featherstonehaughington Cholmondeleyworthington!",
    ],
)
async def test_a_greeting_with_a_name_or_a_few_words_is_reflex_without_classifier(text):
    assert len(text) < 80 or text.startswith("Good evening, Professor")
    classify = RecordingClassifier(reply="GROUNDED")
    decision = await route(text, classify=classify)
    assert decision.route is Route.REFLEX
    assert rule(decision) == "greeting"
    assert classify.calls == []


def test_a_greeting_opening_takes_at_most_four_more_words():
    assert heuristic("hello there my dear old friend").reason == (
        "greeting: 'hello there' and 4 more word(s)"
    )
    # five more words: not the greeting rule (short, so "brief" takes it)
    assert rule(heuristic("hello there my dear old friend Sam")) == "brief"
    # and past 80 characters without a cue, the classifier decides
    text = "hey " + "what do you think " * 5
    assert len(text) > 80 and heuristic(text) is None


@pytest.mark.parametrize(
    ("text", "expected_rule"),
    [
        ("hello, who are you?", "identity"),
        ("hi, can you fix my python script?", "code"),
        ("hey Sam, check the readme", "file"),
        ("good morning! any news today?", "research"),
        ("hi, I feel so lonely", "emotional"),
        ("how's lisbon weather tomorrow?", "research"),  # live data: not a brief chat
        ("what's the exchange rate of the euro", "research"),
    ],
)
async def test_deliberate_cues_win_over_greeting_and_brief(text, expected_rule):
    classify = RecordingClassifier(reply="CHAT")
    decision = await route(text, classify=classify)
    assert decision.route is Route.DELIBERATE
    assert rule(decision) == expected_rule
    assert classify.calls == []


@pytest.mark.parametrize("length", [80, 140, 200])
async def test_unclear_input_of_80_to_200_characters_reaches_the_classifier(length):
    text = ("tell me what you honestly think about pineapple on pizza " * 4)[:length]
    assert heuristic(text) is None
    classify = RecordingClassifier(reply="CHAT")
    decision = await route(text, classify=classify)
    assert classify.calls == [classifier_messages(text)]
    assert decision.route is Route.REFLEX and decision.label is Label.CHAT


def test_over_200_characters_is_deliberate_without_cue():
    assert rule(heuristic("tell me what you think " * 9)) == "long"


def test_cues_match_whole_words_case_insensitively():
    assert rule(heuristic("I need to DEBUG this")) == "code"
    assert rule(heuristic("the runway was wet today")) == "brief"  # "run" is not "runway"
    assert rule(heuristic("a cool breeze")) == "casual"
    assert rule(heuristic("coolant levels look fine")) == "brief"  # "cool" is not "coolant"


# --- classifier prompt and parsing -------------------------------------------------------------


def test_classifier_messages_ask_for_one_label_and_cut_the_input():
    text = "a" * CLASSIFIER_INPUT_CHARS + "TAIL"
    system, user = classifier_messages(text)
    assert system["role"] == "system" and user["role"] == "user"
    for label in Label:
        assert label.value in system["content"]
    assert "a" * CLASSIFIER_INPUT_CHARS in user["content"]
    assert "TAIL" not in user["content"]


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        ("chat", Label.CHAT),
        ("CHAT.", Label.CHAT),
        ("Label: GROUNDED", Label.GROUNDED),
        (" exact\n", Label.EXACT),
        ("**DEEP**", Label.DEEP),
        ("CHAT or GROUNDED", Label.GROUNDED),  # the more cautious label wins
        ("GROUN", None),  # cut off by max_tokens
        ("chatty", None),
        ("banana", None),
        ("", None),
    ],
)
def test_parse_label(reply, expected):
    assert parse_label(reply) == expected


def test_running_errands_is_not_code_but_running_a_script_is():
    """"I'm gonna run to the store" is reflex ("run" alone once sent it to the deliberate model
    with its judge); running something still is code."""
    errand = heuristic("I'm gonna run to the store, brb")
    assert errand is not None and errand.route is Route.REFLEX
    for text in ("can you run the tests", "run this for me", "please run my script"):
        decision = heuristic(text)
        assert decision is not None and decision.route is Route.DELIBERATE and decision.reason.startswith("code")


# -- through the whole daemon ------------------------------------------------------------------


async def test_group_routing_reads_the_words_not_the_speaker(tmp_path, llm, tg):
    """"[Python Fan]: hey" is routed by its words (reflex, no classifier call), not as code for
    the speaker's name."""
    from bumblebot.core.events import ChatKind, ChatRef, Inbound, Platform
    from bumblebot.store import JournalEntry

    config = write_config(tmp_path, llm, tg, cognition={"classifier": True})
    async with running(config) as d:
        entry = JournalEntry(1, Inbound(ChatRef(Platform.DISCORD, "5"), "1", "7", "Python Fan", "hey", ChatKind.GROUP), "pending")
        state = await d.runner.preparer.start_state([entry])
    assert state.route == "reflex" and llm.requests == []  # no classifier call either
