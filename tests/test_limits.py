"""The loop's limits (bumblebot/cognition/limits.py)."""

from __future__ import annotations

import pytest

from bumblebot.cognition.limits import max_steps


@pytest.mark.parametrize(
    ("rounds", "steps"), [(-3, 6), (0, 6), (4, 10), (16, 22), (19, 22), (100, 22)]
)
def test_step_cap_follows_the_spec(rounds, steps):
    assert max_steps(rounds) == steps
