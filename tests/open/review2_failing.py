"""Review 2 of the acknowledged-end (HEAD) recovery: scenarios that break DESIGN.md invariants 1 and 2.

Brokers run as child processes (LocalCluster) over the session etcd, so `kill -9` is real.
"""

from __future__ import annotations

import asyncio

from tests.support.cluster import FAST_BROKER_FLAGS
from tests.support.waiting import wait_until

from tidings.broker.replica import spool_directory
from tidings.client import AppendResult, AsyncClient
from tidings.cluster import LocalCluster
from tidings.fragment.spool import HEAD, _read_head
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.specs import spec_from_dict
from tidings.protocol.status import TidingsError

J = "review2/journal"


async def _route(endpoint: str) -> pb.Route | None:
    async with AsyncClient(endpoint) as c:
        for j in (await c.list()).journals:
            if j.spec.name == J:
                return j.route
    return None


async def test_an_acknowledged_append_survives_when_its_primary_is_not_back_first(etcd, etcd_root, tmp_path) -> None:
    """R=2 over 3 brokers. The last acknowledged append A is in the HEAD of its primary Q only: its peer P
    learns the acknowledged end from the next proposal, which never comes (both are killed at once).
    P comes back first and the journal goes on with P and the third broker S: P recovered only up to
    its lagging HEAD, so the next append is handed A's offsets (A is lost; when Q comes back and persists
    what it recovered, two different fragments cover the same offsets)."""
    lc = LocalCluster(brokers=3, zones=3, data_dir=tmp_path, etcd=etcd.endpoint, root=etcd_root)
    # A long pulse: no zero-byte append follows A (it would tell P the acknowledged end). A busy journal
    # gets the same effect from a kill within one pulse interval of its last append.
    lc.extra = [*FAST_BROKER_FLAGS, "--pulse-interval", "60"]
    try:
        lc.start()
        spec = spec_from_dict({"name": J, "replication": 2, "fragment": {"length": "1MiB", "refresh_interval": "1s"}})
        async with AsyncClient(lc.endpoints[0]) as c:
            await c.apply([pb.ApplyRequest.Change(upsert=spec)])

        async def has_primary() -> bool:
            route = await _route(lc.endpoints[0])
            return route is not None and route.primary >= 0 and len(route.members) == 2

        await wait_until(has_primary, 30)
        async with AsyncClient(lc.endpoints[0]) as c:
            for i in range(3):
                await c.append(J, f"acked-{i}\n".encode())
            a = await c.append(J, b"the last acknowledged append\n")
        route = await _route(lc.endpoints[0])
        assert route is not None
        q_suffix = route.members[route.primary].suffix
        p_suffix = next(m.suffix for i, m in enumerate(route.members) if i != route.primary)
        q = next(b for b in lc.brokers if b.suffix == q_suffix)
        p = next(b for b in lc.brokers if b.suffix == p_suffix)
        s = next(b for b in lc.brokers if b not in (p, q))
        q.kill()
        p.kill()

        q_head = _read_head(spool_directory(q.data_dir, J) / HEAD, J)
        p_head = _read_head(spool_directory(p.data_dir, J) / HEAD, J)
        assert q_head is not None and q_head.acknowledged_end == a.end  # the client heard OK after this
        assert p_head is not None and p_head.acknowledged_end < a.end  # the peer's HEAD lags (by design)

        await asyncio.to_thread(p.start)  # Q's machine is slow to come back

        async def routed_to_p_and_s() -> bool:
            r = await _route(s.endpoint)
            return (
                r is not None and r.primary >= 0 and {m.suffix for m in r.members} == {p.suffix, s.suffix}
            )

        await wait_until(routed_to_p_and_s, 60, interval=0.2)

        async def append_b() -> AppendResult | None:
            try:
                async with AsyncClient(s.endpoint) as c:
                    return await asyncio.wait_for(c.append(J, b"B, after the restart\n"), 10)
            except (TidingsError, TimeoutError):
                return None

        b = await wait_until(append_b, 60, interval=0.5)
        assert b.begin >= a.end, (
            f"offsets [{b.begin}, {b.end}) handed out again: the acknowledged append A [{a.begin}, {a.end}) "
            f"is lost (P recovered to its HEAD at {p_head.acknowledged_end})"
        )
    finally:
        for bp in lc.brokers:
            bp.kill()
        lc.stop()
