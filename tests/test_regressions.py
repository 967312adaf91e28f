"""Regression tests for bugs found in review, each with the input that failed."""

from __future__ import annotations

import asyncio
import sqlite3

from conftest import TOKEN, running, write_config
from fakes.openai_server import error, is_loop, text, tool_calls
from support import Gate, contents, judges_say_done, loop_requests, say

from bumblebot.core.adapter import Adapter
from bumblebot.core.errors import DeliveryFailed
from bumblebot.core.events import ChatKind, ChatRef, Inbound, Platform
from bumblebot.delivery import Delivery
from bumblebot.store import Store


class FlakyConsole(Adapter):
    """A console-like platform whose sends fail on demand (a real Adapter, no mock library)."""

    platform = Platform.CONSOLE

    def __init__(self, fail_on_call: set[int], crash_on_call: set[int] = frozenset()) -> None:
        self.fail_on_call = fail_on_call
        self.crash_on_call = crash_on_call
        self.calls = 0
        self.sent: list[str] = []

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def chunks(self, text: str) -> list[str]:
        return text.split("|")

    async def send_chunk(self, chat: ChatRef, text: str, *, key: str = "") -> str:
        self.calls += 1
        if self.calls in self.crash_on_call:
            raise asyncio.CancelledError  # the process is going down mid-message
        if self.calls in self.fail_on_call:
            raise DeliveryFailed("network down", retryable=True)
        self.sent.append(text)
        return str(self.calls)

    async def send_typing(self, chat: ChatRef) -> None: ...


def delivery_for(store: Store, adapter: FlakyConsole, attempts: int = 3) -> Delivery:
    delivery = Delivery(store, attempts=attempts)
    delivery.register(adapter)
    return delivery


async def test_retry_resumes_after_the_last_delivered_chunk(tmp_path):
    chat = ChatRef(Platform.CONSOLE, "c")
    async with Store(tmp_path / "db.sqlite") as store:
        conversation = await store.conversation(chat)
        adapter = FlakyConsole(fail_on_call=set(), crash_on_call={3})
        delivery = delivery_for(store, adapter, attempts=1)
        try:
            await delivery.send(conversation.id, chat, "one|two|three")
        except asyncio.CancelledError:
            pass
        assert adapter.sent == ["one", "two"]
        [pending] = await store.outbox_pending()
        assert pending.platform_message_ids == ["1", "2"]
        assert await delivery.retry_pending() == 1
        assert adapter.sent == ["one", "two", "three"]  # no chunk twice
        assert await store.outbox_pending() == []


async def test_sweeper_does_not_resend_a_message_being_delivered(tmp_path):
    chat = ChatRef(Platform.CONSOLE, "c")
    release = asyncio.Event()

    class Slow(FlakyConsole):
        async def send_chunk(self, chat: ChatRef, text: str, *, key: str = "") -> str:
            await release.wait()
            return await super().send_chunk(chat, text)

    async with Store(tmp_path / "db.sqlite") as store:
        conversation = await store.conversation(chat)
        adapter = Slow(fail_on_call=set())
        delivery = delivery_for(store, adapter)
        sending = asyncio.create_task(delivery.send(conversation.id, chat, "hello"))
        while not await store.outbox_pending():
            await asyncio.sleep(0)  # let the send record its outbox row
        sweep = asyncio.create_task(delivery.retry_pending())
        release.set()
        await asyncio.gather(sending, sweep)
        assert adapter.sent == ["hello"]


async def test_mid_turn_message_is_kept_when_the_model_then_fails(tmp_path, llm, tg):
    judges_say_done(llm)
    slow = Gate(tool_calls(("think", {"thought": "working"})))
    llm.push(slow, when=is_loop)
    for _ in range(2):  # refused with tool_choice=required, then again with auto
        llm.push(error(400, "bad request from the endpoint"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("start something", chat_id=3)
        await asyncio.wait_for(slow.entered.wait(), 5)
        tg.push_text("also this detail", chat_id=3)
        await d.engine.wait_until(lambda: d.engine.progress.accepted == 2)
        slow.release.set()
        await d.engine.wait_for_turns(1)
        pending = await d.store.pending_inbound()
    assert pending == []
    db = sqlite3.connect(tmp_path / "data" / "bumblebot.db")
    stored = [r[0] for r in db.execute("SELECT content FROM messages WHERE role='user' ORDER BY id")]
    assert stored == ["start something", "also this detail"]
    roles = [r[0] for r in db.execute("SELECT role FROM messages ORDER BY id")]
    assert roles == ["user", "assistant", "tool", "user", "assistant"]  # partial turn + the note
    assert "refused the request (400)" in tg.sent(3)[0]
    assert db.execute("SELECT DISTINCT status FROM journal").fetchall() == [("failed",)]


async def test_say_calls_of_one_step_arrive_in_call_order(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(tool_calls(*[("say", {"text": f"part {i}"}) for i in range(5)], ("end_turn", {})), when=is_loop)
    config = write_config(tmp_path, llm, tg, cognition={"classifier": False, "max_messages_per_turn": 5})
    async with running(config):
        tg.push_text("count to five", chat_id=4)
        await tg.wait_for("sendMessage", n=5)
    assert tg.sent(4) == [f"part {i}" for i in range(5)]


async def test_a_final_reply_that_repeats_a_say_is_neither_sent_nor_stored(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(tool_calls(("say", {"text": "the answer is 4."})), when=is_loop)
    llm.push(text("The answer is 4."), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("2+2?", chat_id=5)
        await tg.wait_for("sendMessage")
        await d.engine.wait_for_turns(1)
    db = sqlite3.connect(tmp_path / "data" / "bumblebot.db")
    assistant_texts = [r[0] for r in db.execute("SELECT content FROM messages WHERE role='assistant'")]
    assert "The answer is 4." not in assistant_texts


async def test_command_moves_the_stored_telegram_offset(tmp_path, llm, tg):
    async with running(write_config(tmp_path, llm, tg)) as d:
        update = tg.push_text("/help", chat_id=6)
        await tg.wait_for("sendMessage")
        offset = await d.store.get_kv("telegram.offset")
    assert offset == str(update["update_id"] + 1)


async def test_chat_mode_does_not_answer_pending_telegram_messages(tmp_path, llm, tg):
    """A Telegram message left pending must wait for `bumblebot run`, not be answered by `chat`."""
    from bumblebot.app.cli import Daemon
    from bumblebot.core.config import Secrets, load_settings
    from bumblebot.core.entity import load_entity

    config = write_config(tmp_path, llm, tg)
    async with Store(tmp_path / "data" / "bumblebot.db") as store:
        await store.journal(Inbound(ChatRef(Platform.TELEGRAM, "7"), "1", "7", "Al", "hello?", ChatKind.PRIVATE))
    daemon = Daemon(load_settings(config), Secrets(OPENAI_API_KEY="sk-x"), load_entity("default"))
    await daemon.start(adapters=[FlakyConsole(fail_on_call=set())])
    try:
        assert daemon.engine is not None and daemon.engine.loaded_conversations == 0
    finally:
        await daemon.stop()
    assert llm.requests == []
    async with Store(tmp_path / "data" / "bumblebot.db") as store:
        assert len(await store.pending_inbound()) == 1


async def test_message_arriving_while_stopping_is_kept_for_the_next_start(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(say("answered after restart"), when=is_loop)
    config = write_config(tmp_path, llm, tg)
    late = Inbound(ChatRef(Platform.TELEGRAM, "8"), "77", "8", "Late", "am I lost?", ChatKind.PRIVATE)
    async with running(config) as d:
        assert d.engine is not None
        d.engine._accepting = False  # what stop() does first
        d.engine._stopped = True
        assert await d.engine.submit(late)  # e.g. a Discord message during shutdown
        assert llm.requests == []
    async with running(config) as d:
        await tg.wait_for("sendMessage")
    assert tg.sent(8) == ["answered after restart"]
    assert "am I lost?" in contents(loop_requests(llm)[0])


async def test_one_upstream_hiccup_does_not_turn_tool_forcing_off(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(error(500, "upstream hiccup"), when=lambda r: is_loop(r) and r.get("tool_choice") == "required")
    llm.push(say("recovered"), when=is_loop)
    llm.push(say("still forced"), when=lambda r: is_loop(r) and r.get("tool_choice") == "required")
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("hi", chat_id=9)
        await tg.wait_for("sendMessage")
        tg.push_text("again", chat_id=9)
        await tg.wait_for("sendMessage", n=2)
        remembered = await d.store.get_kv(f"llm.tool_choice:{llm.base_url}")
    assert tg.sent(9) == ["recovered", "still forced"]
    assert remembered is None


async def test_reasoning_inside_say_arguments_is_never_delivered(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(say("<think>the user is annoying, humor them</think>Sure, happy to help!"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)):
        tg.push_text("help?", chat_id=10)
        await tg.wait_for("sendMessage")
    assert tg.sent(10) == ["Sure, happy to help!"]


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
    assert "answer to the old topic" not in tg.sent(12)  # /reset stopped it (issue 16)


async def test_a_key_echoed_by_the_endpoint_is_not_stored_in_the_trace(tmp_path, llm, tg):
    llm.push(error(401, "Incorrect API key provided: sk-test-key-not-real-000000"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("hi", chat_id=13)
        await tg.wait_for("sendMessage")
        await d.engine.wait_for_turns(1)
        trace = (await d.store.recent_turns())[0]["trace"]
    blob = (tmp_path / "data" / "bumblebot.db").read_bytes()
    wal = tmp_path / "data" / "bumblebot.db-wal"
    blob += wal.read_bytes() if wal.exists() else b""
    assert "[REDACTED]" in trace["error"]
    assert b"sk-test-key-not-real" not in blob


async def test_a_final_reply_after_say_is_delivered_as_the_model_wrote_it(tmp_path, llm, tg):
    """What the model says after its answer is its own to say: no list of "filler" phrases
    decides that a closing question is not worth sending."""
    judges_say_done(llm)
    llm.push(tool_calls(("say", {"text": "The answer is 42."})), when=is_loop)
    llm.push(text("Anything else I can help you with today?"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("how does the build pipeline in the repo work?", chat_id=14)
        await d.engine.wait_for_turns(1)
    assert tg.sent(14) == ["The answer is 42.", "Anything else I can help you with today?"]


async def test_the_same_say_twice_in_one_step_reaches_the_user_once(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(say("Hello!", "Hello!"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("hi", chat_id=20)
        await tg.wait_for("sendMessage")
        await d.engine.wait_for_turns(1)
    assert tg.sent(20) == ["Hello!"]


async def test_a_new_answer_after_a_say_is_delivered_on_endpoints_without_forcing(tmp_path, tg):
    """Regression: with tool_choice=auto the real answer came as plain text after a say and was dropped."""
    from fakes.openai_server import FakeOpenAI

    async with FakeOpenAI(reject_tool_choice_required=400) as llm:
        judges_say_done(llm)
        llm.push(tool_calls(("say", {"text": "Good question! Let me think."})), when=is_loop)
        llm.push(text("The capital of Australia is Canberra."), when=is_loop)
        async with running(write_config(tmp_path, llm, tg)):
            # deliberate ("research"): a reflex turn would end at its first say
            tg.push_text("look up the capital of Australia", chat_id=21)
            await tg.wait_for("sendMessage", n=2)
    assert tg.sent(21) == ["Good question! Let me think.", "The capital of Australia is Canberra."]


async def test_the_same_say_in_two_steps_reaches_the_user_once(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(tool_calls(("say", {"text": "Hello there!"})), when=is_loop)
    llm.push(say("hello  there!"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("Explain in detail, step by step, how the build pipeline in the repo works.", chat_id=15)  # deliberate: a reflex turn ends at its first say
        await tg.wait_for("sendMessage")
        await d.engine.wait_for_turns(1)
    assert tg.sent(15) == ["Hello there!"]
    # the second say's result tells the model why nothing was sent
    db = sqlite3.connect(tmp_path / "data" / "bumblebot.db")
    assert any("not sent again" in r[0] for r in db.execute("SELECT content FROM messages WHERE role='tool'"))


async def test_a_blocked_bot_stops_the_turn_instead_of_retrying_say(tmp_path, llm, tg):
    judges_say_done(llm)
    for _ in range(4):
        llm.push(tool_calls(("say", {"text": "are you there?"})), when=is_loop)
    tg.fail_next("sendMessage", 403, {"ok": False, "error_code": 403, "description": "Forbidden: bot was blocked by the user"})
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("hi", chat_id=16)
        await d.engine.wait_for_turns(1)
        trace = (await d.store.recent_turns())[0]["trace"]
    assert len([c for c in tg.calls if c.method == "sendMessage"]) == 1
    assert len(loop_requests(llm)) == 1 and trace["stop_reason"] == "undeliverable"


async def test_a_server_that_reuses_tool_call_ids_still_works(tmp_path, llm, tg):
    """llama.cpp-style: every tool call carries the same id, within and across turns."""
    judges_say_done(llm)
    llm.push(tool_calls(("read_file", {"path": "a.txt"}, "SAMEID123")), when=is_loop)
    llm.push(tool_calls(("read_file", {"path": "b.txt"}, "SAMEID123")), when=is_loop)
    llm.push(tool_calls(("say", {"text": "a says A, b says B"}, "SAMEID123"), ("end_turn", {}, "SAMEID123")), when=is_loop)
    llm.push(tool_calls(("say", {"text": "again"}, "SAMEID123"), ("end_turn", {}, "SAMEID123")), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        (d.settings.workspace / "a.txt").write_text("A")
        (d.settings.workspace / "b.txt").write_text("B")
        tg.push_text("compare a.txt and b.txt", chat_id=17)
        await tg.wait_for("sendMessage")
        tg.push_text("once more", chat_id=17)
        await tg.wait_for("sendMessage", n=2)
    third = loop_requests(llm)[2]
    results = [m["content"] for m in third["messages"] if m["role"] == "tool"]
    assert any("A" in r for r in results) and any("B" in r for r in results)  # both results seen
    ids = [c["id"] for r in [loop_requests(llm)[3]] for m in r["messages"] for c in m.get("tool_calls") or ()]
    assert len(ids) == len(set(ids))
    assert tg.sent(17) == ["a says A, b says B", "again"]
    assert not llm.violations


async def test_parallel_big_tool_results_cannot_lock_the_conversation(tmp_path, llm, tg):
    """Four 10 kB files read in one step used to overflow every later request."""
    judges_say_done(llm)
    llm.push(tool_calls(*[("read_file", {"path": f"f{i}.txt"}) for i in range(4)]), when=is_loop)
    llm.push(say("read them"), when=is_loop)
    llm.push(say("still talking"), when=is_loop)
    config = write_config(tmp_path, llm, tg, cognition={"classifier": False, "max_context_tokens": 8192})
    async with running(config) as d:
        for i in range(4):
            (d.settings.workspace / f"f{i}.txt").write_text(str(i) * 10_000)
        tg.push_text("read all four files", chat_id=18)
        await tg.wait_for("sendMessage")
        tg.push_text("and now?", chat_id=18)
        await tg.wait_for("sendMessage", n=2)
    step_results = [m["content"] for m in loop_requests(llm)[1]["messages"] if m["role"] == "tool"]
    assert sum(len(r) for r in step_results) <= int(0.25 * 8192 * 4)
    assert tg.sent(18) == ["read them", "still talking"]


async def test_a_tail_that_alone_overflows_is_pruned_after_a_refusal(tmp_path, llm, tg):
    """Big tool results inside the protected tail: the refusal path must clear them too."""
    import json as _json

    judges_say_done(llm)
    limit_chars = 30_000

    def endpoint(request):
        if len(_json.dumps(request["messages"])) > limit_chars:
            return error(400, "This model's maximum context length is 8192 tokens")
        return say("fits again")

    async with Store(tmp_path / "data" / "bumblebot.db") as store:
        conversation = await store.conversation(ChatRef(Platform.TELEGRAM, "19"))
        calls = [{"id": f"c{i}", "type": "function", "function": {"name": "read_file", "arguments": "{}"}} for i in range(3)]
        from bumblebot.core.messages import Message

        history = [Message(role="user", content="read the logs"), Message(role="assistant", content="", tool_calls=calls)]
        history += [Message(role="tool", content="L" * 9000, tool_call_id=f"c{i}", name="read_file") for i in range(3)]
        history += [Message(role="assistant", content="done")]
        await store.import_history(conversation, history)
    for _ in range(3):
        llm.push(endpoint, when=is_loop)
    config = write_config(tmp_path, llm, tg, cognition={"classifier": False, "max_context_tokens": 8192})
    async with running(config):
        tg.push_text("hello again", chat_id=19)
        await tg.wait_for("sendMessage")
    assert tg.sent(19) == ["fits again"]


async def test_a_short_api_key_does_not_break_saving_turns(tmp_path, llm, tg):
    """Regression: OPENAI_API_KEY=1 (fine for a local server) corrupted every trace's JSON."""
    from bumblebot.app.cli import Daemon
    from bumblebot.core.config import Secrets, load_settings
    from bumblebot.core.entity import load_entity

    judges_say_done(llm)
    llm.push(say("first answer"), when=is_loop)
    config = write_config(tmp_path, llm, tg)
    daemon = Daemon(load_settings(config), Secrets(TELEGRAM_BOT_TOKEN=TOKEN, OPENAI_API_KEY="1"), load_entity("default"))
    await daemon.start()
    try:
        tg.push_text("hi 1 null true", chat_id=22)
        await tg.wait_for("sendMessage")
        await daemon.engine.wait_for_turns(1)
        pending = await daemon.store.pending_inbound()
        trace = (await daemon.store.recent_turns())[0]["trace"]
    finally:
        await daemon.stop()
    assert pending == [] and trace["stop_reason"] == "end_turn"


async def test_unreadable_knowledge_bytes_do_not_silence_the_bot(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(say("still answering"), when=is_loop)
    config = write_config(tmp_path, llm, tg)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "knowledge.md").write_bytes(b"# Knowledge\n\n## Caf\xe9\nLatin-1 edit\n")
    async with running(config) as d:
        tg.push_text("hi", chat_id=24)
        await tg.wait_for("sendMessage")
        await d.engine.wait_for_turns(1)
        pending = await d.store.pending_inbound()
    assert tg.sent(24) == ["still answering"] and pending == []


async def test_a_lone_surrogate_in_a_message_neither_blocks_intake_nor_is_lost(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(say("got the odd one"), when=lambda r: is_loop(r) and "bad" in contents(r))
    llm.push(say("hello other"), when=lambda r: is_loop(r) and "normal" in contents(r))
    async with running(write_config(tmp_path, llm, tg)):
        tg.push_text("bad \ud83d text", chat_id=25)
        tg.push_text("normal message", chat_id=26)
        await tg.wait_for("sendMessage", n=2)
    assert tg.sent(25) == ["got the odd one"] and tg.sent(26) == ["hello other"]


async def test_the_sweeper_rechecks_a_row_before_sending_it(tmp_path):
    """Regression: a stale list of pending rows let the sweeper resend a row sent meanwhile."""
    chat = ChatRef(Platform.CONSOLE, "c")
    async with Store(tmp_path / "db.sqlite") as store:
        conversation = await store.conversation(chat)
        adapter = FlakyConsole(fail_on_call={1})
        delivery = delivery_for(store, adapter, attempts=1)
        first = await delivery.send(conversation.id, chat, "X")  # fails: left pending
        assert first.queued
        [row] = await store.outbox_pending()
        await store.outbox_progress(row.id, status="sent", message_ids=["9"])  # sent elsewhere meanwhile
        original = store.outbox_pending

        async def stale() -> list:
            return [row]  # the sweeper's snapshot from before the send

        store.outbox_pending = stale  # type: ignore[method-assign]
        try:
            assert await delivery.retry_pending() == 0
        finally:
            store.outbox_pending = original  # type: ignore[method-assign]
        assert adapter.sent == []


async def test_a_rate_limited_say_outlasting_the_tool_timeout_is_not_cut_off(tmp_path, llm, tg):
    """Regression: the tool timeout cancelled a say waiting out a 429; the row stayed pending
    for the sweeper while the model, told it failed, said it again (delivered twice)."""
    from fakes.telegram_server import retry_after_body

    judges_say_done(llm)
    llm.push(tool_calls(("say", {"text": "Part two."})), when=is_loop)
    llm.push(say("Part two."), when=is_loop)  # what a model does when told the say failed
    tg.fail_next("sendMessage", 429, retry_after_body(2))
    config = write_config(tmp_path, llm, tg, cognition={"classifier": False, "tool_timeout_s": 1})
    async with running(config) as d:
        tg.push_text("Explain in detail, step by step, how the build pipeline in the repo works.", chat_id=27)  # deliberate: a reflex turn ends at its first say
        await d.engine.wait_for_turns(1, timeout=20)
        pending = await d.store.outbox_pending()
    result = [m["content"] for m in loop_requests(llm)[1]["messages"] if m["role"] == "tool"][0]
    assert '"delivered": true' in result
    assert pending == []
    assert [t for t in tg.sent(27)] == ["Part two.", "Part two."]  # the 429'd attempt + one delivery
    assert len([c for c in tg.calls if c.method == "sendMessage"]) == 2
