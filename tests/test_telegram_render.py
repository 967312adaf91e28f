"""Telegram rendering and splitting of the model's Markdown (pure logic)."""

from __future__ import annotations

from adapters.telegram.render import render_chunks
from bumblebot.delivery.splitting import utf16_len


def test_long_markdown_splits_within_the_limit_with_entities_in_bounds():
    code = "\n".join(f"print({i})  # 😀 line" for i in range(300))
    text = "**Intro** paragraph\n\n```python\n" + code + "\n```\n\nThe _end_."
    chunks = render_chunks(text)
    assert len(chunks) > 1
    for chunk in chunks:
        size = utf16_len(chunk.text)
        assert 0 < size <= 4096 and chunk.text == chunk.text.rstrip()
        assert all(e.offset + e.length <= size for e in chunk.entities)
    joined = "\n".join(c.text for c in chunks)
    assert "print(0)" in joined and "print(299)" in joined and "The end." in joined


def test_plain_text_passes_through_unchanged():
    [chunk] = render_chunks("snake_case and 2 * 3 stay as typed")
    assert chunk.text == "snake_case and 2 * 3 stay as typed" and chunk.entities == ()


def test_text_that_looks_like_html_arrives_as_written():
    """CommonMark reads ``<…>`` as raw HTML, which the converter dropped: "In Java use
    List<String>" arrived as "In Java use List", and a reply that was all a tag as nothing."""
    for text in ("In Java use List<String> here", "Vec<u8>", "use <br> for breaks", '<div class="card">Hello</div>',
                 "1 < 2 and 3 > 2", "a &amp; b <i>x</i>"):
        [chunk] = render_chunks(text)
        assert chunk.text == text and chunk.entities == ()


def test_an_autolink_is_still_a_link():
    [chunk] = render_chunks("see <https://example.com/a?b=1&c=2>")
    assert chunk.text == "see https://example.com/a?b=1&c=2"
    assert [(e.type, e.url) for e in chunk.entities] == [("text_link", "https://example.com/a?b=1&c=2")]


def test_markdown_that_uses_angle_brackets_keeps_its_meaning():
    """Keeping HTML-looking text as written must not break the Markdown that uses ``<``: a link
    destination in angle brackets, an email autolink, an escaped ``\\<``, and a ``<!--`` with no
    ``-->`` (it hid the rest of the reply)."""
    [link] = render_chunks("see [the doc](<https://example.com/a b>) now")
    assert link.text == "see the doc now" and [e.url for e in link.entities] == ["https://example.com/a b"]
    [mail] = render_chunks("mail <bob@example.com> now")
    assert mail.text == "mail bob@example.com now"
    [escaped] = render_chunks(r"escape: \<b> here")
    assert escaped.text == "escape: <b> here"
    shown = "".join(c.text for c in render_chunks("<!-- is how a comment starts in HTML.\n\nThe rest of the answer."))
    assert "<!-- is how a comment starts" in shown and "The rest of the answer." in shown
