"""Broker: one `tidings broker` process's services, wired together: a member process
(`tidings.member`: etcd, KeySpace, gRPC server, /metrics, leased announcement, allocator, hand-off)
whose items are journals.

Its own steps: before it serves, the persister and the spools recovered from --data-dir, then the
resolver (journal -> Replica); beside the gRPC server, the replication transport's listener (the
peers' pipelines) and its dialer; once announced, the gauges, the retention loop and the checks of
recovered journals assigned elsewhere. At a stop, after the hand-off: stop serving (cancelled
replication streams give their spools back), close the replicas, complete and persist the spools,
and record where each journal held to the end resumes (its spec's suspend offset), so that its next
primary, on whichever broker, appends after it instead of refusing to guess.

With `--auth-keys` every RPC of the Journal service first checks its caller's token for the capability it
needs (`_Servicer`: LIST, APPLY, READ, APPEND) and goes on with the token's claims, which hide the
journals outside their selector; the broker signs its own calls to its peers with its first key.

etcd outages shorter than the lease do not stop a broker: it keeps serving the routes it has
while the keep-alive and the KeySpace watch retry; it stops (without hand-off) only once its
lease is really lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import cast

import grpc

from tidings import tls
from tidings.allocator import keys
from tidings.allocator.handoff import ETCD_STOP_TIMEOUT
from tidings.allocator.kind import JOURNALS
from tidings.allocator.state import State
from tidings.auth import Authorizer, KeyedAuthorizer, NoAuthorizer, NoVerifier, Verifier
from tidings.broker import _metrics as metrics
from tidings.broker import transport_tls
from tidings.broker.append_api import serve_append
from tidings.broker.fragments_api import serve_list_fragments
from tidings.broker.host import BrokerConfig
from tidings.broker.list_apply_api import serve_apply, serve_list, serve_list_members
from tidings.broker.pulse import pulse
from tidings.broker.read_api import serve_read
from tidings.broker.recovery import RecoveryChecks, verify_unassigned
from tidings.broker.replica import Replica, spool_directory
from tidings.broker.replicate_api import serve_replicate
from tidings.broker.resolver import Resolver, same_process
from tidings.broker.transport import Dialer, FailedStream, ReplicaStream, ReplicationServer
from tidings.fragment.fragment import Fragment
from tidings.fragment.persister import Persister
from tidings.fragment.spool import Recovered, SpoolFile, recover
from tidings.keyspace.etcd import mod_revision_is, put_op
from tidings.member import MemberProcess, counted
from tidings.member.serving import host_of
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol import protocol_pb2_grpc as pb_grpc
from tidings.protocol.claims import Capability
from tidings.protocol.status import TidingsError, UsageError

log = logging.getLogger(__name__)

MAX_MESSAGE = 64 * 1024 * 1024
GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE),
    ("grpc.max_send_message_length", MAX_MESSAGE),
    ("grpc.so_reuseport", 0),
]
# Broker-to-broker channels notice a dead or frozen peer (a half-open connection) by keepalive
# pings: without them a pipeline waiting for its acknowledgements would wait forever.
PEER_CHANNEL_OPTIONS = [
    *GRPC_OPTIONS,
    ("grpc.keepalive_time_ms", 5_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
SERVER_OPTIONS = [
    *GRPC_OPTIONS,
    ("grpc.http2.min_ping_interval_without_data_ms", 1_000),
    ("grpc.http2.max_ping_strikes", 0),
]
CLOSE_TIMEOUT = 5.0  # seconds for the replicas to close while stopping (they take milliseconds, unless stuck)


class Broker(MemberProcess):
    """A journal broker (Gazette's broker), serving the Journal gRPC service: a member process whose
    items are journals (`tidings.member`), with its spools, replication and fragment persistence."""

    kind = JOURNALS
    server_options = SERVER_OPTIONS

    def __init__(self, config: BrokerConfig) -> None:
        super().__init__(config)
        self.config: BrokerConfig = config
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._unassigned: dict[str, asyncio.Task[None]] = {}  # checks of journals recovered but not assigned here
        self.recovery = RecoveryChecks(self)
        self.replication_endpoint = ""  # announced for peers (_serve_more)
        keys = config.auth_keys
        self.verifier: Verifier | NoVerifier = Verifier(keys, service="journal") if keys else NoVerifier()
        self.authorizer: Authorizer = KeyedAuthorizer(keys, sub=self.who) if keys else NoAuthorizer()

    # -- the member process's steps (tidings.member.process) -----------------------------------

    async def _prepare(self, undo: contextlib.AsyncExitStack) -> None:
        cfg = self.config
        self.persister = Persister(self._on_persisted)
        await self.persister.start()
        undo.push_async_callback(self.persister.aclose)
        revisions = {j: it.create_revision for j, it in State.from_keyspace(self.keyspace).items.items()}
        self._recovered = await asyncio.to_thread(_recover_all, Path(cfg.data_dir), revisions)
        self.resolver = Resolver(
            self.keyspace, self.process_id, self._new_replica, functools.partial(pulse, self), self._hid
        )
        undo.push_async_callback(self.resolver.aclose)

    def _hid(self, journal: str) -> None:
        self.verifier.hid(f"journal {journal}", "JOURNAL_NOT_FOUND")

    def _add_servicer(self, server: grpc.aio.Server) -> None:
        pb_grpc.add_JournalServicer_to_server(_Servicer(self), server)  # type: ignore[no-untyped-call]  # generated gRPC code, untyped

    async def _serve_more(self, undo: contextlib.AsyncExitStack, host: str) -> None:
        cfg = self.config
        self.dialer = Dialer(cfg.tls, self.authorizer)
        undo.push_async_callback(self.dialer.aclose)
        self.replication = ReplicationServer(
            functools.partial(serve_replicate, self),
            f"{cfg.zone}/{cfg.suffix}",
            tls=cfg.tls,
            verifier=self.verifier if isinstance(self.verifier, Verifier) else None,
            servicer=_Servicer(self),  # (clients' calls on the same port: transport_rpc.py)
        )
        listen = cfg.replication_listen or f"{host}:0"
        try:
            await self.replication.start(listen)
        except (OSError, ValueError) as err:
            raise UsageError(
                f"{self.who} cannot listen for replication on {listen} ({err}); pass another --replication-listen"
            ) from None
        undo.push_async_callback(self.replication.aclose)
        self.replication_endpoint = self.announced(
            self.replication.endpoint, not cfg.replication_listen, cfg.replication_advertise, "--replication-advertise"
        )
        if (
            cfg.tls is not None
            and cfg.tls.ca is not None
            and host_of(self.replication_endpoint) != host_of(self.endpoint)
        ):
            # (a name of its own: peers verify the certificate for it, so check it as the gRPC one was)
            await asyncio.to_thread(
                tls.check_own, self.replication_endpoint, cfg.tls, self.who, alpn=transport_tls.ALPN
            )

    def _member_spec(self) -> pb.BrokerSpec:
        return pb.BrokerSpec(
            id=self.process_id,
            endpoint=self.endpoint,
            journal_limit=self.config.journal_limit,
            replication_endpoint=self.replication_endpoint,
            metrics_endpoint=("https://" if self.metrics_scheme == "https" and self.metrics_endpoint else "")
            + self.metrics_endpoint,
        )

    def _exiting_spec(self) -> pb.BrokerSpec:
        spec = pb.BrokerSpec()
        mine = cast(pb.BrokerSpec, self.spec)  # (this process's: _member_spec's)
        spec.CopyFrom(mine)  # still replicating while its journals move: keep every endpoint
        spec.journal_limit, spec.exiting = 0, True
        return spec

    def _state(self) -> State:
        return self.resolver.state

    def _started(self) -> None:
        cfg = self.config
        self._tasks.append(asyncio.create_task(self._gauge_loop(), name=f"gauges:{cfg.suffix}"))
        if cfg.prune_interval > 0:
            self._tasks.append(asyncio.create_task(self._prune_loop(), name=f"retention:{cfg.suffix}"))
        self._verify_unassigned()

    async def _release(self, graceful: bool) -> None:
        """Stop serving first (cancelled replication streams give their spools back), close the
        replicas, and (graceful) persist what they held and record where each journal resumes."""
        for task in self._unassigned.values():
            task.cancel()
        held = list(self.resolver.replicas.values())  # journals we could not hand off
        grace = 1.0 if graceful else 0
        await asyncio.gather(self.server.stop(grace=grace), self.replication.drain_calls(grace))
        await self.replication.aclose()
        try:
            async with asyncio.timeout(CLOSE_TIMEOUT):
                await self.resolver.aclose()
        except TimeoutError:
            log.warning("%s: its replicas did not close within %.0fs; stopping anyway", self.who, CLOSE_TIMEOUT)
        if graceful:
            drained = False
            with contextlib.suppress(Exception):
                drained = await self.persister.drain(timeout=30)
            if drained and not self.announcement.lost.is_set():
                await self._record_resume_offsets(held)
        await self.persister.aclose()

    async def _close_clients(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        await self.dialer.aclose()

    async def _record_resume_offsets(self, held: list[Replica]) -> None:
        """For each journal we still held, with every byte persisted: record its end in its spec
        (Gazette's suspend offset), so its next primary, on whichever broker, resumes there instead
        of refusing with INDEX_HAS_GREATER_OFFSET. Only ever raised; guarded by the spec's revision."""
        for replica in held:
            end = replica.end_at_close
            if not end or not replica.stores:
                continue
            key = keys.item_key(self.config.root, replica.journal)
            for _attempt in range(3):
                item = self.keyspace.get(key)  # the resolver stopped following the KeySpace
                if item is None or item.decoded.suspend.offset >= end:
                    break
                spec = pb.JournalSpec()
                spec.CopyFrom(item.decoded)
                spec.suspend.offset = end
                try:
                    ok, revision = await self.etcd.txn(
                        [mod_revision_is(key, item.mod_revision)],
                        [put_op(key, spec.SerializeToString())],
                        timeout=ETCD_STOP_TIMEOUT,
                    )
                    await self.keyspace.wait_for_revision(revision, timeout=ETCD_STOP_TIMEOUT)
                except (TidingsError, TimeoutError) as err:
                    log.warning("journal %s: could not record its resume offset %d: %s", replica.journal, end, err)
                    break
                if ok:
                    log.info("journal %s: appends resume at offset %d on its next primary", replica.journal, end)
                    break

    def channel(self, endpoint: str) -> grpc.aio.Channel:
        ch = self._channels.get(endpoint)
        if ch is None:
            ch = self._channels[endpoint] = tls.channel(endpoint, self.config.tls, PEER_CHANNEL_OPTIONS)
        return ch

    def open_streams(self, route: pb.Route) -> list[ReplicaStream]:
        """A replication stream to every peer of `route` (every member but the primary: us), at the
        replication endpoint its member spec announces."""
        streams: list[ReplicaStream] = []
        for i, member in enumerate(route.members):
            if i == route.primary:
                continue
            kv = self.keyspace.get(keys.member_key(self.config.root, member.zone, member.suffix))
            endpoint = kv.decoded.replication_endpoint if kv is not None else ""
            if not endpoint:
                why = "the peer announces no replication endpoint"
                streams.append(FailedStream(f"{member.zone}/{member.suffix}", why))
            else:
                streams.append(self.dialer.open(endpoint, f"{member.zone}/{member.suffix}"))
        return streams

    def _new_replica(self, journal: str, spec: pb.JournalSpec, revision: int) -> Replica:
        cfg = self.config
        recovered = self._recovered.pop(journal, None)
        unassigned = self._unassigned.pop(journal, None)
        if unassigned is not None:
            unassigned.cancel()  # the replica recovers the directory itself (after it, nothing is dropped)
        return Replica(
            journal,
            spec,
            Path(cfg.data_dir),
            self.persister,
            default_store=cfg.default_store,
            persist_delay=cfg.persist_delay,
            recovered=recovered if recovered is not None and recovered.journal_revision == revision else None,
            journal_revision=revision,
            recovery=self.recovery,
        )

    def _verify_unassigned(self) -> None:
        """Check, then persist, what a previous process left on disk for journals this broker does not
        replicate now (`recovery.verify_unassigned`; a replica created later recovers and checks the
        directory itself)."""
        for journal in list(self._recovered):
            rec = self._recovered.pop(journal)
            if rec.fragments:
                task = asyncio.create_task(
                    verify_unassigned(self, journal, rec.fragments), name=f"verify-unassigned:{journal}"
                )
                task.add_done_callback(functools.partial(self._unassigned_done, journal))
                self._unassigned[journal] = task

    def _unassigned_done(self, journal: str, task: asyncio.Task[None]) -> None:
        if self._unassigned.get(journal) is task:
            del self._unassigned[journal]
        if not task.cancelled() and task.exception() is not None:
            log.error("journal %s: checking recovered fragments failed", journal, exc_info=task.exception())

    def _on_persisted(self, fragment: Fragment, file: SpoolFile | str) -> None:
        replica = self.resolver.replicas.get(fragment.journal)
        if replica is not None:
            replica.fragment_persisted(fragment, file)
        elif isinstance(file, SpoolFile):
            file.mark_persisted(fragment.end)

    async def _gauge_loop(self) -> None:
        """Set this broker's share of the gauges every GAUGE_INTERVAL (and take it back when stopped)."""
        gauges = (metrics.JOURNALS, metrics.PRIMARIES, metrics.PERSIST_QUEUE, metrics.STORES_UNHEALTHY)
        shown = [0] * len(gauges)
        try:
            while True:
                replicas = list(self.resolver.replicas.values())
                state, me = self.resolver.state, self.process_id
                led = 0
                for r in replicas:
                    route = state.route(r.journal)
                    if route.primary >= 0 and same_process(route.members[route.primary], me):
                        led += 1
                now = [
                    len(replicas),
                    led,
                    self.persister.statistics().queued,
                    sum(r.store_error is not None for r in replicas),
                ]
                for i, gauge in enumerate(gauges):
                    gauge.inc(now[i] - shown[i])
                shown = now
                await asyncio.sleep(metrics.GAUGE_INTERVAL)  # (a schedule, not a wait for a condition)
        finally:
            for i, gauge in enumerate(gauges):
                gauge.dec(shown[i])

    async def _prune_loop(self) -> None:
        """Enforce retention (Gazette leaves it to a cron job running `gazctl journals prune`): every
        `prune_interval`, the primary of each journal with a retention removes its aged fragments."""
        while True:
            await asyncio.sleep(self.config.prune_interval)  # (a schedule, not a wait for a condition)
            for replica in list(self.resolver.replicas.values()):
                if replica.spec.fragment.retention_ms <= 0 or replica.closed.is_set():
                    continue
                res = await self.resolver.resolve(replica.journal)
                if res.status != pb.OK or res.replica is not replica or not res.is_primary:
                    continue
                try:
                    await replica.prune()
                except Exception as exc:  # a store outage: the next pass tries again
                    log.warning("journal %s: enforcing retention failed: %s", replica.journal, exc)


def _recover_all(data_dir: Path, revisions: dict[str, int]) -> dict[str, Recovered]:
    """Every journal's spool directory under `data_dir`, recovered (blocking: run in a thread).

    `revisions` holds the create revision of every journal etcd knows; the folders of journals it
    does not (deleted meanwhile) are removed.
    """
    out: dict[str, Recovered] = {}
    root = data_dir / "spools"
    if not root.is_dir():
        return out
    for folder in sorted(root.iterdir()):
        if not folder.is_dir():
            continue
        journal = folder.name.replace("%2F", "/")
        assert spool_directory(data_dir, journal) == folder
        if journal not in revisions:
            log.info("journal %s no longer exists; removing its spool files", journal)
            shutil.rmtree(folder, ignore_errors=True)
            continue
        out[journal] = recover(journal, folder, revisions[journal])
    return out


# Each RPC's capability (docs/design/production.md §3.7), as ints: an IntFlag member costs 0.2 µs a lookup.
_LIST, _APPLY, _READ, _APPEND = (
    int(c) for c in (Capability.LIST, Capability.APPLY, Capability.READ, Capability.APPEND)
)


class _Servicer(pb_grpc.JournalServicer):
    """gRPC entry points; bad input becomes INVALID_ARGUMENT naming the field, never a crash. Every RPC
    first checks its caller's token for the capability it needs (Gazette's VerifiedJournalServer: each
    RPC's is here, and tests/auth walks the service's methods for one without), then serves with the
    token's claims. Every RPC is counted by its outcome (tidings_rpc_status_total; Append counts its own)."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.verifier = broker.verifier

    async def Append(
        self, request_iterator: AsyncIterator[pb.AppendRequest], context: grpc.aio.ServicerContext
    ) -> pb.AppendResponse:
        claims = await self.verifier.verify(context, _APPEND, "Append")
        return await serve_append(self.broker, context, claims)

    async def Read(self, request: pb.ReadRequest, context: grpc.aio.ServicerContext) -> None:
        claims = await self.verifier.verify(context, _READ, "Read")
        with counted(metrics.RPC_STATUS, "read", context) as outcome:
            outcome.append(await serve_read(self.broker, request, context, claims))

    async def List(self, request: pb.ListRequest, context: grpc.aio.ServicerContext) -> None:
        claims = await self.verifier.verify(context, _LIST, "List")
        await serve_list(self.broker, request, context, claims)

    async def Apply(self, request: pb.ApplyRequest, context: grpc.aio.ServicerContext) -> pb.ApplyResponse:
        claims = await self.verifier.verify(context, _APPLY, "Apply")
        return await serve_apply(self.broker, request, context, claims)

    async def ListMembers(self, request: pb.MembersRequest, context: grpc.aio.ServicerContext) -> pb.MembersResponse:
        claims = await self.verifier.verify(context, _LIST, "ListMembers")
        return await serve_list_members(self.broker, request, context, claims)

    async def ListFragments(
        self, request: pb.FragmentsRequest, context: grpc.aio.ServicerContext
    ) -> pb.FragmentsResponse:
        claims = await self.verifier.verify(context, _READ, "ListFragments")
        return await serve_list_fragments(self.broker, request, context, claims)
