"""The web console in a real browser: Debian's chromium, driven by selenium through
chromedriver, against a daemon on the fakes.

Selenium's calls block, and the daemon runs on this test's event loop: every browser call runs
in a worker thread (:class:`Browser`), so the console keeps answering meanwhile.

Screenshots of every page go to ``$BUMBLEBOT_SCREENSHOTS``, else ``test-output/screenshots`` in the
repository (kept with the test output, ignored by git).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import sqlite3
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import running, write_config
from fakes.openai_server import FakeOpenAI, is_loop
from fakes.telegram_server import FakeTelegram
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support import expected_conditions
from selenium.webdriver.support.ui import WebDriverWait
from support import Gate, judges_say_done, say

WEB_TOKEN = "browser-test-token-0123456789abcdef"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
#: the issue's bound: a step shows within this long of the event being published
LIVE_S = 0.5
#: read at import: the tests' clean environment drops BUMBLEBOT_* variables before each test
SCREENSHOTS = os.environ.get("BUMBLEBOT_SCREENSHOTS")


class Browser:
    """A headless chromium on the console; each call runs in a thread."""

    def __init__(self, driver: webdriver.Chrome, base: str, shots: Path) -> None:
        self.driver, self.base, self.shots = driver, base, shots

    async def get(self, path: str) -> None:
        await asyncio.to_thread(self.driver.get, self.base + path)

    async def wait(self, css: str, timeout: float = 10.0) -> WebElement:
        """The first element matching ``css``, once it is there."""
        wait = WebDriverWait(self.driver, timeout, poll_frequency=0.05)
        return await asyncio.to_thread(wait.until, expected_conditions.presence_of_element_located((By.CSS_SELECTOR, css)))

    async def click(self, css: str) -> None:
        element = await self.wait(css)
        await asyncio.to_thread(element.click)

    async def type(self, css: str, text: str) -> None:
        element = await self.wait(css)
        await asyncio.to_thread(element.clear)
        await asyncio.to_thread(element.send_keys, text)

    async def text(self, css: str) -> str:
        element = await self.wait(css)
        return str(await asyncio.to_thread(lambda: element.text))

    async def script(self, source: str) -> Any:
        return await asyncio.to_thread(self.driver.execute_script, source)

    async def shot(self, name: str) -> None:
        await asyncio.to_thread(self.driver.save_screenshot, str(self.shots / f"{name}.png"))

    async def live(self) -> None:
        """Wait until the page's event stream is open (``console.js`` marks the body)."""
        await self.wait('body[data-live="open"]')


@contextlib.asynccontextmanager
async def browser(daemon: Any, shots: Path) -> AsyncIterator[Browser]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        f"--user-data-dir={shots.parent / 'chromium-profile'}", "--window-size=1200,1400",
    ):
        options.add_argument(arg)
    driver = await asyncio.to_thread(webdriver.Chrome, options=options, service=Service(CHROMEDRIVER))
    try:
        host, port = daemon.web.address
        yield Browser(driver, f"http://{host}:{port}", shots)
    finally:
        await asyncio.to_thread(driver.quit)


async def until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """Wait for ``condition`` (checked every 20 ms)."""
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.02)


def journaled(tmp_path: Path, text: str) -> bool:
    with contextlib.closing(sqlite3.connect(tmp_path / "data" / "bumblebot.db")) as db:
        return db.execute("SELECT COUNT(*) FROM journal WHERE text = ?", (text,)).fetchone()[0] > 0


async def held_turn(b: Browser, llm: Any, tg: Any, text: str, answer: str) -> Gate:
    """Open chat 1001's page with its live events, send ``text`` there on Telegram, and return
    once the turn has started and the model holds its ``say(answer)`` at the returned gate."""
    gate = Gate(say(answer))
    llm.push(gate, when=is_loop)
    await b.get("/c/telegram:1001")
    await b.live()
    tg.push_text(text, chat_id=1001)
    await asyncio.wait_for(gate.entered.wait(), 10)
    await b.wait('#live li[data-kind="turn_started"]')
    return gate


@pytest.fixture
def shots(tmp_path: Path) -> Path:
    where = Path(SCREENSHOTS or Path(__file__).resolve().parents[1] / "test-output" / "screenshots")
    where.mkdir(parents=True, exist_ok=True)
    return where


@pytest.mark.timeout(180)
async def test_the_operator_watches_and_acts_in_a_browser(
    tmp_path: Path, llm: FakeOpenAI, tg: FakeTelegram, shots: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BUMBLEBOT_WEB_TOKEN", WEB_TOKEN)
    judges_say_done(llm)
    config = write_config(tmp_path, llm, tg, web={"listen": "127.0.0.1:0"})
    async with running(config) as d, browser(d, shots) as b:
        # a wrong token is refused
        await b.get("/")
        await b.type("#token", "not-the-token")
        await b.click("#login")
        assert "not right" in await b.text("#login-error")
        await b.shot("login-refused")
        # the right one logs in
        await b.type("#token", WEB_TOKEN)
        await b.click("#login")
        await b.wait("#running-count")
        await b.shot("overview")

        # a message on Telegram shows as a live turn, its steps within LIVE_S of happening
        hold = await held_turn(b, llm, tg, "is a tomato a fruit?", "Tomatoes are fruit, botanically.")
        hold.release.set()
        await b.wait('#live li[data-kind="turn_ended"]')
        lags = await b.script(
            "return Array.from(document.querySelectorAll('#live li[data-shown]'))"
            ".map(e => [e.dataset.kind, Number(e.dataset.shown) - Number(e.dataset.at)])"
        )
        kinds = [kind for kind, _ in lags]
        assert "step" in kinds and "said" in kinds, kinds
        late = [(kind, lag) for kind, lag in lags if lag > LIVE_S]
        print(f"live events shown after (s): {lags}")
        assert late == [], f"events shown later than {LIVE_S} s after they happened"
        assert "Tomatoes are fruit" in await b.text("#live")
        await b.shot("conversation-live")

        # its trace
        await b.click('#live li[data-kind="turn_started"] a')
        assert "end_turn" in await b.text("#turn-stop")
        await b.shot("trace")

        # cancel a task
        task = await d.scheduler.create("telegram:1001", "in 2 hours", "Water the plants.")
        await b.get("/tasks")
        await b.shot("tasks")
        await b.click(f"#cancel-{task.id}")
        await b.wait(".flash")
        assert await b.text(f"#task-{task.id} .status") == "cancelled"
        assert await d.scheduler.tasks("telegram:1001") == []

        # stop a running turn
        stuck = await held_turn(b, llm, tg, "tell me a very long story", "this is never said")
        await b.click("#action-stop")
        await b.wait(".flash")
        await b.wait('#live li[data-kind="turn_ended"]')
        assert "stopped" in await b.text('#live li[data-kind="turn_ended"]')
        await b.shot("conversation-stopped")
        stuck.release.set()
        await d.engine.wait_until(lambda: d.engine.idle)
        assert "this is never said" not in tg.sent(1001)

        # pause: the next message waits, no model request for it; resume: it is answered
        await b.click("#action-pause")
        await b.wait("#state .paused")
        asked = len(llm.requests)
        tg.push_text("are you still there?", chat_id=1001)
        await until(lambda: journaled(tmp_path, "are you still there?"))
        await d.engine.wait_until(lambda: d.engine.idle)
        assert len(llm.requests) == asked
        await b.get("/c/telegram:1001")
        await b.shot("conversation-paused")
        llm.push(say("Still here."), when=is_loop)
        await b.click("#action-resume")
        await tg.wait_for("sendMessage", predicate=lambda p: p.get("text") == "Still here.")
        await b.wait("#action-pause")  # active again

        # the other pages
        for path, name in (("/conversations", "conversations"), ("/tools", "tools"), ("/setup", "setup"), ("/", "overview-after")):
            await b.get(path)
            await b.wait("main h1")
            await b.shot(name)
        await asyncio.to_thread(b.driver.set_window_size, 390, 844)  # a phone: one column
        await b.get("/c/telegram:1001")
        await b.shot("conversation-narrow")
    print(f"screenshots in {shots}")
