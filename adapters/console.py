"""The terminal console: ``bumblebot chat`` talks to the same engine, persisted like any chat.

Line editing comes from the standard ``readline`` module where the platform has it. Input is
read in a worker thread so the event loop keeps running turns and printing ``say`` messages as
they are delivered. ``/stop``, ``/reset``, ``/status``, ``/compact``, ``/tasks`` and ``/help`` work as on Telegram;
``/quit`` or end of input (Ctrl-D) leaves.
"""

from __future__ import annotations

import asyncio
import contextlib
import getpass
import itertools
import sys
import threading
import time
from typing import TextIO

from bumblebot.adapter import Adapter, Intake
from bumblebot.events import ChatKind, ChatRef, Inbound, Platform

with contextlib.suppress(ImportError):
    import readline  # noqa: F401  (enables line editing for input())


class ConsoleAdapter(Adapter):
    """Reads lines from stdin and prints replies to stdout.

    Args:
        intake: the engine, as adapters see it.
        user: the name shown to the entity as the speaker.
        stdin, stdout: streams (tests pass pipes).
    """

    platform = Platform.CONSOLE

    def __init__(self, intake: Intake, *, user: str | None = None, stdin: TextIO | None = None, stdout: TextIO | None = None) -> None:
        self.intake = intake
        self.user = user or getpass.getuser()
        self.stdin = stdin or sys.stdin
        self.stdout = stdout or sys.stdout
        self.chat = ChatRef(Platform.CONSOLE, f"local:{self.user}")
        self._ids = itertools.count(time.time_ns())
        self.closed = asyncio.get_running_loop().create_future()
        self._reader: asyncio.Task[None] | None = None

    def _print(self, text: str) -> None:
        self.stdout.write(text + "\n")
        self.stdout.flush()

    async def start(self) -> None:
        if self._reader is not None:
            raise RuntimeError("console already started")
        self._print(f"Talking to {self.intake.entity_name}. /help for commands, /quit or Ctrl-D to leave.")
        self._lines: asyncio.Queue[str | None] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def pump() -> None:  # a daemon thread: a blocked input() never keeps the process alive
            while True:
                line = self._readline()
                loop.call_soon_threadsafe(self._lines.put_nowait, line)
                if line is None:
                    return

        threading.Thread(target=pump, name="bumblebot-console-input", daemon=True).start()
        self._reader = asyncio.create_task(self._read(), name="bumblebot:console:read")

    async def stop(self) -> None:
        if self._reader is not None and not self._reader.done():
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader

    def _readline(self) -> str | None:
        if self.stdin is sys.stdin and sys.stdin.isatty():
            try:
                return input("> ")
            except EOFError:
                return None
        line = self.stdin.readline()
        return None if line == "" else line.rstrip("\n")

    async def _read(self) -> None:
        try:
            while True:
                line = await self._lines.get()
                if line is None or line.strip() in ("/quit", "/exit"):
                    break
                if not line.strip():
                    continue
                inbound = Inbound(
                    chat=self.chat,
                    message_id=str(next(self._ids)),
                    sender_id=self.user,
                    sender_name=self.user,
                    text=line,
                    chat_kind=ChatKind.PRIVATE,
                )
                if line.startswith("/"):
                    answer = await self.intake.command(inbound, (line[1:].split() or [""])[0])
                    if answer:
                        self._print(answer)
                else:
                    await self.intake.submit(inbound)
        finally:
            if not self.closed.done():
                self.closed.set_result(None)

    def chunks(self, text: str) -> list[str]:
        return [text] if text.strip() else []

    async def send_chunk(self, chat: ChatRef, text: str, *, key: str) -> str:
        self._print(f"{self.intake.entity_name}: {text}")
        return str(next(self._ids))

    async def send_typing(self, chat: ChatRef) -> None:
        return None
