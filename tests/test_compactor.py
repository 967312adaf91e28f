"""When compaction runs (bumblebot/cognition/compactor.py): chats and long tool turns keep fitting a small window."""

from __future__ import annotations

import json
from typing import Any

from conftest import running, write_config
from fakes.openai_server import Reply, error, is_aux, is_loop, text, tool_calls
from support import chatty as _chatty
from support import contents, judges_say_done, say, tokenizer_fake

from bumblebot.core.events import ChatRef, Platform
from bumblebot.store import Store


def window_fake(window: int, reply: Any) -> Any:
    """An endpoint with a ``window``-token context (our estimate of its request, prompt plus
    ``max_tokens``, as vLLM and llama.cpp count): bigger requests get the 400 a real server
    sends; the others get ``reply(request)``."""

    def endpoint(request: dict[str, Any]) -> Reply:
        prompt = len(json.dumps(request["messages"])) // 4 + len(json.dumps(request.get("tools", []))) // 4
        if prompt + int(request.get("max_tokens", 0)) > window:
            return error(400, f"This model's maximum context length is {window} tokens")
        return reply(request)

    return endpoint


async def test_ten_turns_at_a_4096_window_keep_going(tmp_path, llm, tg):
    """Ten long turns at a 4096-token window go through compaction against a server that refuses
    anything over its window (a 4k chat once died of "too long" by the third message)."""
    from bumblebot.cognition.compaction import SUMMARY_HEADINGS

    summary = "\n".join(f"## {h}\n- the user keeps asking to be told more about it" for h in SUMMARY_HEADINGS)

    def reply(request: dict[str, Any]) -> Reply:
        if is_aux(request):
            if "durable facts" in contents(request):
                return text("[]")
            if "You compact the history" in contents(request):
                return text(summary)
            return text("DONE: fine")
        return say("Here is a long answer. " + "words " * 90)

    llm.default = window_fake(4096, reply)
    config = write_config(tmp_path, llm, tg, cognition={"classifier": False, "max_context_tokens": 4096})
    async with running(config) as d:
        for i in range(10):
            tg.push_text(f"question {i}: " + "tell me more about it " * 40, chat_id=91)
            await d.engine.wait_for_turns(i + 1, timeout=20)
    refused = [r for r in llm.request_log if r.status == 400]
    assert refused == [], [(len(json.dumps(r.body["messages"])) // 4, r.body.get("max_tokens"), "tools" in r.body) for r in refused]
    sent = tg.sent(91)
    assert len(sent) == 10 and all(t.startswith("Here is a long answer") for t in sent)
    assert [r for r in llm.requests if "You compact the history" in contents(r)]  # it compacted


async def test_long_messages_at_a_4096_window_keep_going(tmp_path, llm, tg):
    """1,500-2,000-character messages at a 4096-token window keep going (they once died of "too
    long": the protected head and tail left no middle to summarise)."""
    llm.default = tokenizer_fake(4096, _chatty("Nice garden! " * 20), 4.0)
    config = write_config(tmp_path, llm, tg, cognition={"classifier": False, "max_context_tokens": 4096})
    async with running(config) as d:
        for i in range(8):
            tg.push_text(f"m{i} " + ("garden tomatoes basil " * 200)[:2000], chat_id=81)
            await d.engine.wait_for_turns(i + 1, timeout=30)
    sent = tg.sent(81)
    assert len(sent) == 8 and all(t.startswith("Nice garden!") for t in sent), sent


async def test_the_turn_after_a_too_long_one_is_answered(tmp_path, llm, tg):
    """A big paste on a small window whose text the endpoint counts at 4 tokens per estimated
    one, and the turn after it, are answered: the paste is measured with that learned scale and
    kept as a file (measured against the raw window, it went whole and came back "too long"),
    and the forced compaction pass never keeps an oversized message in its protected tail."""
    llm.default = tokenizer_fake(4096, _chatty("Answer. " + "w " * 40), 4.0)
    config = write_config(tmp_path, llm, tg, cognition={"classifier": False, "max_context_tokens": 4096})
    async with running(config) as d:
        for i in range(4):
            tg.push_text(f"q{i} " + "tell me more " * 60, chat_id=87)
            await d.engine.wait_for_turns(i + 1, timeout=20)
        # under 40% of the raw window, over 40% of the window the scale leaves
        tg.push_text("big " + "lorem ipsum dolor " * 360, chat_id=87)
        await d.engine.wait_for_turns(5, timeout=30)
        tg.push_text("short follow-up", chat_id=87)
        await d.engine.wait_for_turns(6, timeout=30)
    assert tg.sent(87)[4].startswith("Answer.") and tg.sent(87)[5].startswith("Answer.")


async def test_an_eight_step_tool_turn_fits_a_32k_window(tmp_path, llm, tg):
    """A turn reading eight 16,000-character documents fits a 32k window: the turn's own older
    tool results are cleared, so every request fits (they once overflowed it). (Files and pages
    alternate: the same work tool in three steps in a row is refused by the repeat guard.)"""
    from aiohttp import web

    workspace = tmp_path / "data" / "workspace"
    workspace.mkdir(parents=True)
    for i in range(0, 8, 2):
        (workspace / f"f{i}.txt").write_text(f"file {i} line " * 1140)  # ~16,000 characters each
    app = web.Application()
    app.router.add_get("/p{n}", lambda r: web.Response(text=f"page {r.match_info['n']} text " * 1140))
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    site = f"http://127.0.0.1:{runner.addresses[0][1]}"
    steps = [tool_calls(("read_file", {"path": f"f{i}.txt"})) if i % 2 == 0
             else tool_calls(("fetch_url", {"url": f"{site}/p{i}"})) for i in range(8)]
    script = iter([*steps, say("read all eight")])
    llm.default = window_fake(32768, lambda r: next(script) if is_loop(r) else text("DONE: fine"))
    config = write_config(
        tmp_path, llm, tg, cognition={"classifier": False, "max_context_tokens": 32768},
        tools={"web": {"allow_private": True}},
    )
    async with running(config) as d:
        tg.push_text("read the eight files f0.txt to f7.txt and tell me about them", chat_id=92)
        await d.engine.wait_for_turns(1, timeout=30)
        trace = (await d.store.recent_turns())[0]["trace"]
    await runner.cleanup()
    assert [r.status for r in llm.request_log if r.status != 200] == []
    assert tg.sent(92) == ["read all eight"]
    assert any(c.get("in_turn") for c in trace["compactions"])  # its own results were cleared


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


async def test_compaction_runs_at_the_threshold_the_window_object_decided():
    """In a 4,096-token window the budget's threshold (2,764 estimated tokens, under the
    request limit) sent the compactor in, but the compaction recomputed its own (75% of the
    window, 3,072) and did nothing, writing that nothing on every request in between."""
    from bumblebot.cognition.budget import ContextBudget
    from bumblebot.cognition.compactor import Compactor, estimate
    from bumblebot.core.messages import Message
    from bumblebot.core.settings import HistoryCompression
    from bumblebot.store import CompactionState

    class Model:
        model = "m"
        calls = 0

        async def text(self, *args: object, **kwargs: object) -> str:
            Model.calls += 1
            return "## Goal\nthe summary of what was said so far " * 5

    class Memory:
        def of(self, key: str) -> None:
            return None

    class Session:  # the runtime's Session, in memory
        key = "telegram:1"

        def __init__(self, n: int) -> None:
            self.history = [Message(role=("user", "assistant")[i % 2], content="x" * 400, id=i + 1) for i in range(n)]
            self.compaction = CompactionState(None, 0, 0, 0, 0.0)
            self.summary_message = None
            self.tokens = sum(m.tokens for m in self.history)
            self.writes = 0

        async def apply_compaction(self, outcome: object, *, failed: bool, next_retry_at: float) -> None:
            self.writes += 1

        async def prune(self, history: list[Message], ids: list[int]) -> None:
            self.history = history

    budget = ContextBudget(4096, 0.75, reply_tokens=2048)
    compactor = Compactor(HistoryCompression(compaction_flush_to_knowledge=False), Model(), Memory(), budget)
    session = Session(20)
    assert budget.threshold() < estimate(session, 600, []) <= int(budget.window() * 0.75)
    entry = await compactor.maybe_compact(session, 600, [])
    assert entry is not None and entry["passes"] >= 1 and Model.calls >= 1 and session.writes == 1
