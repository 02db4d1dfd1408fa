"""Consumer store conformance suite: SQLiteStore (a file) and PostgresStore (a real PostgreSQL server,
the `postgres` fixture) must both pass it. A checkpoint commits with the application's changes or not
at all, after the operations it must follow; a primary fenced off by a newer one's restore commits
nothing more; a process killed mid-transaction leaves nothing of it (DESIGN.md invariant 8).

What only one of the stores does: test_store_sqlite.py (its file's write lock, across processes) and
test_store_postgres.py (one database for many shards: row and table locks, lost connections)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.consumer._support import COUNTS, add, counts
from tests.support.stores import checkpoint
from tidings.consumer import FenceError, PostgresStore, SQLiteStore
from tidings.protocol import protocol_pb2 as pb


class SQLiteKind:
    """A shard's SQLite file. Its begin only takes the file's write lock: a fenced zombie fails at its commit."""

    cls = "SQLiteStore"
    fenced_at = "commit"

    def __init__(self, path: Path) -> None:
        self.where = str(path)

    def store(self) -> SQLiteStore:
        return SQLiteStore(self.where, schema=[COUNTS])

    def counts(self, store: SQLiteStore) -> dict[str, int]:
        """The counts as `store`'s own connection sees them (a transaction it left open would show)."""
        return dict(store.db.execute("SELECT word, n FROM counts ORDER BY word").fetchall())


class PostgresKind:
    """A fresh PostgreSQL database. Its begin locks the shard's row and checks the fence there: a fenced
    zombie fails at its next begin, before it consumes anything."""

    cls = "PostgresStore"
    fenced_at = "begin"

    def __init__(self, dsn: str) -> None:
        self.where = dsn

    def store(self) -> PostgresStore:
        return PostgresStore(self.where, schema=[COUNTS])

    def counts(self, store: PostgresStore) -> dict[str, int]:
        """The committed counts, through a connection of their own."""
        return counts(self.where)


@pytest.fixture(params=["sqlite", "postgres"])
def kind(request: pytest.FixtureRequest, tmp_path: Path) -> SQLiteKind | PostgresKind:
    """The store under test: a SQLite file, or a fresh database of the session's PostgreSQL server."""
    if request.param == "sqlite":
        return SQLiteKind(tmp_path / "shard.db")
    return PostgresKind(request.getfixturevalue("pg_dsn"))


async def test_a_checkpoint_commits_with_the_applications_changes(kind) -> None:
    a = kind.store()
    assert await a.restore_checkpoint("wc/0") == pb.Checkpoint()  # a new shard
    await add(a, "hello")
    await add(a, "hello")
    await a.start_commit("wc/0", checkpoint(100))
    a.destroy()

    b = kind.store()  # the next primary
    assert await b.restore_checkpoint("wc/0") == checkpoint(100)
    assert kind.counts(b) == {"hello": 2}
    b.destroy()


async def test_a_zombie_primary_cannot_commit_after_a_newer_one_restored(kind) -> None:
    """A primary whose shard a newer one restored fails with FenceError (PostgreSQL: at its next begin;
    SQLite: at its commit), commits nothing after that, and nothing of its transaction lands."""
    zombie, primary = kind.store(), kind.store()
    try:
        await zombie.restore_checkpoint("wc/0")
        await primary.restore_checkpoint("wc/0")  # (the zombie has no transaction open yet: nothing to wait for)
        if kind.fenced_at == "begin":
            with pytest.raises(FenceError, match="a newer primary restored it"):
                await add(zombie, "zombie")
        else:
            await add(zombie, "zombie")
            with pytest.raises(FenceError, match="a newer primary restored it"):
                await zombie.start_commit("wc/0", checkpoint(50))
        with pytest.raises(FenceError):  # (nor commit later: PostgreSQL's without a begin of its own)
            await zombie.start_commit("wc/0", checkpoint(50))
        await add(primary, "primary")
        await primary.start_commit("wc/0", checkpoint(60))
        assert kind.counts(primary) == {"primary": 1}  # nothing of the zombie's transaction
    finally:
        zombie.destroy()
        primary.destroy()
    again = kind.store()
    assert await again.restore_checkpoint("wc/0") == checkpoint(60)
    again.destroy()


async def test_a_commit_waits_for_its_dependencies_and_rolls_back_if_one_failed(kind) -> None:
    store = kind.store()
    try:
        await store.restore_checkpoint("wc/0")
        await store.start_commit("wc/0", checkpoint(0))
        await add(store, "lost")
        failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        failed.set_exception(RuntimeError("the previous transaction's ACKs failed"))
        with pytest.raises(RuntimeError, match="ACKs failed"):
            await store.start_commit("wc/0", checkpoint(10), [failed])
        assert kind.counts(store) == {}
        assert await store.restore_checkpoint("wc/0") == checkpoint(0)
    finally:
        store.destroy()


async def test_a_process_killed_mid_transaction_leaves_nothing_of_it(kind) -> None:
    child = textwrap.dedent(
        f"""
        import asyncio
        from tidings.consumer import {kind.cls}
        from tidings.protocol import protocol_pb2 as pb

        async def main():
            s = {kind.cls}({kind.where!r}, schema=[{COUNTS!r}])
            await s.restore_checkpoint("wc/0")
            await s.start_commit("wc/0", pb.Checkpoint())
            await s.begin()
            written = s.transaction().execute("INSERT INTO counts VALUES ('uncommitted', 1)")
            if asyncio.iscoroutine(written):  # (PostgreSQL's connection is asyncio's; SQLite's runs it at once)
                await written
            print("written", flush=True)
            await asyncio.Event().wait()

        asyncio.run(main())
        """
    )
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", child, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        assert await asyncio.wait_for(proc.stdout.readline(), 60) == b"written\n"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        await proc.wait()
    store = kind.store()
    try:  # (PostgreSQL's server notices the dead connection and rolls back; the restore waits for its row lock)
        assert await asyncio.wait_for(store.restore_checkpoint("wc/0"), 60) == pb.Checkpoint()
        assert kind.counts(store) == {}
    finally:
        store.destroy()
