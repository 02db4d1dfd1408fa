"""In-process brokers for integration tests: real Broker objects, real etcd, real gRPC on loopback.

Each broker runs on the test's event loop with its own etcd connection, KeySpace, gRPC server
(free 127.0.0.1 port) and data dir. Fault tests that need `kill -9` use LocalCluster (child
processes) instead.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from tidings.auth import Authorizer, KeyedAuthorizer, KeySet
from tidings.broker.host import BrokerConfig
from tidings.broker.service import Broker
from tidings.client import AsyncClient
from tidings.cluster import LocalCluster
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.specs import spec_from_dict

from .waiting import wait_until


class TestCluster:
    __test__ = False

    def __init__(self, etcd_endpoint: str, root: str, data_dir: Path, **config: object) -> None:
        self.etcd_endpoint = etcd_endpoint
        self.root = root
        self.data_dir = data_dir
        self.config = {"pulse_interval": 0.5, "lease_ttl": 2, "exit_timeout": 20.0, **config}
        self.brokers: list[Broker] = []
        self._n = 0

    @property
    def store_url(self) -> str:
        return f"file://{self.data_dir / 'fragments'}/"

    async def add_broker(self, zone: str = "zone-a", **config: object) -> Broker:
        suffix = f"b{self._n}"
        self._n += 1
        cfg = BrokerConfig(
            etcd=self.etcd_endpoint,
            zone=zone,
            suffix=suffix,
            data_dir=self.data_dir / suffix,
            root=self.root,
            **{**self.config, **config},  # type: ignore[arg-type]
        )
        b = await Broker(cfg).start()
        self.brokers.append(b)
        return b

    def client(self, i: int = 0) -> AsyncClient:
        """A client of broker i (with the brokers' TLS, if they have it: their certificate is a client's too;
        and their keys, if they have them: it signs its own tokens, as a broker does)."""
        keys = self.config.get("auth_keys")
        auth = KeyedAuthorizer(keys, sub="tests") if isinstance(keys, KeySet) else None
        return AsyncClient(self.brokers[i].endpoint, tls=self.config.get("tls"), auth=auth)  # type: ignore[arg-type]

    async def create_journal(self, name: str, replication: int = 3, **fields: object) -> pb.JournalSpec:
        frag = {"length": "1MiB", "stores": [self.store_url], "refresh_interval": "1s", **fields.pop("fragment", {})}
        spec = spec_from_dict({"name": name, "replication": replication, "fragment": frag, **fields})
        async with self.client() as c:
            await c.apply([pb.ApplyRequest.Change(upsert=spec)])
        await self.wait_consistent(name, replication)
        return spec

    def route(self, name: str) -> pb.Route:
        return self.brokers[0].resolver.state.route(name)

    async def wait_consistent(self, name: str, replication: int, timeout: float = 30.0) -> None:
        """Wait until the journal has R assignments, a primary, and every value advertises the Route."""
        from tidings.protocol.route import routes_equivalent

        def ready() -> bool:
            for b in self.brokers:
                st = b.resolver.state
                assigns = st.assignments.get(name, [])
                route = st.route(name)
                if len(assigns) != replication or route.primary < 0:
                    return False
                if not all(routes_equivalent(a.value, route) for a in assigns):
                    return False
            return True

        await wait_until(ready, timeout)

    async def stop(self) -> None:
        for b in self.brokers:
            if not b.stopped.is_set():
                with contextlib.suppress(Exception):
                    await b.stop(graceful=False)


FAST_BROKER_FLAGS = ["--pulse-interval", "0.5", "--lease-ttl", "2", "--stall-timeout", "5"]


async def create_local_journal(
    lc: LocalCluster, name: str, replication: int = 3, auth: Authorizer | None = None, **fields: object
) -> None:
    """Create a journal on a LocalCluster (brokers as child processes) and wait for its primary (`auth`:
    what the client signs with, for brokers holding keys)."""
    frag = {"length": "64KiB", "stores": [lc.store_url], **fields.pop("fragment", {})}  # type: ignore[dict-item]
    spec = spec_from_dict({"name": name, "replication": replication, "fragment": frag, **fields})
    async with AsyncClient(lc.endpoints[0], auth=auth) as c:
        await c.apply([pb.ApplyRequest.Change(upsert=spec)])

        async def has_primary() -> bool:
            resp = await c.list()
            return any(j.spec.name == name and j.route.primary >= 0 for j in resp.journals)

        await wait_until(has_primary, 30)
