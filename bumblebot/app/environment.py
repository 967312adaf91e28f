"""What the daemon's parts take from the machine they run on: the variables ``${VAR}`` in
``mcp.servers`` may name, and whether ``run_command``'s sandbox runs here. Shared by the daemon
(``bumblebot/app/daemon.py``) and ``bumblebot check`` (``bumblebot/app/check.py``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from bumblebot.core.config import dotenv_unreadable
from bumblebot.core.settings import Settings


def mcp_environ(dotenv: Path = Path(".env")) -> dict[str, str]:
    """Where ``${VAR}`` in ``mcp.servers`` comes from: the environment, over ``./.env``
    (whose values are not copied into the environment)."""
    values: dict[str, str] = {}
    if dotenv.is_file() and dotenv_unreadable(dotenv) is None:
        from dotenv import dotenv_values

        values = {k: v for k, v in dotenv_values(dotenv).items() if v is not None}
    return {**values, **os.environ}


def shell_sandbox(settings: Settings) -> Any:
    """The bubblewrap sandbox of ``tools.shell`` (a ``tools.Sandbox``), ``None`` for ``sandbox: off``."""
    from tools import Sandbox

    s = settings.tools.shell
    if s.sandbox == "off":
        return None
    return Sandbox(
        bwrap=s.bwrap, network=s.network, memory_mb=s.memory_mb, tmp_mb=s.tmp_mb,
        max_processes=s.max_processes, cpu_s=s.cpu_s,
    )  # fmt: skip


async def shell_sandbox_problem(settings: Settings) -> str | None:
    """Why ``run_command`` cannot be offered although ``tools.shell.enabled``: its sandbox does
    not run here (tried once per process, ``tools.sandbox.probe``). ``None``: it can be."""
    from tools import probe

    sandbox = shell_sandbox(settings)
    if not settings.tools.shell.enabled or sandbox is None:
        return None
    return await probe(sandbox, settings.workspace.resolve())
