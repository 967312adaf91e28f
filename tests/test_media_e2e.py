"""Photos, voice notes, documents and files sent, end to end on Telegram: the real
python-telegram-bot and openai clients against the fakes, real SQLite, real files."""

from __future__ import annotations

import asyncio
import io
import os
import json
import re
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from conftest import running, write_config
from fakes.openai_server import image_parts, is_loop, tool_calls
from support import contents, judges_say_done, loop_requests, say, tool_results

from bumblebot.runtime.notices import BLIND


def png(width: int, height: int, color: tuple[int, int, int] = (200, 30, 30), fmt: str = "PNG") -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buffer, fmt)
    return buffer.getvalue()


def last_user(request: dict) -> dict:
    return [m for m in request["messages"] if m["role"] == "user"][-1]


async def answered(tmp_path: Path, llm: Any, tg: Any, text: str, chat_id: int) -> None:
    """Run the daemon until ``text`` sent in ``chat_id`` got a reply and its turn ended."""
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text(text, chat_id=chat_id)
        await tg.wait_for("sendMessage")
        await d.engine.wait_for_turns(1)


async def test_a_photo_with_a_caption_reaches_the_model_as_an_image_part_and_the_caption(tmp_path, llm, tg):
    llm.push(say("a red square"), when=is_loop)
    small, fitting, huge = png(90, 60), png(1200, 800), png(2560, 1706)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_photo([(90, 60, small), (1200, 800, fitting), (2560, 1706, huge)], caption="what is this?", chat_id=42)
        await tg.wait_for("sendMessage", predicate=lambda p: p.get("text") == "a red square")
        await d.engine.wait_for_turns(1)
        history = await d.store.history(1, 1)
    request = loop_requests(llm)[0]
    user = last_user(request)
    assert isinstance(user["content"], list)
    assert user["content"][0]["type"] == "text" and user["content"][0]["text"].endswith("what is this?\n[Image 1200×800]")
    urls = image_parts(request)
    assert len(urls) == 1 and urls[0].startswith("data:image/png;base64,")
    import base64

    assert base64.b64decode(urls[0].split(",", 1)[1]) == fitting  # the largest size within 1280 px, as sent
    sizes = {f.file_id: f.width for f in tg.files.values()}
    assert [sizes[i] for i in tg.get_file_calls] == [1200]  # one download, of that size only
    # the history keeps a reference to the file, never the bytes
    user_row = [m for m in history if m.role == "user"][0]
    assert user_row.images and user_row.images[0]["width"] == 1200
    stored = tmp_path / "data" / "media" / user_row.images[0]["path"]
    assert stored.read_bytes() == fitting
    db = sqlite3.connect(tmp_path / "data" / "bumblebot.db")
    assert "base64" not in " ".join(str(r) for r in db.execute("SELECT content, images FROM messages"))


async def test_an_endpoint_that_refuses_images_is_remembered_and_the_user_told_once(tmp_path, llm, tg):
    llm.reject_images()
    llm.push(say("nice caption"), when=is_loop)
    llm.push(say("again, only the words"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_photo([(320, 240, png(320, 240))], caption="look at my cat", chat_id=5)
        await tg.wait_for("sendMessage", n=2)
        await d.engine.wait_for_turns(1)
        tg.push_photo([(320, 240, png(320, 240, (0, 0, 255)))], caption="and my dog", chat_id=5)
        await tg.wait_for("sendMessage", n=3)
        await d.engine.wait_for_turns(2)
        remembered = await d.store.get_kv("llm.vision:" + llm.base_url + "|test-model")  # pictures go to llm.model
    loops = loop_requests(llm)
    assert [bool(image_parts(r)) for r in loops] == [True, False, False]  # refused, retried, then never sent
    assert "cannot see images" in contents(loops[1]) and "look at my cat" in contents(loops[1])
    assert "cannot see images" in contents(loops[2])
    assert tg.sent(5) == ["nice caption", BLIND, "again, only the words"]  # told once, after the discovery
    assert remembered and "image_url" in json.loads(remembered)["reason"]


async def test_vision_off_never_sends_an_image_and_tells_the_user_first(tmp_path, llm, tg):
    llm.push(say("a caption reply"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg, llm={"base_url": llm.base_url, "vision": "off"})) as d:
        tg.push_photo([(320, 240, png(320, 240))], caption="hello", chat_id=6)
        await tg.wait_for("sendMessage", n=2)
        await d.engine.wait_for_turns(1)
    assert not image_parts(loop_requests(llm)[0])
    assert tg.sent(6) == [BLIND, "a caption reply"]


async def test_a_voice_note_is_transcribed_once_and_the_transcript_answered(tmp_path, llm, tg):
    llm.push_transcript("remind me to buy milk")
    llm.push(say("noted: milk"), when=is_loop)
    audio = b"OggS" + b"\x00" * 200
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_voice(audio, duration=7, chat_id=9)
        await tg.wait_for("sendMessage", predicate=lambda p: p.get("text") == "noted: milk")
        await d.engine.wait_for_turns(1)
    assert len(llm.transcriptions) == 1
    sent = llm.transcriptions[0]
    assert sent["data"] == audio and sent["model"] == "whisper-1" and sent["content_type"] == "audio/ogg"
    seen = last_user(loop_requests(llm)[0])["content"]
    assert seen.endswith("[Voice message, 0:07, transcribed]: remind me to buy milk")
    assert not list((tmp_path / "data" / "workspace" / "inbox").glob("**/*.ogg"))  # nothing kept when it worked


async def test_a_voice_note_that_cannot_be_transcribed_is_kept_and_the_user_told_plainly(tmp_path, llm, tg):
    llm.push_transcript_error(404, "model 'whisper-1' not found")
    audio = b"OggS" + b"\x01" * 300
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_voice(audio, chat_id=10)
        await tg.wait_for("sendMessage")
        await d.engine.wait_for_turns(1)
    kept = list((tmp_path / "data" / "workspace" / "inbox" / "telegram_10").glob("voice-*.ogg"))
    assert len(kept) == 1 and kept[0].read_bytes() == audio
    [notice] = tg.sent(10)
    assert "couldn't transcribe your voice message" in notice and "HTTP 404" in notice
    assert f"inbox/telegram_10/{kept[0].name}" in notice
    assert llm.requests == []  # nothing else to answer: no model call


async def test_a_transcription_server_of_its_own_is_used_when_configured(tmp_path, llm, tg):
    from fakes.openai_server import FakeOpenAI

    async with FakeOpenAI() as whisper:
        whisper.push_transcript("hello from whisper")
        llm.push(say("hi"), when=is_loop)
        config = write_config(tmp_path, llm, tg, llm={"base_url": llm.base_url, "transcription_base_url": whisper.base_url,
                                                     "transcription_model": "large-v3"})
        async with running(config) as d:
            tg.push_voice(b"OggS" + b"\x02" * 50, chat_id=11)
            await tg.wait_for("sendMessage")
            await d.engine.wait_for_turns(1)
    assert [t["model"] for t in whisper.transcriptions] == ["large-v3"] and llm.transcriptions == []
    assert "hello from whisper" in contents(loop_requests(llm)[0])


async def test_a_text_document_is_saved_byte_for_byte_and_the_model_told_where(tmp_path, llm, tg):
    judges_say_done(llm)
    llm.push(say("read it"), when=is_loop)
    data = "name,qty\nmilk,2\nbröd,1\n".encode()
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_document(data, "../../shopping list.csv", "text/csv", caption="my list", chat_id=12)
        await tg.wait_for("sendMessage")
        await d.engine.wait_for_turns(1)
        trace = (await d.store.recent_turns(limit=1))[0]
    saved = tmp_path / "data" / "workspace" / "inbox" / "telegram_12" / "shopping list.csv"
    assert saved.read_bytes() == data  # the name sanitised: no way out of the chat's inbox
    seen = last_user(loop_requests(llm)[0])["content"]
    assert "my list\n[File received: inbox/telegram_12/shopping list.csv (text, text/csv, 24 bytes)." in seen
    assert "bröd,1" in seen  # short text inline
    assert trace["trace"]["route"] == "deliberate"  # reading a file is work


async def test_the_same_name_twice_is_suffixed_and_a_pdf_is_read_inline_and_by_read_file(tmp_path, llm, tg):
    judges_say_done(llm)
    from test_documents import make_pdf  # a real PDF with text, built by hand

    pdf = make_pdf(["Quarterly report", "Revenue grew by 12 percent"])
    llm.push(tool_calls(("read_file", {"path": "inbox/telegram_13/report-1.pdf"})), when=is_loop)
    llm.push(say("the second report says revenue grew"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_document(b"%PDF-1.4 not really", "report.pdf", "application/pdf", chat_id=13)
        await tg.wait_for("sendMessage")  # only the notice that it cannot be read: nothing else to answer
        await d.engine.wait_for_turns(1)
        tg.push_document(pdf, "report.pdf", "application/pdf", chat_id=13)
        await tg.wait_for("sendMessage", n=2)
        await d.engine.wait_for_turns(2)
    inbox = tmp_path / "data" / "workspace" / "inbox" / "telegram_13"
    assert sorted(p.name for p in inbox.iterdir()) == ["report-1.pdf", "report.pdf"]
    assert tg.sent(13)[0].startswith("I saved report.pdf, but I can't read it: the PDF could not be read")
    assert tg.sent(13)[1] == "the second report says revenue grew"
    second = loop_requests(llm)[0]  # the first document never reached the model
    assert "inbox/telegram_13/report-1.pdf (PDF, 921 bytes, 2 pages)" in contents(second) and "Quarterly report" in contents(second)
    read = loop_requests(llm)[1]
    [result] = [m["content"] for m in read["messages"] if m["role"] == "tool"]
    assert result.startswith("[text extracted from a PDF of 2 pages]") and "Revenue grew by 12 percent" in result


async def test_an_oversized_file_gets_one_polite_reply_and_nothing_is_downloaded(tmp_path, llm, tg):
    async with running(write_config(tmp_path, llm, tg)) as d:
        update = tg.push_document(b"tiny", "movie.mkv", "video/x-matroska", file_size=31 * 1024 * 1024, chat_id=14)
        await tg.wait_for("sendMessage")
        offset = await d.store.get_kv("telegram.offset")
    assert tg.sent(14) == [
        "That file is too big for me: I can fetch files up to 20 MB here, and movie.mkv is 31 MB. "
        "Could you send a smaller one, or paste the part that matters?"
    ]
    assert tg.get_file_calls == [] and tg.downloads == [] and llm.requests == []
    assert offset == str(update["update_id"] + 1)


async def test_a_damaged_image_gets_a_clear_reply_and_the_caption_still_an_answer(tmp_path, llm, tg):
    llm.push(say("about your caption"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_document(png(100, 100)[:60], "broken.png", "image/png", caption="see this", chat_id=15)
        await tg.wait_for("sendMessage", n=2)
        await d.engine.wait_for_turns(1)
    assert tg.sent(15) == [
        "I couldn't open the image: the image seems to be damaged. I kept the file as inbox/telegram_15/broken.png.",
        "about your caption",
    ]
    assert (tmp_path / "data" / "workspace" / "inbox" / "telegram_15" / "broken.png").read_bytes() == png(100, 100)[:60]
    assert not image_parts(loop_requests(llm)[0])
    assert "[An image that could not be opened (the image seems to be damaged); the file is kept as" in contents(
        loop_requests(llm)[0]
    )


async def test_stickers_locations_contacts_and_polls_arrive_as_words(tmp_path, llm, tg):
    for _ in range(4):
        llm.push(say("ok"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_sticker("🐝", "Bees", chat_id=16)
        await d.engine.wait_for_turns(1)
        tg.push_location(52.52, 13.405, chat_id=16)
        await d.engine.wait_for_turns(2)
        tg.push_contact("+49 30 123", "Ada", last_name="Lovelace", chat_id=16)
        await d.engine.wait_for_turns(3)
        tg.push_poll("Lunch?", ["pizza", "soup"], chat_id=16)
        await d.engine.wait_for_turns(4)
    seen = [last_user(r)["content"].split("\n")[-1] for r in loop_requests(llm)]
    assert seen == [
        "[Sticker 🐝 from the pack Bees]", "[Location: 52.52000, 13.40500]", "[Contact: Ada Lovelace, +49 30 123]",
        "[Poll: Lunch? (options: pizza / soup)]",
    ]
    assert tg.sent(16) == ["ok"] * 4


async def test_send_file_delivers_a_photo_and_a_document_through_the_outbox(tmp_path, llm, tg):
    judges_say_done(llm)
    workspace = tmp_path / "data" / "workspace"
    workspace.mkdir(parents=True)
    (workspace / "chart.png").write_bytes(png(400, 300))
    (workspace / "notes.txt").write_text("line one\n")
    llm.push(tool_calls(("send_file", {"path": "chart.png", "caption": "the chart"}),
                        ("send_file", {"path": "notes.txt"})), when=is_loop)
    llm.push(say("sent both"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("send me the chart and the notes, please, both of them as files", chat_id=17)
        await tg.wait_for("sendMessage")
        await d.engine.wait_for_turns(1)
        outbox = await d.store.outbox_for_turn(1)
    sent = [(f["method"], f["filename"], f["caption"]) for f in tg.files_sent]
    assert sent == [("sendPhoto", "chart.png", "the chart"), ("sendDocument", "notes.txt", None)]
    assert tg.files_sent[1]["data"] == b"line one\n"
    assert [(e.attachment or {}).get("kind") for e in outbox] == ["photo", "document", None]
    assert all(e.status == "sent" for e in outbox)
    results = [m["content"] for m in loop_requests(llm)[1]["messages"] if m["role"] == "tool"]
    assert all(json.loads(r)["delivered"] for r in results)


async def test_send_file_refuses_a_path_outside_the_workspace(tmp_path, llm, tg):
    judges_say_done(llm)
    (tmp_path / "secret.txt").write_text("no")
    llm.push(tool_calls(("send_file", {"path": "../../secret.txt"})), when=is_loop)
    llm.push(say("could not"), when=is_loop)
    await answered(tmp_path, llm, tg, "send me the secret file from the parent directory please", 18)
    assert tg.files_sent == []
    result = [m["content"] for m in loop_requests(llm)[1]["messages"] if m["role"] == "tool"][0]
    assert "error" in json.loads(result)


async def test_send_file_of_a_name_longer_than_the_file_system_allows_is_a_plain_error(tmp_path, llm, tg, caplog):
    """``is_file`` raised on the over-long name: a traceback in the log, and the workspace's
    absolute path in what the model read."""
    judges_say_done(llm)
    llm.push(tool_calls(("send_file", {"path": "n" * 300 + ".pdf"})), when=is_loop)
    llm.push(say("no such file"), when=is_loop)
    await answered(tmp_path, llm, tg, "send me the file with the very long name from the workspace, please", 23)
    [result] = tool_results(loop_requests(llm)[1])
    assert json.loads(result)["error"] == f"no such file in the workspace: {'n' * 300}.pdf"
    assert not [r for r in caplog.records if r.exc_info] and tg.files_sent == []


async def test_send_file_of_a_named_pipe_is_a_plain_error(tmp_path, llm, tg, caplog):
    """A named pipe the shell made (``mkfifo report.txt``) is refused by its kind before anything
    opens it: its upload would wait in a worker thread for ever for a writer."""
    judges_say_done(llm)
    ws = tmp_path / "data" / "workspace"
    ws.mkdir(parents=True)
    os.mkfifo(ws / "report.txt")
    llm.push(tool_calls(("send_file", {"path": "report.txt"})), when=is_loop)
    llm.push(say("that is a pipe"), when=is_loop)
    await answered(tmp_path, llm, tg, "send me the report file from the workspace, please", 24)
    [result] = tool_results(loop_requests(llm)[1])
    assert json.loads(result)["error"] == "report.txt is not a regular file (a named pipe)"
    assert tg.files_sent == [] and tg.sent(24) == ["that is a pipe"]
    assert not [r for r in caplog.records if r.exc_info]


async def test_voice_reply_mirror_sends_the_reply_as_ogg_voice_next_to_the_text(tmp_path, llm, tg):
    llm.push_transcript("how are you")
    llm.push(say("fine, thanks"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg, voice={"reply": "mirror"})) as d:
        tg.push_voice(b"OggS" + b"\x03" * 80, chat_id=19)
        await tg.wait_for("sendVoice")
        await d.engine.wait_for_turns(1)
        [entry] = await d.store.outbox_for_turn(1)
    assert tg.sent(19) == ["fine, thanks"]
    assert [r["input"] for r in llm.speech_requests] == ["fine, thanks"]
    assert llm.speech_requests[0]["response_format"] == "opus"
    [voice] = tg.files_sent
    assert voice["method"] == "sendVoice" and voice["data"].startswith(b"OggS")
    assert entry.status == "sent" and len(entry.platform_message_ids) == 2  # the text, then the voice
    assert entry.attachment["path"] and not Path(entry.attachment["path"]).exists()  # made for it, gone once sent


async def test_a_failing_speech_service_still_delivers_the_text_once(tmp_path, llm, tg):
    llm.push_transcript("hi")
    llm.fail_speech(400, "voice not available")
    llm.push(say("hello there"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg, voice={"reply": "mirror"})) as d:
        tg.push_voice(b"OggS" + b"\x04" * 80, chat_id=20)
        await tg.wait_for("sendMessage")
        await d.engine.wait_for_turns(1)
        [entry] = await d.store.outbox_for_turn(1)
    assert tg.sent(20) == ["hello there"] and tg.files_sent == []
    assert entry.status == "sent" and "voice reply could not be made" in (entry.last_error or "")
    result = [m for m in loop_requests(llm)[0]["messages"] if m["role"] == "tool"]
    assert result == []  # one step: the say was delivered, nothing for the model to repeat


# -- Discord --------------------------------------------------------------------------------


async def test_discord_an_image_a_document_and_a_voice_message_reach_the_model(tmp_path, llm):
    from fakes.discord_server import IS_VOICE_MESSAGE, FakeDiscord

    judges_say_done(llm)
    image = png(640, 480)
    llm.push(say("pretty"), when=is_loop)
    llm.push(say("got the notes"), when=is_loop)
    llm.push_transcript("see you at noon")
    llm.push(say("noon it is"), when=is_loop)
    async with FakeDiscord() as dc:
        section = {"enabled": True, "api_base_url": dc.api_base, "gateway_url": dc.gateway_url}
        async with running(write_config(tmp_path, llm, None, discord=section), telegram_token=None,
                           discord_token=dc.token) as d:
            dm = dc.dm_channel_id()
            await dc.send_dm("my garden", attachments=[{"filename": "garden.png", "data": image, "content_type": "image/png"}])
            await dc.wait_until(lambda: dc.messages_sent(dm) == ["pretty"])
            await d.engine.wait_for_turns(1)
            await dc.send_dm("", attachments=[{"filename": "notes.md", "data": b"# Notes\n- call Bob\n",
                                               "content_type": "text/markdown; charset=utf-8"}])
            await dc.wait_until(lambda: len(dc.messages_sent(dm)) == 2)
            await d.engine.wait_for_turns(2)
            await dc.send_dm("", attachments=[{"filename": "voice-message.ogg", "data": b"OggS" + b"\x05" * 64,
                                               "content_type": "audio/ogg", "duration_secs": 2.5, "waveform": b"\x00" * 8}],
                             flags=IS_VOICE_MESSAGE)
            await dc.wait_until(lambda: len(dc.messages_sent(dm)) == 3)
            await d.engine.wait_for_turns(3)
        assert dc.messages_sent(dm) == ["pretty", "got the notes", "noon it is"]
        assert len(dc.downloads) == 3
    first, second, third = loop_requests(llm)
    assert len(image_parts(first)) == 1 and "my garden\n[Image 640×480]" in contents(first)
    folder = next((tmp_path / "data" / "workspace" / "inbox").iterdir())
    assert folder.name.startswith("discord_") and (folder / "notes.md").read_bytes() == b"# Notes\n- call Bob\n"
    assert f"[File received: inbox/{folder.name}/notes.md" in contents(second) and "- call Bob" in contents(second)
    assert llm.transcriptions[0]["data"].startswith(b"OggS")
    assert last_user(third)["content"].endswith("[Voice message, 0:02, transcribed]: see you at noon")


async def test_discord_an_oversized_attachment_gets_one_polite_reply_and_no_download(tmp_path, llm):
    from fakes.discord_server import FakeDiscord

    async with FakeDiscord() as dc:
        section = {"enabled": True, "api_base_url": dc.api_base, "gateway_url": dc.gateway_url}
        async with running(write_config(tmp_path, llm, None, discord=section), telegram_token=None, discord_token=dc.token):
            dm = dc.dm_channel_id()
            await dc.send_dm("", attachments=[{"filename": "big.zip", "data": b"PK", "size": 40 * 1024 * 1024}])
            await dc.wait_until(lambda: len(dc.messages_sent(dm)) == 1)
        assert dc.messages_sent(dm) == [
            "That file is too big for me: I can fetch files up to 25 MB here, and big.zip is 40 MB. "
            "Could you send a smaller one, or paste the part that matters?"
        ]
        assert dc.downloads == [] and llm.requests == []


async def test_discord_send_file_attaches_the_file_to_a_message(tmp_path, llm):
    from fakes.discord_server import FakeDiscord

    judges_say_done(llm)
    workspace = tmp_path / "data" / "workspace"
    workspace.mkdir(parents=True)
    (workspace / "plot.png").write_bytes(png(64, 64))
    llm.push(tool_calls(("send_file", {"path": "plot.png", "caption": "here"})), when=is_loop)
    llm.push(say("done"), when=is_loop)
    async with FakeDiscord() as dc:
        section = {"enabled": True, "api_base_url": dc.api_base, "gateway_url": dc.gateway_url}
        async with running(write_config(tmp_path, llm, None, discord=section), telegram_token=None,
                           discord_token=dc.token) as d:
            dm = dc.dm_channel_id()
            await dc.send_dm("please send me the plot file from the workspace as an attachment")
            await dc.wait_until(lambda: len(dc.messages_sent(dm)) == 2)
            await d.engine.wait_for_turns(1)
        [upload] = dc.files_sent
        assert upload["filename"] == "plot.png" and upload["data"] == png(64, 64) and upload["content"] == "here"
        assert dc.messages_sent(dm) == ["here", "done"]


async def test_an_image_counts_in_the_estimate_and_is_only_named_once_it_leaves_the_tail(tmp_path, llm, tg):
    from bumblebot.media import image_tokens

    for reply in ("nice", "same words", "later"):
        llm.push(say(reply), when=is_loop)
    history = {"history_compression": {"compaction_protect_last_n": 2}}
    async with running(write_config(tmp_path, llm, tg, cognition={"classifier": False, **history})) as d:
        tg.push_photo([(1200, 800, png(1200, 800))], caption="hi there", chat_id=30)
        await d.engine.wait_for_turns(1)
        tg.push_text("hi there\n[Image 1200×800]", chat_id=31)  # the same words, no image
        await d.engine.wait_for_turns(2)
        tg.push_text("and now?", chat_id=30)
        await d.engine.wait_for_turns(3)
        traces = {t["chat"]: t["trace"] for t in await d.store.recent_turns(limit=3) if t["turn_id"] in (1, 2)}
    with_image, without = traces["telegram:30"]["estimates"][0], traces["telegram:31"]["estimates"][0]
    assert abs((with_image - without) - image_tokens(1200, 800)) <= 5
    first, _, later = loop_requests(llm)
    assert len(image_parts(first)) == 1
    assert image_parts(later) == []  # the photo is three messages back: past the tail of 2
    assert "hi there\n[Image 1200×800]\n(1 image no longer shown)" in contents(later)


async def test_a_photo_sent_while_the_entity_works_is_fetched_and_shown_at_the_next_step(tmp_path, llm, tg):
    from support import Gate

    judges_say_done(llm)
    hold = Gate(tool_calls(("list_directory", {"path": "."})))
    llm.push(hold, when=is_loop)
    llm.push(say("I see the photo too"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("please list the files in your workspace directory for me", chat_id=40)
        await hold.entered.wait()
        tg.push_photo([(320, 240, png(320, 240))], caption="and this", chat_id=40)
        await d.engine.wait_until(lambda: d.engine.progress.accepted >= 2)
        hold.release.set()
        await tg.wait_for("sendMessage")
        await d.engine.wait_for_turns(1)
    assert d.engine.progress.turns_finished == 1  # taken into the running turn, not a turn of its own
    second = loop_requests(llm)[1]
    assert len(image_parts(second)) == 1 and "and this" in contents(second)
    assert tg.sent(40) == ["I see the photo too"]


def noisy_jpeg(width: int, height: int, seed: int = 1) -> bytes:
    """A photo-like JPEG (noise does not compress): tens of KB, as real photos are."""
    import random

    from PIL import Image

    rng = random.Random(seed)
    buffer = io.BytesIO()
    Image.frombytes("RGB", (width, height), bytes(rng.getrandbits(8) for _ in range(width * height * 3))).save(
        buffer, "JPEG", quality=80
    )
    return buffer.getvalue()


async def test_a_server_that_counts_the_image_as_text_and_refuses_it_as_too_long_is_remembered(tmp_path, llm, tg):
    """Regression (the real llama-cpp-python server with SmolLM2): a request with a photo was
    refused as 22,766 tokens in a 4k window, and the conversation died of "too long"."""
    llm.reject_images(400, "This model's maximum context length is 4096 tokens. However, you requested 22771 "
                           "tokens (22766 in the messages, 5 in the completion). Please reduce the length of the messages.")
    llm.push(say("I read your caption"), when=is_loop)
    llm.push(say("still fine"), when=is_loop)
    photo = noisy_jpeg(200, 150)
    async with running(write_config(tmp_path, llm, tg, cognition={"classifier": False, "max_context_tokens": 4096})) as d:
        tg.push_photo([(200, 150, photo)], caption="what colour is this?", chat_id=50)
        await tg.wait_for("sendMessage", n=2)
        await d.engine.wait_for_turns(1)
        tg.push_text("thanks", chat_id=50)
        await tg.wait_for("sendMessage", n=3)
        await d.engine.wait_for_turns(2)
        remembered = json.loads(await d.store.get_kv("llm.vision:" + llm.base_url + "|test-model"))
        scale = await d.store.get_kv(f"tokens.scale:{llm.base_url}|test-model")
    assert tg.sent(50) == ["I read your caption", BLIND, "still fine"]
    assert [bool(image_parts(r)) for r in loop_requests(llm)] == [True, False, False]
    assert "read the image as text" in remembered["reason"]
    assert scale is None  # the answer without the image taught the token estimate nothing


async def test_a_server_that_answers_with_the_image_read_as_text_is_remembered(tmp_path, llm, tg):
    """The fake counts a data URL as text (a quarter token a character), as a server without a
    vision projector does: the answer stands, and no image is sent to that model again."""
    llm.push(say("hmm"), when=is_loop)
    llm.push(say("only words now"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_photo([(200, 150, noisy_jpeg(200, 150))], caption="look", chat_id=51)
        await tg.wait_for("sendMessage", n=2)
        await d.engine.wait_for_turns(1)
        tg.push_photo([(200, 150, noisy_jpeg(200, 150, seed=2))], caption="and now", chat_id=51)
        await tg.wait_for("sendMessage", n=3)
        await d.engine.wait_for_turns(2)
    assert [bool(image_parts(r)) for r in loop_requests(llm)] == [True, False]
    assert tg.sent(51) == ["hmm", BLIND, "only words now"]


# -- regressions, each with its failing input ---------------------------------------------


async def test_files_sent_in_one_chat_are_out_of_reach_of_another(tmp_path, llm, tg):
    """Regression: Alice's private passwords.txt in inbox/ was listed and sent to a group."""
    judges_say_done(llm)
    llm.push(say("saved"), when=lambda r: is_loop(r) and "passwords.txt" in contents(r) and "Speaking: Alice" in contents(r))
    steal = tool_calls(("list_directory", {"path": "inbox"}), ("read_file", {"path": "inbox/telegram_60/passwords.txt"}),
                       ("send_file", {"path": "inbox/telegram_60/passwords.txt"}))
    llm.push(steal, when=lambda r: is_loop(r) and "Speaking: Mallory" in contents(r))
    llm.push(say("nothing to see"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_document(b"hunter2\n", "passwords.txt", "text/plain", caption="keep this", chat_id=60, first_name="Alice")
        await d.engine.wait_for_turns(1)
        tg.push_text("show me what files people sent you, all of them please", chat_id=61, first_name="Mallory")
        await d.engine.wait_for_turns(2)
    results = [m["content"] for m in loop_requests(llm)[-1]["messages"] if m["role"] == "tool"]
    listing, read, sent = results
    assert "telegram_60" not in listing
    assert "another chat" in read and "hunter2" not in read
    assert "another chat" in sent and tg.files_sent == []


async def test_a_transcription_service_that_is_down_makes_the_voice_note_wait_not_fail(tmp_path, llm, tg):
    """Regression: a 503 was told as "couldn't transcribe" at once, and never tried again."""
    for _ in range(2):  # the client's one retry sees it too
        llm.push_transcript_error(503, "overloaded")
    llm.push_transcript("call mum")
    llm.push(say("I'll remember: call mum"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_voice(b"OggS" + b"\x06" * 90, chat_id=62)
        await tg.wait_for("sendMessage", n=2, timeout=10)
        await d.engine.wait_for_turns(1)
    first, answer = tg.sent(62)
    assert first.startswith("I can't get to the file you sent right now") and answer == "I'll remember: call mum"
    assert [t["status"] for t in llm.transcriptions] == [503, 503, 200]
    assert "call mum" in contents(loop_requests(llm)[0])


async def test_a_long_voice_note_is_answered_with_its_transcript_kept_as_a_file(tmp_path, llm, tg):
    """Regression: a 10-minute voice note put 9,000 characters inline and the turn died of "too long"."""
    words = " ".join(f"word{i}" for i in range(1500))  # about 10,000 characters
    llm.push_transcript(words)
    llm.push(say("long one"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_voice(b"OggS" + b"\x07" * 90, duration=600, chat_id=63)
        await tg.wait_for("sendMessage")
        await d.engine.wait_for_turns(1)
    seen = last_user(loop_requests(llm)[0])["content"]
    [kept] = (tmp_path / "data" / "workspace" / "inbox" / "telegram_63").glob("*.transcript.txt")
    assert kept.read_text() == words
    assert f'read it with read_file("inbox/telegram_63/{kept.name}")' in seen and "word1499" not in seen
    assert len(seen) < 3000


async def test_an_oversized_file_with_a_caption_still_gets_the_caption_answered(tmp_path, llm, tg):
    llm.push(say("about the trip"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_document(b"x", "trip.mov", "video/quicktime", caption="how was the trip?", file_size=30 * 1024 * 1024,
                         chat_id=64)
        await tg.wait_for("sendMessage", n=2)
        await d.engine.wait_for_turns(1)
    assert tg.sent(64) == ["I couldn't use the file trip.mov: it is over the 20 MB limit.", "about the trip"]
    assert tg.get_file_calls == [] and tg.downloads == []


async def test_a_slow_upload_is_not_cut_off_by_the_tool_timeout_and_goes_out_once(tmp_path, llm, tg):
    """Regression: a 4 s sendDocument under a 2 s tool timeout was sent twice and the model told it failed."""
    judges_say_done(llm)
    workspace = tmp_path / "data" / "workspace"
    workspace.mkdir(parents=True)
    (workspace / "report.txt").write_text("report\n")
    respond = tg._respond

    async def slow(method, params):  # the fake's latency: the stimulus, not a synchronisation
        if method == "sendDocument":
            await asyncio.sleep(1.0)
        return await respond(method, params)

    tg._respond = slow
    llm.push(tool_calls(("send_file", {"path": "report.txt"}), ("say", {"text": "there it is"})), when=is_loop)
    llm.push(tool_calls(("end_turn", {})), when=is_loop)
    config = write_config(tmp_path, llm, tg, cognition={"classifier": False, "tool_timeout_s": 0.3})
    async with running(config) as d:
        tg.push_text("please send me report.txt from the workspace as a document", chat_id=65)
        await d.engine.wait_for_turns(1)
        outbox = await d.store.outbox_for_turn(1)
    assert [f["method"] for f in tg.files_sent] == ["sendDocument"]
    results = [json.loads(m["content"]) for m in loop_requests(llm)[1]["messages"] if m["role"] == "tool"]
    assert results[0]["delivered"] is True
    assert [(e.attachment or {}).get("kind") for e in outbox] == ["document", None]  # file first: call order
    assert [c.method for c in tg.calls if c.method in ("sendDocument", "sendMessage")] == ["sendDocument", "sendMessage"]
    assert tg.sent(65) == ["there it is"]


async def test_an_album_is_one_turn_with_all_its_photos(tmp_path, llm, tg):
    """Regression: three photos sent together got three turns and three answers."""
    llm.push(say("the blue one"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        for i, colour in enumerate([(255, 0, 0), (0, 255, 0), (0, 0, 255)]):
            tg.push_photo([(200, 200, png(200, 200, colour))], caption="which is best?" if i == 0 else None,
                          chat_id=66, media_group_id="album-1")
            await asyncio.sleep(0.3)  # the parts arrive apart, as Telegram sends them
        await tg.wait_for("sendMessage")
        await d.engine.wait_for_turns(1)
    [request] = loop_requests(llm)
    assert len(image_parts(request)) == 3 and tg.sent(66) == ["the blue one"]


async def test_a_photo_with_a_short_caption_goes_to_the_main_model_not_the_reflex_one(tmp_path, llm, tg):
    """Regression: a text-only reflex model got the photo and the user was told it cannot see."""
    llm.push(say("a cat"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_photo([(320, 240, png(320, 240))], caption="what is it?", chat_id=67)
        await tg.wait_for("sendMessage")
        await d.engine.wait_for_turns(1)
        trace = (await d.store.recent_turns(limit=1))[0]["trace"]
    [request] = loop_requests(llm)
    assert request["model"] == "test-model" and trace["route"] == "reflex" and image_parts(request)


async def test_speech_is_made_from_words_not_markdown(tmp_path, llm, tg):
    llm.push_transcript("the docs?")
    llm.push(say("**Yes**: see [the guide](https://example.org/guide) and `run`"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg, voice={"reply": "mirror"})) as d:
        tg.push_voice(b"OggS" + b"\x08" * 80, chat_id=68)
        await tg.wait_for("sendVoice")
        await d.engine.wait_for_turns(1)
    assert [r["input"] for r in llm.speech_requests] == ["Yes: see the guide and run"]


async def test_a_caption_over_telegrams_limit_in_utf16_goes_as_a_message_before_the_file(tmp_path, llm, tg):
    """Regression: 600 🐝 (1,200 UTF-16 units, 600 characters) was refused as a caption twice."""
    judges_say_done(llm)
    workspace = tmp_path / "data" / "workspace"
    workspace.mkdir(parents=True)
    (workspace / "bees.png").write_bytes(png(50, 50))
    bees = "🐝" * 600
    llm.push(tool_calls(("send_file", {"path": "bees.png", "caption": bees})), when=is_loop)
    llm.push(say("sent"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("send me the bees picture from the workspace with its caption", chat_id=69)
        await d.engine.wait_for_turns(1)
    [photo] = tg.files_sent
    assert photo["method"] == "sendPhoto" and photo["status"] == 200 and not photo["caption"]
    assert tg.sent(69)[0] == bees


async def test_an_image_pillow_cannot_open_is_kept_as_a_file(tmp_path, llm, tg):
    """Regression: an iPhone HEIC was refused ("not an image I can open") and thrown away."""
    heic = b"\x00\x00\x00\x18ftypheic\x00\x00\x00\x00mif1heic" + b"\x00" * 200
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_document(heic, "IMG_0001.HEIC", "image/heic", chat_id=70)
        await tg.wait_for("sendMessage")
        await d.engine.wait_for_turns(1)
    kept = tmp_path / "data" / "workspace" / "inbox" / "telegram_70" / "IMG_0001.HEIC"
    assert kept.read_bytes() == heic
    assert tg.sent(70) == [
        "I couldn't open the image: it is not an image I can open. I kept the file as inbox/telegram_70/IMG_0001.HEIC."
    ]


# -- more regressions, each with its failing input ----------------------------------------


async def test_a_voice_note_steered_in_during_a_transcription_outage_waits_and_the_turn_goes_on(tmp_path, llm, tg):
    """Regression: the running turn crashed ("Something went wrong") and the voice note was stranded."""
    from support import Gate

    judges_say_done(llm)
    for _ in range(2):
        llm.push_transcript_error(503, "overloaded")
    llm.push_transcript("and buy bread")
    hold = Gate(tool_calls(("list_directory", {"path": "."})))
    llm.push(hold, when=is_loop)
    llm.push(say("listed"), when=is_loop)
    llm.push(say("bread noted"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("please list the files in your workspace directory for me", chat_id=71)
        await hold.entered.wait()
        tg.push_voice(b"OggS" + b"\x09" * 50, chat_id=71)
        await d.engine.wait_until(lambda: d.engine.progress.accepted >= 2)
        hold.release.set()
        await tg.wait_for("sendMessage", n=2, timeout=15)
        await d.engine.wait_for_turns(2)
    # the running turn went on; the voice note got a turn of its own once it could be transcribed
    assert tg.sent(71) == ["listed", "bread noted"]
    assert [t["status"] for t in llm.transcriptions] == [503, 503, 200]


async def test_a_text_after_a_waiting_voice_note_is_answered_meanwhile_and_stop_drops_the_wait(tmp_path, llm, tg):
    """Regression: a text sent after a voice note whose transcription was down waited with it
    for up to an hour; /stop during the wait said "Nothing to stop"."""
    for _ in range(40):
        llm.push_transcript_error(503, "down for a while")
    llm.push(say("answering your text"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_voice(b"OggS" + b"\x0a" * 50, chat_id=72)
        await tg.wait_for("sendMessage")  # told once that it waits
        tg.push_text("are you there?", chat_id=72)
        await tg.wait_for("sendMessage", n=2, timeout=10)
        await d.engine.wait_for_turns(1)  # the text's turn is over; the voice note still waits
        tg.push_text("/stop", chat_id=72)
        await tg.wait_for("sendMessage", n=3, timeout=10)
        # the wait is settled in the conversation's actor
        await d.engine.wait_until(lambda: not d.engine.waiting and d.engine.idle, timeout=10)
        rows = await d.store._all("SELECT text, status FROM journal WHERE source='chat' AND text NOT LIKE '/%' ORDER BY id")
    assert tg.sent(72)[1:] == ["answering your text", "Stopped."]
    assert [r["status"] for r in rows] == ["ignored", "done"]  # the voice note: not answered after all


async def test_a_file_named_like_the_inbox_cannot_be_written(tmp_path, llm, tg):
    """Regression: write_file("inbox") made a file, and every chat's documents failed from then on."""
    judges_say_done(llm)
    llm.push(tool_calls(("write_file", {"path": "inbox", "content": "x"})), when=is_loop)
    llm.push(say("could not"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("please write a file called inbox with the letter x in it", chat_id=73)
        await d.engine.wait_for_turns(1)
    [result] = tool_results(loop_requests(llm)[1])
    assert "where the files people send are kept" in result
    assert not (tmp_path / "data" / "workspace" / "inbox").is_file()


def test_a_chat_that_moves_takes_its_inbox_along(tmp_path):
    """Regression: files sent before a group became a supergroup were refused afterwards."""
    from bumblebot.core.settings import MediaSettings
    from bumblebot.media import MediaIntake

    workspace = tmp_path / "ws"
    old = workspace / "inbox" / "telegram_-5"
    old.mkdir(parents=True)
    (old / "a.txt").write_text("a")
    media = MediaIntake(MediaSettings(), store=None, media_dir=tmp_path / "m", workspace=workspace, speech=None)  # type: ignore[arg-type]
    media.move_chat("telegram:-5", "telegram:-1005")
    assert (workspace / "inbox" / "telegram_-1005" / "a.txt").read_text() == "a" and not old.exists()


# -- transcription answers that are not what the API promises -------------------------------------

#: What an exception's name looks like in a message (none may reach a user).
EXCEPTION_NAME = re.compile(r"\b[A-Z][A-Za-z]*(Error|Exception)\b")


@pytest.mark.parametrize("body, content_type", [
    ("not json at all {", "application/json"),  # the SDK's reader raised JSONDecodeError
    ('{"text": 12345}', "application/json"),  # the strip() of an int raised AttributeError
    ('{"transcript": "hi"}', "application/json"),
    ("<html><body>502 Bad Gateway</body></html>", "text/html"),
    ('{"text": ' + "[" * 200_000 + "]" * 200_000 + "}", "application/json"),  # RecursionError escaped the reader
])
async def test_a_transcription_answer_that_is_not_what_the_api_promises_is_told_plainly_and_the_chat_goes_on(
    tmp_path, llm, tg, body, content_type,
):
    """Such an answer raised in intake: the user saw the exception's name ("JSONDecodeError"),
    the voice note was stored as a user message with content '' and, on an endpoint that
    refuses blank text, every later turn of the chat failed with 400."""
    judges_say_done(llm)
    llm.push_transcript_body(body, content_type)
    llm.push(say("yes, still here"), when=is_loop)
    audio = b"OggS" + b"\x06" * 90
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_voice(audio, chat_id=21)
        await tg.wait_for("sendMessage")
        await d.engine.wait_for_turns(1)
        tg.push_text("are you there?", chat_id=21)
        await tg.wait_for("sendMessage", n=2)
        await d.engine.wait_for_turns(2)
    notice, answer = tg.sent(21)
    assert notice.startswith("I couldn't transcribe your voice message (the transcription service gave an answer that could not be read).")
    assert not EXCEPTION_NAME.search(notice) and answer == "yes, still here"
    [kept] = (tmp_path / "data" / "workspace" / "inbox" / "telegram_21").glob("voice-*.ogg")
    assert kept.read_bytes() == audio
    users = [r[0] for r in sqlite3.connect(tmp_path / "data" / "bumblebot.db").execute("SELECT content FROM messages WHERE role='user'")]
    assert len(users) == 2 and all(u.strip() for u in users) and "could not be transcribed" in users[0]
    assert not llm.violations


async def test_a_transcript_with_a_lone_surrogate_is_answered_and_the_chat_goes_on(tmp_path, llm, tg):
    """The transcript's lone surrogate made ``store.begin_turn`` raise UnicodeEncodeError; the
    daemon retried every 5 s for ever and every later message of the chat stayed pending."""
    judges_say_done(llm)
    llm.push_transcript("call me at \ud83d noon")
    llm.push(say("noted"), when=lambda r: is_loop(r) and "noon" in contents(r))
    llm.push(say("and again"), when=lambda r: is_loop(r) and "one more" in contents(r))
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_voice(b"OggS" + b"\x07" * 90, chat_id=22)
        await tg.wait_for("sendMessage")
        tg.push_text("one more", chat_id=22)
        await tg.wait_for("sendMessage", n=2)
        await d.engine.wait_for_turns(2)
    assert tg.sent(22) == ["noted", "and again"]
    assert "call me at \ufffd noon" in contents(loop_requests(llm)[0])
    db = sqlite3.connect(tmp_path / "data" / "bumblebot.db")
    assert db.execute("SELECT status FROM journal ORDER BY id").fetchall() == [("done",), ("done",)]
    assert "\ufffd" in json.loads(db.execute("SELECT media FROM journal ORDER BY id").fetchone()[0])["text"]


# -- how many files one turn takes ---------------------------------------------------------------


async def test_a_ten_thousand_part_album_makes_one_turn_of_ten_images_and_every_chat_goes_on(tmp_path, llm, tg):
    """Nothing capped the files of a turn: a 10,000-part album made one request with 3,800
    images. An album holds at most 10 files: the parts past ``media.max_attachments_per_turn``
    are never fetched, the sender is told once, and the chat and the others go on."""
    judges_say_done(llm)
    llm.push(say("ten fine photos"), when=is_loop)
    llm.push(say("hello other"), when=lambda r: is_loop(r) and "other chat" in contents(r))
    photo = png(8, 8)
    for i in range(10_000):  # one album over 10,000 updates, all waiting when the daemon starts
        last = tg.push_photo([(8, 8, photo)], caption="my trip" if i == 0 else None, chat_id=92, media_group_id="flood")
    async with running(write_config(tmp_path, llm, tg)) as d:
        await tg.wait_for("getUpdates", predicate=lambda p: int(p.get("offset") or 0) > last["update_id"], timeout=60)
        tg.push_text("other chat", chat_id=93)
        await tg.wait_for("sendMessage", n=3)
        await d.engine.wait_for_turns(2)
        offset = await d.store.get_kv("telegram.offset")
    overflow, answer = tg.sent(92)
    assert overflow.startswith("That album has more files than I take at once (10)") and answer == "ten fine photos"
    assert tg.sent(93) == ["hello other"] and offset == str(last["update_id"] + 2)
    album_turn, other_turn = loop_requests(llm)
    assert len(image_parts(album_turn)) == 10 and "my trip" in contents(album_turn) and not image_parts(other_turn)
    assert len(tg.get_file_calls) == 10 and not llm.violations


async def test_files_past_the_cap_of_one_turn_are_not_fetched_and_the_model_and_the_sender_are_told(tmp_path, llm):
    """A message with more files than ``media.max_attachments_per_turn`` (Discord takes 10 a
    message; a burst of messages, more): the first ones are fetched, the others never are."""
    from fakes.discord_server import FakeDiscord

    judges_say_done(llm)
    llm.push(say("three seen"), when=is_loop)
    files = [{"filename": f"p{i}.png", "data": png(16, 16, (i * 40, 0, 0)), "content_type": "image/png"} for i in range(5)]
    async with FakeDiscord() as dc:
        section = {"enabled": True, "api_base_url": dc.api_base, "gateway_url": dc.gateway_url}
        config = write_config(tmp_path, llm, None, discord=section, media={"max_attachments_per_turn": 3})
        async with running(config, telegram_token=None, discord_token=dc.token) as d:
            dm = dc.dm_channel_id()
            await dc.send_dm("which is reddest?", attachments=files)
            await dc.wait_until(lambda: len(dc.messages_sent(dm)) == 2)
            await d.engine.wait_for_turns(1)
        notice, answer = dc.messages_sent(dm)
        assert len(dc.downloads) == 3
    assert notice == "I take 3 files at a time, so I left the other 2 out. Send them again, a few at a time, if they matter."
    assert answer == "three seen"
    [request] = loop_requests(llm)
    assert len(image_parts(request)) == 3
    assert "[2 more files came with this and were left out unopened: at most 3 are taken at once]" in contents(request)


async def test_a_file_host_that_cannot_be_reached_is_told_without_the_http_library_s_words(tmp_path, llm, tg, monkeypatch):
    """python-telegram-bot words a failed connection "httpx.ConnectError: …": that reached the
    user inside "I can't get to the file you sent right now (…)"."""
    import socket

    from bumblebot.media import intake

    monkeypatch.setattr(intake, "FETCH_RETRY_S", 0.01)
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    config = write_config(tmp_path, llm, tg, telegram={"base_url": tg.base_url, "base_file_url": f"http://127.0.0.1:{closed}/file/bot"})
    async with running(config):
        tg.push_document(b"data", "notes.txt", "text/plain", chat_id=24)
        [told] = await tg.wait_for("sendMessage")
    notice = told.params["text"]
    assert notice.startswith("I can't get to the file you sent right now (Telegram could not be reached).")
    assert "httpx" not in notice and not EXCEPTION_NAME.search(notice)


async def test_an_audio_file_with_a_name_longer_than_servers_take_is_transcribed_under_a_short_one(tmp_path, llm, tg):
    """The sender's 3,000-character name went to the transcription server as the upload's file
    name; the server failed on the header (HTTP 500), and the voice note waited as if the
    service were down."""
    judges_say_done(llm)
    llm.push_transcript("the long one")
    llm.push(say("heard it"), when=lambda r: is_loop(r) and "the long one" in contents(r))
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_audio(b"ID3" + b"\x08" * 90, file_name="\U0001f3b5" * 3000 + ".mp3", chat_id=25)
        await tg.wait_for("sendMessage")
        await d.engine.wait_for_turns(1)
    [sent] = llm.transcriptions
    assert sent["filename"].endswith(".mp3") and len(sent["filename"].encode()) <= 120
    assert tg.sent(25) == ["heard it"]


def pdf_mapping_A_to(utf16_hex: str) -> bytes:
    """A one-page PDF showing "HAAB" in Helvetica whose ToUnicode CMap maps "A" to ``utf16_hex``."""
    cmap = (f"/CIDInit /ProcSet findresource begin 12 dict begin begincmap /CMapName /X def\n1 begincodespacerange\n"
            f"<00> <FF>\nendcodespacerange\n1 beginbfchar\n<41> <{utf16_hex}>\nendbfchar\nendcmap\n"
            "CMapName currentdict /CMap defineresource pop end end\n")
    content = "BT /F1 24 Tf 72 720 Td (HAAB) Tj ET"
    objs = ["<< /Type /Catalog /Pages 2 0 R >>", "<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
            "<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R /Resources << /Font << /F1 5 0 R >> >> >>",
            f"<< /Length {len(content)} >>\nstream\n{content}\nendstream",
            "<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica /ToUnicode 6 0 R >>",
            f"<< /Length {len(cmap)} >>\nstream\n{cmap}\nendstream"]
    out, offsets = "%PDF-1.4\n", []
    for i, obj in enumerate(objs, 1):
        offsets.append(len(out))
        out += f"{i} 0 obj\n{obj}\nendobj\n"
    xref = len(out)
    out += f"xref\n0 {len(objs) + 1}\n0000000000 65535 f \n" + "".join(f"{o:010d} 00000 n \n" for o in offsets)
    return (out + f"trailer\n<< /Size {len(objs) + 1} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n").encode()


async def test_a_pdf_whose_text_holds_a_lone_surrogate_is_read(tmp_path, llm, tg):
    """pypdf yields lone surrogates from a malformed ToUnicode CMap (pypdf#1872); the worker's
    json.dumps(ensure_ascii=False) failed on its strict UTF-8 stdout: "its reader failed"."""
    judges_say_done(llm)
    llm.push(say("read it"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_document(pdf_mapping_A_to("D800"), "sur.pdf", "application/pdf", caption="what is it", chat_id=52)
        await tg.wait_for("sendMessage", timeout=30)
        await d.engine.wait_for_turns(1)
    assert tg.sent(52) == ["read it"]
    assert "H\ufffd\ufffdB" in contents(loop_requests(llm)[0])


async def test_send_file_of_a_name_that_is_not_utf8_does_not_crash_the_turn(tmp_path, llm, tg):
    """The resolved name '\\udcff-report.txt' went raw into the next step's nudge ("Already
    told the user: [file …]"): the openai client failed to encode the request."""
    judges_say_done(llm)
    ws = tmp_path / "data" / "workspace"
    ws.mkdir(parents=True)
    (ws / os.fsdecode(b"\xff-report.txt")).write_text("hello")
    (ws / "report.txt").symlink_to(ws / os.fsdecode(b"\xff-report.txt"))
    llm.push(tool_calls(("send_file", {"path": "report.txt"})), when=is_loop)
    llm.push(say("sent"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg, telegram={"allowed_user_ids": [41]})) as d:
        tg.push_text("send me the report", chat_id=41)
        await tg.wait_for("sendMessage", timeout=15)
        await d.engine.wait_for_turns(1)
    assert not any("went wrong" in t for t in tg.sent(41))


async def test_a_file_over_the_chats_limit_is_refused_before_anything_is_copied(tmp_path, llm, tg):
    """send_file copied the whole file before its size was checked: a 2 GB sparse file (free in
    the workspace: ``truncate -s``) wrote 2 GB next to the database before the refusal."""
    judges_say_done(llm)
    workspace = tmp_path / "data" / "workspace"
    workspace.mkdir(parents=True)
    with open(workspace / "big.bin", "wb") as big:
        big.truncate(2 * 1024**3)
    llm.push(tool_calls(("send_file", {"path": "big.bin"})), when=is_loop)
    llm.push(say("too big"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.push_text("send big.bin", chat_id=91)
        await tg.wait_for("sendMessage")
        await d.engine.wait_for_turns(1)
        outgoing = d.settings.media_dir / "outgoing"
        copies = list(outgoing.iterdir()) if outgoing.exists() else []
    result = json.loads(tool_results(loop_requests(llm)[1])[0])
    assert result["delivered"] is False and "2 GB" in result["error"] and "over the" in result["error"]
    assert copies == [] and tg.files_sent == []


async def test_the_copy_of_a_file_the_platform_refuses_for_good_is_not_kept(tmp_path, llm, tg):
    """A refused upload left its copy in media/outgoing for ever."""
    judges_say_done(llm)
    workspace = tmp_path / "data" / "workspace"
    workspace.mkdir(parents=True)
    (workspace / "notes.txt").write_text("notes\n")
    llm.push(tool_calls(("send_file", {"path": "notes.txt"})), when=is_loop)
    llm.push(say("could not"), when=is_loop)
    async with running(write_config(tmp_path, llm, tg)) as d:
        tg.fail_next("sendDocument", 400, {"ok": False, "error_code": 400, "description": "Bad Request: file is wrong"})
        tg.push_text("send the notes", chat_id=92)
        await tg.wait_for("sendMessage")
        await d.engine.wait_for_turns(1)
        outgoing = d.settings.media_dir / "outgoing"
        copies = list(outgoing.iterdir()) if outgoing.exists() else []
    assert copies == [] and (workspace / "notes.txt").read_text() == "notes\n"


async def test_copies_no_pending_row_will_send_are_deleted_at_start(tmp_path, llm, tg):
    """A crash between send_file's copy and its row, or a row that expired, left the copy in
    media/outgoing for ever; one a pending row will still send stays."""
    judges_say_done(llm)
    workspace = tmp_path / "data" / "workspace"
    workspace.mkdir(parents=True)
    (workspace / "notes.txt").write_text("notes\n")
    llm.push(tool_calls(("send_file", {"path": "notes.txt"})), when=is_loop)
    llm.push(say("sending"), when=is_loop)
    config = write_config(tmp_path, llm, tg)
    async with running(config) as d:
        tg.fail_next("sendDocument", 500, {"ok": False, "error_code": 500, "description": "Internal Server Error"}, times=20)
        tg.push_text("send the notes", chat_id=93)
        await d.engine.wait_for_turns(1)
        outgoing = d.settings.media_dir / "outgoing"
        [kept] = list(outgoing.iterdir())
    orphan = outgoing / "file-0123456789abcdef.txt"
    orphan.write_text("left by a crash")
    tg.fail_next("sendDocument", 500, {"ok": False, "error_code": 500, "description": "Internal Server Error"}, times=20)
    async with running(config):
        pass
    assert not orphan.exists() and kept.exists()


async def test_a_file_waiting_to_be_sent_survives_a_secret_that_is_part_of_the_data_path(tmp_path, llm, tg):
    """An MCP env value that is part of the data directory's path (``PROJECT_DIR``) is a
    secret: the store redacted it inside the row's file path, and after a restart the file
    "was gone" and the row failed."""
    judges_say_done(llm)
    workspace = tmp_path / "data" / "workspace"
    workspace.mkdir(parents=True)
    (workspace / "notes.txt").write_text("notes\n")
    llm.push(tool_calls(("send_file", {"path": "notes.txt"})), when=is_loop)
    llm.push(say("sending"), when=is_loop)
    mcp = {"startup_wait_s": 0.2, "servers": {"x": {"command": ["/bin/false"], "env": {"PROJECT_DIR": str(tmp_path)}}}}
    config = write_config(tmp_path, llm, tg, mcp=mcp)
    error = {"ok": False, "error_code": 500, "description": "Internal Server Error"}
    async with running(config) as d:
        tg.fail_next("sendDocument", 500, error, times=3)  # each of the turn's three tries: it waits
        tg.push_text("send the notes", chat_id=94)
        await d.engine.wait_for_turns(1)
        await tg.wait_for("sendDocument", n=3)
    async with running(config):  # the row is read back from the database and sent
        await tg.wait_for("sendDocument", n=4, timeout=15)
    assert [f["data"] for f in tg.files_sent if f["method"] == "sendDocument"][-1] == b"notes\n"
