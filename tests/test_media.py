"""Media pieces (bumblebot/media/intake.py, bumblebot/llm/images.py): the image token rule, image checks and scaling, the vision
fallback's request rewriting, and a message's files fetched once across a restart (a real
python-telegram-bot client against the fake Bot API, real SQLite)."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from bumblebot.core.errors import MediaError
from bumblebot.core.events import Attachment, AttachmentKind, ChatRef, Inbound, Platform
from bumblebot.core.settings import MediaSettings
from bumblebot.llm import IMAGE_NOT_SHOWN, has_images, without_images
from bumblebot.media import ImageRef, MediaIntake, Prepared, image_tokens, normalise_image
from bumblebot.store import Store


def image_bytes(size: tuple[int, int], fmt: str, mode: str = "RGB") -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, size, (10, 200, 10, 128) if mode == "RGBA" else (10, 200, 10)).save(buffer, fmt)
    return buffer.getvalue()


@pytest.mark.parametrize(
    ("width", "height", "tokens"),
    [
        (1280, 960, 765),  # scaled to 1024×768: 2×2 tiles
        (512, 512, 255),  # one tile
        (4096, 4096, 765),  # 2048 first, then 768×768: 2×2 tiles
        (100, 3000, 85 + 170 * 4),  # 68×2048 (shortest side already under 768): 1×4 tiles
        (None, 600, 765),  # unknown: the 1024×768 estimate
    ],
)
def test_image_tokens_follow_the_published_tile_rule(width, height, tokens):
    assert image_tokens(width, height) == tokens


def test_a_fitting_jpeg_is_kept_as_it_is(tmp_path):
    src = tmp_path / "in"
    data = image_bytes((800, 600), "JPEG")
    src.write_bytes(data)
    path, mime, w, h = normalise_image(src, tmp_path / "out" / "1-0", 1280, 4_000_000)
    assert (path.name, mime, w, h) == ("1-0.jpg", "image/jpeg", 800, 600)
    assert path.read_bytes() == data and not src.exists()


def test_a_large_image_is_scaled_and_a_bmp_converted(tmp_path):
    src = tmp_path / "in"
    src.write_bytes(image_bytes((3000, 1500), "BMP"))
    path, mime, w, h = normalise_image(src, tmp_path / "2-0", 1280, 4_000_000)
    assert (path.suffix, mime, w, h) == (".jpg", "image/jpeg", 1280, 640)
    with Image.open(path) as im:
        assert im.format == "JPEG" and im.size == (1280, 640)


def test_transparency_is_kept_as_png(tmp_path):
    src = tmp_path / "in"
    src.write_bytes(image_bytes((2000, 2000), "PNG", "RGBA"))
    path, mime, w, h = normalise_image(src, tmp_path / "3-0", 1000, 4_000_000)
    assert (path.suffix, mime, w, h) == (".png", "image/png", 1000, 1000)


def test_an_image_over_the_byte_bound_is_shrunk_until_it_fits(tmp_path):
    import random

    rng = random.Random(7)
    noise = Image.frombytes("RGB", (1200, 1200), bytes(rng.getrandbits(8) for _ in range(1200 * 1200 * 3)))
    src = tmp_path / "in"
    noise.save(src, "PNG")
    path, _, w, _ = normalise_image(src, tmp_path / "4-0", 1280, 150_000)
    assert path.stat().st_size <= 150_000 and w < 1200


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"this is not an image at all", "it is not an image I can open"),
        (image_bytes((400, 400), "PNG")[:80], "the image seems to be damaged"),
    ],
)
def test_damaged_or_foreign_files_raise_a_readable_error(tmp_path, data, reason):
    src = tmp_path / "in"
    src.write_bytes(data)
    with pytest.raises(MediaError, match=reason):
        normalise_image(src, tmp_path / "5-0", 1280, 4_000_000)


def test_a_decompression_bomb_is_refused_before_it_is_decoded(tmp_path):
    src = tmp_path / "in"
    Image.new("1", (10000, 10000)).save(src, "PNG")  # tiny file, 100 million pixels
    with pytest.raises(MediaError, match="too large"):
        normalise_image(src, tmp_path / "6-0", 1280, 4_000_000)


def test_prepared_round_trips_through_json():
    p = Prepared(text="[Image 1×1]", images=(ImageRef("a/1-0.jpg", "image/jpeg", 1, 1),), voice=True, document=False,
                 notices=("n",), usable=1, spoken="hi")
    assert Prepared.from_json(p.to_json()) == p
    assert Prepared.from_json(None) == Prepared()


def test_without_images_keeps_the_words_and_says_what_is_missing():
    messages = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": [{"type": "text", "text": "look"},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]},
    ]
    assert has_images(messages) and not has_images(without_images(messages))
    assert without_images(messages)[1]["content"] == f"look\n{IMAGE_NOT_SHOWN}"
    assert without_images(messages)[0] == messages[0]


async def test_files_are_fetched_once_even_when_the_process_stops_before_the_turn(tmp_path):
    """A restart between fetching a message's files and the turn taking it reads what the
    journal recorded (``journal.media``): no second getFile, no second download."""
    from conftest import TOKEN
    from fakes.telegram_server import FakeTelegram

    from adapters.telegram import TelegramAdapter
    from bumblebot.core.settings import TelegramSettings

    class NoIntake:
        accepting = True

    data = image_bytes((300, 200), "PNG")
    async with FakeTelegram(token=TOKEN) as tg, Store(tmp_path / "b.db") as store:
        file_id = tg.add_file(data)
        settings = TelegramSettings(base_url=tg.base_url, base_file_url=tg.base_file_url)
        adapter = TelegramAdapter(NoIntake(), settings, TOKEN)  # type: ignore[arg-type]
        await adapter.app.initialize()
        try:
            inbound = Inbound(ChatRef(Platform.TELEGRAM, "7"), "1", "7", "Ann", "caption",
                              attachments=(Attachment(AttachmentKind.IMAGE, file_id, "photo.jpg", "image/jpeg", len(data)),))
            await store.journal(inbound)

            def intake() -> MediaIntake:  # what each process builds at start
                m = MediaIntake(MediaSettings(), store=store, media_dir=tmp_path / "media", workspace=tmp_path / "ws", speech=None)
                m.register(adapter)
                return m

            [first] = await intake().prepare(await store.pending_inbound())
            [again] = await intake().prepare(await store.pending_inbound())  # "after the restart"
        finally:
            await adapter.app.shutdown()
        assert len(tg.get_file_calls) == 1 and len(tg.downloads) == 1
        assert again.media == first.media and Prepared.from_json(first.media).images[0].width == 300
        assert (tmp_path / "media" / Prepared.from_json(first.media).images[0].path).read_bytes() == data
