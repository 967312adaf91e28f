"""Entity (persona) files shipped with Bumblebot; see ``bumblebot/core/entity.py`` for the format."""
