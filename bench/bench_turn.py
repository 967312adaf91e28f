"""Engine overhead per turn, as a ratio against the bare model calls of the same turn.

Runs in one process against the local fake OpenAI server from ``tests/fakes`` (no network):

* baseline: the chat completions one turn needs (loop step + gate judge), sent directly with
  the ``openai`` client;
* engine: the same turn through Bumblebot (journal, actor, routing, prompt, loop, tool
  execution, gate, outbox delivery, SQLite commit) via the console adapter's engine.

Usage: ``python bench/bench_turn.py [turns]`` (default 200). Prints medians and the ratio.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import openai  # noqa: E402
from fakes.openai_server import FakeOpenAI, Reply, is_aux, text, tool_calls  # noqa: E402

from bumblebot.app.daemon import Daemon  # noqa: E402
from bumblebot.core.adapter import Adapter  # noqa: E402
from bumblebot.core.config import Secrets, load_settings  # noqa: E402
from bumblebot.core.entity import load_entity  # noqa: E402
from bumblebot.core.events import ChatKind, ChatRef, Inbound, Platform  # noqa: E402


def scripted(request: dict) -> Reply:
    if is_aux(request):
        return text("DONE: fine")
    return tool_calls(("say", {"text": "hello"}), ("end_turn", {}))


class NullAdapter(Adapter):
    """Delivers to nowhere (measures the engine, not a platform)."""

    platform = Platform.CONSOLE

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def chunks(self, text: str) -> list[str]:
        return [text]

    async def send_chunk(self, chat: ChatRef, text: str, *, key: str) -> str:
        return "1"

    async def send_typing(self, chat: ChatRef) -> None: ...


async def baseline(llm: FakeOpenAI, turns: int) -> list[float]:
    client = openai.AsyncOpenAI(base_url=llm.base_url, api_key="sk-bench", max_retries=0)
    out = []
    for _ in range(turns):
        start = time.perf_counter()
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], tools=[{"type": "function", "function": {"name": "say", "parameters": {"type": "object", "properties": {}}}}], tool_choice="required")
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "judge"}])
        out.append(time.perf_counter() - start)
    await client.close()
    return out


async def engine(llm: FakeOpenAI, turns: int, data: Path) -> list[float]:
    (data / "bumblebot.yaml").write_text(
        f"data_dir: {data / 'data'}\nllm: {{base_url: '{llm.base_url}', max_retries: 0}}\n"
        "telegram: {enabled: false}\ncognition: {classifier: false}\n"
    )
    settings = load_settings(data / "bumblebot.yaml")
    daemon = Daemon(settings, Secrets(OPENAI_API_KEY="sk-bench"), load_entity("default"))
    await daemon.start(adapters=[NullAdapter()])
    assert daemon.engine is not None
    out = []
    for i in range(turns):
        inbound = Inbound(ChatRef(Platform.CONSOLE, "bench"), str(i), "u", "user", "hi", ChatKind.PRIVATE)
        start = time.perf_counter()
        await daemon.engine.submit(inbound)
        await daemon.engine.wait_for_turns(i + 1)
        out.append(time.perf_counter() - start)
    await daemon.stop()
    return out


async def main(turns: int) -> None:
    async with FakeOpenAI(default=scripted) as llm:
        base = await baseline(llm, turns)
        with tempfile.TemporaryDirectory() as tmp:
            eng = await engine(llm, turns, Path(tmp))
    b, e = statistics.median(base), statistics.median(eng)
    print(f"turns: {turns}")
    print(f"baseline (2 bare completions)  median {b * 1000:7.2f} ms")
    print(f"engine (one full turn)         median {e * 1000:7.2f} ms")
    print(f"ratio engine / baseline        {e / b:7.2f}x")
    print(f"engine overhead per turn       {(e - b) * 1000:7.2f} ms")


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 200))
