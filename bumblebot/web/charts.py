"""Small charts as inline SVG, made on the server (no script, no library): bars of a series,
with a title, the largest value and the first and last labels. Presentation attributes only
(no ``style``): the page's Content-Security-Policy allows no inline style."""

from __future__ import annotations

from collections.abc import Sequence

from markupsafe import Markup, escape

WIDTH, HEIGHT, PAD = 600, 140, 18


def _number(value: float) -> str:
    if value >= 1000:
        return f"{value:,.0f}"
    if value == int(value):
        return str(int(value))
    return f"{value:.4g}"


def bars(title: str, labels: Sequence[str], values: Sequence[float], *, unit: str = "") -> Markup:
    """A bar chart of ``values`` (one bar per label), as an accessible ``<svg>``."""
    n = max(len(values), 1)
    largest = max([v for v in values if v is not None] or [0])
    top = largest or 1
    slot = (WIDTH - 2 * PAD) / n
    bar = max(slot * 0.8, 1)
    plot = HEIGHT - 2 * PAD
    parts = [
        (
            f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="{escape(title)}" '
            f'preserveAspectRatio="none" xmlns="http://www.w3.org/2000/svg">'
        ),
        f"<title>{escape(title)}</title>",
        f'<line x1="{PAD}" y1="{HEIGHT - PAD}" x2="{WIDTH - PAD}" y2="{HEIGHT - PAD}" stroke="currentColor" stroke-width="1"/>',
    ]
    for i, (label, value) in enumerate(zip(labels, values, strict=False)):
        h = (value or 0) / top * plot
        x = PAD + i * slot + (slot - bar) / 2
        parts.append(
            f'<rect x="{x:.1f}" y="{HEIGHT - PAD - h:.1f}" width="{bar:.1f}" height="{h:.1f}" fill="#3b82c4">'
            f"<title>{escape(label)}: {escape(_number(value or 0))}{escape(unit)}</title></rect>"
        )
    parts.append(
        f'<text x="{PAD}" y="{PAD - 5}" font-size="11" fill="currentColor">max {escape(_number(largest))}{escape(unit)}</text>'
    )
    if labels:
        parts.append(f'<text x="{PAD}" y="{HEIGHT - 4}" font-size="11" fill="currentColor">{escape(labels[0])}</text>')
        parts.append(
            f'<text x="{WIDTH - PAD}" y="{HEIGHT - 4}" font-size="11" text-anchor="end" fill="currentColor">'
            f"{escape(labels[-1])}</text>"
        )
    parts.append("</svg>")
    return Markup("".join(parts))
