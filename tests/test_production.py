"""Production across machines (issue 30's acceptance): etcd and each broker on a host of its own
(network namespaces on a private bridge, tests/support/netns.py), everything on mutual TLS with
certificates for each host's address, etcd requiring client certificates, brokers verifying capability
tokens (replication included). From another host (the test's), a client with its own certificate and
keys appends and reads through every broker; a token of another key and a plaintext client are refused
in one line with nothing written; the kill -9 of a journal's primary re-homes it with every
acknowledged append kept. The same over IPv6. A consumer and a LogPlayer with its targets, each on a
host of its own, deliver exactly once across them."""

from __future__ import annotations

import asyncio
import ipaddress
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.certs import Certs
from tests.support.hosts import Hosts, hosts_on
from tests.support.logplayer import applied_log, wait_delivered
from tests.support.waiting import wait_until
from tidings.auth import BearerAuthorizer, KeyedAuthorizer, KeySet, generate_key, sign
from tidings.client import AppendService, AsyncClient
from tidings.consumer.client import ShardClient
from tidings.logplayer.player import last_acks
from tidings.logplayer.wal import Target, Targets, WalWriter
from tidings.message import Publisher, read_committed
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.claims import Capability, Claims
from tidings.protocol.specs import shard_from_dict, spec_from_dict
from tidings.protocol.status import TidingsError, TransportError

KEYS = generate_key()


@pytest.fixture(params=["ipv4", "ipv6"])
def secure_hosts(request: pytest.FixtureRequest, tmp_path: Path, certs: Certs) -> Iterator[Hosts]:
    with hosts_on(tmp_path, certs=certs, auth_keys=KEYS, ipv6=request.param == "ipv6") as hs:
        yield hs


async def test_a_tls_and_token_cluster_on_separate_hosts_serves_and_survives_a_kill(secure_hosts: Hosts) -> None:
    hs = secure_hosts.start(4)  # (a spare for R=3)
    addresses = {ipaddress.ip_address(hs.address(h)) for h in hs.net.hosts.values()}
    spec = spec_from_dict({"name": "prod/j", "replication": 3, "fragment": {"length": "64KiB", "stores": [hs.store]}})
    async with hs.client() as c:
        await c.apply([pb.ApplyRequest.Change(upsert=spec)])
        for m in (await c.members()).members:  # every endpoint on its own host's address
            for endpoint in (m.spec.endpoint, m.spec.replication_endpoint):
                assert ipaddress.ip_address(endpoint.rsplit(":", 1)[0].strip("[]")) in addresses, m.spec

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

    data, _ = await hs.kill_the_primary_and_append("prod/j", acked)  # (SIGKILL: re-homed on the other three)
    assert b"forged" not in data
    for b, e, body in acked:
        assert data[b:e] == body, f"acknowledged append at [{b},{e}) changed"


@pytest.fixture
def hosts_v4(tmp_path: Path, certs: Certs) -> Iterator[Hosts]:
    with hosts_on(tmp_path, certs=certs, auth_keys=KEYS) as hs:
        yield hs


async def test_a_consumer_and_a_logplayer_deliver_across_hosts_with_tls_and_tokens(hosts_v4: Hosts) -> None:
    """A `tidings consumer` (the Relay app) on a host of its own relays every message exactly once; a
    `tidings logplayer run` on another delivers a WAL to two `tidings target serve` on two more, every
    entry once, in order: all of them on mutual TLS, holding the keys, and reaching etcd with their
    certificates."""
    hs = hosts_v4.start(3)
    for name in ("prod/in", "prod/out", "prod/wal"):
        spec = spec_from_dict({"name": name, "replication": 2, "fragment": {"length": "64KiB", "stores": [hs.store]}})
        async with hs.client() as c:
            await c.apply([pb.ApplyRequest.Change(upsert=spec)])
    keyed = KeyedAuthorizer(KeySet.parse(KEYS), sub="tests")

    c0 = hs.net.host("c0")
    consumer = await hs.tidings(c0, "consumer", ["consumer", "--app", "tests.support.apps:Relay", "--etcd",
        hs.etcd.endpoint, "--broker", hs.endpoints[0], "--root", "/tidings/prod-consumers", "--data-dir",
        str(hs.data / "c0"), "--id", "c0", "--zone", "zone-a", "--listen", "0.0.0.0:9090", "--advertise", c0.ip,
        "--metrics", "", "--lease-ttl", "2"], etcd=True)  # fmt: skip
    shard = shard_from_dict({"id": "relay/0", "sources": ["prod/in"], "labels": {"out": "prod/out"},
                             "max_txn_duration": "200ms"})  # fmt: skip
    async with ShardClient(consumer, tls=hs.tls(None), auth=keyed) as sc:
        await sc.apply([pb.ShardApplyRequest.Change(upsert=shard)])
    async with ShardClient(consumer, tls=hs.tls(None)) as anonymous:  # (it holds the keys: no token, no answer)
        with pytest.raises(TidingsError, match="UNAUTHENTICATED"):
            await anonymous.list()
    async with hs.client() as c:
        pub = Publisher(AppendService(c))
        for i in range(0, 60, 20):
            await (await pub.publish_committed("prod/in", *({"id": str(n)} for n in range(i, i + 20))))
        await pub.service.aclose()

        async def relayed() -> list[str]:
            ids = [env.message["id"] async for env in read_committed(c, "prod/out", block=False)]
            return ids if len(ids) >= 60 else []

        ids = await wait_until(relayed, 60, interval=0.2)
    assert sorted(ids, key=int) == [str(n) for n in range(60)]  # (each once)

    targets = Targets([Target(f"t{i}", f"{hs.net.host(f't{i}').ip}:7070") for i in range(2)])
    for i, t in enumerate(targets.targets):
        await hs.tidings(hs.net.hosts[f"t{i}"], t.id, ["target", "serve", "--id", t.id, "--listen", "0.0.0.0:7070",
                         "--db", str(hs.data / f"{t.id}.sqlite"), "--log-applied"])  # fmt: skip
    targets_file = hs.data / "targets.yaml"
    targets_file.write_text(json.dumps({"targets": [{"id": t.id, "endpoint": t.endpoint} for t in targets.targets]}))
    await hs.tidings(hs.net.host("lp"), "logplayer", ["logplayer", "run", "--wal", "prod/wal", "--targets",
                     str(targets_file), "--broker", hs.endpoints[1], "--state", str(hs.data / "player.state"),
                     "--progress", "0"])  # fmt: skip
    async with hs.client() as c:
        writer = WalWriter(c, "prod/wal", targets)
        for i in range(20):
            await writer.append([{"key": f"k{i}-{j}", "value": {"i": i}} for j in range(3)])
        await writer.aclose()
        expected = await wait_delivered(c, "prod/wal", targets, 60.0, auth=keyed)
    for t in targets.ids:
        assert expected[t] and applied_log(hs.data / f"{t}.sqlite") == expected[t], t
    anonymous = await last_acks(targets, tls=hs.tls(None))  # (the targets hold the keys too)
    assert all(isinstance(a, str) and "UNAUTHENTICATED" in a for a in anonymous.values()), anonymous
