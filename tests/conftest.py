"""Shared fixtures: a clean environment, the fake servers, and a running daemon."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from fakes.discord_server import FakeDiscord
from fakes.openai_server import FakeOpenAI
from fakes.postgres_server import PostgresServer
from fakes.telegram_server import FakeTelegram

TOKEN = "123456:TEST-token-for-the-fake-server-only"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """No real secrets, proxies or overrides leak into a test; cwd is the test's own folder."""
    for name in list(os.environ):
        if name.startswith("BUMBLEBOT_") or name in (
            "TELEGRAM_BOT_TOKEN", "DISCORD_BOT_TOKEN", "OPENAI_API_KEY", "OPENAI_BASE_URL",
            "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy",
        ):
            monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("PTB_TIMEDELTA", "true")  # PTB warns on RetryAfter otherwise
    monkeypatch.chdir(tmp_path)
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers  # an in-process `bumblebot` call installs its own handler
    root.setLevel(level)


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """One PostgreSQL server per test process, started when a test first asks for it."""
    import shutil
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="bumblebot-pg-"))  # not under pytest's 0700 root folder
    server = PostgresServer(folder)
    try:
        server.start()
        yield server
    finally:
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(params=["sqlite", "postgresql"])
async def store_location(request: pytest.FixtureRequest, tmp_path: Path) -> Path | str:
    """Where a store test keeps its database, once per backend: a SQLite file, then a new
    PostgreSQL database."""
    if request.param == "sqlite":
        return tmp_path / "db.sqlite"
    server: PostgresServer = request.getfixturevalue("postgres_server")
    return await server.database()


@pytest.fixture
async def llm() -> AsyncIterator[FakeOpenAI]:
    async with FakeOpenAI() as server:
        yield server


@pytest.fixture
async def tg() -> AsyncIterator[FakeTelegram]:
    async with FakeTelegram(token=TOKEN) as server:
        yield server


@pytest.fixture
async def dc() -> AsyncIterator[FakeDiscord]:
    async with FakeDiscord() as fake:
        yield fake
        assert fake.server_errors == []


def write_config(tmp_path: Path, llm: FakeOpenAI, tg: FakeTelegram | None = None, /, **sections: Any) -> Path:
    """A bumblebot.yaml pointing at the fakes; ``sections`` are deep-merged over the defaults."""
    import yaml

    config: dict[str, Any] = {
        "data_dir": str(tmp_path / "data"),
        "llm": {"base_url": llm.base_url, "model": "test-model", "reflex_model": "reflex-model", "max_retries": 0, "timeout_s": 10},
        # tests keep the default entity and data under tmp_path
        "telegram": {"enabled": tg is not None, "poll_timeout_s": 1},
        # a turn starts at once (tests of bursts, tests/test_inbox.py, set cognition.debounce_s)
        "cognition": {"classifier": False, "debounce_s": 0},
        "engine": {"shutdown_grace_s": 5},
        # whole messages unless a test is about streaming (tests/test_streaming.py turns it on):
        # with an instant fake model whether a preview gets out before the reply is a race
        "delivery": {"streaming": "off"},
        # the file tools reach the whole workspace in every chat, as they did before chats were
        # confined to their own folder by default: tests of the workspace's files set up and
        # look at files at its root. tests/test_tools_access.py covers the default.
        "tools": {"files": {"shared_chats": ["*"]}},
    }
    if tg is not None:
        config["telegram"].update(base_url=tg.base_url, base_file_url=tg.base_file_url)
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    path = tmp_path / "bumblebot.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


#: The Telegram adapter's pace in tests that are not about pacing (``running(pace=...)``): the
#: published limits (one call a second per chat) would make every test with a few messages
#: seconds slower; tests/test_pacing.py covers them.
TEST_PACE_INTERVAL_S = 0.01


@contextlib.asynccontextmanager
async def running(
    config: Path, *, telegram_token: str | None = TOKEN, discord_token: str | None = None, adapters: Any = None,
    pace: Any = None, webhook_secret: str | None = None,
) -> AsyncIterator[Any]:
    """Run the daemon in this event loop (as ``bumblebot run`` would) and stop it afterwards.

    ``pace``: the Telegram adapter's :class:`~adapters.telegram.pacing.PaceLimits` (default: calls to
    one chat :data:`TEST_PACE_INTERVAL_S` apart, the group and overall windows out of reach)."""
    from adapters.telegram.pacing import PaceLimits
    from bumblebot.app.cli import Daemon
    from bumblebot.core.config import Secrets, load_settings
    from bumblebot.core.entity import load_entity

    settings = load_settings(config)
    secrets = Secrets(
        TELEGRAM_BOT_TOKEN=telegram_token, DISCORD_BOT_TOKEN=discord_token, OPENAI_API_KEY="sk-test-key-not-real-000000",
        TELEGRAM_WEBHOOK_SECRET=webhook_secret,
    )
    entity = load_entity(settings.entity, config_dir=config.parent)
    if pace is None:
        pace = PaceLimits(per_chat_interval_s=TEST_PACE_INTERVAL_S, group_per_minute=10_000, global_per_second=10_000)
    daemon = Daemon(settings, secrets, entity, pace=pace)
    try:
        await daemon.start(adapters)
        yield daemon
    finally:
        await daemon.stop()
