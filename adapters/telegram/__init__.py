"""Telegram adapter (python-telegram-bot). The only package that imports ``telegram``."""

from adapters.telegram.adapter import TelegramAdapter

__all__ = ["TelegramAdapter"]
