"""The text rules (bumblebot/core/textrules.py): the only places the engine reads what the model
wrote. Each rule removes text that is not for the user, and nothing the user asked for."""

from __future__ import annotations

import json

import pytest
from conftest import running, write_config
from fakes.openai_server import is_loop, tool_calls
from support import judges_say_done

from bumblebot.cognition.notes import CLOSING_NUDGE, model_words, post_tool_nudge
from bumblebot.core.textrules import (
    TURN_CONTEXT,
    EchoFilter,
    call_as_text,
    may_be_call,
    shown_so_far,
    strip_reasoning,
)

TOOLS = frozenset({"say", "end_turn", "read_file", "list_directory", "write_file"})


# -- reasoning ---------------------------------------------------------------------------------


def test_reasoning_blocks_lone_closing_tags_and_cut_off_thoughts_are_removed():
    assert strip_reasoning("<think>plan</think>Hello") == "Hello"
    assert strip_reasoning("thinking…</think>answer") == "answer"  # the template opened it
    assert strip_reasoning("<think>cut off mid-thought") == ""
    assert strip_reasoning("<THINKING>x</THINKING> hi <reasoning>y</reasoning>!") == "hi !"


def test_a_tag_mentioned_mid_reply_stays():
    mentioned = "Use a <thinking> tag in your prompt to see it."
    assert strip_reasoning(mentioned) == mentioned


def test_case_folding_keeps_positions_of_characters_that_grow_when_lowered():
    assert strip_reasoning("İİİİ <think>secret</think> answer here") == "İİİİ  answer here"


def test_a_streamed_reply_shows_nothing_of_an_open_block_nor_half_a_tag():
    assert shown_so_far("<think>still thinking") == ""
    assert shown_so_far("Hello <thi") == "Hello"
    assert shown_so_far("<think>a</think>Hello") == "Hello"


# -- call as text -------------------------------------------------------------------------------


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "read_file", "arguments": {"path": "a.txt"}}</tool_call>',
    '<tool_call>{"name": "read_file", "arguments": {"pa',  # cut off inside the block
    "functions.list_directory: { }",
    'functions.read_file({"path": "a"})',
    '{"name": "read_file", "arguments": {"path": "notes.md"}}',
    '{"name": "say", "parameters": {"text": "hi"}}',  # Llama 3.1's JSON tool format
    '[{"name": "say", "arguments": {}}, {"name": "end_turn", "arguments": {}}]',
    '{"type": "function", "function": {"name": "read_file", "arguments": "{}"}}',
])
def test_a_reply_that_is_only_a_call_in_a_template_syntax_is_a_call(text):
    assert call_as_text(text, TOOLS)


@pytest.mark.parametrize("text", [
    '{"name": "Bob", "age": 3}',  # the JSON the user asked for: Bob is no tool
    '{"name": "read_file"}  and that is the name of the tool',
    '{"name": "read_file", "age": 3}',  # age is no key of a call
    "functions.unknown_tool: {}",
    "Here is a call: <tool_call>{}</tool_call>",  # prose around it: not only a call
    "functions.read_file reads a file.",
    "Plain words.",
    "[1, 2, 3]",
    "{not json",
    '```json\n{"name": "read_file", "arguments": {"path": "a"}}\n```',  # an example in a code block
    "<tool_call> is the tag Hermes templates wrap a call in.",
    "functions.read_file(path) reads a file.",
    '{"name": "fetch_url", "type": "tool", "id": 7}',  # no arguments: a description, not a call
])
def test_text_the_user_asked_for_is_never_a_call(text):
    assert not call_as_text(text, TOOLS)


def test_deeply_nested_json_is_not_a_call_and_does_not_raise():
    assert not call_as_text("[" * 100_000 + "]" * 100_000, TOOLS)


@pytest.mark.parametrize(("so_far", "maybe"), [
    ("{", True), ('{"na', True), ('{"name": "re', True), ('{"name": "read_file", "arg', True),
    ('{"name": "B', False), ('{"name": "Bob"', False), ('{"age": 3', False),
    ("<tool", True), ("functions.re", True), ("functions.xyz", False),
    ("```", False), ('```json\n{"name"', False), ("Hello", False), ("Sure, here's one:", False),
    ("<tool_call> is", False), ("functions.read_file reads", False), ("functions.read_file:", True),
])
def test_a_streamed_reply_is_held_only_while_it_may_still_become_a_call(so_far, maybe):
    assert may_be_call(so_far, TOOLS) is maybe


# -- engine echo --------------------------------------------------------------------------------

NUDGE = (
    '[Same turn] Tool results are ready; failed: read_file. Already told the user (do not repeat): '
    '"hi". Next: call more tools, say() to talk to the user, or end_turn() when done.'
)


@pytest.mark.parametrize(("said", "shown"), [
    ("[Same turn] Tool results are ready; failed: read_file. The answer is 42.", "The answer is 42."),
    ("Next: call more tools, say() to talk to the user, or end_turn() when done. Bye!", "Bye!"),
    (f"{TURN_CONTEXT}\nHello", "Hello"),
    ("Tool results are ready; failed: read_file.", ""),
])
def test_sentences_copied_from_the_engine_notes_of_the_turn_are_removed(said, shown):
    assert EchoFilter([NUDGE, TURN_CONTEXT])(said) == shown


@pytest.mark.parametrize("said", [
    "[1] is a footnote.",
    "[Same turn] Here is the weather: sunny.",  # a marker opening new words: the words are the model's
    "[Turn context] is the block the system adds to your message.",
    "Sure. Let me look. Back soon.",  # quoted by the note ("Already told the user"): still the model's
    "Let me look.",
    "Tool results are ready in the other tab.",  # not a sentence the engine wrote
    "Keep   this.  Two\tspaces\n\nand this",  # untouched, spacing and all
    "```\nTool results are ready; failed: read_file.\n```",  # code is kept whole
    "Next step: call more tools.",
])
def test_anything_else_stays_exactly_as_written(said):
    assert EchoFilter([NUDGE, TURN_CONTEXT])(said) == said


def test_a_sentence_that_quotes_what_the_model_said_is_the_engine_s():
    told = 'Already told the user (do not repeat): "Sure. Let me look. Back soon.". Next: say() or end_turn().'
    echoes = EchoFilter([told])
    assert echoes('Already told the user (do not repeat): "Sure. Let me look. Back soon.". Ok!') == "Ok!"
    assert echoes("Sure. Let me look. Back soon.") == "Sure. Let me look. Back soon."


@pytest.mark.parametrize(("so_far", "shown"), [
    ("[Same tu", ""), ("[Same turn] Tool results are re", ""), ("Hello. Tool res", "Hello."),
    ("Hello there", "Hello there"), ("Tool results are ready; failed: read_file. Fi", "Fi"),
])
def test_a_text_still_being_written_hides_a_sentence_that_may_become_an_echo(so_far, shown):
    assert EchoFilter([NUDGE, TURN_CONTEXT]).partial(so_far) == shown


def test_code_is_never_taken_for_reasoning():
    block = "```html\n<think>x</think>\n```"
    assert strip_reasoning(block) == block
    assert strip_reasoning("Use `<think>` and `</think>` tags.") == "Use `<think>` and `</think>` tags."
    assert strip_reasoning("<think>a</think>Hello `x` <think>b</think>!") == "Hello `x` !"


def test_a_sentence_holding_six_words_in_a_row_of_a_note_is_an_echo_however_it_goes_on():
    """What SmolLM2-135M sent when asked for closing words: the request, copied and mangled."""
    closing = ("[Same turn] No tools now: your turn is over (your last steps repeated themselves). Write to the "
               "user, in the language they wrote in, a short plain message.")
    echoes = EchoFilter([closing])
    said = "Write to the user, in the language they wrote their response; otherwise what you did"
    assert echoes(said) == ""
    assert echoes("I have nothing to reply.\n\nYour turn is over (your last steps repeated") == "I have nothing to reply."
    assert echoes("Hello! Write to the user soon.") == "Hello! Write to the user soon."  # five words: a phrase


def test_an_echo_through_a_template_that_escapes_the_prompt_is_still_an_echo():
    """llama-cpp-python's template showed SmolLM2 "user&#39;s"; it copied the note that way.
    The comparison reads the references; what is delivered keeps them as written."""
    echoes = EchoFilter(["[Same turn] No tools now. Write your answer to the user's last message as plain text."])
    assert echoes("Write your answer to the user&#39;s last message as plain text.") == ""
    assert echoes("It&#39;s fine.") == "It&#39;s fine."


def test_what_a_note_quotes_never_makes_an_echo():
    told = 'Already told the user (do not repeat): "When I went to the bar my friend said hi to all". Next: end_turn().'
    echoes = EchoFilter([told])
    assert echoes("When I went to the bar my friend said hi to all.") == "When I went to the bar my friend said hi to all."


def test_only_the_notes_the_engine_sent_count():
    assert EchoFilter()("Tool results are ready.") == "Tool results are ready."
    echoes = EchoFilter()
    echoes.add("[Same turn] Tool results are ready.")
    assert echoes("Tool results are ready.") == ""


def test_a_long_reply_of_sentences_and_brackets_goes_through_every_rule():
    """Every rule reads the text in one pass (they run on the event loop): a 200,000-character
    reply of sentences and brackets is handled, and only the echoed sentences go."""
    text = "[a] b. " * 30_000 + json.dumps({"name": "x" * 1000})
    assert EchoFilter([NUDGE])(text)
    assert not call_as_text(text, TOOLS)
    assert strip_reasoning(text)


# -- through the whole daemon and the echo filter's keepers ------------------------------------


async def test_reasoning_before_a_lone_closing_tag_reaches_neither_user_nor_history(tmp_path, llm, tg):
    """Templates that pre-fill <think> return "…reasoning…</think>answer": only the answer is sent,
    and the reasoning is not stored."""
    import sqlite3

    judges_say_done(llm)
    llm.push(tool_calls(("say", {"text": "The user wants X.</think>Here you go!"}), ("end_turn", {}),
                        content="secret plan</think>"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("give me X", chat_id=99)
        await d.engine.wait_for_turns(1)
    assert tg.sent(99) == ["Here you go!"]
    stored = "\n".join(r[0] for r in sqlite3.connect(tmp_path / "data" / "bumblebot.db").execute(
        "SELECT content || coalesce(tool_calls, '') FROM messages"))
    assert "secret plan" not in stored
    assert strip_reasoning("thinking…</think>answer") == "answer"


def test_user_text_keeps_urls_test_names_and_plain_sentences():
    from bumblebot.cognition.notes import post_tool_nudge
    from bumblebot.core.textrules import EchoFilter

    nudge = post_tool_nudge(["read_file"], ["hi"])
    echoes = EchoFilter([nudge])
    url = "see https://x.com/?q=x&region=us&copy=2 ok"
    assert echoes(url) == url  # html.unescape once turned "&region" and "&copy" into symbols
    for kept in ("Failed: test_login, test_logout.", "Same turn, different story: I fixed it.",
                 "Tool results are ready: 3 files, a.py b.py c.py", "line one  \nline two",
                 "```\n[Same turn] Tool results are ready.\n```"):
        assert echoes(kept) == kept
    assert echoes(nudge) == ""  # failures ride in the marked sentence


def test_what_a_note_quotes_of_the_model_is_never_an_echo_even_with_quotes_inside():
    """The post-tool note quotes the model's messages; a message holding double quotes (a quoted
    person, an inch mark) once turned the quote parsing inside out, and the model's next
    sentence repeating its own words was cut as a copy of the engine's note."""
    first = 'Alice wrote: "I will be late because the train is delayed by about twenty minutes, sorry."'
    note = post_tool_nudge([], [first])
    echoes = EchoFilter()
    echoes.add(note, model_words=model_words([first], None))
    final = "So Alice will be late because the train is delayed. I moved your meeting to 10:30."
    assert echoes(final) == final
    assert echoes("Tool results are ready. I moved it.") == "I moved it."  # the note's own words still go
    inch = 'The screen is 27" wide and the desk is 30" wide, so it fits on the desk nicely.'
    echoes = EchoFilter()
    echoes.add(post_tool_nudge([], [inch]), model_words=model_words([inch], None))
    again = 'As I said, the desk is 30" wide, so it fits on the desk nicely.'
    assert echoes(again) == again


def test_the_checks_reason_in_a_closing_request_is_the_models_to_restate():
    reason = "milk was never added to the shopping list"
    echoes = EchoFilter()
    echoes.add(CLOSING_NUDGE.format(why=f"a check found the request not done yet: {reason}"),
               model_words=model_words([], reason))
    closing = "Sorry, milk was never added to the shopping list because I could not open it. Want me to try again?"
    assert echoes(closing) == closing


@pytest.mark.parametrize("said", ["No", "a"])
def test_a_one_word_message_of_the_model_leaves_the_notes_own_sentences_whole(said):
    """Taking the model's words out of a note took every "No" or "a" out of the note's own
    sentences ("[Same turn]  tools now.", "re dy"), and the model's copy of the note got through."""
    from bumblebot.cognition.notes import LAST_CHANCE_NUDGE

    echoes = EchoFilter()
    echoes.add(LAST_CHANCE_NUDGE, model_words=model_words([said], None))
    echoes.add(post_tool_nudge([], [said]), model_words=model_words([said], None))
    assert echoes("[Same turn] No tools now. The answer is 4.") == "The answer is 4."
    assert echoes("[Same turn] Tool results are ready. Here it is.") == "Here it is."
