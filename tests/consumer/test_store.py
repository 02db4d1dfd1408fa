"""The consumer's SQLite store and its fence (issue 10, item 6, SQLite half): a checkpoint commits
with the application's changes or not at all; a primary fenced off by a newer one's restore fails
its next commit and nothing of that transaction lands; a process killed mid-transaction leaves
nothing of it."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from tests.support.stores import checkpoint
from tidings.consumer import FenceError, SQLiteStore
from tidings.protocol import protocol_pb2 as pb


def counts(store: SQLiteStore) -> dict[str, int]:
    return dict(store.db.execute("SELECT word, n FROM counts ORDER BY word").fetchall())


async def test_a_checkpoint_commits_with_the_applications_changes(tmp_path) -> None:
    path = tmp_path / "shard.db"
    a = SQLiteStore(path)
    assert await a.restore_checkpoint("wc/0") == pb.Checkpoint()  # a new shard
    a.transaction().execute("CREATE TABLE counts (word TEXT PRIMARY KEY, n INTEGER)")
    a.transaction().execute("INSERT INTO counts VALUES ('hello', 2)")
    await a.start_commit("wc/0", checkpoint(100))
    a.destroy()

    b = SQLiteStore(path)  # the next primary
    assert await b.restore_checkpoint("wc/0") == checkpoint(100)
    assert counts(b) == {"hello": 2}
    b.destroy()


async def test_a_zombie_primary_cannot_commit_after_a_newer_one_restored(tmp_path) -> None:
    path = tmp_path / "shard.db"
    setup = SQLiteStore(path)
    await setup.restore_checkpoint("wc/0")
    setup.transaction().execute("CREATE TABLE counts (word TEXT PRIMARY KEY, n INTEGER)")
    await setup.start_commit("wc/0", checkpoint(0))
    setup.destroy()

    zombie, primary = SQLiteStore(path), SQLiteStore(path)
    await zombie.restore_checkpoint("wc/0")
    await primary.restore_checkpoint("wc/0")  # (the zombie has no transaction open yet: nothing to wait for)
    zombie.transaction().execute("INSERT INTO counts VALUES ('zombie', 1)")
    with pytest.raises(FenceError, match="a newer primary restored it"):
        await zombie.start_commit("wc/0", checkpoint(50))
    primary.transaction().execute("INSERT INTO counts VALUES ('primary', 1)")
    await primary.start_commit("wc/0", checkpoint(60))
    assert counts(primary) == {"primary": 1}  # nothing of the zombie's transaction
    zombie.destroy()
    primary.destroy()
    again = SQLiteStore(path)
    assert await again.restore_checkpoint("wc/0") == checkpoint(60)
    again.destroy()


async def test_a_commit_waits_for_its_dependencies_and_rolls_back_if_one_failed(tmp_path) -> None:
    store = SQLiteStore(tmp_path / "shard.db")
    await store.restore_checkpoint("wc/0")
    store.transaction().execute("CREATE TABLE counts (word TEXT PRIMARY KEY, n INTEGER)")
    await store.start_commit("wc/0", checkpoint(0))
    store.transaction().execute("INSERT INTO counts VALUES ('lost', 1)")
    failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    failed.set_exception(RuntimeError("the previous transaction's ACKs failed"))
    with pytest.raises(RuntimeError, match="ACKs failed"):
        await store.start_commit("wc/0", checkpoint(10), [failed])
    assert counts(store) == {}
    assert await store.restore_checkpoint("wc/0") == checkpoint(0)
    store.destroy()


def test_a_process_killed_mid_transaction_leaves_nothing_of_it(tmp_path) -> None:
    path = tmp_path / "shard.db"
    child = textwrap.dedent(
        f"""
        import asyncio, sys
        from tidings.consumer import SQLiteStore
        from tidings.protocol import protocol_pb2 as pb

        async def main():
            s = SQLiteStore({str(path)!r})
            await s.restore_checkpoint("wc/0")
            s.transaction().execute("CREATE TABLE IF NOT EXISTS counts (word TEXT PRIMARY KEY, n INTEGER)")
            await s.start_commit("wc/0", pb.Checkpoint())
            s.transaction().execute("INSERT INTO counts VALUES ('uncommitted', 1)")
            print("written", flush=True)
            await asyncio.Event().wait()

        asyncio.run(main())
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"written\n"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    store = SQLiteStore(path)
    assert asyncio.run(store.restore_checkpoint("wc/0")) == pb.Checkpoint()
    assert counts(store) == {}
    store.destroy()


@pytest.mark.parametrize("waiting_in", ["begin", "restore"])
async def test_a_cancelled_wait_for_the_files_lock_leaves_nothing_holding_it(tmp_path, waiting_in) -> None:
    """A primary cancelled (a spec change, a stop) while its store waits in a worker thread for the
    file's write lock (held by another connection: a zombie on the same host) stops waiting and can be
    closed: no thread is left that would take the lock once it is free and keep it for good."""
    import apsw

    path = tmp_path / "shard.db"
    store = SQLiteStore(path)
    await store.restore_checkpoint("wc/0")
    if waiting_in == "restore":
        store.destroy()
        store = SQLiteStore(path)
    zombie = apsw.Connection(str(path))
    zombie.execute("BEGIN IMMEDIATE")  # holds the write lock
    waiting = asyncio.ensure_future(store.begin() if waiting_in == "begin" else store.restore_checkpoint("wc/0"))
    done, _ = await asyncio.wait([waiting], timeout=0.3)
    assert not done  # (it waits for the lock)
    waiting.cancel()
    done, _ = await asyncio.wait([waiting], timeout=5)
    assert done and waiting.cancelled()
    store.destroy()  # (no thread is busy with its connection)
    zombie.execute("ROLLBACK")
    probe = apsw.Connection(str(path))
    probe.set_busy_timeout(2000)
    probe.execute("BEGIN IMMEDIATE")  # the lock is free: nobody took it behind our back
    probe.execute("ROLLBACK")
    probe.close()
    zombie.close()
