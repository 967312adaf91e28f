"""Several workers sharing one PostgreSQL store: leases, roles, and who runs what."""

from bumblebot.cluster.membership import TELEGRAM_POLLER, Membership, default_name
from bumblebot.cluster.shards import ShardLeases

__all__ = ["TELEGRAM_POLLER", "Membership", "ShardLeases", "default_name"]
