"""Discord adapter (discord.py). The only package that imports ``discord``."""

from adapters.discord.adapter import DiscordAdapter

__all__ = ["DiscordAdapter"]
