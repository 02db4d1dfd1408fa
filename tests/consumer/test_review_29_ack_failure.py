"""Review 29: transaction N's ACKs failing for good (here: its downstream journal deleted between the
store commit and the ACK append) is only noticed by N+1's commit or a graceful stop. With no more
input the shard stays PRIMARY for ever, its progress frozen (Stat waits out its deadline) and N's
downstream messages never acknowledged, instead of failing the shard with the reason."""

from __future__ import annotations

import asyncio

import pytest

from tests.consumer.test_shard import WordCount, produce, spec
from tidings.consumer.shard import Shard, serve_primary
from tidings.protocol import protocol_pb2 as pb


class DeletesDownstreamAfterCommit(WordCount):
    def __init__(self, path, client) -> None:
        super().__init__(path)
        self.client, self.deleted = client, False

    async def finished_txn(self, shard, store, commit) -> None:
        await commit
        if not self.deleted:  # (an operator deleting the downstream journal at this moment)
            self.deleted = True
            revision = {j.spec.name: j.mod_revision for j in (await self.client.list()).journals}["wc/out"]
            await self.client.apply([pb.ApplyRequest.Change(delete="wc/out", expect_mod_revision=revision)])


async def test_failed_acks_fail_the_idle_shard(cluster, tmp_path) -> None:
    await cluster.create_journal("wc/in", 1)
    await cluster.create_journal("wc/out", 1)
    await produce(cluster, ["apple", "fig"] * 10)
    async with cluster.client() as c:
        app = DeletesDownstreamAfterCommit(tmp_path / "wc.db", c)
        stop = asyncio.Event()
        shard = Shard(spec(), c)
        task = asyncio.ensure_future(serve_primary(c, spec(), app, stop, shard))
        try:
            done, _ = await asyncio.wait([task], timeout=10)
            assert done, (
                f"the shard runs on although its last ACKs failed (read_through {shard.read_through}, "
                f"deleted={app.deleted})"
            )
            with pytest.raises(Exception):  # noqa: B017 (any failure naming the journal will do)
                task.result()
        finally:
            stop.set()
            if not task.done():
                task.cancel()
            await asyncio.wait([task])
