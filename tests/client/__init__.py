"""The client: routing, retries, readers, the append service."""
