"""Consumer applications for tests that run `tidings consumer` child processes (`--app
tests.support.apps:Relay`) or shards in this process.

`Relay` reads input messages ``{"id": ...}`` and, for each, counts the id in its SQLite store and
publishes ``{"id": ..., "pad": "x" * pad}`` to its output journal, by the path its shard's `mode`
label names: the ways docs/shards.md offers to publish from a shard.

- ``uncommitted``: the hook's `publisher.publish_uncommitted` (the transaction's ACKs commit it);
- ``committed``: the hook's `publisher.publish_committed` (committed at once: at least once downstream);
- ``shard-uncommitted`` / ``shard-committed``: the same through `shard.publisher`;
- ``begin``: `shard.publisher.publish_committed` of a marker from `begin_txn`, then as ``uncommitted``.

Labels: `out` (the output journal), `pad` (bytes of padding per output: large outputs keep appends
in flight while the transaction commits), `side` (optional: a second output journal, written the
same way). With TIDINGS_TEST_KILL_AFTER_COMMIT=N in its environment, a process kills itself
(SIGKILL) right after its Nth store commit resolves: before the transaction's ACKs, and before any
append that commit did not wait for.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import apsw

from tidings.consumer import Application, SQLiteStore

SEEN = "CREATE TABLE IF NOT EXISTS seen (id TEXT PRIMARY KEY, n INTEGER NOT NULL)"


def label(shard: Any, name: str, default: str = "") -> str:
    return next((lb.value for lb in shard.spec.labels.labels if lb.name == name), default)


class Relay(Application):
    """See the module docstring. `appended` keeps each append's future (for tests in this process)."""

    def __init__(self) -> None:
        self.appended: list[asyncio.Future] = []
        self.commits = 0
        self.kill_after = int(os.environ.get("TIDINGS_TEST_KILL_AFTER_COMMIT", "0"))

    def new_store(self, shard: Any) -> SQLiteStore:
        return SQLiteStore(shard.path(), schema=[SEEN])

    async def begin_txn(self, shard: Any, store: SQLiteStore) -> None:
        if label(shard, "mode") == "begin":
            marker = {"id": f"begin:{shard.spec.id}", "pad": ""}
            self.appended.append(await shard.publisher.publish_committed(label(shard, "out"), marker))

    async def consume_message(self, shard: Any, store: SQLiteStore, envelope: Any, publisher: Any) -> None:
        msg_id = envelope.message["id"]
        db = store.transaction()
        db.execute("INSERT INTO seen VALUES (?, 1) ON CONFLICT (id) DO UPDATE SET n = n + 1", (msg_id,))
        mode = label(shard, "mode", "uncommitted")
        pub = shard.publisher if mode.startswith("shard-") else publisher
        publish = pub.publish_committed if mode in ("committed", "shard-committed") else pub.publish_uncommitted
        out = {"id": msg_id, "pad": "x" * int(label(shard, "pad", "0"))}
        for journal in filter(None, (label(shard, "out"), label(shard, "side"))):
            self.appended.append(await publish(journal, dict(out)))

    async def finalize_txn(self, shard: Any, store: SQLiteStore, publisher: Any) -> None:
        pass

    async def finished_txn(self, shard: Any, store: SQLiteStore, commit: asyncio.Future) -> None:
        if self.kill_after:
            commit.add_done_callback(self._count_commit)

    def _count_commit(self, commit: asyncio.Future) -> None:
        if commit.cancelled() or commit.exception() is not None:
            return
        self.commits += 1
        if self.commits == self.kill_after:
            os.kill(os.getpid(), signal.SIGKILL)


def seen(path: Any) -> dict[str, int]:
    """The ids a Relay's store counted (its SQLite file at `path`), with how many times (none yet: {})."""
    if not Path(path).exists():
        return {}
    store = SQLiteStore(path)
    try:
        return dict(store.db.execute("SELECT id, n FROM seen").fetchall())
    except apsw.SQLError as exc:
        if "no such table" in str(exc):
            return {}
        raise
    finally:
        store.destroy()
