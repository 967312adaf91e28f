"""Where the state is kept (``store``) and how workers sharing it take turns (``cluster``)."""

from __future__ import annotations

import re
from urllib.parse import unquote

from pydantic import Field, field_validator

from bumblebot.core.llm_settings import Section


#: a URL's scheme, as far as telling one from a file path goes (``C:`` is no scheme here)
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+:")
_QUERY_PASSWORD = re.compile(r"(?i)([?&]password=)([^&#]*)")


def shown_url(url: str) -> str:
    """``url`` with its password (``user:password@``, ``?password=``) as ``***``, for errors
    and logs. It never fails, however malformed the URL (a password may hold ``/``, ``?``, ``@``)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    at = rest.rfind("@")
    if at >= 0 and ":" in rest[:at]:
        rest = rest[: rest.index(":")] + ":***" + rest[at:]
    return f"{scheme}://{_QUERY_PASSWORD.sub(lambda m: m.group(1) + '***', rest)}"


def url_secrets(url: str) -> list[str]:
    """The passwords ``url`` carries, as written and decoded: secrets no log or stored text holds."""
    _, sep, rest = url.partition("://")
    found = []
    at = rest.rfind("@")
    if sep and at >= 0 and ":" in rest[:at]:
        found.append(rest[rest.index(":") + 1 : at])
    found += [m.group(2) for m in _QUERY_PASSWORD.finditer(rest)]
    return sorted({s for raw in found if raw for s in (raw, unquote(raw))}, key=len, reverse=True)


class StoreSettings(Section):
    url: str | None = Field(
        None,
        description="the database: null for <data_dir>/bumblebot.db (SQLite), a SQLite file, or "
        "postgresql://user@host:port/database (its password in PGPASSWORD or ~/.pgpass, not here)",
    )

    @field_validator("url")
    @classmethod
    def _known_scheme(cls, value: str | None) -> str | None:
        if not value or value.startswith(("postgresql://", "postgres://")):
            return value
        found = _SCHEME.match(value)
        if found and len(found.group()) > 2:  # a URL, not a file (a Windows drive letter is one letter)
            raise ValueError(
                f"{found.group()[:-1]}: is not a database Bumblebot knows: a SQLite file path, or a URL "
                "postgresql://user@host:port/database"
            )
        return value


class ClusterSettings(Section):
    worker: str | None = Field(
        None, description="this worker's name among those sharing a PostgreSQL store; default: <host>-<pid>"
    )
    lease_s: float = Field(
        10.0, ge=1.0, le=300.0,
        description="a worker's conversations are taken over this long after it stopped renewing its leases, seconds",
    )
