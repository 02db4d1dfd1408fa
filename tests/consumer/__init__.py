"""Consumer shards: transactions, stores and their fences, processes."""
