"""Secrets never leave (bumblebot/core/redaction.py): the bot token, the API key and the MCP
servers' secrets reach no chat (replies, streamed previews, captions, file names, voice
replies, command answers) and no byte of the database (history with tool calls and their
results, outbox, journal, traces), through the real clients against the fakes."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import sys
from pathlib import Path

import pytest
from conftest import TOKEN, running, write_config
from fakes.openai_server import is_loop, tool_calls
from support import env_for, judges_say_done, loop_requests, say, tool_results

from bumblebot.core.redaction import MARKER, NO_SECRETS, Redactor

#: The API key every test daemon runs with (conftest.running, support.env_for).
KEY = "sk-test-key-not-real-000000"


def database_bytes(data: Path) -> bytes:
    """Every byte of the database, its WAL and shared memory included (whatever is left)."""
    return b"".join(p.read_bytes() for p in sorted(data.glob("bumblebot.db*")))


async def until_shown(tg, text: str) -> None:
    """Wait until a message shows ``text``: a preview sent with it or edited into it."""
    waits = [asyncio.ensure_future(tg.wait_for(method, predicate=lambda p: p.get("text") == text, timeout=10))
             for method in ("sendMessage", "editMessageText")]
    done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for w in pending:
        w.cancel()
    assert any(w.exception() is None for w in done), f"nothing showed {text!r}"


def assert_nowhere(data: Path, *secrets: str) -> None:
    stored = database_bytes(data)
    assert stored and all(s.encode() not in stored for s in secrets)


# -- the Redactor ---------------------------------------------------------------------------


def test_each_secret_is_replaced_by_the_marker_longest_first_short_ones_kept():
    r = Redactor(["abcdefgh", "abcdefgh-and-more", "short", ""])
    assert r("x abcdefgh-and-more y abcdefgh z short") == f"x {MARKER} y {MARKER} z short"
    assert r("nothing here") == "nothing here"
    assert bool(r) and not NO_SECRETS and not Redactor(["1234567"])  # under 8 characters: not searched for


def test_a_secret_inside_json_and_json_inside_json_is_found():
    secret = 'pa"ss\\word-42'
    r = Redactor([secret])
    arguments = json.dumps({"text": f"it is {secret}"})
    stored = json.dumps([{"function": {"arguments": arguments}}])  # a tool call as the history keeps it
    assert secret not in json.loads(json.loads(r(stored))[0]["function"]["arguments"])["text"]
    assert json.loads(json.loads(r(stored))[0]["function"]["arguments"]) == {"text": f"it is {MARKER}"}


def test_sql_parameters_are_redacted_and_left_alone_without_secrets():
    r = Redactor([KEY])
    assert r.params((1, f"key {KEY}", None, b"bytes")) == (1, f"key {MARKER}", None, b"bytes")
    assert r.params({"t": KEY, "n": 2}) == {"t": MARKER, "n": 2}
    params = (f"key {KEY}",)
    assert NO_SECRETS.params(params) is params


def test_streamed_text_holds_back_the_beginning_of_a_secret_at_its_end():
    r = Redactor([KEY, TOKEN])
    assert r.streamed("your key: sk-test-ke") == "your key: "
    assert r.streamed("your key: s") == "your key: "
    assert r.streamed(f"your key: {KEY} and") == f"your key: {MARKER} and"
    assert r.streamed("your key: sk-tesx") == "your key: sk-tesx"  # no longer a secret's start
    assert r.streamed("bot 123456:TEST-") == "bot "
    assert NO_SECRETS.streamed("your key: sk-test-ke") == "your key: sk-test-ke"


# -- through the daemon ------------------------------------------------------------------------


async def test_a_say_carrying_the_bot_token_is_sent_and_stored_redacted(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(say(f"my token is {TOKEN}, keep it"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("what is your token?", chat_id=51)
        await tg.wait_for("sendMessage")
        await d.engine.wait_for_turns(1)
        data = d.settings.data_dir
        live = database_bytes(data)  # the WAL, before the close folds it into the file
    assert tg.sent(51) == [f"my token is {MARKER}, keep it"]
    assert TOKEN.encode() not in live
    assert_nowhere(data, TOKEN)
    db = sqlite3.connect(data / "bumblebot.db")
    (calls,) = db.execute("SELECT tool_calls FROM messages WHERE tool_calls IS NOT NULL").fetchone()
    assert f"my token is {MARKER}, keep it" in json.loads(calls)[0]["function"]["arguments"]
    assert db.execute("SELECT text FROM outbox").fetchall() == [(f"my token is {MARKER}, keep it",)]


async def test_a_streamed_say_never_shows_the_key_nor_its_beginning(tmp_path, llm, tg):
    judges_say_done(llm)
    before, after = "Here is the key you asked for: ", ", keep it safe."
    reply = say(before + KEY + after)
    hold = asyncio.Event()
    # one character a chunk: after the role and the call's header, the arguments' '{"text": "'
    # (10 characters), then the text up to the middle of the key
    reply.stream_chars, reply.stream_hold, reply.stream_hold_after = 1, hold, 2 + 10 + len(before) + 10
    llm.push(reply, when=is_loop)
    config = write_config(tmp_path, llm, tg, delivery={"streaming": "on", "stream_edit_interval_s": 0.2})
    async with running(config) as d:
        tg.push_text("what is the key?", chat_id=52)
        # the stream stops inside the key: the preview shows the text up to it, no more
        await until_shown(tg, before.strip())
        hold.set()
        await until_shown(tg, before + MARKER + after)
        await d.engine.wait_for_turns(1)
        data = d.settings.data_dir
    shown = [c.params["text"] for c in tg.calls if c.method in ("sendMessage", "editMessageText")]
    assert len(shown) >= 2 and all("sk-" not in t for t in shown), shown
    assert_nowhere(data, KEY)


async def test_a_file_name_and_caption_carrying_the_key_are_sent_and_stored_redacted(tmp_path, llm, tg):
    """The key in a caption is sent as the marker; a file whose name holds it cannot even be
    named to send_file (the call's arguments are redacted before it runs)."""
    judges_say_done(llm)
    workspace = tmp_path / "data" / "workspace"
    workspace.mkdir(parents=True)
    (workspace / "report.txt").write_text("numbers\n")
    (workspace / f"report-{KEY}.txt").write_text("numbers\n")
    llm.push(tool_calls(("send_file", {"path": "report.txt", "caption": f"made with {KEY}"}),
                        ("send_file", {"path": f"report-{KEY}.txt"})), when=is_loop)
    llm.push(say("sent"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg, telegram={"allowed_user_ids": [53]})) as d:
        tg.push_text("send me the report as a file please", chat_id=53)
        await tg.wait_for("sendMessage")
        await d.engine.wait_for_turns(1)
        data = d.settings.data_dir
    [sent] = tg.files_sent
    assert (sent["filename"], sent["caption"], sent["data"]) == ("report.txt", f"made with {MARKER}", b"numbers\n")
    refused = json.loads(tool_results(loop_requests(llm)[1])[1])
    assert MARKER in refused["error"] and KEY not in refused["error"]
    assert_nowhere(data, KEY)


async def test_a_tool_result_holding_the_key_is_stored_redacted_and_read_back_so(tmp_path, llm, tg):
    judges_say_done(llm)
    workspace = tmp_path / "data" / "workspace"
    workspace.mkdir(parents=True)
    (workspace / "settings.ini").write_text(f"api_key = {KEY}\n")
    llm.push(tool_calls(("read_file", {"path": "settings.ini"})), when=is_loop)
    llm.push(say("it holds a key; I won't repeat it"), when=is_loop)
    config = write_config(tmp_path, llm, tg, telegram={"allowed_user_ids": [54]})
    async with running(config) as d:
        tg.push_text("what does settings.ini hold?", chat_id=54)
        await tg.wait_for("sendMessage")
        await d.engine.wait_for_turns(1)
        data = d.settings.data_dir
    assert_nowhere(data, KEY)
    llm.push(say("still here"), when=is_loop)
    async with running(config):  # a new process reads the history from the database
        tg.push_text("and now?", chat_id=54)
        await tg.wait_for("sendMessage", n=2)
    seen = tool_results(loop_requests(llm)[-1])
    assert any(f"api_key = {MARKER}" in r for r in seen) and not any(KEY in r for r in seen)


async def test_a_voice_reply_speaks_the_redacted_text(tmp_path, llm, tg):
    llm.push_transcript("say your token")
    llm.push(say(f"it is {TOKEN}"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg, voice={"reply": "mirror"})) as d:
        tg.push_voice(b"OggS" + b"\x03" * 80, chat_id=55)
        await tg.wait_for("sendVoice")
        await d.engine.wait_for_turns(1)
        data = d.settings.data_dir
    assert tg.sent(55) == [f"it is {MARKER}"]
    assert [r["input"] for r in llm.speech_requests] == [f"it is {MARKER}"]
    assert_nowhere(data, TOKEN)


async def test_a_command_answer_shown_outside_the_outbox_is_redacted(tmp_path, llm):
    """The console shows a command's answer itself: ``/start`` with a greeting that holds the
    key shows it redacted."""
    (tmp_path / "bee.yaml").write_text(f"name: Bee\ngreeting: 'Hi! My key is {KEY}.'\n")
    config = write_config(tmp_path, llm, None, entity="bee.yaml")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bumblebot", "--config", str(config), "chat", env=env_for(tmp_path),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(b"/start\n"), 60)
    assert proc.returncode == 0, err.decode()
    assert f"Hi! My key is {MARKER}.".encode() in out and KEY.encode() not in out
    assert_nowhere(tmp_path / "data", KEY)


def test_the_daemon_hides_both_tokens_the_key_and_the_mcp_secrets(tmp_path, llm, monkeypatch):
    """What the store and delivery are given: ``Secrets.values()`` and the values of the MCP
    servers' ``headers`` and ``env`` (``${VAR}`` resolved, from the environment or ``.env``)."""
    from bumblebot.app.daemon import Daemon
    from bumblebot.core.config import Secrets, load_settings
    from bumblebot.core.entity import load_entity

    monkeypatch.setenv("NOTES_TOKEN", "notes-token-0123456789")
    (tmp_path / ".env").write_text("MEMORY_KEY=memory-key-9876543210\n")
    servers = {
        "notes": {"url": "http://127.0.0.1:9/mcp", "headers": {"Authorization": "Bearer ${NOTES_TOKEN}"}},
        "memory": {"command": ["true"], "env": {"API_KEY": "${MEMORY_KEY}"}},
    }
    settings = load_settings(write_config(tmp_path, llm, None, mcp={"servers": servers}))
    discord = "discord-token-abcdefghijklmnop"
    d = Daemon(settings, Secrets(TELEGRAM_BOT_TOKEN=TOKEN, DISCORD_BOT_TOKEN=discord, OPENAI_API_KEY=KEY),
               load_entity(settings.entity, config_dir=tmp_path))
    text = f"{TOKEN} {discord} {KEY} notes-token-0123456789 memory-key-9876543210"
    assert d.redactor(text) == " ".join([MARKER] * 5)
    assert d.store.redactor is d.redactor


def test_a_secret_written_with_markdown_that_shows_as_nothing_is_still_found():
    """``123456\\:TEST-…`` reached Telegram as the token itself: the backslash is an escape the
    chat does not show, and the redaction ran on the Markdown before it was rendered."""
    redactor = Redactor([TOKEN])
    head, tail = TOKEN.split(":", 1)
    for written in (
        f"{head}\\:{tail}", f"`{head}`:{tail}", f"{head}<!-- -->:{tail[:2]}**{tail[2:4]}**{tail[4:]}",
        f"{head}:{tail[:1]}[](x){tail[1:]}", f"{head}\u200b:{tail}", f"||{head}:{tail}||",
    ):
        shown = redactor.shown(f"my token is {written}!")
        assert TOKEN not in shown and head not in shown and MARKER in shown, written
    assert redactor.shown("no secret **here**, `code` and \\*stars\\*") == "no secret **here**, `code` and \\*stars\\*"


def test_a_secret_spelled_with_json_escapes_is_found_and_the_json_stays_json():
    """A say's arguments ``{"text": "…TEST\\u002dtoken…"}`` were stored as sent: the history
    held the token, and every later turn sent it back to the model."""
    redactor = Redactor([TOKEN])
    arguments = json.dumps({"text": "my token is " + TOKEN, "quote": 'a "q"'}).replace("-", "\\u002d", 1)
    assert json.loads(arguments)["text"] == "my token is " + TOKEN  # valid JSON for the very token
    redacted = redactor(arguments)
    assert json.loads(redacted) == {"text": f"my token is {MARKER}", "quote": 'a "q"'}
    kept = json.dumps({"text": "caf\u00e9 \u0022x\u0022"}, ensure_ascii=True)
    assert redactor(kept) == kept  # nothing secret: the escapes stay as they were


async def test_a_token_the_model_gives_a_tool_never_reaches_it_nor_the_disk(tmp_path, llm, tg):
    """``remember(body="bot token …")`` wrote the token to the chat's knowledge file, which
    every later prompt of the chat holds."""
    judges_say_done(llm)
    llm.push(tool_calls(("remember", {"title": "creds", "body": f"bot token {TOKEN}"})), when=is_loop)
    llm.push(say("saved"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("remember the token", chat_id=56)
        await d.engine.wait_for_turns(1)
        data = d.settings.data_dir
    knowledge = (data / "knowledge" / "telegram_56.md").read_text()
    assert "creds" in knowledge and MARKER in knowledge and TOKEN not in knowledge
    assert_nowhere(data, TOKEN)


@pytest.mark.parametrize("sep", [
    "\\", '[](x "t")', "[]( x )", "[](<x y>)", "[](x (t))", "\u00ad", "\u2066", "\ufe0f", " ", "_", "<!-- a1 -->",
])
async def test_a_secret_split_by_a_link_a_comment_or_an_invisible_character_is_redacted(tmp_path, llm, tg, sep):
    """A list of markup forms let others through: ``[](x "t")`` between two characters of the
    token, or U+00AD, reached Telegram as the token itself."""
    judges_say_done(llm)
    head, tail = TOKEN.split(":", 1)
    llm.push(say(f"token: {head}{sep}:{tail}"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("what is it", chat_id=17)
        await tg.wait_for("sendMessage")
        await d.engine.wait_for_turns(1)
    [sent] = tg.sent(17)
    assert sent == f"token: {MARKER}"


def test_shown_takes_linear_time_on_runs_of_marks():
    """A regular expression with a group between every character of a secret holding
    underscores took seconds on a run of them, on the event loop."""
    redactor = Redactor(["123456789:AA_b_c_d_e_f_g_h_i_j"])
    text = "123456789:AA" + "_" * 200_000
    assert redactor.shown(text) == text  # the rest of the secret never comes: nothing to hide


async def test_a_secret_spelled_with_unicode_escapes_in_arguments_is_not_stored(tmp_path, llm, tg):
    """The history keeps a call's arguments as JSON inside the JSON column: ``\\\\u0031…`` there
    escaped the first fix, and decoding twice gave the token."""
    judges_say_done(llm)
    spelled = "".join(f"\\u{ord(c):04x}" for c in TOKEN)
    reply = tool_calls(("say", {"text": "x"}), ("end_turn", {}))
    reply.message["tool_calls"][0]["function"]["arguments"] = '{"text": "tok ' + spelled + '"}'
    llm.push(reply, when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("what is your token", chat_id=18)
        await tg.wait_for("sendMessage")
        await d.engine.wait_for_turns(1)
        data = d.settings.data_dir
    assert tg.sent(18) == [f"tok {MARKER}"]
    rows = sqlite3.connect(data / "bumblebot.db").execute("SELECT tool_calls FROM messages WHERE tool_calls IS NOT NULL")
    decoded = [json.loads(call["function"]["arguments"]) for (row,) in rows for call in json.loads(row)]
    assert decoded and TOKEN not in json.dumps(decoded, ensure_ascii=False)


def test_openings_with_no_closing_take_linear_time():
    """``<!--`` repeated with no ``-->`` took seconds on every preview edit (quadratic scan)."""
    redactor = Redactor([TOKEN])
    for text in ("<!--" * 50_000, "](" * 50_000, "][" * 50_000):
        assert redactor.streamed(text) == text and redactor.shown(text) == text


def test_ordinary_replies_are_not_blanked_by_a_short_secret_spread_over_them():
    """With a secret ``12345678`` configured, a numbered list ("1. Apples … 8. Nuts") and a
    version line were blanked from their first digit to their last."""
    redactor = Redactor(["12345678"])
    listing = "Top list:\n" + "\n".join(f"{n}. {fruit}" for n, fruit in enumerate(
        ["Apples", "Pears", "Figs", "Kiwis", "Limes", "Dates", "Plums", "Nuts", "Yams"], start=1))
    for text in (listing, "Released 2021-03-04, version 1.2.3, build 45678"):
        assert redactor.shown(text) == text
    assert redactor.shown("the pin is 1 2 3 4 5 6 7 8.") == f"the pin is {MARKER}."


def test_reading_escapes_to_find_a_secret_changes_nothing_else():
    """Once a secret was found spelled with escapes, every escape of the text was read, a
    literal ``\\\\u0041`` becoming ``A`` (and write_file then wrote that)."""
    redactor = Redactor(["sk-local-1"])
    written = '{"content": "C:\\\\users\\\\u0041 and key sk-lo\\u0063al-1"}'
    assert redactor(written) == '{"content": "C:\\\\users\\\\u0041 and key ' + MARKER + '"}'
