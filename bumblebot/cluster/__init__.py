"""Several workers sharing one PostgreSQL store: leases, roles, and who runs what."""

from bumblebot.cluster.membership import TELEGRAM_POLLER, Membership, default_name

__all__ = ["TELEGRAM_POLLER", "Membership", "default_name"]
