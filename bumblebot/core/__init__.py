"""The values and seams every part shares: events and messages, errors, the tool contract,
the adapter seam, the entity, configuration, logs and metrics. Imports nothing else of
Bumblebot."""
