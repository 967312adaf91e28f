"""Media support of the fakes (files, uploads, attachments, audio, vision) through the REAL
clients: python-telegram-bot against FakeTelegram, discord.py against FakeDiscord and
openai.AsyncOpenAI against FakeOpenAI, all over 127.0.0.1. Waits are on events with timeouts.
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import io
import struct
import warnings
import zlib
from collections.abc import AsyncIterator

import aiohttp
import openai
import pytest
import telegram
from fakes.openai_server import FakeOpenAI, image_parts, mentions, sequence_violation, text
from fakes.telegram_server import (
    MAX_DOWNLOAD_SIZE,
    FakeTelegram,
    bad_request_body,
    image_size,
    retry_after_body,
)
from telegram.ext import ApplicationBuilder, ContextTypes, MessageHandler, filters

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", "'audioop' is deprecated", DeprecationWarning)
    import discord

from fakes.discord_server import IS_VOICE_MESSAGE, FakeDiscord


def png(width: int, height: int) -> bytes:
    """A real (valid, decodable) RGB PNG of the given size."""
    raw = b"".join(b"\x00" + b"\x10\x80\xf0" * width for _ in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data)))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw))
            + chunk(b"IEND", b""))


PNG = png(40, 30)
OGG = b"OggS\x00\x02" + bytes(20) + b"\x01\x13OpusHead fake voice"


def test_image_size_reads_png_gif_jpeg_and_webp_headers():
    assert image_size(PNG) == (40, 30)
    assert image_size(b"GIF89a" + struct.pack("<HH", 7, 9) + bytes(8)) == (7, 9)
    jpeg = b"\xff\xd8" + b"\xff\xe0\x00\x04ab" + b"\xff\xc0\x00\x0b\x08" + struct.pack(">HH", 50, 60) + bytes(6)
    assert image_size(jpeg) == (60, 50)
    webp = b"RIFF\x00\x00\x00\x00WEBPVP8X" + bytes(8) + (99).to_bytes(3, "little") + (49).to_bytes(3, "little")
    assert image_size(webp) == (100, 50)
    assert image_size(b"not an image at all") is None


# ---- FakeTelegram ----------------------------------------------------------------------------

@pytest.fixture
async def tg() -> AsyncIterator[FakeTelegram]:
    async with FakeTelegram() as server:
        yield server


@pytest.fixture
async def bot(tg: FakeTelegram) -> AsyncIterator[telegram.Bot]:
    async with telegram.Bot(tg.token, base_url=tg.base_url, base_file_url=tg.base_file_url) as b:
        yield b


async def test_pushed_photo_is_downloaded_with_get_file(tg: FakeTelegram, bot: telegram.Bot):
    big, small = png(320, 240), png(90, 68)
    pushed = tg.push_photo([(320, 240, big), (90, 68, small)], caption="look @bob",
                           chat_id=-100, chat_type="supergroup", user_id=7, reply_to=3)
    [update] = await bot.get_updates()
    message = update.message
    assert update.update_id == pushed["update_id"]
    assert [(p.width, p.height, p.file_size) for p in message.photo] == [
        (90, 68, len(small)), (320, 240, len(big))]  # small to large, as Telegram orders them
    assert message.photo[0].file_unique_id != message.photo[1].file_unique_id
    assert message.caption == "look @bob" and message.text is None
    assert [(e.type, e.offset, e.length) for e in message.caption_entities] == [("mention", 5, 4)]
    assert message.chat.id == -100 and message.from_user.id == 7
    assert message.reply_to_message.message_id == 3

    file = await bot.get_file(message.photo[-1].file_id)
    assert file.file_size == len(big) and file.file_unique_id == message.photo[-1].file_unique_id
    assert file.file_path == f"{tg.base_file_url}{tg.token}/{tg.files[file.file_id].file_path}"
    assert bytes(await file.download_as_bytearray()) == big
    assert tg.get_file_calls == [message.photo[-1].file_id]
    assert tg.downloads == [tg.files[file.file_id].file_path]
    assert tg.downloads[0].startswith("photos/") and tg.downloads[0].endswith(".jpg")


async def test_get_file_limits_unknown_ids_and_unknown_paths(tg: FakeTelegram, bot: telegram.Bot):
    pushed = tg.push_document(b"%PDF-1.4 tiny", "report.pdf", "application/pdf",
                              caption="the report", file_size=30 * 1024 * 1024)
    document = pushed["message"]["document"]
    assert document["file_size"] == 30 * 1024 * 1024 > MAX_DOWNLOAD_SIZE
    with pytest.raises(telegram.error.BadRequest, match="(?i)file is too big"):
        await bot.get_file(document["file_id"])
    with pytest.raises(telegram.error.BadRequest, match="(?i)invalid file_id"):
        await bot.get_file("no-such-file")
    assert tg.get_file_calls == [document["file_id"], "no-such-file"]

    exactly_20mb = tg.add_file(b"edge", file_path="documents/edge.bin", file_size=MAX_DOWNLOAD_SIZE)
    file = await bot.get_file(exactly_20mb)  # the limit itself is still downloadable
    assert file.file_size == MAX_DOWNLOAD_SIZE
    assert bytes(await file.download_as_bytearray()) == b"edge"
    assert tg.downloads == ["documents/edge.bin"]

    async with aiohttp.ClientSession() as http:
        async with http.get(f"{tg.base_file_url}{tg.token}/documents/nothing.bin") as response:
            assert response.status == 404
        async with http.get(f"{tg.base_file_url}WRONG/documents/edge.bin") as response:
            assert response.status == 404
    tg.fail_next("download", 500, {"ok": False, "error_code": 500, "description": "Internal"})
    with pytest.raises(telegram.error.NetworkError):
        await file.download_as_bytearray()
    assert tg.downloads == ["documents/edge.bin"]


async def test_every_pushed_media_kind_parses_as_ptb_objects(tg: FakeTelegram, bot: telegram.Bot):
    tg.push_voice(OGG, duration=4, caption="/cmd in a caption")
    tg.push_audio(b"ID3 song", title="Song", performer="Band")
    tg.push_video(b"\x00\x00\x00\x18ftypmp42", file_name="cat.mp4", duration=7, width=320, height=240)
    tg.push_sticker(emoji="🐝", set_name="Bees")
    tg.push_location(52.5, 13.4)
    tg.push_contact("+15551234", "Bob", "Builder", contact_user_id=99, sender_name="Carol")
    tg.push_poll("Tea or coffee?", ["tea", "coffee"], chat_id=-5, chat_type="group")
    tg.push_document(b"a,b\n1,2\n", "data.csv", "text/csv", chat_id=-300, chat_type="supergroup",
                     is_forum=True, thread_id=12)
    updates = await bot.get_updates()
    voice, audio, video, sticker, location, contact, poll, doc = [u.message for u in updates]

    assert voice.voice.duration == dt.timedelta(seconds=4) and voice.voice.mime_type == "audio/ogg"
    assert voice.caption == "/cmd in a caption"
    assert voice.caption_entities[0].type == "bot_command" and voice.caption_entities[0].length == 4
    assert bytes(await (await bot.get_file(voice.voice.file_id)).download_as_bytearray()) == OGG
    assert (audio.audio.file_name, audio.audio.mime_type, audio.audio.title,
            audio.audio.performer) == ("song.mp3", "audio/mpeg", "Song", "Band")
    assert audio.audio.duration == dt.timedelta(seconds=10)
    assert (video.video.file_name, video.video.width, video.video.height) == ("cat.mp4", 320, 240)
    assert video.video.mime_type == "video/mp4"
    assert (sticker.sticker.emoji, sticker.sticker.set_name, sticker.sticker.type) == (
        "🐝", "Bees", "regular")
    assert not sticker.sticker.is_animated and not sticker.sticker.is_video
    assert (location.location.latitude, location.location.longitude) == (52.5, 13.4)
    assert (contact.contact.phone_number, contact.contact.first_name, contact.contact.last_name,
            contact.contact.user_id) == ("+15551234", "Bob", "Builder", 99)
    assert contact.from_user.first_name == "Carol"
    assert poll.poll.question == "Tea or coffee?"
    assert [o.text for o in poll.poll.options] == ["tea", "coffee"]
    assert poll.chat.type == "group" and not poll.poll.is_closed
    assert (doc.document.file_name, doc.document.mime_type) == ("data.csv", "text/csv")
    assert doc.message_thread_id == 12 and doc.is_topic_message
    assert tg.files[doc.document.file_id].file_path.endswith(".csv")


async def test_uploads_answer_real_messages_and_are_recorded(tg: FakeTelegram, bot: telegram.Bot):
    photo = await bot.send_photo(1001, png(1600, 1200), caption="a chart")
    assert [(p.width, p.height) for p in photo.photo] == [
        (90, 68), (320, 240), (800, 600), (1280, 960)]
    assert photo.caption == "a chart" and photo.from_user.id == bot.id

    document = await bot.send_document(1001, b"col\n1\n", filename="out.csv", caption="table")
    assert (document.document.file_name, document.document.mime_type) == ("out.csv", "text/csv")
    assert document.document.file_size == 6
    voice = await bot.send_voice(1001, OGG, duration=2, filename="reply.ogg")
    assert voice.voice.duration == dt.timedelta(seconds=2) and voice.voice.mime_type == "audio/ogg"
    bare_voice = await bot.send_voice(1001, OGG)  # no name: the part is application/octet-stream
    assert bare_voice.voice.mime_type == "audio/ogg"
    audio = await bot.send_audio(1001, b"ID3 music", filename="tune.mp3", title="Tune")
    assert (audio.audio.file_name, audio.audio.title) == ("tune.mp3", "Tune")

    assert [(f["method"], f["chat_id"], f["filename"], f["caption"], f["mime"], f["status"])
            for f in tg.files_sent] == [
        ("sendPhoto", 1001, "application.octet-stream", "a chart", "application/octet-stream", 200),
        ("sendDocument", 1001, "out.csv", "table", "text/csv", 200),
        ("sendVoice", 1001, "reply.ogg", None, "audio/ogg", 200),
        ("sendVoice", 1001, "application.octet-stream", None, "application/octet-stream", 200),
        ("sendAudio", 1001, "tune.mp3", None, "audio/mpeg", 200)]
    assert tg.files_sent[1]["data"] == b"col\n1\n" and tg.files_sent[2]["data"] == OGG
    assert [f["message_id"] for f in tg.files_sent] == [
        photo.message_id, document.message_id, voice.message_id, bare_voice.message_id,
        audio.message_id]
    assert tg.shown(1001) == ["a chart", "table", "", "", ""]
    assert [c.content_type for c in tg.calls if c.method == "sendPhoto"] == ["multipart/form-data"]

    # the bot's own uploads can be fetched again, and re-sent by file_id (no upload)
    again = await bot.send_document(1001, document.document.file_id)
    assert again.document.file_id == document.document.file_id
    assert (again.document.file_name, again.document.mime_type) == ("out.csv", "text/csv")
    assert tg.files_sent[-1]["file_id"] == document.document.file_id
    assert tg.files_sent[-1]["data"] == b"col\n1\n" and tg.files_sent[-1]["filename"] is None
    photo_again = await bot.send_photo(1001, photo.photo[0].file_id)
    assert [(p.file_id, p.width) for p in photo_again.photo] == [(photo.photo[0].file_id, 90)]
    file = await bot.get_file(photo.photo[-1])
    assert bytes(await file.download_as_bytearray())[:8] == b"\x89PNG\r\n\x1a\n"


async def test_uploads_in_topics_replies_and_their_errors(tg: FakeTelegram, bot: telegram.Bot):
    tg.push_text("hi", chat_id=-200, chat_type="supergroup", is_forum=True, thread_id=9)
    sent = await bot.send_photo(-200, PNG, message_thread_id=9, caption="in topic",
                                reply_parameters=telegram.ReplyParameters(1))
    assert sent.message_thread_id == 9 and sent.reply_to_message.message_id == 1
    assert tg.files_sent[-1]["message_thread_id"] == 9

    tg.fail_next("sendPhoto", 429, retry_after_body(3))
    with pytest.raises(telegram.error.RetryAfter):
        await bot.send_photo(1001, PNG)
    tg.fail_next("sendDocument", 400, bad_request_body("chat not found"))
    with pytest.raises(telegram.error.BadRequest, match="(?i)chat not found"):
        await bot.send_document(1001, b"x", filename="x.txt")
    with pytest.raises(telegram.error.BadRequest, match="(?i)image_process_failed"):
        await bot.send_photo(1001, b"these bytes are no image")
    with pytest.raises(telegram.error.BadRequest, match="(?i)caption is too long"):
        await bot.send_document(1001, b"x", filename="x.txt", caption="c" * 1025)
    with pytest.raises(telegram.error.BadRequest, match="(?i)wrong file identifier"):
        await bot.send_voice(1001, "not-a-known-file-id")
    with pytest.raises(telegram.error.BadRequest, match="(?i)thread not found"):
        await bot.send_photo(1001, PNG, message_thread_id=5)  # a private chat without topics
    assert [(f["method"], f["status"], f["message_id"]) for f in tg.files_sent[1:]] == [
        ("sendPhoto", 429, None), ("sendDocument", 400, None), ("sendPhoto", 400, None),
        ("sendDocument", 400, None), ("sendVoice", 400, None), ("sendPhoto", 400, None)]
    await bot.send_photo(1001, PNG)  # the failures were used up
    assert tg.files_sent[-1]["status"] == 200


async def test_captions_are_edited_and_media_has_no_text_to_edit(tg: FakeTelegram, bot: telegram.Bot):
    sent = await bot.send_document(1001, b"x", filename="x.txt", caption="first")
    edited = await bot.edit_message_caption(1001, sent.message_id, caption="second")
    assert edited.caption == "second" and tg.shown(1001) == ["second"]
    with pytest.raises(telegram.error.BadRequest, match="(?i)not modified"):
        await bot.edit_message_caption(1001, sent.message_id, caption="second")
    with pytest.raises(telegram.error.BadRequest, match="(?i)no text in the message"):
        await bot.edit_message_text("text", chat_id=1001, message_id=sent.message_id)
    plain = await bot.send_message(1001, "plain")
    with pytest.raises(telegram.error.BadRequest, match="(?i)no caption in the message"):
        await bot.edit_message_caption(1001, plain.message_id, caption="c")


async def test_an_application_handler_downloads_a_voice_note(tg: FakeTelegram):
    got: list[bytes] = []

    async def on_voice(update: telegram.Update, _: ContextTypes.DEFAULT_TYPE) -> None:
        file = await update.message.voice.get_file()
        got.append(bytes(await file.download_as_bytearray()))
        await update.message.reply_document(got[-1], filename="echo.ogg", caption="your voice")

    app = (ApplicationBuilder().token(tg.token).base_url(tg.base_url)
           .base_file_url(tg.base_file_url).build())
    app.add_handler(MessageHandler(filters.VOICE, on_voice))
    async with app:
        await app.start()
        await app.updater.start_polling(poll_interval=0.0, timeout=1)
        tg.push_voice(OGG, duration=5)
        await tg.wait_for("sendDocument")
        await app.updater.stop()
        await app.stop()
    assert got == [OGG]
    assert [(f["filename"], f["data"], f["caption"]) for f in tg.files_sent] == [
        ("echo.ogg", OGG, "your voice")]
    assert len(tg.downloads) == 1 and tg.downloads[0].startswith("voice/")


# ---- FakeDiscord -----------------------------------------------------------------------------

class MediaClient(discord.Client):
    """A discord.Client that collects received messages (and handler errors)."""

    def __init__(self, intents: discord.Intents) -> None:
        super().__init__(intents=intents, guild_ready_timeout=0.1)
        self.received: list[discord.Message] = []
        self.errors: list[str] = []
        self._cond = asyncio.Condition()

    async def on_message(self, message: discord.Message) -> None:
        if self.user is not None and message.author.id == self.user.id:
            return
        async with self._cond:
            self.received.append(message)
            self._cond.notify_all()

    async def on_error(self, event_method: str, /, *args: object, **kwargs: object) -> None:
        import traceback

        self.errors.append(f"{event_method}: {traceback.format_exc()}")

    async def wait_messages(self, n: int, timeout: float = 5.0) -> list[discord.Message]:
        async with self._cond:
            await asyncio.wait_for(self._cond.wait_for(lambda: len(self.received) >= n), timeout)
        return self.received


GUILD_ID, CHANNEL_ID = "700000000000000070", "700000000000000071"


@pytest.fixture
async def dc() -> AsyncIterator[FakeDiscord]:
    async with FakeDiscord() as fake:
        with fake.patch_discord():
            fake.add_guild(GUILD_ID, [CHANNEL_ID])
            yield fake
        assert fake.server_errors == []


@pytest.fixture
async def client(dc: FakeDiscord) -> AsyncIterator[MediaClient]:
    intents = discord.Intents.default()
    intents.message_content = True
    bot = MediaClient(intents)
    task = asyncio.create_task(bot.start(dc.token))
    await dc.wait_identified()
    await asyncio.wait_for(bot.wait_until_ready(), 5.0)
    yield bot
    await bot.close()
    await asyncio.wait_for(task, 5.0)
    assert bot.errors == []


async def test_dm_attachments_are_read_through_discord_py(dc: FakeDiscord, client: MediaClient):
    image, notes = png(64, 48), b"some notes\n"
    payload = await dc.send_dm("two files", attachments=[
        {"filename": "chart.png", "data": image},
        {"filename": "my notes.txt", "data": notes, "content_type": "text/plain; charset=utf-8",
         "size": 12345, "description": "notes"}])
    [message] = await client.wait_messages(1)
    chart, text_file = message.attachments
    assert (chart.filename, chart.content_type, chart.width, chart.height, chart.size) == (
        "chart.png", "image/png", 64, 48, len(image))
    assert (text_file.filename, text_file.title, text_file.size, text_file.description) == (
        "my_notes.txt", "my notes.txt", 12345, "notes")  # Discord sanitises the name
    assert text_file.content_type == "text/plain; charset=utf-8"
    assert chart.url.startswith(f"http://127.0.0.1:{dc.port}/attachments/{message.channel.id}/")
    assert await chart.read() == image
    assert await text_file.read(use_cached=True) == notes  # proxy_url
    assert dc.downloads == [chart.url, text_file.proxy_url]
    assert payload["attachments"][0]["id"] == str(chart.id)

    async with aiohttp.ClientSession() as http, http.get(
            chart.url.replace("chart.png", "other.png")) as response:
        assert response.status == 404
    assert len(dc.downloads) == 2


async def test_voice_message_and_stickers_in_a_guild(dc: FakeDiscord, client: MediaClient):
    await dc.send_guild_message(
        "", GUILD_ID, CHANNEL_ID, flags=IS_VOICE_MESSAGE,
        attachments=[{"filename": "voice-message.ogg", "data": OGG, "content_type": "audio/ogg",
                      "duration_secs": 2.5, "waveform": b"\x00\x80\xff"}])
    await dc.send_guild_message("a sticker", GUILD_ID, CHANNEL_ID,
                                sticker_items=[{"id": "42", "name": "wave", "format_type": 1}])
    voice, sticker = await client.wait_messages(2)
    assert voice.flags.voice and voice.guild is not None
    [attachment] = voice.attachments
    assert attachment.is_voice_message() and attachment.duration == 2.5
    assert attachment.waveform == b"\x00\x80\xff" and attachment.content_type == "audio/ogg"
    assert await attachment.read() == OGG
    [item] = sticker.stickers
    assert (item.id, item.name, item.format) == (42, "wave", discord.StickerFormatType.png)


async def test_channel_send_with_files_creates_downloadable_attachments(
    dc: FakeDiscord, client: MediaClient
) -> None:
    channel = client.get_channel(int(CHANNEL_ID))
    assert isinstance(channel, discord.TextChannel)
    image = png(20, 10)
    sent = await channel.send("here you go", files=[
        discord.File(io.BytesIO(image), filename="plot.png", description="a plot"),
        discord.File(io.BytesIO(b"a,b\n"), filename="data.csv")])
    plot, data = sent.attachments
    assert (plot.filename, plot.content_type, plot.width, plot.height, plot.description) == (
        "plot.png", "image/png", 20, 10, "a plot")
    assert (data.filename, data.content_type, data.size) == ("data.csv", "text/csv", 4)
    assert await plot.read() == image and await data.read() == b"a,b\n"
    assert [(f["channel_id"], f["filename"], f["data"], f["content"], f["message_id"], f["route"])
            for f in dc.files_sent] == [
        (CHANNEL_ID, "plot.png", image, "here you go", str(sent.id), "channel"),
        (CHANNEL_ID, "data.csv", b"a,b\n", "here you go", str(sent.id), "channel")]
    assert dc.messages_sent(CHANNEL_ID) == ["here you go"]
    [request] = dc.matching_calls("POST", rf"/channels/{CHANNEL_ID}/messages")
    assert [f["field"] for f in request.files] == ["files[0]", "files[1]"]

    # a file alone is a valid message; an edit's attachment list keeps only the listed ones
    only_file = await channel.send(file=discord.File(io.BytesIO(b"x"), filename="x.bin"))
    assert only_file.content == "" and only_file.attachments[0].size == 1
    edited = await sent.edit(attachments=[plot])
    assert [a.filename for a in edited.attachments] == ["plot.png"]


async def test_uploads_over_the_limit_are_refused(dc: FakeDiscord, client: MediaClient) -> None:
    dc.upload_limit = 1000
    channel = client.get_channel(int(CHANNEL_ID))
    assert isinstance(channel, discord.TextChannel)
    with pytest.raises(discord.HTTPException) as caught:
        await channel.send(file=discord.File(io.BytesIO(bytes(1001)), filename="big.bin"))
    assert caught.value.status == 413 and caught.value.code == 40005
    assert dc.files_sent == []
    await channel.send(file=discord.File(io.BytesIO(bytes(1000)), filename="ok.bin"))
    assert [f["filename"] for f in dc.files_sent] == ["ok.bin"]


async def test_attachment_objects_given_as_is_still_pass_through(dc: FakeDiscord) -> None:
    raw = {"id": "1", "filename": "a.txt", "size": 1, "url": "https://cdn.example/a.txt",
           "proxy_url": "https://media.example/a.txt"}
    payload = dc.message_payload("hi", "123", attachments=[raw])
    assert payload["attachments"] == [raw] and payload["flags"] == 0
    assert "sticker_items" not in payload


# ---- FakeOpenAI ------------------------------------------------------------------------------

@pytest.fixture
async def llm() -> AsyncIterator[FakeOpenAI]:
    async with FakeOpenAI() as server:
        yield server


@pytest.fixture
async def oai(llm: FakeOpenAI) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=llm.base_url, api_key="sk-test", max_retries=0) as c:
        yield c


async def test_transcriptions_answer_the_queue_then_a_default(llm: FakeOpenAI, oai: openai.AsyncOpenAI):
    llm.push_transcript("hello from a voice note")
    llm.push_transcript_error(400, "Audio file might be corrupted or unsupported")
    first = await oai.audio.transcriptions.create(file=("v.ogg", OGG, "audio/ogg"), model="whisper-1")
    assert first.text == "hello from a voice note"
    with pytest.raises(openai.BadRequestError, match="corrupted or unsupported") as caught:
        await oai.audio.transcriptions.create(file=("v.ogg", OGG, "audio/ogg"), model="whisper-1")
    assert caught.value.status_code == 400
    plain = await oai.audio.transcriptions.create(
        file=("v.mp3", b"ID3", "audio/mpeg"), model="gpt-4o-mini-transcribe",
        response_format="text", language="de", prompt="Bumblebot")
    assert plain == "fake transcript"
    records = await llm.wait_for_transcriptions(3)
    assert [(r["model"], r["filename"], r["data"], r["content_type"], r["response_format"],
             r["status"]) for r in records] == [
        ("whisper-1", "v.ogg", OGG, "audio/ogg", "json", 200),
        ("whisper-1", "v.ogg", OGG, "audio/ogg", "json", 400),
        ("gpt-4o-mini-transcribe", "v.mp3", b"ID3", "audio/mpeg", "text", 200)]
    assert (records[2]["language"], records[2]["prompt"]) == ("de", "Bumblebot")
    assert records[0]["headers"]["Authorization"] == "Bearer sk-test"
    assert llm.requests == []  # chat completions are untouched


async def test_a_second_instance_serves_as_the_transcription_endpoint(llm: FakeOpenAI):
    async with FakeOpenAI() as stt, openai.AsyncOpenAI(
            base_url=stt.base_url, api_key="sk-stt", max_retries=0) as stt_client:
        stt.push_transcript("separate server")
        result = await stt_client.audio.transcriptions.create(
            file=("v.ogg", OGG, "audio/ogg"), model="whisper-1", response_format="verbose_json")
        assert result.text == "separate server"
        assert [r["headers"]["Authorization"] for r in stt.transcriptions] == ["Bearer sk-stt"]
    assert llm.transcriptions == [] and stt.base_url != llm.base_url


async def test_speech_answers_audio_bytes_in_the_asked_format(llm: FakeOpenAI, oai: openai.AsyncOpenAI):
    opus = await oai.audio.speech.create(model="tts-1", input="Hello there", voice="alloy",
                                         response_format="opus")
    assert opus.content.startswith(b"OggS") and opus.response.headers["content-type"] == "audio/ogg"
    mp3 = await oai.audio.speech.create(model="tts-1", input="Hi", voice="nova")
    assert mp3.response.headers["content-type"] == "audio/mpeg" and mp3.content.startswith(b"ID3")
    llm.push_speech(b"OggS scripted", "audio/ogg")
    assert (await oai.audio.speech.create(model="tts-1", input="x", voice="alloy")).content == (
        b"OggS scripted")
    llm.fail_speech(429, "Rate limit reached for tts-1")
    with pytest.raises(openai.RateLimitError, match="Rate limit reached"):
        await oai.audio.speech.create(model="tts-1", input="x", voice="alloy")
    with pytest.raises(openai.BadRequestError, match="4096"):
        await oai.audio.speech.create(model="tts-1", input="x" * 4097, voice="alloy")
    bodies = await llm.wait_for_speech(5)
    assert [(b["model"], b["input"], b["voice"], b.get("response_format")) for b in bodies][:2] == [
        ("tts-1", "Hello there", "alloy", "opus"), ("tts-1", "Hi", "nova", None)]


def _image_request(prompt: str) -> list[dict[str, object]]:
    url = "data:image/png;base64," + base64.b64encode(PNG).decode()
    return [{"role": "user", "content": [{"type": "text", "text": prompt},
                                         {"type": "image_url", "image_url": {"url": url}}]}]


async def test_reject_images_refuses_image_parts_without_using_the_script(
    llm: FakeOpenAI, oai: openai.AsyncOpenAI
) -> None:
    llm.reject_images()
    llm.push(text("described without the image"), when=mentions("what is in it"))
    with pytest.raises(openai.BadRequestError, match="image_url is only supported") as caught:
        await oai.chat.completions.create(model="test-model", messages=_image_request("what is in it"))
    assert caught.value.body["param"] == "messages.[0].content.[1].type"  # type: ignore[index]
    assert llm.pending == 1
    retry = [{"role": "user", "content": [{"type": "text", "text": "what is in it (no image)"}]}]
    answer = await oai.chat.completions.create(model="test-model", messages=retry)
    assert answer.choices[0].message.content == "described without the image"
    first, second = await llm.wait_for_requests(2)
    assert image_parts(first) == [_image_request("")[0]["content"][1]["image_url"]["url"]]  # type: ignore[index]
    assert image_parts(second) == []
    assert [r.status for r in llm.request_log] == [400, 200]
    assert llm.images_rejected == [first] and llm.pending == 0

    llm.accept_images()
    llm.push(text("I see a picture"))
    seen = await oai.chat.completions.create(model="test-model", messages=_image_request("look"))
    assert seen.choices[0].message.content == "I see a picture"


def test_message_helpers_read_content_given_as_parts():
    messages = _image_request("find the bee")
    request = {"messages": messages}
    assert mentions("find the bee")(request) and not mentions("base64")(request)
    assert image_parts(request)[0].startswith("data:image/png;base64,")
    assert sequence_violation(messages) is None
    assert image_parts({"messages": [{"role": "user", "content": "just text"}]}) == []

