"""Bumblebot: a self-hosted daemon that gives one LLM entity a presence on Telegram and Discord."""

__version__ = "0.1.0"
