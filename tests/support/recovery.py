"""Helpers for the recovery tests: brokers as child processes (LocalCluster), crashes with spool
content left on disk, and checks that the journal neither forks nor reuses offsets."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass
from pathlib import Path

from tests.support.cluster import create_local_journal
from tests.support.waiting import wait_until
from tidings.auth import Authorizer
from tidings.broker.replica import spool_directory
from tidings.client import AppendResult, AsyncClient
from tidings.cluster import LocalCluster
from tidings.cluster.launcher import BrokerProcess
from tidings.fragment.fragment import Fragment
from tidings.fragment.spool import Spool, recover
from tidings.fragment.store import store_for
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.status import IndexHasGreaterOffsetError, TidingsError

AUTH: Authorizer | None = None  # what the helpers' clients sign with (a test of brokers holding keys sets it)


def client(endpoint: str) -> AsyncClient:
    return AsyncClient(endpoint, auth=AUTH)


async def route_of(endpoint: str, journal: str) -> pb.Route | None:
    async with client(endpoint) as c:
        for j in (await c.list()).journals:
            if j.spec.name == journal:
                return j.route
    return None


async def routed(endpoint: str, journal: str, members: set[str] | None = None, n: int | None = None) -> bool:
    """The journal has a primary, and `members` (by suffix) or `n` members, as `endpoint` sees it."""
    r = await route_of(endpoint, journal)
    if r is None or r.primary < 0 or (n is not None and len(r.members) != n):
        return False
    return members is None or {m.suffix for m in r.members} == members


async def refuses_to_guess(endpoint: str, journal: str) -> bool:
    """An append through `endpoint` answers INDEX_HAS_GREATER_OFFSET (False: no answer yet; an append
    that lands fails the test: it went over offsets only a lost replica held)."""
    try:
        async with client(endpoint) as c:
            await asyncio.wait_for(c.append(journal, b"not yet"), 10)
    except IndexHasGreaterOffsetError:
        return True
    except (TidingsError, TimeoutError):
        return False
    raise AssertionError(f"{endpoint} appended to {journal} without a reset-head, over offsets it never held")


async def append_eventually(endpoint: str, journal: str, content: bytes, **kw: int) -> AppendResult:
    async def attempt() -> AppendResult | None:
        try:
            async with client(endpoint) as c:
                return await asyncio.wait_for(c.append(journal, content, **kw), 10)
        except (TidingsError, TimeoutError):
            return None

    return await wait_until(attempt, 60, interval=0.5)


def _content(frag: Fragment) -> bytes:
    with store_for(frag.backing_store).open(frag) as f:
        return f.read()


def assert_no_fork(store_url: str, journal: str) -> list[Fragment]:
    """No two fragments in the store hold different bytes at one offset."""
    frags = store_for(store_url).list(journal)
    contents = {f.content_name(): _content(f) for f in frags}
    for a, b in itertools.combinations(frags, 2):
        lo, hi = max(a.begin, b.begin), min(a.end, b.end)
        if lo < hi:
            ca = contents[a.content_name()][lo - a.begin : hi - a.begin]
            cb = contents[b.content_name()][lo - b.begin : hi - b.begin]
            assert ca == cb, f"fragments [{a.begin}, {a.end}) and [{b.begin}, {b.end}) differ over [{lo}, {hi})"
    return frags


def local_spools(data_dir: Path, journal: str) -> list[str]:
    """A broker's non-empty spool files of `journal` (recovered or live)."""
    folder = spool_directory(data_dir, journal)
    if not folder.is_dir():
        return []
    names = []
    for p in folder.iterdir():
        try:
            if p.name != "HEAD" and p.stat().st_size:
                names.append(p.name)
        except FileNotFoundError:  # (the broker unlinked it between the listing and the stat: gone)
            continue
    return sorted(names)


def commit_on_disk(data_dir: Path, journal: str, revision: int, content: bytes) -> tuple[int, int]:
    """Commit `content` past what a stopped broker's spool of `journal` holds, with real Spool code, as
    that broker's process would have: a primary applies a commit before its peers have it, and its HEAD
    records the spool's committed end at the next acknowledgement (of an earlier, pipelined append) or
    when the spool closes. Returns the committed span."""
    folder = spool_directory(data_dir, journal)
    rec = recover(journal, folder, revision)
    spool = Spool(journal, folder)
    spool.journal_revision = revision
    spool.resume(rec.end, rec.registers, rec.codec)
    begin = spool.end
    spool.apply(pb.ReplicateRequest(content=content, content_delta=0), primary=True)
    resp = spool.apply(
        pb.ReplicateRequest(proposal=spool.next_fragment().to_proto(), registers=spool.registers), primary=True
    )
    assert resp.status == pb.OK
    spool.close(primary=True)
    return begin, spool.end


async def create_revision(endpoint: str, journal: str) -> int:
    async with client(endpoint) as c:
        return next(j.create_revision for j in (await c.list()).journals if j.spec.name == journal)


@dataclass
class Tail:
    """An R=2 journal whose primary P died holding C [c_begin, c_end), past the last append A its peer
    Q acknowledged; S is the third broker."""

    a: AppendResult
    p: BrokerProcess
    q: BrokerProcess
    s: BrokerProcess
    c_begin: int
    c_end: int


async def primary_killed_with_a_tail(lc: LocalCluster, journal: str) -> Tail:
    """On a started 3-broker cluster: create `journal` (R=2), append A, kill its primary P -9, and leave C
    committed on P's disk alone (`commit_on_disk`)."""
    await create_local_journal(lc, journal, 2, fragment={"length": "1MiB", "refresh_interval": "1s"}, auth=AUTH)
    await wait_until(lambda: routed(lc.endpoints[0], journal, n=2), 30)
    async with client(lc.endpoints[0]) as c:
        a = await c.append(journal, b"A: acknowledged on P and Q\n")
    route = await route_of(lc.endpoints[0], journal)
    assert route is not None
    p = next(b for b in lc.brokers if b.suffix == route.members[route.primary].suffix)
    q = next(b for b in lc.brokers if b.suffix != p.suffix and b.suffix in {m.suffix for m in route.members})
    s = next(b for b in lc.brokers if b not in (p, q))
    revision = await create_revision(q.endpoint, journal)
    p.kill()
    c_begin, c_end = commit_on_disk(p.data_dir, journal, revision, b"C: committed on P alone, never acknowledged\n")
    return Tail(a, p, q, s, c_begin, c_end)
