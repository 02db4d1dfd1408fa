"""A consumer process's replica of one shard (Gazette's shard.go): what it does at its assignment's
slot, and the status it writes into the assignment (the allocator reads it).

- at slot 0 (primary): `serve_primary` (restore the store, which fences off any earlier primary,
  re-write its ACK intents, run transactions). Its status goes IDLE -> PRIMARY once restored; a
  failure stops the shard (the process keeps serving the others) and writes FAILED with the reason:
  a deleted source journal, a fenced store, the application's own error. A failed shard stays so
  until `tidings shards unassign ID` (Gazette's choice: a fault that repeats would otherwise move
  from process to process).
- with a recovery log (`recovery_log_prefix`): every replica plays the log into a directory of this
  process's own (`Consumer.recovered_dir`; `consumer/recovery.py`): BACKFILL, then STANDBY once
  caught up (a hot standby). At slot 0 it finishes playback by handing the log off to a new author
  (fencing the previous primary's recorder), gives the Shard its `recorder` and `recovery_dir`
  (`sqlite_store`), stores the recovered hints once restored and its own every HINT_INTERVAL. A
  demoted primary plays the log afresh (a recorder's directory is not a player's). A playback that
  fails makes it FAILED. A replica asked to stop while playing never hands the log off.
- without one, at another slot (standby): STANDBY at once: the store is remote (PostgreSQL) or a file
  every process reaches (SQLite in `--data-dir`, shared by the processes of one host).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from tidings.allocator.decoded import Assignment
from tidings.consumer import _metrics as metrics
from tidings.consumer.application import Shard, TxnStats
from tidings.consumer.recovery import Recovery
from tidings.consumer.recoverylog import _metrics as metrics_log
from tidings.consumer.recoverylog.hints import store_recorded
from tidings.consumer.recoverylog.recorder import RecorderFencedError
from tidings.consumer.shard import serve_primary
from tidings.consumer.store import FenceError
from tidings.consumer.transaction import OutputFailedError
from tidings.keyspace.etcd import create_revision_is, mod_revision_is, put_op
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.status import JournalNotFoundError, TidingsError

if TYPE_CHECKING:
    from tidings.consumer.service import Consumer

__all__ = ["HINT_INTERVAL", "RETAKES", "STOP_TIMEOUT", "ShardReplica"]

log = logging.getLogger(__name__)

STOP_TIMEOUT = 10.0  # seconds a stopping shard may take to commit its open transaction and write its ACKs
HINT_INTERVAL = 60.0  # seconds between a recording primary's hints in etcd (what a player reads from)
RETAKES = 3  # a primary fenced off its log while still assigned takes it back at most so many times in a row


class ShardReplica:
    """This process's replica of one shard (see the module docstring)."""

    def __init__(self, consumer: Consumer, shard_id: str, predecessor: asyncio.Task[None] | None = None) -> None:
        self.consumer = consumer
        self.id = shard_id
        self._predecessor = predecessor  # this shard's replica here that is still closing (its aclose)
        self.spec: pb.ShardSpec | None = None
        self.assignment: Assignment | None = None
        self.shard: Shard | None = None  # while primary
        self.status = pb.ReplicaStatus(code=pb.ReplicaStatus.IDLE)  # what this replica says of itself
        self._primary: asyncio.Task[None] | None = None
        self._stopping: asyncio.Task[None] | None = None  # a demoted primary, until it has stopped
        self.recovery: Recovery | None = None  # playing the shard's recovery log here (a standby, or primary-to-be)
        self._recoveries = 0
        self._retakes = 0  # recorder fences taken back in a row (`_retake`)
        self._stop = asyncio.Event()
        self._changed = asyncio.Event()
        self._writer = asyncio.create_task(self._write_status(), name=f"status:{shard_id}")
        self.closed = False

    @property
    def is_primary(self) -> bool:
        return self.assignment is not None and self.assignment.slot == 0 and self._primary is not None

    def update(self, spec: pb.ShardSpec, assignment: Assignment) -> None:
        """Follow the shard's spec and this process's assignment of it (a KeySpace update)."""
        old_spec, self.spec, self.assignment = self.spec, spec, assignment
        failed = self.status.code == pb.ReplicaStatus.FAILED
        stopping = self._stopping is not None and not self._stopping.done()
        if (
            self.recovery is not None
            and self._primary is None
            and old_spec is not None
            and _log_of(spec) != _log_of(old_spec)
        ):
            old, self.recovery = self.recovery, None  # (a standby of the old log: play the new one instead)
            asyncio.get_running_loop().create_task(old.aclose(), name=f"close-recovery:{self.id}")
        if spec.recovery_log_prefix and self.recovery is None and self._primary is None and not failed and not stopping:
            self._start_recovery()
        if assignment.slot == 0:
            if self._primary is None and not failed:
                self._start_primary(after=self._stopping)
            elif self._primary is not None and not failed and old_spec is not None and spec != old_spec:
                log.info("shard %s: its spec changed; restarting its primary", self.id)
                self._restart()
        elif self._primary is not None:  # demoted (the allocator moved the primary elsewhere)
            log.info("shard %s: no longer primary here; stopping it and standing by", self.id)
            self._demote()
        elif self.status.code == pb.ReplicaStatus.IDLE and not spec.recovery_log_prefix:
            self._set_status(pb.ReplicaStatus.STANDBY)  # (no recovery log to tail: ready at once)
        self._changed.set()

    def _demote(self) -> None:
        """Stop the primary (a successor fences it anyway), then stand by."""
        self._stop.set()
        old, self._primary, self.shard = self._primary, None, None
        assert old is not None
        if self.spec is not None and self.spec.recovery_log_prefix and self.status.code != pb.ReplicaStatus.FAILED:
            self._set_status(pb.ReplicaStatus.BACKFILL)  # (no ready standby until it has played the log afresh)

        def stood_down(_task: asyncio.Task[None]) -> None:
            code = self.status.code
            if self._primary is None and not self.closed and code != pb.ReplicaStatus.FAILED:
                if self.spec is not None and self.spec.recovery_log_prefix:
                    if self.recovery is None:  # (a recorder's directory cannot turn into a player's: play afresh)
                        self._start_recovery()
                    else:  # (one kept by a primary that never served: it says how far it is)
                        caught_up = self.recovery.tailing.is_set()
                        self._set_status(pb.ReplicaStatus.STANDBY if caught_up else pb.ReplicaStatus.BACKFILL)
                else:
                    self._set_status(pb.ReplicaStatus.STANDBY)

        self._stopping = asyncio.create_task(self._outlast(old), name=f"stopping:{self.id}")
        self._stopping.add_done_callback(stood_down)

    def _start_recovery(self) -> None:
        """Play the shard's recovery log into a fresh directory of this process: BACKFILL, then STANDBY
        once caught up (unless primary by then); a playback that fails makes the replica FAILED."""
        assert self.spec is not None and self.assignment is not None
        consumer = self.consumer
        self._recoveries += 1
        dir = consumer.recovered_dir / f"{quote(self.id, safe='')}-{self.assignment.create_revision}-{self._recoveries}"

        def caught_up() -> None:
            if self.recovery is recovery and self._primary is None and self.status.code == pb.ReplicaStatus.BACKFILL:
                self._set_status(pb.ReplicaStatus.STANDBY)

        def played(task: asyncio.Task[Any]) -> None:
            if task.cancelled() or task.exception() is None or self.recovery is not recovery:
                return
            if self._primary is None and not self.closed:  # (a primary fails with it on its own)
                reason = f"recovery log: {task.exception()}"  # (not through _fail: a demotion set _stop)
                log.error("shard %s: FAILED: %s (`tidings shards unassign %s` once mended)", self.id, reason, self.id)
                metrics.SHARD_FAILURES.inc()
                self._set_status(pb.ReplicaStatus.FAILED, reason)

        recovery = self.recovery = Recovery(
            consumer.client, consumer.etcd, self.spec, dir, consumer.hint_prefix, on_tailing=caught_up
        )
        recovery.start()
        assert recovery.task is not None
        recovery.task.add_done_callback(played)
        self._set_status(pb.ReplicaStatus.BACKFILL)

    def _start_primary(self, after: asyncio.Task[None] | None = None) -> None:
        """A new primary, serving once `after` (the previous one) has stopped. Its Shard is made now, so
        Stat waits on it from this moment (not on the previous one's, which no longer moves)."""
        assert self.spec is not None
        consumer = self.consumer
        self._stop = asyncio.Event()
        shard = self.shard = Shard(
            self.spec, consumer.client, on_transaction=self._observe, data_dir=consumer.config.data_dir
        )
        self._primary = asyncio.create_task(self._serve(shard, self._stop, after), name=f"shard:{self.id}")

    def _restart(self) -> None:
        """Stop the primary (its open transaction commits) and start another once it has stopped."""
        if self.closed or self._primary is None:
            return
        self._stop.set()
        self._start_primary(after=self._primary)

    async def _serve(self, shard: Shard, stop: asyncio.Event, after: asyncio.Task[None] | None) -> None:
        if self._predecessor is not None:  # (unassigned, then assigned here again: bounded by its own stop)
            await asyncio.wait([self._predecessor])
            self._predecessor = None
            if stop.is_set():
                return
        if after is not None:  # (never two primaries of a shard in one process: they would share its store)
            await self._outlast(after)
            if stop.is_set():
                return
        consumer, spec = self.consumer, shard.spec
        restored = asyncio.ensure_future(shard.restored.wait())

        def promoted(f: asyncio.Future[Any]) -> None:
            if not f.cancelled():
                self._set_status(pb.ReplicaStatus.PRIMARY)

        restored.add_done_callback(promoted)
        hints: asyncio.Task[None] | None = None
        recovery = self.recovery
        try:
            if spec.recovery_log_prefix:
                if recovery is None:  # (restarted under a new spec: play the log afresh)
                    self._start_recovery()
                    recovery = self.recovery
                assert recovery is not None
                since = time.monotonic()
                if not await self._take_over(shard, stop, recovery):
                    return  # (below: the recovery is closed, its playback cancelled)
                hints = asyncio.create_task(self._write_hints(shard, recovery, since), name=f"hints:{self.id}")
            log.info("shard %s: primary here; restoring its store", self.id)
            await serve_primary(consumer.client, spec, consumer.app, stop, shard)
            log.info("shard %s: primary stopped", self.id)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await self._ended_by(exc, spec, stop)
        finally:
            restored.cancel()
            if recovery is not None and self.recovery is recovery:
                self.recovery = None  # (first: a demotion plays afresh whatever happens below)
            try:
                if hints is not None:
                    hints.cancel()
                    await asyncio.wait([hints])
                if shard.recorder is not None:
                    await shard.recorder.aclose()
            finally:
                if recovery is not None:
                    await recovery.aclose()

    async def _ended_by(self, exc: Exception, spec: pb.ShardSpec, stop: asyncio.Event) -> None:
        """The primary ended with `exc`: FAILED with the reason, unless stopping anyway or fenced off its
        recovery log by a successor (`_fenced`)."""
        if isinstance(exc, RecorderFencedError):
            await self._fenced(exc, stop)
        elif isinstance(exc, FenceError):
            self._fail(f"fenced: {exc}", stop)
        elif isinstance(exc, OutputFailedError):
            self._fail(str(exc), stop)
        elif isinstance(exc, JournalNotFoundError):
            role = "source" if exc.journal in {s.journal for s in spec.sources} else "output"
            self._fail(f"its {role} journal {exc.journal!r} does not exist (deleted?): {exc}", stop)
        else:
            log.error("shard %s: failed", self.id, exc_info=exc)
            self._fail(f"{type(exc).__name__}: {exc}", stop)

    async def _fenced(self, exc: RecorderFencedError, stop: asyncio.Event) -> None:
        """Fenced off the recovery log. etcd (read now, linearizably) says by whom: no longer this
        process's assignment -> a successor's handoff: stop, as a demotion's update will say (no FAILED
        standby); still ours -> the handoff was no primary's (a replica promoted, then stalled past its
        lease with its no-op in flight, landing late): take the log over again, at most RETAKES times in
        a row (a commit resets the count)."""
        a = self.assignment
        if stop.is_set() or a is None:
            return self._fail(f"fenced: {exc}", stop)
        try:
            kv, _ = await self.consumer.etcd.get(a.key)
        except TidingsError:
            return self._fail(f"fenced: {exc}", stop)
        mine = kv is not None and kv.create_revision == a.create_revision
        if stop.is_set() or self.closed or self.assignment is not a or self._primary is not asyncio.current_task():
            return  # (moved on meanwhile: whoever moved it stops or starts what must run)
        if not mine:
            log.info("shard %s: stopped: fenced off its recovery log by its successor (%s)", self.id, exc)
            return
        if self._retakes >= RETAKES:
            return self._fail(f"fenced: {exc} ({RETAKES} times in a row while still its primary)", stop)
        self._retakes += 1
        log.warning("shard %s: %s, yet it is still this process's to serve; taking its log over again", self.id, exc)
        self._restart()  # (a new primary, once this one has ended)

    async def _take_over(self, shard: Shard, stop: asyncio.Event, recovery: Recovery) -> bool:
        """Finish playback with a handoff and give `shard` its recorder; False if `stop` came first (no
        longer primary: the log is never handed off to a replica going away)."""
        log.info("shard %s: primary here; playing its recovery log to its end", self.id)
        completing = asyncio.ensure_future(recovery.complete())
        stopped = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait([completing, stopped], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
        if not completing.done():
            completing.cancel()
            return False
        shard.recorder = completing.result()
        shard.recovery_dir = recovery.dir
        return not stop.is_set()

    async def _write_hints(self, shard: Shard, recovery: Recovery, since: float) -> None:
        """A recording primary's hints in etcd: the recovered ones once its store is restored (`since` its
        promotion: the handoff's time), then its recorder's every HINT_INTERVAL (a player reads the log
        from the latest hints on), each guarded by this assignment (a primary that lost the shard writes
        none); and at once when the recorder says the log's live part moved on (a rollover)."""
        recorder = shard.recorder
        assert self.assignment is not None and recorder is not None
        guard = create_revision_is(self.assignment.key, self.assignment.create_revision)
        await shard.restored.wait()
        metrics_log.HANDOFF_SECONDS.observe(time.monotonic() - since)
        await recovery.store_recovered(guard)
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(recorder.hints_due.wait(), HINT_INTERVAL)
            recorder.hints_due.clear()
            try:
                await store_recorded(self.consumer.etcd, recovery.keys, await recorder.build_hints(), guard)
            except TidingsError as exc:  # (etcd unreachable, or the recorder fenced: the primary stops anyway)
                log.warning("shard %s: writing its recovery hints failed: %s", self.id, exc)

    async def _outlast(self, old: asyncio.Task[None]) -> None:
        """Wait for the previous primary to stop (it commits its open transaction), at most
        STOP_TIMEOUT seconds; then cancel it (its store rolls the transaction back) and wait until it
        has ended, even if this wait is cancelled meanwhile (its successor is, or the replica closes):
        two primaries of one shard never run in one process, whatever the order of stops and starts."""
        cancelled = False
        try:
            await asyncio.wait([old], timeout=STOP_TIMEOUT)
        except asyncio.CancelledError:
            cancelled = True
        if not old.done():
            if not cancelled:
                log.warning("shard %s: its previous primary did not stop within %.0fs; cancelling it", self.id,
                            STOP_TIMEOUT)  # fmt: skip
            old.cancel()
            while not old.done():
                try:
                    await asyncio.wait([old])
                except asyncio.CancelledError:
                    cancelled = True
        if cancelled:
            raise asyncio.CancelledError

    def _fail(self, reason: str, stop: asyncio.Event) -> None:
        if stop.is_set():  # (stopping anyway: the assignment went, a successor fenced us)
            log.info("shard %s: stopped (%s)", self.id, reason)
            return
        log.error("shard %s: FAILED: %s (`tidings shards unassign %s` once mended)", self.id, reason, self.id)
        metrics.SHARD_FAILURES.inc()
        self._set_status(pb.ReplicaStatus.FAILED, reason)

    def _observe(self, stats: TxnStats) -> None:
        self._retakes = 0
        metrics.TRANSACTIONS.labels(self.id).inc()
        metrics.MESSAGES.labels(self.id).inc(stats.messages)
        metrics.COMMIT_SECONDS.labels(self.id).observe(stats.committing)
        metrics.TXN_SECONDS.labels(self.id).observe(stats.consuming + stats.committing + stats.acknowledging)

    def _set_status(self, code: pb.ReplicaStatus.Code, error: str = "") -> None:
        self.status = pb.ReplicaStatus(code=code, errors=[error] if error else [])
        self._changed.set()

    async def _write_status(self) -> None:
        """Keep the assignment's value equal to `status` (guarded by its mod revision; a changed
        assignment is written again once the KeySpace shows it)."""
        consumer = self.consumer
        while True:
            await self._changed.wait()
            self._changed.clear()
            a = self.assignment
            if a is None or a.value == self.status or self.closed:
                continue
            try:
                ok, revision = await consumer.etcd.txn(
                    [mod_revision_is(a.key, a.mod_revision)],
                    [put_op(a.key, self.status.SerializeToString(), ignore_lease=True)],
                )
            except Exception as exc:  # (etcd unreachable, most likely: the writer must live on)
                log.warning("shard %s: cannot write its status %s (%s); retrying", self.id, self.status.code, exc)
                await asyncio.sleep(1.0)
                self._changed.set()
                continue
            if ok:
                with contextlib.suppress(TimeoutError):
                    await consumer.keyspace.wait_for_revision(revision, timeout=10)

    async def aclose(self, timeout: float | None = None) -> None:
        """Stop: the primary commits its open transaction (at most `timeout`, STOP_TIMEOUT, seconds; then it
        is cancelled)."""
        timeout = STOP_TIMEOUT if timeout is None else timeout
        self.closed = True
        self._stop.set()
        running = [t for t in (self._primary, self._stopping) if t is not None]
        if running:
            _done, pending = await asyncio.wait(running, timeout=timeout)
            if pending:
                log.warning("shard %s: did not stop within %.0fs; cancelling it", self.id, timeout)
                for task in pending:
                    task.cancel()
                await asyncio.wait(pending)
        if self.recovery is not None:
            await self.recovery.aclose()
            self.recovery = None
        self._writer.cancel()
        await asyncio.wait([self._writer])


def _log_of(spec: pb.ShardSpec) -> tuple[str, str, int]:
    """What a replica's playback follows: the recovery log and its hints."""
    return spec.recovery_log_prefix, spec.hint_prefix, spec.hint_backups
