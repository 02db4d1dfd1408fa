"""Broker: one `tidings broker` process's services, wired together.

Start order: etcd client -> KeySpace (load + watch) -> persister -> resolver -> gRPC server ->
member announcement (leased) -> allocator. `start()` returns once the server serves and the
member key is in etcd. Graceful stop (SIGTERM): mark the member exiting so the allocator moves
its journals away, wait for that (bounded), then stop serving, complete and persist spools,
and revoke the lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
from pathlib import Path

import grpc

from tidings.allocator import keys
from tidings.allocator.announce import Announcement, announce
from tidings.allocator.converge import Allocator
from tidings.broker import _metrics as metrics
from tidings.broker.append_api import serve_append
from tidings.broker.append_fsm import AppendFSM
from tidings.broker.read_api import serve_read
from tidings.broker.replica import Replica
from tidings.broker.replicate_api import serve_replicate
from tidings.broker.resolver import Resolver
from tidings.fragment.fragment import Fragment
from tidings.fragment.persister import Persister
from tidings.fragment.store import check_store_url, store_for
from tidings.keyspace import KeySpace
from tidings.keyspace.decode import decoder
from tidings.keyspace.etcd import Etcd, delete_op, mod_revision_is, put_op
from tidings.protocol import labels, validate
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol import protocol_pb2_grpc as pb_grpc
from tidings.protocol.status import ValidationError

log = logging.getLogger(__name__)

MAX_MESSAGE = 64 * 1024 * 1024
GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE),
    ("grpc.max_send_message_length", MAX_MESSAGE),
    ("grpc.so_reuseport", 0),
]


@dataclasses.dataclass
class BrokerConfig:
    """Flags of `tidings broker`, one for one with TIDINGS_* environment variables."""

    etcd: str
    zone: str = "local"
    suffix: str = "broker-0"
    listen: str = "127.0.0.1:0"
    data_dir: Path = Path("data")
    root: str = "/tidings/cluster"
    journal_limit: int = 1024
    stall_timeout: float = 10.0  # a client silent this long is cut off
    min_append_rate: int = 16 * 1024  # bytes/s a client must average after stall_timeout
    pulse_interval: float = 2.0
    lease_ttl: int = 5
    metrics_listen: str | None = None  # "127.0.0.1:PORT" serves /metrics
    exit_timeout: float = 60.0


class Broker:
    """A journal broker (Gazette's broker), serving the Journal gRPC service."""

    def __init__(self, config: BrokerConfig) -> None:
        self.config = config
        self.process_id = pb.ProcessId(zone=config.zone, suffix=config.suffix)
        self.endpoint = ""
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self.stopped = asyncio.Event()
        self._metrics_server = None

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> Broker:
        cfg = self.config
        validate.process_id(self.process_id, "broker")
        self.etcd = await Etcd.connect(cfg.etcd)
        self.keyspace = KeySpace(cfg.root, decoder(cfg.root))
        await self.keyspace.start(self.etcd)
        self.persister = Persister(self._on_persisted)
        await self.persister.start()
        self.resolver = Resolver(self.keyspace, self.process_id, Path(cfg.data_dir), self.persister, self._pulse)
        self.server = grpc.aio.server(options=GRPC_OPTIONS)
        pb_grpc.add_JournalServicer_to_server(_Servicer(self), self.server)
        host = cfg.listen.rsplit(":", 1)[0]
        port = self.server.add_insecure_port(cfg.listen)
        if port == 0:
            raise OSError(f"cannot listen on {cfg.listen}")
        self.endpoint = f"{host}:{port}"
        await self.server.start()
        spec = pb.BrokerSpec(id=self.process_id, endpoint=self.endpoint, journal_limit=cfg.journal_limit)
        self.announcement: Announcement = await announce(self.etcd, cfg.root, spec, ttl=cfg.lease_ttl)
        self.allocator = Allocator(self.etcd, self.keyspace, cfg.root, (cfg.zone, cfg.suffix))
        self._tasks.append(asyncio.create_task(self.allocator.run(), name=f"allocator:{cfg.suffix}"))
        if cfg.metrics_listen:
            from prometheus_client import start_http_server

            mhost, mport = cfg.metrics_listen.rsplit(":", 1)
            self._metrics_server, _thread = start_http_server(int(mport), addr=mhost)
        log.info("broker %s/%s serving on %s", cfg.zone, cfg.suffix, self.endpoint)
        return self

    async def stop(self, graceful: bool = True) -> None:
        """Graceful: hand journals off first. Either way: stop serving and release everything."""
        cfg = self.config
        log.info("broker %s/%s stopping (graceful=%s)", cfg.zone, cfg.suffix, graceful)
        if graceful:
            spec = pb.BrokerSpec(id=self.process_id, endpoint=self.endpoint, journal_limit=0, exiting=True)
            with contextlib.suppress(Exception):
                await self.announcement.update(spec)
                await self._wait_no_assignments(cfg.exit_timeout)
        log.info("broker %s/%s: journals handed off; stopping the server", cfg.zone, cfg.suffix)
        for task in self._tasks:
            task.cancel()
        with contextlib.suppress(Exception):
            await self.allocator.aclose()
        # Stop serving first: cancelled Replicate streams give their spools back.
        await self.server.stop(grace=1.0 if graceful else 0)
        await self.resolver.aclose()
        if graceful:
            with contextlib.suppress(Exception):
                await self.persister.drain(timeout=30)
        await self.persister.aclose()
        with contextlib.suppress(Exception):
            await self.announcement.aclose()
        await self.keyspace.aclose()
        for ch in self._channels.values():
            await ch.close()
        await self.etcd.aclose()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
        self.stopped.set()
        log.info("broker %s/%s stopped", cfg.zone, cfg.suffix)

    async def _wait_no_assignments(self, timeout: float) -> None:
        """Wait until our journals have moved away, or until no other member could take them
        (the whole cluster is stopping): then there is nothing to wait for."""
        me = (self.config.zone, self.config.suffix)
        async with asyncio.timeout(timeout):
            while True:
                state = self.resolver.state
                others = [
                    m for mid, m in state.members.items() if mid != me and not m.spec.exiting and m.spec.journal_limit
                ]
                if not state.assignments_of(*me) or not others:
                    return
                await self.keyspace.wait_for_update(self.keyspace.revision)

    # -- shared services -------------------------------------------------------------------

    def channel(self, endpoint: str) -> grpc.aio.Channel:
        ch = self._channels.get(endpoint)
        if ch is None:
            ch = self._channels[endpoint] = grpc.aio.insecure_channel(endpoint, options=GRPC_OPTIONS)
        return ch

    def channels_for(self, route: pb.Route) -> dict[str, grpc.aio.Channel]:
        return {ep: self.channel(ep) for ep in route.endpoints if ep and ep != self.endpoint}

    def _on_persisted(self, fragment: Fragment, path: str) -> None:
        replica = self.resolver.replicas.get(fragment.journal)
        if replica is not None:
            replica.fragment_persisted(fragment, path)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    async def _pulse(self, replica: Replica) -> None:
        """Keep the pipeline synchronized and consistency advertised when no client appends.

        The pulse is a zero-byte append through the same AppendFSM; it also runs at once when
        the route changes. When this broker is no longer primary its pipeline is torn down so
        the new primary can take the spool.
        """
        while not replica.closed.is_set():
            changed = replica.route_changed
            try:
                async with asyncio.timeout(max(5.0, self.config.pulse_interval * 3)):
                    await self._pulse_once(replica)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.debug("journal %s: pulse: %s", replica.journal, exc)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.pulse_interval):
                    await changed.wait()

    async def _pulse_once(self, replica: Replica) -> None:
        res = await self.resolver.resolve(replica.journal)
        if res.status != pb.OK or res.replica is not replica:
            return
        if not res.is_primary:
            await _tear_down_pipeline(replica)
            return
        messages = iter([pb.AppendRequest(), None])

        async def next_message() -> pb.AppendRequest | None:
            return next(messages)

        fsm = AppendFSM(self, pb.AppendRequest(journal=replica.journal, do_not_proxy=True))
        await fsm.run(next_message)
        if fsm.error:
            log.debug("journal %s: pulse ended in %s: %s", replica.journal, fsm.state, fsm.error)

    # -- List / Apply / ListFragments -------------------------------------------------------

    def list_response(self, selector: pb.LabelSelector) -> pb.ListResponse:
        state = self.resolver.state
        resp = pb.ListResponse(status=pb.OK, header=self.resolver.header(pb.Route(primary=-1)))
        for name in sorted(state.items):
            item = state.items[name]
            spec_labels = labels.union(item.spec.labels, labels.label_set({"name": name}))
            if not labels.matches(selector, spec_labels):
                continue
            resp.journals.append(
                pb.ListResponse.Journal(
                    spec=item.spec,
                    mod_revision=item.mod_revision,
                    create_revision=item.create_revision,
                    route=state.route(name),
                )
            )
        return resp

    async def apply(self, req: pb.ApplyRequest) -> pb.ApplyResponse:
        root = self.config.root
        compares, ops = [], []
        for i, change in enumerate(req.changes):
            if change.HasField("upsert"):
                validate.journal_spec(change.upsert, f"changes[{i}].upsert")
                for j, url in enumerate(change.upsert.fragment.stores):  # a first import of a backend may be slow
                    await asyncio.to_thread(check_store_url, url, f"changes[{i}].upsert.fragment.stores[{j}]")
                key = keys.item_key(root, change.upsert.name)
                ops.append(put_op(key, change.upsert.SerializeToString()))
            elif change.delete:
                validate.journal_name(change.delete, f"changes[{i}].delete")
                key = keys.item_key(root, change.delete)
                ops.append(delete_op(key))
                for a in self.resolver.state.assignments.get(change.delete, []):
                    ops.append(delete_op(a.key))
            else:
                raise ValidationError(f"changes[{i}]", "expected an upsert or a delete")
            compares.append(mod_revision_is(key, change.expect_mod_revision))
        ok, revision = await self.etcd.txn(compares, ops)
        await self.keyspace.wait_for_revision(revision, timeout=10)
        status = pb.OK if ok else pb.ETCD_TRANSACTION_FAILED
        return pb.ApplyResponse(status=status, header=self.resolver.header(pb.Route(primary=-1)))

    async def list_fragments(self, req: pb.FragmentsRequest) -> pb.FragmentsResponse:
        validate.journal_name(req.journal, "fragments.journal")
        res = await self.resolver.resolve(req.journal, req.header.etcd.revision if req.HasField("header") else 0)
        if res.status != pb.OK:
            return pb.FragmentsResponse(status=res.status, header=res.header)
        if res.replica is None:
            if req.do_not_proxy or not res.route.members:
                return pb.FragmentsResponse(status=pb.NOT_JOURNAL_BROKER, header=res.header)
            fwd = pb.FragmentsRequest(header=res.header, journal=req.journal, do_not_proxy=True)
            return await pb_grpc.JournalStub(self.channel(res.route.endpoints[0])).ListFragments(fwd)
        await res.replica.index.wait_first_refresh()
        resp = pb.FragmentsResponse(status=pb.OK, header=res.header)
        for frag, _path in res.replica.index.fragments():
            url = store_for(frag.backing_store).url(frag) if frag.backing_store else ""
            resp.fragments.append(pb.FragmentsResponse.Entry(spec=frag.to_proto(), url=url))
        return resp


async def _tear_down_pipeline(replica: Replica) -> None:
    pipeline = await replica.pipeline_slot.get()
    try:
        if pipeline is not None:
            replica.spool_slot.put_nowait(await pipeline.close())
    finally:
        replica.pipeline_slot.put_nowait(None)


class _Servicer(pb_grpc.JournalServicer):
    """gRPC entry points; bad input becomes INVALID_ARGUMENT naming the field, never a crash."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker

    async def Append(self, request_iterator, context):
        return await serve_append(self.broker, context)

    async def Replicate(self, request_iterator, context):
        await serve_replicate(self.broker, context)

    async def Read(self, request, context):
        await serve_read(self.broker, request, context)

    async def List(self, request, context):
        try:
            validate.selector(request.selector)
        except ValidationError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        broker = self.broker
        while True:
            revision = broker.keyspace.revision
            await context.write(broker.list_response(request.selector))
            if not request.watch:
                return
            await broker.keyspace.wait_for_update(revision)

    async def Apply(self, request, context):
        try:
            resp = await self.broker.apply(request)
        except ValidationError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        metrics.RPC_STATUS.labels("apply", pb.Status.Name(resp.status)).inc()
        return resp

    async def ListFragments(self, request, context):
        try:
            return await self.broker.list_fragments(request)
        except ValidationError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
