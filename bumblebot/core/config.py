"""Configuration: one YAML file, ``BUMBLEBOT_<SECTION>__<KEY>`` env overrides, secrets from env.

Where the file comes from (first match wins): ``--config PATH``, env ``BUMBLEBOT_CONFIG``,
``./bumblebot.yaml``, else built-in defaults. Precedence of values: env override > YAML >
default. Unknown keys are errors, so a typo never passes silently. Relative paths
(``data_dir``, ``tools.workspace``, a SQLite ``store.url``, an entity path) are resolved against the config file's
directory (or the working directory when there is no file).

Secrets never live in the YAML file: they come from the environment or a ``.env`` file next to
the working directory, under their usual names (``TELEGRAM_BOT_TOKEN``, ``DISCORD_BOT_TOKEN``,
``OPENAI_API_KEY``, ``OPENAI_BASE_URL``, ``BUMBLEBOT_WEB_TOKEN``); a fallback endpoint's key under the name its
``api_key_env`` gives (:meth:`Secrets.named`).

Raises:
    ConfigError: from :func:`load_settings`, naming the file, the key and what was expected.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path
from typing import Any

import yaml
from pydantic import (
    BaseModel,
    Field,
    PrivateAttr,
    SecretStr,
    ValidationError,
)
from pydantic_settings import (
    BaseSettings,
    SettingsConfigDict,
    SettingsError,
)

from bumblebot.core.errors import ConfigError
from bumblebot.core.settings import DEFAULT_OPENAI_BASE_URL, Settings
from bumblebot.core.store_settings import url_secrets


class Secrets(BaseSettings):
    """Secrets from the environment or ``.env``, under their usual names. Never logged."""

    model_config = SettingsConfigDict(env_file=".env", extra="ignore", populate_by_name=False)

    telegram_bot_token: SecretStr | None = Field(None, validation_alias="TELEGRAM_BOT_TOKEN")
    discord_bot_token: SecretStr | None = Field(None, validation_alias="DISCORD_BOT_TOKEN")
    openai_api_key: SecretStr | None = Field(None, validation_alias="OPENAI_API_KEY")
    openai_base_url: str | None = Field(None, validation_alias="OPENAI_BASE_URL")
    #: the web console's login token (else the one ``bumblebot web token`` stored as a hash)
    web_token: SecretStr | None = Field(None, validation_alias="BUMBLEBOT_WEB_TOKEN")
    #: the secret token Telegram sends with each webhook request (``telegram.webhook_url``)
    telegram_webhook_secret: SecretStr | None = Field(None, validation_alias="TELEGRAM_WEBHOOK_SECRET")
    #: the PostgreSQL password (``store.url``), as libpq and asyncpg name it
    pg_password: SecretStr | None = Field(None, validation_alias="PGPASSWORD")

    _dotenv: dict[str, str] = PrivateAttr(default_factory=dict)

    def __init__(self, **values: Any) -> None:
        super().__init__(**values)
        # the .env this was read from, kept for the names only the config knows (named())
        env_file = values.get("_env_file", self.model_config.get("env_file"))
        if isinstance(env_file, str | os.PathLike) and Path(env_file).is_file():
            from dotenv import dotenv_values

            with contextlib.suppress(OSError):
                self._dotenv = {k: v for k, v in dotenv_values(env_file).items() if v is not None}

    def values(self) -> list[str]:
        """Every secret value that is set (for log redaction)."""
        out = []
        for v in (self.telegram_bot_token, self.discord_bot_token, self.openai_api_key, self.web_token, self.pg_password,
                  self.telegram_webhook_secret):
            if v is not None and v.get_secret_value():
                out.append(v.get_secret_value())
        return out

    def named(self, name: str) -> str | None:
        """The secret in the environment variable ``name``, else on the line ``name=`` of the
        ``.env`` this was read from (a fallback endpoint's ``api_key_env``); ``None``: unset."""
        return os.environ.get(name) or self._dotenv.get(name) or None


def endpoint_secrets(settings: Settings, secrets: Secrets) -> list[str]:
    """The keys of the fallback endpoints (``llm.fallbacks[].api_key_env``) that are set: secrets
    no log, chat or stored text may hold."""
    names = [f.api_key_env for f in settings.llm.fallbacks if f.api_key_env]
    return [value for name in names if (value := secrets.named(name))]


def apply_dotenv(path: Path = Path(".env")) -> list[str]:
    """Make ``BUMBLEBOT_*`` lines of ``.env`` count like environment variables.

    Real environment variables win. Secrets (``TELEGRAM_BOT_TOKEN``…) are read from ``.env`` by
    :class:`Secrets` itself and are not copied into the process environment.

    Returns:
        the names taken from the file.
    """
    if not path.is_file():
        return []
    from dotenv import dotenv_values

    taken = []
    for name, value in dotenv_values(path).items():
        if name.upper().startswith(ENV_PREFIX) and value is not None and name not in os.environ:
            os.environ[name] = value
            taken.append(name)
    return taken


def find_config(explicit: str | os.PathLike[str] | None = None) -> Path | None:
    """The config file to use: ``explicit``, else ``$BUMBLEBOT_CONFIG``, else ``./bumblebot.yaml``.

    Returns ``None`` when no file is named and ``./bumblebot.yaml`` does not exist.

    Raises:
        ConfigError: a file named explicitly or through the environment does not exist.
    """
    named = explicit or os.environ.get("BUMBLEBOT_CONFIG")
    if named:
        path = Path(named).expanduser()
        try:
            found = path.stat()
        except PermissionError:
            raise ConfigError(
                str(path), "", f"a file this user can reach (Permission denied on {path.parent}: the user running "
                "Bumblebot must be able to enter that directory)"
            ) from None
        except OSError:
            raise ConfigError(str(path), "", "config file not found") from None
        if not stat.S_ISREG(found.st_mode):
            raise ConfigError(str(path), "", "is a directory, not a config file" if stat.S_ISDIR(found.st_mode)
                              else "is not a regular file, not a config file")
        return path
    default = Path("bumblebot.yaml")
    return default if default.is_file() else None


ENV_PREFIX = "BUMBLEBOT_"
_ENV_NOT_KEYS = {"BUMBLEBOT_CONFIG", "BUMBLEBOT_WEB_TOKEN"}  # not keys: the config file, a secret


def _env_names(model: type[BaseModel], prefix: str) -> set[str]:
    names = set()
    for name, field in model.model_fields.items():
        ann = field.annotation
        full = f"{prefix}{name.upper()}"
        names.add(full)
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            names |= _env_names(ann, full + "__")
    return names


def _check_env_names() -> None:
    """An unknown ``BUMBLEBOT_*`` variable is an error, like an unknown YAML key."""
    known = _env_names(Settings, ENV_PREFIX) | _ENV_NOT_KEYS
    for name in sorted(os.environ):
        if name.upper().startswith(ENV_PREFIX) and name.upper() not in known:
            hint = " (sections and keys are separated by two underscores)" if "__" not in name else ""
            raise ConfigError(f"environment variable {name}", "", f"no such setting{hint}")


def _non_text_key(node: Any, prefix: str = "") -> str | None:
    """The dotted path of the first mapping key that is not text, anywhere in ``node``."""
    if isinstance(node, dict):
        for key, value in node.items():
            if not isinstance(key, str):
                return f"{prefix}{key!r}"
            found = _non_text_key(value, f"{prefix}{key}.")
            if found:
                return found
    return None


def _env_field(message: str) -> str:
    import re

    m = re.search(r'field "([^"]+)"', message)
    return m.group(1) if m else "(an override)"


def _describe(error: dict[str, Any]) -> tuple[str, str]:
    loc = [str(p) for p in error.get("loc", ())]
    key = ".".join(loc)
    kind = error.get("type", "")
    if kind == "extra_forbidden":
        return key, "unknown key (check the spelling; docs/configuration.md lists every key)"
    msg = error.get("msg", "invalid value")
    msg = msg.removeprefix("Value error, ").removeprefix("Input should be ")
    expected = f"expected {msg}" if kind != "value_error" else msg
    if "input" in error and not isinstance(error["input"], dict | list) and loc[-1:] != ["url"]:
        expected += f" (got {error['input']!r})"  # a URL may carry a password: never shown
    return key, expected


def load_settings(path: Path | None = None) -> Settings:
    """Read, validate and resolve the configuration.

    Args:
        path: the YAML file (from :func:`find_config`), or ``None`` for defaults plus env.

    Returns:
        Settings with ``data_dir`` and ``tools.workspace`` made absolute.

    Raises:
        ConfigError: unreadable YAML, a document that is not a mapping, an unknown key or a
            value of the wrong type; the error names the file, the dotted key and what was
            expected.
    """
    source = str(path) if path else "environment"
    data: dict[str, Any] = {}
    _check_env_names()
    if path is not None:
        try:
            loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError(source, "", f"cannot read file ({exc.strerror})") from exc
        except UnicodeDecodeError as exc:
            raise ConfigError(source, "", f"a UTF-8 text file (byte {exc.start} is not UTF-8)") from exc
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f"line {mark.line + 1}" if mark is not None else "?"
            raise ConfigError(source, where, f"invalid YAML ({getattr(exc, 'problem', exc)})") from exc
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(source, "(top level)", "expected a mapping of keys to values")
        bad_key = _non_text_key(loaded)
        if bad_key is not None:
            raise ConfigError(
                source, bad_key, "keys must be text (YAML reads on/off/yes/no as booleans: quote them)"
            )
        data = loaded
    try:
        settings = Settings(**data)
    except SettingsError as exc:
        # an override that is not valid JSON for a list/dict field, e.g. "[1,2"
        raise ConfigError("environment", _env_field(str(exc)), "a valid JSON value (e.g. [1, 2])") from None
    except ValidationError as exc:
        errors = exc.errors()
        key, expected = _describe(errors[0])
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        env_name = ENV_PREFIX + "__".join(str(p) for p in errors[0].get("loc", ())).upper()
        where = f"environment variable {env_name}" if env_name in os.environ else source
        raise ConfigError(where, key, expected + more) from None
    base = path.parent.resolve() if path else Path.cwd()
    data_dir = settings.data_dir.expanduser()
    settings.data_dir = (data_dir if data_dir.is_absolute() else base / data_dir).resolve()
    if settings.tools.workspace is not None:
        workspace = settings.tools.workspace.expanduser()
        settings.tools.workspace = (workspace if workspace.is_absolute() else base / workspace).resolve()
    if settings.store.url and not settings.on_postgres:  # a SQLite file: relative to the config too
        db = Path(settings.store.url).expanduser()
        settings.store.url = str((db if db.is_absolute() else base / db).resolve())
    settings.__dict__["config_dir"] = base
    return settings


#: The environment variables :class:`Secrets` reads.
SECRET_VARIABLES = (
    "TELEGRAM_BOT_TOKEN", "DISCORD_BOT_TOKEN", "OPENAI_API_KEY", "OPENAI_BASE_URL", "BUMBLEBOT_WEB_TOKEN", "PGPASSWORD",
    "TELEGRAM_WEBHOOK_SECRET",
)


def dotenv_unreadable(path: Path = Path(".env")) -> str | None:
    """Why ``path`` exists but cannot be read (``"Permission denied"``), ``None`` when it can
    be read or does not exist."""
    if not path.exists():
        return None
    try:
        with open(path, "rb"):
            return None
    except OSError as exc:
        return exc.strerror or str(exc)


def load_secrets(*, read_dotenv: bool = True, path: Path = Path(".env")) -> Secrets:
    """Secrets from the environment and the ``.env`` at ``path`` (not the file when
    ``read_dotenv`` is false).

    A ``PGPASSWORD`` only the ``.env`` holds is put in this process's environment, where the
    PostgreSQL client (asyncpg, like libpq) reads it."""
    secrets = Secrets(_env_file=path) if read_dotenv else Secrets(_env_file=None)
    if secrets.pg_password is not None and "PGPASSWORD" not in os.environ:
        os.environ["PGPASSWORD"] = secrets.pg_password.get_secret_value()
    return secrets


def store_secrets(settings: Settings) -> list[str]:
    """A password written into ``store.url`` itself: a secret no log or stored text may hold."""
    return url_secrets(settings.store.url) if settings.store.url and settings.on_postgres else []


def effective_base_url(settings: Settings, secrets: Secrets) -> str:
    """``llm.base_url``, else ``OPENAI_BASE_URL``, else OpenAI's own URL."""
    return settings.llm.base_url or secrets.openai_base_url or DEFAULT_OPENAI_BASE_URL
