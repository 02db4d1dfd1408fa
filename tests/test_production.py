"""Production across machines (issue 30's acceptance): etcd and each broker on a host of its own
(network namespaces on a private bridge, tests/support/netns.py), everything on mutual TLS with
certificates for each host's address, etcd requiring client certificates, brokers verifying capability
tokens (replication included). From another host (the test's), a client with its own certificate and
keys appends and reads through every broker; a token of another key and a plaintext client are refused
in one line with nothing written; the kill -9 of a journal's primary re-homes it with every
acknowledged append kept. The same over IPv6."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.certs import Certs
from tests.support.hosts import Hosts
from tests.support.netns import Net
from tests.support.waiting import wait_until
from tidings.auth import BearerAuthorizer, KeySet, generate_key, sign
from tidings.client import AsyncClient
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.claims import Capability, Claims
from tidings.protocol.specs import spec_from_dict
from tidings.protocol.status import TidingsError, TransportError

KEYS = generate_key()


@pytest.fixture(params=["ipv4", "ipv6"])
def secure_hosts(request: pytest.FixtureRequest, tmp_path: Path, certs: Certs) -> Iterator[Hosts]:
    with Net() as net:
        hs = Hosts(net, tmp_path, certs=certs, auth_keys=KEYS, ipv6=request.param == "ipv6")
        try:
            yield hs
        finally:
            hs.stop()


async def test_a_tls_and_token_cluster_on_separate_hosts_serves_and_survives_a_kill(secure_hosts: Hosts) -> None:
    hs = secure_hosts.start(4)  # (a spare for R=3)
    addresses = {hs.address(h) for h in hs.net.hosts.values()}
    spec = spec_from_dict({"name": "prod/j", "replication": 3, "fragment": {"length": "64KiB", "stores": [hs.store]}})
    async with hs.client() as c:
        await c.apply([pb.ApplyRequest.Change(upsert=spec)])
        for m in (await c.members()).members:  # every endpoint on its own host's address
            for endpoint in (m.spec.endpoint, m.spec.replication_endpoint):
                assert endpoint.rsplit(":", 1)[0].strip("[]") in addresses, m.spec

        async def routed() -> bool:
            route = next(j.route for j in (await c.list()).journals if j.spec.name == "prod/j")
            return route.primary >= 0 and len(route.members) == 3

        await wait_until(routed, 30)

    acked: list[tuple[int, int, bytes]] = []
    for i, ep in enumerate(hs.endpoints):  # through every broker (replicated and proxied over TLS, with tokens)
        async with hs.client(ep) as c:
            body = f"<via broker {i}>".encode()
            r = await c.append("prod/j", body)
            acked.append((r.begin, r.end, body))
    for ep in hs.endpoints:
        async with hs.client(ep) as c:
            assert await c.read_all("prod/j") == b"".join(body for _, _, body in sorted(acked))

    now = int(asyncio.get_running_loop().time())  # (any clock: the token's key is what is wrong)
    forged = sign(Claims(cap=Capability.ALL, iat=now, exp=now + 3600), KeySet.parse(generate_key()).signing_key)
    async with AsyncClient(hs.endpoints[0], tls=hs.tls(None), auth=BearerAuthorizer(forged), retries=0) as c:
        with pytest.raises(TidingsError, match="UNAUTHENTICATED"):
            await c.append("prod/j", b"forged")
    async with AsyncClient(hs.endpoints[0], retries=0, fail_fast=True) as plain:
        with pytest.raises(TransportError, match="speaks TLS: pass --tls-ca"):
            await plain.list()

    async with hs.client() as c:
        route = next(j.route for j in (await c.list()).journals if j.spec.name == "prod/j")
    victim = next(b for b in hs.brokers if b.suffix == route.members[route.primary].suffix)
    victim.kill()  # SIGKILL: its lease expires; the journal is re-homed on the other three hosts

    async def appended_after_the_kill() -> bool:
        for ep in hs.endpoints:
            try:
                async with hs.client(ep, retries=2) as c:
                    r = await c.append("prod/j", b"<after the kill>")
                acked.append((r.begin, r.end, b"<after the kill>"))
                return True
            except TidingsError:
                continue
        return False

    await wait_until(appended_after_the_kill, 60, interval=0.2)
    async with hs.client() as c:
        data = await c.read_all("prod/j")
    assert b"forged" not in data
    for b, e, body in acked:
        assert data[b:e] == body, f"acknowledged append at [{b},{e}) changed"
