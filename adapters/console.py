"""The terminal console: ``bumblebot chat`` talks to the same engine, persisted like any chat.

Input is read in a worker thread (``input()``, with line editing from the standard ``readline``
module where the platform has it), so the event loop keeps running turns meanwhile.
``/stop``, ``/reset``, ``/status``, ``/compact``, ``/tasks`` and ``/help`` work as on Telegram;
``/quit`` or end of input (Ctrl-D) leaves.

How the console shares the terminal (when stdin and stdout are both terminals):

* The ``> `` prompt shows only while the console waits for the user: after the greeting, after
  a command's answer, and once a turn the user started is done (the engine is idle again). So
  it always comes back on a line of its own, after the reply, never in the middle of one.
* While that turn runs, a spinner line (``rich``'s live display, on the console's stream) says
  the entity is thinking. A reply replaces it; the typing hook (:meth:`send_typing`, refreshed
  while the turn waits on the model) brings it back if the turn goes on. Keys typed meanwhile
  are not echoed (nothing garbles the spinner); they wait as type-ahead for the next prompt.
* What arrives while the prompt is up (a scheduled task's reply, ``/compact``'s report) clears
  the input line, prints above it, and redraws the prompt and the half-typed input (GNU
  readline's ``rl_forced_update_display``; without it the line is rewritten by hand).
* Replies are the model's Markdown rendered for the terminal, after the entity's name.

When either stream is not a terminal (tests, pipes) the console is plain: no prompt, no
spinner, ``Name: text`` lines, one input line handled after the other.

The console prints the conversation and nothing else; log records are the command line's to
send elsewhere (``bumblebot chat`` writes them to a file). Ctrl-C is the command line's signal
to handle: its handler asks :meth:`ConsoleAdapter.interrupt` what to do.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import getpass
import itertools
import re
import io
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol, TextIO

from markdown_it import MarkdownIt
from rich.console import Console, RenderableType
from rich.live import Live
from rich.markdown import Markdown
from rich.spinner import Spinner
from rich.table import Table
from rich.text import Text

from bumblebot.core.errors import STORE_FAILURES, StoreError
from bumblebot.core.adapter import Adapter, Intake
from bumblebot.core.events import ChatKind, ChatRef, Inbound, Platform

try:
    import readline  # enables line editing for input()
except ImportError:  # Windows
    readline = None  # type: ignore[assignment]
try:
    import termios
except ImportError:  # Windows
    termios = None  # type: ignore[assignment]

PROMPT = "> "
#: shown at the first Ctrl-C while a turn runs
FINISHING = "finishing the reply… Ctrl-C again to quit"
#: appended to the engine's ``/help``
HELP_HERE = (
    "Here in the terminal: /quit or Ctrl-D leaves; Ctrl-C while I'm answering lets the reply "
    "finish and then leaves (Ctrl-C again leaves at once). What you type while I'm answering "
    "waits for the reply."
)


#: C0 and C1 control characters but tab and newline: in a reply they would be the terminal's
#: commands (OSC 52 sets the clipboard, others the title or what the screen shows), and a web
#: page the model read can steer what it writes.
_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")

class LiteralMarkdown(Markdown):
    """rich's Markdown with character references and raw HTML left as written: CommonMark
    would show ``&amp;`` as ``&`` and drop ``<String>`` from ``List<String>`` as a tag, and the
    model's text must arrive as it wrote it."""

    def __init__(self, markup: str) -> None:
        super().__init__("")
        self.markup = markup
        self.parsed = (
            MarkdownIt().enable("strikethrough").enable("table").disable(["entity", "html_inline", "html_block"]).parse(markup)
        )


class ChatIntake(Intake, Protocol):
    """The engine as the console sees it: the adapters' :class:`~bumblebot.core.adapter.Intake`,
    plus its observing half (``Engine.idle``, ``Engine.wait_until``), so the prompt comes back
    only once the turn the user started is done."""

    @property
    def idle(self) -> bool:
        """No turn or job is running or queued."""

    async def wait_until(self, predicate: Callable[[], bool], timeout: float | None = 10.0) -> None:
        """Return once ``predicate()`` holds (re-checked as turns finish)."""


class ConsoleAdapter(Adapter):
    """Reads lines from stdin and prints replies to stdout.

    Args:
        intake: the engine.
        user: the name shown to the entity as the speaker (default: the login name).
        stdin, stdout: streams (tests pass pipes); the terminal behaviour needs the process's
            own ``sys.stdin`` and ``sys.stdout`` on a terminal.

    Attributes:
        closed: resolved when the user leaves (``/quit``, Ctrl-D, end of input), or once the
            turn is done after a first Ctrl-C (:meth:`interrupt`).
    """

    platform = Platform.CONSOLE

    def __init__(self, intake: ChatIntake, *, user: str | None = None, stdin: TextIO | None = None, stdout: TextIO | None = None) -> None:
        self.intake = intake
        self.user = user or getpass.getuser()
        self.stdin = stdin or sys.stdin
        self.stdout = stdout or sys.stdout
        if isinstance(self.stdin, io.TextIOWrapper):
            # a line that is not valid in the locale's encoding arrives with U+FFFD in it; a
            # strict decoder (a desktop UTF-8 locale) would kill the input thread on it
            self.stdin.reconfigure(errors="replace")
        self.chat = ChatRef(Platform.CONSOLE, f"local:{self.user}")
        self._ids = itertools.count(time.time_ns())
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._reader: asyncio.Task[None] | None = None
        self._closer: asyncio.Task[None] | None = None
        self._terminal = _Terminal.open(self.stdin, self.stdout)
        self._rich = Console(file=self.stdout, highlight=False, markup=False, emoji=False) if self._terminal is not None else None
        self._live: Live | None = None
        self._may_prompt = threading.Event()  # set: the input thread may show the prompt
        self._waiting = False  # a turn the user started runs (from submit until the engine is idle)
        self._leaving = False  # a first Ctrl-C came while a turn ran

    @property
    def interactive(self) -> bool:
        """Whether the console talks to a terminal (prompt, spinner, Markdown)."""
        return self._terminal is not None

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        if self._reader is not None:
            raise RuntimeError("console already started")
        self._note(f"Talking to {self.intake.entity_name}. /help for commands, /quit or Ctrl-D to leave.")
        self._lines: asyncio.Queue[str | None] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def pump() -> None:  # a daemon thread: a blocked input() never keeps the process alive
            while True:
                self._may_prompt.wait()
                line = self._readline()
                self._may_prompt.clear()  # before the loop sees the line (it sets it again)
                try:
                    loop.call_soon_threadsafe(self._lines.put_nowait, line)
                except RuntimeError:  # the loop is closed: the chat is over
                    return
                if line is None:
                    return

        threading.Thread(target=pump, name="bumblebot-console-input", daemon=True).start()
        self._reader = asyncio.create_task(self._read(), name="bumblebot:console:read")

    async def stop(self) -> None:
        for task in (self._reader, self._closer):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._release_terminal()

    def interrupt(self) -> bool:
        """Ctrl-C: the command line's SIGINT handler calls this (in the event loop) and acts
        on the answer.

        The first Ctrl-C while a turn runs shows ``finishing the reply… Ctrl-C again to quit``;
        the console then reads no more input and resolves :attr:`closed` once the turn is done,
        so the chat ends as after ``/quit`` (the handler does nothing more). A turn runs from a
        message the user sent until the engine is idle, or while a scheduled one works.

        Returns:
            ``True`` when the chat should end now: no turn is running (a clean stop), or this
            is the second Ctrl-C during one (quit at once without waiting for it; the engine
            resumes it at the next start). The terminal is already put back as it was
            (spinner gone, echo on, off the prompt line), so the caller may exit at once.
            ``False`` for the first Ctrl-C during a turn.
        """
        if self._leaving or not (self._waiting or not self.intake.idle):
            self._release_terminal()
            return True
        self._leaving = True
        self._note(FINISHING)
        self._closer = asyncio.create_task(self._close_when_idle(), name="bumblebot:console:leave")
        return False

    # -- input ------------------------------------------------------------------------------

    def _readline(self) -> str | None:
        """One line typed (``None``: end of input); in the input thread."""
        if self._terminal is not None:
            try:
                return self._terminal.input(PROMPT)
            except EOFError:
                return None
        line = self.stdin.readline()
        return None if line == "" else line.rstrip("\n")

    def _ready_for_input(self) -> None:
        if self._terminal is not None:
            self._terminal.restore()
        self._may_prompt.set()

    async def _read(self) -> None:
        try:
            while not self._leaving:
                self._ready_for_input()
                line = await self._lines.get()
                if line is None:
                    if self._terminal is not None:  # Ctrl-D leaves the cursor after the prompt
                        self._write("\n")
                    break
                if line.strip() in ("/quit", "/exit"):
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
                    chat_title="terminal",
                )
                try:
                    if line.startswith("/"):
                        await self._command(inbound, (line[1:].split() or [""])[0])
                    else:
                        await self._turn(inbound)
                except (StoreError, *STORE_FAILURES) as exc:  # not journaled: nothing was taken
                    self._note(f"that was not taken, the database failed ({exc}); send it again")
        except Exception as exc:
            if not self.closed.done():
                self.closed.set_exception(exc)  # `bumblebot chat` says it and exits 1
            raise
        finally:
            self._close()

    async def _command(self, inbound: Inbound, name: str) -> None:
        answer = await self.intake.command(inbound, name)
        if answer and name.lower() == "help":
            answer = f"{answer}\n{HELP_HERE}"
        if answer:
            self._note(answer)

    async def _turn(self, inbound: Inbound) -> None:
        """Submit a message; return once the engine has nothing left running (the reply and
        anything the turn says after it are printed)."""
        self._waiting = True
        if self._terminal is not None:
            self._terminal.quiet()
        self._spin()
        try:
            if await self.intake.submit(inbound):
                await self.intake.wait_until(lambda: self.intake.idle, timeout=None)
        finally:
            self._waiting = False
            self._unspin()

    async def _close_when_idle(self) -> None:
        with contextlib.suppress(Exception):
            await self.intake.wait_until(lambda: self.intake.idle, timeout=None)
        self._close()

    def _close(self) -> None:
        if not self.closed.done():
            self.closed.set_result(None)

    # -- output -----------------------------------------------------------------------------

    def chunks(self, text: str) -> list[str]:
        text = _CONTROLS.sub("", text)  # the model's escape sequences never reach the terminal
        return [text] if text.strip() else []

    async def send_chunk(self, chat: ChatRef, text: str, *, key: str) -> str:
        self._unspin()
        if self._rich is None:
            self._write(f"{self.intake.entity_name}: {text}\n")
        else:
            grid = Table.grid(padding=(0, 1))
            grid.add_column(no_wrap=True)
            grid.add_column()
            grid.add_row(Text(f"{self.intake.entity_name}:", style="bold cyan"), LiteralMarkdown(text))
            self._show(grid)
        return str(next(self._ids))

    async def send_typing(self, chat: ChatRef) -> None:
        """The turn waits on the model: the spinner shows again if the user waits on the turn."""
        if self._waiting:
            self._spin()

    def _note(self, text: str) -> None:
        """A line of the console's own (greeting, command answers, the Ctrl-C notice)."""
        if self._rich is None:
            self._write(text + "\n")
        else:
            self._show(Text(text))

    def _write(self, text: str) -> None:
        self.stdout.write(text)
        self.stdout.flush()

    def _show(self, renderable: RenderableType) -> None:
        """Print on the terminal: above the spinner if it shows, above the input line (then
        redrawn as it was) if the prompt is up."""
        assert self._rich is not None and self._terminal is not None
        above_prompt = self._terminal.prompting
        if above_prompt:
            self._terminal.clear_line()
        self._rich.print(renderable)
        if above_prompt:
            self._terminal.redraw()

    def _spin(self) -> None:
        if self._rich is None or self._live is not None or self._terminal is None or self._terminal.prompting:
            return
        spinner = Spinner("dots", text=Text(f"{self.intake.entity_name} is thinking…", style="dim"))
        self._live = Live(
            spinner, console=self._rich, transient=True, refresh_per_second=12.5,
            redirect_stdout=False, redirect_stderr=False,
        )
        self._live.start()

    def _unspin(self) -> None:
        if self._live is not None:
            live, self._live = self._live, None
            live.stop()  # transient: the spinner line is erased

    def _release_terminal(self) -> None:
        """Leave the terminal as the console found it: no spinner, echo on, off the prompt line."""
        self._unspin()
        if self._terminal is not None:
            if self._terminal.prompting:
                self._write("\n")
                self._terminal.prompting = False  # nothing more is drawn around the prompt
            self._terminal.restore()


class _Terminal:
    """The user's terminal while the console reads from it: its echo, and the input line.

    The input thread is inside :meth:`input` while the event loop prints, so a redraw here can
    race a keystroke: at worst the line shows out of step until readline draws it again; what
    was typed is never lost.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.saved = termios.tcgetattr(fd) if termios is not None else None
        #: the prompt is on screen and readline reads keys (set by readline's pre-input hook)
        self.prompting = False
        self._rl = _readline_library()
        if readline is not None and hasattr(readline, "set_pre_input_hook"):
            readline.set_pre_input_hook(self._prompt_shown)
        self._prompt = PROMPT

    @classmethod
    def open(cls, stdin: TextIO, stdout: TextIO) -> _Terminal | None:
        """The terminal, when ``stdin`` and ``stdout`` are this process's own on a terminal."""
        try:
            own = stdin is sys.stdin and stdout is sys.stdout and stdin.isatty() and stdout.isatty()
            return cls(stdin.fileno()) if own else None
        except (OSError, ValueError):
            return None

    def _prompt_shown(self) -> None:
        self.prompting = True

    def input(self, prompt: str) -> str:
        """``input(prompt)``, marking the time the prompt is up; in the input thread."""
        self._prompt = prompt
        if readline is None or not hasattr(readline, "set_pre_input_hook"):
            self.prompting = True
        try:
            return input(prompt)
        finally:
            self.prompting = False

    def quiet(self) -> None:
        """No echo of typed keys (they stay queued as type-ahead); a Ctrl-C still signals."""
        if self.saved is not None:
            with contextlib.suppress(termios.error):
                attrs = termios.tcgetattr(self.fd)
                attrs[3] &= ~termios.ECHO
                termios.tcsetattr(self.fd, termios.TCSANOW, attrs)

    def restore(self) -> None:
        """The terminal as it was at start (before each prompt: readline saves and restores it)."""
        if self.saved is not None:
            with contextlib.suppress(termios.error):
                termios.tcsetattr(self.fd, termios.TCSANOW, self.saved)

    def clear_line(self) -> None:
        """Erase the input line (all its rows) and put the cursor at its start."""
        sys.stdout.flush()
        if self._rl is not None and self._rl.clear is not None:
            self._rl.clear()
            self._rl.flush(None)
        else:
            sys.stdout.write("\r\x1b[K")
            sys.stdout.flush()

    def redraw(self) -> None:
        """Draw the prompt and the half-typed input again on the cursor's (fresh) line."""
        sys.stdout.flush()
        if self._rl is not None:
            self._rl.redraw()
            self._rl.flush(None)
        else:
            typed = readline.get_line_buffer() if readline is not None else ""
            sys.stdout.write(self._prompt + typed)
            sys.stdout.flush()


class _ReadlineLibrary:
    """The two GNU readline calls Python's ``readline`` module does not offer."""

    def __init__(self, lib: ctypes.CDLL, libc: ctypes.CDLL) -> None:
        self.redraw: Callable[[], int] = lib.rl_forced_update_display
        self.clear: Callable[[], int] | None = getattr(lib, "rl_clear_visible_line", None)
        self.flush: Callable[[Any], int] = libc.fflush  # readline writes through C stdio


def _readline_library() -> _ReadlineLibrary | None:
    if readline is None or "libedit" in (getattr(readline, "__doc__", "") or ""):
        return None
    try:
        return _ReadlineLibrary(ctypes.CDLL(readline.__file__), ctypes.CDLL(None))
    except (OSError, AttributeError):
        return None
