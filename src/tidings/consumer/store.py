"""Store: where a consumer shard keeps its state, committed atomically with its Checkpoint
(Gazette's consumer.Store). A shard that becomes primary calls `restore_checkpoint`; each of its
transactions ends with `start_commit`, which commits the application's changes and the
Checkpoint (read-through offsets, producer states, ACK intents) in one store transaction, after
the operations it must follow (`wait_for`: e.g. the previous transaction's ACKs).

Fencing, as Gazette's SQLStore: a table ``tidings_checkpoints(shard PRIMARY KEY, fence, checkpoint)``.
`restore_checkpoint` increments the shard's fence in its own committed transaction and remembers
the value; every commit updates the checkpoint only WHERE the fence still has that value, inside
the same transaction as the application's changes. A primary that lost its shard to a newer one
(a zombie, still running) therefore fails its next commit with `FenceError`, and none of that
transaction's changes land; it must stop.

`SQLiteStore` keeps a shard's store in a SQLite file (apsw, in WAL mode); its tables are created
from `schema` (CREATE ... IF NOT EXISTS statements) with the restore, off the event loop (another
process's lock may make them wait: a process whose event loop stops misses its lease). The
application reads and writes through `transaction()` (an apsw Connection inside the open transaction, begun IMMEDIATE:
it holds the file's write lock) from the event loop's thread; a commit runs in a worker thread (it
may wait on the disk, and a cancelled commit still waits for it), and the next transaction begins
(`begin`, from a worker thread too) once it is done. A shard's file has one writer; while a zombie
and its successor (other processes on one host) both hold it open, each waits for the other's lock
between transactions, and a successor's restore waits as long as a paused zombie holds the lock
(until it resumes, and is fenced, or dies). Recovery logs (next) give each replica its own file.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Iterable
from pathlib import Path
from typing import Protocol

import apsw

from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.status import TidingsError

__all__ = ["FenceError", "SQLiteStore", "Store"]

log = logging.getLogger(__name__)

TABLE = "tidings_checkpoints"
BUSY_TIMEOUT = 30.0  # seconds a statement waits for another connection's write lock


def _retry_for(seconds: float):  # -> Callable[[int], bool]
    """A busy handler retrying every millisecond for `seconds` (apsw calls it with the tries so far)."""
    started: list[float] = []

    def busy(tries: int) -> bool:
        if tries == 0:
            started[:] = [time.monotonic()]
        time.sleep(0.001)
        return time.monotonic() - started[0] < seconds

    return busy


class FenceError(TidingsError):
    """A newer primary restored this shard's store: this one is a zombie and must stop."""


class Store(Protocol):
    """What a shard commits through (see the module docstring)."""

    async def restore_checkpoint(self, shard: str) -> pb.Checkpoint: ...
    async def start_commit(self, shard: str, checkpoint: pb.Checkpoint, wait_for: Iterable[Awaitable] = ()) -> None: ...
    def destroy(self) -> None: ...


class SQLiteStore:
    """A shard's store in the SQLite file at `path` (created if missing)."""

    def __init__(self, path: str | Path, schema: Iterable[str] = ()) -> None:
        self.path = str(path)
        self.schema = list(schema)  # the application's CREATE statements, run with the restore
        self.db = apsw.Connection(self.path)
        # Another connection may hold the write lock (a zombie's open transaction while a newer primary
        # restores, or the other way round): retry every millisecond, so a writer between two of its
        # transactions (committing, then writing its ACKs) lets the other in (SQLite's own busy timeout
        # backs off to 100 ms and could wait out a busy zombie for ever).
        self.db.set_busy_handler(_retry_for(BUSY_TIMEOUT))
        self._fence = 0  # the fence this store restored; 0 before restore_checkpoint
        self._open = False
        self._created = False

    def _create(self) -> None:
        """WAL mode, the checkpoints table and the application's `schema`: statements that may wait for
        another connection's lock, so they run with the restore, in a worker thread."""
        if self._created:
            return
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute(
            f"CREATE TABLE IF NOT EXISTS {TABLE} (shard TEXT PRIMARY KEY NOT NULL, fence INTEGER NOT NULL, "
            "checkpoint BLOB NOT NULL)"
        )
        for statement in self.schema:
            self.db.execute(statement)
        self._created = True

    async def begin(self) -> None:
        """Open the next transaction from a worker thread: waiting for the file's write lock (held by
        another process's connection, say) never stops the event loop. The shard calls it before a
        transaction's first message."""
        if not self._open:
            await asyncio.to_thread(self._begin)

    def transaction(self) -> apsw.Connection:
        """The connection, inside the current transaction (begun here, on the caller's thread, if
        `begin` did not open one)."""
        if not self._open:
            self._begin()
        return self.db

    def _begin(self) -> None:
        # IMMEDIATE: the write lock first, then the snapshot. A deferred transaction that read before
        # another connection committed could not write at all (SQLITE_BUSY_SNAPSHOT, which no wait mends).
        self.db.execute("BEGIN IMMEDIATE")
        self._open = True

    async def restore_checkpoint(self, shard: str) -> pb.Checkpoint:
        """The shard's last committed Checkpoint (empty for a new shard), fencing off earlier primaries."""
        if self._open:
            self._rollback()
        while True:
            try:
                fence, raw = await asyncio.to_thread(self._restore, shard)
                break
            except apsw.BusyError:  # another process holds the file's write lock (a zombie, paused?): wait on
                log.warning("shard %s: the store %s stays locked by another connection; still waiting", shard,
                            self.path)  # fmt: skip
        self._fence = fence
        checkpoint = pb.Checkpoint()
        checkpoint.ParseFromString(raw)
        return checkpoint

    def _restore(self, shard: str) -> tuple[int, bytes]:
        self._create()
        self.db.execute("BEGIN IMMEDIATE")
        try:
            row = self.db.execute(f"SELECT fence, checkpoint FROM {TABLE} WHERE shard = ?", (shard,)).fetchone()
            fence, raw = (row[0] + 1, row[1]) if row else (1, b"")
            self.db.execute(
                f"INSERT INTO {TABLE} (shard, fence, checkpoint) VALUES (?, ?, ?) "
                "ON CONFLICT (shard) DO UPDATE SET fence = excluded.fence",
                (shard, fence, raw),
            )
            self.db.execute("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        return fence, bytes(raw)

    async def start_commit(self, shard: str, checkpoint: pb.Checkpoint, wait_for: Iterable[Awaitable] = ()) -> None:
        """Commit the open transaction with `checkpoint`, once every `wait_for` has succeeded (if one
        failed, the transaction is rolled back and its error raised). FenceError if a newer primary
        restored the shard since this store did."""
        if not self._fence:
            raise TidingsError(f"shard {shard!r}: restore_checkpoint must come before the first commit")
        await self.begin()
        try:
            for op in wait_for:
                await op
        except BaseException:
            self._rollback()
            raise
        # The worker runs to its end whatever happens to us: rolling back (or closing) under it would let
        # its UPDATE commit the checkpoint alone. So a cancelled commit first waits for the worker.
        commit = asyncio.ensure_future(asyncio.to_thread(self._commit, shard, checkpoint.SerializeToString()))
        try:
            await asyncio.shield(commit)
        except asyncio.CancelledError:
            while not commit.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait([commit])
            if self._open:  # (the worker failed: nothing of the transaction landed)
                self._rollback()
            raise
        except BaseException:
            if self._open:
                self._rollback()
            raise

    def _commit(self, shard: str, raw: bytes) -> None:
        self.db.execute(f"UPDATE {TABLE} SET checkpoint = ? WHERE shard = ? AND fence = ?", (raw, shard, self._fence))
        if self.db.changes() != 1:
            raise FenceError(
                f"shard {shard!r}: its checkpoint fence moved past {self._fence}: a newer primary restored it, "
                "so this transaction is rolled back and this primary must stop"
            )
        self.db.execute("COMMIT")
        self._open = False

    def _rollback(self) -> None:
        self.db.execute("ROLLBACK")
        self._open = False

    def destroy(self) -> None:
        """Roll back an open transaction and close the file."""
        if self._open:
            self._rollback()
        self.db.close()
