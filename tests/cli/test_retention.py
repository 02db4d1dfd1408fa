"""Retention: `journals prune` removes the persisted fragments a journal's fragment.retention lets go, only
ever its oldest ones (a journal starts later, never gets a hole); brokers do it on their own every
--prune-interval; a reader of a removed offset sees the jump (`read` prints a warning line) instead of
silence or a hang. Against real brokers and a file store."""

from __future__ import annotations

import json
import time

from hypothesis import given
from hypothesis import strategies as st

from tests.cli._support import run
from tests.support.cluster import TestCluster
from tests.support.waiting import wait_until
from tidings.fragment import _metrics, retention
from tidings.fragment.fragment import EMPTY_SUM, Fragment
from tidings.fragment.store import store_for

SMALL = {"length": "1KiB", "retention": "1s", "refresh_interval": "1h"}


async def _fragments(name: str, ep: str) -> list[dict]:
    r = await run("journals", "fragments", name, "--json", broker=ep)
    assert r.returncode == 0, r
    return [json.loads(line) for line in r.stdout.splitlines()]


async def _aged_journal(cluster, name: str, appends: int = 5) -> tuple[str, list[int]]:
    """A journal of R=1 whose appends are each a persisted fragment older than its 1s retention
    (each append fills a fragment, which the next pulse rolls and persists); the appends' ends."""
    ep = cluster.brokers[0].endpoint
    await cluster.create_journal(name, 1, fragment=SMALL)
    ends = []
    async with cluster.client() as c:
        for i in range(appends):
            ends.append((await c.append(name, f"{i}".encode() * 1500 + b"\n")).end)
    await _wait_aged(cluster, name, appends)
    return ep, ends


async def _wait_aged(cluster, name: str, n: int) -> None:
    """Until `n` fragments are in the store, each older than the 1s retention, and the broker's index
    has swapped its local entries for the listed ones (it lists after persisting)."""
    store = store_for(cluster.store_url)

    def aged() -> bool:
        listed = store.list(name)
        return len(listed) >= n and all(time.time() - f.mod_time >= 1 for f in listed)

    await wait_until(aged, 30)
    await wait_until(lambda: _persisted_in_index(cluster, name, n), 30)


def _persisted_in_index(cluster, name: str, n: int) -> bool:
    for b in cluster.brokers:
        replica = b.resolver.replicas.get(name)
        if replica is not None:
            return sum(1 for f, _file in replica.index.fragments() if f.backing_store) >= n
    return False


async def test_prune_removes_the_aged_prefix_and_readers_see_the_jump(cluster) -> None:
    name = "cli/retained"
    ep, ends = await _aged_journal(cluster, name)
    store = store_for(cluster.store_url)
    before = store.list(name)

    r = await run("journals", "prune", "--dry-run", "--selector", f"name={name}", broker=ep)
    assert r.returncode == 0, r
    assert r.stdout.decode().startswith(f"{name}: would remove 4 fragments"), r.stdout
    assert store.list(name) == before  # a dry run removes nothing

    r = await run("journals", "prune", "--json", "--selector", f"name={name}", broker=ep)
    assert r.returncode == 0, r
    row = json.loads(r.stdout)
    assert (row["removed"], row["begin"], row["dry_run"]) == (4, ends[3], False), row  # (the newest stays)
    assert [f.begin for f in store.list(name)] == [ends[3]]

    # The brokers still list the removed fragments (refresh_interval 1h): a read finds them gone,
    # lists the store again and jumps to the journal's first byte, saying so on stderr.
    r = await run("journals", "read", name, broker=ep)
    assert r.returncode == 0, r
    assert r.stdout == b"4" * 1500 + b"\n"
    said = f"{name} holds no bytes [0, {ends[3]}) any more (removed by retention?): reading on at {ends[3]}"
    assert r.stderr.decode().splitlines() == [said]
    assert (await _fragments(name, ep))[0]["begin"] == ends[3]


async def test_prune_tells_what_it_keeps_and_refuses_a_selector_matching_nothing(cluster) -> None:
    ep = cluster.brokers[0].endpoint
    await cluster.create_journal("cli/forever", 1)
    r = await run("journals", "prune", broker=ep)
    assert r.returncode == 0 and r.stdout.decode() == "cli/forever: retention 0s (keep for ever): kept 0 (0 bytes)\n", r
    r = await run("journals", "prune", "--selector", "app=nothing", broker=ep)
    lines = r.stderr.decode().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and "no journal matches --selector 'app=nothing'" in lines[0], r


async def test_read_committed_reports_the_jump_too(cluster) -> None:
    name = "cli/retained-messages"
    await cluster.create_journal(name, 1, fragment=SMALL, labels={"content-type": "application/x-ndjson"})
    ep = cluster.brokers[0].endpoint
    pad = "x" * 1200
    for i in range(3):
        r = await run("publish", name, broker=ep, stdin=json.dumps({"n": i, "pad": pad}).encode() + b"\n")
        assert r.returncode == 0, r
    await _wait_aged(cluster, name, 3)
    r = await run("journals", "prune", broker=ep)
    assert r.returncode == 0, r
    r = await run("journals", "read", name, "--committed", broker=ep)
    assert r.returncode == 0, r
    kept = [json.loads(line)["n"] for line in r.stdout.splitlines()]
    assert kept == [2], kept  # the newest fragment stays
    assert "holds no bytes [0, " in r.stderr.decode() and "reading on at" in r.stderr.decode(), r


async def test_brokers_enforce_retention_on_their_own(etcd, etcd_root, tmp_path) -> None:
    tc = TestCluster(etcd.endpoint, etcd_root, tmp_path, prune_interval=0.2)
    pruned = _metrics.FRAGMENTS_PRUNED._value.get()
    try:
        await tc.add_broker("zone-a")
        name = "cli/scheduled"
        await tc.create_journal(name, 1, fragment={**SMALL, "refresh_interval": "1s"})
        async with tc.client() as c:
            ends = [(await c.append(name, b"a" * 1500)).end for _ in range(3)]
            store = store_for(tc.store_url)

            async def starts_at_last_append() -> bool:
                """Each persisted fragment goes once a second old, but for the newest."""
                return [e.spec.begin for e in (await c.fragments(name)).fragments] == [ends[1]]

            await wait_until(starts_at_last_append, 30)
            assert [f.begin for f in store.list(name)] == [ends[1]]
            assert await c.read_all(name) == b"a" * 1500
        assert _metrics.FRAGMENTS_PRUNED._value.get() - pruned == 2
    finally:
        await tc.stop()


def _frag(begin: int, end: int, mod_time: int = 0, store: str = "file:///s/") -> Fragment:
    return Fragment("j", begin, end, EMPTY_SUM, backing_store=store if mod_time else "", mod_time=mod_time)


spans = st.lists(
    st.tuples(st.integers(0, 50), st.integers(1, 20), st.integers(0, 100), st.booleans()), min_size=0, max_size=12
)


@given(spans, st.integers(0, 60))
def test_retention_removes_only_an_aged_prefix(raw, retention_s) -> None:
    now = 100
    frags = [_frag(b, b + n, mod_time=t if persisted else 0) for b, n, t, persisted in raw]
    plan = retention.plan("j", frags, retention_s, now)
    by_span = lambda f: (f.begin, f.end)  # noqa: E731
    assert sorted(plan.aged + plan.kept, key=by_span) == sorted(frags, key=by_span)
    for f in plan.aged:
        assert f.backing_store and retention_s > 0 and now - f.mod_time >= retention_s
    last_end = max((f.end for f in frags if f.backing_store), default=None)
    must_stay = [f for f in frags if not retention.is_aged(f, retention_s, now) or f.end == last_end]
    for f in plan.aged:  # never beyond the first byte a fragment that must stay holds: no hole in the middle
        assert all(f.end <= k.begin for k in must_stay)
    if must_stay:
        assert plan.begin <= min(k.begin for k in must_stay)
