"""Keys rotate without downtime (docs/deploy.md): while a producer appends without pause, the brokers
are restarted one by one with K1,K2 (the old key still signs, both verify), then K2,K1 (the new one
signs), the producer's token changes to K2, then K2 alone; no append fails and every acknowledged one
reads back once, where it was acknowledged. Brokers as child processes, replicating to each other
with their own tokens throughout."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from tests.support.cluster import FAST_BROKER_FLAGS
from tests.support.waiting import wait_until
from tidings.auth import KeyedAuthorizer, KeySet, generate_key
from tidings.client import AsyncClient
from tidings.cluster import LocalCluster
from tidings.protocol import protocol_pb2 as pb

K1, K2 = generate_key(), generate_key()


class Signer:
    """The producer's authorizer, switched from K1's to K2's between two appends."""

    def __init__(self, keys: str) -> None:
        self.use(keys)

    def use(self, keys: str) -> None:
        self.current = KeyedAuthorizer(KeySet.parse(keys), sub="producer")

    def metadata(self, cap: int, selector: pb.LabelSelector | None = None, exp: float | None = None):
        return self.current.metadata(cap, selector, exp)


@pytest.fixture
def cluster(etcd, etcd_root, tmp_path) -> Iterator[LocalCluster]:
    lc = LocalCluster(brokers=3, zones=3, data_dir=tmp_path, etcd=etcd.endpoint, root=etcd_root, auth_keys=K1)
    lc.extra = list(FAST_BROKER_FLAGS)
    with lc:
        yield lc


async def test_keys_rotate_under_a_steady_producer_with_no_failed_append(cluster: LocalCluster) -> None:
    lc = cluster
    signer = Signer(K1)
    # (the journal is made with K1's token through the first broker)
    async with AsyncClient(lc.endpoints[0], auth=signer) as c:
        spec = {"name": "rotate/j", "replication": 2}
        await c.apply([pb.ApplyRequest.Change(upsert=_spec(lc, spec))])
        await wait_until(lambda: _has_primary(c, "rotate/j"), 30)

    acked: list[tuple[int, int, bytes]] = []
    failures: list[BaseException] = []
    stop = asyncio.Event()

    async def produce() -> None:
        n = 0
        async with AsyncClient(lc.endpoints[0], auth=signer, retries=None, deadline=60.0) as c:
            while not stop.is_set():
                body = f"<{n}>".encode()
                n += 1
                try:
                    r = await c.append("rotate/j", body)
                except Exception as exc:  # (recorded: the test fails on any)
                    failures.append(exc)
                    continue
                acked.append((r.begin, r.end, body))

    producer = asyncio.create_task(produce())
    try:
        for keys in (f"{K1},{K2}", f"{K2},{K1}", K2):
            if keys == K2:
                signer.use(K2)  # (every broker verifies K2 now: the producer's new token)
            for b in lc.brokers:
                before = len(acked)
                await asyncio.to_thread(b.terminate)
                b.auth_keys = keys
                await asyncio.to_thread(b.start)
                await wait_until(lambda before=before: len(acked) > before + 5, 60)  # (appends go on)
    finally:
        stop.set()
        await producer
    assert not failures, failures[:3]
    async with AsyncClient(lc.endpoints[0], auth=signer) as c:
        data = await c.read_all("rotate/j")
    for b, e, body in acked:
        assert data[b:e] == body
    assert len({body for _, _, body in acked}) == len(acked) and data.count(b"<") == len(acked)


def _spec(lc: LocalCluster, fields: dict) -> pb.JournalSpec:
    from tidings.protocol.specs import spec_from_dict

    return spec_from_dict({**fields, "fragment": {"length": "64KiB", "stores": [lc.store_url]}})


async def _has_primary(c: AsyncClient, name: str) -> bool:
    return any(j.spec.name == name and j.route.primary >= 0 for j in (await c.list()).journals)
