"""The one connection of a store: opening it, write transactions and reads.

The store is a SQLite file (aiosqlite), or a PostgreSQL database when its location is a
``postgresql://`` URL (``store.url``; :mod:`bumblebot.store.postgres`, which takes the same
statements).

:class:`Database` is the base of :class:`bumblebot.store.Store` and of each table module's
class: they all read through :meth:`Database._one` and :meth:`Database._all` and write through
:meth:`Database.transaction`, which serialises writers on the single connection.

Every text bound to a statement goes through :func:`~bumblebot.core.events.storable_text`
on its way (:class:`Writes`): SQLite takes text as UTF-8, which has no lone surrogate, and one
in a transcript, a file name or a tool's output would otherwise fail the write again at every
retry. JSON columns are written with :func:`~bumblebot.core.messages.json_text`, which does
the same for what is inside them. Every text then passes the store's
:class:`~bumblebot.core.redaction.Redactor` (writes and the reads that match on them alike):
whatever a table module writes (the history, tool calls and their results, the journal, the
outbox, traces, tasks), no configured secret reaches the file.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from dataclasses import dataclass
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Self

import aiosqlite

from bumblebot.core.errors import DatabaseError, LeaseLost, StoreError
from bumblebot.core.redaction import NO_SECRETS, Redactor
from bumblebot.core.events import storable_text
from bumblebot.store import postgres
from bumblebot.store.schema import migrate

log = logging.getLogger(__name__)

#: a ``kv`` value written over the one there (``INSERT OR REPLACE`` in SQLite alone)
SET_KV = "INSERT INTO kv (key, value) VALUES (?, ?) ON CONFLICT (key) DO UPDATE SET value = excluded.value"


@dataclass(frozen=True, slots=True)
class Fence:
    """The lease the writes of a task carry: lease ``name``, held by ``owner`` with ``token``;
    ``ttl_s``: how long a send's check (:meth:`Database.holds_fence`) extends it."""

    name: str
    owner: str
    token: int
    ttl_s: float = 0.0


#: the fence of the writes made in this context (a conversation's actor sets it); ``None``: none
FENCE: contextvars.ContextVar[Fence | None] = contextvars.ContextVar("bumblebot_fence", default=None)
_FENCE_CHECK = "SELECT 1 FROM leases WHERE name = ? AND owner = ? AND token = ? FOR SHARE"


@contextlib.contextmanager
def unfenced() -> Iterator[None]:
    """Writes in this block carry no fence: a lease's own row, and what a send made happen
    (a fact of the platform, recorded even by a worker that has just lost the conversation)."""
    token = FENCE.set(None)
    try:
        yield
    finally:
        FENCE.reset(token)


#: the database server's clock, in epoch seconds (PostgreSQL: the workers' clocks may differ)
DB_NOW = "CAST(EXTRACT(EPOCH FROM clock_timestamp()) AS DOUBLE PRECISION)"


def storable(params: Sequence[Any], redactor: Redactor = NO_SECRETS) -> Any:
    """A statement's parameters with each text made storable (lone surrogates as U+FFFD) and
    without a secret (``redactor``)."""
    return redactor.params(tuple(storable_text(p) if isinstance(p, str) else p for p in params))


class Writes:
    """The connection as a write transaction uses it: ``execute`` and ``executemany`` bind
    storable text without secrets (:func:`storable`); anything else is the aiosqlite
    connection's own."""

    def __init__(self, db: Any, redactor: Redactor) -> None:
        self._db = db
        self._redactor = redactor

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Any:
        return self._db.execute(sql, storable(params, self._redactor))

    async def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> Any:
        return await self._db.executemany(sql, [storable(r, self._redactor) for r in rows])

    async def insert(self, sql: str, params: Sequence[Any] = ()) -> int | None:
        """Run an ``INSERT`` and return the new row's ``id`` (``None`` when an ``ON CONFLICT DO
        NOTHING`` skipped it): ``RETURNING id``, one trip on either database."""
        rows = await self._db.execute_fetchall(f"{sql} RETURNING id", storable(params, self._redactor))
        return int(rows[0][0]) if rows else None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._db, name)


class Database:
    """A connection to one database, opened with ``async with`` (see :class:`Store`).

    ``location``: a SQLite file, or a ``postgresql://`` URL. ``redactor``: the secrets no text
    written or matched may hold (default: none)."""

    def __init__(self, location: Path | str, *, readonly: bool = False, redactor: Redactor = NO_SECRETS) -> None:
        self.postgres = postgres.is_url(location)
        self.path = Path(location) if not self.postgres else Path()
        self.url = str(location) if self.postgres else ""
        self.readonly = readonly
        self.redactor = redactor
        self._db: Any = None  # aiosqlite.Connection, or postgres.Connection
        self._write_lock = asyncio.Lock()
        self._transaction_task: asyncio.Task[Any] | None = None  # the task whose transaction is open

    async def __aenter__(self) -> Self:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def shown(self) -> str:
        """Where the database is, to name in messages (a URL without its password)."""
        return postgres.shown(self.url) if self.postgres else str(self.path)

    async def open(self) -> None:
        if self._db is not None:
            raise RuntimeError("store is already open")
        if self.postgres:
            await self._open_postgres()
            return
        try:
            if self.readonly:
                self._db = await aiosqlite.connect(f"file:{self.path}?mode=ro", uri=True, isolation_level=None)
            else:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._db = await aiosqlite.connect(self.path, isolation_level=None)
            self._db.row_factory = aiosqlite.Row
            await self._db.execute("PRAGMA busy_timeout=10000")
            if not self.readonly:
                await self._db.execute("PRAGMA journal_mode=WAL")
                await self._db.execute("PRAGMA foreign_keys=ON")
                await self._db.execute("PRAGMA synchronous=NORMAL")
            await migrate(self._db, readonly=self.readonly)
        except (OSError, aiosqlite.Error) as exc:
            await self.close()
            raise StoreError(f"cannot open database {self.path}: {exc}") from exc

    async def _open_postgres(self) -> None:
        db = postgres.Connection(self.url, readonly=self.readonly)
        try:
            await db.connect()
            await migrate(db, readonly=self.readonly)
        except BaseException as exc:
            await db.close()
            if isinstance(exc, DatabaseError):
                raise StoreError(str(exc)) from exc  # it names the database (without a password)
            raise
        self._db = db

    async def close(self) -> None:
        if self._db is not None:
            db, self._db = self._db, None
            await db.close()

    @property
    def db(self) -> Any:
        """The open connection (aiosqlite's, or :class:`bumblebot.store.postgres.Connection`)."""
        if self._db is None:
            raise RuntimeError("store is not open")
        return self._db

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[Writes]:
        """Serialise a write transaction; commits on success, rolls back on error.

        On PostgreSQL, inside a :data:`FENCE` (a conversation's work on a worker), the
        transaction first checks that the fence's lease is still held with its token, and keeps
        that row locked until it ends (:class:`~bumblebot.core.errors.LeaseLost` if not)."""
        async with self._write_lock:
            await self._end_left_open()
            await self._begin()
            self._transaction_task = asyncio.current_task()
            try:
                await self._check_fence()
                yield Writes(self.db, self.redactor)
            except BaseException:
                await self.db.execute("ROLLBACK")
                raise
            else:
                await self.db.execute("COMMIT")
            finally:
                self._transaction_task = None

    async def write(self, sql: str, params: tuple[Any, ...] = ()) -> Any:
        """One write statement, serialised with the transactions. In autocommit mode SQLite
        makes a lone statement a transaction of its own, so this is one trip to aiosqlite's
        thread where ``BEGIN`` … ``COMMIT`` would be three (a fenced one is a transaction)."""
        if self.postgres and FENCE.get() is not None:
            async with self.transaction() as db:
                return await db.execute(sql, params)
        async with self._write_lock:
            await self._end_left_open()
            return await self.db.execute(sql, storable(params, self.redactor))

    async def write_rows(self, sql: str, params: tuple[Any, ...] = ()) -> list[Any]:
        """One write statement that returns rows (``RETURNING``), serialised with the
        transactions like :meth:`write` (never run inside another task's transaction)."""
        async with self._write_lock:
            await self._end_left_open()
            return list(await self.db.execute_fetchall(sql, storable(params, self.redactor)))

    async def insert(self, sql: str, params: tuple[Any, ...] = ()) -> int:
        """One ``INSERT`` (as :meth:`write`); returns the new row's ``id``."""
        if self.postgres and FENCE.get() is not None:
            async with self.transaction() as db:
                row_id = await db.insert(sql, params)
            assert row_id is not None
            return row_id
        async with self._write_lock:
            await self._end_left_open()
            rows = await self.db.execute_fetchall(f"{sql} RETURNING id", storable(params, self.redactor))
        return int(rows[0][0])

    async def _check_fence(self) -> None:
        fence = FENCE.get()
        if fence is None or not self.postgres:
            return
        rows = await self.db.execute_fetchall(_FENCE_CHECK, (fence.name, fence.owner, fence.token))
        if not rows:
            raise LeaseLost(f"{fence.owner} no longer holds {fence.name} with token {fence.token}")

    async def holds_fence(self) -> bool:
        """Whether this context's fence (if any) is still held, asked before each platform send
        (no transaction covers one); a fence held is extended by its ``ttl_s`` from now.

        The extension is what keeps a send exactly-once across a takeover: another worker can
        take the lease only once it has expired, so a send checked here reaches the platform
        ``ttl_s`` before anyone else may send the same row, unless this process stalls longer
        than that between the check and the send."""
        fence = FENCE.get()
        if fence is None or not self.postgres:
            return True
        with unfenced():
            rows = await self.write_rows(  # a lease given up or lapsed stays so: others may take it
                f"UPDATE leases SET expires_at = GREATEST(expires_at, {DB_NOW} + ?)"
                f" WHERE name = ? AND owner = ? AND token = ? AND expires_at > {DB_NOW} RETURNING 1",
                (fence.ttl_s, fence.name, fence.owner, fence.token),
            )
        return bool(rows)

    async def _begin(self) -> None:
        """``BEGIN IMMEDIATE``, never left open: a task cancelled while the statement waits in
        aiosqlite's queue (behind a read) does not stop it from running there, so the
        transaction it opens is rolled back before the write lock goes to the next writer,
        whose statements would otherwise run inside it and never be committed."""
        begin = asyncio.ensure_future(self.db.execute("BEGIN IMMEDIATE"))
        try:
            await asyncio.shield(begin)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await begin
                await self.db.execute("ROLLBACK")
            raise

    async def _end_left_open(self) -> None:
        """Roll back a transaction left open (a safety net: :meth:`_begin` leaves none), so
        that no later statement joins it and is never committed. Checked holding the write
        lock, when no writer's statement waits in aiosqlite's queue."""
        if self.db.in_transaction:
            log.warning("a transaction was left open by a cancelled write; rolling it back")
            await self.db.execute("ROLLBACK")

    async def _one(self, sql: str, params: tuple[Any, ...] = ()) -> Any:
        """The first row of a query that returns at most a few (one trip to aiosqlite's thread)."""
        return next(iter(await self._all(sql, params)), None)

    async def _all(self, sql: str, params: tuple[Any, ...] = ()) -> list[Any]:
        """The rows of a query. On PostgreSQL a read of another task than the one whose write
        transaction is open waits for it to end: an error would abort that transaction (SQLite's
        does not), and it would read writes not committed yet."""
        if self.postgres and self._write_lock.locked() and self._transaction_task is not asyncio.current_task():
            async with self._write_lock:
                return list(await self.db.execute_fetchall(sql, storable(params, self.redactor)))
        return list(await self.db.execute_fetchall(sql, storable(params, self.redactor)))
