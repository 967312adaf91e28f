"""Preparing a turn (bumblebot/runtime/preparing.py): a long paste kept as a file, files that cannot be fetched."""

from __future__ import annotations

import asyncio
import json

from conftest import running, write_config
from fakes.openai_server import FakeOpenAI, error, is_aux, is_loop, text
from support import Gate, judges_say_done, loop_requests, say, telegram_parts


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


async def test_reset_while_a_photo_downloads_and_then_fails_promises_nothing(tmp_path, llm, tg, monkeypatch):
    """/reset while a photo's download hangs, then the download fails (Telegram unreachable): the
    set-aside message is not postponed, and the chat is not told "I'll answer as soon as I can",
    which would never happen. (The download is held, then fails, by a stand-in for it.)"""
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


async def test_a_long_paste_is_measured_against_the_window_the_scale_learned():
    """A 40,000-character CJK paste is about 10,000 estimated tokens; with the scale learned
    for such text (4) the window holds 8,192 of them, so the paste must become a file. It was
    measured against the raw window (32,768 tokens) and went to the endpoint whole."""
    import types

    from bumblebot.cognition.budget import ContextBudget
    from bumblebot.core.events import ChatRef, Inbound, Platform
    from bumblebot.runtime.preparing import TurnPreparer
    from bumblebot.store import JournalEntry

    budget = ContextBudget(32768, 0.75, reply_tokens=2048)
    budget.scale = 4.0

    class Media:
        async def keep_long_text(self, entries: list[JournalEntry], text: str) -> list[str]:
            return ["kept as a file"]

    entry = JournalEntry(
        id=1, inbound=Inbound(chat=ChatRef(Platform.TELEGRAM, "1"), message_id="1", sender_id="1", sender_name="a",
                              text="漢" * 40000),
        status="pending", turn_id=None,
    )
    preparer = types.SimpleNamespace(window=budget, media=Media())
    assert await TurnPreparer.fold_long(preparer, [entry]) == ["kept as a file"]  # type: ignore[arg-type]


async def test_a_paste_steered_into_a_running_turn_is_kept_as_a_file_when_a_refusal_teaches_the_window(tmp_path, tg):
    """A server telling its window nowhere (llama-cpp-python, 4096): a 27 KB paste that arrives
    while the turn's first step is answered is taken into the turn whole (the window was not
    known); the next request is refused, teaching 4096. The paste is then kept as a file and
    answered; it was left in the turn and the turn ended, the paste unread ("context full")."""
    paste = "\n".join(f"line {i:04d}: " + "the quick brown fox jumps over the lazy dog, again and again. "
                      for i in range(370))
    async with FakeOpenAI(context_window=4096, tells_window=None, context_error="openai") as llm:
        judges_say_done(llm)
        gate = Gate(say("Hello! Go ahead.", end=False))
        llm.push(gate, when=is_loop)
        llm.default = lambda r: text("DONE: the reply is adequate") if is_aux(r) else say("Got your text.")
        async with running(write_config(tmp_path, llm, tg)) as d:
            tg.push_text("hi, I will paste my notes", chat_id=50)
            await asyncio.wait_for(gate.entered.wait(), 20)
            tg.push_text(paste, chat_id=50)
            await d.engine.wait_until(lambda: d.engine.progress.accepted >= 2)
            gate.release.set()
            await d.engine.wait_for_turns(1, timeout=30)
    assert tg.sent(50) == ["Hello! Go ahead.", "Got your text."]
    kept = list((tmp_path / "data" / "workspace" / "inbox" / "telegram_50").glob("message-*.txt"))
    assert len(kept) == 1 and kept[0].read_text() == paste
    last = [m["content"] for m in loop_requests(llm)[-1]["messages"] if m["role"] == "user"]
    assert f'read_file("inbox/telegram_50/{kept[0].name}")' in last[-1] and "line 0369" not in last[-1]
    assert len(llm.context_refused) == 1  # the one that taught the window
