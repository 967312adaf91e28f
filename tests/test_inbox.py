"""A conversation's inbox (bumblebot/runtime/inbox.py): bursts, debounce, a /stop or /reset while a burst is routed."""

from __future__ import annotations

import asyncio

from conftest import running, write_config
from fakes.openai_server import is_loop, text
from support import (
    TG_LIMIT,
    UNCLEAR,
    Gate,
    contents,
    db,
    is_classifier,
    is_loop_with,
    judges_say_done,
    loop_requests,
    say,
    telegram_parts,
)

# -- bursts: messages that follow each other within cognition.debounce_s are one turn ----------


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


async def test_a_lead_message_then_a_slow_paste_is_still_one_turn_on_a_slow_model(tmp_path, llm, tg):
    """"here is my log" then 13 paste parts 0.4 s apart, with a model taking 1.5 s a call, is one
    turn (waited out for the debounce only, the burst once made parts 2-13 a second turn)."""
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
    """In queue mode X's turn has been thinking for a while when A and B come 0.1 s apart: they
    are a burst of their own and wait for their turn (counted as X's, they aborted its completion)."""
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


# -- a pending /stop and the /reset fence while a burst is routed ------------------------------


async def test_reset_while_a_burst_is_routed_sets_it_aside_and_answers_the_next_message(tmp_path, llm, tg):
    """A is routed (slow classifier), B continues the burst, /reset, then C: A and B are set aside
    and C is answered in the new session. (The burst once went back to the inbox with A, merged
    with C, and the stop the reset left pending stopped C's turn.)"""
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


async def test_a_message_after_stop_while_the_turn_is_routed_is_answered(tmp_path, llm, tg):
    """/stop while A is routed, then B within the burst window: A is stopped and B is answered
    (B once sent A's turn back to the inbox, the stop survived it, and the merged turn [A, B]
    began stopped)."""
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
