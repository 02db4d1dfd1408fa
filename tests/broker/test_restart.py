"""Restarts of a whole cluster on its data dirs, and the resume offset a stop leaves for the journal's next
primary: no acknowledged append is lost or has its offsets handed out again (DESIGN.md invariants 1, 2
and 6).

Brokers run as child processes (LocalCluster) over the session etcd, or in this process (TestCluster)
where a test steps a broker by hand. A journal without `stores`
persists to the cluster's default store. After a stop (SIGTERM, or kill -9) and a start of the
same brokers on the same data dirs, every acknowledged append reads back at its offsets and the
next append lands after them: no committed byte lost, no offset handed out twice.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.support.cluster import FAST_BROKER_FLAGS, TestCluster
from tests.support.waiting import wait_until
from tidings.allocator.keys import item_key
from tidings.broker.pulse import pulse_once
from tidings.broker.service import Broker
from tidings.client import AppendResult, AsyncClient
from tidings.cluster import LocalCluster
from tidings.fragment.store import store_for
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.specs import spec_from_dict
from tidings.protocol.status import IndexHasGreaterOffsetError, TidingsError

J = "restart/journal"


def _cluster(etcd, root: str, data_dir, brokers: int) -> LocalCluster:
    lc = LocalCluster(brokers=brokers, zones=min(brokers, 3), data_dir=data_dir, etcd=etcd.endpoint, root=root)
    lc.extra = list(FAST_BROKER_FLAGS)
    return lc


async def _wait_primary(endpoint: str) -> None:
    async with AsyncClient(endpoint) as c:

        async def ready() -> bool:
            resp = await c.list()
            return any(j.spec.name == J and j.route.primary >= 0 for j in resp.journals)

        await wait_until(ready, 30)


def _append_to(path, content: bytes) -> None:
    with open(path, "ab") as f:
        f.write(content)


async def _spec_in_etcd(etcd, root: str) -> pb.JournalSpec:
    from tidings.keyspace.etcd import Etcd

    client = await Etcd.connect(etcd.endpoint)
    try:
        kv, _ = await client.get(item_key(root, J))
    finally:
        await client.aclose()
    assert kv is not None
    return pb.JournalSpec.FromString(kv.value)


async def _append_some(endpoint: str, n: int, tag: str) -> list[tuple[int, int, bytes]]:
    spans = []
    async with AsyncClient(endpoint) as c:
        for i in range(n):
            content = f"{tag}-{i:04d}\n".encode() * (1 + i % 7)
            r = await c.append(J, content)
            spans.append((r.begin, r.end, content))
    return spans


@pytest.mark.parametrize(
    ("replication", "brokers", "how"),
    [
        pytest.param(1, 3, "sigterm", id="R1-sigterm"),
        pytest.param(3, 3, "sigterm", id="R3-sigterm"),
        pytest.param(1, 1, "kill-9", id="R1-kill9"),
        pytest.param(3, 3, "kill-9", id="R3-kill9"),
    ],
)
async def test_a_restarted_cluster_keeps_every_ok_append_and_never_reuses_an_offset(
    etcd, etcd_root, tmp_path, replication: int, brokers: int, how: str
) -> None:
    lc = _cluster(etcd, etcd_root, tmp_path, brokers)
    try:
        lc.start()
        spec = spec_from_dict({"name": J, "replication": replication, "fragment": {"length": "2KiB"}})
        async with AsyncClient(lc.endpoints[0]) as c:
            await c.apply([pb.ApplyRequest.Change(upsert=spec)])
        await _wait_primary(lc.endpoints[0])
        spans = await _append_some(lc.endpoints[0], 40, "before")
    finally:
        if how == "kill-9":
            for b in lc.brokers:
                b.kill()
        lc.stop()
    if how == "sigterm":  # its last holders recorded where it ends, for any next primary
        assert (await _spec_in_etcd(etcd, etcd_root)).suspend.offset == spans[-1][1]
    lc = _cluster(etcd, etcd_root, tmp_path, brokers)
    try:
        lc.start()
        await _wait_primary(lc.endpoints[0])
        async with AsyncClient(lc.endpoints[0]) as c:
            # Blocking: a restarted replica serves what it recovered once it has checked it against the
            # others (broker/recovery.py); until then a read waits there (a non-blocking one stops).
            async def read_back() -> bytes:
                return b"".join([ch.content async for ch in c.read(J, 0, block=True, end_offset=spans[-1][1])])

            data = await asyncio.wait_for(read_back(), 60)
            for begin, end, content in spans:
                assert data[begin:end] == content, f"[{begin}, {end}) did not survive the restart"
            assert len(data) == spans[-1][1]
            assert await c.write_head(J) == spans[-1][1]
            after = await c.append(J, b"after the restart\n")
            assert after.begin == spans[-1][1], "the next append lands after every earlier one"
    finally:
        lc.stop()


async def test_a_journal_killed_with_every_replica_and_back_elsewhere_needs_reset_head(
    etcd, etcd_root, tmp_path
) -> None:
    """Kill -9 of every replica of an R=1 journal, whose next primary is another broker: nothing tells
    that broker nobody else holds more, so it refuses (Invariant 6) until reset-head, then continues
    after every acknowledged byte (the killed broker persisted what it recovered when it came back)."""
    lc = _cluster(etcd, etcd_root, tmp_path, 3)
    try:
        lc.start()
        spec = spec_from_dict({"name": J, "replication": 1, "fragment": {"length": "2KiB"}})
        async with AsyncClient(lc.endpoints[0]) as c:
            await c.apply([pb.ApplyRequest.Change(upsert=spec)])
            await _wait_primary(lc.endpoints[0])
            spans = await _append_some(lc.endpoints[0], 20, "before")
            route = next(j.route for j in (await c.list()).journals if j.spec.name == J)
        holder = route.members[route.primary].suffix
    finally:
        for b in lc.brokers:
            b.kill()
        lc.stop()
    lc = _cluster(etcd, etcd_root, tmp_path, 3)
    try:
        lc.start()
        await _wait_primary(lc.endpoints[0])
        async with AsyncClient(lc.endpoints[0]) as c:
            end = spans[-1][1]
            try:
                after = await c.append(J, b"x")
            except IndexHasGreaterOffsetError:
                # Another broker than `holder` took it: wait until `holder` persisted what it recovered.
                async def persisted() -> bool:
                    frags = await c.fragments(J)
                    return max((e.spec.end for e in frags.fragments), default=0) >= end

                await wait_until(persisted, 30)
                await c.append(J, b"", offset=end)  # `journals reset-head`
                after = await c.append(J, b"x")
            data = await c.read_all(J)
            assert all(data[b:e] == content for b, e, content in spans), f"lost data (holder was {holder})"
            assert after.begin == end
    finally:
        lc.stop()


async def test_a_commit_no_peer_acknowledged_does_not_come_back_over_a_later_append(etcd, etcd_root, tmp_path) -> None:
    """A resurrected commit: the primary applies an append's commit to its own spool, and is
    killed before any peer has it. The journal goes on without it, acknowledging another append at the
    same offsets. When the killed broker returns on its data dir it must not bring its commit back."""
    from tidings.broker.replica import spool_directory

    lc = _cluster(etcd, etcd_root, tmp_path, 3)
    try:
        lc.start()
        spec = spec_from_dict({"name": J, "replication": 2, "fragment": {"length": "1MiB", "refresh_interval": "1s"}})
        async with AsyncClient(lc.endpoints[0]) as c:
            await c.apply([pb.ApplyRequest.Change(upsert=spec)])
        await _wait_primary(lc.endpoints[0])
        spans = await _append_some(lc.endpoints[0], 3, "acked-before")
        async with AsyncClient(lc.endpoints[0]) as c:
            route = next(j.route for j in (await c.list()).journals if j.spec.name == J)
        p = next(b for b in lc.brokers if b.suffix == route.members[route.primary].suffix)
        p.kill()
        # What the primary's disk holds had it died right after applying a commit no peer got: its
        # content, past the committed end its HEAD records (the primary records it when peers acknowledge).
        directory = spool_directory(p.data_dir, J)
        current = next(f for f in directory.iterdir() if f.name.startswith("spool-"))
        await asyncio.to_thread(_append_to, current, b"X" * 200)
        others = [b.endpoint for b in lc.brokers if b is not p]
        async with AsyncClient(others[0]) as c:
            y = await asyncio.wait_for(c.append(J, b"acked-after-failover\n"), 60)
            assert y.begin == spans[-1][1]
            await asyncio.to_thread(p.start)

            # Every broker, P included, comes to serve Y at its offsets: a replica serves reads up to
            # its own write head, and P's reaches Y once the primary's pulse has synced it. Had P
            # brought its commit back, its X's would sit at Y's offsets and this would never hold.
            for b in lc.brokers:
                async with AsyncClient(b.endpoint) as cb:

                    async def serves_y() -> bool:
                        return (await cb.read_all(J))[y.begin : y.end] == b"acked-after-failover\n"

                    await wait_until(serves_y, 30, interval=0.1)
                    assert b"XXXX" not in await cb.read_all(J)
    finally:
        lc.stop()


async def test_a_resume_offset_recorded_while_the_primary_still_runs_is_not_cleared_by_its_pulse(
    etcd, etcd_root, tmp_path
) -> None:
    """Brokers stopping together: one records the journal's resume offset (its end) while the primary,
    stopping too, still pulses. A zero-byte append at exactly that offset is no resumption: clearing the
    offset then would leave the journal's next primary nothing to resume at (seen under load, 3 in 25
    runs of the R3-sigterm restart). The offset goes at the next client append, before it writes there
    (left longer, every replica lost meanwhile, a new primary would roll to it and write over that
    append: the test below)."""
    tc = TestCluster(etcd.endpoint, etcd_root, tmp_path, pulse_interval=600.0)
    try:
        for zone in ("zone-a", "zone-b", "zone-c"):
            await tc.add_broker(zone)
        await tc.create_journal(J, 3)
        async with tc.client(0) as c:
            last = await c.append(J, b"the last append before the stop\n")
            item = next(j for j in (await c.list()).journals if j.spec.name == J)
            spec = pb.JournalSpec()
            spec.CopyFrom(item.spec)
            spec.suspend.offset = last.end  # what `_record_resume_offsets` writes
            await c.apply([pb.ApplyRequest.Change(upsert=spec, expect_mod_revision=item.mod_revision)])
            await wait_until(lambda: _suspend_offset(tc.brokers[0]) == last.end, 10)
            primary = next(b for b in tc.brokers if b.resolver.replicas.get(J) and _is_primary(b))
            await pulse_once(primary, primary.resolver.replicas[J])
            assert (await _spec_in_etcd(etcd, etcd_root)).suspend.offset == last.end, "cleared by a pulse"
            resumed = await c.append(J, b"resumed\n")
            assert resumed.begin == last.end
            assert (await _spec_in_etcd(etcd, etcd_root)).suspend.offset == 0
    finally:
        await tc.stop()


def _is_primary(broker) -> bool:
    route = broker.resolver.state.route(J)
    return route.primary >= 0 and route.members[route.primary].suffix == broker.config.suffix


def _suspend_offset(broker: Broker) -> int:
    kv = broker.keyspace.get(item_key(broker.config.root, J))
    return kv.decoded.suspend.offset if kv is not None else -1


async def test_an_append_acknowledged_past_the_resume_offset_is_not_handed_out_again_after_every_replica_is_lost(
    etcd, etcd_root, tmp_path
) -> None:
    """A journal resumed at R (its spec's `suspend.offset`, as `_record_resume_offsets` writes it) takes an
    append at R, acknowledged OK, and then loses every replica (here: the only one, R=1, stopped without
    persisting the fragment, as kill -9 would). The journal's next primary must not roll its empty spool
    to R and hand the acknowledged offsets out again: it refuses (INDEX_HAS_GREATER_OFFSET, DESIGN.md
    invariant 6; the store reaches R, its spool 0), and an operator's reset-head, or `verify_unassigned`
    on the lost broker's disk, decides. So the append at R clears the offset from the spec before it
    streams a byte, not a later append or pulse (`spool.end > resume`)."""
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
