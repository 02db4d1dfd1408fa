"""A tidings cluster on separate hosts (network namespaces, tests/support/netns.py): etcd on host
`etcd`, broker i on host `b<i>`, each listening on a wildcard and announcing its host's address
(IPv4, or IPv6 with `ipv6`). With `certs`, every process serves mutual TLS with a certificate for its
own host (etcd too, requiring client certificates; brokers reach it with theirs); with `auth_keys`,
brokers verify tokens. The test process, on the bridge, is a client from "another host"."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from tests.support.certs import Certs
from tests.support.cluster import FAST_BROKER_FLAGS
from tests.support.netns import Host, Net
from tests.support.waiting import wait_until
from tidings.auth import KeyedAuthorizer, KeySet
from tidings.client import AsyncClient
from tidings.cluster import BrokerProcess, EtcdProcess
from tidings.cluster.etcd import endpoint_of
from tidings.protocol.status import TidingsError
from tidings.tls import TLS, load

ROOT = "/tidings/hosts"
REPO = Path(__file__).resolve().parents[2]


class Hosts:
    def __init__(
        self, net: Net, data: Path, certs: Certs | None = None, auth_keys: str = "", ipv6: bool = False
    ) -> None:
        self.net, self.data, self.certs, self.auth_keys, self.ipv6 = net, data, certs, auth_keys, ipv6
        self.store = f"file://{data / 'fragments'}/"
        self.etcd_host = etcd_host = net.host("etcd")
        self.etcd = EtcdProcess(data / "etcd", client_port=2379, peer_port=2380, host="::" if ipv6 else "0.0.0.0",
                                advertise_host=self.address(etcd_host), wrap=etcd_host.wrap,
                                tls=self.tls(etcd_host, server=True))  # fmt: skip
        self.brokers: list[BrokerProcess] = []

    def address(self, host: Host) -> str:
        return host.ip6 if self.ipv6 else host.ip

    def tls(self, host: Host | None, server: bool = False) -> TLS | None:
        """The TLS of a process on `host` (None: the test's own client, on the bridge)."""
        if self.certs is None:
            return None
        name = host.name if host is not None else "client"
        cert, key = self.certs.issue(
            f"{name}-{'6' if self.ipv6 else '4'}", *([self.address(host)] if host else ["client"])
        )
        return load(cert, key, self.certs.ca_file, name, server)

    def start(self, n: int) -> Hosts:
        self.etcd.start()
        (self.data / "fragments").mkdir(parents=True, exist_ok=True)
        for _ in range(n):
            self.add_broker()
        return self

    def add_broker(self) -> BrokerProcess:
        i = len(self.brokers)
        h = self.net.host(f"b{i}")
        h.wait_reaches(self.address(self.etcd_host), 2379)  # (etcd itself, over the address it announces)
        extra = [*FAST_BROKER_FLAGS, "--default-store", self.store]
        extra += self.flags(h)
        b = BrokerProcess(self.etcd.endpoint, f"zone-{'abc'[i % 3]}", f"broker-{i}", 8080, self.data / h.name, extra,
                          ROOT, "::" if self.ipv6 else "0.0.0.0", self.address(h), h.wrap,
                          auth_keys=self.auth_keys)  # fmt: skip
        self.brokers.append(b.start())
        return b

    @property
    def endpoints(self) -> list[str]:
        return [b.endpoint for b in self.brokers if b.alive()]

    def client(self, endpoint: str | None = None, **kw: object) -> AsyncClient:
        """A client on the test's host: TLS with a certificate of its own, signing with the cluster's keys."""
        auth = KeyedAuthorizer(KeySet.parse(self.auth_keys), sub="tests") if self.auth_keys else None
        return AsyncClient(endpoint or self.endpoints[0], tls=self.tls(None), auth=auth, **kw)  # type: ignore[arg-type]

    async def kill_the_primary_and_append(self, journal: str, acked: list[tuple[int, int, bytes]]) -> tuple[bytes, str]:
        """SIGKILL the broker leading `journal`, append to it through any broker once it is re-homed on the
        others (the append's span added to `acked`): the journal's content, and the killed broker's suffix."""
        async with self.client() as c:
            route = next(j.route for j in (await c.list()).journals if j.spec.name == journal)
        victim = next(b for b in self.brokers if b.suffix == route.members[route.primary].suffix)
        victim.kill()  # its lease expires; the journal is re-homed on the other hosts

        async def appended_after_the_kill() -> bool:
            for ep in self.endpoints:
                try:
                    async with self.client(ep, retries=2) as c:
                        r = await c.append(journal, b"<after the kill>")
                    acked.append((r.begin, r.end, b"<after the kill>"))
                    return True
                except TidingsError:
                    continue
            return False

        await wait_until(appended_after_the_kill, 60, interval=0.2)
        async with self.client() as c:
            return await c.read_all(journal), victim.suffix

    def flags(self, host: Host) -> list[str]:
        """A process's flags on `host`: its TLS, and etcd's (the same certificate)."""
        tls = self.tls(host, server=True)
        if tls is None:
            return []
        return [
            arg for flag, path in tls.paths.items() for arg in (flag, path, flag.replace("--tls", "--etcd-tls"), path)
        ]

    async def tidings(self, host: Host, name: str, args: list[str], etcd: bool = False) -> str:
        """`tidings ARGS` on `host` with its TLS (and etcd's, with `etcd`) and the cluster's keys in its
        environment (never its command line); its READY line's second word. Stopped by the Net, by PID."""
        flags = self.flags(host)
        if not etcd:
            flags = [
                a
                for i, a in enumerate(flags)
                if not (a.startswith("--etcd-tls") or (i and flags[i - 1].startswith("--etcd-tls")))
            ]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}
        if self.auth_keys:
            env["TIDINGS_AUTH_KEYS"] = self.auth_keys
        with (self.data / f"{name}.log").open("ab") as log:
            proc = host.popen([sys.executable, "-m", "tidings.cli", *args, *flags], stdout=subprocess.PIPE,
                              stderr=log, env=env)  # fmt: skip
        assert proc.stdout is not None
        line = (await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 60)).decode()
        assert line.startswith("READY"), (name, line, (self.data / f"{name}.log").read_text()[-3000:])
        return line.split()[1] if len(line.split()) > 1 else ""

    @property
    def etcd_endpoint(self) -> str:
        return endpoint_of(self.address(self.net.hosts["etcd"]), 2379)

    def stop(self) -> None:
        """SIGTERM to every broker at once (each one alone would hand its journals to the others), then etcd."""
        for b in self.brokers:
            if b.alive():
                b.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        for b in self.brokers:
            try:
                if b.proc is not None:
                    b.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                b.kill()
        self.etcd.stop()


@contextlib.contextmanager
def hosts_on(data: Path, **kw: object) -> Iterator[Hosts]:
    """A Hosts on a new Net (its options `kw`), every process of it stopped and the Net removed after."""
    from tests.support.netns import Net

    with Net() as net:
        hs = Hosts(net, data, **kw)  # type: ignore[arg-type]
        try:
            yield hs
        finally:
            hs.stop()
