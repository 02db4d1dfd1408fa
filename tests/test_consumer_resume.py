"""A new primary reads on from its checkpoint's read-through offsets, as in Gazette: a source
producer that began a transaction and never acknowledged it (a dead producer, a Spark sink's failed
task attempt) does not pin where every later primary starts reading (its transaction is re-read only
if its ACK ever comes). Real etcd and brokers; shards in this process."""

from __future__ import annotations

import asyncio

from tests.support.apps import Relay, seen
from tests.support.waiting import wait_until
from tidings.client import AppendService
from tidings.consumer.shard import Shard, serve_primary
from tidings.message import Publisher
from tidings.protocol.specs import shard_from_dict

SPEC = shard_from_dict({"id": "relay/0", "sources": ["relay/in"], "max_txn_duration": "1s"})


class Watching(Relay):
    def __init__(self) -> None:
        super().__init__()
        self.garbage: list[tuple[str, int]] = []

    def on_garbage(self, shard, journal, garbage) -> None:
        self.garbage.append((journal, garbage.begin))


async def serve_until_read(c, tmp_path, app, head: int) -> Shard:
    stop = asyncio.Event()
    shard = Shard(SPEC, c, data_dir=tmp_path)
    task = asyncio.ensure_future(serve_primary(c, SPEC, app, stop, shard))
    try:
        await wait_until(lambda: task.done() or shard.read_through.get("relay/in", 0) >= head, 30)
    finally:
        stop.set()
        await asyncio.wait([task])
    task.result()
    return shard


async def test_a_producer_that_never_acknowledges_does_not_pin_where_a_new_primary_reads(cluster, tmp_path) -> None:
    await cluster.create_journal("relay/in", 1)
    async with cluster.client() as c:
        dead = Publisher(AppendService(c))  # begins a transaction, never acknowledges it
        await (await dead.publish_uncommitted("relay/in", {"id": "never"}))
        await c.append("relay/in", b"not json\n")
        live = Publisher(AppendService(c))
        await (await live.publish_committed("relay/in", *({"id": f"m{i}"} for i in range(5))))
        head = await c.write_head("relay/in")
        app = Watching()
        await serve_until_read(c, tmp_path, app, head)
        assert [g[0] for g in app.garbage] == ["relay/in"]
        # The next primaries start at the read-through offset, past the garbage and the dead transaction.
        for i in range(2):
            await (await live.publish_committed("relay/in", {"id": f"later{i}"}))
            await serve_until_read(c, tmp_path, app, await c.write_head("relay/in"))
        assert len(app.garbage) == 1, app.garbage
        # The dead transaction still commits if its ACK ever comes (re-read then, from where it began).
        await (await dead.write_ack_intents(dead.build_ack_intents()))
        await serve_until_read(c, tmp_path, app, await c.write_head("relay/in"))
        await dead.service.aclose()
        await live.service.aclose()
    expected = {"never": 1, **{f"m{i}": 1 for i in range(5)}, "later0": 1, "later1": 1}
    assert seen(tmp_path / "relay%2F0.db") == expected
