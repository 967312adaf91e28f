"""Field bugs of comparable bots replayed against Bumblebot (issue 16), each with the input
that broke them: bursts and split pastes, tool-call arguments a strict endpoint refuses,
invisible-only messages, and ``/reset`` during a running turn. Everything goes through the
real python-telegram-bot and openai clients against the local fakes, which are as strict as
vLLM (tool-call arguments must be a JSON object) and Anthropic through OpenRouter (no blank
text) by default (tests/fakes/openai_server.py)."""

from __future__ import annotations

import asyncio
import json
import sqlite3

from conftest import running, write_config
from fakes.openai_server import Reply, error, is_aux, is_loop, text
from support import (
    UNCLEAR,
    Gate,
    contents,
    is_classifier,
    is_loop_with,
    judges_say_done,
    loop_requests,
    say,
    tool_result,
)

TG_LIMIT = 4096


def db(tmp_path):
    return sqlite3.connect(tmp_path / "data" / "bumblebot.db")


def telegram_parts(paste: str) -> list[str]:
    """``paste`` cut as a Telegram client cuts a long message: at line breaks, each part at
    most 4096 characters, the break itself dropped."""
    parts, current = [], ""
    for line in paste.split("\n"):
        if current and len(current) + 1 + len(line) > TG_LIMIT:
            parts.append(current)
            current = line
        else:
            current = f"{current}\n{line}" if current else line
    parts.append(current)
    return parts


# -- 1. bursts -------------------------------------------------------------------------------


async def test_a_50000_character_paste_cut_into_13_messages_is_one_turn_and_one_reply(tmp_path, llm, tg):
    """The failing input: a 50,000-character paste arriving as 13 Telegram messages became 13
    turns and 13 replies, the first seeing part 1 only."""
    judges_say_done(llm)
    paste = "\n".join(f"line {i:05d}: " + "lorem ipsum dolor sit amet " * 2 for i in range(780))[:50_000].rstrip()
    parts = telegram_parts(paste)
    assert len(parts) == 13 and all(len(p) <= TG_LIMIT for p in parts)
    llm.push(say("I have read all of it."), when=is_loop)
    config = write_config(tmp_path, llm, tg, cognition={"debounce_s": 0.3})
    async with running(config) as daemon:
        for part in parts:
            tg.push_text(part, chat_id=161)
        await daemon.engine.wait_for_turns(1, timeout=20)
        await daemon.engine.wait_until(lambda: daemon.engine.idle)
    assert tg.sent(161) == ["I have read all of it."]
    [request] = loop_requests(llm)
    [user] = [m for m in request["messages"] if m["role"] == "user"]
    assert paste in user["content"]  # the parts joined back into the one text that was pasted
    turns = db(tmp_path).execute("SELECT COUNT(DISTINCT turn_id), COUNT(*) FROM journal").fetchone()
    assert turns == (1, 13)


async def test_a_long_paste_on_a_4k_window_is_kept_as_a_file_instead_of_refused_as_too_long(tmp_path, llm, tg):
    """The same kind of paste on a real small model's 4k window: one input, kept whole as a file
    the model can read in parts, never a request the server refuses as too long."""
    refused = []

    def four_k_server(request):
        if len(json.dumps(request["messages"])) > 4096 * 4:
            refused.append(request)
            return error(400, "This model's maximum context length is 4096 tokens. Please reduce the length.")
        if is_aux(request):
            return text("DONE: the reply is adequate")
        return say("I saved it and read the start.")

    llm.default = four_k_server
    paste = "\n".join(f"row {i:04d}: " + "the quick brown fox jumps over the lazy dog " * 2 for i in range(200))
    parts = telegram_parts(paste)
    assert len(parts) == 5
    config = write_config(tmp_path, llm, tg, cognition={"debounce_s": 0.3, "max_context_tokens": 4096})
    async with running(config) as daemon:
        for part in parts:
            tg.push_text(part, chat_id=171)
        await daemon.engine.wait_for_turns(1, timeout=20)
    assert tg.sent(171) == ["I saved it and read the start."]
    assert refused == []
    kept = list((tmp_path / "data" / "workspace" / "inbox" / "telegram_171").glob("message-*.txt"))
    assert len(kept) == 1 and kept[0].read_text() == paste
    user = next(m["content"] for m in loop_requests(llm)[0]["messages"] if m["role"] == "user")
    assert f'read_file("inbox/telegram_171/{kept[0].name}")' in user and "row 0000" in user and "row 0199" not in user


async def test_a_burst_of_short_messages_within_the_debounce_is_one_turn(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(say("All three noted."), when=is_loop)
    config = write_config(tmp_path, llm, tg, cognition={"debounce_s": 0.3})
    async with running(config) as daemon:
        for word in ("first: milk", "second: eggs", "third: bread"):
            tg.push_text(word, chat_id=162)
        await daemon.engine.wait_for_turns(1, timeout=10)
        await daemon.engine.wait_until(lambda: daemon.engine.idle)
    assert tg.sent(162) == ["All three noted."]
    # the first message's turn may have begun at once and been asked again: the last request has all
    assert all(w in contents(loop_requests(llm)[-1]) for w in ("milk", "eggs", "bread"))
    assert db(tmp_path).execute("SELECT COUNT(*), COUNT(DISTINCT turn_id) FROM journal").fetchone() == (3, 1)


async def test_a_lone_message_is_answered_at_once_not_after_the_debounce(tmp_path, llm, tg):
    """Debouncing must not cost a lone message its latency: with a 5 s window its model
    request still comes at once (before the window could have passed)."""
    judges_say_done(llm)
    hold = Gate(say("Right away."))
    llm.push(hold, when=is_loop)
    config = write_config(tmp_path, llm, tg, cognition={"debounce_s": 5})
    async with running(config) as daemon:
        tg.push_text("a lone question", chat_id=172)
        await asyncio.wait_for(hold.entered.wait(), 4)
        hold.release.set()
        await daemon.engine.wait_for_turns(1)
    assert tg.sent(172) == ["Right away."]


async def test_a_message_following_within_the_debounce_asks_the_first_completion_again_with_both(tmp_path, llm, tg):
    """The turn began at once on the first message; the second came while its first model call
    ran (nothing shown yet): that call is aborted and asked again with both messages."""
    judges_say_done(llm)
    first = Gate(say("Only the first."))
    llm.push(first, when=is_loop)
    llm.push(say("Both of them."), when=is_loop_with("second half"))
    config = write_config(tmp_path, llm, tg, cognition={"debounce_s": 2, "mid_turn_messages": "queue"})
    async with running(config) as daemon:
        tg.push_text("first half", chat_id=173)
        await asyncio.wait_for(first.entered.wait(), 10)
        tg.push_text("second half", chat_id=173)
        await daemon.engine.wait_for_turns(1, timeout=15)
        await daemon.engine.wait_until(lambda: daemon.engine.idle)
    first.release.set()
    assert tg.sent(173) == ["Both of them."]  # the aborted completion never reached the chat
    last = loop_requests(llm)[-1]
    assert "first half" in contents(last) and "second half" in contents(last)
    conn = db(tmp_path)
    assert conn.execute("SELECT COUNT(*), COUNT(DISTINCT turn_id) FROM journal").fetchone() == (2, 1)
    assert conn.execute("SELECT COUNT(*) FROM turns").fetchone() == (1,)


async def test_a_chat_that_never_stops_writing_still_gets_its_answer(tmp_path, monkeypatch):
    """Regression: each message within the debounce sent a turn still being routed back to the
    inbox; with a message every 0.15 s and routing that takes 0.3 s (the classifier), no turn
    would ever begin. The actor with a stand-in runner that routes slowly (pure logic)."""
    import bumblebot.runtime.inbox
    from bumblebot.core.events import ChatRef, Inbound, Platform
    from bumblebot.runtime.actor import ConversationActor, Progress
    from bumblebot.runtime.conversation import Conversation
    from bumblebot.runtime.outcomes import Finished, Requeued
    from bumblebot.store import JournalEntry, Store

    monkeypatch.setattr(bumblebot.runtime.inbox, "DEBOUNCE_MAX_S", 1.0)

    class SlowRouter:
        calls = 0

        async def run(self, conversation, entries):
            self.calls += 1
            await asyncio.sleep(0.3)  # the classifier deciding the route
            return Requeued(entries) if conversation.inbox.burst.is_set() else Finished("done")

    chat = ChatRef(Platform.TELEGRAM, "176")
    async with Store(tmp_path / "b.db") as store:
        runner, progress, ready = SlowRouter(), Progress(), asyncio.Event()
        ready.set()
        actor = ConversationActor(await Conversation.load(store, chat, debounce_s=0.3), runner, ready=ready,
                                  idle_unload_s=60, progress=progress)
        task = asyncio.create_task(actor.run())
        for i in range(40):  # the stimulus: a message every 0.15 s for up to 6 s
            actor.enqueue(JournalEntry(i + 1, Inbound(chat, str(i), "1", "Alice", f"part {i}"), "pending"))
            await asyncio.sleep(0.15)
            if progress.turns_finished:
                break
        actor.stop()
        await asyncio.wait_for(task, 5)
    assert progress.turns_finished >= 1  # a turn began while the messages kept coming
    assert runner.calls < 15


async def test_a_message_following_while_the_turn_is_routed_joins_it(tmp_path, llm, tg):
    judges_say_done(llm)
    routing = Gate(text("CHAT"))
    llm.push(routing, when=is_classifier)
    llm.push(say("Answered together."), when=is_loop)
    config = write_config(tmp_path, llm, tg, cognition={"debounce_s": 2, "classifier": True})
    async with running(config) as daemon:
        tg.push_text(UNCLEAR, chat_id=174)
        await asyncio.wait_for(routing.entered.wait(), 10)
        tg.push_text("and one more thing", chat_id=174)
        await daemon.engine.wait_until(lambda: daemon.engine.progress.accepted >= 2)
        routing.release.set()
        await daemon.engine.wait_for_turns(1, timeout=15)
    assert tg.sent(174) == ["Answered together."]
    [request] = loop_requests(llm)
    assert UNCLEAR in contents(request) and "and one more thing" in contents(request)


async def test_debounce_off_starts_a_turn_at_once(tmp_path, llm, tg):
    """``cognition.debounce_s: 0``: the first message's turn does not wait for a second one."""
    judges_say_done(llm)
    hold = Gate(say("one"))
    llm.push(hold, when=is_loop)
    llm.push(say("two"), when=is_loop)
    config = write_config(tmp_path, llm, tg, cognition={"debounce_s": 0, "mid_turn_messages": "queue"})
    async with running(config) as daemon:
        tg.push_text("first", chat_id=163)
        await asyncio.wait_for(hold.entered.wait(), 10)  # began before anything else arrived
        tg.push_text("second", chat_id=163)
        await daemon.engine.wait_until(lambda: daemon.engine.progress.accepted >= 2)
        hold.release.set()
        await daemon.engine.wait_for_turns(2, timeout=10)
    assert tg.sent(163) == ["one", "two"]


# -- 2. tool-call arguments a strict endpoint refuses -----------------------------------------


def _call(name: str, arguments: str, *, end: bool = False) -> Reply:
    calls = [{"id": "call_nan", "type": "function", "function": {"name": name, "arguments": arguments}}]
    if end:
        calls.append({"id": "call_end", "type": "function", "function": {"name": "end_turn", "arguments": "{}"}})
    return Reply(message={"role": "assistant", "content": None, "tool_calls": calls}, finish_reason="tool_calls")


async def test_tool_call_arguments_with_nan_are_stored_as_valid_json_and_the_model_told(tmp_path, llm, tg):
    """The failing input: ``{"text": NaN}`` reads as an object in Python but is not JSON; stored
    as it was, a strict endpoint (vLLM) refused every later request of the conversation."""
    judges_say_done(llm)
    llm.push(_call("say", '{"text": NaN}'), when=is_loop)
    llm.push(say("Sorry, here it is."), when=is_loop)
    llm.push(say("Still here."), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as daemon:
        tg.push_text("hi there", chat_id=164)
        await daemon.engine.wait_for_turns(1)
        tg.push_text("and again", chat_id=164)
        await daemon.engine.wait_for_turns(2)
    assert tg.sent(164) == ["Sorry, here it is.", "Still here."]
    assert llm.violations == []  # no request was refused
    second = loop_requests(llm)[1]
    [told] = tool_result(second, "say")[:1]
    assert "NaN is not a JSON value" in told["error"]  # the model is told why
    for (calls,) in db(tmp_path).execute("SELECT tool_calls FROM messages WHERE tool_calls IS NOT NULL"):
        for call in json.loads(calls):
            json.loads(call["function"]["arguments"], parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))


async def test_a_history_poisoned_by_an_older_version_is_sent_with_sound_arguments(tmp_path, llm, tg):
    """A conversation whose history already holds broken arguments (recorded before this fix)
    is not stuck: every request carries them as ``{}``."""
    judges_say_done(llm)
    llm.push(say("First answer."), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as daemon:
        tg.push_text("hello", chat_id=165)
        await daemon.engine.wait_for_turns(1)
    conn = db(tmp_path)
    (row_id, calls) = conn.execute("SELECT id, tool_calls FROM messages WHERE tool_calls IS NOT NULL").fetchone()
    poisoned = json.loads(calls)
    poisoned[0]["function"]["arguments"] = '{"text": "First ans'  # cut off: what an old version kept
    conn.execute("UPDATE messages SET tool_calls=? WHERE id=?", (json.dumps(poisoned), row_id))
    conn.commit()
    llm.push(say("Second answer."), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as daemon:
        tg.push_text("again", chat_id=165)
        await daemon.engine.wait_for_turns(1)
    assert tg.sent(165)[-1] == "Second answer."
    assert llm.violations == []
    sent_calls = [c for m in loop_requests(llm)[-1]["messages"] for c in m.get("tool_calls") or ()]
    assert sent_calls[0]["function"]["arguments"] == "{}"


# -- 3. blank and invisible-only input --------------------------------------------------------


ZERO_WIDTH = "\u200b\u200c\u200d\u2060\ufeff"


async def test_a_message_of_only_zero_width_characters_never_becomes_a_message(tmp_path, llm, tg):
    """The failing input: a message of only zero-width characters was stored as a user message,
    and an endpoint that refuses blank text (Anthropic through OpenRouter) then failed on every
    later turn."""
    judges_say_done(llm)
    llm.push(say("Hello!"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as daemon:
        tg.push_text(ZERO_WIDTH, chat_id=166)
        tg.push_text("\u3164 \u2800", chat_id=166)  # a Hangul filler and a blank Braille pattern
        tg.push_text("hi", chat_id=166)
        await daemon.engine.wait_for_turns(1)
        await daemon.engine.wait_until(lambda: daemon.engine.idle)
    assert tg.sent(166) == ["Hello!"]
    assert llm.violations == []
    [request] = loop_requests(llm)
    users = [m["content"] for m in request["messages"] if m["role"] == "user"]
    assert len(users) == 1 and "\u200b" not in users[0] and users[0].rstrip().endswith("hi")
    conn = db(tmp_path)
    assert conn.execute("SELECT status FROM journal ORDER BY id").fetchall() == [("ignored",), ("ignored",), ("done",)]
    assert conn.execute("SELECT COUNT(*) FROM messages WHERE role='user'").fetchone() == (1,)


async def test_the_model_saying_only_invisible_characters_sends_nothing_and_stores_no_blank(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(Reply(message={"role": "assistant", "content": "\u200b", "tool_calls": [
        {"id": "call_zw", "type": "function", "function": {"name": "say", "arguments": json.dumps({"text": ZERO_WIDTH})}},
    ]}, finish_reason="tool_calls"), when=is_loop)
    llm.push(say("A real answer."), when=is_loop)
    llm.push(say("Next."), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as daemon:
        tg.push_text("hey", chat_id=167)
        await daemon.engine.wait_for_turns(1)
        tg.push_text("and?", chat_id=167)
        await daemon.engine.wait_for_turns(2)
    assert tg.sent(167) == ["A real answer.", "Next."]
    assert llm.violations == []
    assert "nothing to say" in tool_result(loop_requests(llm)[1], "say")[0]["error"]


# -- 4. /reset during a running turn ----------------------------------------------------------


async def test_reset_during_a_running_turn_stops_it_and_later_messages_belong_to_the_new_session(tmp_path, llm, tg):
    """The failing input: ``/reset`` while a turn runs; the next message was steered into the
    old turn, answered with the discarded history, and stored under the old session."""
    judges_say_done(llm)
    hold = Gate(say("Tomatoes are fruit."))
    llm.push(hold, when=is_loop)
    llm.push(say("Fresh here: what would you like?"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as daemon:
        tg.push_text("tell me about tomatoes", chat_id=168)
        await asyncio.wait_for(hold.entered.wait(), 10)
        tg.push_text("/reset", chat_id=168)
        [answer] = await tg.wait_for("sendMessage", predicate=lambda p: "Fresh start" in p.get("text", ""))
        assert "stopped what I was working on" in answer.params["text"]
        tg.push_text("what did I ask you before?", chat_id=168)
        await daemon.engine.wait_for_turns(2, timeout=10)
    hold.release.set()
    assert tg.sent(168)[-1] == "Fresh here: what would you like?"
    assert "Tomatoes are fruit." not in tg.sent(168)  # the old turn never answered
    after = loop_requests(llm)[-1]
    assert "what did I ask you before?" in contents(after) and "tomatoes" not in contents(after)
    conn = db(tmp_path)
    sessions = dict(conn.execute("SELECT content, session FROM messages WHERE role='user'").fetchall())
    assert sessions["tell me about tomatoes"] < sessions["what did I ask you before?"]
    stop_reasons = [r[0] for r in conn.execute("SELECT json_extract(trace, '$.stop_reason') FROM turns ORDER BY id")]
    assert stop_reasons[0] == "stopped"


async def test_messages_waiting_when_reset_comes_are_set_aside_not_answered_in_the_new_session(tmp_path, llm, tg):
    judges_say_done(llm)
    hold = Gate(say("Old answer."))
    llm.push(hold, when=is_loop)
    llm.push(say("New answer."), when=is_loop)
    config = write_config(tmp_path, llm, tg, cognition={"mid_turn_messages": "queue"})
    async with running(config) as daemon:
        tg.push_text("first question", chat_id=169)
        await asyncio.wait_for(hold.entered.wait(), 10)
        tg.push_text("a follow-up that waits", chat_id=169)
        await daemon.engine.wait_until(lambda: daemon.engine.queue_depth == 1)
        tg.push_text("/reset", chat_id=169)
        [answer] = await tg.wait_for("sendMessage", predicate=lambda p: "Fresh start" in p.get("text", ""))
        assert "the 1 message you sent before it will not be answered" in answer.params["text"]
        tg.push_text("a new topic", chat_id=169)
        await daemon.engine.wait_for_turns(2, timeout=10)
    hold.release.set()
    assert tg.sent(169)[-1] == "New answer."
    assert not any("a follow-up that waits" in contents(r) for r in llm.requests)
    status = dict(db(tmp_path).execute("SELECT text, status FROM journal").fetchall())
    assert status["a follow-up that waits"] == "ignored"


async def test_reset_while_the_turn_is_being_routed_sets_its_message_aside(tmp_path, llm, tg):
    """``/reset`` while the classifier decides the route: the turn never begins in the new
    session (nor in the old)."""
    judges_say_done(llm)
    routing = Gate(text("DELIBERATE"))
    llm.push(routing, when=is_classifier)
    llm.push(say("Answer in the new session."), when=is_loop)
    config = write_config(tmp_path, llm, tg, cognition={"classifier": True})
    async with running(config) as daemon:
        tg.push_text(UNCLEAR, chat_id=170)
        await asyncio.wait_for(routing.entered.wait(), 10)
        tg.push_text("/reset", chat_id=170)
        await tg.wait_for("sendMessage", predicate=lambda p: "Fresh start" in p.get("text", ""))
        routing.release.set()
        await daemon.engine.wait_until(lambda: daemon.engine.idle)
        tg.push_text("hello again", chat_id=170)
        await daemon.engine.wait_for_turns(2, timeout=10)
    assert tg.sent(170)[-1] == "Answer in the new session."
    assert not any(UNCLEAR in contents(r) for r in loop_requests(llm))
    conn = db(tmp_path)
    assert conn.execute("SELECT COUNT(*) FROM turns").fetchone() == (1,)
    assert dict(conn.execute("SELECT text, status FROM journal").fetchall())[UNCLEAR] == "ignored"


# -- regressions from the review of issue 16 ---------------------------------------------------


async def test_reset_while_a_burst_is_routed_sets_it_aside_and_answers_the_next_message(tmp_path, llm, tg):
    """Review: A is routed (slow classifier), B continues the burst, /reset, then C. The burst went
    back to the inbox with A, merged with C, and the stop the reset left pending stopped C's turn."""
    judges_say_done(llm)
    routing = Gate(text("CHAT"))
    llm.push(routing, when=is_classifier)
    llm.push(say("Answer to C."), when=is_loop)
    config = write_config(tmp_path, llm, tg, cognition={"debounce_s": 1.0, "classifier": True})
    async with running(config) as daemon:
        tg.push_text(UNCLEAR, chat_id=180)
        await asyncio.wait_for(routing.entered.wait(), 10)
        tg.push_text("B continues the burst", chat_id=180)
        await daemon.engine.wait_until(lambda: daemon.engine.progress.accepted >= 2)
        tg.push_text("/reset", chat_id=180)
        await tg.wait_for("sendMessage", predicate=lambda p: "Fresh start" in p.get("text", ""))
        tg.push_text("C after the reset", chat_id=180)
        await daemon.engine.wait_until(lambda: daemon.engine.progress.accepted >= 3)
        routing.release.set()
        await tg.wait_for("sendMessage", predicate=lambda p: p.get("text") == "Answer to C.", timeout=15)
        await daemon.engine.wait_until(lambda: daemon.engine.idle)
    assert not any(UNCLEAR in contents(r) or "B continues" in contents(r) for r in loop_requests(llm))
    conn = db(tmp_path)
    status = dict(conn.execute("SELECT substr(text, 1, 20), status FROM journal WHERE text NOT LIKE '/%'").fetchall())
    assert status == {UNCLEAR[:20]: "ignored", "B continues the burs": "ignored", "C after the reset": "done"}
    users = conn.execute("SELECT session, content FROM messages WHERE role='user'").fetchall()
    assert users == [(2, "C after the reset")]
    assert conn.execute("SELECT json_extract(trace, '$.stop_reason') FROM turns").fetchall() == [("end_turn",)]


async def test_a_lead_message_then_a_slow_paste_is_still_one_turn_on_a_slow_model(tmp_path, llm, tg):
    """Review: "here is my log" then 13 paste parts 0.4 s apart with a model taking 1.5 s a call:
    the burst was waited out for the debounce only, so parts 2-13 became a second turn."""
    judges_say_done(llm)
    llm.push(say("One answer to the log.", delay=1.5), when=is_loop)
    llm.push(say("One answer to the log.", delay=1.5), when=is_loop)
    paste = "\n".join(f"line {i:05d}: " + "lorem ipsum dolor sit amet " * 2 for i in range(780))[:50_000].rstrip()
    config = write_config(tmp_path, llm, tg, cognition={"debounce_s": 0.3})
    async with running(config) as daemon:
        tg.push_text("here is my log, what is wrong?", chat_id=181)
        await asyncio.sleep(0.1)  # the stimulus: the paste follows the question
        for part in telegram_parts(paste):
            tg.push_text(part, chat_id=181)
            await asyncio.sleep(0.4)
        await daemon.engine.wait_for_turns(1, timeout=30)
        await daemon.engine.wait_until(lambda: daemon.engine.idle, timeout=15)
    assert tg.sent(181) == ["One answer to the log."]
    assert db(tmp_path).execute("SELECT COUNT(DISTINCT turn_id), COUNT(*) FROM journal").fetchone() == (1, 14)
    assert paste in contents(loop_requests(llm)[-1])


async def test_two_quick_messages_long_after_a_turn_began_wait_for_their_own_turn(tmp_path, llm, tg):
    """Review: in queue mode X's turn had been thinking for a while when A and B came 0.1 s apart;
    they counted as a burst of X's and aborted its completion. They are a burst of their own."""
    judges_say_done(llm)
    slow = Gate(say("Answer to X only."))
    llm.push(slow, when=is_loop)
    llm.push(say("Answer to A and B."), when=is_loop)
    config = write_config(tmp_path, llm, tg, cognition={"debounce_s": 0.3, "mid_turn_messages": "queue"})
    async with running(config) as daemon:
        tg.push_text("X: a question", chat_id=182)
        await asyncio.wait_for(slow.entered.wait(), 10)
        await asyncio.sleep(0.6)  # the stimulus: well after X's own burst
        tg.push_text("A: unrelated", chat_id=182)
        tg.push_text("B: unrelated too", chat_id=182)
        await daemon.engine.wait_until(lambda: daemon.engine.queue_depth == 2)
        slow.release.set()
        await daemon.engine.wait_for_turns(2, timeout=10)
    assert tg.sent(182) == ["Answer to X only.", "Answer to A and B."]
    assert len(loop_requests(llm)) == 2  # X's completion was not aborted


async def test_a_say_whose_text_holds_a_lone_surrogate_after_reasoning_is_cut_does_not_poison_the_chat(tmp_path, llm, tg):
    """Review: {"text": "<think>x</think>hi \\ud800 there"}: cutting the reasoning re-wrote the
    arguments with a raw lone surrogate; the outbox insert failed and every later request too."""
    judges_say_done(llm)
    llm.push(_call("say", '{"text": "<think>x</think>hi \\ud800 there"}', end=True), when=is_loop)
    llm.push(say("Next turn is fine."), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as daemon:
        tg.push_text("hi there", chat_id=183)
        await daemon.engine.wait_for_turns(1, timeout=15)
    async with running(write_config(tmp_path, llm, tg)) as daemon:  # and after a restart
        tg.push_text("after a restart", chat_id=183)
        await daemon.engine.wait_for_turns(1, timeout=15)
    assert tg.sent(183) == ["hi \ufffd there", "Next turn is fine."]
    assert llm.violations == []


async def test_reset_for_another_bot_followed_by_punctuation_resets_nothing(tmp_path, llm, tg):
    """Review: ``/reset@other_bot.`` (and ``,``, ``!``, ``-bot``) reset this bot's conversation."""
    judges_say_done(llm)
    llm.push(say("Noted."), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as daemon:
        tg.push_text("remember 42", chat_id=184)
        await daemon.engine.wait_for_turns(1)
        for command in ("/reset@other_bot.", "/reset@other_bot, please", "/reset@other_bot!", "/reset@other-bot"):
            tg.push_text(command, chat_id=184)
        tg.push_text("/status", chat_id=184)  # answered after the four: they were handled by then
        await tg.wait_for("sendMessage", n=2, predicate=lambda p: p.get("chat_id") == 184)
    assert not any("Fresh start" in t for t in tg.sent(184))
    assert db(tmp_path).execute("SELECT session FROM conversations").fetchone() == (1,)


async def test_a_message_after_stop_while_the_turn_is_routed_is_answered(tmp_path, llm, tg):
    """Second review: /stop while A was routed, then B within the burst window: B sent A's turn
    back to the inbox, the stop survived it, and the merged turn [A, B] began stopped."""
    judges_say_done(llm)
    routing = Gate(text("CHAT"))
    llm.push(routing, when=is_classifier)
    llm.push(say("Answer to B."), when=is_loop)
    config = write_config(tmp_path, llm, tg, cognition={"debounce_s": 2, "classifier": True})
    async with running(config) as daemon:
        tg.push_text(UNCLEAR, chat_id=185)
        await asyncio.wait_for(routing.entered.wait(), 10)
        tg.push_text("/stop", chat_id=185)
        await tg.wait_for("sendMessage", predicate=lambda p: p.get("text") == "Stopped.")
        tg.push_text("actually, what is 2+2?", chat_id=185)
        await daemon.engine.wait_until(lambda: daemon.engine.progress.accepted >= 2)
        routing.release.set()
        await tg.wait_for("sendMessage", predicate=lambda p: p.get("text") == "Answer to B.", timeout=15)
    assert not any(UNCLEAR in contents(r) for r in loop_requests(llm))  # A was stopped
    status = dict(db(tmp_path).execute("SELECT substr(text, 1, 12), status FROM journal").fetchall())
    assert status[UNCLEAR[:12]] == "ignored" and status["actually, wh"] == "done"


async def test_reset_while_a_photo_downloads_and_then_fails_promises_nothing(tmp_path, llm, tg, monkeypatch):
    """Second review: /reset while a photo's download hung, then the download failed (Telegram
    unreachable): the set-aside message was postponed and the chat told "I'll answer as soon as
    I can", which never happened. (The download is held, then fails, by a stand-in for it.)"""
    import io

    from PIL import Image

    import adapters.telegram.adapter as telegram_adapter
    from bumblebot.core.errors import MediaError

    entered, release = asyncio.Event(), asyncio.Event()

    async def download(self, attachment, dest):
        entered.set()
        await release.wait()
        raise MediaError("Telegram could not be reached", retryable=True)

    monkeypatch.setattr(telegram_adapter.TelegramAdapter, "download", download)
    image = io.BytesIO()
    Image.new("RGB", (64, 64), "red").save(image, "JPEG")
    judges_say_done(llm)
    async with running(write_config(tmp_path, llm, tg)) as daemon:
        tg.push_photo([(64, 64, image.getvalue())], caption="look at this", chat_id=186)
        await asyncio.wait_for(entered.wait(), 10)
        tg.push_text("/reset", chat_id=186)
        await tg.wait_for("sendMessage", predicate=lambda p: "Fresh start" in p.get("text", ""))
        release.set()
        await daemon.engine.wait_until(lambda: daemon.engine.idle and not daemon.engine.waiting)
    assert not any("can't get to the file" in t for t in tg.sent(186))
