"""Where the state is kept (``store``) and how workers sharing it take turns (``cluster``)."""

from __future__ import annotations

from pydantic import Field, field_validator

from bumblebot.core.llm_settings import Section


class StoreSettings(Section):
    url: str | None = Field(
        None,
        description="the database: null for <data_dir>/bumblebot.db (SQLite), a SQLite file, or "
        "postgresql://user@host:port/database (its password in PGPASSWORD or ~/.pgpass, not here)",
    )

    @field_validator("url")
    @classmethod
    def _known_scheme(cls, value: str | None) -> str | None:
        scheme = value.split("://", 1)[0] if value and "://" in value else ""
        if scheme and scheme not in ("postgresql", "postgres"):
            raise ValueError(f"{scheme}:// is not a database Bumblebot knows: a SQLite file path or postgresql://…")
        return value


class ClusterSettings(Section):
    worker: str | None = Field(
        None, description="this worker's name among those sharing a PostgreSQL store; default: <host>-<pid>"
    )
    lease_s: float = Field(
        10.0, ge=1.0, le=300.0,
        description="a worker's conversations are taken over this long after it stopped renewing its leases, seconds",
    )
