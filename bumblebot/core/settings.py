"""The configuration's shape: every section, its keys, their defaults and limits.

:mod:`bumblebot.core.config` reads a file and the environment into :class:`Settings`. Unknown
keys are errors, so a typo never passes silently; ``docs/configuration.md`` lists every key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from bumblebot.core.events import ChatRef
from bumblebot.core.llm_settings import (  # noqa: F401  (the llm section, importable from here too)
    FallbackSettings,
    LLMSettings,
    Section,
    ThinkingSettings,
    off_is_text,
    on_off,
)
from bumblebot.core.mcp_settings import MCPSettings
from bumblebot.core.store_settings import ClusterSettings, StoreSettings

DEFAULT_OPENAI_BASE_URL = "https://api.openai.com/v1"


class DeliverySettings(Section):
    """How replies reach the chat."""

    streaming: Literal["on", "off"] = Field(
        "on",
        description="show the text of a say call while the model is still writing it (one message "
        "edited in place); endpoints that cannot stream fall back to whole messages by themselves",
    )
    stream_edit_interval_s: float = Field(
        1.0, ge=0.2, le=10,
        description="least time between two edits of a streamed message, seconds; the platform's own "
        "floor applies on top (Telegram: 1 s in a private chat, 3 s in a group; Discord: 1 s)",
    )

    @field_validator("streaming", mode="before")
    @classmethod
    def _streamingon_off(cls, value: Any) -> Any:
        return on_off(value)


class MediaSettings(Section):
    """Photos, voice notes and files people send."""

    image_max_side_px: int = Field(
        1280, ge=64, le=8192,
        description="longest side of an image given to the model, pixels: Telegram's largest photo "
        "size within it is taken, larger images are scaled down",
    )
    image_max_bytes: int = Field(
        4_000_000, ge=10_000, description="largest encoded image given to the model, bytes"
    )
    inline_chars: int = Field(
        2000, ge=0,
        description="characters of a text document or PDF shown to the model inline (the rest it "
        "reads with read_file); 0: none",
    )
    max_attachments_per_turn: int = Field(
        10, ge=1, le=100,
        description="most files fetched for the messages a turn takes at once (a Telegram album holds "
        "10); the rest are not downloaded, and the model and the sender are told how many were left out",
    )


class VoiceSettings(Section):
    """Voice replies (text to speech)."""

    reply: Literal["off", "mirror"] = Field(
        "off",
        description="mirror: a turn answering a voice note also sends its replies as voice messages "
        "(POST /audio/speech, OGG/Opus)",
    )
    tts_model: str = Field("tts-1", description="text-to-speech model")
    tts_voice: str = Field("alloy", description="the voice of the text-to-speech model")
    max_chars: int = Field(
        1500, ge=50, le=4096, description="longest text read out as one voice message, characters (the rest is cut)"
    )

    @field_validator("reply", mode="before")
    @classmethod
    def _reply_off(cls, value: Any) -> Any:
        return "off" if value is False else value


class TelegramSettings(Section):
    """The Telegram adapter (python-telegram-bot, long polling)."""

    enabled: bool = Field(True, description="run the Telegram adapter when a token is set")
    base_url: str = Field(
        "https://api.telegram.org/bot", description="Bot API base URL (self-hosted Bot API server)"
    )
    base_file_url: str = Field("https://api.telegram.org/file/bot", description="file download base URL")
    allowed_user_ids: list[int] = Field(
        default_factory=list, description="user ids allowed to talk; empty with empty chats = anyone"
    )
    allowed_chat_ids: list[int] = Field(default_factory=list, description="chat ids allowed to talk")
    poll_timeout_s: int = Field(30, ge=0, le=50, description="getUpdates long-poll timeout, seconds")
    webhook_url: str | None = Field(
        None, description="the public HTTPS URL Telegram posts updates to (its secret: TELEGRAM_WEBHOOK_SECRET); null: polling"
    )
    webhook_listen: str = Field("127.0.0.1:8443", description="host:port this process serves the webhook on, behind the HTTPS proxy")
    respond_in_groups: Literal["mention", "always", "never"] = Field(
        "mention", description="in groups answer when mentioned, replied to or commanded; every message; or never"
    )
    group_context: int = Field(
        20, ge=0, le=200,
        description="unaddressed group messages since the last turn shown as background (needs privacy mode off)",
    )
    allow_bots: bool = Field(False, description="answer other bots that address the bot (never itself)")
    max_file_bytes: int = Field(
        20 * 1024 * 1024, ge=1,
        description="largest file downloaded, bytes; the Bot API serves at most 20 MB (getFile)",
    )


class DiscordSettings(Section):
    """The Discord adapter (discord.py)."""

    enabled: bool = Field(False, description="run the Discord adapter when a token is set")
    api_base_url: str = Field("https://discord.com/api/v10", description="REST base URL")
    gateway_url: str = Field("wss://gateway.discord.gg", description="gateway websocket URL")
    shard_count: int | None = Field(
        None, ge=1, le=1024,
        description="gateway shards (unset: one connection per process); workers of a cluster split them through leases",
    )
    respond_in_guilds: Literal["mention", "all", "off"] = Field(
        "mention", description="in guild channels answer when mentioned/replied to, always, or never"
    )
    allowed_user_ids: list[int] = Field(default_factory=list, description="user allowlist (empty = anyone)")
    allowed_channel_ids: list[int] = Field(
        default_factory=list, description="guild channel allowlist (empty = any channel)"
    )
    allow_bots: bool = Field(False, description="answer other bots (never itself)")
    max_file_bytes: int = Field(
        25 * 1024 * 1024, ge=1,
        description="largest attachment downloaded, bytes (Discord lets users upload 10 MB, more with Nitro)",
    )

    @field_validator("respond_in_guilds", mode="before")
    @classmethod
    def _respond_off(cls, value: Any) -> Any:
        return off_is_text(value)


class HistoryCompression(Section):
    """Context compaction; keys and defaults as docs/compaction.md describes them."""

    enabled: bool = Field(True, description="compact before the context fills up")
    compaction_threshold_ratio: float = Field(
        0.75, gt=0, lt=1, description="compact when the estimate exceeds this share of max_context_tokens"
    )
    compaction_target_ratio: float = Field(
        0.20, gt=0, lt=1, description="after compaction the prompt aims for this share of max_context_tokens"
    )
    compaction_protect_last_n: int = Field(12, ge=1, description="minimum recent messages kept verbatim")
    compaction_protect_first_n: int = Field(2, ge=0, description="first messages kept verbatim")
    compaction_max_passes: int = Field(3, ge=1, le=10, description="compaction passes per trigger")
    compaction_flush_to_knowledge: bool = Field(
        True, description="extract durable facts into the chat's knowledge file on the first pass"
    )

    @model_validator(mode="after")
    def _target_below_threshold(self) -> HistoryCompression:
        if self.compaction_target_ratio >= self.compaction_threshold_ratio:
            raise ValueError(
                "compaction_target_ratio must be below compaction_threshold_ratio "
                f"(got {self.compaction_target_ratio} >= {self.compaction_threshold_ratio})"
            )
        return self


#: The least one tool result may hold, characters: the head and tail a cut result keeps, and its note.
MIN_TOOL_RESULT_CHARS = 200


class CognitionSettings(Section):
    """The turn pipeline (docs/cognition.md and docs/compaction.md)."""

    max_context_tokens: int = Field(
        32768, ge=4096, le=10_000_000, description="the model's context window, tokens"
    )
    reflex_max_tokens: int = Field(512, ge=16, description="completion budget of reflex turns, tokens")
    deliberate_max_tokens: int = Field(2048, ge=64, description="completion budget of deliberate turns")
    tool_continuation_rounds: int = Field(
        4, ge=0, description="tool rounds; clamped to [0, 16]; steps = max(6, min(25, 6 + rounds))"
    )
    tool_timeout_s: float = Field(60.0, gt=0, description="default timeout of one tool call, seconds")
    mid_turn_messages: Literal["steer", "queue"] = Field(
        "steer", description="steer: show mid-turn messages at the next step; queue: next turn"
    )
    debounce_s: float = Field(
        0.3, ge=0, le=10, description="messages of one chat this close together merge into one turn, seconds (0: off)"
    )
    classifier: bool = Field(True, description="ask the reflex model when the router is unsure")
    max_messages_per_turn: int = Field(
        4, ge=1, le=20, description="most messages one turn sends; later say calls are not delivered"
    )
    max_tool_result_share: float = Field(
        0.25, gt=0, le=1, description="cap of one tool result as a share of max_context_tokens"
    )
    first_words_s: float = Field(
        30.0, ge=0, description="a turn whose person has seen nothing for this long names say as the tool of its "
        "next step, seconds (0: never by time)"
    )
    history_compression: HistoryCompression = Field(default_factory=HistoryCompression)

    @property
    def tool_result_chars(self) -> int:
        """``max_tool_result_share`` of the configured window in characters (4 a token); the
        loop caps again against the window it learns (``ContextBudget.share_chars``)."""
        return int(self.max_tool_result_share * self.max_context_tokens * 4)

    @model_validator(mode="after")
    def _result_cap_holds_a_result(self) -> CognitionSettings:
        chars = self.tool_result_chars
        if chars < MIN_TOOL_RESULT_CHARS:
            raise ValueError(
                f"max_tool_result_share leaves one tool result {chars} characters of a {self.max_context_tokens}-token "
                f"window; it needs at least {MIN_TOOL_RESULT_CHARS}"
            )
        return self


#: How ``allowed_chats`` is described in every tool group (``tools/access.py`` reads the rules).
_CHATS = (
    "conversation keys (telegram:123; a key covers its topics), 'telegram:*', 'private' (private chats with "
    "allowlisted users, and the terminal), '*' (everywhere)"
)


def _chats(default: str) -> Any:
    return Field(
        default_factory=lambda: [default], description=f"where these tools are offered: {_CHATS}; default {default}"
    )


class ShellSettings(Section):
    enabled: bool = Field(False, description="register run_command (in a bubblewrap sandbox unless sandbox: off)")
    timeout_s: float = Field(30.0, gt=0, description="maximum run time of one command, seconds")
    max_output_chars: int = Field(6000, ge=1000, description="cap of stdout/stderr each, characters")
    sandbox: Literal["bwrap", "off"] = Field(
        "bwrap",
        description="bwrap: commands run in a bubblewrap sandbox (the workspace writable, the system read-only, "
        "no daemon files or processes); if it cannot run, run_command is not offered; off: unconfined, as the daemon user",
    )
    bwrap: str = Field("bwrap", min_length=1, description="the bubblewrap binary: a name looked up in PATH, or a path")
    network: bool = Field(False, description="sandboxed commands reach the network (the host's, loopback included)")
    memory_mb: int = Field(1024, ge=16, description="address space of each sandboxed process (RLIMIT_AS), MiB")
    tmp_mb: int = Field(512, ge=1, description="size of each of the sandbox's /tmp and /dev/shm (in memory), MiB")
    max_processes: int = Field(128, ge=4, description="processes and threads a sandboxed command may have at once")
    cpu_s: int = Field(60, ge=1, description="CPU time of each sandboxed process, seconds")
    allowed_chats: list[str] = _chats("private")

    @field_validator("sandbox", mode="before")
    @classmethod
    def _sandbox_off(cls, value: Any) -> Any:
        return off_is_text(value)


class FetchSettings(Section):
    enabled: bool = Field(True, description="register fetch_url")
    timeout_s: float = Field(20.0, gt=0, description="request timeout, seconds")
    max_bytes: int = Field(2_000_000, ge=1024, description="maximum body read, bytes")
    allow_private: bool = Field(False, description="allow loopback and private addresses")
    allowed_chats: list[str] = _chats("*")


class FilesSettings(Section):
    """The file tools (read_file, write_file, append_file, list_directory, search_files, send_file)."""

    allowed_chats: list[str] = _chats("*")
    shared_chats: list[str] = Field(
        default_factory=lambda: ["private"],
        description="where the file tools reach the whole workspace (same rules as allowed_chats); elsewhere "
        "only the chat's own folder, inbox/<chat>; default private",
    )


class ToolGroupSettings(Section):
    """A tool group whose only setting is where it is offered (its data is the chat's own)."""

    allowed_chats: list[str] = _chats("*")


class ToolsSettings(Section):
    workspace: Path | None = Field(None, description="work tools' root; default <data_dir>/workspace")
    max_result_chars: int | None = Field(
        None, ge=500, description="deprecated and ignored: use cognition.max_tool_result_share"
    )
    shell: ShellSettings = Field(default_factory=ShellSettings)
    web: FetchSettings = Field(default_factory=FetchSettings)
    files: FilesSettings = Field(default_factory=FilesSettings)
    knowledge: ToolGroupSettings = Field(
        default_factory=ToolGroupSettings, description="remember and recall (the chat's own facts)"
    )
    tasks: ToolGroupSettings = Field(
        default_factory=ToolGroupSettings, description="schedule_task, list_tasks, cancel_task (the chat's own tasks)"
    )


class AutomationSettings(Section):
    """Scheduled tasks (``schedule_task``)."""

    max_tasks: int = Field(50, ge=1, description="most active scheduled tasks per conversation")
    min_interval_s: float = Field(60.0, gt=0, description="shortest repeat of a recurring task, seconds")


class AutonomySettings(Section):
    """Autonomous turns: the entity may reach out on its own in active conversations."""

    enabled: bool = Field(False, description="give the entity an autonomous turn per active conversation")
    interval_s: float = Field(3600.0, ge=1, description="time between autonomous turns of a conversation, seconds")
    active_window_s: float = Field(
        86400.0, gt=0, description="a conversation is active while its last message from a person is this recent, seconds"
    )
    quiet_hours: str | None = Field(
        None, description="no autonomous turns in this span of the entity's day, e.g. '22:00-08:00'; null: none"
    )
    max_messages_per_day: int = Field(
        2, ge=0, description="most messages autonomous turns send per conversation and day (the entity's day)"
    )

    @field_validator("quiet_hours")
    @classmethod
    def _span(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        parts = value.replace(" ", "").split("-")
        try:
            if len(parts) != 2:
                raise ValueError
            for part in parts:
                hour, minute = part.split(":")
                if not (0 <= int(hour) <= 23 and 0 <= int(minute) <= 59):
                    raise ValueError
        except ValueError:
            raise ValueError("expected 'HH:MM-HH:MM', e.g. '22:00-08:00'") from None
        return "-".join(parts)

    def quiet(self, hour: int, minute: int) -> bool:
        """Whether the time of day ``hour:minute`` falls in :attr:`quiet_hours` (a span may
        cross midnight)."""
        if self.quiet_hours is None:
            return False
        start, end = ((int(h) * 60 + int(m)) for h, m in (p.split(":") for p in self.quiet_hours.split("-")))
        now = hour * 60 + minute
        return start <= now < end if start <= end else now >= start or now < end


class MetricsSettings(Section):
    """Prometheus metrics (off unless ``listen`` is set)."""

    listen: str | None = Field(
        None, description="host:port to serve /metrics on, e.g. 127.0.0.1:9464; null: no metrics"
    )

    @field_validator("listen")
    @classmethod
    def _host_port(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        host, _, port = value.strip().rpartition(":")
        bare_ipv6 = ":" in host and not (host.startswith("[") and host.endswith("]"))
        if not host or bare_ipv6 or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"expected host:port, e.g. 127.0.0.1:9464 or [::1]:9464 (got {value!r})")
        return value.strip()


def _listen(value: str | None, example: str) -> str | None:
    """``host:port`` checked (``[::1]:port`` for IPv6), or ``None`` for null or empty."""
    if value is None or not value.strip():
        return None
    host, _, port = value.strip().rpartition(":")
    bare_ipv6 = ":" in host and not (host.startswith("[") and host.endswith("]"))
    if not host or bare_ipv6 or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"expected host:port, e.g. {example} or [::1]:{example.rpartition(':')[2]} (got {value!r})")
    return value.strip()


def is_loopback(listen: str) -> bool:
    """Whether ``host:port`` names a loopback address (``localhost``, ``127.0.0.0/8``, ``::1``)."""
    import ipaddress

    host = listen.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class WebSettings(Section):
    """The operator's web console (``docs/console.md``); off unless ``listen`` is set."""

    insecure_bind: bool = Field(
        False, description="allow a listen address that is not loopback (the page is served without TLS: put a "
        "TLS proxy in front); a warning is logged at start",
    )
    listen: str | None = Field(
        None, description="host:port to serve the console on, e.g. 127.0.0.1:8790; null: no console"
    )
    secure_cookie: bool = Field(False, description="mark the session cookie Secure (set it when TLS is in front)")
    session_hours: float = Field(12.0, gt=0, description="how long a login lasts, hours")

    @field_validator("listen")
    @classmethod
    def _host_port(cls, value: str | None, info: ValidationInfo) -> str | None:
        listen = _listen(value, "127.0.0.1:8790")
        if listen and not info.data.get("insecure_bind") and not is_loopback(listen):
            raise ValueError(
                f"a loopback address, e.g. 127.0.0.1:8790 (got {listen!r}): the console would be served without "
                "TLS; listen on 127.0.0.1 behind a TLS proxy, or set web.insecure_bind: true"
            )
        return listen


class LimitsSettings(Section):
    """Spending limits per UTC day (``docs/usage.md``); none by default.

    Tokens count prompt (cached included) plus completion; costs are in the currency of
    ``llm.prices`` and only count requests whose model has a price there.
    """

    sender_daily_tokens: int | None = Field(
        None, ge=1, description="most tokens one person's turns use a day, all chats together; null: no limit"
    )
    sender_daily_cost: float | None = Field(
        None, gt=0, description="most one person's turns cost a day, all chats together; null: no limit"
    )
    chat_daily_tokens: int | None = Field(
        None, ge=1, description="most tokens one conversation uses a day, background work included; null: no limit"
    )
    chat_daily_cost: float | None = Field(
        None, gt=0, description="most one conversation costs a day, background work included; null: no limit"
    )
    bot_daily_tokens: int | None = Field(
        None, ge=1, description="most tokens the whole bot uses a day; null: no limit"
    )
    bot_daily_cost: float | None = Field(
        None, gt=0, description="most the whole bot costs a day; null: no limit"
    )
    background_daily_tokens: int | None = Field(
        None, ge=1, description="most tokens scheduled tasks and autonomous turns use a day, all chats together; null: no limit"
    )
    background_daily_cost: float | None = Field(
        None, gt=0, description="most scheduled tasks and autonomous turns cost a day, all chats together; null: no limit"
    )
    notify_chat: str | None = Field(
        None, description="conversation key told when a limit is reached (once per limit and day), e.g. telegram:123; "
        "null: the log only",
    )

    @field_validator("notify_chat")
    @classmethod
    def _chat_key(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        try:
            return ChatRef.from_key(value.strip()).key
        except ValueError:
            raise ValueError(f"expected a conversation key such as telegram:123 (got {value!r})") from None


class EngineSettings(Section):
    idle_unload_s: float = Field(600.0, gt=0, description="unload a conversation idle this long, seconds")
    max_concurrent_turns: int | None = Field(
        None, ge=1, description="deprecated and ignored: use llm.max_concurrent_requests"
    )
    shutdown_grace_s: float = Field(30.0, ge=0, description="time in-flight turns get on stop, seconds")
    typing_interval_s: float = Field(4.5, gt=0, description="typing indicator refresh, seconds")
    outage_limit_s: float = Field(
        3600.0,
        gt=0,
        description="how long a message waits for an unreachable model (retried with backoff up to "
        "60 s, or the endpoint's Retry-After up to 5 min; with llm.fallbacks every endpoint is asked at "
        "each retry) before the user is told it failed, seconds",
    )
    outbox_expiry_s: float = Field(
        86400.0,
        gt=0,
        description="a reply still undelivered this long after it was queued (retried every 30 s "
        "meanwhile) is marked failed, logged and never sent, seconds",
    )
    retention_days: int = Field(
        90,
        ge=0,
        description="settled journal and outbox rows and finished turns' traces older than this are "
        "pruned (the message history never is); 0 keeps everything, days",
    )


class Settings(BaseSettings):
    """The whole configuration. See ``docs/configuration.md`` for every key."""

    model_config = SettingsConfigDict(
        env_prefix="BUMBLEBOT_", env_nested_delimiter="__", extra="forbid", validate_default=True
    )

    entity: str = Field("default", description="a name in entities/ or a path to a YAML file")
    data_dir: Path = Field(Path("./data"), description="SQLite database, knowledge.md, workspace")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="log level")
    log_format: Literal["text", "json"] = Field(
        "text", description="text: one line per event; json: one JSON object per event, with conversation and turn ids"
    )

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper_level(cls, value: Any) -> Any:
        return value.upper() if isinstance(value, str) else value
    llm: LLMSettings = Field(default_factory=LLMSettings)
    delivery: DeliverySettings = Field(default_factory=DeliverySettings)
    media: MediaSettings = Field(default_factory=MediaSettings)
    voice: VoiceSettings = Field(default_factory=VoiceSettings)
    telegram: TelegramSettings = Field(default_factory=TelegramSettings)
    discord: DiscordSettings = Field(default_factory=DiscordSettings)
    cognition: CognitionSettings = Field(default_factory=CognitionSettings)
    tools: ToolsSettings = Field(default_factory=ToolsSettings)
    automation: AutomationSettings = Field(default_factory=AutomationSettings)
    autonomy: AutonomySettings = Field(default_factory=AutonomySettings)
    metrics: MetricsSettings = Field(default_factory=MetricsSettings)
    web: WebSettings = Field(default_factory=WebSettings, description="the operator's web console")
    limits: LimitsSettings = Field(default_factory=LimitsSettings)
    mcp: MCPSettings = Field(default_factory=MCPSettings, description="MCP tool servers")
    engine: EngineSettings = Field(default_factory=EngineSettings)
    store: StoreSettings = Field(default_factory=StoreSettings, description="where the state is kept")
    cluster: ClusterSettings = Field(default_factory=ClusterSettings, description="workers sharing a PostgreSQL store")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The YAML document arrives as init kwargs; env overrides it key by key.
        return (env_settings, init_settings)

    @property
    def workspace(self) -> Path:
        """The work tools' root directory."""
        return self.tools.workspace or self.data_dir / "workspace"

    @property
    def media_dir(self) -> Path:
        """Where received images and voice replies are kept (``<data_dir>/media``)."""
        return self.data_dir / "media"

    @property
    def on_postgres(self) -> bool:
        """Whether the state is in PostgreSQL (``store.url``), not a SQLite file."""
        return (self.store.url or "").startswith(("postgresql://", "postgres://"))

    @property
    def db_path(self) -> Path:
        """The SQLite file: ``store.url`` when it is a path, else ``<data_dir>/bumblebot.db``."""
        return Path(self.store.url) if self.store.url and not self.on_postgres else self.data_dir / "bumblebot.db"

    @property
    def store_location(self) -> Path | str:
        """What :class:`~bumblebot.store.Store` opens: the PostgreSQL URL, or the SQLite file."""
        return self.store.url if self.store.url and self.on_postgres else self.db_path

    @property
    def store_shown(self) -> str:
        """The database, to name in messages (a URL without its password)."""
        if not self.store.url or not self.on_postgres:
            return str(self.db_path)
        from bumblebot.core.store_settings import shown_url

        return shown_url(self.store.url)

    def store_exists(self) -> bool:
        """Whether there is a database to read (a PostgreSQL server is taken to have one)."""
        return self.on_postgres or self.db_path.exists()

    @property
    def knowledge_path(self) -> Path:
        return self.data_dir / "knowledge.md"
