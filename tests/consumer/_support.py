"""What the consumer store tests (test_store.py's suite over both stores, and each store's own file)
write and read alike: a word-count table and a transaction counting one word in it."""

from __future__ import annotations

import psycopg

from tidings.consumer import PostgresStore, SQLiteStore

COUNTS = "CREATE TABLE IF NOT EXISTS counts (word TEXT PRIMARY KEY, n INTEGER NOT NULL)"


async def add(store: SQLiteStore | PostgresStore, word: str) -> None:
    """Begin the store's transaction (if none is open) and count `word` once in it."""
    await store.begin()
    if isinstance(store, PostgresStore):
        await store.transaction().execute(
            "INSERT INTO counts VALUES (%s, 1) ON CONFLICT (word) DO UPDATE SET n = counts.n + 1", (word,)
        )
    else:
        store.transaction().execute(
            "INSERT INTO counts VALUES (?, 1) ON CONFLICT (word) DO UPDATE SET n = counts.n + 1", (word,)
        )


def counts(dsn: str) -> dict[str, int]:
    """The committed counts of the PostgreSQL database at `dsn`."""
    with psycopg.connect(dsn) as conn:
        return dict(conn.execute("SELECT word, n FROM counts ORDER BY word").fetchall())  # type: ignore[arg-type]
