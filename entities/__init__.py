"""Entity (persona) files shipped with Bumblebot; see ``bumblebot/entity.py`` for the format."""
