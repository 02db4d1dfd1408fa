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

`PostgresStore` keeps shards' stores in a PostgreSQL database (psycopg 3, asyncio; one connection
per shard, READ COMMITTED), the checkpoints table a row per shard. Each transaction begins
(`begin`) by locking its shard's row (SELECT ... FOR UPDATE) and checking the fence there, so the
transactions of a zombie and of its successor take turns on that row before touching any of the
application's (they never deadlock on those), a restore waits for the zombie's transaction in
progress and restores what it committed, and a fenced zombie fails at its next begin, before it
consumes anything. The application writes through `transaction()` (the connection, inside that
transaction). A paused zombie holds its row until it resumes or dies, as with SQLite (the restore
warns every RESTORE_WAIT seconds). The schema runs with each restore; CREATE TABLE|INDEX IF NOT
EXISTS of a relation that exists is skipped, and what does run (a new index, say) takes its locks
only briefly at a time, retrying, so writers never queue behind it for more than a second.
Per-message round trips bound a shard's speed: an application keeps a transaction's changes in
memory and writes them in `finalize_txn`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import re
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import apsw

from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.status import TidingsError
from tidings.tasks import to_the_end

if TYPE_CHECKING:
    import psycopg

__all__ = ["FenceError", "PostgresStore", "SQLiteStore", "Store"]

log = logging.getLogger(__name__)
T = TypeVar("T")

TABLE = "tidings_checkpoints"
BUSY_TIMEOUT = 30.0  # seconds a statement waits for another connection's write lock
RESTORE_WAIT = 10.0  # seconds between warnings while a restore waits for another primary's transaction
SCHEMA_LOCK_WAIT_MS = 20  # a PostgresStore's schema statements wait no longer for a lock at first...
SCHEMA_RETRY = 0.1  # ...then try again after about this many seconds
CHECKPOINTS_TABLE = (
    f"CREATE TABLE IF NOT EXISTS {TABLE} (shard TEXT PRIMARY KEY NOT NULL, fence BIGINT NOT NULL, "
    "checkpoint BYTEA NOT NULL)"
)
_CREATED = re.compile(r"\s*CREATE\s+(?:UNIQUE\s+)?(?:TABLE|INDEX)\s+IF\s+NOT\s+EXISTS\s+([^\s(]+)", re.IGNORECASE)


class _Waiting:
    """Warns that a shard's restore is still waiting, every RESTORE_WAIT seconds of it."""

    def __init__(self, shard: str) -> None:
        self.shard, self.warned = shard, time.monotonic()

    def tick(self, why: str) -> None:
        if time.monotonic() - self.warned >= RESTORE_WAIT:
            log.warning("shard %s: %s; still waiting", self.shard, why)
            self.warned = time.monotonic()


def _retry_for(seconds: float, stop: threading.Event) -> Callable[[int], bool]:
    """A busy handler retrying every millisecond for `seconds` (apsw calls it with the tries so far),
    unless `stop` is set (its statement then fails with BusyError at once)."""
    started: list[float] = []

    def busy(tries: int) -> bool:
        if tries == 0:
            started[:] = [time.monotonic()]
        if stop.is_set():
            return False
        time.sleep(0.001)
        return time.monotonic() - started[0] < seconds

    return busy


class FenceError(TidingsError):
    """A newer primary restored this shard's store: this one is a zombie and must stop."""

    @classmethod
    def of(cls, shard: str, fence: int) -> FenceError:
        return cls(
            f"shard {shard!r}: its checkpoint fence moved past {fence}: a newer primary restored it, "
            "so this transaction is rolled back and this primary must stop"
        )


def _restore_first(shard: str) -> TidingsError:
    return TidingsError(f"shard {shard!r}: restore_checkpoint must come before the first commit")


def _parse(raw: bytes) -> pb.Checkpoint:
    checkpoint = pb.Checkpoint()
    checkpoint.ParseFromString(raw)
    return checkpoint


class Store(Protocol):
    """What a shard commits through (see the module docstring)."""

    async def restore_checkpoint(self, shard: str) -> pb.Checkpoint: ...
    async def start_commit(
        self, shard: str, checkpoint: pb.Checkpoint, wait_for: Iterable[Awaitable[object]] = ()
    ) -> None: ...
    def destroy(self) -> None: ...


class SQLiteStore:
    """A shard's store in the SQLite file at `path` (created if missing)."""

    def __init__(self, path: str | Path, schema: Iterable[str] = ()) -> None:
        self.path = str(path)
        self.schema = list(schema)  # the application's CREATE statements, run with the restore
        self._giving_up = threading.Event()  # a cancelled caller: a statement waiting for a lock stops waiting
        self.db = self._open_connection()
        self.cache: Any = None  # the application's, as Gazette's SQLStore.Cache: e.g. a transaction's changes
        self._fence = 0  # the fence this store restored; 0 before restore_checkpoint
        self._open = False
        self._created = False

    def _open_connection(self) -> apsw.Connection:
        db = self._connect()
        # Another connection may hold the write lock (a zombie's open transaction while a newer primary
        # restores, or the other way round): retry every millisecond, so a writer between two of its
        # transactions (committing, then writing its ACKs) lets the other in (SQLite's own busy timeout
        # backs off to 100 ms and could wait out a busy zombie for ever).
        db.set_busy_handler(_retry_for(BUSY_TIMEOUT, self._giving_up))
        return db

    def _connect(self) -> apsw.Connection:
        return apsw.Connection(self.path)

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
            await self._in_thread(self._begin)

    async def _in_thread(self, work: Callable[[], T]) -> T:
        """Run `work` (statements that may wait for another connection's lock) in a worker thread. A
        cancelled caller makes it stop waiting and still waits for the thread to end: the connection is
        never left busy in a thread nobody waits for (it could not be closed, and a BEGIN that got its
        lock later would hold it for good)."""
        task = asyncio.ensure_future(asyncio.to_thread(work))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            self._giving_up.set()
            try:
                await to_the_end(task)
            except Exception:  # (BusyError: it stopped waiting; the cancellation is what counts)
                pass
            finally:
                self._giving_up.clear()
            raise

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
                fence, raw = await self._in_thread(functools.partial(self._restore, shard))
                break
            except apsw.BusyError:  # another process holds the file's write lock (a zombie, paused?): wait on
                log.warning("shard %s: the store %s stays locked by another connection; still waiting", shard,
                            self.path)  # fmt: skip
        self._fence = fence
        return _parse(raw)

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

    async def start_commit(
        self, shard: str, checkpoint: pb.Checkpoint, wait_for: Iterable[Awaitable[object]] = ()
    ) -> None:
        """Commit the open transaction with `checkpoint`, once every `wait_for` has succeeded (if one
        failed, the transaction is rolled back and its error raised). FenceError if a newer primary
        restored the shard since this store did."""
        if not self._fence:
            raise _restore_first(shard)
        await self.begin()
        try:
            for op in wait_for:
                await op
        except BaseException:
            self._rollback()
            raise
        # The worker runs to its end whatever happens to us: rolling back (or closing) under it would let
        # its UPDATE commit the checkpoint alone.
        try:
            await to_the_end(asyncio.to_thread(self._commit, shard, checkpoint.SerializeToString()))
        except BaseException:
            if self._open:  # (the worker failed: nothing of the transaction landed)
                self._rollback()
            raise

    def _commit(self, shard: str, raw: bytes) -> None:
        self.db.execute(f"UPDATE {TABLE} SET checkpoint = ? WHERE shard = ? AND fence = ?", (raw, shard, self._fence))
        if self.db.changes() != 1:
            raise FenceError.of(shard, self._fence)
        self.db.execute("COMMIT")
        self._open = False

    def _rollback(self) -> None:
        self._open = False
        if not self.db.getautocommit():  # (SQLite itself rolled back a transaction whose commit failed: full disk)
            self.db.execute("ROLLBACK")

    def destroy(self) -> None:
        """Roll back an open transaction and close the file."""
        try:
            if self._open:
                self._rollback()
        finally:
            self.db.close()


class PostgresStore:
    """A shard's store in the PostgreSQL database at `dsn` (a libpq connection string or URL); the
    application's `schema` (CREATE ... IF NOT EXISTS statements) runs with the restore."""

    def __init__(self, dsn: str, schema: Iterable[str] = ()) -> None:
        self.dsn = dsn
        self.schema = list(schema)
        self.cache: Any = None  # the application's, as Gazette's SQLStore.Cache: e.g. a transaction's changes
        self.conn: psycopg.AsyncConnection | None = None
        self._shard = ""
        self._fence = 0  # the fence this store restored; 0 before restore_checkpoint
        self._open = False

    async def begin(self) -> None:
        """Open the next transaction: lock the shard's checkpoint row, checking the fence. Every primary
        locks that row first, so a zombie's transaction and its successor's take turns, never deadlock
        on the application's rows, and a fenced zombie fails here, before consuming anything."""
        if self._open:
            return
        if self.conn is None or not self._fence:
            raise _restore_first(self._shard)
        conn = self.conn
        try:
            cur = await conn.execute(f"SELECT fence FROM {TABLE} WHERE shard = %s FOR UPDATE", (self._shard,))
            row = await cur.fetchone()
            if row is None or row[0] != self._fence:
                raise FenceError.of(self._shard, self._fence)
        except BaseException:
            with contextlib.suppress(Exception):
                await conn.rollback()
            raise
        self._open = True

    def transaction(self) -> psycopg.AsyncConnection:
        """The shard's connection, inside the transaction `begin` opened (the shard begins each)."""
        if self.conn is None or not self._open:
            raise TidingsError("PostgresStore: no transaction is open: begin() opens one (after restore_checkpoint)")
        return self.conn

    async def restore_checkpoint(self, shard: str) -> pb.Checkpoint:
        """The shard's last committed Checkpoint (empty for a new shard), fencing off earlier primaries:
        its fence is incremented in a committed transaction of its own (once a transaction of the
        previous primary in progress has ended, and with what it committed)."""
        import psycopg

        if self.conn is None or self.conn.closed:
            self.conn = await psycopg.AsyncConnection.connect(self.dsn)
        conn, self._shard, self._open = self.conn, shard, False
        await conn.rollback()
        try:
            waited = _Waiting(shard)
            attempt = 0
            while not await self._create(conn, attempt):  # (another transaction holds a lock it needs: try again)
                attempt += 1
                waited.tick("creating the store's tables waits for another transaction's locks")
                await asyncio.sleep(SCHEMA_RETRY * (0.5 + random.random()))
            while True:
                try:  # (SET LOCAL: for this attempt's transaction, which a rollback ends)
                    await conn.execute(f"SET LOCAL lock_timeout = {int(RESTORE_WAIT * 1000)}")
                    cur = await conn.execute(
                        f"INSERT INTO {TABLE} AS t (shard, fence, checkpoint) VALUES (%s, 1, '') "
                        "ON CONFLICT (shard) DO UPDATE SET fence = t.fence + 1 RETURNING fence, checkpoint",
                        (shard,),
                    )
                    break
                except psycopg.errors.LockNotAvailable:  # a transaction of another primary (paused?) holds the row
                    await conn.rollback()
                    waited.tick("its checkpoint row stays locked by another primary's transaction")
            fence, raw = await cur.fetchone() or (0, b"")
            await conn.commit()
        except BaseException:
            with contextlib.suppress(Exception):
                await conn.rollback()
            raise
        self._fence = fence
        return _parse(bytes(raw))

    async def _create(self, conn: psycopg.AsyncConnection, attempt: int) -> bool:
        """The checkpoints table and the application's `schema`, one restore at a time (concurrent CREATE
        ... IF NOT EXISTS of one table collide in PostgreSQL's catalog). A CREATE [UNIQUE] TABLE|INDEX
        IF NOT EXISTS of a relation that exists is skipped: CREATE INDEX takes its table's lock even
        then, and waiting in that table's lock queue (behind a paused zombie's transaction, or any
        writer's) holds up every writer queued behind it, and every other restore. What still runs
        waits for a lock at most 20 ms, doubling each attempt up to a second; False (rolled back)
        if it did not get one: the caller tries again."""
        import psycopg

        try:
            await conn.execute(f"SET LOCAL lock_timeout = {min(1000, SCHEMA_LOCK_WAIT_MS << min(attempt, 6))}")
            await conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (TABLE,))
            for statement in (CHECKPOINTS_TABLE, *self.schema):
                created = _CREATED.match(statement)
                if created is not None:
                    cur = await conn.execute("SELECT to_regclass(%s) IS NOT NULL", (created.group(1),))
                    if (await cur.fetchone() or (False,))[0]:
                        continue
                await conn.execute(statement)
            await conn.commit()
            return True
        except psycopg.errors.LockNotAvailable:
            await conn.rollback()
            return False

    async def start_commit(
        self, shard: str, checkpoint: pb.Checkpoint, wait_for: Iterable[Awaitable[object]] = ()
    ) -> None:
        """Commit the open transaction with `checkpoint`, once every `wait_for` has succeeded (else it is
        rolled back and the failure raised); FenceError if a newer primary restored the shard."""
        await self.begin()
        assert self.conn is not None
        conn = self.conn
        try:
            for op in wait_for:
                await op
        except BaseException:
            await self._rollback()
            raise
        await to_the_end(self._commit(conn, shard, checkpoint.SerializeToString()))

    async def _commit(self, conn: psycopg.AsyncConnection, shard: str, raw: bytes) -> None:
        try:
            cur = await conn.execute(
                f"UPDATE {TABLE} SET checkpoint = %s WHERE shard = %s AND fence = %s", (raw, shard, self._fence)
            )
            if cur.rowcount != 1:
                raise FenceError.of(shard, self._fence)
            await conn.commit()
            self._open = False
        except BaseException:
            await self._rollback()
            raise

    async def _rollback(self) -> None:
        self._open = False
        if self.conn is not None:
            with contextlib.suppress(Exception):  # (a broken connection rolled back already)
                await self.conn.rollback()

    def destroy(self) -> None:
        """Close the connection (the server rolls back an open transaction). psycopg's close is libpq's
        PQfinish and nothing else, so it is done here without awaiting."""
        self._open = False
        if self.conn is not None:
            self.conn.pgconn.finish()
