"""Review 5 of 6746257 (recovery resumes at the committed end and verifies recovered fragments).

Each test drives real code (real Spool objects, or brokers as child processes over the session etcd)
into a scenario the change mishandles, and fails on 6746257.
"""

from __future__ import annotations

import asyncio

from tests.support.cluster import FAST_BROKER_FLAGS
from tests.support.recovery import assert_no_fork, local_spools, primary_killed_with_a_tail, route_of, routed
from tests.support.waiting import wait_until
from tidings.client import AsyncClient
from tidings.cluster import LocalCluster
from tidings.fragment.store import store_for
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.status import IndexHasGreaterOffsetError, TidingsError


async def _members_listed(endpoints: list[str], journal: str, wanted: set[str]) -> bool:
    """Every endpoint's own index (not proxied) lists every fragment named in `wanted`."""
    for ep in endpoints:
        async with AsyncClient(ep) as c:
            try:
                resp = await c.stub(ep).ListFragments(pb.FragmentsRequest(journal=journal, do_not_proxy=True))
            except Exception:
                return False
            if resp.status != pb.OK:
                return False
            have = {f"{e.spec.begin:016x}-{e.spec.end:016x}" for e in resp.fragments}
            if not wanted <= have:
                return False
    return True


async def test_an_unassigned_restart_does_not_persist_a_tail_the_route_never_had(etcd, etcd_root, tmp_path) -> None:
    """R=2 over 3 brokers. The primary P commits C past the last acknowledged append A (its HEAD covers C:
    recorded at a pipelined acknowledgement or its spool's close) and dies before its peer Q has C. The
    journal goes on with Q and S at A's end. P comes back unassigned: `verify_unassigned` finds no member
    holding C's offsets (they are *behind*, not past them) and persists C. The members then list a store
    fragment past their write head and refuse every append with INDEX_HAS_GREATER_OFFSET (or, had one
    landed before their listing, the store holds two contents at C's offsets). verify_replica waits for a
    synchronized pipeline for exactly this reason; verify_unassigned does not."""
    j = "review5/unassigned-tail"
    lc = LocalCluster(brokers=3, zones=3, data_dir=tmp_path, etcd=etcd.endpoint, root=etcd_root)
    lc.extra = list(FAST_BROKER_FLAGS)
    try:
        lc.start()
        t = await primary_killed_with_a_tail(lc, j)
        a, p, c_begin, c_end = t.a, t.p, t.c_begin, t.c_end
        others = [t.q, t.s]
        assert c_begin == a.end

        await wait_until(lambda: routed(others[0].endpoint, j, {b.suffix for b in others}), 60, interval=0.2)
        await asyncio.to_thread(p.start)
        # P's check of C finds the members behind it: C stays on P's disk, neither persisted nor dropped.
        await wait_until(lambda: b"left on disk" in (p.data_dir / "broker.log").read_bytes(), 60, interval=0.2)
        assert local_spools(p.data_dir, j)
        route = await route_of(others[0].endpoint, j)
        assert route is not None and p.suffix not in {m.suffix for m in route.members}, "P was assigned again"
        stored = {f"{f.begin:016x}-{f.end:016x}" for f in store_for(lc.store_url).list(j)}
        await wait_until(lambda: _members_listed([b.endpoint for b in others], j, stored), 30, interval=0.2)

        async with AsyncClient(others[0].endpoint) as c:
            for i in range(2):
                try:
                    d = await asyncio.wait_for(c.append(j, f"D{i}: after P came back\n".encode()), 20)
                except IndexHasGreaterOffsetError as exc:
                    raise AssertionError(
                        f"the journal refuses appends after P persisted [{c_begin}, {c_end}), which no member "
                        f"held (store: {sorted(stored)}): {exc}"
                    ) from exc
                assert d.begin >= a.end
        assert_no_fork(lc.store_url, j)
    finally:
        for bp in lc.brokers:
            bp.kill()
        lc.stop()


async def test_a_dropped_tail_leaves_no_hole_the_journal_never_fills(etcd, etcd_root, tmp_path) -> None:
    """As above, but the journal writes D (shorter than C) at A's end before P comes back, so P's check
    drops C. P's HEAD still records C's end, though, and the spool of its next replica of the journal
    resumes there: once P is a member again, the route rolls forward to C's end, past offsets
    [D.end, C.end) that no replica holds. The next append E lands after that hole, and a reader of the
    journal from D's end waits forever (the hole is neither the journal's start nor old)."""
    j = "review5/dropped-tail"
    lc = LocalCluster(brokers=3, zones=3, data_dir=tmp_path, etcd=etcd.endpoint, root=etcd_root)
    lc.extra = list(FAST_BROKER_FLAGS)
    try:
        lc.start()
        t = await primary_killed_with_a_tail(lc, j)
        a, p, q, s, c_begin, c_end = t.a, t.p, t.q, t.s, t.c_begin, t.c_end

        await wait_until(lambda: routed(q.endpoint, j, {q.suffix, s.suffix}), 60, interval=0.2)
        async with AsyncClient(q.endpoint) as c:
            d = await asyncio.wait_for(c.append(j, b"D\n"), 20)
        assert d.begin == a.end == c_begin and d.end < c_end

        await asyncio.to_thread(p.start)
        await wait_until(lambda: not local_spools(p.data_dir, j), 60, interval=0.2)  # C is dropped
        s.kill()  # the journal moves to Q and P
        await wait_until(lambda: routed(q.endpoint, j, {q.suffix, p.suffix}), 60, interval=0.2)

        async def appended() -> object:
            try:
                async with AsyncClient(q.endpoint) as c:
                    return await asyncio.wait_for(c.append(j, b"E: after P is a member again\n"), 10)
            except (TidingsError, TimeoutError):
                return None

        e = await wait_until(appended, 60, interval=0.5)
        async with AsyncClient(q.endpoint) as c:
            try:
                got = await asyncio.wait_for(
                    c.read_all(j, d.end, end_offset=e.end) if e.begin == d.end else _read_blocking(c, j, d.end, e.end),
                    15,
                )
            except TimeoutError:
                got = None
        assert got is not None and got.endswith(b"E: after P is a member again\n"), (
            f"D ends at {d.end} but E landed at [{e.begin}, {e.end}): offsets [{d.end}, {e.begin}) are held by "
            f"no replica (P dropped C [{c_begin}, {c_end}) but resumed past it), and a reader from {d.end} waits"
        )
    finally:
        for bp in lc.brokers:
            bp.kill()
        lc.stop()


async def _read_blocking(c: AsyncClient, journal: str, begin: int, end: int) -> bytes:
    return b"".join([ch.content async for ch in c.read(journal, begin, block=True, end_offset=end)])
