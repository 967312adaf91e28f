"""Command line: ``bumblebot run | chat | check | trace`` and ``--version``.

This is the one module that wires ``adapters/`` and ``tools/`` to the engine.

Exit codes: 0 on a clean stop; 1 when a platform or the endpoint fails at start or while
running (e.g. a second instance with the same Telegram token); 2 for a configuration error.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import sys
from datetime import datetime
from typing import Any, TextIO

from bumblebot import __version__
from bumblebot.config import (
    Secrets,
    Settings,
    apply_dotenv,
    find_config,
    load_secrets,
    load_settings,
)
from bumblebot.daemon import Daemon, instance_lock
from bumblebot.entity import Entity, load_entity
from bumblebot.errors import AdapterError, BumblebotError, ConfigError, StoreError
from bumblebot.logs import setup_logging
from bumblebot.store import Store

log = logging.getLogger("bumblebot")


def enabled_platforms(settings: Settings, secrets: Secrets) -> list[str]:
    """Platforms that are enabled in the config and have a token."""
    out = []
    if settings.telegram.enabled and secrets.telegram_bot_token:
        out.append("telegram")
    if settings.discord.enabled and secrets.discord_bot_token:
        out.append("discord")
    return out


def _load(args: argparse.Namespace) -> tuple[Settings, Secrets, Entity]:
    apply_dotenv()
    path = find_config(args.config)
    settings = load_settings(path)
    secrets = load_secrets()
    entity = load_entity(
        settings.entity, config_dir=getattr(settings, "config_dir", None), source=str(path) if path else "defaults"
    )
    setup_logging(settings.log_level, secrets.values())
    return settings, secrets, entity


async def _wait_for_stop(extra: list[asyncio.Future[Any]]) -> BaseException | None:
    loop = asyncio.get_running_loop()
    stop = loop.create_future()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, lambda s=sig: stop.done() or stop.set_result(s))
    done, _ = await asyncio.wait([stop, *extra], return_when=asyncio.FIRST_COMPLETED)
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.remove_signal_handler(sig)
    for fut in done:
        if fut is not stop and fut.exception() is not None:
            return fut.exception()
    if stop.done():
        log.info("received %s; stopping", signal.Signals(stop.result()).name)
    return None


async def run_daemon(settings: Settings, secrets: Secrets, entity: Entity) -> int:
    if not enabled_platforms(settings, secrets):
        print(
            "bumblebot: no platform to serve: set TELEGRAM_BOT_TOKEN (telegram.enabled) or "
            "DISCORD_BOT_TOKEN with discord.enabled: true; `bumblebot chat` talks in the terminal",
            file=sys.stderr,
        )
        return 2
    daemon = Daemon(settings, secrets, entity)
    failure: BaseException | None = None
    try:
        await daemon.start()
        names = ", ".join(a.platform.value for a in daemon.adapters)
        log.info("Bumblebot %s serving %s as %s", __version__, names, entity.name)
        failure = await _wait_for_stop([a.failure for a in daemon.adapters])
    except AdapterError as exc:
        failure = exc
    finally:
        await daemon.stop()
    if failure is not None:
        print(f"bumblebot: {failure}", file=sys.stderr)
        return 1
    return 0


async def run_chat(settings: Settings, secrets: Secrets, entity: Entity, stdin: TextIO | None = None) -> int:
    from adapters.console import ConsoleAdapter

    daemon = Daemon(settings, secrets, entity)
    try:
        engine = await daemon.open()
        console = ConsoleAdapter(engine, stdin=stdin)
        daemon.adapters = [console]
        daemon.delivery.register(console)
        await engine.start({console.platform})
        engine.mark_ready()
        await console.start()
        await _wait_for_stop([console.closed])
        await engine.wait_until(lambda: engine.idle, timeout=None)
    finally:
        await daemon.stop()
    return 0


async def run_check(settings: Settings, secrets: Secrets, entity: Entity) -> int:
    from bumblebot.check import check_all

    problems = await check_all(settings, secrets, entity)
    return 1 if problems else 0


async def run_trace(settings: Settings, chat: str | None, limit: int) -> int:
    if not settings.db_path.exists():
        print(f"bumblebot: no database at {settings.db_path} yet (nothing has run here)", file=sys.stderr)
        return 1
    async with Store(settings.db_path, readonly=True) as store:
        conversation_id = None
        if chat:
            rows = await store._all(
                "SELECT id FROM conversations WHERE platform || ':' || chat_id || "
                "CASE WHEN thread_id = '' THEN '' ELSE ':' || thread_id END = ?",
                (chat,),
            )
            if not rows:
                print(f"no conversation {chat!r}", file=sys.stderr)
                return 1
            conversation_id = int(rows[0][0])
        for turn in reversed(await store.recent_turns(conversation_id, limit)):
            t = turn["trace"]
            when = datetime.fromtimestamp(turn["started_at"]).strftime("%Y-%m-%d %H:%M:%S")
            print(
                f"turn {turn['turn_id']} {when} {turn['chat']} [{turn['status']}] route={t.get('route')}"
                f" ({t.get('route_reason')}) label={t.get('classifier_label')} stop={t.get('stop_reason')}"
                f" wall={t.get('wall_s')}s"
            )
            for step in t.get("steps", []):
                calls = ", ".join(
                    f"{c['name']} [suppressed]" if c.get("suppressed")
                    else f"{c['name']}{'' if c.get('ok', True) else '!'}({c.get('seconds', 0)}s)"
                    for c in step["tool_calls"]
                )
                print(
                    f"  step {step['step']}: finish={step['finish_reason']} prompt_tokens={step['prompt_tokens']}"
                    f" (estimate {step['estimate']}) completion_tokens={step.get('completion_tokens')}"
                    f" tool_choice={step.get('tool_choice')}"
                    f" tools=[{calls}]"
                )
            for g in t.get("gate", []):
                print(f"  gate@{g['step']}: {'DONE' if g['done'] else 'CONTINUE'} ({g.get('judge') or 'heuristic'}): {g['reason']}")
            for c in t.get("compactions", []):
                print(f"  compaction: {json.dumps(c)}")
            if t.get("error"):
                print(f"  error: {t['error']}")
    return 0


def _positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError("must be 1 or more")
    return number


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bumblebot", description="An LLM entity on Telegram and Discord.")
    p.add_argument("--version", action="version", version=f"bumblebot {__version__}")
    p.add_argument("--config", help="YAML config file (default: $BUMBLEBOT_CONFIG, else ./bumblebot.yaml)")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("run", help="serve every enabled platform until SIGINT/SIGTERM")
    sub.add_parser("chat", help="talk to the entity in this terminal")
    sub.add_parser("check", help="validate the config and try the endpoint and the tokens")
    t = sub.add_parser("trace", help="print recent turns and why they ended")
    t.add_argument("--chat", help="conversation key, e.g. telegram:12345")
    t.add_argument("-n", type=_positive, default=10, help="how many turns (default 10)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        settings, secrets, entity = _load(args)
    except ConfigError as exc:
        print(f"bumblebot: config error: {exc}", file=sys.stderr)
        return 2
    try:
        if args.command == "run":
            with instance_lock(settings.data_dir):
                return asyncio.run(run_daemon(settings, secrets, entity))
        if args.command == "chat":
            with instance_lock(settings.data_dir):
                return asyncio.run(run_chat(settings, secrets, entity))
        if args.command == "check":
            return asyncio.run(run_check(settings, secrets, entity))
        if args.command == "trace":
            return asyncio.run(run_trace(settings, args.chat, args.n))
    except ConfigError as exc:  # found after loading, e.g. an unusable data_dir
        print(f"bumblebot: config error: {exc}", file=sys.stderr)
        return 2
    except (StoreError, BumblebotError) as exc:
        print(f"bumblebot: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # e.g. data_dir unusable for chat/trace
        print(f"bumblebot: {exc.strerror or exc}: {getattr(exc, 'filename', '') or ''}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())

