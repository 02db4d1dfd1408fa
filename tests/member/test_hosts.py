"""Brokers on separate hosts: etcd and each broker in its own network namespace on a private bridge
(tests/support/netns.py), listening on 0.0.0.0 and announcing their host's address. Every broker takes
appends and serves reads for a replicated journal (routing and replication go over the announced
addresses only: nothing is reachable through 127.0.0.1), and the kill -9 of its primary re-homes it
with no acknowledged append lost."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.hosts import Hosts, hosts_on
from tests.support.netns import Net
from tests.support.waiting import wait_until
from tidings.client import AsyncClient
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.specs import spec_from_dict


@pytest.fixture
def hosts(tmp_path: Path) -> Iterator[Hosts]:
    with hosts_on(tmp_path) as hs:
        yield hs


async def test_brokers_on_separate_hosts_serve_every_journal_and_survive_a_primary_kill(hosts: Hosts) -> None:
    hs = hosts.start(4)  # (a spare for R=3)
    ips = {h.ip for h in hs.net.hosts.values()}
    assert all(ep.rsplit(":", 1)[0] in ips for ep in hs.endpoints), hs.endpoints
    spec = spec_from_dict({"name": "hosts/j", "replication": 3, "fragment": {"length": "64KiB", "stores": [hs.store]}})
    async with AsyncClient(hs.endpoints[0]) as c:
        await c.apply([pb.ApplyRequest.Change(upsert=spec)])
        members = (await c.members()).members
        for m in members:  # gRPC, replication and metrics: each on its own host's address
            for endpoint in (m.spec.endpoint, m.spec.replication_endpoint, m.spec.metrics_endpoint):
                assert endpoint.rsplit(":", 1)[0] in ips, m.spec

        async def primary() -> pb.Route | None:
            route = next(j.route for j in (await c.list()).journals if j.spec.name == "hosts/j")
            return route if route.primary >= 0 and len(route.members) == 3 else None

        await wait_until(primary, 30)

    acked: list[tuple[int, int, bytes]] = []
    for i, ep in enumerate(hs.endpoints):  # through every broker: all but one proxy to the primary
        async with AsyncClient(ep) as c:
            body = f"<via broker {i}>".encode()
            r = await c.append("hosts/j", body)
            acked.append((r.begin, r.end, body))
    expect = b"".join(body for _, _, body in sorted(acked))
    for ep in hs.endpoints:  # reads through every broker, each from its own replica or proxied
        async with AsyncClient(ep) as c:
            assert await c.read_all("hosts/j") == expect

    data, victim = await hs.kill_the_primary_and_append("hosts/j", acked)  # (SIGKILL: re-homed on the others)
    async with AsyncClient(hs.endpoints[0]) as c:
        route = next(j.route for j in (await c.list()).journals if j.spec.name == "hosts/j")
    assert route.primary >= 0 and route.members[route.primary].suffix != victim, route
    for b, e, body in acked:
        assert data[b:e] == body, f"acknowledged append at [{b},{e}) changed"


def test_the_hosts_are_gone_after_the_test(tmp_path: Path) -> None:
    """A Net removes its namespaces, its bridge and every process it started, also when a test fails."""
    with pytest.raises(RuntimeError, match="the test failed"), Net() as net:
        h = net.host("x")
        proc = h.popen([sys.executable, "-c", "import signal; signal.pause()"])
        names = (net.bridge, h.ns)
        raise RuntimeError("the test failed")
    assert proc.poll() is not None
    assert h.ns not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert names[0] not in subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout


def test_without_root_the_hosts_tests_fail_saying_why() -> None:
    """Where namespaces cannot be made (not root), a hosts test fails with the reason and what to do."""
    import shutil

    assert os.geteuid() == 0 and shutil.which("setpriv"), "run as root (the tests' hosts need it), with setpriv"
    r = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c",
         "from tests.support.netns import require; require()"],
        capture_output=True, text=True, cwd=Path(__file__).parents[2], timeout=60,
    )  # fmt: skip
    assert "Failed: network-namespace hosts need root with CAP_NET_ADMIN (not root): run `make test` as root" in (
        r.stderr
    ), r.stderr
