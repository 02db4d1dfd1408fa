"""MemberProcess: the life of a member of an allocator's cluster, one process (a broker, whose items
are journals; a consumer process, whose items are shards: `allocator.kind`).

Start: etcd client -> KeySpace of the member's root (loaded, then watched) -> what the member needs
before it serves (`_prepare`) -> gRPC server on --listen -> what serves beside it (`_serve_more`) ->
/metrics -> member announcement (leased; it waits while a previous process's key of the same id is
alive) -> Allocator -> the member's own loops (`_started`). `start()` returns once the server
serves and the member key is in etcd; if any step fails (or start is cancelled) the steps already
taken are undone, so nothing is left running.

Graceful stop (SIGTERM): mark the member exiting (its item limit 0) so the allocator moves its
items away, and wait for that (at most `exit_timeout`; the wait ends as soon as no other member
could take them, the lease is lost or etcd stops answering); then, graceful or not, cancel the
member's loops and the allocator, let the member release its items and stop serving (`_release`),
revoke the lease (the member key goes at once), and close the KeySpace, the member's clients
(`_close_clients`), etcd and /metrics. Every etcd step of a stop is bounded by ETCD_STOP_TIMEOUT,
so a member whose etcd is gone still exits within seconds; its key then goes with its lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, ClassVar, Protocol

import grpc

from tidings.allocator.announce import Announcement, announce
from tidings.allocator.converge import Allocator
from tidings.allocator.handoff import ETCD_STOP_TIMEOUT, wait_handed_off
from tidings.allocator.kind import Kind
from tidings.allocator.state import State
from tidings.keyspace import KeySpace
from tidings.keyspace.decode import decoder
from tidings.keyspace.etcd import Etcd
from tidings.member.serving import (
    WILDCARDS,
    advertised,
    host_of,
    listen_grpc,
    metrics_tls,
    serve_metrics,
    stop_metrics,
)
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol import validate
from tidings.protocol.status import TidingsError
from tidings.tls import TLS, check_own

__all__ = ["MemberConfig", "MemberProcess"]

log = logging.getLogger(__name__)


class MemberConfig(Protocol):
    """The flags every member process has (BrokerConfig and ConsumerConfig have more)."""

    etcd: str
    zone: str
    suffix: str
    listen: str
    advertise: str
    root: str
    lease_ttl: int
    metrics_listen: str | None
    metrics_advertise: str
    metrics_tls: bool
    exit_timeout: float
    tls: TLS | None
    etcd_tls: TLS | None
    etcd_user: str
    etcd_password: str


class MemberProcess:
    """One member process (see the module docstring). A subclass names its `kind`, serves its gRPC
    service (`_add_servicer`), describes itself (`_member_spec`, `_exiting_spec`) and fills the
    hooks it needs."""

    kind: ClassVar[Kind]
    server_options: ClassVar[list[tuple[str, Any]]] = []

    def __init__(self, config: MemberConfig) -> None:
        self.config = config
        self.process_id = pb.ProcessId(zone=config.zone, suffix=config.suffix)
        self.endpoint = self.metrics_endpoint = ""
        self.metrics_scheme = "https" if config.metrics_tls else "http"  # (how /metrics is scraped)
        self._tasks: list[asyncio.Task[None]] = []
        self._metrics_server: Any = None
        self.stopping = False  # handed off (or not to be): from here on it follows no more assignments
        self.stopped = asyncio.Event()

    @property
    def who(self) -> str:
        return f"{self.kind.member} {self.config.zone}/{self.config.suffix}"

    # -- what a member is ------------------------------------------------------------------

    def _add_servicer(self, server: grpc.aio.Server) -> None:
        raise NotImplementedError

    def _member_spec(self) -> pb.BrokerSpec | pb.ConsumerSpec:
        raise NotImplementedError

    def _exiting_spec(self) -> pb.BrokerSpec | pb.ConsumerSpec:
        """Its spec once it is leaving: exiting, taking no item."""
        raise NotImplementedError

    # -- hooks (each does nothing unless a member needs it) -----------------------------------

    def _state(self) -> State:
        """The allocator's view of its items and members, as the member follows it."""
        return State.from_keyspace(self.keyspace, self.kind)

    async def _prepare(self, undo: contextlib.AsyncExitStack) -> None:
        """Before the gRPC server serves (with `undo` for what must be undone should start fail)."""

    async def _serve_more(self, undo: contextlib.AsyncExitStack, host: str) -> None:
        """Once the gRPC server serves on `host`, before the announcement: other listeners."""

    def _started(self) -> None:
        """Once announced and allocating: the member's own loops (into `self._tasks`)."""

    async def _release(self, graceful: bool) -> None:
        """At a stop, after its loops and the allocator are cancelled: release its items and stop
        serving (`self.server`)."""
        await self.server.stop(grace=1.0 if graceful else 0)

    async def _close_clients(self) -> None:
        """At a stop, once the KeySpace is closed: the clients it opened."""

    # -- lifecycle ---------------------------------------------------------------------------

    def announced(self, bound: str, derived: bool, advertise: str = "", flag: str = "") -> str:
        """The endpoint to announce for another listener of this process bound at `bound`: its own
        `advertise` flag's (HOST[:PORT], e.g. a port mapped by a container or a load balancer) if given;
        else on the advertised host (with its own port) when `bound` is a wildcard, or when it was
        `derived` from --listen and --advertise is given; else `bound` (an address its flag named)."""
        if advertise:
            return advertised(bound, advertise, self.who, flag)
        if host_of(bound) in WILDCARDS or (derived and self.config.advertise):
            return f"{host_of(self.endpoint)}:{bound.rpartition(':')[2]}"
        return bound

    async def start(self) -> MemberProcess:
        cfg = self.config
        validate.process_id(self.process_id, self.kind.member)
        async with contextlib.AsyncExitStack() as undo:  # undoes the steps taken if a later one fails
            self.etcd = await Etcd.connect(cfg.etcd, tls=cfg.etcd_tls, user=cfg.etcd_user, password=cfg.etcd_password)
            undo.push_async_callback(self.etcd.aclose)
            self.keyspace = KeySpace(cfg.root, decoder(cfg.root, self.kind))
            await self.keyspace.start(self.etcd)
            undo.push_async_callback(self.keyspace.aclose)
            await self._prepare(undo)
            self.server = grpc.aio.server(options=self.server_options)
            self._add_servicer(self.server)
            bound = listen_grpc(self.server, cfg.listen, self.who, cfg.tls)
            self.endpoint = advertised(bound, cfg.advertise, self.who)
            host, port = bound.rsplit(":", 1)
            await self.server.start()
            undo.push_async_callback(self.server.stop, 0)
            if cfg.tls is not None and cfg.tls.ca is not None:  # (before it is announced: nobody dials a bad one)
                await asyncio.to_thread(check_own, self.endpoint, cfg.tls, self.who)
            await self._serve_more(undo, host)
            if cfg.metrics_listen:
                served = serve_metrics(
                    cfg.metrics_listen, host, int(port), self.who, metrics_tls(cfg.metrics_tls, cfg.tls, self.who)
                )
                self._metrics_server, self.metrics_endpoint = (
                    served[0],
                    self.announced(
                        served[1], cfg.metrics_listen == "auto", cfg.metrics_advertise, "--metrics-advertise"
                    ),
                )
                undo.callback(stop_metrics, self._metrics_server)
            self.spec = self._member_spec()
            self.announcement: Announcement = await announce(self.etcd, cfg.root, self.spec, ttl=cfg.lease_ttl)
            undo.push_async_callback(self.announcement.aclose, ETCD_STOP_TIMEOUT)
            self.allocator = Allocator(self.etcd, self.keyspace, cfg.root, (cfg.zone, cfg.suffix), self.kind)
            self._tasks.append(asyncio.create_task(self.allocator.run(), name=f"allocator:{cfg.suffix}"))
            self._started()
            undo.pop_all()  # started: stop() undoes it all from here on
        log.info("%s serving on %s (root %s)", self.who, self.endpoint, cfg.root)
        return self

    async def stop(self, graceful: bool = True) -> None:
        """Graceful: hand the items off first (bounded). Either way: stop serving and release everything."""
        lost = self.announcement.lost.is_set()
        items = f"{self.kind.item}s"
        how = f"handing its {items} off first" if graceful and not lost else "no hand-off"
        log.info("%s stopping (%s)", self.who, how)
        if graceful and not lost:
            await self._hand_off()
        self.stopping = True
        for task in self._tasks:
            task.cancel()
        with contextlib.suppress(Exception):
            await self.allocator.aclose()
        await self._release(graceful)
        await self.announcement.aclose(timeout=ETCD_STOP_TIMEOUT)
        await self.keyspace.aclose()
        await self._close_clients()
        await self.etcd.aclose()
        stop_metrics(self._metrics_server)
        self._metrics_server = None
        self.stopped.set()
        log.info("%s stopped", self.who)

    async def _hand_off(self) -> None:
        """Mark the member exiting, then wait (at most `exit_timeout` seconds) for its items to move away."""
        try:
            await self.announcement.update(self._exiting_spec(), timeout=ETCD_STOP_TIMEOUT)
        except TidingsError as err:
            log.warning(
                "%s: cannot mark itself exiting in etcd (%s); stopping without handing its %ss off",
                self.who,
                err,
                self.kind.item,
            )
            return
        await wait_handed_off(
            self.keyspace, self.etcd, self.announcement, self._state, self.who, self.config.exit_timeout
        )
