"""Command line: ``bumblebot run | chat | check | trace | usage | backup | service install | web token`` and ``--version``.

This is the one module that wires ``adapters/`` and ``tools/`` to the engine. ``--config PATH``
works before or after the subcommand; every subcommand's ``--help`` lists its options.

Exit codes (the same for every subcommand, :data:`EXIT_OK` …):

* 0: done, or a clean stop (SIGTERM, one Ctrl-C after in-flight replies finished);
* 1: something outside the config failed: a platform or the endpoint at start or while
  running (a second instance with the same Telegram token), the database, another Bumblebot
  holding the data directory, a ``check`` that found problems, a backup that could not be made;
* 2: the configuration is wrong (file, key, ``.env``, ``data_dir``) or there is nothing to do
  (``run`` with no platform); restarting will not help (the systemd unit does not restart on 2);
* 130: a second Ctrl-C quit at once, without waiting for in-flight replies (they are resumed
  at the next start).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import getpass
import json
import logging
import os
import signal
import sqlite3
import sys
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO

from bumblebot import __version__
from bumblebot.app.daemon import Daemon, instance_lock
from bumblebot.app.private import make_private, private_umask
from bumblebot.core.config import (
    SECRET_VARIABLES,
    Secrets,
    apply_dotenv,
    dotenv_unreadable,
    endpoint_secrets,
    find_config,
    load_secrets,
    load_settings,
)
from bumblebot.core.entity import Entity, load_entity
from bumblebot.core.errors import AdapterError, BumblebotError, ConfigError, StoreError
from bumblebot.core.logs import setup_logging
from bumblebot.core.settings import Settings
from bumblebot.core.usage import scoped
from bumblebot.store import Store

log = logging.getLogger("bumblebot")

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_CONFIG = 2
EXIT_INTERRUPTED = 130


def enabled_platforms(settings: Settings, secrets: Secrets) -> list[str]:
    """Platforms that are enabled in the config and have a token."""
    out = []
    if settings.telegram.enabled and secrets.telegram_bot_token:
        out.append("telegram")
    if settings.discord.enabled and secrets.discord_bot_token:
        out.append("discord")
    return out


def _dotenv(args: argparse.Namespace) -> Path:
    """The ``.env`` to read: ``./.env``, else the one next to the config file (where the
    service install keeps it: ``bumblebot check --config /etc/bumblebot/bumblebot.yaml``
    finds the service's secrets from any directory)."""
    here = Path(".env")
    if here.exists():
        return here
    named = args.config or os.environ.get("BUMBLEBOT_CONFIG")
    beside = Path(named).expanduser().parent / ".env" if named else here
    return beside if beside.exists() else here


def _load(args: argparse.Namespace) -> tuple[Settings, Secrets, Entity]:
    """Config, secrets and entity, and logging set up.

    Raises:
        ConfigError: an unreadable or invalid config file, an unreadable ``.env`` when the
            secrets are not in the environment either, or a ``data_dir`` that is not a directory.
    """
    dotenv = _dotenv(args)
    unreadable = dotenv_unreadable(dotenv)
    if unreadable is not None and not any(os.environ.get(name) for name in SECRET_VARIABLES):
        raise ConfigError(
            str(dotenv.resolve()), "", f"a file the daemon can read ({unreadable}); make it readable by "
            f"{getpass.getuser()}, or pass the secrets in the environment (systemd: EnvironmentFile=)"
        )
    if unreadable is None:
        apply_dotenv(dotenv)
    path = find_config(args.config)
    settings = load_settings(path)
    secrets = load_secrets(read_dotenv=unreadable is None, path=dotenv)
    if settings.data_dir.exists() and not settings.data_dir.is_dir():
        raise ConfigError(str(path) if path else "config", "data_dir", f"a directory, but {settings.data_dir} is a file")
    entity = load_entity(
        settings.entity, config_dir=getattr(settings, "config_dir", None), source=str(path) if path else "defaults"
    )
    chat = getattr(args, "command", None) == "chat"
    log_file = settings.data_dir / "bumblebot.log" if chat else None  # never into the conversation
    try:
        if log_file is not None:
            settings.data_dir.mkdir(parents=True, exist_ok=True)
        from bumblebot.app.daemon import mcp_environ
        from bumblebot.core.mcp_settings import secret_values as mcp_secret_values

        hidden = [
            *secrets.values(), *endpoint_secrets(settings, secrets), *mcp_secret_values(settings.mcp, mcp_environ(dotenv))
        ]
        setup_logging(settings.log_level, hidden, fmt=settings.log_format, file=log_file)
    except OSError as exc:
        raise ConfigError(
            str(path) if path else "config", "data_dir",
            f"a directory this user can write ({exc.strerror or exc}: {exc.filename or settings.data_dir})",
        ) from None
    if unreadable is not None:
        # the service's own .env is root's: systemd read it (EnvironmentFile=), nothing is amiss
        say = log.debug if _secrets_from_systemd(settings, secrets) else log.warning
        say("%s is not readable (%s); using the secrets from the environment", dotenv.resolve(), unreadable)
    return settings, secrets, entity


def _secrets_from_systemd(settings: Settings, secrets: Secrets) -> bool:
    """Started by systemd (``$INVOCATION_ID``, which it sets for every process of a unit) with
    a platform to serve in the environment, as ``EnvironmentFile=`` gives the tokens: ``run``
    serves the enabled platforms that have a token (:func:`enabled_platforms`), so an enabled
    one without (``telegram.enabled`` is on by default) is no sign of a missing ``.env``."""
    return bool(os.environ.get("INVOCATION_ID")) and bool(enabled_platforms(settings, secrets))


async def _wait_for_stop(
    extra: list[asyncio.Future[Any]], on_first: Any = None, interrupt: Any = None, busy: Any = None
) -> BaseException | None:
    """Wait for SIGINT/SIGTERM or one of ``extra`` to finish; returns the exception of a
    failed ``extra``. After the first signal a second SIGINT quits at once (exit 130): the
    turns in flight are resumed at the next start. ``interrupt()`` (the console) decides
    whether a SIGINT stops at all (``False``: it only asked the turn to finish); when it says
    stop while ``busy()`` (a turn still runs), that is the second Ctrl-C: exit 130 at once."""
    loop = asyncio.get_running_loop()
    stop = loop.create_future()

    def signalled(sig: int) -> None:
        if stop.done():
            if sig == signal.SIGINT:
                sys.stderr.write("bumblebot: quitting now; replies in flight resume at the next start\n")
                sys.stderr.flush()
                os._exit(EXIT_INTERRUPTED)
            return
        if sig == signal.SIGINT and interrupt is not None:
            if not interrupt():
                return  # the console finishes the reply, then closes itself
            if busy is not None and busy():  # a second Ctrl-C during a turn: at once
                sys.stderr.flush()
                os._exit(EXIT_INTERRUPTED)
        stop.set_result(sig)
        if on_first is not None:
            on_first(sig)

    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, signalled, sig)
    done, _ = await asyncio.wait([stop, *extra], return_when=asyncio.FIRST_COMPLETED)
    for fut in done:
        if fut is not stop and fut.exception() is not None:
            return fut.exception()
    if stop.done():
        log.info("received %s; stopping", signal.Signals(stop.result()).name)
    return None


def _stopping_note(grace_s: float) -> Any:
    def note(sig: int) -> None:
        if sig == signal.SIGINT:
            sys.stderr.write(f"bumblebot: finishing the replies in flight (up to {grace_s:g} s)… Ctrl-C again to quit now\n")
            sys.stderr.flush()
    return note


async def _restore_signals() -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.remove_signal_handler(sig)


async def run_daemon(settings: Settings, secrets: Secrets, entity: Entity) -> int:
    from bumblebot.app.systemd import Notifier

    if not enabled_platforms(settings, secrets):
        print(
            "bumblebot: no platform to serve: set TELEGRAM_BOT_TOKEN (telegram.enabled) or "
            "DISCORD_BOT_TOKEN with discord.enabled: true; `bumblebot chat` talks in the terminal",
            file=sys.stderr,
        )
        return EXIT_CONFIG
    notifier = Notifier()
    notifier.status("starting: opening the database and recovering")
    daemon = Daemon(settings, secrets, entity)
    failure: BaseException | None = None
    keep_alive: asyncio.Task[None] | None = None
    try:
        await daemon.start()
        names = ", ".join(a.platform.value for a in daemon.adapters)
        log.info("Bumblebot %s serving %s as %s", __version__, names, entity.name)
        notifier.ready(f"serving {names} as {entity.name}")
        keep_alive = asyncio.create_task(notifier.keep_alive(), name="bumblebot:watchdog-ping")

        def first(sig: int) -> None:
            notifier.stopping(f"stopping: finishing replies in flight (up to {settings.engine.shutdown_grace_s:g} s)")
            _stopping_note(settings.engine.shutdown_grace_s)(sig)

        failure = await _wait_for_stop([a.failure for a in daemon.adapters], on_first=first)
    except AdapterError as exc:
        failure = exc
    finally:
        if failure is not None or keep_alive is None:
            notifier.stopping("stopping")  # not after a signal: that one said why already
        await daemon.stop()
        if keep_alive is not None:
            keep_alive.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keep_alive
        await _restore_signals()
    if failure is not None:
        print(f"bumblebot: {failure}", file=sys.stderr)
        return EXIT_FAILURE
    return EXIT_OK


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
        interrupt = getattr(console, "interrupt", None)
        await _wait_for_stop([console.closed], interrupt=interrupt, busy=lambda: not engine.idle)
        await engine.wait_until(lambda: engine.idle, timeout=None)
    finally:
        await daemon.stop()
        await _restore_signals()
    return EXIT_OK


async def run_check(settings: Settings, secrets: Secrets, entity: Entity, *, chat_only: bool = False) -> int:
    from bumblebot.app.check import check_all

    with scoped(kind="check"):  # the probes' requests, for a meter that counts them
        problems = await check_all(settings, secrets, entity, chat_only=chat_only)
    return EXIT_FAILURE if problems else EXIT_OK


def run_backup(settings: Settings, dest: Path) -> int:
    """``bumblebot backup PATH``: a consistent copy of the database through SQLite's online
    backup (safe while the daemon runs: it copies a snapshot, pages written meanwhile are
    copied again), checked with ``PRAGMA integrity_check`` before it is moved into place."""
    if settings.on_postgres:
        print(f"bumblebot: the state is in PostgreSQL ({settings.store_shown}): back it up with pg_dump "
              "(docs/running.md, Backup and restore)", file=sys.stderr)
        return EXIT_FAILURE
    source = settings.db_path
    if not source.is_file():
        print(f"bumblebot: no database at {source} yet (nothing has run here)", file=sys.stderr)
        return EXIT_FAILURE
    if dest.is_dir():
        dest = dest / f"bumblebot-{datetime.now():%Y%m%d-%H%M%S}.db"
    if dest.exists():
        print(f"bumblebot: {dest} exists; choose a new name (a backup never overwrites a file)", file=sys.stderr)
        return EXIT_FAILURE
    if not dest.parent.is_dir():
        print(f"bumblebot: cannot back up to {dest}: the directory {dest.parent} does not exist", file=sys.stderr)
        return EXIT_FAILURE
    partial = dest.with_name(f".{dest.name}.partial")
    try:
        src = sqlite3.connect(f"file:{source}?mode=ro", uri=True, timeout=10)
        try:
            out = sqlite3.connect(partial)
            try:
                src.backup(out, pages=1024)
                ok = out.execute("PRAGMA integrity_check").fetchone()[0]
                turns = out.execute("SELECT COUNT(*) FROM turns").fetchone()[0]
                messages = out.execute("SELECT COUNT(*) FROM messages").fetchone()[0]
            finally:
                out.close()
        finally:
            src.close()
        if ok != "ok":
            raise sqlite3.DatabaseError(f"integrity check of the copy: {ok}")
        os.chmod(partial, 0o600)  # the history is private, as the database is
        os.replace(partial, dest)
    except (sqlite3.Error, OSError) as exc:
        partial.unlink(missing_ok=True)
        print(f"bumblebot: cannot back up {source} to {dest}: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    print(f"backed up {source} to {dest}: {turns} turns, {messages} messages, integrity ok")
    return EXIT_OK


def run_service(args: argparse.Namespace, config: Path | None, settings: Settings) -> int:
    """``bumblebot service install [--user] [--dry-run]``."""
    from bumblebot.app import service

    if config is None:
        print("bumblebot: service install needs a config file (as `run` finds it: --config, else $BUMBLEBOT_CONFIG, "
              "else ./bumblebot.yaml): pass --config /etc/bumblebot/bumblebot.yaml", file=sys.stderr)
        return EXIT_CONFIG
    workspace = settings.workspace.resolve()
    outside = [] if workspace.is_relative_to(settings.data_dir.resolve()) else [workspace]
    shell = settings.tools.shell
    plan = service.plan_install(
        config_path=config, data_dir=settings.data_dir, user_mode=args.user, writable=outside,
        shell_sandbox=shell.enabled and shell.sandbox == "bwrap",
    )
    if plan.refusals:
        print("bumblebot: service install writes no unit the service could not run:", file=sys.stderr)
        for reason in plan.refusals:
            print(f"  - {reason}", file=sys.stderr)
        return EXIT_FAILURE
    try:
        print(service.install(plan, dry_run=args.dry_run))
    except service.InstallError as exc:
        print(f"bumblebot: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    return EXIT_OK


async def run_trace(settings: Settings, chat: str | None, limit: int) -> int:
    if not settings.store_exists():
        print(f"bumblebot: no database at {settings.db_path} yet (nothing has run here)", file=sys.stderr)
        return 1
    async with Store(settings.store_location, readonly=True) as store:
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
            stop = "+".join([str(t.get("stop_reason")), *t.get("stop_flags", [])])  # as ``str(Stop)`` writes it
            when = datetime.fromtimestamp(turn["started_at"]).strftime("%Y-%m-%d %H:%M:%S")
            print(
                f"turn {turn['turn_id']} {when} {turn['chat']} [{turn['status']}] route={t.get('route')}"
                f" ({t.get('route_reason')}) label={t.get('classifier_label')} stop={stop}"
                f" wall={t.get('wall_s')}s"
            )
            if t.get("classifier_usage"):
                print(f"  classifier: {_used(t['classifier_usage'], settings.llm.currency)}")
            for step in t.get("steps", []):
                calls = ", ".join(
                    f"{c['name']} [suppressed]" if c.get("suppressed")
                    else f"{c['name']}{'' if c.get('ok', True) else '!'}({c.get('seconds', 0)}s)"
                    for c in step["tool_calls"]
                )
                where = f" model={step['model']} at {step['endpoint']}" if step.get("endpoint") else ""
                print(
                    f"  step {step['step']}: finish={step['finish_reason']} {_step_tokens(step, settings.llm.currency)}"
                    f" tool_choice={step.get('tool_choice')}{where}"
                    f" tools=[{calls}]"
                    + (f" repeated={step['repeated']:.0%}" if step.get("repeated") is not None else "")
                    + (f" {_cut_text(step['cut'])}" if step.get("cut") else "")
                )
            for g in t.get("gate", []):
                used = f" [{_used(g['usage'], settings.llm.currency)}]" if g.get("usage") else ""
                print(f"  gate@{g['step']}: {'DONE' if g['done'] else 'CONTINUE'} ({g.get('judge') or 'structure'}): {g['reason']}{used}")
            for c in t.get("cuts", []):
                what = f" {c['chars']} chars" if c.get("chars") is not None else ""
                print(f"  cut@{c['step']}: {c['rule']}{what}" + (f" (call {c['call']})" if c.get("call") else ""))
            if t.get("told"):
                told = "in the model's words" if t["told"] == "model" else "with a plain note"
                print(f"  told the user it stopped: {told}")
            for c in t.get("compactions", []):
                print(f"  compaction: {json.dumps(c)}")
            if t.get("error"):
                print(f"  error: {t['error']}")
    return 0


async def run_web_token(settings: Settings, secrets: Secrets) -> int:
    """``bumblebot web token``: make a login token for the web console, keep only its SHA-256
    in the store (``kv`` ``web.token_sha256``, replacing the one before) and print it once."""
    from bumblebot.web.auth import TOKEN_KEY, new_token, token_digest

    token = new_token()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    async with Store(settings.store_location) as store:
        await store.set_kv(TOKEN_KEY, token_digest(token))
    print(token)
    note = "the web console's login token; it is shown only this once (the database keeps its hash)"
    if secrets.web_token is not None:
        note += ". BUMBLEBOT_WEB_TOKEN is set, and wins over it while it is"
    print(note, file=sys.stderr)
    return EXIT_OK


def _cut_text(cut: dict[str, Any]) -> str:
    """A step the client cut at its budget, as ``bumblebot trace`` shows it."""
    if cut.get("by") == "tokens":
        return f"cut=past {cut.get('budget')} tokens after {cut.get('elapsed_s')}s"
    return (f"cut=deadline {cut.get('deadline_s')}s (budget {cut.get('budget')} tokens at "
            f"{cut.get('writing')} tokens/s) after {cut.get('elapsed_s')}s")


def _step_tokens(step: dict[str, Any], currency: str) -> str:
    """What a step's model requests used, as ``bumblebot trace`` shows it: the usage recorded
    (cached and reasoning tokens, estimated or not, the cost when priced), or for a trace
    written before usage was recorded the tokens the endpoint reported."""
    usage = step.get("usage")
    if not usage:
        return (
            f"prompt_tokens={step['prompt_tokens']} (estimate {step['estimate']})"
            f" completion_tokens={step.get('completion_tokens')}"
        )
    return (
        f"prompt_tokens={usage['prompt']} (cached {usage['cached']}, estimate {step['estimate']})"
        f" completion_tokens={usage['completion']} (reasoning {usage['reasoning']})" + _usage_notes(usage, currency)
    )


def _used(usage: dict[str, Any], currency: str) -> str:
    """What a judge's, the classifier's or a compaction's requests used, as ``bumblebot trace``
    shows it."""
    return (f"{usage['requests']} request(s), prompt_tokens={usage['prompt']} completion_tokens={usage['completion']}"
            + _usage_notes(usage, currency))


def _usage_notes(usage: dict[str, Any], currency: str) -> str:
    """What ``bumblebot trace`` adds to a usage: ``[estimated]``, the cost, the requests cut."""
    shown = " [estimated]" if usage.get("estimated") else ""
    if usage.get("cost") is not None:
        shown += f" cost={usage['cost']:.6f} {currency}"
    return shown + "".join(f" {_cut_text(cut)}" for cut in usage.get("cuts") or ())


def _positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError("must be 1 or more")
    return number


def _days(value: str) -> int:
    from bumblebot.app.usage import MAX_DAYS

    number = _positive(value)
    if number > MAX_DAYS:
        raise argparse.ArgumentTypeError(f"must be {MAX_DAYS} or less")
    return number


def parser() -> argparse.ArgumentParser:
    """The command line; ``--config`` is accepted before or after the subcommand."""
    p = argparse.ArgumentParser(
        prog="bumblebot", description="An LLM entity on Telegram and Discord.",
        epilog="Exit codes: 0 done; 1 a platform, the endpoint, the database or a backup failed, the data "
        "directory is in use, or check found a problem; 2 a configuration error, or run with nothing to serve; "
        "130 quit by a second Ctrl-C (docs/running.md).",
    )
    p.add_argument("--version", action="version", version=f"bumblebot {__version__}")
    config_help = "YAML config file (default: $BUMBLEBOT_CONFIG, else ./bumblebot.yaml)"
    p.add_argument("--config", help=config_help)
    common = argparse.ArgumentParser(add_help=False)
    # SUPPRESS: after the subcommand it sets args.config, before it the top level does
    common.add_argument("--config", default=argparse.SUPPRESS, help=config_help)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("run", parents=[common], help="serve every enabled platform until SIGINT/SIGTERM",
                   description="Serve every enabled platform until SIGINT/SIGTERM (systemd: Type=notify).")
    sub.add_parser("chat", parents=[common], help="talk to the entity in this terminal",
                   description="Talk to the entity in this terminal; logs go to <data_dir>/bumblebot.log.")
    c = sub.add_parser("check", parents=[common], help="validate the config and try the endpoint and the tokens",
                       description="Validate the config, try the model endpoint and each enabled platform's token.")
    c.add_argument("--chat-only", action="store_true", help="only what `bumblebot chat` needs: no platform token")
    t = sub.add_parser("trace", parents=[common], help="print recent turns and why they ended",
                       description="Print recent turns: route, steps, tool calls, gate decisions, tokens, why each ended.")
    t.add_argument("--chat", help="conversation key, e.g. telegram:12345")
    t.add_argument("-n", type=_positive, default=10, help="how many turns (default 10)")
    u = sub.add_parser("usage", parents=[common], help="tokens and cost: totals, top chats, by model and kind",
                       description="What model requests used and cost (UTC days): totals today, over 7 and 30 days, "
                       "then the top chats, each model and each kind of request. Safe while the daemon runs.")
    u.add_argument("--days", type=_days, default=30, help="the span of the breakdowns, days (1 to 3660; default 30)")
    u.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    k = sub.add_parser("cluster", parents=[common], help="the workers sharing the PostgreSQL store and what each holds",
                       description="The workers sharing the PostgreSQL store (store.url): each one's host, pid, last "
                       "heartbeat, conversations, roles and the messages waiting in its conversations; what no worker "
                       "holds. Exit status 1 when the store is SQLite.")
    k.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    b = sub.add_parser("backup", parents=[common], help="copy the database consistently (safe while running)",
                       description="Copy <data_dir>/bumblebot.db with SQLite's online backup, safe while the daemon "
                       "runs, and check the copy. Restore: stop the daemon, put the copy in place of bumblebot.db "
                       "(remove bumblebot.db-wal and -shm), start it.")
    b.add_argument("path", type=Path, help="the backup file to write (or a directory to write a dated one in)")
    s = sub.add_parser("service", parents=[common], help="install the systemd unit",
                       description="Manage the systemd service of this installation.")
    ss = s.add_subparsers(dest="action", required=True, metavar="ACTION")
    i = ss.add_parser("install", parents=[common], help="write a hardened systemd unit for this installation",
                      description="Write a hardened Type=notify unit for this installation (its venv, the config, "
                      "the data directory), create the state directory, and print the next commands. It needs a "
                      "config file, found as `run` finds it: --config, else $BUMBLEBOT_CONFIG, else ./bumblebot.yaml. "
                      "It writes no system unit whose program, Python, code, config or data the service could not reach, "
                      "symbolic links followed (under /tmp, which the unit makes private, or in a home directory hidden "
                      "from or closed to the service user): install into /opt (docs/running.md), or use --user.")
    i.add_argument("--user", action="store_true", help="a user unit (systemctl --user) instead of a system one")
    i.add_argument("--dry-run", action="store_true", help="print the unit and what would be done; write nothing")
    w = sub.add_parser("web", parents=[common], help="the web console", description="The web console (docs/console.md).")
    ws = w.add_subparsers(dest="action", required=True, metavar="ACTION")
    ws.add_parser("token", parents=[common], help="make the web console's login token and print it once",
                  description="Make a random login token for the web console, store only its SHA-256 in the "
                  "database (replacing the previous one; the running daemon takes it at the next login) and "
                  "print it once. BUMBLEBOT_WEB_TOKEN, when set, wins over it.")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one command; whatever it creates is private to this user (``bumblebot/app/private.py``)."""
    with private_umask():
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    args = parser().parse_args(argv)
    try:
        settings, secrets, entity = _load(args)
    except ConfigError as exc:
        print(f"bumblebot: config error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        if args.command in ("check", "trace", "backup", "usage") and settings.data_dir.is_dir():
            # they open the database too (SQLite gives its -wal and -shm the database file's
            # mode, whatever the umask): what an older version left open is closed first
            make_private(settings.data_dir, settings.workspace)
        if args.command == "run":
            with instance_lock(settings.data_dir):
                return asyncio.run(run_daemon(settings, secrets, entity))
        if args.command == "chat":
            with instance_lock(settings.data_dir):
                return asyncio.run(run_chat(settings, secrets, entity))
        if args.command == "check":
            return asyncio.run(run_check(settings, secrets, entity, chat_only=args.chat_only))
        if args.command == "trace":
            return asyncio.run(run_trace(settings, args.chat, args.n))
        if args.command == "usage":
            from bumblebot.app.usage import run_usage

            return asyncio.run(run_usage(settings, args.days, args.json))
        if args.command == "backup":
            return run_backup(settings, args.path)
        if args.command == "cluster":
            from bumblebot.app.cluster import run_cluster

            return asyncio.run(run_cluster(settings, args.json))
        if args.command == "service":
            return run_service(args, find_config(args.config), settings)
        if args.command == "web":
            return asyncio.run(run_web_token(settings, secrets))
    except ConfigError as exc:  # found after loading, e.g. an unusable data_dir
        print(f"bumblebot: config error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except (StoreError, BumblebotError) as exc:
        print(f"bumblebot: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except OSError as exc:
        print(f"bumblebot: {exc.strerror or exc}: {getattr(exc, 'filename', '') or ''}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        return EXIT_OK
    return EXIT_CONFIG


if __name__ == "__main__":
    sys.exit(main())
