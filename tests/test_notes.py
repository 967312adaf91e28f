"""What the engine tells the model (bumblebot/cognition/notes.py)."""

from __future__ import annotations

from bumblebot.cognition.notes import post_tool_nudge


def test_post_tool_nudge_lists_failures_once_and_last_three_told():
    nudge = post_tool_nudge(["read_file", "read_file", "fetch_url"], ["a", "b", "c", "d"])
    assert "ready; failed: read_file, fetch_url." in nudge
    assert '"b"; "c"; "d"' in nudge and '"a"' not in nudge
