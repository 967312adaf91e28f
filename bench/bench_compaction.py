"""Timing of the non-LLM phases of context compaction (estimate, prune, boundaries).

Run: ``python bench/bench_compaction.py`` (from the repository root; a few seconds).

Synthetic histories of 1k, 10k and 100k messages made of turns (user message, assistant
with 1-3 parallel tool calls, their results of 50-4000 chars, assistant reply). Each phase is
run ``REPEATS`` times with :func:`time.perf_counter`; the table shows the best and median run
in milliseconds, and two ratios measured in the same process:

* ``x len-pass``: against a plain ``sum(len(m.content) for m in msgs)`` over the same list,
  the cheapest walk that touches every message's text. At 100k messages (~200 MB of text) it
  is dominated by cache misses on the string objects, so phases that read only cached ints
  (the cached estimate) can come out below 1 there;
* ``x 1k``: against the same phase on the 1k history (linear growth gives ~10 and ~100).

The second table is the per-step cost of re-estimating after appending one message as the
history grows: :class:`~bumblebot.cognition.compaction.RunningEstimate` (incremental, should stay flat)
against a full ``estimate_messages`` re-walk (grows with the history).

Target: estimate + boundaries + prune of a 10k-message history under 50 ms.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bumblebot.cognition.compaction import RunningEstimate, find_boundaries, prune_tool_results
from bumblebot.core.messages import Message, estimate_messages

REPEATS = 7
SIZES = (1_000, 10_000, 100_000)
TARGET_MS_10K = 50.0


def synthetic_history(n: int, seed: int = 7) -> list[Message]:
    """``n`` messages of tool-using turns, deterministic for a seed."""
    rnd = random.Random(seed)
    out: list[Message] = []
    call_no = 0
    while len(out) < n:
        out.append(Message("user", "u" * rnd.randint(20, 600), id=len(out) + 1))
        ids = []
        for _ in range(rnd.randint(1, 3)):
            call_no += 1
            ids.append(f"call_{call_no}")
        calls = [
            {
                "id": c,
                "type": "function",
                "function": {"name": "read_file", "arguments": '{"p": 1}'},
            }
            for c in ids
        ]
        out.append(Message("assistant", "", tool_calls=calls, id=len(out) + 1))
        for c in ids:
            out.append(
                Message("tool", "r" * rnd.randint(50, 4000), tool_call_id=c, id=len(out) + 1)
            )
        out.append(Message("assistant", "a" * rnd.randint(20, 800), id=len(out) + 1))
    del out[n:]  # may end inside a tool group: irrelevant for timing
    return out


def fresh_copies(msgs: list[Message]) -> list[Message]:
    """Copies without a cached estimate (for the cold estimate)."""
    return [
        Message(m.role, m.content, m.tool_calls, m.tool_call_id, m.name, m.id, m.pruned)
        for m in msgs
    ]


def timed(fn: Callable[[], object], setup: Callable[[], None] | None = None) -> list[float]:
    """``REPEATS`` wall-clock timings of ``fn`` in ms (``setup`` runs untimed before each)."""
    runs = []
    for _ in range(REPEATS):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        runs.append((time.perf_counter() - t0) * 1000)
    return runs


def phase_table() -> dict[tuple[str, int], float]:
    best: dict[tuple[str, int], float] = {}
    rows: list[tuple[str, int, float, float]] = []
    for n in SIZES:
        msgs = synthetic_history(n)
        estimate_messages(msgs)  # warm the per-message cache
        cold: list[list[Message]] = [msgs]

        def new_cold(cold: list[list[Message]] = cold, msgs: list[Message] = msgs) -> None:
            cold[0] = fresh_copies(msgs)

        phases: dict[str, tuple[Callable[[], object], Callable[[], None] | None]] = {
            "len-pass (baseline)": (lambda m=msgs: sum(len(x.content) for x in m), None),
            "estimate, cold": (lambda c=cold: estimate_messages(c[0]), new_cold),
            "estimate, cached": (lambda m=msgs: estimate_messages(m), None),
            "boundaries": (
                lambda m=msgs: find_boundaries(
                    m, protect_first_n=2, protect_last_n=12, tail_token_budget=3000
                ),
                None,
            ),
            "prune (all but tail)": (lambda m=msgs: prune_tool_results(m, len(m) - 12), None),
            "plan = est+bound+prune": (
                lambda m=msgs: (
                    estimate_messages(m),
                    prune_tool_results(
                        m,
                        find_boundaries(
                            m, protect_first_n=2, protect_last_n=12, tail_token_budget=3000
                        )[1],
                    ),
                ),
                None,
            ),
        }
        for name, (fn, setup) in phases.items():
            runs = timed(fn, setup)
            best[(name, n)] = min(runs)
            rows.append((name, n, min(runs), statistics.median(runs)))

    print(f"Phases ({REPEATS} runs each; best and median wall time)")
    header = (
        f"{'phase':<24}{'messages':>9}{'best ms':>10}{'median ms':>11}{'x len-pass':>12}{'x 1k':>8}"
    )
    print(header)
    print("-" * len(header))
    for name, n, b, med in rows:
        base = best[("len-pass (baseline)", n)]
        vs_1k = b / best[(name, SIZES[0])] if best[(name, SIZES[0])] > 0 else float("nan")
        print(f"{name:<24}{n:>9}{b:>10.3f}{med:>11.3f}{b / base:>12.2f}{vs_1k:>8.1f}")
    return best


def incremental_table() -> None:
    print()
    print("Re-estimate after appending one message (mean of 1000 steps, microseconds per step)")
    header = f"{'history size':>12}{'running estimate us':>21}{'full re-walk us':>17}{'ratio':>9}"
    print(header)
    print("-" * len(header))
    pool = synthetic_history(1000, seed=11)
    for n in SIZES:
        history = synthetic_history(n)
        running = RunningEstimate(history)
        steps = [fresh_copies([pool[i % len(pool)]])[0] for i in range(1000)]
        t0 = time.perf_counter()
        for m in steps:
            running.add(m)
            _ = running.total
        inc = (time.perf_counter() - t0) / len(steps) * 1e6

        grown = list(history)
        steps = [fresh_copies([pool[i % len(pool)]])[0] for i in range(50)]
        t0 = time.perf_counter()
        for m in steps:
            grown.append(m)
            estimate_messages(grown)
        full = (time.perf_counter() - t0) / len(steps) * 1e6
        assert running.total == estimate_messages(history) + sum(
            m.tokens for m in (pool[i % len(pool)] for i in range(1000))
        )
        print(f"{n:>12}{inc:>21.3f}{full:>17.1f}{full / inc:>9.0f}")


def main() -> int:
    print(f"Python {sys.version.split()[0]}")
    best = phase_table()
    incremental_table()
    plan_10k = best[("plan = est+bound+prune", 10_000)]
    verdict = "OK" if plan_10k < TARGET_MS_10K else "OVER TARGET"
    print()
    print(f"Target: plan of 10k messages < {TARGET_MS_10K:.0f} ms -> {plan_10k:.2f} ms ({verdict})")
    return 0 if plan_10k < TARGET_MS_10K else 1


if __name__ == "__main__":
    raise SystemExit(main())
