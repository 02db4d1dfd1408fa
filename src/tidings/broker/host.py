"""The broker as the parts it runs see it: its flags (`BrokerConfig`) and what it lends them (`Host`).

The RPC handlers, the AppendFSM, the pulse and the recovery checks take the broker that runs them,
typed as `Host`: `service.Broker` imports them to wire them together, so they cannot import it (in
Gazette they take its `*broker.Service`; the files of one Go package need no import order).
`service.Broker` is the one implementation; the AppendFSM's tests drive it through a stub of the
parts it touches (`tests/broker/_stub.py`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Protocol

import grpc

from tidings.auth import Authorizer, KeySet, NoVerifier, Verifier
from tidings.broker.resolver import Resolver
from tidings.broker.transport import ReplicaStream
from tidings.fragment.persister import Persister
from tidings.keyspace import Etcd, KeySpace
from tidings.protocol import protocol_pb2 as pb
from tidings.tls import TLS

__all__ = ["BrokerConfig", "Host"]


@dataclasses.dataclass
class BrokerConfig:
    """Flags of `tidings broker`, one for one with TIDINGS_* environment variables."""

    etcd: str
    zone: str = "local"
    suffix: str = "broker-0"
    listen: str = "127.0.0.1:0"
    advertise: str = ""  # HOST or HOST:PORT other hosts dial ("": --listen's; a wildcard --listen needs one)
    data_dir: Path = Path("data")
    root: str = "/tidings/cluster"
    journal_limit: int = 1024
    stall_timeout: float = 10.0  # a client silent this long is cut off
    min_append_rate: int = 16 * 1024  # bytes/s a client must average after stall_timeout
    max_append_rate: int = 0  # bytes/s any journal's appends may take at most (0: only its spec's limit)
    # Seconds between a primary's zero-byte health-check appends of each journal (Gazette's healthCheckInterval:
    # a minute). Route changes pulse at once; dead connections are found by the transport's keep-alive.
    pulse_interval: float = 60.0
    lease_ttl: int = 5
    metrics_listen: str | None = None  # HOST:PORT serving /metrics; "auto": the gRPC port + 1000 (or any free one)
    metrics_advertise: str = ""  # HOST[:PORT] announced for /metrics ("": on --advertise's host, its own port)
    metrics_tls: bool = False  # /metrics over TLS with the process's certificate (mutual with a CA)
    exit_timeout: float = 60.0
    default_store: str = ""  # the fragment store of journals whose spec names none ("": local only)
    persist_delay: float = 60.0  # seconds a replica waits before persisting what the primary did not
    replication_listen: str = ""  # HOST:PORT for peers' replication streams ("": --listen's host, any port)
    replication_advertise: str = ""  # HOST[:PORT] peers dial for it ("": on --advertise's host, its own port)
    # Seconds between retention passes: each journal's primary removes the persisted fragments its
    # fragment.retention lets go (Kafka's log.retention.check.interval: 5 minutes). 0: never (prune by hand).
    prune_interval: float = 300.0
    metrics_journals: bool = False  # per-journal series (one per journal: mind the cardinality)
    auto_suspend: bool = False  # suspend idle journals (Gazette's AutoSuspend; see broker/pulse.py)
    tls: TLS | None = None  # --tls-cert/--tls-key/--tls-ca: serve, and dial peers, with TLS
    etcd_tls: TLS | None = None  # --etcd-tls-*: etcd over TLS
    etcd_user: str = ""  # --etcd-user: as this etcd user (its password below, never shown)
    etcd_password: str = dataclasses.field(default="", repr=False)
    # --auth-keys: verify every RPC's token (None: auth off), and sign the broker's own calls to its peers
    auth_keys: KeySet | None = None


class Host(Protocol):
    """What a broker lends the parts it runs (see the module docstring)."""

    config: BrokerConfig
    process_id: pb.ProcessId
    endpoint: str  # its own Journal service's (`host:port`)
    etcd: Etcd
    keyspace: KeySpace  # the broker's root, followed
    resolver: Resolver  # journal -> Route and local Replica
    persister: Persister
    verifier: Verifier | NoVerifier  # checks each RPC's token; logs and counts refusals
    authorizer: Authorizer  # signs the broker's own calls to its peers (proxied Appends, Reads, ListFragments)

    def channel(self, endpoint: str) -> grpc.aio.Channel:
        """A channel to another broker's Journal service (or its own), shared and kept open."""
        ...

    def open_streams(self, route: pb.Route) -> list[ReplicaStream]:
        """A replication stream to every peer of `route` (every member but the primary: itself)."""
        ...
