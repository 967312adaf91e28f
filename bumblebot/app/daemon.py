"""The composition root: builds every part in order, starts them, stops them in reverse.

This module and ``bumblebot/app/cli.py`` are the only ones in ``bumblebot/`` that import
``adapters/`` and ``tools/``; every other part gets its collaborators through its constructor.

One process per data directory: :func:`instance_lock` holds an exclusive ``flock`` on
``<data_dir>/bumblebot.lock`` (with the holder's pid in it) for as long as ``run`` or ``chat``
runs, so a second process exits at once instead of answering the same messages again.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from adapters.telegram.pacing import PaceLimits, Pacer
from bumblebot.app.environment import mcp_environ, shell_sandbox, shell_sandbox_problem
from bumblebot.app.private import PRIVATE_UMASK, make_private
from bumblebot.app.watchdog import LoopWatchdog
from bumblebot.cluster import TELEGRAM_POLLER, Membership, ShardLeases, default_name
from bumblebot.cognition.budget import ContextBudget
from bumblebot.cognition.compactor import Compactor
from bumblebot.cognition.gate import CompletionGate
from bumblebot.cognition.knowledge import Memory
from bumblebot.cognition.loop import AgentLoop
from bumblebot.cognition.prompt import PromptBuilder
from bumblebot.core.activity import Activity
from bumblebot.core.adapter import Adapter
from bumblebot.core.config import Secrets, effective_base_url, endpoint_secrets, store_secrets
from bumblebot.core.entity import Entity
from bumblebot.core.errors import ConfigError, DataDirInUse
from bumblebot.core.logs import redact_values
from bumblebot.core.mcp_settings import secret_values as mcp_secret_values
from bumblebot.core.metrics import NO_METRICS, Metrics
from bumblebot.core.redaction import NO_SECRETS, Redactor
from bumblebot.core.settings import Settings
from bumblebot.core.toolkit import ToolContext
from bumblebot.core.usage import scoped
from bumblebot.delivery import Delivery
from bumblebot.llm import CapabilityMemory, Endpoints, build_endpoints
from bumblebot.llm.speech import Speech
from bumblebot.media import MediaFiles, MediaIntake
from bumblebot.runtime.engine import Engine
from bumblebot.runtime.ledger import Ledger
from bumblebot.runtime.limits import SpendingLimits
from bumblebot.runtime.runner import TurnRunner
from bumblebot.runtime.scheduler import Scheduler
from bumblebot.store import Store
from tools.mcp_client import MCPManager

log = logging.getLogger("bumblebot")

JUDGE_MAX_TOKENS = 64
#: A completion check that takes longer (or longer than ``llm.timeout_s``) is given up, retries
#: included: the turn ends, the check fails open. It runs while the conversation's next message
#: waits, so it must not hold the chat for the client's whole timeout and retries.
JUDGE_TIMEOUT_S = 15.0
LOCK_NAME = "bumblebot.lock"


@contextlib.contextmanager
def instance_lock(data_dir: Path) -> Iterator[None]:
    """Hold ``<data_dir>/bumblebot.lock`` exclusively while the block runs.

    Raises:
        DataDirInUse: another process holds it (its pid, when it wrote one).
        ConfigError: ``data_dir`` cannot be created or written.
    """
    path = data_dir / LOCK_NAME
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        handle = open(path, "a+")  # noqa: SIM115
    except OSError as exc:
        raise ConfigError("config", "data_dir", f"a writable directory ({exc.strerror}: {data_dir})") from exc
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip()
        handle.close()
        raise DataDirInUse(data_dir, int(holder) if holder.isdigit() else None) from None
    try:
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        yield
    finally:
        with contextlib.suppress(OSError):
            handle.truncate(0)
        fcntl.flock(handle, fcntl.LOCK_UN)
        handle.close()


def trusted_chats(settings: Settings, is_private: Callable[[str], bool] | None = None) -> Callable[[str], bool]:
    """The ``"private"`` rule of ``allowed_chats``: the terminal and allowlisted users' private
    chats (``is_private`` tells a Discord DM's key)."""
    from tools import allowlisted_private_chats

    tg, dc = settings.telegram, settings.discord
    return allowlisted_private_chats(
        telegram_user_ids=tg.allowed_user_ids, telegram_chat_ids=tg.allowed_chat_ids,
        discord_user_ids=dc.allowed_user_ids, is_private=is_private,
    )


def build_toolbox(
    settings: Settings, scheduler: Scheduler | None = None, *, shell_problem: str | None = None,
    is_private: Callable[[str], bool] | None = None, redactor: Redactor = NO_SECRETS,
) -> Any:
    """The tools the daemon offers, each where ``tools.<group>.allowed_chats`` says
    (``is_private`` tells a Discord DM's key); ``shell_problem`` (from
    :func:`shell_sandbox_problem`): leave ``run_command`` out, its sandbox does not run."""
    from tools import build_registry, tool_access

    t = settings.tools
    return build_registry(
        workspace=settings.workspace,
        shell_enabled=t.shell.enabled and shell_problem is None,
        shell_timeout_s=t.shell.timeout_s,
        shell_max_output_chars=t.shell.max_output_chars,
        shell_sandbox=shell_sandbox(settings),
        web_enabled=t.web.enabled,
        web_timeout_s=t.web.timeout_s,
        web_max_bytes=t.web.max_bytes,
        web_allow_private=t.web.allow_private,
        max_result_chars=settings.cognition.tool_result_chars,
        scheduler=scheduler,
        access=tool_access(t, trusted_chats(settings, is_private)),
        redactor=redactor,
    )


async def reap_orphans(settings: Settings) -> None:
    """Kill commands the last process started and did not live to stop (``tools.shell``)."""
    from tools import COMMANDS_DIR, reap_orphaned_commands

    await asyncio.to_thread(reap_orphaned_commands, settings.data_dir / COMMANDS_DIR)


def _tool_lines(schemas: list[dict[str, Any]]) -> list[str]:
    lines = []
    for s in schemas:
        fn = s["function"]
        description = (fn.get("description") or "").splitlines()
        lines.append(f"{fn['name']}: {description[0] if description else ''}")
    return lines


class Daemon:
    """Everything ``bumblebot run`` (or ``chat``) runs, in start order; stops in reverse.

    Start: start the loop watchdog (``bumblebot/app/watchdog.py``), make the data private (the
    umask 077 until the stop, what was left open closed: ``bumblebot/app/private.py``), open the
    store, build the LLM client, tools, cognition and engine, recover (resume cut-off turns,
    queue pending messages), start each adapter, then let turns run. Stop (idempotent):
    adapters stop intake, the engine drains in-flight turns (they can still deliver), adapters
    disconnect, the LLM client closes, the store closes, the watchdog stops last.

    The parts are attributes (``store``, ``llm``, ``toolbox``, ``delivery``, ``runner``,
    ``engine``) once :meth:`open` ran.

    ``pace``: the limits the Telegram adapter paces its calls by (default: Telegram's
    published ones, :class:`~adapters.telegram.pacing.PaceLimits`); the tests scale them down.
    """

    def __init__(self, settings: Settings, secrets: Secrets, entity: Entity, *, pace: PaceLimits | None = None) -> None:
        self.settings, self.secrets, self.entity = settings, secrets, entity
        self.pace = pace
        #: the secrets no chat and nothing stored may hold (the store and delivery apply it)
        self.redactor = Redactor(
            secrets.values() + endpoint_secrets(settings, secrets) + store_secrets(settings)
            + mcp_secret_values(settings.mcp, mcp_environ())
        )
        self.store = Store(settings.store_location, redactor=self.redactor)
        #: the live event bus (turns as they happen, the operator's actions), redacted like the store
        self.activity = Activity(self.redactor)
        self.web: Any = None  # the web console (bumblebot.web.WebConsole) once started
        self._umask: int | None = None  # the process umask before :meth:`open`, restored at stop
        self.engine: Engine | None = None
        self.llm: Endpoints | None = None
        self.speech: Speech | None = None
        self.mcp: MCPManager | None = None
        self.mcp_tools: Any = None
        self.metrics: Metrics = NO_METRICS
        self.adapters: list[Adapter] = []
        self.watchdog = LoopWatchdog()  # logs event-loop stalls over 0.5 s
        self._stopped = False
        self._window_task: asyncio.Task[object] | None = None
        #: a worker sharing a PostgreSQL store: its leases (``None``: alone, on SQLite)
        self.membership: Membership | None = None
        self._membership_task: asyncio.Task[None] | None = None
        #: a worker with Discord's shards split across the cluster: the shards it holds
        self.shard_leases: ShardLeases | None = None
        self._shards_task: asyncio.Task[None] | None = None

    def platform_adapters(self, engine: Engine) -> list[Adapter]:
        settings, secrets = self.settings, self.secrets
        adapters: list[Adapter] = []
        if settings.telegram.enabled and secrets.telegram_bot_token:
            from adapters.telegram import TelegramAdapter

            adapters.append(TelegramAdapter(
                engine, settings.telegram, secrets.telegram_bot_token.get_secret_value(), media=settings.media,
                pacer=Pacer(self.pace),
                poller_role=self.membership.role(TELEGRAM_POLLER) if self.membership is not None else None,
                webhook_secret=secrets.telegram_webhook_secret.get_secret_value() if secrets.telegram_webhook_secret else None,
            ))
        if settings.discord.enabled and secrets.discord_bot_token:
            from adapters.discord import DiscordAdapter

            adapters.append(DiscordAdapter(
                engine, settings.discord, secrets.discord_bot_token.get_secret_value(),
                leased_shards=self.membership is not None,
            ))
        return adapters

    async def open(self) -> Engine:
        """Start the loop watchdog, open the store and build every part (no adapter yet)."""
        await self.watchdog.start()  # first: it watches everything after it
        settings, store = self.settings, self.store
        if self._umask is None:  # what the daemon creates is private (bumblebot/app/private.py)
            self._umask = os.umask(PRIVATE_UMASK)
        await asyncio.to_thread(make_private, settings.data_dir, settings.workspace)
        _warn_ignored_settings(settings)
        await store.open()
        environ = mcp_environ()
        if settings.mcp.servers:
            self.mcp = MCPManager(settings.mcp, environ=environ)
            await self.mcp.start()  # returns at once; the servers connect meanwhile
        worker = (settings.cluster.worker or default_name()) if settings.on_postgres else None
        self.metrics = metrics = Metrics(worker) if settings.metrics.listen else NO_METRICS
        base_url = effective_base_url(settings, self.secrets)
        self.spending = SpendingLimits(settings.limits, store)  # checked before each model request
        self.ledger = ledger = Ledger(
            store, settings.llm.prices, metrics, limits=self.spending, currency=settings.llm.currency
        )
        self.llm = llm = build_endpoints(
            settings.llm,
            base_url=base_url,
            api_key=self.secrets.openai_api_key.get_secret_value() if self.secrets.openai_api_key else None,
            key_of=self.secrets.named,
            capabilities=CapabilityMemory(store.get_kv, store.set_kv, store.delete_kv),
            metrics=metrics,
            meter=ledger,
        )
        cognition = settings.cognition
        self.budget = budget = ContextBudget(
            cognition.max_context_tokens,
            cognition.history_compression.compaction_threshold_ratio,
            reply_tokens=max(cognition.deliberate_max_tokens, cognition.reflex_max_tokens),
            key=ContextBudget.key_for(base_url, llm.model),
            load=store.get_kv,
            save=store.set_kv,
            configured="max_context_tokens" in cognition.model_fields_set,
        )
        await budget.load()
        await self._learn_window()
        self.prompts: PromptBuilder | None = None
        self.scheduler = scheduler = Scheduler(
            settings.automation, settings.autonomy, store,
            zone=lambda: (self.prompts.entity if self.prompts is not None else self.entity).zone,
        )
        if problem := await shell_sandbox_problem(settings):
            log.error("run_command is not offered: %s", problem)
        elif settings.tools.shell.enabled and settings.tools.shell.sandbox == "off":
            log.warning("run_command runs commands unconfined, as this user (tools.shell.sandbox: off)")
        self.toolbox = toolbox = build_toolbox(
            settings, scheduler, shell_problem=problem, is_private=self._discord_dm, redactor=self.redactor
        )
        if self.mcp is not None:
            from tools.mcp import MCPTools

            self.mcp_tools = MCPTools(self.mcp, trusted=trusted_chats(settings, self._discord_dm))
            toolbox.add_source(self.mcp_tools)
        await reap_orphans(settings)  # before any turn resumes: a cut-off command must not land later
        memory = Memory(settings.data_dir)
        self.prompts = prompts = PromptBuilder(self.entity, memory, _tool_lines(toolbox.schemas()))
        api_key = self.secrets.openai_api_key.get_secret_value() if self.secrets.openai_api_key else None
        self.speech = speech = Speech(settings.llm, settings.voice, base_url=base_url, api_key=api_key, meter=ledger)
        self.delivery = delivery = Delivery(
            store, speech=speech, media_dir=settings.media_dir, metrics=metrics, redactor=self.redactor,
        )
        settings.workspace.mkdir(parents=True, exist_ok=True)
        self.media = MediaIntake(
            settings.media, store=store, media_dir=settings.media_dir, workspace=settings.workspace.resolve(), speech=speech,
        )
        await asyncio.to_thread(self.media.clean_partials)  # a killed fetch left half a file
        await delivery.sweep_staged()  # copies of files no row will send
        self.runner = self._runner(memory, environ)
        if settings.on_postgres:  # a worker: other processes may share the store
            assert worker is not None
            self.membership = Membership(store, worker, settings.cluster.lease_s)
            delivery.fence_of = self.membership.fence
        self.engine = Engine(
            settings.engine, store, self.runner, delivery, prompts, memory, scheduler=scheduler, metrics=metrics,
            media=self.media, debounce_s=settings.cognition.debounce_s, activity=self.activity,
            ownership=self.membership,
        )
        if self.membership is not None:
            self.membership.bind(self.engine.collect, self.engine.drop, self.engine.at_rest)
        self.spending.reply = self.engine.reply  # limits.notify_chat is told through the outbox
        return self.engine

    def _runner(self, memory: Memory, environ: dict[str, str]) -> TurnRunner:
        """The turn runner and the agent loop it drives, from the parts :meth:`open` built."""
        settings, llm, cognition = self.settings, self.llm, self.settings.cognition
        assert self.prompts is not None
        judge_timeout_s = min(JUDGE_TIMEOUT_S, settings.llm.timeout_s)

        async def judge(messages: list[dict[str, Any]]) -> str:
            with scoped(kind="judge"):
                return await asyncio.wait_for(
                    llm.text(messages, max_tokens=JUDGE_MAX_TOKENS, temperature=0.0), judge_timeout_s
                )

        loop = AgentLoop(
            llm=llm,
            toolbox=self.toolbox,
            gate=CompletionGate(judge),
            tool_context=ToolContext(workspace=settings.workspace.resolve(), data_dir=settings.data_dir),
        )
        secrets = [
            *self.secrets.values(), *endpoint_secrets(settings, self.secrets), *store_secrets(settings), *mcp_secret_values(settings.mcp, environ)
        ]
        return TurnRunner(
            cognition=cognition,
            engine=settings.engine,
            prompts=self.prompts,
            llm=llm,
            loop=loop,
            compactor=Compactor(cognition.history_compression, llm, memory, self.budget),
            delivery=self.delivery,
            budget=self.budget,
            toolbox=self.toolbox,
            redact=lambda value: redact_values(value, secrets),
            streaming=settings.delivery,
            media=self.media,
            media_files=MediaFiles(settings.media_dir),
            voice=settings.voice,
            metrics=self.metrics,
            tasks=self.scheduler,
            status_lines=self._status_lines,
            spending=self.spending,
        )

    async def _learn_window(self) -> None:
        """The budget follows the endpoints' context windows: those remembered at once, then
        what each endpoint says, asked in the background (turns wait for it, not readiness),
        then what their refusals say (``bumblebot/llm/window.py``)."""
        assert self.llm is not None
        windows, budget = self.llm.windows, self.budget

        def apply() -> None:  # the smallest window of the models and endpoints turns may use
            label, window, fallback = windows.smallest(assumed=not budget.configured) or ("", None, False)
            budget.learn(window, label, fallback=fallback)

        windows.listen(apply)
        await windows.load()
        self._window_task = asyncio.create_task(windows.ask(), name="bumblebot:window")
        budget.learning(self._window_task)

    def _discord_dm(self, key: str) -> bool:
        """Whether ``key`` is a Discord DM, as the running Discord adapter knows."""
        from adapters.discord import DiscordAdapter

        return any(isinstance(a, DiscordAdapter) and a.is_dm(key) for a in self.adapters)

    def _status_lines(self, conversation: str) -> str:
        """``/status``'s lines of the tools and MCP servers ``conversation`` may use."""
        lines = [self.toolbox.summary(conversation)]
        if self.mcp_tools is not None:
            lines.append(self.mcp_tools.summary(conversation))
        return "\n".join(line for line in lines if line)

    async def start(self, adapters: list[Adapter] | None = None) -> None:
        """Open, recover, connect ``adapters`` (default: every enabled platform), run turns.

        Raises:
            AdapterError: a platform refused the token or is unreachable.
            StoreError: the database cannot be opened.
        """
        engine = await self.open()
        if self.settings.metrics.listen:  # before the adapters: a port in use fails the start
            await self.metrics.serve(self.settings.metrics.listen)
        if self.settings.web.listen:
            await self._serve_console()
        self.adapters = self.platform_adapters(engine) if adapters is None else adapters
        if self.mcp is not None:  # resumed turns see the tools; a slow server waits mcp.startup_wait_s at most
            await self.mcp.wait_settled()
        await engine.start({a.platform for a in self.adapters})
        for adapter in self.adapters:
            self.delivery.register(adapter)
            self.media.register(adapter)
            await adapter.start()
        engine.mark_ready()
        if self.membership is not None:  # claims its conversations, and its roles, from now on
            self._membership_task = asyncio.create_task(self.membership.run(), name="bumblebot:cluster")
            self._lease_shards()

    def _lease_shards(self) -> None:
        """Take part in splitting Discord's shards, when they are set (``discord.shard_count``)."""
        from adapters.discord import DiscordAdapter

        count = self.settings.discord.shard_count
        for adapter in self.adapters:
            if isinstance(adapter, DiscordAdapter) and count is not None and self.membership is not None:
                self.shard_leases = ShardLeases(self.membership, count, adapter)
                self._shards_task = asyncio.create_task(self.shard_leases.run(), name="bumblebot:cluster:shards")

    async def web_token_sha256(self) -> str | None:
        """The web console's login token as its SHA-256 (hex): ``BUMBLEBOT_WEB_TOKEN``'s, else
        the one ``bumblebot web token`` stored; ``None``: neither."""
        from bumblebot.web.auth import TOKEN_KEY, token_digest

        if self.secrets.web_token is not None and self.secrets.web_token.get_secret_value():
            return token_digest(self.secrets.web_token.get_secret_value())
        return await self.store.get_kv(TOKEN_KEY) or None

    async def _serve_console(self) -> None:
        """Start the web console on ``web.listen`` (``bumblebot/web``).

        Raises:
            ConfigError: no login token, or the address cannot be bound.
        """
        from bumblebot.app.console import DaemonConsole
        from bumblebot.web import WebConsole
        from bumblebot.web.auth import MIN_TOKEN_CHARS

        given = self.secrets.web_token.get_secret_value() if self.secrets.web_token is not None else ""
        if given and len(given) < MIN_TOKEN_CHARS:
            raise ConfigError(
                "environment", "BUMBLEBOT_WEB_TOKEN", f"at least {MIN_TOKEN_CHARS} characters (it is {len(given)}): "
                "`bumblebot web token` makes a strong one",
            )
        if await self.web_token_sha256() is None:
            raise ConfigError(
                "config", "web.listen", "a login token for the web console: set BUMBLEBOT_WEB_TOKEN, or run "
                "`bumblebot web token` to make one",
            )
        self.web = WebConsole(DaemonConsole(self), self.settings.web, self.web_token_sha256)
        await self.web.start()

    async def _each_adapter(self, method: str) -> None:
        """Call ``method`` on every adapter; one failing never keeps the others running."""
        for adapter in self.adapters:
            try:
                await getattr(adapter, method)()
            except Exception:
                log.exception("%s of %s failed", method, adapter.platform.value)

    async def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        try:
            if self.web is not None:
                await self.web.stop()  # first: no action reaches a stopping engine
            await self._each_adapter("stop_intake")
            if self._shards_task is not None:
                self._shards_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._shards_task
            if self.shard_leases is not None:  # saved and released: another worker takes them at once
                await self.shard_leases.leave()
            if self.engine is not None:
                await self.engine.stop()  # in-flight turns finish and deliver
            if self._membership_task is not None:
                self._membership_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._membership_task
            if self.membership is not None:
                await self.membership.leave()  # the other workers take over at once
            await self._each_adapter("stop")
            if self.mcp is not None:
                await self.mcp.stop()  # stdio servers stop with the daemon
            if self._window_task is not None:
                self._window_task.cancel()
            if self.llm is not None:
                await self.llm.aclose()
            if self.speech is not None:
                await self.speech.aclose()
            await self.metrics.stop()
            await self.store.close()
        finally:
            await self.watchdog.stop()  # last: it watched the whole stop
            if self._umask is not None:
                os.umask(self._umask)


def _warn_ignored_settings(settings: Settings) -> None:
    """Keys older configurations may still set, which no longer do anything."""
    if settings.engine.max_concurrent_turns is not None:
        log.warning(
            "engine.max_concurrent_turns is no longer used and is ignored: concurrency is capped only by "
            "llm.max_concurrent_requests (%d)", settings.llm.max_concurrent_requests,
        )
    if settings.tools.max_result_chars is not None:
        log.warning(
            "tools.max_result_chars is no longer used and is ignored: one tool result is capped by "
            "cognition.max_tool_result_share (%g of the window)", settings.cognition.max_tool_result_share,
        )
