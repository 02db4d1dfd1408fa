"""Consumer: one `tidings consumer` process, serving the shards the allocator assigns it (Gazette's
consumer.Service). Shards are items and consumer processes members of the same allocator that
places journals on brokers (`allocator.kind.SHARDS`), under the consumer's own etcd root.

A member process (`tidings.member`: etcd, KeySpace of the consumer root, gRPC Shard service,
/metrics, leased ConsumerSpec, allocator, hand-off) whose items are shards; before it serves it checks
--broker and opens the shards' client, and once announced it follows its assignments. Each
assignment of this process is a `ShardReplica` (`consumer/replica.py`: what it does at each slot, and
the status it reports).

Statuses gate the allocator as journal routes do: it removes a primary only once another replica
is STANDBY, so a hand-off never leaves a shard without a ready successor. A replica whose
assignment goes is stopped gracefully (its open transaction commits, or fails on the fence if the
successor already restored). SIGTERM marks the member exiting and waits (at most `exit_timeout`)
for its shards to move, then stops.

With `auth_keys` (`--auth-keys`) every Shard RPC first checks its caller's token for the capability it
needs (Gazette's consumer/protocol/auth.go: READ for Stat and GetHints, LIST for List, APPLY for Apply
and Unassign), and a shard outside the token's selector (its labels and meta-label `id`) is answered
exactly as a missing one (SHARD_NOT_FOUND), left out of List, and out of Apply's reach. The process
signs its own calls to brokers (its shards' reads and appends, recovery logs) with the first key: it
holds keys, never a token, which would expire while it runs. (It makes no Shard calls to its peers: a
Stat asked of a replica that is not primary answers with the route, and the client follows it.)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import importlib
import logging
import math
import shutil
import sys
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import TypeVar, cast

import grpc

from tidings.allocator import keys
from tidings.allocator.kind import SHARDS
from tidings.allocator.state import State
from tidings.auth import AuthError, KeySet, authorizer_of, seconds_left, verifier_of
from tidings.client import AsyncClient
from tidings.consumer import _metrics as metrics
from tidings.consumer.application import Application, Shard
from tidings.consumer.client import STAT_MARGIN
from tidings.consumer.recovery import recovery_log
from tidings.consumer.recoverylog import _metrics as recovery_metrics
from tidings.consumer.recoverylog import hints
from tidings.consumer.replica import ShardReplica
from tidings.keyspace.etcd import KV, Compare, RequestOp, delete_op, mod_revision_is, put_op
from tidings.member import MemberProcess, counted
from tidings.protocol import labels, validate
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol import protocol_pb2_grpc as pb_grpc
from tidings.protocol.claims import Capability, Claims, covers
from tidings.protocol.status import (
    NotAllowedError,
    TidingsError,
    TransportError,
    UnauthenticatedError,
    UsageError,
    ValidationError,
)
from tidings.tls import TLS

__all__ = ["Consumer", "ConsumerConfig", "ShardReplica", "load_app"]

log = logging.getLogger(__name__)

BROKER_CHECK_RETRIES = 8  # retries of the start's check that --broker answers (about 3 s)
LAG_INTERVAL = 5.0  # seconds between looks at the sources' write heads (the lag gauges)


@dataclasses.dataclass
class ConsumerConfig:
    """Flags of `tidings consumer`, one for one with TIDINGS_* environment variables."""

    etcd: str
    broker: str
    app: str | Application  # module:factory, or the application itself (tests, embedding)
    zone: str = "local"
    suffix: str = "consumer-0"
    listen: str = "127.0.0.1:0"
    advertise: str = ""  # HOST or HOST:PORT other hosts dial ("": --listen's; a wildcard --listen needs one)
    root: str = "/tidings/consumers/default"
    data_dir: Path = Path("data/consumer")  # shards' local files (`Shard.path`): SQLite stores
    shard_limit: int = 1024
    lease_ttl: int = 5
    metrics_listen: str | None = None  # HOST:PORT serving /metrics; "auto": the gRPC port + 1000
    metrics_advertise: str = ""  # HOST[:PORT] announced for /metrics ("": on --advertise's host, its own port)
    metrics_tls: bool = False  # /metrics over TLS with the process's certificate (mutual with a CA)
    exit_timeout: float = 60.0
    tls: TLS | None = None  # --tls-cert/--tls-key/--tls-ca: serve, and dial brokers and peers, with TLS
    etcd_tls: TLS | None = None  # --etcd-tls-*: etcd over TLS
    etcd_user: str = ""  # --etcd-user: as this etcd user (its password below, never shown)
    etcd_password: str = dataclasses.field(default="", repr=False)
    # --auth-keys: verify every Shard RPC's token (None: auth off), and sign the process's calls to brokers
    auth_keys: KeySet | None = None


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
        self.verifier = verifier_of(config.auth_keys, "shard")
        self.authorizer = authorizer_of(config.auth_keys, sub=self.who)  # (its calls to brokers)

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
        # (shards wait out broker outages of any length)
        self.client = AsyncClient(self.config.broker, retries=None, tls=self.config.tls, auth=self.authorizer)
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
            auth = self.authorizer
            async with AsyncClient(broker, retries=BROKER_CHECK_RETRIES, tls=self.config.tls, auth=auth) as probe:
                await probe.list(labels.parse_selector("name=tidings/consumer-start-check"))
        except (UnauthenticatedError, NotAllowedError) as err:  # (it answers, but not to this process)
            keys = "the keys the brokers hold" if self.config.auth_keys else "the brokers' keys"
            said = str(err).replace(": pass --auth-token (TIDINGS_AUTH_TOKEN)", "")  # (it takes none)
            raise UsageError(
                f"{self.who}: the brokers at --broker {broker} refuse its calls ({said}); give it {keys} "
                "(--auth-keys-file or --auth-keys): a consumer signs its own tokens"
            ) from None
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
                with contextlib.suppress(KeyError):  # (its gauge would stay at its last value for good)
                    recovery_metrics.LAG_BYTES.remove(shard_id)
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
        """Every LAG_INTERVAL: each primary's read-through offsets and lag (the sources' write heads), and
        each replica's recovery-log lag."""
        while True:
            for replica in list(self.replicas.values()):
                await self._recovery_lag(replica)
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

    async def _recovery_lag(self, replica: ShardReplica) -> None:
        stat = self._replica_stat(replica.id, replica, pb.Route())
        if not stat.recovery_log.journal:
            return
        with contextlib.suppress(TidingsError, TimeoutError):
            async with asyncio.timeout(LAG_INTERVAL):  # (the client retries for ever: not here)
                head = await self.client.write_head(stat.recovery_log.journal)
            if self.replicas.get(replica.id) is replica:  # (not one closed meanwhile)
                recovery_metrics.LAG_BYTES.labels(replica.id).set(max(0, head - stat.recovery_log.offset))

    # -- the Shard service ---------------------------------------------------------------------

    def _visible(self, shard_id: str, claims: Claims | None) -> pb.ShardSpec | None:
        """The spec of `shard_id` if it exists and the token's selector (`claims`; None: the process's own)
        covers it; else None, the one answer for a shard missing or hidden (hidden: logged, counted)."""
        item = self.state.items.get(shard_id)
        if item is None:
            return None
        spec = cast(pb.ShardSpec, item.spec)  # (a shard's: the State of SHARDS)
        if _outside(claims, shard_id, spec):
            self.verifier.hid(f"shard {shard_id}", "SHARD_NOT_FOUND")
            return None
        return spec

    async def stat(self, req: pb.StatRequest, deadline: float | None, claims: Claims | None = None) -> pb.StatResponse:
        validate.shard_id(req.shard, "stat.shard")
        state = self.state
        if self._visible(req.shard, claims) is None:
            return pb.StatResponse(status=pb.SHARD_NOT_FOUND, header=self.header(), detail=f"no shard {req.shard!r}")
        route = state.route(req.shard)
        replica = self.replicas.get(req.shard)
        if req.any_replica:
            if req.read_through:
                raise ValidationError(
                    "stat.read_through", "any_replica answers at once: ask the primary (without any_replica) to wait"
                )
            return self._replica_stat(req.shard, replica, route)
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

    def _replica_stat(self, shard_id: str, replica: ShardReplica | None, route: pb.Route) -> pb.StatResponse:
        """Stat(any_replica): this process's replica as it stands, at once."""
        if replica is None:
            return pb.StatResponse(
                status=pb.NOT_SHARD_PRIMARY, header=self.header(route), detail=f"no replica of {shard_id!r} here"
            )
        resp = pb.StatResponse(status=pb.OK, header=self.header(route))
        shard, primary = replica.shard, replica._primary
        serving = replica.is_primary and primary is not None and not primary.done()
        if serving and shard is not None and shard.restored.is_set():
            resp.read_through.update(shard.read_through)
        if shard is not None and shard.recorder is not None and replica.is_primary:
            resp.recovery_log.journal, resp.recovery_log.offset = shard.recorder.log, shard.recorder.write_head
        elif replica.recovery is not None:
            resp.recovery_log.journal, resp.recovery_log.offset = replica.recovery.log, replica.recovery.offset
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

    def list_response(self, selector: pb.LabelSelector, claims: Claims | None = None) -> pb.ShardListResponse:
        """The shards matching `selector` and the token's (`claims`), by id, with their routes and statuses."""
        state = self.state
        resp = pb.ShardListResponse(status=pb.OK, header=self.header())
        for shard_id in sorted(state.items):
            item = state.items[shard_id]
            if not labels.matches(selector, labels.shard_labels(shard_id, item.spec.labels)):
                continue
            if _outside(claims, shard_id, item.spec):
                continue
            route = state.route(shard_id)
            by_member = {a.member: a.value for a in state.assignments.get(shard_id, [])}
            entry = resp.shards.add(
                spec=item.spec, mod_revision=item.mod_revision, create_revision=item.create_revision, route=route
            )
            for m in route.members:
                entry.status.append(by_member.get((m.zone, m.suffix), pb.ReplicaStatus()))
        return resp

    async def apply(self, req: pb.ShardApplyRequest, claims: Claims | None = None) -> pb.ShardApplyResponse:
        """Apply `req`'s changes in one etcd transaction, each within the token's selector (`claims`; None:
        the process's own): an upsert whose new or existing spec lies outside is refused (AuthError,
        PERMISSION_DENIED) before anything is written; a delete of a hidden shard answers as one of a
        missing shard (nothing to delete; a revision expected of it fails the transaction)."""
        root = self.config.root
        compares: list[Compare] = []
        ops: list[RequestOp] = []
        doomed = False  # a hidden shard's delete expected a revision: as for a missing one, the transaction fails
        for i, change in enumerate(req.changes):
            if change.HasField("upsert"):
                validate.shard_spec(change.upsert, f"changes[{i}].upsert")
                key = keys.item_key(root, change.upsert.id)
                kv, existing = await self._existing(key)
                for spec in (change.upsert, existing):  # (checked first: what follows may name the existing spec)
                    if spec is not None and _outside(claims, change.upsert.id, spec):
                        reason = f"not allowed to apply shard {change.upsert.id} (outside your token's selector)"
                        raise AuthError("PERMISSION_DENIED", reason)
                self._same_store(existing, change.upsert, f"changes[{i}].upsert")
                if change.expect_mod_revision < 0:  # (else the expectation below keeps the shard as read, or fails)
                    compares.append(mod_revision_is(key, kv.mod_revision if kv is not None else 0))
                ops.append(put_op(key, change.upsert.SerializeToString()))
            elif change.delete:
                validate.shard_id(change.delete, f"changes[{i}].delete")
                key = keys.item_key(root, change.delete)
                _kv, existing = await self._existing(key)
                if existing is not None and _outside(claims, change.delete, existing):
                    self.verifier.hid(f"shard {change.delete}", "SHARD_NOT_FOUND")
                    doomed = doomed or change.expect_mod_revision > 0  # (a missing shard's key has revision 0)
                    continue
                ops.extend(self.state.delete_ops(root, change.delete))
                ops.extend(await self._hints_of(existing, change.delete))
            else:
                raise ValidationError(f"changes[{i}]", "expected an upsert or a delete")
            if change.expect_mod_revision >= 0:
                compares.append(mod_revision_is(key, change.expect_mod_revision))
        ok, revision = (False, 0) if doomed else await self.etcd.txn(compares, ops)
        with contextlib.suppress(TimeoutError):  # (applied either way; our view catches up later)
            await self.keyspace.wait_for_revision(revision, timeout=10)
        if not ok:
            return pb.ShardApplyResponse(
                status=pb.ETCD_TRANSACTION_FAILED,
                header=self.header(),
                detail="a shard changed since it was read (its mod revision differs); read it again and retry",
            )
        return pb.ShardApplyResponse(status=pb.OK, header=self.header())

    async def _existing(self, key: str) -> tuple[KV | None, pb.ShardSpec | None]:
        """The shard at `key` as etcd holds it now (not the KeySpace's view, which may lag): its key and spec."""
        kv, _ = await self.etcd.get(key)
        return kv, pb.ShardSpec.FromString(kv.value) if kv is not None else None

    async def _hints_of(self, spec: pb.ShardSpec | None, shard_id: str) -> list[RequestOp]:
        """A deleted shard's hints go with it: a shard made again under its id starts from its own log
        (hints of the old one would name another log, or bring its state back). Every slot there is,
        also backups above a lowered hint_backups."""
        if spec is None or not spec.recovery_log_prefix:
            return []
        slots = hints.HintKeys(spec.hint_prefix or self.hint_prefix, shard_id, 0)
        found, _ = await self.etcd.get_prefix(f"{slots.prefix}/{shard_id}.")
        return [delete_op(k.key) for k in found if slots.is_slot(k.key)]

    @staticmethod
    def _same_store(was: pb.ShardSpec | None, spec: pb.ShardSpec, ctx: str) -> None:
        """Refuse an upsert that moves an existing shard's store (`was`: its spec) to another recovery log
        (or to or from none): the store would start from what the new place holds (nothing) and the shard
        would read its sources again from their start, publishing its outputs twice; or its hints
        elsewhere. Gazette migrates hints across logs; here, delete the shard and create it anew."""
        if was is not None:
            if was.recovery_log_prefix and was.hint_prefix != spec.hint_prefix:
                raise ValidationError(
                    f"{ctx}.hint_prefix",
                    f"shard {spec.id!r} keeps its recovery hints under {was.hint_prefix or '(the default)'!r}; "
                    "under another prefix a replica would find none and play its log from the start (which a "
                    "prune may have removed): keep it",
                )
            old = was.recovery_log_prefix
            if old != spec.recovery_log_prefix:
                where = f"recovery log prefix {old!r}" if old else "no recovery log"
                raise ValidationError(
                    f"{ctx}.recovery_log_prefix",
                    f"shard {spec.id!r} keeps its store in {where}; changing it to {spec.recovery_log_prefix!r} "
                    "would start the store empty and read the sources again from their start: keep it, or "
                    "delete the shard and create it anew on a new recovery log (its store then starts empty)",
                )

    async def unassign(self, req: pb.UnassignRequest, claims: Claims | None = None) -> pb.UnassignResponse:
        """Remove the shards' assignments (only FAILED ones with `only_failed`) in one etcd transaction; a
        shard missing, or outside the token's selector (`claims`), is SHARD_NOT_FOUND and nothing changes."""
        state = self.state
        compares: list[Compare] = []
        ops: list[RequestOp] = []
        done: list[str] = []
        for i, shard_id in enumerate(req.shards):
            validate.shard_id(shard_id, f"shards[{i}]")
            if self._visible(shard_id, claims) is None:
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

    async def get_hints(self, req: pb.GetHintsRequest, claims: Claims | None = None) -> pb.GetHintsResponse:
        """The shard's recovery hints as etcd holds them (every slot, unusable ones with the reason): from
        any process, as the keys depend only on the spec and this application's --root."""
        validate.shard_id(req.shard, "get_hints.shard")
        spec = self._visible(req.shard, claims)
        if spec is None:
            detail = f"no shard {req.shard!r}"
            return pb.GetHintsResponse(status=pb.SHARD_NOT_FOUND, header=self.header(), detail=detail)
        if not spec.recovery_log_prefix:
            return pb.GetHintsResponse(
                status=pb.NO_RECOVERY_LOG,
                header=self.header(),
                detail=f"shard {req.shard!r} has no recovery log (its recovery_log_prefix is empty), so no hints",
            )
        log_name = recovery_log(spec)
        keys = hints.HintKeys(spec.hint_prefix or self.hint_prefix, spec.id, spec.hint_backups)
        fetched = await hints.fetch(self.etcd, keys, log_name)

        def slot(key: str) -> pb.GetHintsResponse.ResponseHints:
            value, error = fetched.values[key], fetched.errors.get(key)
            return pb.GetHintsResponse.ResponseHints(hints=value, key=key, error=str(error) if error else "")

        return pb.GetHintsResponse(
            status=pb.OK,
            header=self.header(),
            log=log_name,
            primary_hints=slot(keys.primary),
            backup_hints=[slot(keys.backup(i)) for i in range(keys.backups)],
        )


def _outside(claims: Claims | None, shard_id: str, spec: pb.ShardSpec) -> bool:
    """Whether the shard `shard_id` with `spec` lies outside the token's selector (`claims`)."""
    return claims is not None and not covers(claims, labels.shard_labels(shard_id, spec.labels))


_Answer = TypeVar("_Answer", pb.ShardApplyResponse, pb.UnassignResponse, pb.GetHintsResponse)

# Each RPC's capability (Gazette's consumer/protocol/auth.go; docs/design/production.md §3.7), as ints.
_LIST, _APPLY, _READ = (int(c) for c in (Capability.LIST, Capability.APPLY, Capability.READ))


class _Servicer(pb_grpc.ShardServicer):
    """gRPC entry points; bad input becomes INVALID_ARGUMENT naming the field. Every RPC first checks its
    caller's token for the capability it needs (Gazette's VerifiedShardServer: each RPC's is here, and
    tests/auth walks the service's methods for one without), then serves with the token's claims."""

    def __init__(self, consumer: Consumer) -> None:
        self.consumer = consumer
        self.verifier = consumer.verifier

    async def Stat(self, request: pb.StatRequest, context: grpc.aio.ServicerContext) -> pb.StatResponse:
        claims = await self.verifier.verify(context, _READ, "Stat")
        with counted(metrics.RPC_STATUS, "stat", context) as outcome:
            remaining = context.time_remaining()  # (answer before it passes, with what was read through)
            deadline = None if remaining is None else time.monotonic() + max(0.0, remaining - STAT_MARGIN)
            if (left := seconds_left(claims)) is not None:  # (a wait for read-through ends with the token, too)
                deadline = min(deadline or math.inf, time.monotonic() + max(0.0, left))
            try:
                resp = await self.consumer.stat(request, deadline, claims)
            except ValidationError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            except NotReadThroughError as exc:
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
            outcome.append(resp.status)
            return resp

    async def List(self, request: pb.ShardListRequest, context: grpc.aio.ServicerContext) -> pb.ShardListResponse:
        claims = await self.verifier.verify(context, _LIST, "List")
        with counted(metrics.RPC_STATUS, "list", context) as outcome:
            try:
                validate.selector(request.selector)
            except ValidationError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            outcome.append(pb.OK)
            return self.consumer.list_response(request.selector, claims)

    async def Apply(self, request: pb.ShardApplyRequest, context: grpc.aio.ServicerContext) -> pb.ShardApplyResponse:
        claims = await self.verifier.verify(context, _APPLY, "Apply")
        return await self._answer("apply", context, self.consumer.apply(request, claims))

    async def Unassign(self, request: pb.UnassignRequest, context: grpc.aio.ServicerContext) -> pb.UnassignResponse:
        claims = await self.verifier.verify(context, _APPLY, "Unassign")
        return await self._answer("unassign", context, self.consumer.unassign(request, claims))

    async def GetHints(self, request: pb.GetHintsRequest, context: grpc.aio.ServicerContext) -> pb.GetHintsResponse:
        claims = await self.verifier.verify(context, _READ, "GetHints")
        return await self._answer("get_hints", context, self.consumer.get_hints(request, claims))

    async def _answer(self, rpc: str, context: grpc.aio.ServicerContext, call: Awaitable[_Answer]) -> _Answer:
        """An RPC that reads or changes etcd: bad input is INVALID_ARGUMENT, a change outside the token's
        selector PERMISSION_DENIED, an unreachable etcd UNAVAILABLE."""
        with counted(metrics.RPC_STATUS, rpc, context) as outcome:
            try:
                resp = await call
            except ValidationError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            except AuthError as exc:
                await self.verifier.refuse(context, exc)
            except TransportError as exc:
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"{rpc}: {exc}")
            outcome.append(resp.status)
            return resp
