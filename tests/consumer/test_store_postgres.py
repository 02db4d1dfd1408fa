"""PostgresStore keeps many shards' stores in one database (a real server, the `postgres` fixture):
their transactions take turns on each shard's checkpoint row, so a restore waits for a zombie's
transaction in progress and restores what it committed; restores, schema changes and a paused zombie
of one shard never hold up the others; a lost connection, or a begin, restore or commit cancelled
while it waits, leaves nothing half-committed or locked (DESIGN.md invariant 8; what both stores do:
test_store.py)."""

from __future__ import annotations

import asyncio
import logging

import psycopg
import pytest

from tests.consumer._support import COUNTS, add, counts
from tests.support.stores import checkpoint
from tests.support.waiting import wait_until
from tidings.consumer import FenceError, PostgresStore
from tidings.consumer import store as store_module
from tidings.protocol import protocol_pb2 as pb

INDEX = "CREATE INDEX IF NOT EXISTS counts_n ON counts (n)"


async def backend_pid(store: PostgresStore) -> int:
    assert store.conn is not None
    return store.conn.info.backend_pid


def lock_waiters(dsn: str) -> int:
    """Backends waiting for a lock: how a test knows a store is blocked (there is nothing else to poll)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute("SELECT count(*) FROM pg_locks WHERE NOT granted").fetchone()[0]  # type: ignore[index]


def committing(dsn: str, pid: int) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT state, query FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()
    return row is not None and row[0] == "active" and row[1].strip().upper() == "COMMIT"


def terminate(dsn: str, pid: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert conn.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone() == (True,)


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


async def test_a_restore_keeps_warning_every_restore_wait_while_the_row_stays_locked(pg_dsn, monkeypatch, caplog):
    """A restore waiting for a paused zombie's row warns every RESTORE_WAIT seconds for as long as it
    waits, as store.py's docstring says, not just once (a lock_timeout set inside the transaction that
    the first LockNotAvailable rolls back would leave every later wait silent)."""
    monkeypatch.setattr(store_module, "RESTORE_WAIT", 0.2)
    zombie, successor = PostgresStore(pg_dsn, schema=[COUNTS]), PostgresStore(pg_dsn, schema=[COUNTS])
    try:
        await zombie.restore_checkpoint("wc/0")
        await add(zombie, "zombie")  # holds the shard's row (a paused zombie)
        with caplog.at_level(logging.WARNING, logger=store_module.__name__):
            restoring = asyncio.ensure_future(successor.restore_checkpoint("wc/0"))

            def warnings() -> int:
                return sum("stays locked by another primary" in r.getMessage() for r in caplog.records)

            await wait_until(lambda: warnings() >= 1, 30)
            try:
                await wait_until(lambda: warnings() >= 3, 5)  # 25 RESTORE_WAITs
            finally:
                seen = warnings()
                await zombie.start_commit("wc/0", checkpoint(1))
                assert await asyncio.wait_for(restoring, 30) == checkpoint(1)
            assert seen >= 3
    finally:
        zombie.destroy()
        successor.destroy()


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


async def test_a_paused_zombie_of_one_shard_does_not_stop_other_shards_restoring(pg_dsn):
    """Shard a's zombie, paused mid-transaction (rows written to the application's table), does not
    stop shards b and c of the same database restoring, though their schema has a CREATE INDEX IF NOT
    EXISTS on that table: run under the restores' one advisory lock, waiting for a's transaction
    (ShareLock vs RowExclusiveLock) with no lock_timeout, it would hold every restore of the database."""
    schema = [COUNTS, INDEX]
    zombie_a = PostgresStore(pg_dsn, schema=schema)
    b, c = PostgresStore(pg_dsn, schema=schema), PostgresStore(pg_dsn, schema=schema)
    try:
        await zombie_a.restore_checkpoint("wc/a")
        await add(zombie_a, "a")  # paused here, mid-transaction
        restoring_b = asyncio.ensure_future(b.restore_checkpoint("wc/b"))
        restoring_c = asyncio.ensure_future(c.restore_checkpoint("wc/c"))
        done, _ = await asyncio.wait([restoring_b, restoring_c], timeout=5)
        stuck = [name for name, f in (("b", restoring_b), ("c", restoring_c)) if f not in done]
        await zombie_a.start_commit("wc/a", checkpoint(1))  # the zombie resumes: all restores go on
        await asyncio.wait_for(asyncio.gather(restoring_b, restoring_c), 30)
        assert stuck == [], f"shards {stuck} could not restore while another shard's zombie was paused"
    finally:
        for s in (zombie_a, b, c):
            s.destroy()


async def test_a_paused_zombie_of_one_shard_and_a_restore_of_another_do_not_stall_running_shards(pg_dsn):
    """Nor do they stall the running primary of shard c: were b's CREATE INDEX to wait in the table's
    lock queue for a's zombie, c's INSERT (RowExclusiveLock) would queue behind b's ShareLock."""
    schema = [COUNTS, INDEX]
    zombie_a, b, c = (PostgresStore(pg_dsn, schema=schema) for _ in range(3))
    try:
        await zombie_a.restore_checkpoint("wc/a")
        await c.restore_checkpoint("wc/c")  # c runs
        await add(zombie_a, "a")  # a's zombie pauses mid-transaction
        restoring_b = asyncio.ensure_future(b.restore_checkpoint("wc/b"))
        await wait_until(lambda: restoring_b.done() or lock_waiters(pg_dsn) > 0, 10)  # (b reaches its schema)
        writing_c = asyncio.ensure_future(add(c, "c"))
        done, _ = await asyncio.wait([writing_c], timeout=5)
        await zombie_a.start_commit("wc/a", checkpoint(1))
        await asyncio.wait_for(asyncio.gather(restoring_b, writing_c), 30)
        await c.start_commit("wc/c", checkpoint(1))
        assert writing_c in done, "a running shard's write stalled behind another shard's restore"
    finally:
        for s in (zombie_a, b, c):
            s.destroy()


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


def test_a_transaction_outside_begin_is_refused_with_a_clear_error(pg_dsn) -> None:
    store = PostgresStore(pg_dsn)
    with pytest.raises(Exception, match="no transaction is open: begin"):
        store.transaction()


async def test_a_connection_terminated_mid_transaction_commits_nothing_and_fails_clearly(pg_dsn):
    store = PostgresStore(pg_dsn, schema=[COUNTS])
    try:
        await store.restore_checkpoint("wc/0")
        await add(store, "kept")
        await store.start_commit("wc/0", checkpoint(1))
        await add(store, "lost")
        terminate(pg_dsn, await backend_pid(store))
        with pytest.raises(psycopg.OperationalError):
            await store.start_commit("wc/0", checkpoint(2))
    finally:
        store.destroy()
    assert counts(pg_dsn) == {"kept": 1}
    again = PostgresStore(pg_dsn)
    try:
        assert await asyncio.wait_for(again.restore_checkpoint("wc/0"), 30) == checkpoint(1)
    finally:
        again.destroy()


async def test_a_connection_terminated_between_transactions_fails_the_next_begin(pg_dsn):
    store = PostgresStore(pg_dsn, schema=[COUNTS])
    try:
        await store.restore_checkpoint("wc/0")
        terminate(pg_dsn, await backend_pid(store))
        with pytest.raises(psycopg.OperationalError):
            await add(store, "x")
    finally:
        store.destroy()


async def test_a_begin_cancelled_while_waiting_for_the_row_leaves_no_lock_or_transaction(pg_dsn):
    a, b = PostgresStore(pg_dsn, schema=[COUNTS]), PostgresStore(pg_dsn, schema=[COUNTS])
    try:
        await a.restore_checkpoint("wc/0")
        async with await psycopg.AsyncConnection.connect(pg_dsn) as holder:
            await holder.execute("SELECT 1 FROM tidings_checkpoints WHERE shard = 'wc/0' FOR UPDATE")
            beginning = asyncio.ensure_future(a.begin())
            await wait_until(lambda: lock_waiters(pg_dsn) > 0, 10)
            assert not beginning.done()
            beginning.cancel()
            with pytest.raises(asyncio.CancelledError):
                await beginning
            await holder.rollback()
        assert a.conn is not None and a.conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        # the next primary restores at once, and the cancelled one is fenced
        assert await asyncio.wait_for(b.restore_checkpoint("wc/0"), 10) == pb.Checkpoint()
        with pytest.raises(FenceError):
            await a.begin()
    finally:
        a.destroy()
        b.destroy()


async def test_a_restore_cancelled_while_waiting_for_the_row_leaves_nothing_locked(pg_dsn):
    zombie, cancelled, successor = (PostgresStore(pg_dsn, schema=[COUNTS]) for _ in range(3))
    try:
        await zombie.restore_checkpoint("wc/0")
        await add(zombie, "z")
        restoring = asyncio.ensure_future(cancelled.restore_checkpoint("wc/0"))
        await wait_until(lambda: lock_waiters(pg_dsn) > 0, 10)  # (waiting for the zombie's row lock)
        assert not restoring.done()
        restoring.cancel()
        with pytest.raises(asyncio.CancelledError):
            await restoring
        await zombie.start_commit("wc/0", checkpoint(5))
        assert await asyncio.wait_for(successor.restore_checkpoint("wc/0"), 10) == checkpoint(5)
        assert counts(pg_dsn) == {"z": 1}
    finally:
        for s in (zombie, cancelled, successor):
            s.destroy()


async def test_a_commit_cancelled_while_waiting_for_dependencies_rolls_back_and_unlocks(pg_dsn):
    store, successor = PostgresStore(pg_dsn, schema=[COUNTS]), PostgresStore(pg_dsn, schema=[COUNTS])
    try:
        await store.restore_checkpoint("wc/0")
        await add(store, "lost")
        dep: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        awaited = asyncio.Event()

        async def dependency() -> None:  # (says when the commit waits on it)
            awaited.set()
            await dep

        commit = asyncio.ensure_future(store.start_commit("wc/0", checkpoint(3), [dependency()]))
        await asyncio.wait_for(awaited.wait(), 10)
        assert not commit.done()
        commit.cancel()
        with pytest.raises(asyncio.CancelledError):
            await commit
        assert await asyncio.wait_for(successor.restore_checkpoint("wc/0"), 10) == pb.Checkpoint()
        assert counts(pg_dsn) == {}
    finally:
        store.destroy()
        successor.destroy()


SLOW_COMMIT = [
    COUNTS,
    "CREATE TABLE IF NOT EXISTS slow (id INTEGER)",
    """CREATE OR REPLACE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS
       $$ BEGIN PERFORM pg_sleep(0.6); RETURN NULL; END $$""",
    """DO $$ BEGIN CREATE CONSTRAINT TRIGGER slow_commit AFTER INSERT ON slow DEFERRABLE INITIALLY DEFERRED
       FOR EACH ROW EXECUTE FUNCTION slow_commit(); EXCEPTION WHEN duplicate_object THEN NULL; END $$""",
]


async def test_a_commit_cancelled_mid_commit_finishes_before_raising(pg_dsn):
    store = PostgresStore(pg_dsn, schema=SLOW_COMMIT)
    try:
        await store.restore_checkpoint("wc/0")
        await add(store, "committed")
        await store.transaction().execute("INSERT INTO slow VALUES (1)")  # COMMIT takes 0.6 s
        pid = await backend_pid(store)
        commit = asyncio.ensure_future(store.start_commit("wc/0", checkpoint(9)))
        await wait_until(lambda: committing(pg_dsn, pid), 10)
        commit.cancel()
        with pytest.raises(asyncio.CancelledError):
            await commit
        assert counts(pg_dsn) == {"committed": 1}  # the outcome is known on return: committed
        assert store.conn is not None and store.conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    finally:
        store.destroy()
    again = PostgresStore(pg_dsn)
    try:
        assert await again.restore_checkpoint("wc/0") == checkpoint(9)
    finally:
        again.destroy()
