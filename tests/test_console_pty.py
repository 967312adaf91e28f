"""``bumblebot chat`` in a pseudo-terminal (adapters/console.py): the real command, its stdin,
stdout and stderr on the pty, against the fake OpenAI server.

What the user would see is rebuilt from the bytes the child wrote by a minimal terminal
(:func:`screen`): enough for a prompt, a reply, a spinner that is erased, a redrawn line.
The pty is read through the event loop's selector (the fake model runs in that loop too, so a
blocking ``select`` would stall it); every wait is for text to appear, with a deadline, never
a fixed sleep.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import re
import struct
import sys
import termios
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from conftest import write_config
from fakes.openai_server import FakeOpenAI, is_loop, tool_calls
from support import Gate, env_for, judges_say_done, say

NAME = "Bumble"  # entities/default.yaml
WIDTH, HEIGHT = 100, 40
CONTROL = re.compile(
    r"\x1b\[([0-?]*)[ -/]*([@-~])"  # CSI: cursor moves, erasing, colours, cursor shown/hidden
    r"|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)"  # OSC: hyperlinks, titles
    r"|\x1b[()][0-9A-Za-z]|\x1b[@-Z\\-_=>78]"  # charsets, keypad modes, cursor save/restore
    r"|([\r\n\b])"
)
#: a log record in any of our formats: a level, a logger name, a timestamp, a traceback
LOG_LINE = re.compile(
    r"\b(DEBUG|INFO|WARNING|ERROR|CRITICAL)\b|\bbumblebot\.[a-z_]+\b|\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d"
    r'|Traceback|"level"'
)


class Terminal:
    """The master side of the child's pty: what was written to it, and keys to type."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.output = b""
        self.eof = False
        self.mode_at_exit: tuple[bool, bool] | None = None  # (echo, line mode) as the child left it
        self._changed = asyncio.Event()
        asyncio.get_running_loop().add_reader(fd, self._readable)

    def _readable(self) -> None:
        try:
            data = os.read(self.fd, 65536)
        except OSError:  # EIO: every slave descriptor is closed (the child is gone)
            data = b""
        if not data:
            self.eof = True
            asyncio.get_running_loop().remove_reader(self.fd)
        self.output += data
        self._changed.set()

    def close(self) -> None:
        if not self.eof:
            asyncio.get_running_loop().remove_reader(self.fd)
        os.close(self.fd)

    @property
    def text(self) -> str:
        """Everything written, without control sequences."""
        return CONTROL.sub(lambda m: m.group(3) or "", self.output.decode("utf-8", "replace"))

    @property
    def lines(self) -> list[str]:
        """Every line as the screen shows it in the end (what was erased or written over is
        gone; the scrollback is kept), trailing blanks dropped."""
        return [line.rstrip() for line in screen(self.output.decode("utf-8", "replace"))]

    @property
    def shown(self) -> str:
        return "\n".join(self.lines)

    def type(self, keys: str) -> None:
        os.write(self.fd, keys.encode())

    async def until(self, what: str, condition: Callable[[list[str]], bool], timeout: float = 20.0) -> None:
        """Wait until ``condition(self.lines)`` holds."""
        try:
            async with asyncio.timeout(timeout):
                while not condition(self.lines):
                    if self.eof:
                        raise AssertionError(f"the chat ended before {what}:\n{self.shown}")
                    self._changed.clear()
                    await self._changed.wait()
        except TimeoutError:
            raise AssertionError(f"no {what} in {timeout} s:\n{self.shown}") from None

    async def expect(self, needle: str, timeout: float = 20.0) -> None:
        await self.until(repr(needle), lambda _: needle in self.text, timeout)

    async def prompt_after(self, needle: str, timeout: float = 20.0) -> None:
        """Wait for a fresh ``> `` line below the last line holding ``needle``."""
        def shown(lines: list[str]) -> bool:
            at = [i for i, line in enumerate(lines) if needle in line]
            return bool(at) and any(is_prompt(line) for line in lines[at[-1] + 1:])
        await self.until(f"prompt after {needle!r}", shown, timeout)

    def echo_and_lines(self) -> tuple[bool, bool]:
        """Whether the terminal echoes and reads whole lines (as a shell expects it back)."""
        lflag = termios.tcgetattr(self.fd)[3]
        return bool(lflag & termios.ECHO), bool(lflag & termios.ICANON)


def screen(output: str) -> list[str]:
    """A minimal terminal: printing (wrapping at :data:`WIDTH`), carriage return, line feed,
    backspace, the cursor moves ``A B C D G`` and the erasing ``K J``; other sequences do
    nothing. Rows are never scrolled away."""
    rows: list[list[str]] = [[]]
    row = col = 0

    def put(text: str) -> None:
        nonlocal row, col
        for char in text:
            if col >= WIDTH:  # a pending wrap, as xterm does it
                row, col = row + 1, 0
            while len(rows) <= row:
                rows.append([])
            line = rows[row]
            line.extend(" " * (col + 1 - len(line)))
            line[col] = char
            col += 1

    at = 0
    for m in CONTROL.finditer(output):
        put(output[at:m.start()])
        at = m.end()
        params, final, char = m.group(1), m.group(2), m.group(3)
        n = int(params) if params and params.isdigit() else None
        if char == "\r":
            col = 0
        elif char == "\n":
            row += 1
            while len(rows) <= row:
                rows.append([])
        elif char == "\b":
            col = max(0, col - 1)
        elif final == "A":
            row = max(0, row - (n or 1))
        elif final == "B":
            row += n or 1
        elif final == "C":
            col = min(WIDTH - 1, col + (n or 1))
        elif final == "D":
            col = max(0, col - (n or 1))
        elif final == "G":
            col = (n or 1) - 1
        elif final == "K":
            while len(rows) <= row:
                rows.append([])
            line = rows[row]
            if n == 2:
                line.clear()
            elif n == 1:
                line[: col + 1] = " " * min(len(line), col + 1)
            else:
                del line[col:]
        elif final == "J" and (n or 0) == 0:
            del rows[row + 1:]
            del rows[row][col:]
    put(output[at:])
    return ["".join(line) for line in rows]


def is_prompt(line: str) -> bool:
    """The ``> `` prompt, maybe with typed text after it."""
    return line == ">" or line.startswith("> ")


def _take_terminal() -> None:
    """In the child: the pty becomes its controlling terminal, so Ctrl-C there is SIGINT."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


@contextlib.asynccontextmanager
async def chat_in_pty(config: Path, tmp_path: Path) -> AsyncIterator[tuple[Terminal, asyncio.subprocess.Process]]:
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", HEIGHT, WIDTH, 0, 0))
    env = env_for(tmp_path) | {"TERM": "xterm-256color"}
    env.pop("NO_COLOR", None)
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bumblebot", "--config", str(config), "chat",
            stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True, preexec_fn=_take_terminal,
        )
    finally:
        os.close(slave)
    terminal = Terminal(master)
    try:
        yield terminal, proc
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        terminal.close()


async def exits(proc: asyncio.subprocess.Process, terminal: Terminal, timeout: float = 20.0) -> int:
    try:
        code = await asyncio.wait_for(proc.wait(), timeout)
    except TimeoutError:
        raise AssertionError(f"the chat did not exit in {timeout} s:\n{terminal.shown}") from None
    terminal.mode_at_exit = terminal.echo_and_lines()
    return code


def assert_no_log_line(terminal: Terminal) -> None:
    assert [line for line in terminal.lines if LOG_LINE.search(line)] == [], terminal.shown


def assert_terminal_given_back(terminal: Terminal) -> None:
    """Echo and line mode are back, and the cursor the spinner hid is shown again."""
    assert terminal.mode_at_exit == (True, True)
    hidden = terminal.output.rfind(b"\x1b[?25l")
    assert hidden == -1 or b"\x1b[?25h" in terminal.output[hidden:]


async def test_a_reply_in_markdown_then_a_fresh_prompt_and_no_log_line(tmp_path: Path, llm: FakeOpenAI) -> None:
    judges_say_done(llm)
    llm.push(say("hello from the **console**"), when=is_loop)
    async with chat_in_pty(write_config(tmp_path, llm, None), tmp_path) as (terminal, proc):
        await terminal.prompt_after(f"Talking to {NAME}.")
        terminal.type("hi there\r")
        await terminal.prompt_after("hello from the console")
        terminal.type("/help\r")
        await terminal.prompt_after("/quit")
        terminal.type("/quit\r")
        assert await exits(proc, terminal) == 0
    lines = terminal.lines
    [reply] = [i for i, line in enumerate(lines) if "hello from the console" in line]
    assert lines[reply].startswith(f"{NAME}:")  # not after a "> " prompt: on a line of its own
    assert "**" not in terminal.text  # the Markdown was rendered
    assert lines[reply - 1] == "> hi there" and lines[reply + 1] == "> /help"
    assert "/stop" in terminal.text and "Ctrl-D" in terminal.text  # the engine's help and the console's
    assert_no_log_line(terminal)
    assert_terminal_given_back(terminal)
    assert "Traceback" not in terminal.text


async def test_the_spinner_shows_while_the_model_thinks_and_the_reply_replaces_it(tmp_path: Path, llm: FakeOpenAI) -> None:
    judges_say_done(llm)
    slow = Gate(say("thought it over"))
    llm.push(slow, when=is_loop)
    async with chat_in_pty(write_config(tmp_path, llm, None), tmp_path) as (terminal, proc):
        await terminal.prompt_after(f"Talking to {NAME}.")
        terminal.type("what do you think?\r")
        await asyncio.wait_for(slow.entered.wait(), 20)
        await terminal.until("the spinner", lambda lines: lines[-1].endswith(f"{NAME} is thinking…"))
        terminal.type("ahead")  # typed meanwhile: not echoed over the spinner, kept for the prompt
        slow.release.set()
        await terminal.prompt_after("thought it over")
        await terminal.until("the type-ahead at the prompt", lambda lines: lines[-1] == "> ahead")
        terminal.type("\x15/quit\r")  # Ctrl-U: the line is cleared
        assert await exits(proc, terminal) == 0
    lines = terminal.lines
    assert not [line for line in lines if "thinking" in line]  # erased once the reply came
    assert not [line for line in lines if "ahead" in line and line != "> ahead"]
    assert_no_log_line(terminal)


async def test_ctrl_c_during_a_turn_finishes_the_reply_then_leaves(tmp_path: Path, llm: FakeOpenAI) -> None:
    judges_say_done(llm)
    held = Gate(say("the reply that was finished"))
    llm.push(held, when=is_loop)
    async with chat_in_pty(write_config(tmp_path, llm, None), tmp_path) as (terminal, proc):
        await terminal.prompt_after(f"Talking to {NAME}.")
        terminal.type("take your time\r")
        await asyncio.wait_for(held.entered.wait(), 20)
        terminal.type("\x03")
        await terminal.expect("finishing the reply… Ctrl-C again to quit")
        assert proc.returncode is None
        held.release.set()
        assert await exits(proc, terminal) == 0
    lines = terminal.lines
    [reply] = [i for i, line in enumerate(lines) if "the reply that was finished" in line]
    assert ">" not in lines[reply + 1:]  # no prompt any more: the chat ended after the reply
    assert_no_log_line(terminal)
    assert_terminal_given_back(terminal)


async def test_a_second_ctrl_c_quits_at_once(tmp_path: Path, llm: FakeOpenAI) -> None:
    judges_say_done(llm)
    held = Gate(say("never shown"))
    llm.push(held, when=is_loop)
    try:
        async with chat_in_pty(write_config(tmp_path, llm, None), tmp_path) as (terminal, proc):
            await terminal.prompt_after(f"Talking to {NAME}.")
            terminal.type("take your time\r")
            await asyncio.wait_for(held.entered.wait(), 20)
            terminal.type("\x03")
            await terminal.expect("Ctrl-C again to quit")
            terminal.type("\x03")
            code = await exits(proc, terminal, timeout=10)  # the model call is still held
    finally:
        held.release.set()
    assert code == 130  # bumblebot/app/cli.py: quit by a second Ctrl-C
    assert "never shown" not in terminal.text
    assert_no_log_line(terminal)
    assert_terminal_given_back(terminal)


async def test_ctrl_c_at_the_prompt_quits(tmp_path: Path, llm: FakeOpenAI) -> None:
    judges_say_done(llm)
    async with chat_in_pty(write_config(tmp_path, llm, None), tmp_path) as (terminal, proc):
        await terminal.prompt_after(f"Talking to {NAME}.")
        terminal.type("half")
        await terminal.until("the typed text", lambda lines: lines[-1] == "> half")
        terminal.type("\x03")
        assert await exits(proc, terminal) == 0
    assert "finishing the reply" not in terminal.text
    assert_no_log_line(terminal)
    assert_terminal_given_back(terminal)


def scheduled(request: dict) -> bool:
    return is_loop(request) and "[Scheduled task #" in str(request["messages"][-1]["content"])


async def test_a_message_arriving_at_the_prompt_redraws_the_half_typed_line(tmp_path: Path, llm: FakeOpenAI) -> None:
    judges_say_done(llm)
    llm.push(tool_calls(("schedule_task", {"when": "in 2 seconds", "task": "Remind the user to stretch."})),
             when=lambda r: is_loop(r) and not scheduled(r))
    llm.push(say("Reminder set."), when=lambda r: is_loop(r) and not scheduled(r))
    llm.push(say("Time to stretch!"), when=scheduled)
    async with chat_in_pty(write_config(tmp_path, llm, None), tmp_path) as (terminal, proc):
        await terminal.prompt_after(f"Talking to {NAME}.")
        terminal.type("remind me in 2 seconds to stretch\r")
        await terminal.prompt_after("Reminder set.")
        terminal.type("half-typed")
        await terminal.until("the typed text", lambda lines: lines[-1] == "> half-typed")
        await terminal.expect("Time to stretch!")
        await terminal.until("the redrawn line", lambda lines: lines[-1] == "> half-typed")
        terminal.type("\x15/quit\r")
        assert await exits(proc, terminal) == 0
    lines = terminal.lines
    [told] = [i for i, line in enumerate(lines) if "Time to stretch!" in line]
    assert lines[told].startswith(f"{NAME}:")  # the half-typed line was cleared first
    assert lines[told - 1] == f"{NAME}: Reminder set." and is_prompt(lines[told + 1])
    assert_no_log_line(terminal)


def test_the_console_shows_text_that_looks_like_html_as_written():
    """rich's Markdown (markdown-it) dropped raw HTML: "List<String>" showed as "List"."""
    from rich.console import Console

    from adapters.console import LiteralMarkdown

    console = Console(width=100)
    for text in ("In Java use List<String> here", '<div class="card">Hello</div>', "a &amp; b"):
        with console.capture() as shown:
            console.print(LiteralMarkdown(text))
        assert shown.get().strip() == text
