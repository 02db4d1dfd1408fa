"""Recovered spool content is checked against the journal before it is served, persisted or resumed
past (`tidings.broker.recovery`): a restart keeps what this broker committed, never hands its offsets out
again, never leaves a hole no replica holds, and never forks the journal with bytes the other replicas
wrote over meanwhile (DESIGN.md invariants 1, 2 and 6).

Brokers run as child processes (LocalCluster) over the session etcd, so `kill -9` is real.
"""

from __future__ import annotations

import asyncio
import hashlib
import os

import pytest

from tests.support import recovery
from tests.support.cluster import FAST_BROKER_FLAGS, create_local_journal
from tests.support.recovery import (
    append_eventually,
    assert_no_fork,
    local_spools,
    primary_killed_with_a_tail,
    refuses_to_guess,
    route_of,
    routed,
)
from tests.support.waiting import wait_until
from tidings.auth import KeyedAuthorizer, KeySet, generate_key
from tidings.client import AsyncClient
from tidings.cluster import LocalCluster
from tidings.fragment.store import store_for
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.status import IndexHasGreaterOffsetError, TidingsError


@pytest.mark.parametrize("keys", ["", generate_key()], ids=["plaintext", "tokens"])
async def test_an_acknowledged_append_survives_when_its_primary_is_not_back_first(
    etcd, etcd_root, tmp_path, monkeypatch, keys: str
) -> None:
    """R=2 over 3 brokers: the last acknowledged append A, then its primary Q and peer P are killed -9
    together and only P comes back (the journal goes on with P and the third broker S). P resumes past A
    (its HEAD records each commit before it answers it), so the next append lands after A and A reads
    back; when Q comes back, what it recovered is checked and persisted without forking the store. With
    keys, the recovery's checks of the other members carry the broker's own tokens."""
    if keys:
        monkeypatch.setattr(recovery, "AUTH", KeyedAuthorizer(KeySet.parse(keys), sub="tests"))
    j = "verify/acked"
    lc = LocalCluster(brokers=3, zones=3, data_dir=tmp_path, etcd=etcd.endpoint, root=etcd_root, auth_keys=keys)
    lc.extra = [*FAST_BROKER_FLAGS, "--pulse-interval", "60"]  # no zero-byte append follows A
    try:
        lc.start()
        await create_local_journal(lc, j, 2, fragment={"length": "1MiB", "refresh_interval": "1s"}, auth=recovery.AUTH)
        await wait_until(lambda: routed(lc.endpoints[0], j, n=2), 30)
        async with recovery.client(lc.endpoints[0]) as c:
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
        async with recovery.client(s.endpoint) as c, asyncio.timeout(60):  # (unverified content is not served)
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
    journal goes on with Q and S at A's end. P comes back unassigned, and its check (`verify_unassigned`)
    finds the members *behind* C's offsets, not past them: C stays on P's disk, neither persisted nor
    dropped. Persisted, C would be a store fragment past the members' write head: they would refuse every
    append with INDEX_HAS_GREATER_OFFSET (or, had one landed before their listing, the store would hold
    two contents at C's offsets)."""
    j = "verify/unassigned-tail"
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
    drops C. P's HEAD still records C's end, and the spool of its next replica of the journal must not
    resume there: once P is a member again, the route would roll forward to C's end, past offsets
    [D.end, C.end) that no replica holds, and a reader of the journal from D's end would wait forever
    (the hole is neither the journal's start nor old). The next append E is read from D's end."""
    j = "verify/dropped-tail"
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


async def test_an_r1_journal_moved_elsewhere_gets_its_acknowledged_tail_back(etcd, etcd_root, tmp_path) -> None:
    """R=1 over 3 brokers. The journal's only replica P acknowledges appends; its first fragment is in the
    store (the journal's first write rolls at once), the rest only in P's spool. P is killed -9 and the
    journal moves to another broker Q, which rightly refuses appends (INDEX_HAS_GREATER_OFFSET: the store
    reaches past its empty spool). P comes back on its data dir, unassigned, with the only copy of an
    acknowledged tail. Q's index ends at the store's end, so the tail is ahead of every member, but Q
    refuses to guess rather than writing below it: P persists the tail, so the store covers every
    acknowledged byte and reset-head continues after them (as in test_restart.py's
    ..._back_elsewhere_needs_reset_head). Left on P's disk, the tail could only be reset over."""
    j = "verify/r1-moved"
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

        def stored() -> int:  # (the first fragment persists on its own time)
            return max((f.end for f in store_for(lc.store_url).list(j)), default=0)

        stored_end = await wait_until(stored, 30, interval=0.05)
        assert stored_end < end, f"the store holds [0, {stored_end}), P alone [{stored_end}, {end})"
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
    """The dropped tail of test_a_dropped_tail_leaves_no_hole_the_journal_never_fills, reached through the
    check before the spool resumes (`before_sync`) instead of `verify_unassigned`. R=2 over 3 brokers:
    primary P commits C past the acknowledged A and is killed before its peer Q has C; the journal goes on
    with Q and S and acknowledges D (shorter than C) at A's end. S dies and P comes back on its data dir
    while the fragment store fails to list (an outage: the journal's folder cannot be read), so the
    journal is assigned to Q and P. A failed listing must not end `before_sync` without asking Q (which
    holds D, contradicting C): P's spool would resume at C's end, the route would roll forward there once
    the store is back, `after_sync` would drop C, and offsets [D.end, C.end) would be held by nobody. The
    next append E is read from D's end."""
    j = "verify/outage-hole"
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
