"""FragmentIndex: which fragment of a journal replica covers an offset.

The index is the union of the replica's local spool fragments (with their file paths) and the
fragments its stores last listed (path None). Readers ask `query(offset)`; appends ask
`end_offset`; both are answered from a *cover set* kept beside the full sets:

    Fragment A dominates B when A.begin <= B.begin, A.end >= B.end, and either A.end > B.end or
    A is local whenever B is. A dominated fragment is never a better answer than its dominator,
    so the cover set keeps only undominated ones. Sorted by begin, their begins are then
    distinct and their ends non-decreasing (equal ends only as remote-then-local), so the last
    fragment beginning at or before an offset is the one with the largest end (local on ties),
    and the next one is where a reader jumps over a gap. Both are one bisect: O(log n).

A commit grows the spool's current fragment (same begin, larger end), which dominates the entry
it replaces: an O(log n) search plus a list insert. A store listing rebuilds the cover set with
one sort and sweep, and drops the local entries whose offsets the listed fragments cover
(Gazette's `CoverSetDifference`): their files may go once the spool is done with them, which is
the file's business (`SpoolFile`), never the index's. Empty fragments hold no content, cannot
answer a read and are ignored.

Skipping. An offset no fragment covers is skipped over only to a *persisted* fragment, and only
when it is the journal's first (the reader starts before the oldest content) or was persisted at
least `jump_age` seconds ago (Gazette's `offsetJumpAgeThreshold`). Otherwise the content may be
on its way (a fragment still uploading while its journal changed hands, or a replica that just
rolled past a gap), so the reader waits instead of silently losing bytes.

All methods must be called from the event loop's thread; waiters are woken synchronously.
"""

from __future__ import annotations

import asyncio
import time
from bisect import bisect_left, bisect_right
from collections.abc import Iterable
from typing import Any

from tidings.fragment.fragment import Fragment

JUMP_AGE = 6 * 3600.0
"""Seconds after which a persisted fragment may be skipped to over a hole before it."""

Entry = tuple[Fragment, Any]
"""A fragment and its local spool file (a `SpoolFile`; None when it is only in a store)."""


def _dominates(a: Entry, b: Entry) -> bool:
    fa, fb = a[0], b[0]
    if fa.begin > fb.begin or fa.end < fb.end:
        return False
    return fa.end > fb.end or a[1] is not None or b[1] is None


class FragmentIndex:
    """The local and persisted fragments of one journal replica.

    **Parameters:**
    - `journal`: the journal every fragment added must belong to.
    """

    def __init__(self, journal: str) -> None:
        self.journal = journal
        self.first_refresh = False
        self._local: dict[int, Entry] = {}  # by begin: the spool replaces its current fragment in place
        self._remote: list[Fragment] = []
        self._cover: list[Entry] = []
        self._cover_begins: list[int] = []
        self._changed = asyncio.Event()
        self._refreshed = asyncio.Event()

    def __repr__(self) -> str:
        return (
            f"FragmentIndex({self.journal!r}, local={len(self._local)}, remote={len(self._remote)}, "
            f"end_offset={self.end_offset})"
        )

    # -- updates ---------------------------------------------------------------------------------

    def add_local(self, frag: Fragment, file: Any) -> None:
        """Add (or grow) a local spool fragment, replacing the local entry with the same begin."""
        self._check_journal(frag)
        if frag.begin == frag.end:
            return
        entry: Entry = (frag, file)
        old = self._local.get(frag.begin)
        self._local[frag.begin] = entry
        if old is None:
            self._insert(entry)
        elif frag.end >= old[0].end:
            # The new entry dominates the old one, so it covers everything the old one hid.
            i = bisect_left(self._cover_begins, old[0].begin)
            if i < len(self._cover) and self._cover[i] is old:
                del self._cover[i]
                del self._cover_begins[i]
            self._insert(entry)
        else:
            self._rebuild()  # a shrinking fragment may uncover others: not a commit path
        self._wake()

    def replace_remote(self, frags: Iterable[Fragment]) -> list[Entry]:
        """Adopt the latest store listing; return the local entries it now makes redundant.

        A local entry is dropped when the listed fragments cover all its offsets (one fragment, or
        several contiguous ones). Sets `first_refresh` and wakes waiters.
        """
        remote = [f for f in frags if f.begin != f.end]
        for f in remote:
            self._check_journal(f)
        covered = _covered_spans(remote)
        dropped = [e for e in self._local.values() if _is_covered(covered, e[0].begin, e[0].end)]
        for frag, _ in dropped:
            del self._local[frag.begin]
        self._remote = remote
        self._rebuild()
        self.first_refresh = True
        self._refreshed.set()
        self._wake()
        return dropped

    def _check_journal(self, frag: Fragment) -> None:
        if frag.journal != self.journal:
            raise ValueError(f"fragment of journal {frag.journal!r} added to the index of {self.journal!r}")

    def _insert(self, entry: Entry) -> None:
        """Insert into the cover set unless dominated, removing what it dominates."""
        frag = entry[0]
        k = bisect_right(self._cover_begins, frag.begin) - 1
        if k >= 0 and _dominates(self._cover[k], entry):
            return
        j = bisect_left(self._cover_begins, frag.begin)
        m = j
        while m < len(self._cover) and _dominates(entry, self._cover[m]):
            m += 1
        self._cover[j:m] = [entry]
        self._cover_begins[j:m] = [frag.begin]

    def _rebuild(self) -> None:
        """Recompute the cover set with one sort and a sweep."""
        entries: list[Entry] = [(f, None) for f in self._remote]
        entries.extend(self._local.values())
        # By begin; at one begin the best (largest end, then local) first, so it dominates the rest.
        entries.sort(key=lambda e: (e[0].begin, -e[0].end, e[1] is None))
        cover: list[Entry] = []
        for e in entries:
            if not cover or not _dominates(cover[-1], e):
                cover.append(e)
        self._cover = cover
        self._cover_begins = [e[0].begin for e in cover]

    def _wake(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    # -- queries ---------------------------------------------------------------------------------

    def query(self, offset: int, jump_age: float = JUMP_AGE, now: float | None = None) -> Entry | None:
        """The fragment to read `offset` from, with its local file (None if only in a store).

        Among fragments with begin <= offset < end, the one with the largest end (local on ties).
        If none covers `offset`, the next fragment after it when a reader may skip there (see the
        module docstring): the reader's offset jumps to its begin. Else None: wait for content.
        """
        i = bisect_right(self._cover_begins, offset) - 1
        if i >= 0 and self._cover[i][0].end > offset:
            return self._cover[i]
        if i + 1 < len(self._cover):
            nxt = self._cover[i + 1][0]
            persisted = bool(nxt.backing_store) and nxt.mod_time > 0
            old = nxt.mod_time < (time.time() if now is None else now) - jump_age
            if persisted and (i + 1 == 0 or old):
                return self._cover[i + 1]
        return None

    @property
    def begin_offset(self) -> int:
        """The smallest begin of any fragment, 0 when there are none."""
        return self._cover[0][0].begin if self._cover else 0

    @property
    def end_offset(self) -> int:
        """The largest end of any fragment, 0 when there are none."""
        return self._cover[-1][0].end if self._cover else 0

    @property
    def last_mod_time(self) -> int:
        """When the journal's last fragment (the one ending last) was persisted; 0 while it is only in
        a spool, or when there are none (Gazette's index summary: a journal is idle once it is old)."""
        if not self._cover or self._cover[-1][1] is not None:
            return 0
        return self._cover[-1][0].mod_time

    def fragments(self) -> list[Entry]:
        """Every fragment, local and remote, sorted by (begin, end), local first on ties."""
        out: list[Entry] = [(f, None) for f in self._remote]
        out.extend(self._local.values())
        out.sort(key=lambda e: (e[0].begin, e[0].end, e[1] is None))
        return out

    # -- waiting ---------------------------------------------------------------------------------

    async def wait_for_end_offset_beyond(self, offset: int) -> None:
        """Return once end_offset > offset. Cancelling it changes nothing.

        Always a checkpoint (it yields even when already satisfied), as trio's waits are.
        """
        if self.end_offset > offset:
            await asyncio.sleep(0)
            return
        while self.end_offset <= offset:
            await self._changed.wait()

    async def wait_for_change(self) -> None:
        """Return at the next change of the index (a commit, a listing). Cancelling it changes nothing."""
        await self._changed.wait()

    async def wait_first_refresh(self) -> None:
        """Return once a store listing has been applied (replace_remote was called)."""
        if self._refreshed.is_set():
            await asyncio.sleep(0)
            return
        await self._refreshed.wait()


def _covered_spans(frags: list[Fragment]) -> list[tuple[int, int]]:
    """The union of the fragments' spans, as sorted disjoint [begin, end) intervals."""
    out: list[tuple[int, int]] = []
    for f in sorted(frags, key=lambda f: f.begin):
        if out and f.begin <= out[-1][1]:
            if f.end > out[-1][1]:
                out[-1] = (out[-1][0], f.end)
        else:
            out.append((f.begin, f.end))
    return out


def _is_covered(spans: list[tuple[int, int]], begin: int, end: int) -> bool:
    i = bisect_right(spans, (begin, float("inf"))) - 1
    return i >= 0 and spans[i][0] <= begin and spans[i][1] >= end
