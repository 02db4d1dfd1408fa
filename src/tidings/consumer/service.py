"""Consumer: one `tidings consumer` process, serving the shards the allocator assigns it (Gazette's
consumer.Service). Shards are items and consumer processes members of the same allocator that
places journals on brokers (`allocator.kind.SHARDS`), under the consumer's own etcd root.

A member process (`tidings.member`: etcd, KeySpace of the consumer root, gRPC Shard service,
/metrics, leased ConsumerSpec, allocator, hand-off) whose items are shards; before it serves it checks
--broker and opens the shards' client, and once announced it follows its assignments. Each
assignment of this process is a `ShardReplica`:

- at slot 0 (primary): `serve_primary` (restore the store, which fences off any earlier primary,
  re-write its ACK intents, run transactions). Its status (the assignment's value) goes IDLE ->
  PRIMARY once restored; a failure stops the shard (the process keeps serving the others) and
  writes FAILED with the reason: a deleted source journal, a fenced store, the application's own
  error. A failed shard stays so until `tidings shards unassign ID` (Gazette's choice: a fault
  that repeats would otherwise move from process to process).
- with a recovery log (`recovery_log_prefix`): every replica plays the log into a directory of this
  process's own (`recovered_dir`; `consumer/recovery.py`): BACKFILL, then STANDBY once caught up (a
  hot standby). At slot 0 it finishes playback by handing the log off to a new author (fencing the
  previous primary's recorder), gives the Shard its `recorder` and `recovery_dir` (`sqlite_store`),
  stores the recovered hints once restored and its own every HINT_INTERVAL. A demoted primary plays
  the log afresh (a recorder's directory is not a player's). A playback that fails makes it FAILED.
- without one, at another slot (standby): STANDBY at once: the store is remote (PostgreSQL) or a file
  every process reaches (SQLite in `--data-dir`, shared by the processes of one host).

Statuses gate the allocator as journal routes do: it removes a primary only once another replica
is STANDBY, so a hand-off never leaves a shard without a ready successor. A replica whose
assignment goes is stopped gracefully (its open transaction commits, or fails on the fence if the
successor already restored). SIGTERM marks the member exiting and waits (at most `exit_timeout`)
for its shards to move, then stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import importlib
import logging
import shutil
import sys
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, TypeVar, cast
from urllib.parse import quote

import grpc

from tidings.allocator import keys
from tidings.allocator.decoded import Assignment
from tidings.allocator.kind import SHARDS
from tidings.allocator.state import State
from tidings.client import AsyncClient
from tidings.consumer import _metrics as metrics
from tidings.consumer.application import Application, Shard, TxnStats
from tidings.consumer.client import STAT_MARGIN
from tidings.consumer.recovery import Recovery
from tidings.consumer.recoverylog.hints import store_recorded
from tidings.consumer.shard import serve_primary
from tidings.consumer.store import FenceError
from tidings.consumer.transaction import OutputFailedError
from tidings.keyspace.etcd import Compare, RequestOp, create_revision_is, delete_op, mod_revision_is, put_op
from tidings.member import MemberProcess, counted
from tidings.protocol import labels, validate
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol import protocol_pb2_grpc as pb_grpc
from tidings.protocol.status import JournalNotFoundError, TidingsError, TransportError, UsageError, ValidationError

__all__ = ["Consumer", "ConsumerConfig", "ShardReplica", "load_app"]

log = logging.getLogger(__name__)

STOP_TIMEOUT = 10.0  # seconds a stopping shard may take to commit its open transaction and write its ACKs
BROKER_CHECK_RETRIES = 8  # retries of the start's check that --broker answers (about 3 s)
LAG_INTERVAL = 5.0  # seconds between looks at the sources' write heads (the lag gauges)
HINT_INTERVAL = 60.0  # seconds between a recording primary's hints in etcd (what a player reads from)


@dataclasses.dataclass
class ConsumerConfig:
    """Flags of `tidings consumer`, one for one with TIDINGS_* environment variables."""

    etcd: str
    broker: str
    app: str | Application  # module:factory, or the application itself (tests, embedding)
    zone: str = "local"
    suffix: str = "consumer-0"
    listen: str = "127.0.0.1:0"
    root: str = "/tidings/consumers/default"
    data_dir: Path = Path("data/consumer")  # shards' local files (`Shard.path`): SQLite stores
    shard_limit: int = 1024
    lease_ttl: int = 5
    metrics_listen: str | None = None  # HOST:PORT serving /metrics; "auto": the gRPC port + 1000
    exit_timeout: float = 60.0


def load_app(ref: str) -> Application:
    """The application of `module:factory` (the factory is called with no arguments)."""
    module_name, colon, attr = ref.partition(":")
    if not colon or not module_name or not attr:
        raise UsageError(f"--app {ref!r} is not module:factory (e.g. examples.wordcount:WordCount)")
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")  # (as `python -m` does: the working directory's modules)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UsageError(
            f"--app {ref!r}: cannot import {module_name!r} ({exc}); check the name and PYTHONPATH"
        ) from None
    factory = getattr(module, attr, None)
    if factory is None:
        raise UsageError(f"--app {ref!r}: module {module_name!r} has no {attr!r}")
    app = factory() if callable(factory) else factory
    if not isinstance(app, Application):
        raise UsageError(
            f"--app {ref!r} gives {type(app).__name__}, which is no tidings.consumer.Application: subclass it"
        )
    return app


class NotReadThroughError(TidingsError):
    """A Stat's deadline passed before the shard read through the offsets it asks for."""


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
                log.info("shard %s: primary here; playing its recovery log to its end", self.id)
                completing = asyncio.ensure_future(recovery.complete())
                stopped = asyncio.ensure_future(stop.wait())
                try:
                    await asyncio.wait([completing, stopped], return_when=asyncio.FIRST_COMPLETED)
                finally:
                    stopped.cancel()
                if not completing.done():  # (no longer primary: never hand the log off to a replica going away)
                    completing.cancel()
                    return  # (below: the recovery is closed, its playback cancelled)
                shard.recorder = completing.result()
                shard.recovery_dir = recovery.dir
                if stop.is_set():
                    return
                hints = asyncio.create_task(self._write_hints(shard, recovery), name=f"hints:{self.id}")
            log.info("shard %s: primary here; restoring its store", self.id)
            await serve_primary(consumer.client, spec, consumer.app, stop, shard)
            log.info("shard %s: primary stopped", self.id)
        except asyncio.CancelledError:
            raise
        except FenceError as exc:
            self._fail(f"fenced: {exc}", stop)
        except OutputFailedError as exc:
            self._fail(str(exc), stop)
        except JournalNotFoundError as exc:
            role = "source" if exc.journal in {s.journal for s in spec.sources} else "output"
            self._fail(f"its {role} journal {exc.journal!r} does not exist (deleted?): {exc}", stop)
        except Exception as exc:
            log.exception("shard %s: failed", self.id)
            self._fail(f"{type(exc).__name__}: {exc}", stop)
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

    async def _write_hints(self, shard: Shard, recovery: Recovery) -> None:
        """A recording primary's hints in etcd: the recovered ones once its store is restored, then its
        recorder's every HINT_INTERVAL (a player reads the log from the latest hints on), each guarded
        by this assignment (a primary that lost the shard writes none)."""
        assert self.assignment is not None and shard.recorder is not None
        guard = create_revision_is(self.assignment.key, self.assignment.create_revision)
        await shard.restored.wait()
        await recovery.store_recovered(guard)
        while True:
            await asyncio.sleep(HINT_INTERVAL)
            try:
                await store_recorded(self.consumer.etcd, recovery.keys, await shard.recorder.build_hints(), guard)
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

    async def aclose(self, timeout: float = STOP_TIMEOUT) -> None:
        """Stop: the primary commits its open transaction (at most `timeout` seconds, then it is cancelled)."""
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


class Consumer(MemberProcess):
    """A consumer process (see the module docstring): a member process whose items are shards
    (`tidings.member`)."""

    kind = SHARDS

    def __init__(self, config: ConsumerConfig) -> None:
        super().__init__(config)
        self.config: ConsumerConfig = config
        self.app: Application = load_app(config.app) if isinstance(config.app, str) else config.app
        self.replicas: dict[str, ShardReplica] = {}
        self._closing: dict[str, asyncio.Task[None]] = {}  # replicas being closed, by shard

    # -- the member process's steps (tidings.member.process) -----------------------------------

    @property
    def recovered_dir(self) -> Path:
        """Where this process plays shards' recovery logs (its own: processes of other ids on one --data-dir
        never touch it), emptied once it is announced (a playback always starts in an empty directory)."""
        return Path(self.config.data_dir) / "recovered" / f"{self.config.zone}-{self.config.suffix}"

    @property
    def hint_prefix(self) -> str:
        """Recovery hints of shards whose spec names no hint_prefix: beside the consumer's root, outside the
        KeySpace it watches."""
        return f"{self.config.root}.hints"

    async def _prepare(self, undo: contextlib.AsyncExitStack) -> None:
        await self._check_broker()
        self.client = AsyncClient(self.config.broker, retries=None)  # (shards wait out broker outages of any length)
        undo.push_async_callback(self.client.aclose)
        self.state = State.from_keyspace(self.keyspace, SHARDS)

    def _add_servicer(self, server: grpc.aio.Server) -> None:
        pb_grpc.add_ShardServicer_to_server(_Servicer(self), server)  # type: ignore[no-untyped-call]  # generated gRPC code, untyped

    def _member_spec(self) -> pb.ConsumerSpec:
        return pb.ConsumerSpec(id=self.process_id, endpoint=self.endpoint, shard_limit=self.config.shard_limit)

    def _exiting_spec(self) -> pb.ConsumerSpec:
        spec = pb.ConsumerSpec()
        spec.CopyFrom(cast(pb.ConsumerSpec, self.spec))  # (this process's: _member_spec's)
        spec.shard_limit, spec.exiting = 0, True
        return spec

    def _state(self) -> State:
        return self.state

    def _started(self) -> None:
        # Announced: no other process of this id runs now (announce waits for one), so what is left in
        # its directory is a dead one's (a playback always starts in an empty directory).
        shutil.rmtree(self.recovered_dir, ignore_errors=True)
        self._tasks.append(asyncio.create_task(self._lag_loop(), name=f"lag:{self.config.suffix}"))
        self.keyspace.add_observer(self._on_keyspace_update)
        self._on_keyspace_update()

    async def _release(self, graceful: bool) -> None:
        """Stop every shard (its open transaction commits, bounded), then serving."""
        replicas, self.replicas = self.replicas, {}
        await asyncio.gather(*(r.aclose() for r in replicas.values()), *self._closing.values(), return_exceptions=True)
        await self.server.stop(grace=1.0 if graceful else 0)

    async def _close_clients(self) -> None:
        await self.client.aclose()

    async def _check_broker(self) -> None:
        """Fail at start, in seconds, when --broker is wrong: the shards' client then waits out outages
        of any length, which for an address that never answered would be a wait for ever."""
        broker = self.config.broker
        try:
            async with AsyncClient(broker, retries=BROKER_CHECK_RETRIES) as probe:
                await probe.list(labels.parse_selector("name=tidings/consumer-start-check"))
        except TidingsError as err:
            raise UsageError(
                f"{self.who}: no broker answers at --broker {broker} ({err}); pass the HOST:PORT of a running broker"
            ) from None

    def _on_keyspace_update(self) -> None:
        """Atomically with a KeySpace update: rebuild State and follow this process's assignments."""
        if self.stopping:
            return
        self.state = state = State.from_keyspace(self.keyspace, SHARDS)
        mine = {a.journal: a for a in state.assignments_of(self.config.zone, self.config.suffix)}
        for shard_id, assignment in mine.items():
            item = state.items.get(shard_id)
            if item is None:
                continue
            replica = self.replicas.get(shard_id)
            if replica is None:
                closing = self._closing.get(shard_id)
                replica = self.replicas[shard_id] = ShardReplica(self, shard_id, closing)
            replica.update(item.spec, assignment)
        for shard_id in list(self.replicas):
            if shard_id not in mine or shard_id not in state.items:
                replica = self.replicas.pop(shard_id)
                log.info("shard %s: no longer assigned here; stopping its replica", shard_id)
                task = asyncio.get_running_loop().create_task(replica.aclose(), name=f"close:{shard_id}")
                self._closing[shard_id] = task
                task.add_done_callback(functools.partial(self._closed, shard_id))

    def _closed(self, shard_id: str, task: asyncio.Task[None]) -> None:
        if self._closing.get(shard_id) is task:
            del self._closing[shard_id]

    def header(self, route: pb.Route | None = None) -> pb.Header:
        return pb.Header(
            process_id=self.process_id,
            route=route if route is not None else pb.Route(primary=-1),
            etcd=pb.Header.Etcd(revision=self.keyspace.revision),
        )

    async def _lag_loop(self) -> None:
        """Every LAG_INTERVAL: each primary's read-through offsets and lag (the sources' write heads)."""
        while True:
            for replica in list(self.replicas.values()):
                shard = replica.shard
                if not replica.is_primary or shard is None:
                    continue
                for journal, through in list(shard.read_through.items()):
                    metrics.READ_THROUGH.labels(replica.id, journal).set(through)
                    with contextlib.suppress(TidingsError, TimeoutError):
                        async with asyncio.timeout(LAG_INTERVAL):  # (the client retries for ever: not here)
                            head = await self.client.write_head(journal)
                        metrics.LAG_BYTES.labels(replica.id, journal).set(max(0, head - through))
            await asyncio.sleep(LAG_INTERVAL)

    # -- the Shard service ---------------------------------------------------------------------

    async def stat(self, req: pb.StatRequest, deadline: float | None) -> pb.StatResponse:
        validate.shard_id(req.shard, "stat.shard")
        state = self.state
        if req.shard not in state.items:
            return pb.StatResponse(status=pb.SHARD_NOT_FOUND, header=self.header(), detail=f"no shard {req.shard!r}")
        route = state.route(req.shard)
        replica = self.replicas.get(req.shard)
        if replica is None or not replica.is_primary or replica.shard is None:
            status = pb.NO_SHARD_PRIMARY if route.primary < 0 else pb.NOT_SHARD_PRIMARY
            return pb.StatResponse(status=status, header=self.header(route))
        # Only the shard's sources, as Gazette's resolver keeps: another journal is never read through.
        sources = {src.journal for src in replica.spec.sources} if replica.spec is not None else set()
        wanted = {j: o for j, o in req.read_through.items() if j in sources and o > 0}
        while True:
            shard, primary = replica.shard, replica._primary
            if shard is None or primary is None:  # (demoted meanwhile)
                return pb.StatResponse(status=pb.NOT_SHARD_PRIMARY, header=self.header(self.state.route(req.shard)))
            if await self._served(shard, primary, wanted, deadline):
                break
            if not primary.done():  # the deadline passed first: Gazette's Stat fails with the context's error too
                behind = {j: o for j, o in wanted.items() if shard.read_through.get(j, 0) < o}
                raise NotReadThroughError(
                    f"shard {req.shard!r} has not read through {behind} by the call's deadline (it has read "
                    f"through {dict(shard.read_through)})"
                )
            if replica._primary is not None and replica._primary is not primary and not replica.closed:
                continue  # restarted under a new spec: the same shard, served on by its new primary
            why = "; ".join(replica.status.errors) or "it was handed off"
            return pb.StatResponse(status=pb.SHARD_STOPPED, header=self.header(route), detail=why)
        resp = pb.StatResponse(status=pb.OK, header=self.header(route))
        resp.read_through.update(shard.read_through)
        return resp

    @staticmethod
    async def _served(
        shard: Shard, primary: asyncio.Task[None], wanted: dict[str, int], deadline: float | None
    ) -> bool:
        """Whether `shard` is restored and reads through `wanted` before `deadline` passes or `primary` ends."""

        async def served() -> None:
            await shard.restored.wait()
            await shard.wait_read_through(wanted)

        waiting = asyncio.ensure_future(served())
        try:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            await asyncio.wait([waiting, primary], timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiting.cancel()
        return waiting.done() and not waiting.cancelled()

    def list_response(self, selector: pb.LabelSelector) -> pb.ShardListResponse:
        state = self.state
        resp = pb.ShardListResponse(status=pb.OK, header=self.header())
        for shard_id in sorted(state.items):
            item = state.items[shard_id]
            if not labels.matches(selector, labels.union(item.spec.labels, labels.label_set({"id": shard_id}))):
                continue
            route = state.route(shard_id)
            by_member = {a.member: a.value for a in state.assignments.get(shard_id, [])}
            entry = resp.shards.add(
                spec=item.spec, mod_revision=item.mod_revision, create_revision=item.create_revision, route=route
            )
            for m in route.members:
                entry.status.append(by_member.get((m.zone, m.suffix), pb.ReplicaStatus()))
        return resp

    async def apply(self, req: pb.ShardApplyRequest) -> pb.ShardApplyResponse:
        root = self.config.root
        compares: list[Compare] = []
        ops: list[RequestOp] = []
        for i, change in enumerate(req.changes):
            if change.HasField("upsert"):
                validate.shard_spec(change.upsert, f"changes[{i}].upsert")
                key = keys.item_key(root, change.upsert.id)
                ops.append(put_op(key, change.upsert.SerializeToString()))
            elif change.delete:
                validate.shard_id(change.delete, f"changes[{i}].delete")
                key = keys.item_key(root, change.delete)
                ops.extend(self.state.delete_ops(root, change.delete))
            else:
                raise ValidationError(f"changes[{i}]", "expected an upsert or a delete")
            if change.expect_mod_revision >= 0:
                compares.append(mod_revision_is(key, change.expect_mod_revision))
        ok, revision = await self.etcd.txn(compares, ops)
        with contextlib.suppress(TimeoutError):  # (applied either way; our view catches up later)
            await self.keyspace.wait_for_revision(revision, timeout=10)
        if not ok:
            return pb.ShardApplyResponse(
                status=pb.ETCD_TRANSACTION_FAILED,
                header=self.header(),
                detail="a shard changed since it was read (its mod revision differs); read it again and retry",
            )
        return pb.ShardApplyResponse(status=pb.OK, header=self.header())

    async def unassign(self, req: pb.UnassignRequest) -> pb.UnassignResponse:
        state = self.state
        compares: list[Compare] = []
        ops: list[RequestOp] = []
        done: list[str] = []
        for i, shard_id in enumerate(req.shards):
            validate.shard_id(shard_id, f"shards[{i}]")
            if shard_id not in state.items:
                return pb.UnassignResponse(status=pb.SHARD_NOT_FOUND, shards=[shard_id])
            assigned = state.assignments.get(shard_id, [])
            primary = next((a for a in assigned if a.slot == 0), None)
            if req.only_failed and (primary is None or primary.value.code != pb.ReplicaStatus.FAILED):
                continue
            if not assigned:
                continue
            done.append(shard_id)
            compares.extend(mod_revision_is(a.key, a.mod_revision) for a in assigned)
            ops.extend(delete_op(a.key) for a in assigned)
        if req.dry_run or not ops:
            return pb.UnassignResponse(status=pb.OK, shards=done)
        ok, revision = await self.etcd.txn(compares, ops)
        if not ok:
            return pb.UnassignResponse(status=pb.ETCD_TRANSACTION_FAILED)
        with contextlib.suppress(TimeoutError):
            await self.keyspace.wait_for_revision(revision, timeout=10)
        return pb.UnassignResponse(status=pb.OK, shards=done)


_Answer = TypeVar("_Answer", pb.ShardApplyResponse, pb.UnassignResponse)


class _Servicer(pb_grpc.ShardServicer):
    """gRPC entry points; bad input becomes INVALID_ARGUMENT naming the field."""

    def __init__(self, consumer: Consumer) -> None:
        self.consumer = consumer

    async def Stat(self, request: pb.StatRequest, context: grpc.aio.ServicerContext) -> pb.StatResponse:
        with counted(metrics.RPC_STATUS, "stat", context) as outcome:
            remaining = context.time_remaining()  # (answer before it passes, with what was read through)
            deadline = None if remaining is None else time.monotonic() + max(0.0, remaining - STAT_MARGIN)
            try:
                resp = await self.consumer.stat(request, deadline)
            except ValidationError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            except NotReadThroughError as exc:
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
            outcome.append(resp.status)
            return resp

    async def List(self, request: pb.ShardListRequest, context: grpc.aio.ServicerContext) -> pb.ShardListResponse:
        with counted(metrics.RPC_STATUS, "list", context) as outcome:
            try:
                validate.selector(request.selector)
            except ValidationError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            outcome.append(pb.OK)
            return self.consumer.list_response(request.selector)

    async def Apply(self, request: pb.ShardApplyRequest, context: grpc.aio.ServicerContext) -> pb.ShardApplyResponse:
        return await self._answer("apply", context, self.consumer.apply(request))

    async def Unassign(self, request: pb.UnassignRequest, context: grpc.aio.ServicerContext) -> pb.UnassignResponse:
        return await self._answer("unassign", context, self.consumer.unassign(request))

    async def _answer(self, rpc: str, context: grpc.aio.ServicerContext, call: Awaitable[_Answer]) -> _Answer:
        """An RPC that changes etcd: bad input is INVALID_ARGUMENT, an unreachable etcd UNAVAILABLE."""
        with counted(metrics.RPC_STATUS, rpc, context) as outcome:
            try:
                resp = await call
            except ValidationError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            except TransportError as exc:
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"{rpc}: {exc}")
            outcome.append(resp.status)
            return resp


def _log_of(spec: pb.ShardSpec) -> tuple[str, str, int]:
    """What a replica's playback follows: the recovery log and its hints."""
    return spec.recovery_log_prefix, spec.hint_prefix, spec.hint_backups
