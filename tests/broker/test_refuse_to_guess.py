"""When a broker cannot tell whether a lost replica held more (every disk lost, a fragment in the store past
its write head), it refuses to guess (INDEX_HAS_GREATER_OFFSET) until an operator resets the head, and
serves what the fragment store holds meanwhile (DESIGN.md invariant 6)."""

from __future__ import annotations

import shutil

import pytest

from tests.support.fragments import write_foreign_fragment
from tests.support.waiting import wait_until
from tidings.fragment.store import store_for
from tidings.protocol.status import IndexHasGreaterOffsetError


def _store_end(store_url: str, journal: str) -> int:
    frags = store_for(store_url).list(journal)
    covered = 0
    for f in sorted(frags, key=lambda f: f.begin):
        if f.begin <= covered:
            covered = max(covered, f.end)
    return covered


async def test_broker_restarted_with_empty_disk_serves_old_content_from_store(cluster) -> None:
    await cluster.create_journal("it/restore", 3, fragment={"flush_interval": "1s"})
    payload = b"".join(f"record {i}\n".encode() for i in range(2000))
    async with cluster.client(0) as c:
        r = await c.append("it/restore", payload)
    # The flush interval rolls the fragment even without appends; wait until the store has it all.
    await wait_until(lambda: _store_end(cluster.store_url, "it/restore") >= r.end, 30)
    for b in list(cluster.brokers):
        await b.stop(graceful=False)
        shutil.rmtree(b.config.data_dir)
    cluster.brokers.clear()
    for zone in ("zone-a", "zone-b", "zone-c"):
        await cluster.add_broker(zone)
    await cluster.wait_consistent("it/restore", 3)
    for i in range(3):
        async with cluster.client(i) as c:
            assert await c.read_all("it/restore") == payload
    async with cluster.client(1) as c:
        # Every broker lost its disk: none can tell whether a partitioned broker holds more, so the
        # journal refuses until an operator resets the head (Invariant 6), then continues there.
        with pytest.raises(IndexHasGreaterOffsetError):
            await c.append("it/restore", b"after restart\n")
        await c.append("it/restore", b"", offset=len(payload))  # `journals reset-head`
        more = await c.append("it/restore", b"after restart\n")
        assert more.begin == len(payload), "appends continue at the store's end offset"


async def test_index_has_greater_offset_until_reset_head(cluster) -> None:
    """Invariant 6: fragments beyond the write head make the broker refuse, until reset-head."""
    await cluster.create_journal("it/greater", 3)
    async with cluster.client(0) as c:
        await c.append("it/greater", b"abc")
    # Another (disconnected) writer left a fragment beyond our head in the store.
    foreign = b"0123456789"
    write_foreign_fragment(cluster, "it/greater", 100, foreign)

    async def refused() -> bool:
        async with cluster.client(0) as c:
            try:
                await c.append("it/greater", b"x")
            except IndexHasGreaterOffsetError:
                return True
        return False

    await wait_until(refused, 20)
    async with cluster.client(0) as c:
        with pytest.raises(IndexHasGreaterOffsetError, match="reset-head"):
            await c.append("it/greater", b"x")
        reset = await c.append("it/greater", b"", offset=110)  # what `journals reset-head` sends
        assert reset.end == 110
        after = await c.append("it/greater", b"xyz")
        assert (after.begin, after.end) == (110, 113)
        assert await c.read_all("it/greater", offset=100) == foreign + b"xyz"


async def test_the_first_fragment_is_persisted_at_the_next_append(cluster) -> None:
    """The spool holding the journal's first write rolls at the next append, so the store shows the
    journal was written: a broker that lost every replica cannot take it for a new one, and refuses."""
    j = "it/first-roll"
    await cluster.create_journal(j, 3, fragment={"length": "64MiB"})
    async with cluster.client(0) as c:
        await c.append(j, b"first write")
        await c.append(j, b"second")

    def persisted() -> bool:
        return any(f.begin == 0 and f.end == 11 for f in store_for(cluster.store_url).list(j))

    await wait_until(persisted, 20)
