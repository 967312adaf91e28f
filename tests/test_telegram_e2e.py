"""End to end on Telegram: real python-telegram-bot and openai clients against the fakes."""

from __future__ import annotations

import asyncio
import logging
import sqlite3

from conftest import TOKEN, running, write_config
from fakes.openai_server import FakeOpenAI, is_aux, is_loop, text
from support import Gate, contents, handled, judges_say_done, loop_requests, say

from bumblebot.llm import ForcingFallback
from bumblebot.runtime.engine import MAX_REFUSALS


async def test_say_then_end_turn_reaches_send_message_with_typing(tmp_path, llm, tg):
    llm.push(say("hey you"), when=is_loop)
    llm.push(text("DONE: a greeting"), when=is_aux)  # the completion check
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("hi", chat_id=1001)
        await tg.wait_for("sendMessage", predicate=lambda p: p.get("text") == "hey you")
        await d.engine.wait_for_turns(1)
    assert len(llm.requests) == 2
    assert tg.sent(1001) == ["hey you"]
    assert [c for c in tg.calls if c.method == "sendChatAction" and c.params.get("action") == "typing"]
    first = loop_requests(llm)[0]
    assert first["tool_choice"] == "required"
    assert first["messages"][-1]["content"].endswith("\nhi")
    assert "[Turn context]" in first["messages"][-1]["content"]
    assert not llm.violations and not llm.unscripted


async def test_history_survives_a_restart(tmp_path, llm, tg):
    judges_say_done(llm)
    config = write_config(tmp_path, llm, tg)
    llm.push(say("nice to meet you, Ada"), when=is_loop)
    async with running(config) as d:
        tg.push_text("my name is Ada", chat_id=7)
        await tg.wait_for("sendMessage")
        await d.engine.wait_for_turns(1)  # finished before the stop
    llm.push(say("you are Ada"), when=is_loop)
    async with running(config):
        tg.push_text("what's my name?", chat_id=7)
        await tg.wait_for("sendMessage", n=2)
    first_turn, second_turn = loop_requests(llm)
    seen = contents(second_turn)
    assert "my name is Ada" in seen and "nice to meet you, Ada" in seen
    # the earlier message goes as it was first sent, with its [Turn context], read back after
    # the restart (the request repeats the previous one as a prefix); history stores what the
    # user wrote
    assert second_turn["messages"][: len(first_turn["messages"])] == first_turn["messages"]
    user_messages = [m["content"] for m in second_turn["messages"] if m["role"] == "user"]
    assert [c.startswith("[Turn context]") for c in user_messages] == [True, True]
    rows = sqlite3.connect(tmp_path / "data" / "bumblebot.db").execute("SELECT content FROM messages WHERE role='user'")
    assert [r[0] for r in rows] == ["my name is Ada", "what's my name?"]


async def test_two_chats_run_concurrently_without_sharing_history(tmp_path, llm, tg):
    judges_say_done(llm)
    gate_a = Gate(say("answer for A"))
    gate_b = Gate(say("answer for B"))
    llm.push(gate_a, when=lambda r: is_loop(r) and "secret-a" in contents(r))
    llm.push(gate_b, when=lambda r: is_loop(r) and "secret-b" in contents(r))
    async with running(write_config(tmp_path, llm, tg)):
        tg.push_text("secret-a", chat_id=1)
        tg.push_text("secret-b", chat_id=2)
        # both turns are inside their model call at the same time: they overlap
        await asyncio.wait_for(asyncio.gather(gate_a.entered.wait(), gate_b.entered.wait()), 5)
        gate_a.release.set()
        gate_b.release.set()
        await tg.wait_for("sendMessage", n=2)
    assert tg.sent(1) == ["answer for A"] and tg.sent(2) == ["answer for B"]
    for r in loop_requests(llm):
        seen = contents(r)
        assert not ("secret-a" in seen and "secret-b" in seen)


async def test_message_during_a_turn_is_answered_next_turn_in_queue_mode(tmp_path, llm, tg):
    judges_say_done(llm)
    first = Gate(say("first answer"))
    llm.push(first, when=lambda r: is_loop(r) and "one" in contents(r))
    llm.push(say("second answer"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg, cognition={"mid_turn_messages": "queue", "classifier": False})) as d:
        tg.push_text("one", chat_id=5)
        await asyncio.wait_for(first.entered.wait(), 5)
        tg.push_text("two", chat_id=5)
        tg.push_text("three", chat_id=5)
        await tg.wait_for("getUpdates", predicate=lambda p: int(p.get("offset", 0)) >= tg.next_update_id)
        first.release.set()
        await tg.wait_for("sendMessage", n=2)
        await d.engine.wait_for_turns(2)
        turns = await d.store.recent_turns()
    assert tg.sent(5) == ["first answer", "second answer"]
    second = loop_requests(llm)[1]
    last_user = [m for m in second["messages"] if m["role"] == "user"][-1]["content"]
    assert "two" in last_user and "three" in last_user  # merged into one turn
    assert len(turns) == 2


async def test_same_update_delivered_twice_makes_one_turn(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(say("once"), when=is_loop)
    update = {
        "update_id": 500,
        "message": {
            "message_id": 42, "date": 1700000000, "text": "hello",
            "chat": {"id": 9, "type": "private"},
            "from": {"id": 9, "is_bot": False, "first_name": "Bo"},
        },
    }
    tg.push_update(update)
    tg.push_update(dict(update, update_id=501))  # Telegram re-delivers the same message
    async with running(write_config(tmp_path, llm, tg)) as d:
        await tg.wait_for("sendMessage")
        await tg.wait_for("getUpdates", predicate=lambda p: int(p.get("offset", 0)) >= 502)
        await d.engine.wait_for_turns(1)
        turns = await d.store.recent_turns()
    assert tg.sent(9) == ["once"]
    assert len(turns) == 1
    assert len(loop_requests(llm)) == 1


async def test_endpoint_rejecting_required_tool_choice_falls_back_to_auto(tmp_path, tg):
    async with FakeOpenAI(reject_tool_choice_required=400) as llm:
        judges_say_done(llm)
        llm.push(text("plain hello"), when=is_loop)  # the model answers in plain text
        llm.push(text("plain again"), when=is_loop)
        async with running(write_config(tmp_path, llm, tg)) as d:
            tg.push_text("hi", chat_id=3)
            await tg.wait_for("sendMessage")
            tg.push_text("hi again", chat_id=3)
            await tg.wait_for("sendMessage", n=2)
            remembered = await d.store.get_kv(f"llm.tool_choice:{llm.base_url}")
        assert tg.sent(3) == ["plain hello", "plain again"]
        assert len(llm.rejected) == 1  # remembered: the second turn went straight to "auto"
        assert ForcingFallback.parse(remembered) is not None  # remembered, with why and since when
        assert [r["tool_choice"] for r in loop_requests(llm) if r not in llm.rejected] == ["auto", "auto"]


async def test_start_answers_without_a_model_call_and_reset_starts_fresh(tmp_path, llm, tg):
    judges_say_done(llm)
    async with running(write_config(tmp_path, llm, tg)):
        tg.push_text("/start", chat_id=11)
        await tg.wait_for("sendMessage")
        assert llm.requests == []
        assert "Bumble" in tg.sent(11)[0]
        llm.push(say("noted"), when=is_loop)
        tg.push_text("remember the word pineapple", chat_id=11)
        await tg.wait_for("sendMessage", n=2)
        tg.push_text("/reset", chat_id=11)
        await tg.wait_for("sendMessage", n=3)
        llm.push(say("fresh"), when=is_loop)
        tg.push_text("what word?", chat_id=11)
        await tg.wait_for("sendMessage", n=4)
    after_reset = [r for r in loop_requests(llm) if "what word?" in contents(r)][0]
    assert "pineapple" not in contents(after_reset)
    rows = sqlite3.connect(tmp_path / "data" / "bumblebot.db").execute(
        "SELECT COUNT(*) FROM messages WHERE content LIKE '%pineapple%'"
    ).fetchone()
    assert rows[0] == 1  # old rows stay in the database


async def test_user_outside_allowlist_gets_one_refusal(tmp_path, llm, tg):
    config = write_config(tmp_path, llm, tg, telegram={"allowed_user_ids": [1], "poll_timeout_s": 1})
    async with running(config) as d:
        tg.push_text("hello?", chat_id=66)
        tg.push_text("anyone?", chat_id=66)
        await tg.wait_for("getUpdates", predicate=lambda p: int(p.get("offset", 0)) >= tg.next_update_id)
        await tg.wait_for("sendMessage")
        pending = await d.store.pending_inbound()
    assert tg.sent(66) == ["Sorry, this bot is private."]
    assert llm.requests == [] and pending == []


async def test_refusals_to_strangers_are_rate_limited_overall(tmp_path, llm, tg):
    """30 strangers writing at once got 30 refusals: each is refused once, but the bot as a whole
    sends at most MAX_REFUSALS a minute; the others are journaled and not answered."""
    config = write_config(tmp_path, llm, tg, telegram={"allowed_user_ids": [1], "poll_timeout_s": 1})
    async with running(config) as d:
        for stranger in range(1000, 1030):
            tg.push_text("let me in", chat_id=stranger)
        await tg.wait_for("getUpdates", predicate=lambda p: int(p.get("offset", 0)) >= tg.next_update_id)
        await tg.wait_for("sendMessage", n=MAX_REFUSALS)
        pending = await d.store.pending_inbound()
    data = sqlite3.connect(tmp_path / "data" / "bumblebot.db")
    assert data.execute("SELECT COUNT(*) FROM outbox").fetchone()[0] == MAX_REFUSALS
    assert data.execute("SELECT COUNT(*) FROM journal WHERE status = 'refused' OR status = 'ignored'").fetchone()[0] == 30
    assert len([c for c in tg.calls if c.method == "sendMessage"]) == MAX_REFUSALS
    assert llm.requests == [] and pending == []


async def test_long_reply_is_split_at_line_boundaries_without_loss(tmp_path, llm, tg):
    judges_say_done(llm)
    lines = [f"line {i:04d} " + "x" * 80 for i in range(100)]  # ~9,000 characters
    long_text = "\n".join(lines)
    llm.push(say(long_text), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)):
        tg.push_text("write a lot", chat_id=4)
        await tg.wait_for("sendMessage", n=3)
    chunks = tg.sent(4)
    assert all(len(c) <= 4096 for c in chunks)
    assert "\n".join(chunks) == long_text
    assert all(c.startswith("line ") for c in chunks)  # cut at line boundaries


async def test_delivery_retries_after_rate_limit(tmp_path, llm, tg):
    from fakes.telegram_server import retry_after_body

    judges_say_done(llm)
    llm.push(say("after the pause"), when=is_loop)
    tg.fail_next("sendMessage", 429, retry_after_body(0))
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("hi", chat_id=8)
        await tg.wait_for("sendMessage", n=2)
        await d.engine.wait_for_turns(1)
        rows = await d.store._all("SELECT status, attempts FROM outbox")
    # first attempt refused with 429, second delivered; nothing sent a third time
    assert tg.sent(8) == ["after the pause", "after the pause"]
    assert [tuple(r) for r in rows] == [("sent", 1)]


async def test_secrets_never_reach_the_database(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(say("ok"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)):
        tg.push_text("hi", chat_id=12)
        await tg.wait_for("sendMessage")
    blob = (tmp_path / "data" / "bumblebot.db").read_bytes()
    wal = tmp_path / "data" / "bumblebot.db-wal"
    if wal.exists():
        blob += wal.read_bytes()
    assert TOKEN.encode() not in blob and b"sk-test-key-not-real" not in blob


async def test_idle_conversation_is_unloaded_and_reloaded_from_sqlite(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(say("first"), when=is_loop)
    llm.push(say("second"), when=is_loop)
    config = write_config(tmp_path, llm, tg, engine={"idle_unload_s": 0.05, "shutdown_grace_s": 5})
    async with running(config) as d:
        tg.push_text("remember kiwi", chat_id=31)
        await tg.wait_for("sendMessage")
        await d.engine.wait_for_turns(1)
        await d.engine.wait_until(lambda: d.engine.loaded_conversations == 0)
        tg.push_text("what fruit?", chat_id=31)
        await tg.wait_for("sendMessage", n=2)
    assert "remember kiwi" in contents(loop_requests(llm)[1])


async def test_typing_indicator_is_refreshed_until_the_turn_ends(tmp_path, llm, tg):
    judges_say_done(llm)
    slow = Gate(say("done thinking"))
    llm.push(slow, when=is_loop)
    config = write_config(tmp_path, llm, tg, engine={"typing_interval_s": 0.05, "shutdown_grace_s": 5})
    async with running(config) as d:
        tg.push_text("take your time", chat_id=41)
        await tg.wait_for("sendChatAction", n=3)  # refreshed while the model is still working
        slow.release.set()
        await tg.wait_for("sendMessage")
        await d.engine.wait_for_turns(1)
        assert d.engine.idle
    assert not [t for t in asyncio.all_tasks() if t.get_name().endswith(":typing")]  # refresher gone


async def test_a_photo_telegram_will_not_hand_over_gets_a_clear_answer_not_silence(tmp_path, llm, tg):
    update = {
        "update_id": 900,
        "message": {
            "message_id": 5, "date": 1700000000, "chat": {"id": 51, "type": "private"},
            "from": {"id": 51, "is_bot": False, "first_name": "Pic"},
            "photo": [{"file_id": "f1", "file_unique_id": "u1", "width": 90, "height": 90}],
        },
    }
    tg.push_update(update)
    async with running(write_config(tmp_path, llm, tg)) as d:
        await tg.wait_for("sendMessage")
        offset = await d.store.get_kv("telegram.offset")
    # an unknown file_id: getFile refuses it; the user hears why, and no model call is made for nothing
    assert tg.sent(51) == ["I couldn't use the image: Telegram would not hand it over (Invalid file_id)."]
    assert llm.requests == [] and offset == "901"


async def test_markdown_replies_arrive_formatted_with_entities_not_raw(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(say("**Done**: wrote `hello.py`\n\n```python\nprint('hi')\n```"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)):
        tg.push_text("write hello.py", chat_id=61)
        [call] = await tg.wait_for("sendMessage")
    assert "**" not in call.params["text"] and "```" not in call.params["text"]
    assert call.params["text"].startswith("Done: wrote hello.py")
    kinds = {e["type"] for e in call.params["entities"]}
    assert {"bold", "code", "pre"} <= kinds
    assert "parse_mode" not in call.params


async def test_refused_formatting_falls_back_to_plain_text_once(tmp_path, llm, tg):
    from fakes.telegram_server import bad_request_body

    judges_say_done(llm)
    llm.push(say("**important** news"), when=is_loop)
    tg.fail_next("sendMessage", 400, bad_request_body("can't parse entities: entity beyond end of text"))
    async with running(write_config(tmp_path, llm, tg)):
        tg.push_text("news?", chat_id=62)
        calls = await tg.wait_for("sendMessage", n=2)
    assert [c.params["text"] for c in calls] == ["important news", "important news"]
    assert "entities" in calls[0].params and "entities" not in calls[1].params


# -- updates python-telegram-bot cannot read ----------------------------------------------------


def _deep_update(update_id: int, chat_id: int, depth: int) -> str:
    """An update whose message replies to a chain ``depth`` messages deep, as JSON text (deeper
    than ``json.dumps`` or ``json.loads`` go)."""
    chat = f'{{"id": {chat_id}, "type": "private", "first_name": "Deep"}}'
    text = f'{{"message_id": 1, "date": 1700000000, "chat": {chat}, "text": "root"}}'
    for i in range(depth):
        text = f'{{"message_id": {i + 2}, "date": 1700000000, "chat": {chat}, "text": "reply", "reply_to_message": {text}}}'
    return f'{{"update_id": {update_id}, "message": {text}}}'


async def test_updates_the_library_cannot_read_are_skipped_once_and_every_other_chat_is_served(tmp_path, llm, tg, caplog):
    """One update python-telegram-bot could not parse (a date that is no timestamp; a reply chain
    3,000 deep) failed the whole getUpdates batch ("Error while parsing updates!") and the offset
    never moved past it: no chat was served again. Each is skipped, logged once with its id, and
    the updates before, between and after them are answered."""
    caplog.set_level(logging.WARNING)
    judges_say_done(llm)
    for chat in (71, 72, 73):
        llm.push(say(f"hello {chat}"), when=lambda r, chat=chat: is_loop(r) and f"note {chat}" in contents(r))
    tg.push_text("note 71", chat_id=71)
    bad_date = tg.push_text("when?", chat_id=74)
    bad_date["message"]["date"] = "yesterday"
    deep = tg.push_raw_update(tg.next_update_id, _deep_update(tg.next_update_id, 75, 3000))
    tg.push_text("note 72", chat_id=72)
    async with running(write_config(tmp_path, llm, tg)) as d:
        await tg.wait_for("sendMessage", n=2)
        later = tg.push_text("note 73", chat_id=73)
        await tg.wait_for("sendMessage", n=3)
        await d.engine.wait_for_turns(3)
        await handled(tg, later)
        offset = await d.store.get_kv("telegram.offset")
    assert (tg.sent(71), tg.sent(72), tg.sent(73)) == (["hello 71"], ["hello 72"], ["hello 73"])
    assert tg.sent(74) == [] and tg.sent(75) == []
    assert offset == str(later["update_id"] + 1)
    skipped = [r.getMessage() for r in caplog.records if "cannot be read" in r.getMessage()]
    assert len(skipped) == 2 and all(r.levelno == logging.WARNING for r in caplog.records if "cannot be read" in r.getMessage())
    assert f"update {bad_date['update_id']} " in skipped[0] and f"update {deep.update_id} " in skipped[1]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_an_update_a_handler_cannot_take_is_skipped_at_once_not_retried(tmp_path, llm, tg, caplog):
    """A message whose text is a number (python-telegram-bot reads it; our handler fails on
    it) was retried four times with backoff, holding every chat's updates back for 30 s."""
    caplog.set_level(logging.INFO)
    judges_say_done(llm)
    llm.push(say("hello 77"), when=is_loop)
    odd = tg.push_text("placeholder", chat_id=76)
    odd["message"]["text"] = 12345
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("note 77", chat_id=77)
        await tg.wait_for("sendMessage")
        await d.engine.wait_for_turns(1)
    assert tg.sent(77) == ["hello 77"] and tg.sent(76) == []
    messages = [r.getMessage() for r in caplog.records]
    assert [m for m in messages if f"update {odd['update_id']} cannot be handled" in m]
    assert not [m for m in messages if "not recorded" in m or "giving up" in m]


async def test_a_batch_ending_in_an_unreadable_update_moves_past_it(tmp_path, llm, tg, caplog):
    """The last update of a batch could not be read: the offset must still pass it, or each poll
    would fetch it again at once (a busy loop, the same warning for ever)."""
    caplog.set_level(logging.WARNING)
    judges_say_done(llm)
    llm.push(say("first"), when=lambda r: is_loop(r) and "note 81" in contents(r))
    llm.push(say("second"), when=lambda r: is_loop(r) and "note 82" in contents(r))
    tg.push_text("note 81", chat_id=81)
    bad = tg.push_text("odd", chat_id=83)
    bad["message"]["chat"] = "not a chat"
    async with running(write_config(tmp_path, llm, tg)) as d:
        await handled(tg, bad)
        polls = len([c for c in tg.calls if c.method == "getUpdates"])
        tg.push_text("note 82", chat_id=82)
        await tg.wait_for("sendMessage", n=2)
        await d.engine.wait_for_turns(2)
    assert tg.sent(81) == ["first"] and tg.sent(82) == ["second"]
    assert polls <= 3  # the start's, the batch's, the one past it: no busy loop
    assert len([r for r in caplog.records if "cannot be read" in r.getMessage()]) == 1
