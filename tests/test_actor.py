"""A conversation's actor (bumblebot/runtime/actor.py): /reset stops the running turn and fences the old session."""

from __future__ import annotations

import asyncio

import pytest
from conftest import running, write_config
from fakes.openai_server import is_loop, text
from support import UNCLEAR, Gate, contents, db, is_classifier, judges_say_done, loop_requests, say


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


async def test_reset_during_a_turn_keeps_that_turn_out_of_the_fresh_conversation(tmp_path, llm, tg):
    judges_say_done(llm)
    slow = Gate(say("answer to the old topic"))
    llm.push(slow, when=is_loop)
    llm.push(say("fresh"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("old topic case-rst", chat_id=12)
        await asyncio.wait_for(slow.entered.wait(), 5)
        tg.push_text("/reset", chat_id=12)
        await tg.wait_for("sendMessage")  # the reset confirmation
        tg.push_text("/status", chat_id=12)  # loads the new session's (empty) history
        await tg.wait_for("sendMessage", n=2)
        slow.release.set()
        await d.engine.wait_for_turns(1)
        tg.push_text("new topic", chat_id=12)
        await tg.wait_for("sendMessage", predicate=lambda p: p.get("text") == "fresh")
    fresh = [r for r in loop_requests(llm) if "new topic" in contents(r)][0]
    assert "case-rst" not in contents(fresh)
    assert "answer to the old topic" not in tg.sent(12)  # /reset stopped it


@pytest.fixture
def transcription_down_for_an_hour(llm, monkeypatch):
    """The transcription endpoint refuses (503) and a voice note's next try is an hour away."""
    import bumblebot.runtime.outage

    monkeypatch.setattr(bumblebot.runtime.outage, "OUTAGE_RETRY_FIRST_S", 3600.0)
    for _ in range(2):  # the client's one retry sees it too
        llm.push_transcript_error(503, "overloaded")


async def voice_note_waiting(d, tg, chat_id: int):
    """Send a voice note and return the chat's actor once the note waits for its transcript."""
    tg.push_voice(b"OggS" + b"\x0a" * 50, chat_id=chat_id)
    await tg.wait_for("sendMessage")  # "I can't get to the file you sent right now…"
    [actor] = d.engine._actors.values()
    await d.engine.wait_until(lambda: bool(actor.inbox.postponed) and not actor.busy)
    return actor


@pytest.mark.usefixtures("transcription_down_for_an_hour")
async def test_a_text_sent_while_a_voice_note_waits_for_its_files_is_answered_at_once(tmp_path, llm, tg):
    """While a voice note waits out a transcription outage, a new text goes on meanwhile: the
    actor's sleep until the voice note's retry swallowed the wake, so the text waited for that
    retry (up to a minute as the backoff grows). The retry is an hour away here: the text is
    answered long before it."""
    llm.push(say("answering your text"), when=is_loop)
    judges_say_done(llm)
    async with running(write_config(tmp_path, llm, tg)) as d:
        await voice_note_waiting(d, tg, 72)
        tg.push_text("are you there?", chat_id=72)
        await tg.wait_for("sendMessage", n=2, timeout=10)
    assert tg.sent(72)[-1] == "answering your text"


@pytest.mark.usefixtures("transcription_down_for_an_hour")
async def test_a_stop_of_messages_waiting_for_files_settles_even_when_the_daemon_stops_at_once(tmp_path, llm, tg):
    """``/stop`` while a voice note waits for its files drops it; the drop is a job of the actor,
    and an actor stopping in the same instant (SIGTERM right after the /stop) skipped its jobs:
    the voice note stayed pending and the next start answered what the user had stopped."""
    from support import journal_texts

    async with running(write_config(tmp_path, llm, tg)) as d:
        actor = await voice_note_waiting(d, tg, 73)
        assert actor.stop_turn()
        actor.stop()
    assert [status for _, status in journal_texts(tmp_path)] == ["ignored"]
