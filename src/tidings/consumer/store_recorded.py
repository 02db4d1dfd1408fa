"""RecordedSQLiteStore: a shard's SQLite store whose file writes are recorded to its recovery log, so
that any process can play the store back (a new primary, a hot standby) without a shared disk.

The application gets a real SQLite database (apsw); an apsw VFS of ours sees every write, truncate,
create and delete of the database file and its WAL and queues them in call order; the queue is
turned into recorder operations on the event loop's thread (`_drain`: after each statement run in a
worker thread, and at each commit). The database runs in WAL mode with exclusive locking (a Python
VFS has no shared memory, which SQLite allows only so). When SQLite restarts the WAL (after a
checkpoint) it writes a new header at its offset 0: that is recorded as a new file, so the old frames
leave the log's horizon (`journal_size_limit=0` then truncates the file to its new frames). Syncs
are not passed to the disk: durability is the recovery log (Gazette's store-sqlite does the same).

A commit is `SQLiteStore`'s (after `wait_for`, the checkpoint with the application's changes in one
SQLite transaction), then its recorded writes are drained and `barrier()` waits until the log holds
them: the commit returns once another process could play it back. A zombie's recorder is fenced by
the log's author register (RecorderFencedError, a FenceError): its commit fails, nothing of it lands
after the newer primary's handoff. Every prefix of the log plays back to a database SQLite opens
consistently (its own recovery rolls back a transaction whose commit frame never landed).

The database file is rewritten in place, so its history in the log grows without bound; a rollover
bounds what a player reads: before a transaction, once the log holds more than `rollover_ratio` x
the database's size (and `rollover_min_bytes`) since its file was created, the database is copied
(`VACUUM INTO`, not recorded), closed, the copy recorded in chunks and renamed over it, and reopened
(measured: 1,500 transactions rewriting 300 rows, 32 MB of log, 1.2 MB live; a hinted playback read
1.35 MB). The pause grows with the database (~10 ms per MB here). A rollover opens a new connection:
connection settings (PRAGMAs) belong in `schema`, which runs on each; keep no reference to `db`
across transactions. Limit: one connection (exclusive locking).

JSONFileStore (Gazette's JSONFileStore) is for an application whose state is a small document: each
commit writes the whole document with the checkpoint to `next.json`, renames it over `state.json`
(both recorded), and returns once the log holds them. A player needs only the last document's
operations: the horizon is bounded by itself.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import itertools
import os
import shutil
import threading
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote

import apsw
import msgspec

from tidings.consumer.application import Shard
from tidings.consumer.recoverylog import _metrics as metrics
from tidings.consumer.recoverylog.recorder import Recorder, RecorderError
from tidings.consumer.store import SQLiteStore
from tidings.protocol import protocol_pb2 as pb

__all__ = ["DATABASE", "STATE", "JSONFileStore", "RecordedSQLiteStore", "sqlite_store"]

T = TypeVar("T")

DATABASE = "store.db"  # the database's file in the store's directory
STATE = "state.json"  # a JSONFileStore's document
_RECORDED = apsw.SQLITE_OPEN_MAIN_DB | apsw.SQLITE_OPEN_MAIN_JOURNAL | apsw.SQLITE_OPEN_WAL
_FLAGS = apsw.SQLITE_OPEN_READWRITE | apsw.SQLITE_OPEN_CREATE | apsw.SQLITE_OPEN_URI
NEXT = "store.db.next"  # a rollover's new database, until it is renamed over store.db
ROLLOVER_CHUNK = 1 << 20  # bytes of the new database recorded between barriers
_names = itertools.count(1)

# A file event, in call order: ("create", path) | ("write", path, offset, data) | ("truncate", path, size)
# | ("delete", path).
_Event = tuple[Any, ...]


def sqlite_store(shard: Shard, schema: Iterable[str] = ()) -> SQLiteStore:
    """The shard's SQLite store: recorded to its recovery log when it has one (played into the
    replica's own directory: any process can take the shard over), else a file in --data-dir."""
    if shard.recorder is not None and shard.recovery_dir is not None:
        return RecordedSQLiteStore(shard.recorder, shard.recovery_dir, schema)
    return SQLiteStore(shard.path(), schema)


class RecordedSQLiteStore(SQLiteStore):
    """A shard's store in `dir`/store.db, recorded by `recorder` (see the module docstring). `dir` is
    where a Player played the shard's log (or an empty directory for a new shard)."""

    def __init__(
        self,
        recorder: Recorder,
        dir: str | Path,
        schema: Iterable[str] = (),
        *,
        rollover_ratio: float = 2.0,
        rollover_min_bytes: int = 4 << 20,
    ) -> None:
        if rollover_ratio <= 1:
            raise ValueError(f"rollover_ratio must be more than 1, not {rollover_ratio}")
        self.recorder = recorder
        self.rollover_ratio, self.rollover_min_bytes = rollover_ratio, rollover_min_bytes
        self.rollovers = 0
        self.dir = Path(dir).resolve()  # (SQLite's symlink handling fails through a Python VFS)
        self._events: collections.deque[_Event] = collections.deque()
        self._recording = True
        self._loop_thread = threading.get_ident()
        self._vfs = _RecordingVFS(f"tidings-recorded-{next(_names)}", self)
        try:
            super().__init__(self.dir / DATABASE, schema)
        except BaseException:
            self._vfs.unregister()
            raise

    def _connect(self) -> apsw.Connection:
        return apsw.Connection(self.path, flags=_FLAGS, vfs=self._vfs.name)

    def _create(self) -> None:
        if not self._created:
            self.db.execute("PRAGMA locking_mode=EXCLUSIVE")  # (before WAL: no shared memory in a Python VFS)
            self.db.execute("PRAGMA journal_size_limit=0")  # a WAL reset truncates it: a new file in the log
        super()._create()

    async def begin(self) -> None:
        """Before the next transaction opens, roll the database over if its history in the log passed
        `rollover_ratio` times its size (and `rollover_min_bytes`): the playback horizon stays bounded."""
        if not self._open and self._created and self._history() > self._rollover_threshold():
            await self._rollover()
        await super().begin()

    def _history(self) -> int:
        """Log bytes since store.db's file was created (what playing it back reads), a lower bound."""
        rec = self.recorder
        fnode = rec.fnode(DATABASE)
        if fnode is None:
            return 0
        return rec.write_head - rec.fsm.nodes[fnode].segments[0].first_offset

    def _rollover_threshold(self) -> float:
        size = sum(os.path.getsize(p) for p in (self.dir / DATABASE, self.dir / f"{DATABASE}-wal") if p.exists())
        return max(self.rollover_ratio * size, self.rollover_min_bytes)

    async def _rollover(self) -> None:
        """`VACUUM INTO` an unrecorded copy, close (recorded: its checkpoint and the WAL's removal),
        record the copy in chunks (waiting for the log between them: nothing holds the whole file),
        rename it over store.db (one append), reopen. A crash anywhere leaves a consistent played
        directory: the old database, perhaps with a stray store.db.next, which the next rollover
        replaces."""
        rec, nxt = self.recorder, self.dir / NEXT
        if nxt.exists():  # (left by a rollover a crash cut short: VACUUM INTO writes only a new file)
            await asyncio.to_thread(nxt.unlink)
            self._event(("delete", NEXT))
        target = "file:" + quote(str(nxt)) + "?vfs=unix"  # (through the plain VFS: not recorded)
        await self._in_thread(lambda: self.db.execute("VACUUM INTO ?", (target,)))
        await self._in_thread(self.db.close)
        await rec.barrier()
        fnode = rec.create(NEXT)
        offset = 0
        f = await asyncio.to_thread(open, nxt, "rb")
        try:
            while chunk := await asyncio.to_thread(f.read, ROLLOVER_CHUNK):
                rec.write_at(fnode, chunk, offset)
                offset += len(chunk)
                await rec.barrier()
        finally:
            await asyncio.to_thread(f.close)
        wal = self.dir / f"{DATABASE}-wal"
        stale = wal.exists() and rec.fnode(wal.name) is not None  # (a WAL the close did not checkpoint away:
        await asyncio.to_thread(os.replace, nxt, self.dir / DATABASE)  # the copy holds its content, and
        if stale:  # beside the new database it would be replayed onto it)
            await asyncio.to_thread(wal.unlink)
        with rec.together():  # (one append: a log cut never leaves the old database without its WAL)
            rec.rename(NEXT, DATABASE)
            if stale:
                rec.unlink(wal.name)
        self.db = self._open_connection()
        self._created = False
        await self._in_thread(self._create)
        await rec.barrier()
        self.rollovers += 1
        metrics.ROLLOVERS.labels(rec.log).inc()
        rec.hints_due.set()  # (the shard's primary writes hints now: a player skips the old history at once)

    async def _in_thread(self, work: Callable[[], T]) -> T:
        try:
            return await super()._in_thread(work)
        finally:
            self._drain()

    async def start_commit(
        self, shard: str, checkpoint: pb.Checkpoint, wait_for: Iterable[Awaitable[object]] = ()
    ) -> None:
        """SQLiteStore's commit, returned once the recovery log holds it (RecorderFencedError for a zombie)."""
        try:
            await super().start_commit(shard, checkpoint, wait_for)
        finally:
            self._drain()
        await self.recorder.barrier()

    def destroy(self) -> None:
        """Close the database without recording (its close checkpoints the WAL: the recorder may be
        fenced) and remove the directory, which no longer matches the log: a replica plays the log
        into a fresh one each time it serves the shard."""
        self._recording = False
        self._events.clear()
        try:
            super().destroy()
        finally:
            self._vfs.unregister()
            shutil.rmtree(self.dir, ignore_errors=True)

    # -- recording -----------------------------------------------------------------------------

    def _event(self, event: _Event) -> None:
        """Queue a file event (any thread); on the loop's thread, record it at once."""
        if not self._recording:
            return
        self._events.append(event)
        if threading.get_ident() == self._loop_thread:
            self._drain()

    def _drain(self) -> None:
        """Record the queued events in order (the loop's thread only: the recorder is not thread-safe)."""
        rec, events = self.recorder, self._events
        while events:
            kind, path, *rest = events.popleft()
            if kind == "create":
                rec.create(path)
            elif kind == "write":
                if rest[0] == 0 and path.endswith("-wal") and rec.fnode(path) is not None:
                    rec.create(path)  # (a WAL header: SQLite restarts the WAL, its old frames are done with)
                rec.write_at(self._fnode(path), rest[1], rest[0])
            elif kind == "truncate":
                if rest[0] == 0:
                    rec.create(path)  # (emptied: a new file, its history out of the log's horizon)
                else:
                    rec.truncate(self._fnode(path), rest[0])
            elif kind == "delete" and rec.fnode(path) is not None:  # (SQLite deletes absent journals too)
                rec.unlink(path)

    def _fnode(self, path: str) -> int:
        fnode = self.recorder.fnode(path)
        if fnode is None:
            raise RecorderError(
                f"store {self.dir}: {path} was written, but was never recorded (not a played directory?)"
            )
        return fnode


class _RecordingVFS(apsw.VFS):
    """The default VFS, with the database's and its journal's writes reported to the store."""

    def __init__(self, name: str, store: RecordedSQLiteStore) -> None:
        self.name, self.store = name, store
        super().__init__(name, "")

    def _path(self, name: str) -> str:
        return os.path.relpath(name, self.store.dir)

    def xOpen(self, name: str | apsw.URIFilename | None, flags: list[int]) -> apsw.VFSFile:
        if name is None or not flags[0] & _RECORDED:
            return super().xOpen(name, flags)
        filename = name.filename() if isinstance(name, apsw.URIFilename) else name
        path = self._path(filename)
        created = not os.path.exists(filename)
        file = _RecordingFile(self.store, name, flags, path)
        if created:  # (once it exists: an open that failed recorded nothing)
            self.store._event(("create", path))
        return file

    def xDelete(self, name: str, syncdir: bool) -> None:
        super().xDelete(name, syncdir)
        self.store._event(("delete", self._path(name)))


class _RecordingFile(apsw.VFSFile):
    def __init__(self, store: RecordedSQLiteStore, name: str | apsw.URIFilename, flags: list[int], path: str) -> None:
        self.store, self.path = store, path
        super().__init__("", name, flags)

    def xWrite(self, data: bytes, offset: int) -> None:
        super().xWrite(data, offset)
        self.store._event(("write", self.path, offset, bytes(data)))

    def xTruncate(self, size: int) -> None:
        super().xTruncate(size)
        self.store._event(("truncate", self.path, size))

    def xSync(self, flags: int) -> None:
        return None  # (durability is the recovery log)


class JSONFileStore:
    """A shard's state as one JSON document in `dir` (see the module docstring): `state` is the
    application's (a `state_type`, decoded by msgspec: a dict by default), committed whole."""

    def __init__(self, recorder: Recorder, dir: str | Path, state_type: type[Any] = dict) -> None:
        self.recorder, self.dir, self.state_type = recorder, Path(dir), state_type
        self.state: Any = state_type()

    async def restore_checkpoint(self, shard: str) -> pb.Checkpoint:
        """The last committed document's checkpoint; `state` becomes its state (a new one if none)."""
        path = self.dir / STATE
        raw = await asyncio.to_thread(path.read_bytes) if path.exists() else b""
        checkpoint = pb.Checkpoint()
        if raw:
            doc = msgspec.json.decode(raw, type=_Document)
            checkpoint.ParseFromString(base64.b64decode(doc.checkpoint))
            self.state = msgspec.convert(doc.state, self.state_type)
        else:
            self.state = self.state_type()
        return checkpoint

    async def start_commit(
        self, shard: str, checkpoint: pb.Checkpoint, wait_for: Iterable[Awaitable[object]] = ()
    ) -> None:
        """Write `state` with `checkpoint` (after every `wait_for`), returned once the log holds it."""
        for op in wait_for:
            await op
        doc = _Document(base64.b64encode(checkpoint.SerializeToString()).decode(), msgspec.to_builtins(self.state))
        data = msgspec.json.encode(doc)
        rec = self.recorder
        await asyncio.to_thread(_write_file, self.dir / "next.json", data)
        rec.write_at(rec.create("next.json"), data, 0)
        await asyncio.to_thread(os.replace, self.dir / "next.json", self.dir / STATE)
        rec.rename("next.json", STATE)
        await rec.barrier()

    def destroy(self) -> None:
        """Nothing to close: the document is written whole at each commit."""


class _Document(msgspec.Struct):
    checkpoint: str  # base64 of the Checkpoint
    state: Any


def _write_file(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
