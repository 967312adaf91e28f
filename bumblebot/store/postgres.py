"""A PostgreSQL connection that the table modules use as they use aiosqlite's.

:class:`Connection` gives the part of ``aiosqlite.Connection`` the store uses (``execute``,
awaited or as ``async with``, ``execute_fetchall``, ``executemany``, ``executescript``,
``in_transaction``) over one asyncpg connection, each statement rewritten by
:mod:`bumblebot.store.dialect`. Statements run one at a time, as on aiosqlite's one thread: a
read issued while a write transaction is open runs inside it and sees its writes, as it does
on SQLite's single connection.

Results are read whole (the store's reads are bounded pages). ``numeric``, which PostgreSQL
gives for ``SUM`` of integers, is read as ``int`` when whole, else ``float``, as SQLite gives
them. Every error of the driver or the connection is raised as
:class:`~bumblebot.core.errors.DatabaseError`, naming the statement's first words; after a
lost connection the next statement outside a transaction connects again.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterable, Sequence
from types import TracebackType
from typing import Any, TypeVar

import asyncpg

from bumblebot.core.errors import DatabaseError
from bumblebot.core.store_settings import shown_url
from bumblebot.store import dialect

T = TypeVar("T")

#: ``postgresql://`` and its short form, as libpq takes them
SCHEMES = ("postgresql://", "postgres://")


def is_url(location: object) -> bool:
    """Whether ``location`` names a PostgreSQL database (else it is a SQLite file)."""
    return isinstance(location, str) and location.startswith(SCHEMES)


def shown(url: str) -> str:
    """``url`` without its password, to show in errors and logs."""
    return shown_url(url)


#: the session's settings: a transaction left idle (its process frozen, or cut off) is ended by
#: the server within seconds, its locks with it (else a frozen worker's lock on a lease row
#: holds every other worker's takeover for hours), and a dead client is noticed by keepalives
SESSION = {
    "idle_in_transaction_session_timeout": "5000",
    "tcp_keepalives_idle": "10", "tcp_keepalives_interval": "5", "tcp_keepalives_count": "3",
}
#: prepared statements kept per connection: more than the table modules have
STATEMENT_CACHE = 512
#: the longest a statement may take before its connection is given up (a server that stopped
#: answering: a partition, a frozen machine), seconds; the store's statements take milliseconds
COMMAND_TIMEOUT_S = 30.0
#: how long a cancelled caller's statement may still run before its connection is dropped
CANCEL_GRACE_S = 2.0


def _returns_rows(query: str) -> bool:
    head = query.lstrip()[:6].upper()
    return head.startswith(("SELECT", "WITH")) or (head.startswith(("INSERT", "UPDATE", "DELETE")) and "RETURNING" in query.upper())


def _numeric(text: str) -> int | float:
    return int(text) if text.lstrip("-").isdigit() else float(text)


class Cursor:
    """A statement's outcome: its rows, read whole, and how many rows it changed."""

    def __init__(self, rows: list[asyncpg.Record], rowcount: int) -> None:
        self._rows = rows
        self.rowcount = rowcount

    async def fetchone(self) -> asyncpg.Record | None:
        return self._rows.pop(0) if self._rows else None

    async def fetchall(self) -> list[asyncpg.Record]:
        rows, self._rows = self._rows, []
        return rows


class _Running:
    """:meth:`Connection.execute`'s result: awaited, or entered with ``async with``."""

    def __init__(self, connection: Connection, sql: str, params: Sequence[Any]) -> None:
        self._run = connection._execute(sql, params)

    def __await__(self) -> Any:
        return self._run.__await__()

    async def __aenter__(self) -> Cursor:
        return await self._run

    async def __aexit__(self, *exc: object) -> None:
        return None


class Connection:
    """One asyncpg connection to ``url``; ``readonly``: every transaction is read-only."""

    def __init__(self, url: str, *, readonly: bool = False) -> None:
        self.url = url
        self.readonly = readonly
        self._conn: asyncpg.Connection | None = None
        self._lock = asyncio.Lock()
        self._transaction = False

    async def connect(self) -> None:
        settings = dict(SESSION)
        if self.readonly:
            settings["default_transaction_read_only"] = "on"
        try:
            conn = await asyncpg.connect(
                self.url, server_settings=settings, timeout=10, statement_cache_size=STATEMENT_CACHE,
                command_timeout=COMMAND_TIMEOUT_S,
            )
        except ValueError:  # asyncpg could not parse the URL: its message would show the password
            raise DatabaseError(f"{shown(self.url)} is not a database URL asyncpg can read "
                                "(a password with ?, /, # or [ must be percent-encoded)") from None
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError) as exc:
            raise DatabaseError(f"cannot connect to {shown(self.url)}: {exc}") from exc
        await conn.set_type_codec("numeric", encoder=str, decoder=_numeric, schema="pg_catalog", format="text")
        self._conn = conn

    @property
    def in_transaction(self) -> bool:
        """A ``BEGIN`` ran and no ``COMMIT`` or ``ROLLBACK`` since (also when the connection
        was lost meanwhile: the caller's ``ROLLBACK`` ends it)."""
        return self._transaction

    async def _ready(self) -> asyncpg.Connection:
        if self._conn is None or self._conn.is_closed():
            await self.connect()  # lost between transactions: connected again
        assert self._conn is not None
        return self._conn

    async def _execute(self, sql: str, params: Sequence[Any]) -> Cursor:
        query = dialect.statement(sql)
        try:
            return await self._run(sql, lambda: self._statement(query, params))
        except DatabaseError as exc:
            # a read between transactions that found the connection gone (the server restarted):
            # once more on a new one, which nothing can tell from the first try
            if self._transaction or not isinstance(exc.__cause__, _LOST) or not query.lstrip()[:6].upper() == "SELECT":
                raise
            return await self._run(sql, lambda: self._statement(query, params))

    async def _statement(self, query: str, params: Sequence[Any]) -> Cursor:
        command = query.strip().upper()
        if self._transaction and (self._conn is None or self._conn.is_closed()):
            # the server rolled the transaction back with the session: no statement of it may
            # run on a new one, where it would be committed alone
            if command == "ROLLBACK":
                self._transaction = False
                return Cursor([], 0)
            raise DatabaseError("the connection was lost inside a transaction, which was rolled back")
        conn = await self._ready()
        if command in ("BEGIN", "COMMIT", "ROLLBACK"):
            try:
                await conn.execute(query)
            finally:
                self._transaction = command == "BEGIN" and conn.is_in_transaction()
            return Cursor([], 0)
        if _returns_rows(query):
            rows = await conn.fetch(query, *params)
            return Cursor(rows, len(rows))
        return Cursor([], _count(await conn.execute(query, *params)))

    async def _run(self, sql: str, work: Callable[[], Awaitable[T]]) -> T:
        """Run ``work()`` (a use of the connection) alone on it, once the connection is free.

        A caller cancelled meanwhile does not cut it short: asyncpg's protocol would be left
        mid-statement, and every later statement refused (aiosqlite's thread, too, finishes a
        statement whose caller left). A connection that failed (not a statement refused by the
        server) is dropped: the next statement connects again, or, inside a transaction, fails
        until the caller's ``ROLLBACK``."""
        async with self._lock:
            running = asyncio.ensure_future(work())
            try:
                return await asyncio.shield(running)
            except asyncio.CancelledError:
                try:
                    await asyncio.wait_for(asyncio.shield(running), CANCEL_GRACE_S)
                except BaseException:  # the server does not answer: the connection goes
                    self._drop()
                raise
            except asyncpg.PostgresError as exc:
                raise DatabaseError(f"{_first_words(sql)} failed on {shown(self.url)}: {exc}") from exc
            except _LOST as exc:
                self._drop()
                raise DatabaseError(f"{_first_words(sql)} failed on {shown(self.url)}: {exc}") from exc

    def _drop(self) -> None:
        """Give the connection up (the next statement connects again)."""
        if self._conn is not None:
            self._conn.terminate()

    def execute(self, sql: str, params: Sequence[Any] = ()) -> _Running:
        return _Running(self, sql, params)

    async def execute_fetchall(self, sql: str, params: Sequence[Any] = ()) -> list[asyncpg.Record]:
        return await (await self._execute(sql, params)).fetchall()

    async def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> Cursor:
        query, batch = dialect.statement(sql), list(rows)

        async def many() -> Cursor:
            await (await self._ready()).executemany(query, batch)
            return Cursor([], -1)

        return await self._run(sql, many)

    async def executescript(self, script: str) -> None:
        """Several statements, no parameters (a migration), as given: not rewritten."""

        async def run() -> None:
            await (await self._ready()).execute(script)

        await self._run("a migration", run)

    async def close(self) -> None:
        if self._conn is not None:
            conn, self._conn = self._conn, None
            try:
                await asyncio.wait_for(conn.close(), 5)
            except (OSError, asyncpg.InterfaceError, TimeoutError):
                conn.terminate()

    async def __aenter__(self) -> Connection:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()


#: what a connection that failed (not a statement the server refused) raises
_LOST = (OSError, TimeoutError, asyncpg.InterfaceError, asyncpg.exceptions.InternalClientError)


def _count(status: str) -> int:
    """Rows a command changed, from its status (``UPDATE 3``, ``INSERT 0 1``); 0 for others."""
    last = status.rsplit(" ", 1)[-1]
    return int(last) if last.isdigit() else 0


def _first_words(sql: str) -> str:
    return " ".join(sql.split()[:3])
