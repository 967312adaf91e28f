"""Delivery through the outbox: every message reaches the platform from an ``outbox`` row,
exactly once, in order per chat; streamed previews; splitting text at the platform's limit."""

from bumblebot.delivery.outbox import MAX_INLINE_WAIT_S, Delivery

__all__ = ["MAX_INLINE_WAIT_S", "Delivery"]
