"""One turn's thinking, stage by stage (docs/cognition.md): the router, the system prompt and
``[Turn context]``, the requests, the bounded agent loop, the completion gate,
the context window and compaction, and the knowledge files."""
