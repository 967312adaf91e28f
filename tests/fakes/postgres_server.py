"""A real PostgreSQL server for the tests: Debian's ``postgresql`` package, started on 127.0.0.1.

:class:`PostgresServer` makes a throwaway cluster (``initdb``) in a folder of its own and starts
it (``pg_ctl``) on a free port, with what makes a test server fast and nothing else
(``fsync=off``: the data dies with the test run; ``durable`` keeps fsync, for benchmarks). :meth:`PostgresServer.database` makes a new,
empty database for each test. As root (CI), the server runs as the ``postgres`` user the
package creates: PostgreSQL refuses to run as root.

The binaries are found on ``PATH`` or in ``/usr/lib/postgresql/<version>/bin`` (where Debian
puts them); without them the fixtures fail, naming the package to install (``.ci/run``
installs it).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import pwd
import shutil
import socket
import subprocess
from pathlib import Path

import asyncpg

_names = itertools.count(1)


def _binary(name: str) -> str:
    found = shutil.which(name)
    if found:
        return found
    versions = sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"), key=lambda p: int(p.parts[-3]))
    if not versions:
        raise RuntimeError(f"PostgreSQL's {name} was not found; install it (Debian: apt install postgresql)")
    return str(versions[-1])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PostgresServer:
    """A PostgreSQL cluster in ``folder``, on 127.0.0.1; ``start()`` then ``stop()``."""

    def __init__(self, folder: Path, *, durable: bool = False) -> None:
        self.folder = folder
        self.durable = durable
        self.data = folder / "data"
        self.port = _free_port()
        self.user = "bumblebot"
        self._as: list[str] = []
        if os.geteuid() == 0:
            account = pwd.getpwnam("postgres")
            os.chown(folder, account.pw_uid, account.pw_gid)
            self._as = ["runuser", "-u", "postgres", "--"]

    def _run(self, *argv: str) -> None:
        done = subprocess.run([*self._as, *argv], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{argv[0]} failed ({done.returncode}): {done.stderr or done.stdout}")

    def start(self) -> None:
        self._run(_binary("initdb"), "-D", str(self.data), "-U", self.user, "-A", "trust", "--no-sync")
        options = f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.folder} -c max_connections=200"
        # durable (the benchmarks): what SQLite's WAL with synchronous=NORMAL is, a crash may lose
        # the last commits but corrupts nothing; else (tests) nothing reaches the disk on purpose
        options += " -c synchronous_commit=off" if self.durable else " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        self._run(_binary("pg_ctl"), "-D", str(self.data), "-o", options, "-l", str(self.folder / "log"), "-w", "start")

    def stop(self) -> None:
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            self._run(_binary("pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop")

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/{database}"

    async def database(self) -> str:
        """The URL of a new, empty database."""
        name = f"test_{os.getpid()}_{next(_names)}"
        conn = await asyncpg.connect(self.url())
        try:
            await conn.execute(f'CREATE DATABASE "{name}"')
        finally:
            await conn.close()
        return self.url(name)
