"""Brokers: spools, replication, appends, recovery, stores and processes."""
