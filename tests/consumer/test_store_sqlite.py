"""SQLiteStore's write lock on a shard's file, which a zombie and its successor (other processes on one
host) share: waiting for it never stops the event loop, a cancelled wait leaves nobody holding it, and
a successor's restore waits on (without failing) for a paused zombie holding it, then takes over once
the zombie dies (DESIGN.md invariant 8; what both stores do: test_store.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections import Counter

import pytest

from tests.consumer._support import COUNTS
from tests.consumer.test_shard import WordCount, produce, spec, stored_counts
from tests.support.stores import checkpoint
from tests.support.waiting import wait_until
from tidings.consumer import SQLiteStore, serve_primary

HOLD_LOCK = """
import sys, apsw
db = apsw.Connection(sys.argv[1])
db.execute("BEGIN IMMEDIATE")
print("locked", flush=True)
sys.stdin.read()  # (holds the file's write lock until the test closes our stdin)
db.execute("ROLLBACK")
"""


async def test_waiting_for_another_processs_write_lock_does_not_freeze_the_event_loop(tmp_path) -> None:
    """A transaction waiting for the file's write lock held by another process (a zombie's transaction,
    which spans its awaits on appends) waits off the event loop: the process's other shards, its gRPC
    streams and its consumer's etcd lease keep-alive run on meanwhile."""
    path = tmp_path / "shard.db"
    store = SQLiteStore(path)
    await store.restore_checkpoint("wc/0")
    holder = await asyncio.create_subprocess_exec(
        sys.executable, "-c", HOLD_LOCK, str(path), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
    )
    beats: list[float] = []
    loop = asyncio.get_running_loop()

    def heartbeat() -> None:
        """The measurement: a timer the loop runs only while it is free to (a frozen loop beats never)."""
        beats.append(time.monotonic())
        beating[0] = loop.call_later(0.01, heartbeat)

    beating = [loop.call_later(0.01, heartbeat)]
    try:
        assert holder.stdout is not None and holder.stdin is not None
        assert await asyncio.wait_for(holder.stdout.readline(), 30) == b"locked\n"

        async def consume() -> None:  # as a shard's transaction does: begin (off the loop), then write
            await store.begin()
            store.transaction().execute("CREATE TABLE IF NOT EXISTS t (x INTEGER)")

        consuming = asyncio.ensure_future(consume())
        before = len(beats)
        await wait_until(lambda: len(beats) >= before + 20, 30)  # twenty beats while it waits for the lock
        # Still waiting (a begin on the loop's thread would have frozen the loop until its busy handler gave
        # up after 30 s, failing the begin): the loop served timers all along.
        assert not consuming.done(), "the lock was not held, or the begin failed: nothing was measured"
        holder.stdin.close()  # the holder rolls back
        await asyncio.wait_for(consuming, 30)
    finally:
        beating[0].cancel()
        if holder.returncode is None:
            holder.kill()
        await holder.wait()
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


ZOMBIE = """
import asyncio, os, signal, sys
from tests.consumer.test_shard import WordCount, spec
from tidings.client import AsyncClient
from tidings.consumer import serve_primary

def pause(n):
    if n == 30:
        print("consumed 30", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)  # paused mid-transaction, its write lock held

async def main(endpoint, path):
    async with AsyncClient(endpoint) as c:
        await serve_primary(c, spec(), WordCount(path, pause), asyncio.Event())

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


async def test_a_successor_takes_over_once_a_paused_zombie_dies(cluster, tmp_path) -> None:
    """A zombie paused mid-transaction (SIGSTOP, a debugger, a VM pause) holds the file's write lock
    while it is paused: its successor's restore waits for it (a documented limit of a SQLite file shared
    by two processes: recovery logs will give each replica its own), without failing, and takes over
    once the zombie dies."""
    for name in ("wc/in", "wc/out"):
        await cluster.create_journal(name, 3)
    words = ["apple", "banana", "cherry"] * 20
    await produce(cluster, words)
    path = tmp_path / "wc-0.db"
    errors = tmp_path / "zombie.err"
    with errors.open("wb") as err:
        zombie = await asyncio.create_subprocess_exec(
            sys.executable, "-c", ZOMBIE, cluster.brokers[0].endpoint, str(path), stdout=asyncio.subprocess.PIPE,
            stderr=err,
        )  # fmt: skip
    stop = asyncio.Event()
    successor: asyncio.Future | None = None
    try:
        assert zombie.stdout is not None
        line = await asyncio.wait_for(zombie.stdout.readline(), 60)
        if line != b"consumed 30\n":  # (what it said, and how it ended, if it did)
            await asyncio.wait([asyncio.ensure_future(zombie.wait())], timeout=5)
            raise AssertionError(f"zombie said {line!r}, exit {zombie.returncode}: {errors.read_text()[-3000:]}")
        async with cluster.client() as c:
            successor = asyncio.ensure_future(serve_primary(c, spec(), WordCount(path), stop))
            try:
                os.kill(zombie.pid, signal.SIGKILL)  # (dying releases the lock)
                await zombie.wait()
                await wait_until(lambda: sum(stored_counts(path).values()) == len(words) or successor.done(), 60)
            finally:
                stop.set()
                await asyncio.wait([successor])
    finally:
        if zombie.returncode is None:
            zombie.kill()
            await zombie.wait()
    assert not successor.done() or successor.exception() is None, successor.exception()
    assert stored_counts(path) == Counter(words)


async def test_a_commit_the_disk_refuses_fails_and_the_store_still_closes(tmp_path) -> None:
    """SQLite rolls a transaction back itself when its commit fails (a full disk): the store reports
    that error, not a rollback of no transaction, and destroy() still closes the file."""
    import apsw

    store = SQLiteStore(tmp_path / "full.db", schema=[COUNTS])
    await store.restore_checkpoint("wc/0")
    store.db.execute("PRAGMA max_page_count=12")  # (a disk this small)
    await store.begin()
    with pytest.raises(apsw.FullError):
        for i in range(200):
            store.transaction().execute("INSERT INTO counts VALUES (?, 1)", (f"w{i}" + "x" * 500,))
        await store.start_commit("wc/0", checkpoint(1))
    store.destroy()
    with pytest.raises(apsw.ConnectionClosedError):
        store.db.execute("SELECT 1")
