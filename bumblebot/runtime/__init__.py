"""One conversation's life: the engine's intake, an actor per conversation, the turn from
routing to finish, the conversation's state, and scheduled tasks."""
