"""Review 7 of 17a98e4..65b658a (recovery checks ask members first, the zero-byte probe of
`verify_unassigned`, the resume offset cleared only once an append went past it).

In-process brokers (TestCluster) over the session etcd; fails on 65b658a.
"""

from __future__ import annotations

import asyncio

from tests.support.cluster import TestCluster
from tests.support.waiting import wait_until
from tidings.allocator.keys import item_key
from tidings.broker.service import Broker
from tidings.client import AppendResult
from tidings.fragment.store import store_for
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.status import IndexHasGreaterOffsetError, TidingsError

J = "review7/resumed"


def _suspend_offset(broker: Broker) -> int:
    kv = broker.keyspace.get(item_key(broker.config.root, J))
    return kv.decoded.suspend.offset if kv is not None else -1


async def test_an_append_acknowledged_past_the_resume_offset_is_not_handed_out_again_after_every_replica_is_lost(
    etcd, etcd_root, tmp_path
) -> None:
    """A journal resumed at R (its spec's `suspend.offset`, as `_record_resume_offsets` writes it) takes an
    append at R, acknowledged OK. Since 65b658a the offset is cleared only by a *later* append or pulse
    (`spool.end > resume`), so until then the spec still says "resume at R". If every replica is lost in
    that window (here: the only one, R=1, stopped without persisting the fragment, as kill -9 would), the
    journal's next primary rolls its empty spool to R and hands the acknowledged offsets out again, where
    it must refuse (INDEX_HAS_GREATER_OFFSET, DESIGN.md invariant 6; the store reaches R, its spool 0)
    and an operator's reset-head, or `verify_unassigned` on the lost broker's disk, must decide.
    On 17a98e4 the first append at R cleared the offset before it streamed a byte."""
    tc = TestCluster(etcd.endpoint, etcd_root, tmp_path, pulse_interval=600.0)
    try:
        b0 = await tc.add_broker("zone-a")
        await tc.create_journal(J, 1)
        async with tc.client(0) as c:
            first = await c.append(J, b"persisted before the stop\n")
            resume = first.end
            item = next(j for j in (await c.list()).journals if j.spec.name == J)
            spec = pb.JournalSpec()
            spec.CopyFrom(item.spec)
            spec.suspend.offset = resume  # the journal was stopped here and resumed
            await c.apply([pb.ApplyRequest.Change(upsert=spec, expect_mod_revision=item.mod_revision)])
            await wait_until(lambda: _suspend_offset(b0) == resume, 10)
            acked = await c.append(J, b"acknowledged past the resume offset\n")
        assert acked.begin == resume

        store = store_for(tc.store_url)
        await wait_until(lambda: any(f.end == resume for f in store.list(J)), 10)  # [0, R) persisted on the roll
        held_at_loss = _suspend_offset(b0)
        await b0.stop(graceful=False)
        for f in store.list(J):  # kill -9 before the primary persisted its last fragment: only [0, R) is stored
            if f.end > resume:
                store.remove(f)
        b1 = await tc.add_broker("zone-b")

        outcome: list[AppendResult | str] = []

        async def settled() -> bool:
            async with tc.client(1) as c1:
                try:
                    outcome[:] = [await asyncio.wait_for(c1.append(J, b"a new append\n"), 10)]
                except IndexHasGreaterOffsetError:
                    outcome[:] = ["refused"]  # refuses to guess: right
                except (TidingsError, TimeoutError):
                    return False  # not assigned to b1 yet: ask again
            return True

        await wait_until(settled, 60, interval=0.5)
        got = outcome[0]
        assert got == "refused", (
            f"the acknowledged append [{acked.begin}, {acked.end}) was lost with its only replica, and its "
            f"offsets were handed out again at {got} without an operator: the journal's spec still named "
            f"resume offset {held_at_loss} when it was lost (new primary {b1.endpoint})"
        )
    finally:
        await tc.stop()
