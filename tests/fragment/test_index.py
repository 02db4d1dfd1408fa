"""FragmentIndex: the cover choice, gaps, end offset, waiters, and a property test against brute force."""

from __future__ import annotations

import asyncio
import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.waiting import wait_until
from tidings.fragment import Fragment, FragmentIndex

J = "examples/index"


OLD = 1_000_000  # a mod_time long past: readers may skip to such a fragment
NOW = 2_000_000_000.0


def frag(begin: int, end: int, tag: int = 0, store: str = "", mod_time: int = 0) -> Fragment:
    digest = hashlib.sha1(f"{begin}-{end}-{tag}".encode()).digest()
    return Fragment(J, begin, end, digest, backing_store=store, mod_time=mod_time)


def remote(begin: int, end: int, tag: int = 0, mod_time: int = OLD) -> Fragment:
    return frag(begin, end, tag, "file:///store/", mod_time)


def span(entry: tuple[Fragment, str | None] | None) -> tuple[int, int, bool] | None:
    """(begin, end, is_local) of a query answer."""
    return None if entry is None else (entry[0].begin, entry[0].end, entry[1] is not None)


@pytest.mark.parametrize(
    ("locals_", "remotes", "offset", "want"),
    [
        pytest.param([], [], 0, None, id="empty"),
        pytest.param([(0, 10)], [], 5, (0, 10, True), id="one-local"),
        pytest.param([], [(0, 10), (0, 20)], 5, (0, 20, False), id="largest-end-same-begin"),
        pytest.param([], [(0, 10), (5, 30)], 7, (5, 30, False), id="largest-end-later-begin"),
        pytest.param([(5, 30)], [(0, 30)], 7, (5, 30, True), id="local-wins-tie-on-end"),
        pytest.param([(0, 30)], [(0, 30, 1)], 0, (0, 30, True), id="local-wins-exact-tie"),
        pytest.param([(0, 20)], [(0, 30)], 10, (0, 30, False), id="remote-wins-larger-end"),
        pytest.param([(5, 30)], [(0, 30)], 3, (0, 30, False), id="only-remote-covers"),
        pytest.param([], [(0, 10), (20, 30)], 12, (20, 30, False), id="gap-jumps-to-next"),
        pytest.param([], [(10, 20)], 0, (10, 20, False), id="before-first-jumps"),
        pytest.param([], [(0, 10), (20, 30), (25, 40)], 10, (20, 30, False), id="jump-to-smallest-begin"),
        pytest.param([], [(0, 10), (20, 30)], 30, None, id="at-end-offset"),
        pytest.param([], [(0, 10)], 99, None, id="beyond-end-offset"),
        pytest.param([(0, 10)], [(10, 20)], 10, (10, 20, False), id="end-is-exclusive"),
        pytest.param([(0, 10), (20, 30)], [], 12, None, id="no-skip-to-a-local-fragment"),
        pytest.param([(20, 30)], [], 0, None, id="no-skip-to-a-local-first-fragment"),
        pytest.param([], [(0, 10), (20, 30, 0, int(NOW) - 60)], 12, None, id="no-skip-to-a-fresh-fragment"),
        pytest.param([], [(20, 30, 0, int(NOW) - 60)], 3, (20, 30, False), id="skip-to-a-fresh-first-fragment"),
        pytest.param([], [(0, 10), (20, 30, 0, 0)], 12, None, id="no-skip-without-mod-time"),
    ],
)
def test_query_cases(
    locals_: list[tuple[int, int]], remotes: list[tuple[int, ...]], offset: int, want: tuple[int, int, bool] | None
) -> None:
    index = FragmentIndex(J)
    index.replace_remote(remote(*r) for r in remotes)
    for b, e in locals_:
        index.add_local(frag(b, e, 9), f"/spool/{b}")
    assert span(index.query(offset, now=NOW)) == want


def test_end_offset_and_fragments_listing() -> None:
    index = FragmentIndex(J)
    assert index.end_offset == 0 and index.fragments() == []
    index.replace_remote([remote(10, 20), remote(0, 10), remote(0, 5)])
    index.add_local(frag(20, 25), "/spool/20")
    index.add_local(frag(30, 30), "/spool/30")  # empty: holds nothing, ignored
    assert index.end_offset == 25
    assert [(f.begin, f.end, p) for f, p in index.fragments()] == [
        (0, 5, None),
        (0, 10, None),
        (10, 20, None),
        (20, 25, "/spool/20"),
    ]


def test_growing_local_fragment_replaces_its_older_self() -> None:
    index = FragmentIndex(J)
    index.add_local(frag(100, 110), "/spool/a")
    index.add_local(frag(100, 150), "/spool/a")
    assert [span((f, p)) for f, p in index.fragments()] == [(100, 150, True)]
    assert span(index.query(120)) == (100, 150, True)
    assert index.end_offset == 150


def test_replace_remote_drops_local_entries_now_persisted() -> None:
    index = FragmentIndex(J)
    persisted, current = frag(0, 100), frag(100, 120)
    index.add_local(persisted, "/spool/0")
    index.add_local(current, "/spool/100")
    index.add_local(frag(200, 300), "/spool/200")
    index.add_local(frag(400, 500), "/spool/400")
    # Covered offsets are dropped whichever fragments cover them (as Gazette's CoverSetDifference):
    # [200, 300) by two contiguous ones; [400, 500) only partly, so it stays.
    listing = [persisted.with_store("file:///s/"), remote(200, 250), remote(240, 300), remote(400, 450)]
    dropped = index.replace_remote(listing)
    assert sorted(dropped, key=repr) == sorted([(persisted, "/spool/0"), (frag(200, 300), "/spool/200")], key=repr)
    assert span(index.query(50)) == (0, 100, False)
    assert span(index.query(110)) == (100, 120, True)
    assert span(index.query(260)) == (240, 300, False)
    assert span(index.query(420)) == (400, 500, True)
    assert index.first_refresh


async def test_waiters_are_woken_by_add_local_and_replace_remote() -> None:
    index = FragmentIndex(J)
    woken: list[str] = []

    async def waiter(name: str, offset: int) -> None:
        await index.wait_for_end_offset_beyond(offset)
        woken.append(name)

    async def refresh_waiter() -> None:
        await index.wait_first_refresh()
        woken.append("refresh")

    tasks = [
        asyncio.create_task(waiter("beyond-0", 0)),
        asyncio.create_task(waiter("beyond-50", 50)),
        asyncio.create_task(refresh_waiter()),
    ]
    await asyncio.sleep(0)
    assert woken == []
    index.add_local(frag(0, 10), "/spool/0")
    await wait_until(lambda: woken == ["beyond-0"])
    index.add_local(frag(0, 40), "/spool/0")  # grows, but not beyond 50: still waiting
    await asyncio.sleep(0)
    assert woken == ["beyond-0"]
    index.replace_remote([remote(40, 60)])
    await wait_until(lambda: sorted(woken) == ["beyond-0", "beyond-50", "refresh"])
    await asyncio.gather(*tasks)
    await asyncio.wait_for(index.wait_for_end_offset_beyond(59), 1)  # already true: returns


async def test_cancelled_waiter_leaves_index_usable() -> None:
    index = FragmentIndex(J)
    task = asyncio.create_task(index.wait_for_end_offset_beyond(10))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    index.add_local(frag(0, 20), "/spool/0")
    await asyncio.wait_for(index.wait_for_end_offset_beyond(10), 1)


def test_rejects_another_journals_fragment() -> None:
    with pytest.raises(ValueError, match="other"):
        FragmentIndex(J).add_local(Fragment("other", 0, 1, hashlib.sha1(b"x").digest()), "/p")


# -- property: query agrees with a brute-force reference --------------------------------------

_spans = st.tuples(st.integers(0, 40), st.integers(1, 15), st.integers(0, 2)).map(lambda t: (t[0], t[0] + t[1], t[2]))
_ops = st.lists(
    st.one_of(
        st.tuples(st.just("local"), _spans),
        st.tuples(st.just("remote"), st.lists(_spans, max_size=8)),
    ),
    max_size=25,
)


class _Reference:
    """The spec, spelled out with lists."""

    def __init__(self) -> None:
        self.local: dict[int, tuple[Fragment, str]] = {}
        self.remote: list[Fragment] = []

    def add_local(self, f: Fragment, path: str) -> None:
        self.local[f.begin] = (f, path)

    def replace_remote(self, frags: list[Fragment]) -> list[tuple[Fragment, str]]:
        offsets = {o for f in frags for o in range(f.begin, f.end)}
        dropped = [e for e in self.local.values() if all(o in offsets for o in range(e[0].begin, e[0].end))]
        for f, _ in dropped:
            del self.local[f.begin]
        self.remote = list(frags)
        return dropped

    def all(self) -> list[tuple[Fragment, str | None]]:
        return [(f, None) for f in self.remote] + list(self.local.values())

    def query(self, offset: int) -> tuple[int, bool] | tuple[str, int] | None:
        covering = [(f.end, p is not None) for f, p in self.all() if f.begin <= offset < f.end]
        if covering:
            return max(covering)  # (end, is_local): largest end, local on ties
        after = [(f, p) for f, p in self.all() if f.begin > offset]
        if not after:
            return None
        first = min(f.begin for f, _ in after)
        _, _, is_local = max((f.end, p is not None, p is not None) for f, p in after if f.begin == first)
        return None if is_local else ("jump", first)  # every remote fragment here is old: skipping is allowed


@settings(max_examples=300, deadline=None)
@given(_ops)
def test_query_matches_brute_force(ops: list[tuple[str, object]]) -> None:
    index, ref = FragmentIndex(J), _Reference()
    for kind, arg in ops:
        if kind == "local":
            b, e, tag = arg  # type: ignore[misc]
            f = frag(b, e, tag)
            index.add_local(f, f"/spool/{b}-{e}-{tag}")
            ref.add_local(f, f"/spool/{b}-{e}-{tag}")
        else:
            frags = [remote(b, e, tag) for b, e, tag in arg]  # type: ignore[union-attr]
            dropped = index.replace_remote(frags)
            assert sorted(dropped, key=repr) == sorted(ref.replace_remote(frags), key=repr)
        end = max((f.end for f, _ in ref.all()), default=0)
        assert index.end_offset == end
        assert sorted(map(repr, index.fragments())) == sorted(map(repr, ref.all()))
        for offset in range(end + 2):
            got, want = index.query(offset), ref.query(offset)
            if want is None:
                assert got is None, offset
            elif want[0] == "jump":
                assert got is not None and got[0].begin == want[1] and got[0].begin > offset, offset
            else:
                assert got is not None and got[0].begin <= offset < got[0].end, offset
                assert (got[0].end, got[1] is not None) == want, offset
