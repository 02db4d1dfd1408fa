"""Long-running readers ride out an outage of the brokers of any length (Gazette's RetryReader): a
consumer shard stays PRIMARY and consumes what comes after, and a client made with
``retries=None`` reads on, however long every broker was gone. The outage here (every broker
killed, then started again on its data dir and port) lasts longer than a one-shot client's retry
budget (20 retries, about 15 s), after which such a client gives up.

Brokers are child processes (LocalCluster over the session etcd); the consumer runs in this process."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

from tests.support.apps import Relay, seen
from tests.support.cluster import create_local_journal
from tests.support.waiting import wait_until
from tidings.client import AppendService, AsyncClient
from tidings.consumer.client import ShardClient
from tidings.consumer.service import Consumer, ConsumerConfig
from tidings.message import Publisher, read_committed
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.specs import shard_from_dict

OUTAGE = 20.0  # seconds every broker is down: longer than a one-shot client's retries last


async def publish(endpoint: str, ids: list[str]) -> None:
    async with AsyncClient(endpoint) as c:
        pub = Publisher(AppendService(c))
        await (await pub.publish_committed("relay/in", *({"id": i} for i in ids)))
        await pub.service.aclose()


async def test_a_shard_and_a_reader_ride_out_a_long_outage_of_every_broker(
    local_cluster, etcd, etcd_root, tmp_path
) -> None:
    lc = local_cluster
    await create_local_journal(lc, "relay/in", 3)
    await publish(lc.endpoints[0], [f"m{i}" for i in range(5)])
    cfg = ConsumerConfig(
        etcd=etcd.endpoint, broker=lc.endpoints[0], app=Relay(), zone="zone-a", suffix="c0",
        root=etcd_root + "-consumer", data_dir=tmp_path / "consumer", lease_ttl=2,
    )  # fmt: skip
    consumer = await Consumer(cfg).start()
    read: list[str] = []

    async def tail() -> None:
        async with AsyncClient(lc.endpoints[1], retries=None) as c:
            async with aclosing(read_committed(c, "relay/in").__aiter__()) as envs:
                async for env in envs:
                    read.append(env.message["id"])

    tailing = asyncio.ensure_future(tail())
    store = tmp_path / "consumer" / "relay%2F0.db"
    try:
        spec = shard_from_dict({"id": "relay/0", "sources": ["relay/in"], "max_txn_duration": "1s"})
        async with ShardClient(consumer.endpoint) as sc:
            await sc.apply([pb.ShardApplyRequest.Change(upsert=spec)])
        await wait_until(lambda: len(seen(store)) == 5 and len(read) == 5, 60, interval=0.1)

        for b in lc.brokers:
            b.kill()
        await asyncio.sleep(OUTAGE)  # (the outage itself: every broker gone this long)
        for b in lc.brokers:  # (in a thread: this loop runs the consumer, whose lease must be kept alive)
            await asyncio.to_thread(b.start)

        await publish(lc.endpoints[0], [f"m{i}" for i in range(5, 10)])
        ids = {f"m{i}": 1 for i in range(10)}
        await wait_until(lambda: seen(store) == ids and sorted(read) == sorted(ids), 90, interval=0.2)
        replica = consumer.replicas["relay/0"]
        assert replica.status.code == pb.ReplicaStatus.PRIMARY, replica.status
        assert not tailing.done()
    finally:
        tailing.cancel()
        await asyncio.gather(tailing, return_exceptions=True)
        await consumer.stop(graceful=False)
