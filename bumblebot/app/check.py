"""``bumblebot check``: validate the config, then try each model endpoint (the primary and each
of ``llm.fallbacks``) and each enabled platform.

Prints one line per check (``ok`` or what is wrong and how to fix it; ``note`` for what it
learned that the daemon will use). Secrets are never printed: every line goes through the
daemon's redactor (an endpoint may echo a key back in its refusal). It also says which tool
forcing the daemon uses with this endpoint and why (``tool forcing: required``, or ``auto since
<time>: <reason>; re-tried every …``), and each model's context window, configured and the
endpoint's. What its requests to the endpoint teach is written to the daemon's database
(:mod:`bumblebot.app.probing`), safely next to a running daemon.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

from bumblebot.app.probing import (
    REMEMBERED,
    forcing_line,
    probe_overrun,
    probe_thinking,
    probe_tools,
    speed_line,
    window_lines,
    writable_store,
)
from bumblebot.app.reach import (
    get_json,
    model_failure,
    platform_failure,
    shown_url,
    token_problem,
    url_problem,
)
from bumblebot.core.config import Secrets, effective_base_url, endpoint_secrets, store_secrets
from bumblebot.core.entity import Entity
from bumblebot.core.errors import ModelError, STORE_FAILURES, StoreError
from bumblebot.core.redaction import Redactor
from bumblebot.core.settings import Settings
from bumblebot.llm import (
    LLM,
    THINKING_RETRY_S,
    CapabilityMemory,
    ForcingFallback,
    stream_key,
    thinking_key,
    tool_choice_key,
    vision_key,
)
from bumblebot.llm.failover import fallback_settings, memory_keys
from bumblebot.runtime.limits import check_lines as limits_lines
from bumblebot.store import Store

#: what hides the secrets in the lines of the check running (:func:`check_all` sets it)
_redact: ContextVar[Callable[[str], str]] = ContextVar("check_redact", default=lambda text: text)
#: where the lines of the check running go: the terminal, or the web console's page (per task,
#: so a check run from the console never takes over the process's stdout)
_out: ContextVar[Callable[[str], None]] = ContextVar("check_out", default=print)


def _line(ok: bool, what: str, detail: str = "") -> None:
    _out.get()(_redact.get()(f"[{'ok' if ok else 'FAIL'}] {what}{': ' + detail if detail else ''}"))


def _redactor(settings: Settings, secrets: Secrets) -> Redactor:
    """The secrets no line may show: those the daemon hides (``Daemon.redactor``)."""
    from bumblebot.app.environment import mcp_environ
    from bumblebot.core.mcp_settings import secret_values

    return Redactor(
        [*secrets.values(), *endpoint_secrets(settings, secrets), *store_secrets(settings),
         *secret_values(settings.mcp, mcp_environ())]
    )


def _note(what: str, detail: str) -> None:
    """A line about something the endpoint showed that the daemon works around, not a failure."""
    _out.get()(_redact.get()(f"[note] {what}: {detail}"))


async def check_all(
    settings: Settings, secrets: Secrets, entity: Entity, *, chat_only: bool = False,
    out: Callable[[str], None] | None = None,
) -> list[str]:
    """Run every check; returns the list of problems (empty when all is well). ``chat_only``:
    the terminal chat only (``bumblebot chat``): no platform token is needed or tried. Each
    line goes to ``out`` (default: printed), its secrets hidden."""
    hiding = _redact.set(_redactor(settings, secrets))
    writing = _out.set(out or print)
    try:
        return await _check_all(settings, secrets, entity, chat_only=chat_only)
    finally:
        _out.reset(writing)
        _redact.reset(hiding)


async def _check_all(settings: Settings, secrets: Secrets, entity: Entity, *, chat_only: bool) -> list[str]:
    problems: list[str] = []

    def fail(what: str, detail: str) -> None:
        problems.append(what)
        _line(False, what, detail)

    _line(True, "config", f"entity {entity.name!r} from {entity.source_path}; data in {settings.data_dir}")
    try:
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        probe = settings.data_dir / ".bumblebot-check"
        probe.write_text("ok")
        probe.unlink()
        _line(True, "data_dir", f"{settings.data_dir} is writable")
    except OSError as exc:
        fail("data_dir", f"{settings.data_dir} is not writable ({exc.strerror}); change data_dir")
    base_url = effective_base_url(settings, secrets)
    store, unwritten = await writable_store(settings)  # what the endpoints show is remembered for the daemon
    if store is None and settings.on_postgres:  # the daemon could not start either
        fail("store.url", unwritten)
    elif store is None:
        _note("what check learns", f"for this run only, not remembered for the daemon: {unwritten}")
    try:
        primary_window = None
        for name, own, url, api_key, memory in _endpoints(settings, secrets, fail):
            window = await _check_endpoint(own, url, api_key, fail, name, memory, store, primary_window)
            primary_window = window if not name else primary_window
    finally:
        if store is not None:
            await store.close()
    stt = settings.llm.transcription_base_url or base_url
    _line(True, "voice notes", f"transcribed at {shown_url(stt.rstrip('/'))}/audio/transcriptions with {settings.llm.transcription_model} "
          "(not tried here); voice replies " + ("on (voice.reply: mirror)" if settings.voice.reply == "mirror" else "off"))
    for detail in limits_lines(settings):
        _line(True, "spending limits", detail)
    if settings.tools.shell.enabled:
        from bumblebot.app.environment import shell_sandbox_problem

        if settings.tools.shell.sandbox == "off":
            _line(True, "shell", "WARNING: run_command runs unconfined (tools.shell.sandbox: off): as this user, with its "
                  "files, processes, secrets and network")
        elif problem := await shell_sandbox_problem(settings):
            fail("shell", f"run_command is not offered: {problem}")
        else:
            net = "with" if settings.tools.shell.network else "without"
            _line(True, "shell", f"run_command runs in a bubblewrap sandbox, {net} network")

    for what, detail in tool_access_lines(settings):
        _line(True, what, detail)
    if settings.mcp.servers:
        from bumblebot.app.environment import mcp_environ
        from tools.mcp_client import probe_servers
        from tools.mcp_records import ServerState

        for st in await probe_servers(settings.mcp, environ=mcp_environ()):
            what, where = f"mcp {st.name}", f"{st.transport}: {shown_url(st.target)}"
            if st.state is ServerState.DISABLED:
                _line(True, what, f"disabled (mcp.servers.{st.name}.enabled: false)")
            elif st.state is ServerState.CONNECTED:
                detail = f"connected ({where}); tools: {', '.join(st.tools) or 'none'}"
                if st.hidden:
                    detail += f"; hidden by mcp.servers.{st.name}.tools: {', '.join(st.hidden)}"
                if st.missing:
                    fail(what, detail + f"; not on the server: {', '.join(st.missing)} (fix mcp.servers.{st.name}.tools)")
                else:
                    _line(True, what, detail)
            elif st.state is ServerState.FAILED:
                fail(what, f"{st.error} ({where}); fix mcp.servers.{st.name}")
            else:
                fail(what, f"{st.error or 'no answer in time'} ({where}); the daemon runs without its tools and retries it")
    if chat_only:
        _line(True, "platforms", "not checked (--chat-only: `bumblebot chat` needs no platform token)")
        return problems
    tg = settings.telegram
    if tg.enabled:
        if not secrets.telegram_bot_token:
            fail("telegram", "TELEGRAM_BOT_TOKEN is not set (create a bot with @BotFather), or set telegram.enabled: false; "
                 "for the terminal chat alone run `bumblebot check --chat-only`")
        elif problem := (token_problem(secrets.telegram_bot_token.get_secret_value(), "TELEGRAM_BOT_TOKEN")
                         or url_problem(tg.base_url, "telegram.base_url")):
            fail("telegram", problem)
        else:
            url = f"{tg.base_url}{secrets.telegram_bot_token.get_secret_value()}/getMe"
            reply = await get_json(url)
            result = reply.body
            if reply.status == 200 and isinstance(result, dict) and result.get("ok"):
                _line(True, "telegram", f"bot @{result['result'].get('username')}")
                if not tg.allowed_user_ids and not tg.allowed_chat_ids:
                    _line(True, "telegram allowlist", "empty: anyone who finds the bot can talk to it")
                _line(True, "telegram groups", _groups_line(tg, result["result"]))
            else:
                fail("telegram", platform_failure(reply, shown=f"{shown_url(tg.base_url)}<token>/getMe", url=tg.base_url,
                                                  setting="telegram.base_url", token="TELEGRAM_BOT_TOKEN",
                                                  not_found_is_token=True))
    dc = settings.discord
    if dc.enabled:
        if not secrets.discord_bot_token:
            fail("discord", "DISCORD_BOT_TOKEN is not set (Developer Portal > your app > Bot > Reset Token)")
        elif problem := (token_problem(secrets.discord_bot_token.get_secret_value(), "DISCORD_BOT_TOKEN")
                         or url_problem(dc.api_base_url, "discord.api_base_url")):
            fail("discord", problem)
        else:
            headers = {"Authorization": f"Bot {secrets.discord_bot_token.get_secret_value()}"}
            reply = await get_json(f"{dc.api_base_url}/users/@me", headers)
            if reply.status == 200 and isinstance(reply.body, dict) and "id" in reply.body:
                _line(True, "discord", f"bot {reply.body.get('username')}")
            else:
                fail("discord", platform_failure(reply, shown=f"{shown_url(dc.api_base_url)}/users/@me", url=dc.api_base_url,
                                                 setting="discord.api_base_url", token="DISCORD_BOT_TOKEN",
                                                 not_found_is_token=False))
    if not problems:
        _out.get()("all checks passed")
    return problems


def _endpoints(
    settings: Settings, secrets: Secrets, fail: Callable[[str, str], None]
) -> Iterator[tuple[str, Settings, str, str | None, str]]:
    """The endpoints to probe: ``(name, settings with its own llm section, base URL, key, name
    in the memory's keys)``, the primary (named ``""``) and each fallback (``fallback 1`` …),
    named as it comes (one whose key is not set fails instead, as does a key or URL no request
    can carry)."""
    primary = secrets.openai_api_key.get_secret_value() if secrets.openai_api_key else None
    llm = settings.llm
    base_url = effective_base_url(settings, secrets)
    memory = memory_keys([(base_url, llm.model)] + [(str(f.base_url), f.model or llm.model) for f in llm.fallbacks])
    if problem := (primary and token_problem(primary, "OPENAI_API_KEY")) or url_problem(
        base_url, "llm.base_url / OPENAI_BASE_URL"
    ):
        fail("model endpoint", problem)
    else:
        yield "", settings, base_url, primary, memory[0]
    for number, fallback in enumerate(settings.llm.fallbacks, 1):
        name, where = f"fallback {number}", f"llm.fallbacks[{number - 1}]"
        key = secrets.named(fallback.api_key_env) if fallback.api_key_env else None
        if fallback.api_key_env and key is None:
            fail(name, f"{fallback.api_key_env} ({where}.api_key_env) is not set in the environment or .env")
            continue
        if problem := (key and token_problem(key, str(fallback.api_key_env))) or url_problem(
            str(fallback.base_url), f"{where}.base_url"
        ):
            fail(f"{name} model endpoint", problem)
            continue
        how = f"key from {fallback.api_key_env}" if fallback.api_key_env else "no key"
        _line(True, name, f"{shown_url(str(fallback.base_url))} ({how}); tried when the endpoints before it are down")
        own = settings.model_copy(update={"llm": fallback_settings(settings.llm, fallback)})
        yield name, own, str(fallback.base_url), key, memory[number]


async def _check_endpoint(
    settings: Settings, base_url: str, api_key: str | None, fail: Callable[[str, str], None], name: str = "",
    memory: str | None = None, store: Store | None = None, primary_window: int | None = None,
) -> int | None:
    """Probe one endpoint (``settings.llm`` is its own section): each model answers, a tool is
    called (streamed, as turns are), thinking and the window are asked, and what the daemon
    remembers of it (under ``memory``, its name in the keys; default: ``base_url``) is said;
    what is learned goes into ``store``'s ``kv`` (the daemon's) when given. Each line's ``what``
    starts with ``name`` (a fallback's). When the endpoint failed, nothing more is said of it.
    Returns the window the daemon sizes requests for with it (``None``: it failed);
    ``primary_window``: the primary's, for a fallback."""
    prefix = f"{name} " if name else ""
    remembered_whole = await _stored_kv(settings, stream_key(memory or base_url))
    llm = LLM(
        settings.llm, base_url=base_url, api_key=api_key, memory_key=memory,
        capabilities=CapabilityMemory(store.get_kv, store.set_kv, store.delete_kv) if store else None,
    )
    forced_now = probe_ran = False
    fallback, forcing, windows, window = await llm.forcing_fallback(), (False, ""), [], None
    kept = REMEMBERED if store is not None else "for this run only: not remembered, see above"
    try:
        for model, setting in _models(settings).items():
            try:
                await llm.complete([{"role": "user", "content": "Say ok."}], model=model, max_tokens=8)
            except ModelError as exc:
                if model == llm.model:
                    raise  # the endpoint's own failure, below
                fail(f"{prefix}model {model}", _failure(exc, base_url, name, setting))
                continue
            _line(True, f"{prefix}model {model}", f"answered at {shown_url(base_url)}")
        streams = settings.delivery.streaming == "on"
        probe = await probe_tools(llm, (lambda index, text: None) if streams else None)  # streamed, as turns are
        forced_now = probe.tool_choice == "required"
        probe_ran = True
        forcing = forcing_line(settings, fallback, await llm.forcing_fallback(), forced_now, kept=kept)
        await probe_thinking(llm, settings)
        windows, window = await window_lines(settings, llm, primary_window, kept)
        for model in _models(settings):
            await probe_overrun(llm, model, (lambda index, text: None) if streams else None)
        speed = await speed_line(llm, llm.model, (lambda index, text: None) if streams else None)
        streaming = await _streaming_line(llm, probe, streams, remembered_whole, kept)
        if probe.tool_calls:
            how = "forced (tool_choice=required)" if forced_now else "with tool_choice=auto"
            _line(True, f"{prefix}tool calls", f"{llm.model} called a tool, {how}")
        else:
            fail(f"{prefix}tool calls", f"{llm.model} answered without calling a tool; use a model/server with tool "
                 "calling (llama.cpp: --jinja; vLLM: --enable-auto-tool-choice)")
    except ModelError as exc:
        fail(f"{prefix}model endpoint", _failure(exc, base_url, name))
        return None
    finally:
        await llm.aclose()
    if forcing[0]:
        _note(f"{prefix}tool forcing", forcing[1])
    else:
        _line(True, f"{prefix}tool forcing", forcing[1])
    if probe_ran and "learned just now" in streaming:
        _note(f"{prefix}streaming", streaming)
    elif probe_ran:
        _line(True, f"{prefix}streaming", streaming)
    for fine, what, detail in windows:
        if fine:
            _line(True, f"{prefix}{what}", detail)
        else:
            _note(f"{prefix}{what}", detail)
    _line(True, f"{prefix}speed {llm.model}", speed)
    _line(True, f"{prefix}images", await _images_line(settings, base_url, llm.model))
    _line(True, f"{prefix}thinking", await _thinking_line(settings, base_url, llm.model))
    return window


async def _streaming_line(llm: LLM, probe: Any, streams: bool, remembered_whole: str | None, kept: str) -> str:
    """What the "streaming" line says after the tool probe."""
    if not streams:
        return "off (delivery.streaming)"
    if remembered_whole:
        why = _reason(remembered_whole)
        line = f"whole messages: the daemon remembers that this endpoint could not stream ({why}); it tries again 24 h after that"
        if probe.streamed:
            line += "; it streamed just now, so the next try will switch streaming back on"
        return line
    if probe.streamed:
        return "on: the endpoint streams tool calls"
    if why := await llm.stream_fallback():
        return f"whole messages, learned just now ({kept}): {why}; it tries again 24 h after that"
    return "whole messages: the endpoint did not stream this time (the daemon decides after a few tries)"


def _models(settings: Settings) -> dict[str, str]:
    """The models ``check`` asks of an endpoint (``settings.llm`` is its own section), each with
    the key that names it: ``model``, ``reflex_model``, ``background_model`` (the primary's)."""
    llm = settings.llm
    models = {llm.model: "model"}
    for model, key in ((llm.reflex_model, "reflex_model"), (llm.background_model, "background_model")):
        if model:
            models.setdefault(model, key)
    return models


def _failure(exc: ModelError, base_url: str, name: str, setting: str = "model") -> str:
    """Why the endpoint at ``base_url`` (``name``: ``""`` for the primary, else ``fallback N``)
    did not answer a request for the model its key ``setting`` names."""
    url = f"{shown_url(base_url)}/chat/completions"
    if name:  # "fallback N": its settings are llm.fallbacks[N-1]
        where = f"llm.fallbacks[{int(name.split()[-1]) - 1}]"
        return model_failure(exc, url, settings=f"{where}.base_url", key=f"{where}.api_key_env", model=f"{where}.{setting}")
    return model_failure(exc, url, model=f"llm.{setting}")


def tool_access_lines(settings: Settings) -> list[tuple[str, str]]:
    """Where each enabled tool group and MCP server is offered (``tools.<group>.allowed_chats``,
    ``mcp.servers.<name>.allowed_chats``), one ``(what, detail)`` per line of ``check``."""
    from tools import TOOL_GROUPS
    from tools.access import describe_rules

    t = settings.tools
    enabled = {"shell": t.shell.enabled, "web": t.web.enabled, "tasks": True, "files": True, "knowledge": True}
    lines = []
    for group, names in TOOL_GROUPS.items():
        if not enabled[group]:
            lines.append((f"tools {group}", f"off (tools.{group}.enabled: false)"))
            continue
        rules = getattr(t, group).allowed_chats
        detail = f"{', '.join(names)} offered {describe_rules(rules)} (tools.{group}.allowed_chats)"
        if group == "files":
            detail += f"; the whole workspace {describe_rules(t.files.shared_chats)}, elsewhere only the chat's " \
                      "own folder (tools.files.shared_chats)"
        lines.append((f"tools {group}", detail))
    for name, server in settings.mcp.servers.items():
        rules = server.allowed_chats if server.allowed_chats is not None else ["private"]
        lines.append((f"tools mcp {name}", f"offered {describe_rules(rules)} (mcp.servers.{name}.allowed_chats)"))
    tg, dc = settings.telegram, settings.discord
    if not (tg.allowed_user_ids or [i for i in tg.allowed_chat_ids if i > 0] or dc.allowed_user_ids):
        lines.append(("tools private", "no allowlisted user: 'private' means the terminal only (set "
                      "telegram.allowed_user_ids or discord.allowed_user_ids)"))
    return lines


async def forcing_mode(settings: Settings, base_url: str, now: float | None = None) -> tuple[str, ForcingFallback | None]:
    """The tool forcing the daemon uses with ``base_url``, as text, and its fallback if any.

    Reads ``kv`` ``llm.tool_choice:<base_url>`` from the database opened read-only (no
    database yet: forcing is on).

    Args:
        now: epoch seconds, for the time left to the next re-try (default: the clock).
    """
    if settings.llm.tool_choice != "required":
        return f"{settings.llm.tool_choice} (llm.tool_choice in the config; never forced)", None
    if not settings.store_exists():
        return "required", None
    try:
        async with Store(settings.store_location, readonly=True) as store:
            raw = await store.get_kv(tool_choice_key(base_url))
    except (StoreError, *STORE_FAILURES) as exc:
        return f"unknown (cannot read {settings.store_shown}: {exc})", None
    fallback = ForcingFallback.parse(raw)
    if fallback is None:
        return "required", None
    return fallback.describe(time.time() if now is None else now), fallback


async def _stored_kv(settings: Settings, key: str) -> str | None:
    """A ``kv`` value of the daemon's database, opened read-only (``None``: none, or no database)."""
    if not settings.store_exists():
        return None
    try:
        async with Store(settings.store_location, readonly=True) as store:
            return await store.get_kv(key)
    except (StoreError, *STORE_FAILURES):
        return None


def _since(raw: str) -> float:
    """When a remembered refusal was recorded, epoch seconds (0: unknown)."""
    try:
        return float(json.loads(raw).get("since") or 0)
    except (ValueError, AttributeError, TypeError):
        return 0.0


def _reason(raw: str) -> str:
    try:
        return str(json.loads(raw).get("reason") or "reason not recorded")
    except (ValueError, AttributeError):
        return "reason not recorded"


async def _images_line(settings: Settings, base_url: str, model: str) -> str:
    """What happens to photos: ``llm.vision``, and what the daemon remembers of the model."""
    mode = settings.llm.vision
    if mode != "auto":
        return f"{'always' if mode == 'on' else 'never'} sent to the model (llm.vision: {mode})"
    remembered = await _stored_kv(settings, vision_key(base_url, model))
    if remembered:
        return (f"not sent: the daemon remembers that {model} refused them ({_reason(remembered)}); "
                "it tries again 24 h after that")
    return f"sent to {model} until the endpoint refuses one (llm.vision: auto)"


async def _thinking_line(settings: Settings, base_url: str, model: str) -> str:
    """Whether deliberate turns ask for thinking: ``llm.thinking``, and what the daemon
    remembers of the model."""
    t = settings.llm.thinking
    if t.mode == "off":
        return "never asked for (llm.thinking.mode: off)"
    if t.mode == "extra_body":
        return "deliberate turns send llm.thinking.extra_body_on, the others extra_body_off"
    asked = f"deliberate turns send reasoning_effort={t.reasoning_effort}"
    if t.mode == "reasoning_effort":
        return asked + " (llm.thinking.mode: reasoning_effort)"
    remembered = await _stored_kv(settings, thinking_key(base_url, model))
    if remembered and time.time() - _since(remembered) < THINKING_RETRY_S:
        return (f"not asked for: the daemon remembers that {model} refused reasoning_effort "
                f"({_reason(remembered)}); it tries again 24 h after that")
    return asked + " until the endpoint refuses it (llm.thinking.mode: auto)"


def _groups_line(tg: Any, me: dict[str, Any]) -> str:
    """How the bot behaves in groups, with what privacy mode (getMe) lets it see."""
    if tg.respond_in_groups == "never":
        return "respond_in_groups: never (silent in groups)"
    mode = f"respond_in_groups: {tg.respond_in_groups}"
    if me.get("can_join_groups") is False:
        return f"{mode}; the bot cannot be added to groups (BotFather: Allow Groups)"
    if me.get("can_read_all_group_messages"):
        return f"{mode}; privacy mode off: it reads every group message (group_context: {tg.group_context})"
    hint = "(BotFather: /mybots, Bot Settings, Group Privacy, Turn off; then re-add the bot to each group)"
    if tg.respond_in_groups == "always":
        return f"{mode}, but privacy mode is on: it only sees mentions, replies to it and commands {hint}"
    return f"{mode}; privacy mode on: in groups it only sees mentions, replies to it and commands, so group_context has nothing to show {hint}"
