"""Documents people send (bumblebot/media/documents.py) and read_file on a PDF (tools/files.py)."""

from __future__ import annotations

import errno
import io
import json
import os
import random
import threading
import unicodedata
from pathlib import Path
from typing import Any

import pypdf
import pytest

import tools.files as file_tools
from bumblebot.core.toolkit import ToolContext, ToolResult
from bumblebot.media import documents, names
from bumblebot.media.documents import DocumentError, describe_size, excerpt, pdf_text
from bumblebot.media.kinds import is_pdf, sniff
from bumblebot.media.names import MAX_NAME_BYTES, place, safe_name
from tools.files import FILE_TOOLS
from tools.registry import Registry

# -- a PDF written by hand ------------------------------------------------------------------


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)")


def make_pdf(pages: list[str]) -> bytes:
    """A PDF 1.4 file with one page per item, each showing its lines in Helvetica (an empty
    item is a page with no text, like a scan); the xref offsets are computed, not guessed."""
    kids = " ".join(f"{4 + 2 * i} 0 R" for i in range(len(pages)))
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        f"<< /Type /Pages /Kids [{kids}] /Count {len(pages)} >>".encode(),
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica /Encoding /WinAnsiEncoding >>",
    ]
    for i, text in enumerate(pages):
        objects.append(
            f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] "
            f"/Resources << /Font << /F1 3 0 R >> >> /Contents {5 + 2 * i} 0 R >>".encode()
        )
        shown = " ".join(f"({_escape(line)}) Tj T*" for line in text.split("\n")) if text else ""
        stream = f"BT /F1 12 Tf 14 TL 72 720 Td {shown} ET".encode("latin-1") if text else b""
        objects.append(b"<< /Length %d >>\nstream\n%s\nendstream" % (len(stream), stream))
    out = bytearray(b"%PDF-1.4\n%\xe2\xe3\xcf\xd3\n")
    offsets = []
    for number, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n%s\nendobj\n" % (number, body)
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % offset for offset in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    return bytes(out)


def encrypted(pdf: bytes, user_password: str) -> bytes:
    writer = pypdf.PdfWriter(clone_from=pypdf.PdfReader(io.BytesIO(pdf)))
    writer.encrypt(user_password=user_password, owner_password="owner", algorithm="RC4-128")
    out = io.BytesIO()
    writer.write(out)
    return out.getvalue()


THREE_PAGES = ["Hello PDF world\nsecond line (with parens)", "Page two text", "Caf\xe9 page three"]


def test_the_hand_written_pdf_is_valid() -> None:
    reader = pypdf.PdfReader(io.BytesIO(make_pdf(THREE_PAGES)), strict=True)  # strict: exact xref
    assert len(reader.pages) == 3
    assert reader.pages[2].extract_text().strip() == "Caf\xe9 page three"


# -- safe_name ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("report.pdf", "report.pdf"),
        ("../../etc/passwd", "passwd"),
        ("..\\..\\Windows\\win.ini", "win.ini"),
        ("C:\\Users\\me\\notes.txt", "notes.txt"),
        ("dir/", "dir"),
        ("..", "file"),
        (".", "file"),
        ("", "file"),
        ("   ", "file"),
        ("/", "file"),
        ("\x00\x01\x7f", "file"),
        ("con.txt", "_con.txt"),
        ("CON", "_CON"),
        ("Nul.tar.gz", "_Nul.tar.gz"),
        ("aux .txt", "_aux .txt"),
        ("com1", "_com1"),
        ("LPT9.log", "_LPT9.log"),
        ("console.txt", "console.txt"),
        ("com10.txt", "com10.txt"),
        ("a\nb\x00c.txt", "a bc.txt"),
        ("line\r\nbreak\ttab.md", "line break tab.md"),
        ('what?<a>:"b"|c*.csv', "whatabc.csv"),
        ("report : final.pdf", "report final.pdf"),
        ("  .hidden. . ", "hidden"),
        (".bashrc", "bashrc"),
        ("???.pdf", "file.pdf"),
        ("***.tar.gz", "file.tar.gz"),
        ("invoice\u202efdp.exe", "invoicefdp.exe"),
        ("e\u0301te\u0301.txt", "\u00e9t\u00e9.txt"),  # NFC
        ("r\u00e9sum\u00e9 \U0001f600.docx", "r\u00e9sum\u00e9 \U0001f600.docx"),
    ],
)
def test_safe_name(raw: str, expected: str) -> None:
    assert safe_name(raw) == expected


def test_safe_name_fallback_is_made_safe_too() -> None:
    assert safe_name("..", fallback="document") == "document"
    assert safe_name("???.pdf", fallback="upload") == "upload.pdf"
    assert safe_name("", fallback="../..") == "file"
    assert safe_name("", fallback="con") == "_con"


def test_safe_name_caps_bytes_and_keeps_the_extension() -> None:
    long_pdf = safe_name("a" * 300 + ".pdf")
    assert long_pdf == "a" * (MAX_NAME_BYTES - 4) + ".pdf"
    assert safe_name("b" * 300) == "b" * MAX_NAME_BYTES
    assert safe_name("c" * 300 + ".tar.gz") == "c" * (MAX_NAME_BYTES - 7) + ".tar.gz"
    # an "extension" with spaces or too long is part of the stem
    assert safe_name("d" * 200 + ". not an extension") == "d" * MAX_NAME_BYTES
    # the cut never leaves trailing dots or spaces
    assert safe_name("e" * 115 + " . . . . . . .x") == "e" * 115 + ".x"


def test_safe_name_never_cuts_inside_a_character_or_an_emoji() -> None:
    smiley = "\U0001f600"  # 4 bytes
    name = safe_name(smiley * 40 + ".pdf")
    assert name == smiley * ((MAX_NAME_BYTES - 4) // 4) + ".pdf"
    accented = safe_name("\u00e9" * 100 + ".txt")  # 2 bytes each: 116 / 2 = 58
    assert accented == "\u00e9" * 58 + ".txt"
    family = "\U0001f468\u200d\U0001f469\u200d\U0001f467\u200d\U0001f466"  # 25 bytes, one cluster
    cut = safe_name(family * 10 + ".txt")
    assert cut == family * 4 + ".txt"
    flags = "\U0001f1eb\U0001f1f7" * 30  # regional indicator pairs, 8 bytes each
    assert safe_name(flags) == "\U0001f1eb\U0001f1f7" * (MAX_NAME_BYTES // 8)
    odd = safe_name("x" + smiley * 40)  # 1 + 4k bytes: the cut lands between characters
    assert len(odd.encode()) <= MAX_NAME_BYTES and odd.encode().decode() == odd


HOSTILE_ALPHABET = (
    list('./\\<>:"|?* \t\n\r\x00\x01\x1f\x7f\x85\u200b\u202e\u00a0\u0301')
    + ["a", "Z", "9", "-", "_", "\u00e9", "e\u0301", "\U0001f600", "\u200d", "\ud800", "CON", "lpt1"]
)


def test_safe_name_properties_on_random_hostile_names() -> None:
    rng = random.Random(20240917)
    for _ in range(2000):
        raw = "".join(rng.choice(HOSTILE_ALPHABET) for _ in range(rng.randint(0, 140)))
        name = safe_name(raw)
        assert name and len(name.encode("utf-8")) <= MAX_NAME_BYTES, raw
        assert not set(name) & set('<>:"/\\|?*'), raw
        assert all(unicodedata.category(c) not in ("Cc", "Cs") for c in name), raw
        assert name[0] not in ". " and name[-1] not in ". ", raw
        assert name == unicodedata.normalize("NFC", name), raw
        assert name.split(".", 1)[0].rstrip().upper() not in names._RESERVED, raw
        assert safe_name(name) == name, raw  # idempotent


# -- place ----------------------------------------------------------------------------------


def download(directory: Path, data: bytes, token: str = "dl") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    partial = directory / f".{token}.partial"
    partial.write_bytes(data)
    return partial


def listing(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_place_moves_the_download_under_its_safe_name(tmp_path: Path) -> None:
    inbox = tmp_path / "ws" / "inbox"
    source = download(tmp_path / "ws" / "inbox", b"%PDF-1.4 report")
    placed = place(inbox, "../../report.pdf", source)
    assert placed == inbox / "report.pdf"
    assert listing(inbox) == {"report.pdf": b"%PDF-1.4 report"}
    assert not (tmp_path / "report.pdf").exists()


def test_place_creates_the_directory(tmp_path: Path) -> None:
    source = tmp_path / ".x.partial"
    source.write_bytes(b"data")
    placed = place(tmp_path / "a" / "b", "notes.txt", source)
    assert placed.read_bytes() == b"data" and placed.parent == tmp_path / "a" / "b"
    assert not source.exists()


def test_place_suffixes_collisions_and_keeps_double_extensions(tmp_path: Path) -> None:
    inbox = tmp_path / "inbox"
    names = [place(inbox, "report.pdf", download(inbox, f"v{i}".encode())).name for i in range(3)]
    assert names == ["report.pdf", "report-1.pdf", "report-2.pdf"]
    logs = [place(inbox, "logs.tar.gz", download(inbox, f"t{i}".encode())).name for i in range(2)]
    assert logs == ["logs.tar.gz", "logs-1.tar.gz"]
    plain = [place(inbox, "README", download(inbox, f"r{i}".encode())).name for i in range(2)]
    assert plain == ["README", "README-1"]
    assert len(listing(inbox)) == 7 and not any(n.endswith(".partial") for n in listing(inbox))


def test_place_keeps_suffixed_long_names_under_the_cap(tmp_path: Path) -> None:
    inbox = tmp_path / "inbox"
    first = place(inbox, "a" * 300 + ".pdf", download(inbox, b"one"))
    second = place(inbox, "a" * 300 + ".pdf", download(inbox, b"two"))
    assert first.name == "a" * 116 + ".pdf"
    assert second.name == "a" * 114 + "-1.pdf"
    assert len(second.name.encode()) == MAX_NAME_BYTES
    third = place(inbox, "a" * 300 + ".pdf", download(inbox, b"two"))
    assert third == second  # found again among the variants


def test_place_reuses_identical_bytes_and_deletes_the_download(tmp_path: Path) -> None:
    inbox = tmp_path / "inbox"
    first = place(inbox, "photo.jpg", download(inbox, b"\xff\xd8\xff same"))
    again = download(inbox, b"\xff\xd8\xff same", token="retry")
    assert place(inbox, "photo.jpg", again) == first
    assert not again.exists()
    assert listing(inbox) == {"photo.jpg": b"\xff\xd8\xff same"}


def test_place_reuses_a_numbered_variant_with_identical_bytes(tmp_path: Path) -> None:
    inbox = tmp_path / "inbox"
    (inbox).mkdir()
    (inbox / "a.txt").write_bytes(b"first")
    (inbox / "a-2.txt").write_bytes(b"wanted")  # a gap: a-1.txt was deleted
    assert place(inbox, "a.txt", download(inbox, b"wanted")) == inbox / "a-2.txt"
    # same size, other bytes: the hash tells them apart
    assert place(inbox, "a.txt", download(inbox, b"wantee")) == inbox / "a-1.txt"
    assert listing(inbox) == {"a-1.txt": b"wantee", "a-2.txt": b"wanted", "a.txt": b"first"}


def test_place_never_reuses_or_follows_a_symlink(tmp_path: Path) -> None:
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"same")
    (inbox / "x.txt").symlink_to(outside)
    placed = place(inbox, "x.txt", download(inbox, b"same"))
    assert placed == inbox / "x-1.txt" and not placed.is_symlink()
    assert outside.read_bytes() == b"same"
    link = inbox / ".link.partial"
    link.symlink_to(outside)
    with pytest.raises(ValueError, match="not a regular file"):
        place(inbox, "y.txt", link)


def test_place_of_a_file_already_at_its_name_keeps_it(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_bytes(b"here")
    assert place(tmp_path, "a.txt", tmp_path / "a.txt") == tmp_path / "a.txt"
    assert (tmp_path / "a.txt").read_bytes() == b"here"


def test_place_loses_a_race_without_overwriting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another placer creates the name between the directory scan and the link."""
    inbox = tmp_path / "inbox"
    real_link = os.link
    raced: list[Path] = []

    def link_after_a_rival(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        if not raced:
            raced.append(Path(dst))
            Path(dst).write_bytes(b"the rival's document")
        real_link(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "link", link_after_a_rival)
    placed = place(inbox, "doc.pdf", download(inbox, b"my document"))
    assert raced == [inbox / "doc.pdf"]
    assert placed == inbox / "doc-1.pdf"
    assert listing(inbox) == {"doc-1.pdf": b"my document", "doc.pdf": b"the rival's document"}


def test_place_race_with_identical_bytes_keeps_one_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    inbox = tmp_path / "inbox"
    real_link = os.link

    def link_after_a_twin(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        if not Path(dst).exists():
            Path(dst).write_bytes(b"same bytes")
        real_link(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "link", link_after_a_twin)
    source = download(inbox, b"same bytes")
    assert place(inbox, "doc.pdf", source) == inbox / "doc.pdf"
    assert listing(inbox) == {"doc.pdf": b"same bytes"} and not source.exists()


def test_concurrent_places_of_one_name_all_survive(tmp_path: Path) -> None:
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    count = 8
    sources = [download(inbox, f"content {i}".encode(), token=f"d{i}") for i in range(count)]
    twins = [download(inbox, b"twin", token=f"t{i}") for i in range(count)]
    barrier = threading.Barrier(2 * count)
    results: list[Path] = []
    errors: list[BaseException] = []

    def run(name: str, source: Path) -> None:
        try:
            barrier.wait()
            results.append(place(inbox, name, source))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=("same.txt", s)) for s in sources]
    threads += [threading.Thread(target=run, args=("twin.txt", s)) for s in twins]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    files = listing(inbox)
    assert sorted(v for k, v in files.items() if k.startswith("same")) == sorted(
        f"content {i}".encode() for i in range(count)
    )
    assert [k for k in files if k.startswith("twin")] == ["twin.txt"]  # one copy of equal bytes
    assert not any(k.endswith(".partial") for k in files)


def test_place_without_hard_links_still_never_overwrites(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_links(*_args: Any, **_kwargs: Any) -> None:
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    inbox = tmp_path / "inbox"
    names = [place(inbox, "a.txt", download(inbox, f"{i}".encode())).name for i in range(2)]
    assert names == ["a.txt", "a-1.txt"]
    assert listing(inbox) == {"a-1.txt": b"1", "a.txt": b"0"}


def test_place_copies_a_download_from_another_file_system(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    elsewhere = tmp_path / "tmp" / "download.bin"
    elsewhere.parent.mkdir()
    elsewhere.write_bytes(b"remote bytes")
    real_link = os.link

    def cross_device(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        if Path(src) == elsewhere:
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        real_link(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "link", cross_device)
    inbox = tmp_path / "inbox"
    assert place(inbox, "x.bin", elsewhere) == inbox / "x.bin"
    assert listing(inbox) == {"x.bin": b"remote bytes"} and not elsewhere.exists()


# -- sniff ----------------------------------------------------------------------------------


PNG = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR"


@pytest.mark.parametrize(
    ("data", "mime", "name", "kind"),
    [
        (make_pdf(["x"]), "application/octet-stream", "upload", "pdf"),
        (b"junk before\n\x00\x01" + make_pdf(["x"]), None, "a.pdf", "pdf"),
        (PNG, "text/plain", "notes.txt", "image"),  # the claim is only a hint
        (b"\xff\xd8\xff\xe0\x00\x10JFIF", None, "x", "image"),
        (b"GIF89a\x01\x00", None, "x", "image"),
        (b"RIFF\x10\x00\x00\x00WEBPVP8 ", None, "x", "image"),
        (b"\x00\x00\x00\x18ftypheic\x00\x00", None, "x", "image"),
        (b"OggS\x00\x02" + b"\x00" * 22 + b"\x01vorbis", "audio/ogg", "voice.oga", "audio"),
        (b"OggS\x00\x02" + b"\x00" * 22 + b"\x80theora", None, "x", "video"),
        (b"ID3\x04\x00\x00\x00\x00", None, "x", "audio"),
        (b"\xff\xfb\x90\x64" + b"\x55" * 100, None, "x", "audio"),
        (b"RIFF\x24\x00\x00\x00WAVEfmt ", None, "x", "audio"),
        (b"\x00\x00\x00\x20ftypisom\x00\x00", None, "x", "video"),
        (b"\x1a\x45\xdf\xa3\x9f", None, "x", "video"),
        (b"PK\x03\x04\x14\x00", "application/pdf", "report.pdf", "archive"),
        (b"PK\x03\x04\x14\x00", None, "letter.docx", "archive"),
        (b"\x1f\x8b\x08\x00", None, "x", "archive"),
        (b"\x7fELF\x02\x01\x01", "image/png", "cat.png", "binary"),
        (bytes(range(256)) * 4, "image/png", "cat.png", "image"),  # unknown bytes: the hint
        (bytes(range(256)) * 4, "application/pdf", "x.pdf", "binary"),  # never pdf by claim
        (bytes(range(256)) * 4, None, "x", "binary"),
        (b"hello world\n", "application/octet-stream", "x.bin", "text"),
        (b'{"a": 1}\n', "application/json", "data.json", "text"),
        ("\u65e5\u672c\u8a9e\n".encode(), None, "x", "text"),
        ("caf\xe9;1\n".encode("cp1252"), "text/csv; charset=windows-1252", "a", "text"),
        ("caf\xe9;1\n".encode("cp1252"), None, "prices.csv", "text"),
        ("caf\xe9;1\n".encode("cp1252"), None, "upload", "binary"),  # not UTF-8, no claim
        ("\ufeffBOM text\n".encode("utf-8"), None, "x", "text"),
        ("\ufeffUTF-16 text\n".encode("utf-16-le"), None, "x", "text"),
        (b"text\x00with a NUL", "text/plain", "a.txt", "binary"),
        (b"\x01\x02\x03\x04\x05 mostly controls", "text/plain", "a.txt", "binary"),
        (b"", "image/png", "empty.png", "text"),
        (b"# About PDFs\nA header looks like %PDF-1.7.\n", None, "notes.md", "text"),
        (b"BMW annual report\n", None, "x.txt", "text"),
        (b"ID3 tags explained\n", None, "x.txt", "text"),
    ],
)
def test_sniff(tmp_path: Path, data: bytes, mime: str | None, name: str, kind: str) -> None:
    path = tmp_path / "f"
    path.write_bytes(data)
    assert sniff(path, mime, name) == kind


def test_sniff_text_with_a_character_across_the_8k_boundary(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"a" * (documents.SNIFF_BYTES - 1) + "\u00e9 more".encode())
    assert sniff(path, None, "f") == "text"
    path.write_bytes(b"a" * (documents.SNIFF_BYTES - 1) + b"\xc3")  # the file ends inside one
    assert sniff(path, None, "f") == "binary"


def test_is_pdf() -> None:
    assert is_pdf(b"%PDF-1.7\n")
    assert is_pdf(b"\x00junk%PDF-1.4")
    assert not is_pdf(b"x" * 1024 + b"%PDF-1.4")
    assert not is_pdf(b"plain text mentioning %PDF-1.4\n")


# -- excerpt --------------------------------------------------------------------------------


def test_excerpt_cuts_multibyte_text_exactly(tmp_path: Path) -> None:
    path = tmp_path / "t.txt"
    path.write_text("\u00e9" * 100 + "\U0001f600" * 100, encoding="utf-8")
    assert excerpt(path, 10) == ("\u00e9" * 10, True)
    assert excerpt(path, 105) == ("\u00e9" * 100 + "\U0001f600" * 5, True)
    assert excerpt(path, 200) == ("\u00e9" * 100 + "\U0001f600" * 100, False)
    assert excerpt(path, 5000) == ("\u00e9" * 100 + "\U0001f600" * 100, False)


def test_excerpt_prefers_a_newline_in_the_last_fifth(tmp_path: Path) -> None:
    path = tmp_path / "t.txt"
    path.write_text("a" * 85 + "\r\n" + "b" * 50)
    assert excerpt(path, 100) == ("a" * 85, True)
    path.write_text("a" * 50 + "\n" + "b" * 100)
    assert excerpt(path, 100) == ("a" * 50 + "\n" + "b" * 49, True)  # newline too early


def test_excerpt_reads_only_the_start(tmp_path: Path) -> None:
    path = tmp_path / "log.txt"
    path.write_bytes(b"line\n" * 3000 + b"\x00\x00 binary tail" * 1000)
    assert excerpt(path, 10) == ("line\nline", True)


def test_excerpt_decodes_boms_and_legacy_bytes(tmp_path: Path) -> None:
    path = tmp_path / "t.txt"
    path.write_bytes("h\u00e9llo".encode("utf-16"))  # with its BOM
    assert excerpt(path, 100) == ("h\u00e9llo", False)
    path.write_bytes("\ufeffh\u00e9llo".encode("utf-8"))
    assert excerpt(path, 100) == ("h\u00e9llo", False)
    path.write_bytes("caf\xe9".encode("cp1252"))
    assert excerpt(path, 100) == ("caf\ufffd", False)
    path.write_bytes(b"")
    assert excerpt(path, 100) == ("", False)
    with pytest.raises(ValueError):
        excerpt(path, -1)


@pytest.mark.parametrize("data", [PNG, b"abc\x00def", make_pdf(["x"]), b"PK\x03\x04zip"])
def test_excerpt_refuses_binary_files(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "blob"
    path.write_bytes(data)
    with pytest.raises(DocumentError, match="not text"):
        excerpt(path, 100)


# -- pdf_text -------------------------------------------------------------------------------


def write_pdf(tmp_path: Path, data: bytes, name: str = "doc.pdf") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def test_pdf_text_single_page(tmp_path: Path) -> None:
    text, pages, cut = pdf_text(write_pdf(tmp_path, make_pdf(["Hello PDF world"])))
    assert (text, pages, cut) == ("Hello PDF world", 1, False)


def test_pdf_text_multi_page(tmp_path: Path) -> None:
    text, pages, cut = pdf_text(write_pdf(tmp_path, make_pdf(THREE_PAGES)))
    assert pages == 3 and not cut
    assert text == (
        "Hello PDF world\nsecond line (with parens)"
        "\n\n--- page 2 ---\n\nPage two text"
        "\n\n--- page 3 ---\n\nCaf\xe9 page three"
    )
    with open(tmp_path / "doc.pdf", "rb") as fh:  # a file object works too
        assert pdf_text(fh) == (text, 3, False)


def test_pdf_text_limits(tmp_path: Path) -> None:
    path = write_pdf(tmp_path, make_pdf(THREE_PAGES))
    text, pages, cut = pdf_text(path, max_pages=2)
    assert pages == 3 and cut and "Page two text" in text and "page three" not in text
    text, pages, cut = pdf_text(path, max_chars=20)
    assert (text, pages, cut) == ("Hello PDF world\nseco", 3, True)
    full, _, _ = pdf_text(path)
    assert pdf_text(path, max_chars=len(full)) == (full, 3, False)
    with pytest.raises(ValueError):
        pdf_text(path, max_pages=0)


def test_pdf_text_without_text_is_empty(tmp_path: Path) -> None:
    assert pdf_text(write_pdf(tmp_path, make_pdf(["", ""]))) == ("", 2, False)


def test_pdf_text_encrypted(tmp_path: Path) -> None:
    locked = write_pdf(tmp_path, encrypted(make_pdf(THREE_PAGES), "secret"), "locked.pdf")
    with pytest.raises(DocumentError, match="^the PDF is password-protected$"):
        pdf_text(locked)
    # an owner password only (no password to open it): read with the empty one
    opened = write_pdf(tmp_path, encrypted(make_pdf(["Open me"]), ""), "open.pdf")
    assert pdf_text(opened) == ("Open me", 1, False)


def test_pdf_text_encryption_it_cannot_open(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def needs_cryptography(self: pypdf.PdfReader, password: str) -> None:
        raise pypdf.errors.DependencyError("cryptography>=3.1 is required for AES algorithm")

    monkeypatch.setattr(pypdf.PdfReader, "decrypt", needs_cryptography)
    path = write_pdf(tmp_path, encrypted(make_pdf(["x"]), ""))
    with pytest.raises(DocumentError, match="encryption this bot cannot open"):
        pdf_text(path)


@pytest.mark.parametrize(
    "data",
    [
        make_pdf(THREE_PAGES)[:300],
        make_pdf(THREE_PAGES)[:-40],
        b"%PDF-1.4\n" + bytes(range(256)) * 20,
        b"%PDF-",
        b"",
    ],
    ids=["truncated-early", "truncated-late", "garbage", "header-only", "empty"],
)
def test_pdf_text_corrupt(tmp_path: Path, data: bytes) -> None:
    with pytest.raises(DocumentError, match="^the PDF could not be read: "):
        pdf_text(write_pdf(tmp_path, data))


def test_pdf_text_broken_pages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = pypdf.PageObject.extract_text
    broken = {"Page two text"}

    def extract(self: pypdf.PageObject, *args: Any, **kwargs: Any) -> str:
        text = real(self, *args, **kwargs)
        if "*" in broken or text.strip() in broken:
            raise KeyError("/Resources")
        return text

    monkeypatch.setattr(pypdf.PageObject, "extract_text", extract)
    path = write_pdf(tmp_path, make_pdf(THREE_PAGES))
    text, pages, cut = pdf_text(path)
    assert (pages, cut) == (3, False)
    assert text.endswith("--- page 2 ---\n\n[page 2 could not be read]\n\n--- page 3 ---\n\nCaf\xe9 page three")
    broken.add("*")  # every page fails: the PDF is corrupt
    with pytest.raises(DocumentError, match="could not be read: '/Resources'"):
        pdf_text(path)


def test_a_reader_failure_without_words_is_told_without_the_exception_s_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reason of a failure whose message is empty was the exception's name ("the PDF could
    not be read: IndexError"), and the user read it."""

    def extract(self: pypdf.PageObject, *args: Any, **kwargs: Any) -> str:
        raise IndexError

    monkeypatch.setattr(pypdf.PageObject, "extract_text", extract)
    with pytest.raises(DocumentError) as raised:
        pdf_text(write_pdf(tmp_path, make_pdf(THREE_PAGES)))
    assert str(raised.value) == "the PDF could not be read: it seems damaged"


# -- describe_size --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "shown"),
    [
        (0, "0 bytes"),
        (1, "1 byte"),
        (812, "812 bytes"),
        (1023, "1023 bytes"),
        (1024, "1 KB"),
        (14_541, "14.2 KB"),
        (1024 * 1024 - 1, "1 MB"),  # would round to 1024.0 KB
        (3_565_158, "3.4 MB"),
        (int(1.5 * 1024**3), "1.5 GB"),
        (3 * 1024**4, "3 TB"),
    ],
)
def test_describe_size(n: int, shown: str) -> None:
    assert describe_size(n) == shown


def test_describe_size_refuses_negative() -> None:
    with pytest.raises(ValueError):
        describe_size(-1)


# -- read_file on a PDF ---------------------------------------------------------------------


@pytest.fixture
def ctx(tmp_path: Path) -> ToolContext:
    workspace = tmp_path / "ws"
    (workspace / "inbox").mkdir(parents=True)
    return ToolContext(workspace=workspace.resolve(), data_dir=tmp_path / "data")


@pytest.fixture
def files() -> Registry:
    return Registry(FILE_TOOLS, max_result_chars=200_000)


async def read(files: Registry, ctx: ToolContext, **args: Any) -> ToolResult:
    return await files.execute("read_file", json.dumps(args), ctx)


async def test_read_file_returns_the_text_of_a_pdf(files: Registry, ctx: ToolContext) -> None:
    (ctx.workspace / "inbox" / "report.pdf").write_bytes(make_pdf(THREE_PAGES))
    result = await read(files, ctx, path="inbox/report.pdf")
    assert result.ok
    assert result.content == (
        "[text extracted from a PDF of 3 pages]\n"
        "Hello PDF world\nsecond line (with parens)\n\n--- page 2 ---\n\nPage two text"
        "\n\n--- page 3 ---\n\nCaf\xe9 page three"
    )


async def test_read_file_knows_a_pdf_by_its_content(files: Registry, ctx: ToolContext) -> None:
    (ctx.workspace / "upload.bin").write_bytes(make_pdf(["One page"]))
    result = await read(files, ctx, path="upload.bin")
    assert result.content == "[text extracted from a PDF of 1 page]\nOne page"
    (ctx.workspace / "fake.pdf").write_text("not a PDF at all\n")
    assert (await read(files, ctx, path="fake.pdf")).content == "not a PDF at all\n"


async def test_read_file_pages_the_extracted_text(files: Registry, ctx: ToolContext) -> None:
    (ctx.workspace / "r.pdf").write_bytes(make_pdf(THREE_PAGES))
    result = await read(files, ctx, path="r.pdf", offset_line=3, max_lines=3, line_numbers=True)
    assert result.content.splitlines() == [
        "[text extracted from a PDF of 3 pages]",
        "     3\t",
        "     4\t--- page 2 ---",
        "     5\t",
        "[... showed lines 3-5 of r.pdf; continue with offset_line=6]",
    ]
    result = await read(files, ctx, path="r.pdf", offset_line=100)
    assert not result.ok and "past the end of r.pdf" in result.content


async def test_read_file_on_a_pdf_without_text(files: Registry, ctx: ToolContext) -> None:
    (ctx.workspace / "scan.pdf").write_bytes(make_pdf(["", ""]))
    result = await read(files, ctx, path="scan.pdf")
    assert result == ToolResult(
        "scan.pdf is a PDF of 2 pages with no extractable text; it may be scanned images"
    )


async def test_read_file_on_broken_pdfs_is_a_tool_error(files: Registry, ctx: ToolContext) -> None:
    (ctx.workspace / "broken.pdf").write_bytes(make_pdf(THREE_PAGES)[:300])
    result = await read(files, ctx, path="broken.pdf")
    assert not result.ok
    assert json.loads(result.content)["error"].startswith("broken.pdf: the PDF could not be read: ")
    (ctx.workspace / "locked.pdf").write_bytes(encrypted(make_pdf(["x"]), "secret"))
    result = await read(files, ctx, path="locked.pdf")
    assert not result.ok
    assert json.loads(result.content) == {"error": "locked.pdf: the PDF is password-protected"}


async def test_read_file_caches_the_extraction(
    files: Registry, ctx: ToolContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    real = file_tools.pdf_text_bounded

    def counting(*args: Any, **kwargs: Any) -> tuple[str, int, bool]:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(file_tools, "pdf_text_bounded", counting)
    path = ctx.workspace / "r.pdf"
    path.write_bytes(make_pdf(THREE_PAGES))
    first = await read(files, ctx, path="r.pdf", max_lines=2)
    second = await read(files, ctx, path="r.pdf", offset_line=3)
    assert first.ok and second.ok and len(calls) == 1
    path.write_bytes(make_pdf(["Replaced text, longer than before"]))
    result = await read(files, ctx, path="r.pdf")
    assert len(calls) == 2 and "Replaced text" in result.content
    broken = ctx.workspace / "b.pdf"
    broken.write_bytes(b"%PDF-1.4 nothing")
    for _ in range(2):
        assert not (await read(files, ctx, path="b.pdf")).ok
    assert len(calls) == 4  # a failure is not cached


def test_the_pdf_cache_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(file_tools, "_pdf_cache", type(file_tools._pdf_cache)())
    monkeypatch.setattr(file_tools, "PDF_CACHE_ENTRIES", 2)
    for i in range(4):
        path = tmp_path / f"{i}.pdf"
        path.write_bytes(make_pdf([f"document {i}"]))
        with open(path, "rb") as fh:
            assert file_tools._extract_pdf(fh, path)[0] == f"document {i}"
    assert [key[0] for key in file_tools._pdf_cache] == [str(tmp_path / "2.pdf"), str(tmp_path / "3.pdf")]


async def test_read_file_pdf_stays_confined(files: Registry, ctx: ToolContext, tmp_path: Path) -> None:
    secret = tmp_path / "secret.pdf"
    secret.write_bytes(make_pdf(["top secret"]))
    (ctx.workspace / "link.pdf").symlink_to(secret)
    for path in ("link.pdf", "../secret.pdf", str(secret)):
        result = await read(files, ctx, path=path)
        assert not result.ok and "path escapes the workspace" in result.content
        assert "top secret" not in result.content


def slow_pdf(pages: int, operators: int) -> bytes:
    """A small PDF whose pages share one compressed content stream of many empty text
    operators: tiny on disk, seconds of pypdf work per page."""
    import zlib

    stream = zlib.compress(b"BT /F1 12 Tf 72 720 Td " + b"( ) Tj " * operators + b"ET", 9)
    kids = " ".join(f"{5 + i} 0 R" for i in range(pages))
    bodies = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        f"<< /Type /Pages /Kids [{kids}] /Count {pages} >>".encode(),
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
        b"<< /Length %d /Filter /FlateDecode >>\nstream\n%s\nendstream" % (len(stream), stream),
        *[b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Resources << /Font << /F1 3 0 R >> >>"
          b" /Contents 4 0 R >>"] * pages,
    ]
    out, offsets = bytearray(b"%PDF-1.4\n"), []
    for number, body in enumerate(bodies, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n%s\nendobj\n" % (number, body)
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(bodies) + 1) + b"".join(b"%010d 00000 n \n" % o for o in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(bodies) + 1, xref)
    return bytes(out)


def test_a_pdf_that_takes_too_long_is_given_up_and_its_worker_killed(tmp_path: Path) -> None:
    """An 8 KB PDF whose pages share one content stream of text operators (pypdf took 9 s a page,
    holding a thread of the daemon for minutes) is given up and its worker killed."""
    from bumblebot.media.documents import pdf_text_bounded

    path = tmp_path / "slow.pdf"
    path.write_bytes(slow_pdf(3, 200_000))
    assert path.stat().st_size < 20_000
    with pytest.raises(DocumentError, match="took too long to read"):
        pdf_text_bounded(path, timeout_s=0.5)
    quick = tmp_path / "quick.pdf"
    quick.write_bytes(make_pdf(["quick"]))
    text, pages, cut = pdf_text_bounded(quick)
    assert (text.strip(), pages, cut) == ("quick", 1, False)


def test_the_pdf_reader_process_does_not_import_the_intake_or_the_model_client():
    """The reader runs as ``python -m bumblebot.media.documents``; when the media package's front
    page imported the intake (and openai behind it), each PDF read paid about a second of
    imports first, and a read on a busy machine ran past its wait."""
    import subprocess
    import sys

    probe = "import sys, bumblebot.media.documents; print(sorted(m for m in ('openai', 'bumblebot.media.intake') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
