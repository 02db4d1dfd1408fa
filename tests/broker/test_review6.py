"""Review 6 of 6746257^..17a98e4 (recovery checks before the spool resumes, HEAD at acknowledgement,
`verify_unassigned`).

Each test drives real brokers (child processes over the session etcd) into a scenario the change
mishandles, and fails on 17a98e4.
"""

from __future__ import annotations

import asyncio
import os

from tests.broker.test_review5 import _read_blocking
from tests.support.cluster import FAST_BROKER_FLAGS, create_local_journal
from tests.support.recovery import (
    assert_no_fork,
    local_spools,
    primary_killed_with_a_tail,
    refuses_to_guess,
    route_of,
    routed,
)
from tests.support.waiting import wait_until
from tidings.client import AsyncClient
from tidings.cluster import LocalCluster
from tidings.fragment.store import store_for
from tidings.protocol.status import TidingsError


async def test_an_r1_journal_moved_elsewhere_gets_its_acknowledged_tail_back(etcd, etcd_root, tmp_path) -> None:
    """R=1 over 3 brokers. The journal's only replica P acknowledges appends; its first fragment is in the
    store (the journal's first write rolls at once), the rest only in P's spool. P is killed -9 and the
    journal moves to another broker Q, which rightly refuses appends (INDEX_HAS_GREATER_OFFSET: the store
    reaches past its empty spool). P comes back on its data dir, unassigned. Before the change it persisted
    what it recovered, so the store covers every acknowledged byte and reset-head continues after them
    (tests/broker/test_restart.py, ..._back_elsewhere_needs_reset_head). Now `verify_unassigned` persists
    only what some member is already past: Q's index ends at the store's end, so P's acknowledged tail is
    AHEAD, left on disk for good; the operator can only reset-head below it, and P then drops it."""
    j = "review6/r1-moved"
    lc = LocalCluster(brokers=3, zones=3, data_dir=tmp_path, etcd=etcd.endpoint, root=etcd_root)
    lc.extra = list(FAST_BROKER_FLAGS)
    try:
        lc.start()
        await create_local_journal(lc, j, 1, fragment={"length": "1MiB", "refresh_interval": "1s"})
        async with AsyncClient(lc.endpoints[0]) as c:
            acked = [await c.append(j, f"A{i}: acknowledged by the only replica\n".encode()) for i in range(5)]
        end = acked[-1].end
        route = await route_of(lc.endpoints[0], j)
        assert route is not None
        p = next(b for b in lc.brokers if b.suffix == route.members[route.primary].suffix)
        others = [b for b in lc.brokers if b is not p]
        stored_end = max((f.end for f in store_for(lc.store_url).list(j)), default=0)
        assert 0 < stored_end < end, f"the store holds [0, {stored_end}), P alone [{stored_end}, {end})"
        p.kill()

        async def moved() -> bool:
            r = await route_of(others[0].endpoint, j)
            return r is not None and r.primary >= 0 and r.members[r.primary].suffix != p.suffix

        await wait_until(moved, 60, interval=0.2)

        await wait_until(lambda: refuses_to_guess(others[0].endpoint, j), 30, interval=0.5)
        await asyncio.to_thread(p.start)

        def covered() -> bool:
            return max((f.end for f in store_for(lc.store_url).list(j)), default=0) >= end

        try:
            await wait_until(covered, 30, interval=0.5)
        except Exception as exc:
            said = b"left on disk" in (p.data_dir / "broker.log").read_bytes()
            raise AssertionError(
                f"P came back holding acknowledged [{stored_end}, {end}), the only copy, but never persisted it "
                f"(the store ends at {stored_end}; P logged 'left on disk': {said}): reset-head can only "
                f"continue at {stored_end}, over acknowledged offsets"
            ) from exc
    finally:
        for bp in lc.brokers:
            bp.kill()
        lc.stop()


async def test_a_store_outage_at_restart_skips_before_sync_and_the_journal_rolls_over_a_hole(
    etcd, etcd_root, tmp_path
) -> None:
    """review5's dropped tail, reached through `before_sync` instead of `verify_unassigned`. R=2 over 3
    brokers: primary P commits C past the acknowledged A and is killed before its peer Q has C; the journal
    goes on with Q and S and acknowledges D (shorter than C) at A's end. S dies and P comes back on its
    data dir while the fragment store fails to list (an outage: the journal's folder cannot be read), so
    the journal is assigned to Q and P. `before_sync` returns at the failed listing without asking Q
    (which holds D, contradicting C), and P's spool resumes at C's end. Once the store is back, the route
    rolls forward to C's end, `after_sync` drops C, and offsets [D.end, C.end) are held by nobody: the
    next append E lands after the hole and a reader from D's end waits forever."""
    j = "review6/outage-hole"
    lc = LocalCluster(brokers=3, zones=3, data_dir=tmp_path, etcd=etcd.endpoint, root=etcd_root)
    lc.extra = list(FAST_BROKER_FLAGS)
    folder = tmp_path / "fragments" / j
    away = folder.with_name(folder.name + ".away")
    try:
        lc.start()
        t = await primary_killed_with_a_tail(lc, j)
        a, p, q, s, c_begin, c_end = t.a, t.p, t.q, t.s, t.c_begin, t.c_end
        await wait_until(lambda: routed(q.endpoint, j, {q.suffix, s.suffix}), 60, interval=0.2)
        async with AsyncClient(q.endpoint) as c:
            d = await asyncio.wait_for(c.append(j, b"D\n"), 20)
        assert d.begin == a.end == c_begin and d.end < c_end

        # The store's outage: listing the journal's folder fails (a symlink loop; the tests run as root).
        folder.mkdir(parents=True, exist_ok=True)
        folder.rename(away)
        os.symlink(folder, folder)
        s.kill()
        await asyncio.to_thread(p.start)
        resumed = f"journal {j}: recovered the spool at offset".encode()
        await wait_until(lambda: resumed in (p.data_dir / "broker.log").read_bytes(), 60, interval=0.2)
        folder.unlink()
        away.rename(folder)
        log_line = next(ln for ln in (p.data_dir / "broker.log").read_bytes().splitlines() if resumed in ln)

        await wait_until(lambda: not local_spools(p.data_dir, j), 60, interval=0.2)  # after_sync drops C

        async def appended() -> object:
            try:
                async with AsyncClient(q.endpoint) as c:
                    return await asyncio.wait_for(c.append(j, b"E: after the outage\n"), 10)
            except (TidingsError, TimeoutError):
                return None

        e = await wait_until(appended, 60, interval=0.5)
        async with AsyncClient(q.endpoint) as c:
            try:
                got = await asyncio.wait_for(_read_blocking(c, j, d.end, e.end), 15)
            except TimeoutError:
                got = None
        assert got is not None and got.endswith(b"E: after the outage\n"), (
            f"D ends at {d.end} but E landed at [{e.begin}, {e.end}): P dropped C [{c_begin}, {c_end}) after "
            f"resuming past it ({log_line.decode(errors='replace')!r}), and a reader from {d.end} waits"
        )
        assert_no_fork(lc.store_url, j)
    finally:
        if folder.is_symlink():
            folder.unlink()
        if away.exists():
            away.rename(folder)
        for bp in lc.brokers:
            bp.kill()
        lc.stop()
