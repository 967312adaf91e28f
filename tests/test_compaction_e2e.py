"""Compaction through the running daemon: scripted model, real SQLite, real clients."""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import sqlite3
import time

import pytest
import yaml
from conftest import running, write_config
from fakes.openai_server import error, is_aux, is_loop, text, tool_calls
from support import contents, judges_say_done, loop_requests, say

from bumblebot.cognition.compaction import PLACEHOLDER, SUMMARY_HEADER, SUMMARY_HEADINGS
from bumblebot.cognition.knowledge import Memory
from bumblebot.core.events import ChatRef, Platform
from bumblebot.core.messages import Message
from bumblebot.core.usage import Scope, Usage
from bumblebot.runtime.conversation import Conversation
from bumblebot.runtime.notices import TOO_LONG, TOO_LONG_MESSAGE
from bumblebot.runtime.limits import utc_day
from bumblebot.store import Store

CHAT = 501
SUMMARY = "\n".join(f"## {h}\n- the user's cat is called Miso" for h in SUMMARY_HEADINGS)


def is_summary(request):
    return is_aux(request) and "You compact the history" in contents(request)


def is_flush(request):
    return is_aux(request) and "durable facts" in contents(request)


def request_kinds(llm) -> list[str]:
    """What each request so far was: flush, summary, loop or judge."""
    return ["flush" if is_flush(r) else "summary" if is_summary(r) else "loop" if is_loop(r) else "judge" for r in llm.requests]


def held(reply, asked: asyncio.Event, release: asyncio.Event):
    """A scripted answer that sets ``asked`` when its request comes, then waits for ``release``
    (a slow local model)."""
    async def answer(request):
        asked.set()
        await release.wait()
        return reply
    return answer


async def turns_between_compactions(d, tg, messages: list[str]) -> None:
    """Send ``messages`` one by one, each after the last one's turn and the compaction between
    turns that followed it."""
    for i, message in enumerate(messages):
        tg.push_text(message, chat_id=CHAT)
        await d.engine.wait_for_turns(i + 1)
        await d.engine.wait_until(lambda: d.engine.settled)


def compaction_config(tmp_path, llm, tg, **history_compression):
    return write_config(
        tmp_path, llm, tg,
        cognition={
            "classifier": False,
            "max_context_tokens": 8000,
            "history_compression": {"compaction_threshold_ratio": 0.75, "compaction_target_ratio": 0.4, **history_compression},
        },
    )


async def seed_history(tmp_path, pairs: int, *, filler: int = 400, tool_every: int = 0) -> None:
    """Write ``pairs`` old exchanges (with tool groups every ``tool_every`` pairs) into the chat."""
    async with Store(tmp_path / "data" / "bumblebot.db") as store:
        conversation = await store.conversation(ChatRef(Platform.TELEGRAM, str(CHAT)))
        messages: list[Message] = []
        for i in range(pairs):
            messages.append(Message(role="user", content=f"old question {i} " + "q" * filler))
            if tool_every and i % tool_every == 0:
                call = {"id": f"seed_{i}", "type": "function", "function": {"name": "read_file", "arguments": json.dumps({"path": f"f{i}.txt"})}}
                messages.append(Message(role="assistant", content="", tool_calls=[call]))
                messages.append(Message(role="tool", content=f"file {i} " + "t" * 600, tool_call_id=f"seed_{i}", name="read_file"))
            messages.append(Message(role="assistant", content=f"old answer {i} " + "a" * filler))
        await store.import_history(conversation, messages)


async def test_crossing_the_threshold_flushes_and_summarises_before_the_completion(tmp_path, llm, tg):
    judges_say_done(llm)
    await seed_history(tmp_path, 24, tool_every=4)
    llm.push(text('[{"title": "Pets", "body": "The user has a cat called Miso."}]'), when=is_flush)
    llm.push(text(SUMMARY), when=is_summary)
    llm.push(say("Miso, of course"), when=is_loop)
    async with running(compaction_config(tmp_path, llm, tg)) as d:
        tg.push_text("what's my cat called?", chat_id=CHAT)
        await tg.wait_for("sendMessage")
        await d.engine.wait_for_turns(1)
        trace = (await d.store.recent_turns())[0]["trace"]
        knowledge = Memory(d.settings.data_dir).of(f"telegram:{CHAT}").path.read_text()  # the chat's own
    kinds = request_kinds(llm)
    assert kinds[:3] == ["flush", "summary", "loop"]
    main = loop_requests(llm)[0]["messages"]
    summary_at = [i for i, m in enumerate(main) if m["content"].startswith(SUMMARY_HEADER)]
    assert summary_at and summary_at[0] >= 3  # system + protected head come first
    assert main[1]["content"].startswith("old question 0")
    assert len(main) - summary_at[0] - 1 >= 12  # at least 12 tail messages (+ this turn)
    step = trace["steps"][0]
    assert step["estimate"] < 8000 * 0.75
    assert trace["compactions"][0]["covered"] > 0
    assert "## Pets" in knowledge
    assert not llm.violations  # every request, summaries included, was a valid sequence


async def test_restart_after_compaction_sends_a_byte_identical_prompt(tmp_path, llm, tg):
    judges_say_done(llm)
    await seed_history(tmp_path, 24, tool_every=5)
    llm.push(text("[]"), when=is_flush)
    llm.push(text(SUMMARY), when=is_summary)
    llm.push(say("first"), when=is_loop)
    llm.push(say("second"), when=is_loop)
    config = compaction_config(tmp_path, llm, tg)
    chat = ChatRef(Platform.TELEGRAM, str(CHAT))

    async def next_prompt(d) -> list[dict]:
        """What the next turn would send before its own user message, as API dicts."""
        requests = d.runner.between_turns(await Conversation.load(d.store, chat))  # from disk
        requests.transcript.append(Message(role="user", content="probe"))  # a turn's first message
        api, _ = await requests.build(None)
        return api[:-1]

    async with running(config) as d:
        tg.push_text("hello", chat_id=CHAT)
        await tg.wait_for("sendMessage")
        await d.engine.wait_for_turns(1)
        predicted = await next_prompt(d)
    assert [r for r in llm.requests if is_summary(r)]  # it did compact
    async with running(config) as d:
        assert json.dumps(await next_prompt(d)) == json.dumps(predicted)  # byte-identical
        tg.push_text("after restart", chat_id=CHAT)
        await tg.wait_for("sendMessage", n=2)
        await d.engine.wait_for_turns(1)
    sent = loop_requests(llm)[-1]["messages"][:-1]
    assert json.dumps(sent) == json.dumps(predicted)
    assert len([r for r in llm.requests if is_summary(r)]) == 1


async def test_summary_failure_drops_nothing_and_the_retry_between_turns_does_not_flush_again(tmp_path, llm, tg):
    judges_say_done(llm)
    await seed_history(tmp_path, 24)
    llm.push(text("[]"), when=is_flush)
    llm.push(error(500, "summariser down"), when=is_summary)
    llm.push(say("answer one"), when=is_loop)
    llm.push(text(SUMMARY), when=is_summary)
    llm.push(say("answer two"), when=is_loop)
    llm.push(say("answer three"), when=is_loop)
    async with running(compaction_config(tmp_path, llm, tg)) as d:
        idle = lambda: d.engine.settled
        tg.push_text("first", chat_id=CHAT)
        await d.engine.wait_for_turns(1)
        await d.engine.wait_until(idle)  # its compaction between turns failed
        first = loop_requests(llm)[0]
        assert "old question 15" in contents(first)
        assert not any(m["content"].startswith(SUMMARY_HEADER) for m in first["messages"])
        tg.push_text("second", chat_id=CHAT)
        await d.engine.wait_for_turns(2)
        await d.engine.wait_until(idle)  # the retry, after the second turn's first words
        assert "old question 15" in contents(loop_requests(llm)[1])  # the middle is still there
        tg.push_text("third", chat_id=CHAT)
        await d.engine.wait_for_turns(3)
    third = loop_requests(llm)[2]
    assert any(m["content"].startswith(SUMMARY_HEADER) for m in third["messages"])
    assert len([r for r in llm.requests if is_summary(r)]) == 2
    first_flush, *later = [contents(r) for r in llm.requests if is_flush(r)]
    assert "old question 3 " in first_flush
    assert not any("old question 3 " in flush for flush in later)  # what the failed run's flush read is not read again
    assert tg.sent(CHAT) == ["answer one", "answer two", "answer three"]
    db = sqlite3.connect(tmp_path / "data" / "bumblebot.db")
    assert db.execute("SELECT COUNT(*) FROM messages WHERE content LIKE 'old question%'").fetchone()[0] == 24


async def test_a_flush_answered_without_facts_is_not_asked_again_for_the_same_messages(tmp_path, llm, tg):
    """SmolLM2 never wrote the JSON: each retry of a failed summary flushed the same messages
    again (20 s a time on two cores)."""
    judges_say_done(llm)
    await seed_history(tmp_path, 24)
    llm.push(text("I am Bob. I have no idea about what you mean."), when=is_flush)
    llm.push(error(500, "summariser down"), when=is_summary)
    llm.push(say("answer one"), when=is_loop)
    llm.push(text(SUMMARY), when=is_summary)
    llm.push(say("answer two"), when=is_loop)
    llm.default = lambda r: text("[]") if is_flush(r) else text("DONE: ok")
    async with running(compaction_config(tmp_path, llm, tg)) as d:
        await turns_between_compactions(d, tg, ["first", "second"])
    first_flush, *later = [contents(r) for r in llm.requests if is_flush(r)]
    assert "old question 3 " in first_flush
    assert not any("old question 3 " in flush for flush in later)
    assert tg.sent(CHAT) == ["answer one", "answer two"]


async def test_a_model_that_fails_to_summarise_twice_gets_an_extractive_summary(tmp_path, llm, tg):
    """SmolLM2-135M never wrote a usable summary: its chats kept every message and each step
    re-read ~3,000 tokens. The second failure in a row summarises extractively, no more calls."""
    judges_say_done(llm)
    await seed_history(tmp_path, 24)
    llm.push(text("[]"), when=is_flush)
    llm.push(text("You can use a JSON array to store the data."), when=is_summary)
    llm.push(say("answer one"), when=is_loop)
    llm.push(text("Here is a summary of the conversation: it was nice."), when=is_summary)
    llm.push(say("answer two"), when=is_loop)
    llm.push(say("answer three"), when=is_loop)
    async with running(compaction_config(tmp_path, llm, tg)) as d:
        await turns_between_compactions(d, tg, ["first", "second", "third"])
        traces = [t["trace"] for t in await d.store.recent_turns()]
    third = loop_requests(llm)[2]
    summary = [m["content"] for m in third["messages"] if m["content"].startswith(SUMMARY_HEADER)]
    assert summary and "the model could not summarise" in summary[0]
    assert "old question 2" in summary[0] and "old question 15" not in contents(third).replace(summary[0], "")
    assert len([r for r in llm.requests if is_summary(r)]) == 2  # the second failure's later passes ask no more
    assert tg.sent(CHAT) == ["answer one", "answer two", "answer three"]
    assert not llm.violations
    assert traces  # the turns were recorded


async def test_two_rate_limited_summaries_do_not_make_an_extractive_summary(tmp_path, llm, tg):
    """Only a model that answers with an unusable summary is taken as unable to summarise: a
    rate limit and an outage in a row kept the messages, as any failure of the endpoint does."""
    judges_say_done(llm)
    await seed_history(tmp_path, 24)
    llm.push(text("[]"), when=is_flush)
    llm.push(error(429, "rate limited, try again in 20s"), when=is_summary)  # between turns 1 and 2
    llm.push(say("answer one"), when=is_loop)
    llm.push(error(503, "model loading"), when=is_summary)  # between turns 2 and 3
    llm.push(say("answer two"), when=is_loop)
    llm.push(say("answer three"), when=is_loop)
    llm.push(text(SUMMARY), when=is_summary)  # the endpoint is fine again
    async with running(compaction_config(tmp_path, llm, tg)) as d:
        await turns_between_compactions(d, tg, ["first", "second", "third"])
    third = loop_requests(llm)[2]
    summary = [m["content"] for m in third["messages"] if m["content"].startswith(SUMMARY_HEADER)]
    assert not (summary and "the model could not summarise" in summary[0]), (
        "two transient endpoint errors replaced the middle by an extractive summary:\n" + summary[0][:400]
    )


async def test_a_retry_after_a_run_whose_flush_failed_too_flushes(tmp_path, llm, tg):
    """The retry skipped the flush because "the failed run flushed those messages"; but when
    the endpoint was down, the failed run's flush had failed as well: the facts were lost."""
    judges_say_done(llm)
    await seed_history(tmp_path, 24)
    llm.push(error(503, "down"), when=is_flush)
    llm.push(error(503, "down"), when=is_summary)
    llm.push(say("answer one"), when=is_loop)
    llm.push(text('[{"title": "Pets", "body": "The user has a cat called Miso."}]'), when=is_flush)
    llm.push(text(SUMMARY), when=is_summary)
    llm.push(say("answer two"), when=is_loop)
    async with running(compaction_config(tmp_path, llm, tg)) as d:
        await turns_between_compactions(d, tg, ["first", "second"])
        knowledge = Memory(d.settings.data_dir).of(f"telegram:{CHAT}").path
        saved = knowledge.read_text() if knowledge.exists() else ""
    flushes = [r for r in llm.requests if is_flush(r)]
    assert len(flushes) == 2, f"{len(flushes)} flush request(s): the retry did not flush after a failed flush"
    assert "## Pets" in saved


async def test_a_waiting_person_gets_first_words_before_the_compaction(tmp_path, llm, tg):
    """Over the threshold but within the window: the turn's first step is sent without
    compacting; the step after the first words compacts (a slow model's summaries took up to
    a minute each, all before the person saw anything)."""
    judges_say_done(llm)
    await seed_history(tmp_path, 24)
    llm.push(say("right away", end=False), when=is_loop)
    llm.push(text("[]"), when=is_flush)
    llm.push(text(SUMMARY), when=is_summary)
    llm.push(tool_calls(("end_turn", {})), when=is_loop)
    async with running(compaction_config(tmp_path, llm, tg)) as d:
        tg.push_text("hello", chat_id=CHAT)
        await d.engine.wait_for_turns(1)
    kinds = request_kinds(llm)
    assert kinds.index("loop") < kinds.index("flush") < kinds.index("summary")
    second = loop_requests(llm)[1]
    assert any(m["content"].startswith(SUMMARY_HEADER) for m in second["messages"])
    assert tg.sent(CHAT) == ["right away"]


async def test_a_message_stops_the_compaction_between_turns_before_its_next_model_call(tmp_path, llm, tg):
    """The request in flight is answered first (llama-cpp-python would go on with an abandoned
    one anyway), then the run stops: no summary is asked before the message's turn."""
    judges_say_done(llm)
    await seed_history(tmp_path, 24)
    release, asked = asyncio.Event(), asyncio.Event()
    llm.push(say("one"), when=is_loop)
    llm.push(held(text("[]"), asked, release), when=is_flush)
    llm.default = lambda r: text(SUMMARY) if is_summary(r) else text("[]") if is_flush(r) else say("two") if is_loop(r) else text("DONE: ok")
    async with running(compaction_config(tmp_path, llm, tg)) as d:
        tg.push_text("first", chat_id=CHAT)
        await d.engine.wait_for_turns(1)
        await asyncio.wait_for(asked.wait(), 10)  # the compaction between turns waits on its flush
        tg.push_text("second", chat_id=CHAT)
        await d.engine.wait_until(lambda: d.engine.progress.accepted >= 2)
        release.set()
        await d.engine.wait_for_turns(2)
        await d.engine.wait_until(lambda: d.engine.settled)  # the next chance compacts
    kinds = request_kinds(llm)
    kinds = [k for k in kinds if k != "judge"]
    assert kinds[:3] == ["loop", "flush", "loop"]  # no summary between the flush and the message's turn
    assert "summary" in kinds[3:]
    assert tg.sent(CHAT) == ["one", "two"]
    assert "old question 15" in contents(loop_requests(llm)[1])  # the stopped run dropped nothing
    db = sqlite3.connect(tmp_path / "data" / "bumblebot.db")
    assert db.execute("SELECT failures FROM compaction").fetchall() in ([], [(0,)])  # a stop is no failure


async def test_stop_stops_the_compaction_between_turns(tmp_path, llm, tg):
    """/stop and /reset left it summarising, the model busy, "nothing to stop" answered."""
    judges_say_done(llm)
    await seed_history(tmp_path, 24)
    release, asked = asyncio.Event(), asyncio.Event()
    llm.push(say("one"), when=is_loop)
    llm.push(held(text("[]"), asked, release), when=is_flush)
    llm.default = lambda r: text(SUMMARY) if is_summary(r) else text("DONE: ok")
    async with running(compaction_config(tmp_path, llm, tg)) as d:
        tg.push_text("first", chat_id=CHAT)
        await d.engine.wait_for_turns(1)
        await asyncio.wait_for(asked.wait(), 10)
        tg.push_text("/stop", chat_id=CHAT)
        await tg.wait_for("sendMessage", n=2)
        release.set()
        await d.engine.wait_until(lambda: d.engine.settled)
    assert not [r for r in llm.requests if is_summary(r)]  # stopped before its summary


async def test_a_stop_of_the_engine_abandons_the_compaction_between_turns(tmp_path, llm, tg, caplog):
    """Nobody waits for it: the shutdown does not sit out its grace for a summary."""
    judges_say_done(llm)
    await seed_history(tmp_path, 24)
    asked, never = asyncio.Event(), asyncio.Event()
    llm.push(say("one"), when=is_loop)
    llm.push(text("[]"), when=is_flush)
    llm.push(held(text(SUMMARY), asked, never), when=is_summary)
    config = write_config(tmp_path, llm, tg, engine={"shutdown_grace_s": 120}, cognition={
        "classifier": False, "max_context_tokens": 8000,
        "history_compression": {"compaction_threshold_ratio": 0.75, "compaction_target_ratio": 0.4},
    })
    async with running(config) as d:
        tg.push_text("first", chat_id=CHAT)
        await d.engine.wait_for_turns(1)
        await asyncio.wait_for(asked.wait(), 10)
    assert "did not finish in time" not in caplog.text  # it ended at once, not cancelled after the grace
    assert tg.sent(CHAT) == ["one"]


async def test_one_huge_tool_result_is_capped_and_the_session_goes_on(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(tool_calls(("read_file", {"path": "big.txt"})), when=is_loop)
    llm.push(say("it is big"), when=is_loop)
    llm.push(say("still here"), when=is_loop)
    async with running(compaction_config(tmp_path, llm, tg, enabled=False)) as d:
        (d.settings.workspace / "big.txt").write_text("HEAD " + "x" * 60_000 + " TAIL")
        tg.push_text("read big.txt", chat_id=CHAT)
        await tg.wait_for("sendMessage")
        tg.push_text("and now?", chat_id=CHAT)
        await tg.wait_for("sendMessage", n=2)
    second = loop_requests(llm)[1]
    result = [m for m in second["messages"] if m["role"] == "tool"][0]["content"]
    assert len(result) <= int(0.25 * 8000 * 4)
    assert tg.sent(CHAT) == ["it is big", "still here"]


async def test_context_length_refusal_compacts_and_retries_once(tmp_path, llm, tg):
    judges_say_done(llm)
    await seed_history(tmp_path, 14)  # under the threshold: only the refusal triggers compaction
    llm.push(error(400, "This model's maximum context length is 4096 tokens"), when=is_loop)
    llm.push(text("[]"), when=is_flush)
    llm.push(text(SUMMARY), when=is_summary)
    llm.push(say("fits now"), when=is_loop)
    async with running(compaction_config(tmp_path, llm, tg)) as d:
        tg.push_text("hello", chat_id=CHAT)
        await tg.wait_for("sendMessage")
        await d.engine.wait_for_turns(1)
    assert tg.sent(CHAT) == ["fits now"]
    retry = loop_requests(llm)[1]
    assert any(m["content"].startswith(SUMMARY_HEADER) for m in retry["messages"])


async def test_a_request_refused_as_too_long_is_not_what_the_next_one_is_measured_against(tmp_path, llm, tg):
    """Regression: the trace's ``repeated`` kept the refused request as the previous one, so
    the next turn, sent after the compaction, was measured against a request no cache holds."""
    judges_say_done(llm)
    await seed_history(tmp_path, 14)
    llm.push(error(400, "maximum context length exceeded"), when=is_loop)  # no smaller window to learn
    llm.push(text("[]"), when=is_flush)
    llm.push(text(SUMMARY), when=is_summary)
    llm.push(say("fits now"), when=is_loop)
    llm.push(say("still here"), when=is_loop)
    async with running(compaction_config(tmp_path, llm, tg)) as d:
        tg.push_text("hello", chat_id=CHAT)
        await d.engine.wait_for_turns(1)
        tg.push_text("are you there?", chat_id=CHAT)
        await d.engine.wait_for_turns(2)
        traces = [t["trace"] for t in reversed(await d.store.recent_turns(limit=2))]
    assert tg.sent(CHAT) == ["fits now", "still here"]
    assert traces[0]["steps"][0]["repeated"] is None  # the first answered here
    assert traces[1]["steps"][0]["repeated"] >= 0.95  # all of the compacted request it follows


async def test_second_refusal_tells_the_user_plainly(tmp_path, llm, tg):
    """A new conversation refused twice: nothing was compacted, so the note speaks of the
    message, never of "even after compacting it" (nor of /reset, which cannot help)."""
    judges_say_done(llm)
    llm.push(error(400, "maximum context length exceeded"), when=is_loop)
    llm.push(error(400, "maximum context length exceeded"), when=is_loop)
    async with running(compaction_config(tmp_path, llm, tg)) as d:
        tg.push_text("hello", chat_id=CHAT)
        await tg.wait_for("sendMessage")
        await d.engine.wait_for_turns(1)
        rows = await d.store._all("SELECT role, content FROM messages")
    assert tg.sent(CHAT) == [TOO_LONG_MESSAGE]
    assert [tuple(r)[0] for r in rows] == ["user", "assistant"]  # the message is kept,
    assert rows[0][1] == "hello" and rows[1][1] == TOO_LONG_MESSAGE  # and so is what the user was told


async def test_a_compacted_conversation_refused_again_says_so(tmp_path, llm, tg):
    """The refusal forced a compaction (a summary was made) and the retry was refused too:
    "even after compacting it" is true, and /reset can help."""
    judges_say_done(llm)
    await seed_history(tmp_path, 14)
    llm.push(error(400, "maximum context length exceeded"), when=is_loop)
    llm.push(text("[]"), when=is_flush)
    llm.push(text(SUMMARY), when=is_summary)
    llm.push(error(400, "maximum context length exceeded"), when=is_loop)
    async with running(compaction_config(tmp_path, llm, tg)) as d:
        tg.push_text("hello", chat_id=CHAT)
        await tg.wait_for("sendMessage")
        await d.engine.wait_for_turns(1)
    assert tg.sent(CHAT) == [TOO_LONG]


async def test_status_and_compact_commands(tmp_path, llm, tg):
    judges_say_done(llm)
    await seed_history(tmp_path, 14)
    llm.push(text("[]"), when=is_flush)
    llm.push(text(SUMMARY), when=is_summary)
    async with running(compaction_config(tmp_path, llm, tg)):
        tg.push_text("/status", chat_id=CHAT)
        await tg.wait_for("sendMessage")
        tg.push_text("/compact", chat_id=CHAT)
        await tg.wait_for("sendMessage", n=3)  # an acknowledgement, then the report
        tg.push_text("/status", chat_id=CHAT)
        await tg.wait_for("sendMessage", n=4)
    before, ack, compacted, after = tg.sent(CHAT)
    assert ack.startswith("Compacting")
    assert "of 8000 tokens" in before and "Summary: none" in before and "compactions so far: 0" in before
    assert compacted.startswith("Compacted:")
    assert "Summary: yes" in after and "compactions so far: 1" in after
    assert not [r for r in llm.requests if is_loop(r)]  # commands never start a turn


def limited(config, **limits):
    """``config`` with ``limits`` set."""
    data = yaml.safe_load(config.read_text())
    data["limits"] = limits
    config.write_text(yaml.safe_dump(data))
    return config


async def test_compact_refused_by_a_limit_names_it_and_when_it_resets(tmp_path, llm, tg):
    judges_say_done(llm)
    await seed_history(tmp_path, 14)
    async with Store(tmp_path / "data" / "bumblebot.db") as store:
        await store.add_usage(utc_day(time.time()), Scope(conversation=f"telegram:{CHAT}", sender=str(CHAT), kind="turn"),
                              Usage("u", "test-model", prompt=5000), None)
    async with running(limited(compaction_config(tmp_path, llm, tg), chat_daily_tokens=1000)):
        tg.push_text("/compact", chat_id=CHAT)
        await tg.wait_for("sendMessage", n=2)
    ack, report = tg.sent(CHAT)
    assert ack.startswith("Compacting") and llm.requests == []
    assert report.startswith("A spending limit stops me here: this chat's daily limit of 1,000 tokens has been reached.")
    assert "It resets at 00:00 UTC, in " in report


async def test_compact_is_counted_for_and_limited_by_the_person_who_sent_it(tmp_path, llm, tg):
    judges_say_done(llm)
    await seed_history(tmp_path, 14)
    llm.push(text("[]"), when=is_flush)
    llm.push(text(SUMMARY), when=is_summary)
    async with running(limited(compaction_config(tmp_path, llm, tg), sender_daily_tokens=100_000)) as d:
        tg.push_text("/compact", chat_id=CHAT)
        await tg.wait_for("sendMessage", n=2)
        await d.store.add_usage(utc_day(time.time()), Scope(conversation=f"telegram:{CHAT}", sender=str(CHAT), kind="turn"),
                                Usage("u", "test-model", prompt=100_000), None)
        tg.push_text("/compact", chat_id=CHAT)
        await tg.wait_for("sendMessage", n=4)
    _, compacted, _, refused = tg.sent(CHAT)
    assert compacted.startswith("Compacted:") and "your daily limit of 100,000 tokens" in refused
    rows = sqlite3.connect(tmp_path / "data" / "bumblebot.db").execute(
        "SELECT sender, background, requests FROM usage WHERE kind = 'summary'").fetchall()
    assert rows == [(str(CHAT), 0, 2)]  # the flush and the summary


async def test_compact_says_when_the_model_could_not_summarise(tmp_path, llm, tg):
    """The report said "N messages summarised" when their summary was only their first words."""
    judges_say_done(llm)
    await seed_history(tmp_path, 14)
    llm.push(text("[]"), when=is_flush)
    llm.default = lambda r: text("You can use a JSON array to store the data.") if is_summary(r) else text("[]")
    async with running(compaction_config(tmp_path, llm, tg)):
        tg.push_text("/compact", chat_id=CHAT)
        await tg.wait_for("sendMessage", n=2)
        tg.push_text("/compact", chat_id=CHAT)
        await tg.wait_for("sendMessage", n=4)
    _, failed, _, extracted = tg.sent(CHAT)
    assert failed.startswith("Compaction failed")
    assert extracted.startswith("Compacted:") and "the model could not summarise: their start was kept" in extracted


async def test_a_compaction_in_a_turn_shows_what_its_summaries_used_in_the_trace(tmp_path, llm, tg):
    judges_say_done(llm)
    await seed_history(tmp_path, 24, tool_every=4)
    llm.push(text("[]", usage={"prompt_tokens": 3000, "completion_tokens": 2}), when=is_flush)
    llm.push(text(SUMMARY, usage={"prompt_tokens": 3100, "completion_tokens": 120}), when=is_summary)
    llm.push(say("Miso, of course"), when=is_loop)
    async with running(compaction_config(tmp_path, llm, tg)) as d:
        tg.push_text("what's my cat called?", chat_id=CHAT)
        await d.engine.wait_for_turns(1)
        trace = (await d.store.recent_turns())[0]["trace"]
    used = trace["compactions"][0]["usage"]
    assert (used["requests"], used["prompt"], used["completion"], used["estimated"]) == (2, 6100, 122, False)


async def test_old_long_tool_results_are_pruned_in_the_prompt_but_kept_in_the_database(tmp_path, llm, tg):
    judges_say_done(llm)
    await seed_history(tmp_path, 24, tool_every=2)
    llm.push(text("[]"), when=is_flush)
    llm.push(text(SUMMARY), when=is_summary)
    llm.push(say("ok"), when=is_loop)
    async with running(compaction_config(tmp_path, llm, tg, compaction_target_ratio=0.6)) as d:
        tg.push_text("hi", chat_id=CHAT)
        await tg.wait_for("sendMessage")
        await d.engine.wait_for_turns(1)
    db = sqlite3.connect(tmp_path / "data" / "bumblebot.db")
    pruned = db.execute("SELECT content FROM messages WHERE pruned = 1").fetchall()
    covered = db.execute("SELECT COUNT(*) FROM messages WHERE covered_by IS NOT NULL").fetchone()[0]
    assert covered > 0
    assert all(c[0].startswith("file ") for c in pruned)  # originals kept for audit
    main = loop_requests(llm)[0]["messages"]
    tool_contents = [m["content"] for m in main if m["role"] == "tool"]
    assert tool_contents and all(c == PLACEHOLDER or c.startswith("file ") for c in tool_contents)
    assert not llm.violations


async def test_a_small_window_does_not_compact_on_every_turn(tmp_path, llm, tg):
    """Regression: at 4096 tokens the fixed prompt plus the protected tail kept the estimate at
    the threshold, so every turn paid a flush and a summary call for two new messages."""
    judges_say_done(llm)
    await seed_history(tmp_path, 8, filler=300)

    def aux(request):
        if is_flush(request):
            return text("[]")
        if is_summary(request):
            return text(SUMMARY)
        return text("DONE: ok")

    llm.default = lambda r: aux(r) if is_aux(r) else say("ok")
    config = write_config(
        tmp_path, llm, tg, cognition={"classifier": False, "max_context_tokens": 4096}
    )
    async with running(config) as d:
        for i in range(8):
            tg.push_text(f"message number {i} " + "z" * 300, chat_id=CHAT)
            await d.engine.wait_for_turns(i + 1)
    summaries = [r for r in llm.requests if is_summary(r)]
    assert len(summaries) in (1, 2, 3), len(summaries)  # not one per turn


async def test_compaction_learns_from_reported_prompt_tokens(tmp_path, llm, tg):
    """Dense text (CJK, code) has more tokens than len // 4: the endpoint's usage corrects it."""
    import json as _json

    from fakes.openai_server import Reply

    judges_say_done(llm)
    await seed_history(tmp_path, 10)  # under the threshold by our estimate

    def dense(text_to_say):
        def reply(request):
            message = {"role": "assistant", "content": None, "tool_calls": [
                {"id": f"d{len(llm.requests)}", "type": "function",
                 "function": {"name": "say", "arguments": _json.dumps({"text": text_to_say})}},
                {"id": f"e{len(llm.requests)}", "type": "function", "function": {"name": "end_turn", "arguments": "{}"}},
            ]}
            tokens = len(_json.dumps(request)) // 4 * 4  # the endpoint counts 4x our estimate
            return Reply(body={
                "id": "x", "object": "chat.completion", "created": 0, "model": request["model"],
                "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls"}],
                "usage": {"prompt_tokens": tokens, "completion_tokens": 5, "total_tokens": tokens + 5},
            })
        return reply

    llm.push(dense("one"), when=is_loop)
    llm.push(text("[]"), when=is_flush)
    llm.push(text(SUMMARY), when=is_summary)
    llm.push(dense("two"), when=is_loop)
    async with running(compaction_config(tmp_path, llm, tg)) as d:
        tg.push_text("first", chat_id=CHAT)
        await d.engine.wait_for_turns(1)
        assert not [r for r in llm.requests if is_summary(r)]  # nothing to learn from yet
        tg.push_text("second", chat_id=CHAT)
        await d.engine.wait_for_turns(2)
        await d.engine.wait_until(lambda: d.engine.settled)
        scale = d.budget.scale
    assert scale > 1.5
    assert [r for r in llm.requests if is_summary(r)]  # compacted in time: between the turns
    assert tg.sent(CHAT) == ["one", "two"]


def _blocks(request) -> str:
    """The [Turn context] blocks of a request's user messages, joined."""
    texts = [m["content"] if isinstance(m["content"], str) else "" for m in request["messages"] if m["role"] == "user"]
    return "".join(re.match(r"\[Turn context\]\n.*?\n---\n", t, re.S).group() for t in texts if t.startswith("[Turn context]"))


@pytest.mark.parametrize("protect_first_n", [2, 0])
async def test_the_turn_that_compacts_still_shows_its_speaker_platform_and_facts(tmp_path, llm, tg, protect_first_n):
    """Regression: the turn whose request crossed the threshold had its [Turn context] built
    before the compaction, leaving out what the blocks it then summarised showed: the rest of
    that turn went without the facts and its speaker (in a group the only Speaking line left
    named someone else; with no protected head, without Platform and Speaking at all)."""
    summary = "\n".join(f"## {h}\n- small talk" for h in SUMMARY_HEADINGS)

    def reply(request):
        if is_aux(request):
            return text(summary if is_summary(request) else "[]" if is_flush(request) else "DONE: ok")
        return tool_calls(("say", {"text": "ok"}), ("end_turn", {}))

    llm.default = reply
    config = write_config(tmp_path, llm, tg, telegram={"respond_in_groups": "always"}, cognition={
        "max_context_tokens": 8000, "history_compression": {"compaction_protect_first_n": protect_first_n},
    })
    facts = Memory(tmp_path / "data").of("telegram:-500")
    group = dict(chat_id=-500, chat_type="group")
    compacted = 0
    async with running(config) as d:
        tg.push_text("hello all", user_id=7, first_name="Ann", **group)
        await d.engine.wait_for_turns(1)
        facts.append_sections([("Birthday", "Bob's birthday is on 4 May.")])  # as `remember` adds it
        filler = " ".join(["lorem ipsum dolor sit amet"] * 60)
        for n in range(2, 12):
            before = len(llm.requests)
            tg.push_text(f"turn {n} {filler}", user_id=8, first_name="Bob", **group)
            await d.engine.wait_for_turns(n)
            compacted += any(is_summary(r) for r in llm.requests[before:])
            seen = _blocks(loop_requests(llm)[-1])
            assert "Bob's birthday is on 4 May." in seen, f"turn {n}: {seen}"
            assert re.findall(r"Speaking: (\w+)", seen)[-1] == "Bob", f"turn {n}: {seen}"
            assert "Platform: telegram, group chat" in seen, f"turn {n}: {seen}"
    assert compacted >= 1  # some turn compacted on its way


async def test_the_console_reads_the_next_line_while_the_compaction_between_turns_runs(tmp_path, llm):
    """``bumblebot chat`` waits for the engine to be idle before it reads the next line: a
    compaction between turns counted as work, so the prompt stayed hidden until its summary
    was written, and nothing typed could stop it."""
    from adapters.console import ConsoleAdapter
    from bumblebot.app.cli import Daemon
    from bumblebot.core.config import Secrets, load_settings
    from bumblebot.core.entity import load_entity

    config = write_config(tmp_path, llm, None, cognition={
        "classifier": False, "max_context_tokens": 8000,
        "history_compression": {"compaction_threshold_ratio": 0.75, "compaction_target_ratio": 0.4}})
    chat = ChatRef(Platform.CONSOLE, "local:tester")
    async with Store(tmp_path / "data" / "bumblebot.db") as store:  # the seed of seed_history, in the console
        conversation = await store.conversation(chat)
        messages = []
        for i in range(24):
            messages.append(Message(role="user", content=f"old question {i} " + "q" * 400))
            messages.append(Message(role="assistant", content=f"old answer {i} " + "a" * 400))
        await store.import_history(conversation, messages)

    release, asked = asyncio.Event(), asyncio.Event()
    llm.push(say("one"), when=is_loop)
    llm.push(held(text("[]"), asked, release), when=is_flush)  # a slow local model reading the conversation
    llm.default = lambda r: text(SUMMARY) if is_summary(r) else say("two") if is_loop(r) else text("DONE: ok")

    settings = load_settings(config)
    daemon = Daemon(settings, Secrets(OPENAI_API_KEY="sk-test-key-not-real-000000"), load_entity(settings.entity, config_dir=config.parent))
    r, w = os.pipe()
    stdin, out = os.fdopen(r, "r"), io.StringIO()
    try:
        engine = await daemon.open()
        console = ConsoleAdapter(engine, user="tester", stdin=stdin, stdout=out)
        daemon.adapters = [console]
        daemon.delivery.register(console)
        await engine.start({console.platform})
        engine.mark_ready()
        await console.start()
        os.write(w, b"first\n")
        await asyncio.wait_for(asked.wait(), 10)  # "one" is out; the compaction between turns waits on the model
        assert "one" in out.getvalue()
        os.write(w, b"second\n")  # the person types the next message
        try:
            await engine.wait_until(lambda: engine.progress.accepted >= 2)  # read and taken in
        finally:
            release.set()  # the flush in flight is answered; the compaction stops there
        await engine.wait_until(lambda: len(loop_requests(llm)) >= 2)
        os.write(w, b"/quit\n")
        await engine.wait_until(lambda: engine.idle, timeout=10)
        assert "two" in out.getvalue()
        asked_after = [r for r in llm.requests if is_summary(r) or is_loop(r)]
        assert is_loop(asked_after[1])  # the line's turn came before any summary
    finally:
        os.close(w)
        await daemon.stop()
