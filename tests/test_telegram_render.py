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
