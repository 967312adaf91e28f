"""``bumblebot cluster``: the workers sharing the PostgreSQL store, what each holds, its backlog.

Read from the store, so it runs anywhere the config reaches the database, beside the workers.
A worker counts as alive while its last heartbeat is younger than ``cluster.lease_s``.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from bumblebot.cluster.shards import MEMBER
from bumblebot.core.settings import Settings
from bumblebot.store import Store
from bumblebot.store.leases import Lease

CONVERSATION = "conversation:"
#: workers not seen for this long are no longer listed, seconds
GONE_FOR_GOOD_S = 86400.0


async def cluster_state(settings: Settings) -> dict[str, Any]:
    """Workers, with their conversations, roles and backlog; what nobody holds."""
    async with Store(settings.store_location, readonly=True) as store:
        workers = await store.workers()
        leases = [lease for lease in await store.leases() if lease.expires_in > 0]
        backlog = {owner: (count, oldest) for owner, count, oldest in await store.backlog()}
    out = []
    for w in workers:
        if w.seen_ago > GONE_FOR_GOOD_S:
            continue  # a worker gone for a day (each restart under <host>-<pid> is a new one)
        held: list[Lease] = [lease for lease in leases if lease.owner == w.name]
        count, oldest = backlog.get(w.name, (0, 0.0))
        out.append({
            "name": w.name, "host": w.host, "pid": w.pid, "seen_ago_s": round(w.seen_ago, 1),
            "alive": w.seen_ago < settings.cluster.lease_s,
            "conversations": sum(1 for lease in held if lease.name.startswith(CONVERSATION)),
            # roles, and Discord's shards (``discord.shard:<n>``); not the lease that counts it among their workers
            "roles": [lease.name for lease in held if not lease.name.startswith((CONVERSATION, MEMBER))],
            "waiting": count, "oldest_waiting_s": round(oldest, 1),
        })
    count, oldest = backlog.get(None, (0, 0.0))
    return {"lease_s": settings.cluster.lease_s, "workers": out,
            "unheld": {"waiting": count, "oldest_waiting_s": round(oldest, 1)}}


def render(state: dict[str, Any]) -> str:
    lines = [f"workers (a lease lasts {state['lease_s']:g} s unrenewed):"]
    lines.append(f"  {'name':<20} {'host':<16} {'pid':>7} {'seen':>9} {'chats':>6} {'waiting':>8} {'oldest':>8}  roles")
    for w in state["workers"]:
        seen = f"{w['seen_ago_s']:.1f} s" if w["alive"] else "gone"
        oldest = f"{w['oldest_waiting_s']:.1f} s" if w["waiting"] else "-"
        lines.append(f"  {w['name']:<20} {w['host']:<16} {w['pid']:>7} {seen:>9} {w['conversations']:>6}"
                     f" {w['waiting']:>8} {oldest:>8}  {', '.join(w['roles']) or '-'}")
    if not state["workers"]:
        lines.append("  none yet")
    unheld = state["unheld"]
    if unheld["waiting"]:
        lines.append(f"held by no worker: {unheld['waiting']} message(s) waiting, the oldest {unheld['oldest_waiting_s']:.1f} s")
    return "\n".join(lines)


async def run_cluster(settings: Settings, as_json: bool) -> int:
    """``bumblebot cluster [--json]``; 1 when the store is not PostgreSQL."""
    if not settings.on_postgres:
        print(f"bumblebot: the state is in SQLite ({settings.db_path}), used by one process; workers share a "
              "PostgreSQL store (store.url, docs/deploy-cluster.md)", file=sys.stderr)
        return 1
    state = await cluster_state(settings)
    print(json.dumps(state, indent=2) if as_json else render(state))
    return 0
