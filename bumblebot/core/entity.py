"""Entities: the YAML personas in ``entities/``.

An entity file holds who the bot is; nothing in it is secret. Keys (all but ``name`` optional):

.. code-block:: yaml

    name: Bumble                  # how the entity calls itself
    persona: |                    # identity and personality, in the second person
      You are Bumble, ...
    voice:                        # voice rules, one per line
      - Short messages, like a person texting.
    greeting: "Hi, I'm Bumble."   # /start answer (no model call)
    always_deliberate: false      # route every turn to the deliberate profile
    timezone: Europe/Lisbon       # IANA name used in the turn context

Raises:
    ConfigError: from :func:`load_entity`, naming the file and the key.
"""

from __future__ import annotations

from pathlib import Path
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from bumblebot.core.errors import ConfigError

#: ``entities/`` shipped next to the package (a source checkout or an editable install).
BUNDLED_ENTITIES = Path(__file__).resolve().parents[2] / "entities"


class Entity(BaseModel):
    """A persona. See the module docstring for the keys."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, description="the entity's name")
    persona: str = Field("", description="identity and personality text")
    voice: list[str] = Field(default_factory=list, description="voice rules")
    greeting: str = Field("", description="the /start answer")
    always_deliberate: bool = Field(False, description="route every turn to deliberate")
    timezone: str = Field("UTC", description="IANA time zone for the turn context")
    source_path: str = Field("", description="file the entity was loaded from (set by the loader)")

    @field_validator("timezone")
    @classmethod
    def _known_zone(cls, value: str) -> str:
        try:
            ZoneInfo(value)
        except (ZoneInfoNotFoundError, ValueError) as exc:
            raise ValueError(f"an IANA time zone name like 'Europe/Lisbon' (got {value!r})") from exc
        return value

    @property
    def zone(self) -> ZoneInfo:
        return ZoneInfo(self.timezone)

    def start_text(self) -> str:
        return self.greeting or f"Hi, I'm {self.name}. Send me a message and I'll answer."


def resolve_entity_path(ref: str, search: list[Path], source: str = "config") -> Path:
    """The file for ``ref``: a path to a YAML file, or a name looked up in each ``search`` dir.

    Raises:
        ConfigError: nothing matches.
    """
    candidate = Path(ref).expanduser()
    if candidate.suffix in (".yaml", ".yml") or "/" in ref:
        for base in [*[d.parent for d in search], Path.cwd()]:
            p = candidate if candidate.is_absolute() else base / candidate
            if p.is_file():
                return p
            if p.is_dir():
                raise ConfigError(source, "entity", f"an entity YAML file; {str(p)!r} is a directory")
        raise ConfigError(source, "entity", f"an entity file; {ref!r} does not exist")
    for directory in search:
        for suffix in (".yaml", ".yml"):
            p = directory / f"{ref}{suffix}"
            if p.is_file():
                return p
    where = ", ".join(str(d) for d in search)
    raise ConfigError(source, "entity", f"the name of a file in entities/ ({ref!r} not found in {where})")


def load_entity(ref: str, *, config_dir: Path | None = None, source: str = "config") -> Entity:
    """Load and validate an entity by name or path.

    Args:
        ref: ``settings.entity``: a name (``"default"``) or a path to a YAML file.
        config_dir: the config file's directory; its ``entities/`` is searched first.

    Raises:
        ConfigError: missing file, invalid YAML, unknown key or wrong type.
    """
    search = [d for d in ((config_dir or Path.cwd()) / "entities", Path.cwd() / "entities", BUNDLED_ENTITIES)]
    path = resolve_entity_path(ref, list(dict.fromkeys(search)), source)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(str(path), where, f"invalid YAML ({getattr(exc, 'problem', None) or 'syntax error'})") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(str(path), "", f"a UTF-8 text file (byte {exc.start} is not UTF-8)") from exc
    except OSError as exc:
        raise ConfigError(str(path), "", f"cannot read file ({exc.strerror})") from exc
    if not isinstance(data, dict):
        raise ConfigError(str(path), "(top level)", "expected a mapping of keys to values")
    odd = [k for k in data if not isinstance(k, str) or k == "source_path"]
    if odd:
        raise ConfigError(str(path), repr(odd[0]), "unknown key (keys are text: name, persona, voice, ...)")
    try:
        return Entity(**data, source_path=str(path))
    except ValidationError as exc:
        err = exc.errors()[0]
        key = ".".join(str(p) for p in err["loc"])
        msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"].removeprefix("Value error, ")
        raise ConfigError(str(path), key, msg) from None
