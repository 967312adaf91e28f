"""Streamed replies (bumblebot/delivery/preview.py): the text of a ``say`` reaches the chat while the model still
writes it, through the real openai client (SSE from the fake endpoint) and the real
python-telegram-bot / discord.py clients against the fakes."""

from __future__ import annotations

import asyncio
import json
import sqlite3

from conftest import running, write_config
from fakes.openai_server import FakeOpenAI, Reply, is_loop, text
from support import judges_say_done, say

LONG = (
    "Here is a longer answer that the model writes word by word, so that the chat can show "
    "it while it is still being generated. It ends with this sentence."
)


async def until_shown(tg, text: str, timeout: float = 10.0) -> None:
    """Wait until a message shows ``text``: sent whole, or a preview edited into it."""
    waits = [asyncio.ensure_future(tg.wait_for(method, predicate=lambda p: p.get("text") == text, timeout=timeout))
             for method in ("sendMessage", "editMessageText")]
    done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for w in pending:
        w.cancel()
    if not any(w.exception() is None for w in done):
        raise AssertionError(f"nothing showed {text!r} within {timeout} s")


def streaming_config(tmp_path, llm, tg, **sections):
    return write_config(tmp_path, llm, tg, delivery={"streaming": "on", "stream_edit_interval_s": 0.2}, **sections)


async def test_a_streamed_say_shows_text_before_the_stream_ends_and_ends_as_one_message(tmp_path, llm, tg):
    judges_say_done(llm)
    hold = asyncio.Event()
    reply = say(LONG)
    reply.stream_hold, reply.stream_hold_after, reply.stream_chars = hold, 12, 4
    llm.push(reply, when=is_loop)
    async with running(streaming_config(tmp_path, llm, tg)):
        tg.push_text("tell me something long", chat_id=1001)
        first = await tg.wait_for("sendMessage", predicate=lambda p: p.get("chat_id") == 1001)
        # the model is still inside its stream: the chat already shows the start of the text
        assert not hold.is_set()
        partial = first[0].params["text"]
        assert partial and LONG.startswith(partial) and partial != LONG
        assert first[0].params.get("reply_markup")  # the Stop button
        hold.set()
        await tg.wait_for("editMessageText", predicate=lambda p: p.get("text") == LONG and not p.get("reply_markup"))
    assert tg.shown(1001) == [LONG]  # one message, the whole text, no Stop button left
    assert len(tg.sent(1001)) == 1
    assert llm.streamed == 1 and not llm.violations


async def test_an_endpoint_that_rejects_stream_still_gets_answers(tmp_path, tg):
    async with FakeOpenAI(reject_stream=400) as llm:
        judges_say_done(llm)
        llm.push(say(LONG), when=is_loop)
        llm.push(say("and a second answer, whole"), when=is_loop)
        config = streaming_config(tmp_path, llm, tg)
        async with running(config):
            tg.push_text("first question here", chat_id=1002)
            await tg.wait_for("sendMessage", predicate=lambda p: p.get("text") == LONG)
            tg.push_text("second question here", chat_id=1002)
            await tg.wait_for("sendMessage", predicate=lambda p: p.get("text") == "and a second answer, whole")
        assert tg.shown(1002) == [LONG, "and a second answer, whole"]
        # refused once, then remembered: the second turn asks for whole answers at once
        streamed = [r for r in llm.requests if r.get("stream")]
        assert len(streamed) == 1
    db = sqlite3.connect(tmp_path / "data" / "bumblebot.db")
    (value,) = db.execute("SELECT value FROM kv WHERE key LIKE 'llm.stream:%'").fetchone()
    assert "refused" in value


async def test_a_crash_mid_stream_leaves_one_message_and_no_duplicate_after_the_restart(tmp_path, llm, tg):
    from support import kill_daemon, start_daemon, stop_daemon

    judges_say_done(llm)
    hold = asyncio.Event()
    first = say(LONG)
    first.stream_hold, first.stream_hold_after, first.stream_chars, first.stream_delay = hold, 30, 3, 0.03
    llm.push(first, when=is_loop)
    config = streaming_config(tmp_path, llm, tg)
    proc = await start_daemon(config, tmp_path)
    try:
        tg.push_text("tell me something long", chat_id=31)
        # an edit of the preview: the daemon knows (and recorded) which message shows it
        await tg.wait_for("editMessageText", predicate=lambda p: p.get("chat_id") == 31, timeout=20)
        await kill_daemon(proc)  # dies mid-stream, with a partial preview on screen
    finally:
        if proc.returncode is None:
            proc.kill()
    hold.set()
    assert len(tg.shown(31)) == 1 and tg.shown(31)[0] != LONG
    again = "After the restart the whole answer is written again, into the same message."
    llm.push(say(again), when=is_loop)
    proc = await start_daemon(config, tmp_path)
    await tg.wait_for("editMessageText", predicate=lambda p: p.get("text") == again, timeout=20)
    assert await stop_daemon(proc) == 0
    assert tg.shown(31) == [again]  # the resumed turn took the preview over: one message
    assert len(tg.sent(31)) == 1
    db = sqlite3.connect(tmp_path / "data" / "bumblebot.db")
    rows = db.execute("SELECT status, streaming, text FROM outbox").fetchall()
    assert rows == [("sent", 0, again)]


async def test_stop_aborts_the_running_model_call_and_history_records_it(tmp_path, llm, tg):
    judges_say_done(llm)
    hold = asyncio.Event()
    reply = say(LONG)
    reply.stream_hold, reply.stream_hold_after, reply.stream_chars = hold, 12, 4
    llm.push(reply, when=is_loop)
    async with running(streaming_config(tmp_path, llm, tg)) as daemon:
        tg.push_text("tell me something long", chat_id=41)
        preview = (await tg.wait_for("sendMessage", predicate=lambda p: p.get("chat_id") == 41))[0]
        tg.push_text("/stop", chat_id=41)
        await tg.wait_for("sendMessage", predicate=lambda p: p.get("text") == "Stopped.")
        progress = daemon.engine.progress
        await progress.wait_until(lambda: progress.turns_finished >= 1, timeout=5)
        assert not hold.is_set()  # the turn ended while the model was still "writing": aborted
        shown = tg.shown(41)
        partial = preview.params["text"]
        assert shown[0].startswith(partial[:8]) and shown[0] != LONG and shown[1:] == ["Stopped."]
        message = tg.messages[(41, min(k[1] for k in tg.messages if k[0] == 41 and tg.messages[k]["from"]["is_bot"]))]
        assert "reply_markup" not in message  # the Stop button went with the stop
        llm.push(say("fine, something else then"), when=is_loop)
        tg.push_text("ok, another question", chat_id=41)
        await tg.wait_for("sendMessage", predicate=lambda p: p.get("text") == "fine, something else then")
    hold.set()
    db = sqlite3.connect(tmp_path / "data" / "bumblebot.db")
    (stop_reason,) = db.execute("SELECT json_extract(trace, '$.stop_reason') FROM turns ORDER BY id").fetchone()
    assert stop_reason == "stopped"
    history = [r[0] for r in db.execute("SELECT content FROM messages WHERE role='assistant' ORDER BY id")]
    assert any("stopped this turn" in h for h in history)
    last = [r for r in llm.requests if is_loop(r)][-1]
    assert "stopped this turn" in str(last["messages"])  # the next turn knows


async def test_discord_streams_by_editing_one_message(tmp_path, llm):
    from fakes.discord_server import FakeDiscord

    judges_say_done(llm)
    hold = asyncio.Event()
    reply = say(LONG)
    reply.stream_hold, reply.stream_hold_after, reply.stream_chars = hold, 12, 4
    llm.push(reply, when=is_loop)
    async with FakeDiscord() as dc:
        section = {"enabled": True, "api_base_url": dc.api_base, "gateway_url": dc.gateway_url}
        config = write_config(tmp_path, llm, None, discord=section, delivery={"streaming": "on", "stream_edit_interval_s": 0.2})
        async with running(config, telegram_token=None, discord_token=dc.token):
            await dc.send_dm("tell me something long")
            dm = dc.dm_channel_id()
            [created] = await dc.wait_for_call("POST", f"/channels/{dm}/messages", status=200)
            assert not hold.is_set()
            partial = created.json["content"]
            assert LONG.startswith(partial) and partial != LONG
            hold.set()
            await dc.wait_until(
                lambda: [m["content"] for m in dc.created_messages(dm)] == [LONG], 5, "the preview edited into the whole text"
            )
        assert [m["content"] for m in dc.created_messages(dm)] == [LONG]  # one message, the whole text
        assert len(dc.matching_calls("POST", f"/channels/{dm}/messages")) == 1
        assert dc.server_errors == []


async def test_the_stop_button_stops_the_turn(tmp_path, llm, tg):
    judges_say_done(llm)
    hold = asyncio.Event()
    reply = say(LONG)
    reply.stream_hold, reply.stream_hold_after, reply.stream_chars = hold, 12, 4
    llm.push(reply, when=is_loop)
    async with running(streaming_config(tmp_path, llm, tg)) as daemon:
        tg.push_text("tell me something long", chat_id=42)
        await tg.wait_for("sendMessage", predicate=lambda p: p.get("chat_id") == 42)
        [(key, message)] = [(k, m) for k, m in tg.messages.items() if k[0] == 42 and m["from"]["is_bot"]]
        assert message["reply_markup"]["inline_keyboard"][0][0]["text"] == "Stop"
        data = message["reply_markup"]["inline_keyboard"][0][0]["callback_data"]
        tg.push_callback_query(42, key[1], data)
        await tg.wait_for("answerCallbackQuery")
        progress = daemon.engine.progress
        await progress.wait_until(lambda: progress.turns_finished >= 1, timeout=5)
        assert not hold.is_set()
    hold.set()
    assert tg.callback_answers[0].get("text") == "Stopped."
    assert len(tg.shown(42)) == 1 and tg.shown(42)[0] != LONG  # what was shown stays, nothing more
    assert "reply_markup" not in tg.messages[key]


async def test_a_streamed_say_over_the_limit_ends_split_as_usual(tmp_path, llm, tg):
    judges_say_done(llm)
    words = " ".join(f"word{i}" for i in range(1400))  # ~11,000 characters: three messages
    reply = say(words)
    reply.stream_chars = 400
    llm.push(reply, when=is_loop)
    config = streaming_config(tmp_path, llm, tg, cognition={"classifier": False, "reflex_max_tokens": 4096, "deliberate_max_tokens": 4096})
    async with running(config):
        tg.push_text("tell me something long", chat_id=43)
        await tg.wait_for("sendMessage", n=3, predicate=lambda p: p.get("chat_id") == 43, timeout=10)
    from adapters.telegram.render import render_chunks

    # the whole text once, split where a whole message would have been split
    assert tg.shown(43) == [chunk.text for chunk in render_chunks(words)]
    assert len(tg.shown(43)) == 3


async def test_a_streamed_say_that_repeats_what_was_said_is_never_shown(tmp_path, llm, tg):
    """A say the turn will not deliver (it repeats exactly what the turn already said) must not
    flash up while it streams: its text is held while it is the beginning of a message
    already delivered, and once complete it is known to be a repeat."""
    judges_say_done(llm)
    llm.push(say(LONG, end=False), when=is_loop)
    again = say(LONG + " ")
    again.stream_delay, again.stream_chars = 0.02, 6
    llm.push(again, when=is_loop)
    async with running(streaming_config(tmp_path, llm, tg)) as daemon:
        tg.push_text("explain the python code in detail", chat_id=44)  # deliberate: two steps
        progress = daemon.engine.progress
        await progress.wait_until(lambda: progress.turns_finished >= 1, timeout=10)
        trace = (await daemon.store.recent_turns())[0]["trace"]
    assert tg.shown(44) == [LONG]
    assert len([c for c in tg.calls if c.method == "sendMessage"]) == 1  # no second preview was opened
    assert not any(c.method == "deleteMessage" for c in tg.calls)
    assert [c["rule"] for c in trace["cuts"]] == ["exact_repeat"]


async def test_typing_shows_until_the_first_words(tmp_path, llm, tg):
    judges_say_done(llm)
    reply = say(LONG)
    reply.stream_chars, reply.stream_delay = 3, 0.03  # about 1.5 s of writing
    llm.push(reply, when=is_loop)
    config = streaming_config(tmp_path, llm, tg, engine={"shutdown_grace_s": 5, "typing_interval_s": 0.2})
    async with running(config):
        tg.push_text("tell me something long", chat_id=45)
        first = (await tg.wait_for("sendMessage", predicate=lambda p: p.get("chat_id") == 45))[0]
        # two edits, 0.2 s apart at least: typing would have been refreshed meanwhile
        await tg.wait_for("editMessageText", n=2, predicate=lambda p: p.get("chat_id") == 45)
        await tg.wait_for("editMessageText", predicate=lambda p: p.get("text") == LONG)
    typing = [c for c in tg.calls if c.method == "sendChatAction"]
    assert typing and typing[0].time < first.time  # it showed while the model was thinking
    assert [c for c in typing if c.time > first.time] == []


async def test_the_discord_stop_button_stops_the_turn(tmp_path, llm):
    from fakes.discord_server import FakeDiscord

    judges_say_done(llm)
    hold = asyncio.Event()
    reply = say(LONG)
    reply.stream_hold, reply.stream_hold_after, reply.stream_chars = hold, 12, 4
    llm.push(reply, when=is_loop)
    async with FakeDiscord() as dc:
        section = {"enabled": True, "api_base_url": dc.api_base, "gateway_url": dc.gateway_url}
        config = write_config(tmp_path, llm, None, discord=section, delivery={"streaming": "on", "stream_edit_interval_s": 0.2})
        async with running(config, telegram_token=None, discord_token=dc.token) as daemon:
            await dc.send_dm("tell me something long")
            dm = dc.dm_channel_id()
            await dc.wait_for_call("POST", f"/channels/{dm}/messages", status=200)
            [preview] = dc.created_messages(dm)
            [button] = preview["components"][0]["components"]
            assert button["label"] == "Stop"
            await dc.press_button(preview["id"], button["custom_id"])
            progress = daemon.engine.progress
            await progress.wait_until(lambda: progress.turns_finished >= 1, timeout=5)
            assert not hold.is_set()
            await dc.wait_until(lambda: not dc.message(preview["id"])["components"], 5, "the Stop button removed")
        hold.set()
        [answer] = dc.interaction_responses
        assert answer["data"]["content"] == "Stopped." and answer["data"]["flags"] & 64  # only to the presser
        [shown] = dc.created_messages(dm)
        assert shown["content"] != LONG and LONG.startswith(shown["content"][:20])
        assert dc.server_errors == []


async def test_a_stream_that_breaks_off_is_retried_into_the_same_message(tmp_path, llm, tg):
    from bumblebot.runtime.outage import OUTAGE_NOTICE

    judges_say_done(llm)
    broken = say(LONG)
    broken.stream_chars, broken.stream_delay, broken.stream_cut_after = 3, 0.03, 30
    llm.push(broken, when=is_loop)
    again = "The endpoint is back and this is the whole answer, in the message that showed the first try."
    llm.push(say(again), when=is_loop)
    async with running(streaming_config(tmp_path, llm, tg)):
        tg.push_text("tell me something long", chat_id=47)
        await tg.wait_for("editMessageText", predicate=lambda p: p.get("text") == again, timeout=10)
    assert tg.shown(47) == [again, OUTAGE_NOTICE]  # the answer took the first preview over
    assert [t for t in tg.sent(47) if t != OUTAGE_NOTICE][0] != again  # it was a preview, edited


async def test_a_429_on_an_edit_pauses_the_preview_and_the_final_text_still_arrives(tmp_path, llm, tg):
    from fakes.telegram_server import retry_after_body

    judges_say_done(llm)
    reply = say(LONG)
    reply.stream_chars, reply.stream_delay = 3, 0.02
    llm.push(reply, when=is_loop)
    tg.fail_next("editMessageText", 429, retry_after_body(1))
    async with running(streaming_config(tmp_path, llm, tg)):
        tg.push_text("tell me something long", chat_id=48)
        await tg.wait_for("editMessageText", predicate=lambda p: p.get("text") == LONG, timeout=10)
    edits = [c for c in tg.calls if c.method == "editMessageText"]
    # nothing was edited within the second Telegram asked for after the refused edit
    assert all(e.time >= edits[0].time + 0.95 for e in edits[1:])
    assert tg.shown(48) == [LONG]


async def test_no_model_slot_is_held_while_a_delivery_waits_on_the_platform(tmp_path, llm, tg):
    from fakes.telegram_server import retry_after_body

    judges_say_done(llm)
    llm.push(say("the answer for chat A, delivered late"), when=lambda r: is_loop(r) and "chat A" in str(r["messages"]))
    llm.push(say("the answer for chat B"), when=lambda r: is_loop(r) and "chat B" in str(r["messages"]))
    tg.fail_next("sendMessage", 429, retry_after_body(2))  # A's delivery waits 2 s inline
    config = write_config(tmp_path, llm, tg, llm={"base_url": llm.base_url, "model": "test-model", "max_retries": 0,
                                                  "timeout_s": 10, "max_concurrent_requests": 1})
    async with running(config):
        tg.push_text("question from chat A", chat_id=51)
        await tg.wait_for("sendMessage", predicate=lambda p: p.get("chat_id") == 51)  # refused: waiting
        tg.push_text("question from chat B", chat_id=52)
        await tg.wait_for("sendMessage", predicate=lambda p: p.get("chat_id") == 52)
        b_sent = [c for c in tg.calls if c.method == "sendMessage" and c.params.get("chat_id") == 52][0].time
        await tg.wait_for("sendMessage", n=2, predicate=lambda p: p.get("chat_id") == 51, timeout=5)
    a_retry = [c for c in tg.calls if c.method == "sendMessage" and c.params.get("chat_id") == 51][1].time
    assert b_sent < a_retry  # B's turn got the one model slot while A's reply waited on Telegram


async def test_two_says_cut_off_by_a_crash_are_taken_over_by_two_streams(tmp_path, llm, tg):
    """Two streamed says of one completion, both on screen when the process died: the resumed
    turn's two says finish the two messages, one each, and nothing more is sent."""
    from support import kill_daemon, start_daemon, stop_daemon

    judges_say_done(llm)
    hold = asyncio.Event()
    second = LONG.replace("longer", "second")
    first = say(LONG, second)
    first.stream_hold, first.stream_chars, first.stream_delay = hold, 4, 0.01
    first.stream_hold_after = 2 + len(json.dumps({"text": LONG})) // 4 + 12  # into the second say
    llm.push(first, when=is_loop)
    config = streaming_config(tmp_path, llm, tg)
    proc = await start_daemon(config, tmp_path)
    try:
        tg.push_text("tell me two things", chat_id=53)
        await tg.wait_for("sendMessage", n=2, predicate=lambda p: p.get("chat_id") == 53, timeout=20)
        latest = max(mid for chat, mid in tg.messages if chat == 53)
        # an edit of the second preview: the daemon recorded which message shows it
        await tg.wait_for("editMessageText", predicate=lambda p: p.get("message_id") == latest, timeout=20)
        await kill_daemon(proc)
    finally:
        if proc.returncode is None:
            proc.kill()
    hold.set()
    one, two = "The first answer, written again after the restart.", "The second answer, also written again."
    llm.push(say(one, two), when=is_loop)
    proc = await start_daemon(config, tmp_path)
    await tg.wait_for("editMessageText", predicate=lambda p: p.get("text") == two, timeout=20)
    assert await stop_daemon(proc) == 0
    assert sorted(tg.shown(53)) == sorted([one, two])
    assert len(tg.sent(53)) == 2


# -- regressions, each with its failing input ---------------------------------------------


async def test_an_error_event_mid_stream_is_an_outage_not_a_refusal(tmp_path, llm, tg):
    """OpenRouter sends ``data: {"error": …}`` when a provider fails mid-stream: the turn waits
    it out like a 502 and answers, into the message that showed the first try."""
    from bumblebot.runtime.outage import OUTAGE_NOTICE

    judges_say_done(llm)
    failing = say(LONG)
    failing.stream_chars, failing.stream_delay, failing.stream_error_after = 3, 0.03, 30
    llm.push(failing, when=is_loop)
    again = "The provider is back and this is the whole answer, written into the first message."
    llm.push(say(again), when=is_loop)
    async with running(streaming_config(tmp_path, llm, tg)):
        tg.push_text("tell me something long", chat_id=61)
        await tg.wait_for("editMessageText", predicate=lambda p: p.get("text") == again, timeout=10)
    assert tg.shown(61) == [again, OUTAGE_NOTICE]
    assert not any("refused" in t for t in tg.sent(61))


async def test_a_truncated_stream_or_a_reply_cut_at_the_budget_keeps_streaming_on(tmp_path, llm, tg):
    judges_say_done(llm)
    truncated = say(LONG)
    truncated.stream_truncated = True
    llm.push(truncated, when=is_loop)
    llm.push(say("a whole answer after a cut-off one"), when=is_loop)
    cut = Reply(message={"role": "assistant", "content": None, "tool_calls": [
        {"id": "cut1", "type": "function", "function": {"name": "say", "arguments": '{"text": "Here is a longer ans'}}]},
        finish_reason="length")
    llm.push(cut, when=is_loop)  # the reflex budget ran out: asked again with the deliberate one
    llm.push(say("the long answer, with the bigger budget"), when=is_loop)
    async with running(streaming_config(tmp_path, llm, tg)) as daemon:
        tg.push_text("tell me something long", chat_id=62)
        await until_shown(tg, "a whole answer after a cut-off one")
        tg.push_text("and another long thing", chat_id=62)
        await until_shown(tg, "the long answer, with the bigger budget")
        assert await daemon.store.get_kv(f"llm.stream:{llm.base_url}") is None
    loops = [r for r in llm.requests if is_loop(r)]
    assert all(r.get("stream") for r in loops) and len(loops) == 4  # no whole re-check was paid for


async def test_a_short_reply_after_a_restart_takes_the_half_written_preview_over(tmp_path, llm, tg):
    from support import kill_daemon, start_daemon, stop_daemon

    judges_say_done(llm)
    hold = asyncio.Event()
    first = say(LONG)
    first.stream_hold, first.stream_hold_after, first.stream_chars, first.stream_delay = hold, 30, 3, 0.03
    llm.push(first, when=is_loop)
    config = streaming_config(tmp_path, llm, tg)
    proc = await start_daemon(config, tmp_path)
    try:
        tg.push_text("tell me something long", chat_id=63)
        await tg.wait_for("editMessageText", predicate=lambda p: p.get("chat_id") == 63, timeout=20)
        await kill_daemon(proc)
    finally:
        if proc.returncode is None:
            proc.kill()
    hold.set()
    llm.push(say("Done."), when=is_loop)  # too short to get a preview of its own
    # the restart streams no more: the half-written preview is still finished, not left behind
    config = write_config(tmp_path, llm, tg, delivery={"streaming": "off"})
    proc = await start_daemon(config, tmp_path)
    await tg.wait_for("editMessageText", predicate=lambda p: p.get("text") == "Done.", timeout=20)
    assert await stop_daemon(proc) == 0
    assert tg.shown(63) == ["Done."]
    assert all("reply_markup" not in m for k, m in tg.messages.items() if k[0] == 63)
    db = sqlite3.connect(tmp_path / "data" / "bumblebot.db")
    assert db.execute("SELECT count(*) FROM outbox WHERE streaming=1").fetchone() == (0,)


async def test_stop_while_waiting_out_an_outage_keeps_the_half_written_preview(tmp_path, llm, tg):
    from bumblebot.runtime.outage import OUTAGE_NOTICE

    judges_say_done(llm)
    broken = say(LONG)
    broken.stream_chars, broken.stream_delay, broken.stream_cut_after = 3, 0.03, 30
    llm.push(broken, when=is_loop)
    from fakes.openai_server import error

    llm.default = lambda r: error(503, "still down") if is_loop(r) else text("DONE: fine")
    async with running(streaming_config(tmp_path, llm, tg)) as daemon:
        tg.push_text("tell me something long", chat_id=64)
        await tg.wait_for("sendMessage", predicate=lambda p: p.get("text") == OUTAGE_NOTICE, timeout=10)
        tg.push_text("/stop", chat_id=64)
        await tg.wait_for("sendMessage", predicate=lambda p: p.get("text") == "Stopped.")
        progress = daemon.engine.progress
        await progress.wait_until(lambda: progress.turns_finished >= 1, timeout=10)
    preview = tg.shown(64)[0]
    assert preview not in (LONG, OUTAGE_NOTICE) and LONG.startswith(preview[:20])
    assert all("reply_markup" not in m for k, m in tg.messages.items() if k[0] == 64)
    db = sqlite3.connect(tmp_path / "data" / "bumblebot.db")
    assert db.execute("SELECT count(*) FROM outbox WHERE streaming=1").fetchone() == (0,)
    history = [r[0] for r in db.execute("SELECT content FROM messages WHERE role='assistant' ORDER BY id")]
    assert preview in history  # what the user saw is what the entity remembers


async def test_a_short_say_before_a_long_one_keeps_its_place(tmp_path, llm, tg):
    judges_say_done(llm)
    reply = say("Sure!", LONG)
    reply.stream_chars, reply.stream_delay = 4, 0.01
    llm.push(reply, when=is_loop)
    async with running(streaming_config(tmp_path, llm, tg)):
        tg.push_text("explain the python code in detail", chat_id=65)
        await tg.wait_for("editMessageText", predicate=lambda p: p.get("text") == LONG, timeout=10)
    assert tg.shown(65) == ["Sure!", LONG]


async def test_reasoning_inside_a_say_never_shows_while_it_streams(tmp_path, llm, tg):
    judges_say_done(llm)
    reply = say("Sure thing, here you go! <think>the user seems annoyed, keep the plan secret</think> It is done.")
    reply.stream_chars, reply.stream_delay = 3, 0.02
    llm.push(reply, when=is_loop)
    async with running(streaming_config(tmp_path, llm, tg)):
        tg.push_text("tell me something long", chat_id=66)
        await tg.wait_for("editMessageText", predicate=lambda p: "It is done." in p.get("text", ""), timeout=10)
    shown = [c.params.get("text", "") for c in tg.calls if c.method in ("sendMessage", "editMessageText")]
    assert shown and not any("annoyed" in t or "<thi" in t or "secret" in t for t in shown)


async def test_says_over_the_message_cap_are_never_shown(tmp_path, llm, tg):
    judges_say_done(llm)
    texts = [f"Message number {i} of a model that talks far too much." for i in range(5)]
    reply = say(*texts)
    reply.stream_chars, reply.stream_delay = 6, 0.005
    llm.push(reply, when=is_loop)
    config = streaming_config(tmp_path, llm, tg, cognition={"classifier": False, "max_messages_per_turn": 2})
    async with running(config) as daemon:
        tg.push_text("explain the python code in detail", chat_id=67)
        progress = daemon.engine.progress
        await progress.wait_until(lambda: progress.turns_finished >= 1, timeout=10)
    assert tg.shown(67) == texts[:2]
    assert len(tg.sent(67)) == 2 and not any(c.method == "deleteMessage" for c in tg.calls)


async def test_stop_while_the_turn_is_being_routed_stops_it(tmp_path, llm, tg):
    from support import UNCLEAR, Gate

    judges_say_done(llm)
    classifier = Gate(text("CHAT"))
    llm.push(classifier, when=lambda r: not is_loop(r) and "You route chat messages" in str(r["messages"]))
    config = streaming_config(tmp_path, llm, tg, cognition={"classifier": True})
    async with running(config) as daemon:
        tg.push_text(UNCLEAR, chat_id=68)
        await asyncio.wait_for(classifier.entered.wait(), 5)
        tg.push_text("/stop", chat_id=68)
        await tg.wait_for("sendMessage", predicate=lambda p: p.get("chat_id") == 68)
        classifier.release.set()
        progress = daemon.engine.progress
        await progress.wait_until(lambda: progress.turns_finished >= 1, timeout=10)
    assert tg.sent(68) == ["Stopped."]
    assert not [r for r in llm.requests if is_loop(r)]  # the turn never asked the model
    db = sqlite3.connect(tmp_path / "data" / "bumblebot.db")
    assert db.execute("SELECT json_extract(trace, '$.stop_reason') FROM turns").fetchall() == [("stopped",)]


async def test_a_work_promise_on_a_reflex_turn_is_judged(tmp_path, llm, tg):
    from support import is_adequacy_judge

    llm.push(say("Sure! I'll dig through your notes and get back to you with the password."), when=is_loop)
    llm.push(text("CONTINUE: it only promised to look"), when=is_adequacy_judge)
    llm.push(say("I can't see any notes of yours here, so I don't know the wifi password."), when=is_loop)
    llm.push(text("DONE: honest"), when=is_adequacy_judge)
    async with running(write_config(tmp_path, llm, tg)):
        tg.push_text("please go through my notes and find the wifi password", chat_id=69)
        await tg.wait_for("sendMessage", n=2, predicate=lambda p: p.get("chat_id") == 69)
    assert llm.pending == 0  # the promise went to the judge, which sent the turn back to work


async def test_a_short_say_after_an_outage_edits_the_half_written_preview(tmp_path, llm, tg):
    """A retried say too short for a preview of its own finishes the half-written preview (it once
    sent a new message and deleted the old preview)."""
    from bumblebot.runtime.outage import OUTAGE_NOTICE

    judges_say_done(llm)
    broken = say(LONG)
    broken.stream_chars, broken.stream_delay, broken.stream_cut_after = 3, 0.03, 30
    llm.push(broken, when=is_loop)
    llm.push(say("Done."), when=is_loop)
    async with running(streaming_config(tmp_path, llm, tg)):
        tg.push_text("tell me something long", chat_id=70)
        await tg.wait_for("editMessageText", predicate=lambda p: p.get("text") == "Done.", timeout=10)
    assert tg.shown(70) == ["Done.", OUTAGE_NOTICE]
    assert not any(c.method == "deleteMessage" for c in tg.calls)


async def test_a_streamed_say_that_renders_to_nothing_leaves_no_preview_behind(tmp_path, llm, tg):
    """A say that is only an HTML comment renders to nothing and is not delivered; its preview,
    which showed the raw text as it streamed, stayed on screen for good."""
    from fakes.openai_server import tool_calls

    judges_say_done(llm)
    comment = tool_calls(("say", {"text": "<!-- a note to myself about the user -->"}))
    comment.stream_chars, comment.stream_delay = 4, 0.03
    llm.push(comment, when=is_loop)
    llm.push(say("Hello!"), when=is_loop)
    async with running(streaming_config(tmp_path, llm, tg)) as d:
        tg.push_text("hi", chat_id=606)
        await d.engine.wait_for_turns(1)
    assert tg.shown(606) == ["Hello!"]
