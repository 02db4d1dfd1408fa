"""Recovered spool content is checked against the journal before it is served or persisted
(`tidings.broker.recovery`): a restart keeps what this broker committed, never hands its offsets out
again, and never forks the journal with bytes the other replicas wrote over meanwhile.

Brokers run as child processes (LocalCluster) over the session etcd, so `kill -9` is real.
"""

from __future__ import annotations

import asyncio
import hashlib

from tests.support.cluster import FAST_BROKER_FLAGS, create_local_journal
from tests.support.recovery import (
    append_eventually,
    assert_no_fork,
    local_spools,
    refuses_to_guess,
    route_of,
    routed,
)
from tests.support.waiting import wait_until
from tidings.client import AsyncClient
from tidings.cluster import LocalCluster
from tidings.fragment.store import store_for
from tidings.protocol.status import TidingsError


async def test_an_acknowledged_append_survives_when_its_primary_is_not_back_first(etcd, etcd_root, tmp_path) -> None:
    """Review 2, finding 1. R=2 over 3 brokers: the last acknowledged append A, then its primary Q and peer
    P are killed -9 together and only P comes back (the journal goes on with P and the third broker S).
    P resumes past A (its HEAD records each commit before it answers it), so the next append lands after
    A and A reads back; when Q comes back, what it recovered is checked and persisted without forking
    the store."""
    j = "verify/acked"
    lc = LocalCluster(brokers=3, zones=3, data_dir=tmp_path, etcd=etcd.endpoint, root=etcd_root)
    lc.extra = [*FAST_BROKER_FLAGS, "--pulse-interval", "60"]  # no zero-byte append follows A
    try:
        lc.start()
        await create_local_journal(lc, j, 2, fragment={"length": "1MiB", "refresh_interval": "1s"})
        await wait_until(lambda: routed(lc.endpoints[0], j, n=2), 30)
        async with AsyncClient(lc.endpoints[0]) as c:
            for i in range(3):
                await c.append(j, f"acked-{i}\n".encode())
            a = await c.append(j, b"the last acknowledged append\n")
        route = await route_of(lc.endpoints[0], j)
        assert route is not None
        q_suffix = route.members[route.primary].suffix
        p_suffix = next(m.suffix for i, m in enumerate(route.members) if i != route.primary)
        q = next(b for b in lc.brokers if b.suffix == q_suffix)
        p = next(b for b in lc.brokers if b.suffix == p_suffix)
        s = next(b for b in lc.brokers if b not in (p, q))
        q.kill()
        p.kill()
        await asyncio.to_thread(p.start)  # Q's machine is slow to come back

        await wait_until(lambda: routed(s.endpoint, j, {p.suffix, s.suffix}), 60, interval=0.2)
        b = await append_eventually(s.endpoint, j, b"B, after the restart\n")
        assert b.begin >= a.end, f"offsets [{b.begin}, {b.end}) handed out again: A [{a.begin}, {a.end}) is lost"
        async with AsyncClient(s.endpoint) as c:
            got = b"".join([ch.content async for ch in c.read(j, a.begin, block=True, end_offset=a.end)])
        assert got == b"the last acknowledged append\n"

        await asyncio.to_thread(q.start)
        await wait_until(lambda: not local_spools(q.data_dir, j), 60, interval=0.2)
        assert_no_fork(lc.store_url, j)
    finally:
        for bp in lc.brokers:
            bp.kill()
        lc.stop()


async def test_content_the_journal_wrote_over_while_its_broker_was_down_is_dropped(etcd, etcd_root, tmp_path) -> None:
    """R=1. Broker A holds [x2 x3] beyond the journal's first (persisted) fragment and is killed -9. The
    journal moves to B, which refuses to guess (INDEX_HAS_GREATER_OFFSET) until an operator resets the
    head at the store's end, where Y is written. When A comes back, what it recovered at Y's offsets is
    other bytes: it is dropped, never persisted beside Y."""
    j = "verify/forked"
    lc = LocalCluster(brokers=2, zones=2, data_dir=tmp_path, etcd=etcd.endpoint, root=etcd_root)
    lc.extra = list(FAST_BROKER_FLAGS)
    try:
        lc.start()
        await create_local_journal(lc, j, 1, fragment={"length": "1MiB", "refresh_interval": "1s"})
        async with AsyncClient(lc.endpoints[0]) as c:
            x1 = await c.append(j, b"x1: the first write\n")
            await c.append(j, b"x2: only on A\n")  # rolls: [x1] is persisted at once (a dirty index)
            x3 = await c.append(j, b"x3: only on A\n")
        await wait_until(lambda: any(f.end == x1.end for f in store_for(lc.store_url).list(j)), 30)
        route = await route_of(lc.endpoints[0], j)
        assert route is not None
        a = next(bp for bp in lc.brokers if bp.suffix == route.members[route.primary].suffix)
        b = next(bp for bp in lc.brokers if bp is not a)
        a.kill()

        await wait_until(lambda: refuses_to_guess(b.endpoint, j), 60, interval=0.5)
        y = await append_eventually(b.endpoint, j, b"Y: written after the reset-head\n", offset=x1.end)
        assert y.begin == x1.end < x3.end

        await asyncio.to_thread(a.start)
        await wait_until(lambda: not local_spools(a.data_dir, j), 60, interval=0.2)
        frags = assert_no_fork(lc.store_url, j)
        forked = hashlib.sha1(b"x2: only on A\nx3: only on A\n").digest()
        assert all(f.sum != forked for f in frags), "A's overwritten content reached the store"
        async with AsyncClient(b.endpoint) as c:
            got = b"".join([ch.content async for ch in c.read(j, y.begin, block=True, end_offset=y.end)])
        assert got == b"Y: written after the reset-head\n"
    finally:
        for bp in lc.brokers:
            bp.kill()
        lc.stop()


async def test_a_tail_only_an_unassigned_broker_holds_is_persisted_when_the_journal_refuses_to_guess(
    etcd, etcd_root, tmp_path
) -> None:
    """R=1. Broker H holds [x2 x3] past the journal's first (persisted) fragment; H and B are killed -9
    together and B comes back first, so the journal is B's: B refuses to guess (INDEX_HAS_GREATER_OFFSET).
    H comes back unassigned. Its tail is past B's end, but B is stuck rather than live below it, so H
    persists the tail (the only copy of acknowledged appends), and the operator's reset-head lands after
    every acknowledged byte."""
    j = "verify/stuck"
    lc = LocalCluster(brokers=2, zones=2, data_dir=tmp_path, etcd=etcd.endpoint, root=etcd_root)
    lc.extra = list(FAST_BROKER_FLAGS)
    try:
        lc.start()
        await create_local_journal(lc, j, 1, fragment={"length": "1MiB", "refresh_interval": "1s"})
        async with AsyncClient(lc.endpoints[0]) as c:
            x1 = await c.append(j, b"x1: the first write\n")
            await c.append(j, b"x2: acknowledged, only on H\n")  # rolls: [x1] is persisted at once
            x3 = await c.append(j, b"x3: acknowledged, only on H\n")
        await wait_until(lambda: any(f.end == x1.end for f in store_for(lc.store_url).list(j)), 30)
        route = await route_of(lc.endpoints[0], j)
        assert route is not None
        h = next(bp for bp in lc.brokers if bp.suffix == route.members[route.primary].suffix)
        b = next(bp for bp in lc.brokers if bp is not h)
        h.kill()
        b.kill()
        await asyncio.to_thread(b.start)

        await wait_until(lambda: refuses_to_guess(b.endpoint, j), 60, interval=0.5)
        await asyncio.to_thread(h.start)
        await wait_until(lambda: any(f.end == x3.end for f in store_for(lc.store_url).list(j)), 60, interval=0.2)
        route = await route_of(b.endpoint, j)
        assert route is not None and [m.suffix for m in route.members] == [b.suffix], "H was assigned the journal"

        async def reset_head() -> bool:
            try:
                async with AsyncClient(b.endpoint) as c:
                    await asyncio.wait_for(c.append(j, b"", offset=x3.end), 10)  # `journals reset-head`
            except (TidingsError, TimeoutError):
                return False
            return True

        await wait_until(reset_head, 60, interval=0.5)
        async with AsyncClient(b.endpoint) as c:
            y = await c.append(j, b"y: after the reset-head\n")
            assert y.begin == x3.end
            data = await c.read_all(j)
        assert data == (
            b"x1: the first write\nx2: acknowledged, only on H\nx3: acknowledged, only on H\ny: after the reset-head\n"
        )
        assert_no_fork(lc.store_url, j)
    finally:
        for bp in lc.brokers:
            bp.kill()
        lc.stop()
