"""The consumer's PostgreSQL store and its fence (issue 10, item 6, PostgreSQL half), against a real
server (the `postgres` fixture): a checkpoint commits with the application's changes or not at all;
a zombie's transaction and its successor's restore take turns on the shard's checkpoint row, so the
restore sees what the zombie committed and the zombie fails at its next begin; a process killed
mid-transaction leaves nothing of it."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import textwrap

import psycopg
import pytest

from tests.support.stores import checkpoint
from tests.support.waiting import wait_until
from tidings.consumer import FenceError, PostgresStore
from tidings.consumer import store as store_module
from tidings.protocol import protocol_pb2 as pb

COUNTS = "CREATE TABLE IF NOT EXISTS counts (word TEXT PRIMARY KEY, n INTEGER NOT NULL)"


def counts(dsn: str) -> dict[str, int]:
    with psycopg.connect(dsn) as conn:
        return dict(conn.execute("SELECT word, n FROM counts ORDER BY word").fetchall())  # type: ignore[arg-type]


async def add(store: PostgresStore, word: str) -> None:
    await store.begin()
    await store.transaction().execute(
        "INSERT INTO counts VALUES (%s, 1) ON CONFLICT (word) DO UPDATE SET n = counts.n + 1", (word,)
    )


async def test_a_checkpoint_commits_with_the_applications_changes(pg_dsn) -> None:
    a = PostgresStore(pg_dsn, schema=[COUNTS])
    assert await a.restore_checkpoint("wc/0") == pb.Checkpoint()  # a new shard
    await add(a, "hello")
    await add(a, "hello")
    await a.start_commit("wc/0", checkpoint(100))
    a.destroy()

    b = PostgresStore(pg_dsn, schema=[COUNTS])  # the next primary
    assert await b.restore_checkpoint("wc/0") == checkpoint(100)
    assert counts(pg_dsn) == {"hello": 2}
    b.destroy()


async def test_a_zombie_primary_cannot_begin_or_commit_after_a_newer_one_restored(pg_dsn) -> None:
    zombie, primary = PostgresStore(pg_dsn, schema=[COUNTS]), PostgresStore(pg_dsn, schema=[COUNTS])
    try:
        await zombie.restore_checkpoint("wc/0")
        await primary.restore_checkpoint("wc/0")
        with pytest.raises(FenceError, match="a newer primary restored it"):
            await add(zombie, "zombie")
        with pytest.raises(FenceError):  # (nor commit without a begin of its own)
            await zombie.start_commit("wc/0", checkpoint(50))
        await add(primary, "primary")
        await primary.start_commit("wc/0", checkpoint(60))
        assert counts(pg_dsn) == {"primary": 1}
    finally:
        zombie.destroy()
        primary.destroy()
    again = PostgresStore(pg_dsn)
    assert await again.restore_checkpoint("wc/0") == checkpoint(60)
    again.destroy()


async def test_a_restore_waits_for_the_zombies_transaction_in_progress_and_restores_what_it_committed(
    pg_dsn, monkeypatch, caplog
) -> None:
    """The zombie began before the restore: its transaction holds the shard's row, so it commits; the
    restore (warning while it waits) comes after it, with its checkpoint; the zombie's next begin fails."""
    monkeypatch.setattr(store_module, "RESTORE_WAIT", 0.2)
    zombie, successor = PostgresStore(pg_dsn, schema=[COUNTS]), PostgresStore(pg_dsn, schema=[COUNTS])
    try:
        await zombie.restore_checkpoint("wc/0")
        await add(zombie, "zombie")
        with caplog.at_level(logging.WARNING, logger=store_module.__name__):
            restoring = asyncio.ensure_future(successor.restore_checkpoint("wc/0"))
            await wait_until(
                lambda: any("stays locked by another primary" in r.getMessage() for r in caplog.records), 30
            )
            assert not restoring.done()
            await zombie.start_commit("wc/0", checkpoint(70))
            assert await asyncio.wait_for(restoring, 30) == checkpoint(70)
        assert counts(pg_dsn) == {"zombie": 1}
        with pytest.raises(FenceError):
            await add(zombie, "zombie")
        await add(successor, "successor")
        await successor.start_commit("wc/0", checkpoint(80))
        assert counts(pg_dsn) == {"successor": 1, "zombie": 1}
    finally:
        zombie.destroy()
        successor.destroy()


async def test_a_commit_waits_for_its_dependencies_and_rolls_back_if_one_failed(pg_dsn) -> None:
    store = PostgresStore(pg_dsn, schema=[COUNTS])
    try:
        await store.restore_checkpoint("wc/0")
        await store.start_commit("wc/0", checkpoint(0))
        await add(store, "lost")
        failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        failed.set_exception(RuntimeError("the previous transaction's ACKs failed"))
        with pytest.raises(RuntimeError, match="ACKs failed"):
            await store.start_commit("wc/0", checkpoint(10), [failed])
        assert counts(pg_dsn) == {}
        assert await store.restore_checkpoint("wc/0") == checkpoint(0)
    finally:
        store.destroy()


async def test_many_shards_restore_at_once_in_one_database(pg_dsn) -> None:
    """Their CREATE TABLE IF NOT EXISTS statements would collide in PostgreSQL's catalog, run at once."""
    stores = [PostgresStore(pg_dsn, schema=[COUNTS]) for _ in range(8)]
    try:
        restored = await asyncio.gather(*(s.restore_checkpoint(f"wc/{i}") for i, s in enumerate(stores)))
        assert restored == [pb.Checkpoint()] * 8
        for i, s in enumerate(stores):
            await add(s, f"w{i}")
            await s.start_commit(f"wc/{i}", checkpoint(i))
        assert counts(pg_dsn) == {f"w{i}": 1 for i in range(8)}
    finally:
        for s in stores:
            s.destroy()


def test_a_transaction_outside_begin_is_refused_with_a_clear_error(pg_dsn) -> None:
    store = PostgresStore(pg_dsn)
    with pytest.raises(Exception, match="no transaction is open: begin"):
        store.transaction()


async def test_a_process_killed_mid_transaction_leaves_nothing_of_it(pg_dsn) -> None:
    child = textwrap.dedent(
        f"""
        import asyncio
        from tidings.consumer import PostgresStore
        from tidings.protocol import protocol_pb2 as pb

        async def main():
            s = PostgresStore({pg_dsn!r}, schema=[{COUNTS!r}])
            await s.restore_checkpoint("wc/0")
            await s.start_commit("wc/0", pb.Checkpoint())
            await s.begin()
            await s.transaction().execute("INSERT INTO counts VALUES ('uncommitted', 1)")
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
    store = PostgresStore(pg_dsn, schema=[COUNTS])
    try:  # (the server notices the dead connection and rolls back; the restore waits for its row lock)
        assert await asyncio.wait_for(store.restore_checkpoint("wc/0"), 60) == pb.Checkpoint()
    finally:
        store.destroy()
    assert counts(pg_dsn) == {}


async def test_a_new_index_waits_for_a_writers_transaction_without_holding_up_others(
    pg_dsn, monkeypatch, caplog
) -> None:
    """A schema statement that needs a table's lock (a new index) tries for it briefly, again and again
    (warning), rather than waiting in the table's lock queue, where every writer would queue behind it:
    another shard keeps writing meanwhile, and the restore completes once the long transaction ends."""
    monkeypatch.setattr(store_module, "RESTORE_WAIT", 0.2)
    running = PostgresStore(pg_dsn, schema=[COUNTS])
    await running.restore_checkpoint("wc/running")
    await add(running, "before")  # a writer's transaction stays open on counts
    migrating = PostgresStore(pg_dsn, schema=[COUNTS, "CREATE INDEX IF NOT EXISTS counts_n ON counts (n)"])
    other = PostgresStore(pg_dsn, schema=[COUNTS])
    try:
        with caplog.at_level(logging.WARNING, logger=store_module.__name__):
            restoring = asyncio.ensure_future(migrating.restore_checkpoint("wc/migrating"))
            await wait_until(
                lambda: any("waits for another transaction's locks" in r.getMessage() for r in caplog.records), 30
            )
            await other.restore_checkpoint("wc/other")  # not held up by the index
            await add(other, "other")
            await asyncio.wait_for(other.start_commit("wc/other", checkpoint(1)), 10)
            assert not restoring.done()
            await running.start_commit("wc/running", checkpoint(2))
            assert await asyncio.wait_for(restoring, 30) == pb.Checkpoint()
        with psycopg.connect(pg_dsn) as conn:
            assert conn.execute("SELECT to_regclass('counts_n') IS NOT NULL").fetchone() == (True,)
        assert counts(pg_dsn) == {"before": 1, "other": 1}
    finally:
        for s in (running, migrating, other):
            s.destroy()
