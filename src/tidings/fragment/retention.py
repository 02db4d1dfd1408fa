"""Retention: which persisted fragments of a journal its `fragment.retention` lets go (gazctl's prune).

A fragment is *aged* when it is persisted (it has a backing store and a store modification time)
and that time is at least the retention ago. Gazette's `journals prune` removes every aged
fragment. We remove only an aged *prefix*, as Kafka deletes only its oldest log segments: walking
the journal's fragments by offset, pruning stops at the first offset a fragment that must stay
covers (one not aged, or only in a spool). So retention never punches a hole in the middle of a
journal (where readers would wait for content that will not come, see `FragmentIndex.query`):
the journal just starts later, and readers asking for a removed offset jump to its first held
byte, which they see and report.

The newest persisted fragment (the one ending last) always stays, as Kafka keeps a partition's
active segment: a reader may jump over a hole only to a *persisted* fragment (a spool's content
past a hole may be waiting for the hole's bytes to be persisted by another broker), so a journal
emptied of persisted fragments would leave a reader of an old offset waiting for ever, or reading
nothing without saying why. It goes once a newer fragment is persisted and it has aged.

Several fragments may hold the same offsets (a longer one persisted beside shorter ones): all of
them go when aged, since a listing returns every fragment, not only the largest (gazctl's caveat
does not apply). Retention 0 keeps everything. Journals without a store keep their content in
the brokers' spools, and retention does not apply to them.

`plan` is pure; `remove` blocks (store I/O): call it through `asyncio.to_thread` on a loop.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from tidings.fragment import _metrics
from tidings.fragment.fragment import Fragment
from tidings.fragment.store import store_for


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    """What retention removes of one journal (`aged`) and what it keeps."""

    journal: str
    aged: list[Fragment]
    kept: list[Fragment]

    @property
    def begin(self) -> int:
        """The journal's first byte after pruning (its first kept fragment's begin; the pruned end if none)."""
        if self.kept:
            return min(f.begin for f in self.kept)
        return max((f.end for f in self.aged), default=0)

    @property
    def aged_bytes(self) -> int:
        return sum(f.content_length for f in self.aged)

    @property
    def kept_bytes(self) -> int:
        return sum(f.content_length for f in self.kept)


def is_aged(frag: Fragment, retention_s: float, now: float) -> bool:
    """Persisted, and last modified at least `retention_s` seconds before `now` (retention 0: never)."""
    return retention_s > 0 and bool(frag.backing_store) and frag.mod_time > 0 and now - frag.mod_time >= retention_s


def plan(journal: str, fragments: Iterable[Fragment], retention_s: float, now: float) -> Plan:
    """Split `fragments` into the aged prefix retention removes and the rest (see the module docstring)."""
    frags = sorted((f for f in fragments if f.begin != f.end), key=lambda f: (f.begin, f.end))
    last_end = max((f.end for f in frags if f.backing_store), default=None)
    stay = [f.begin for f in frags if not is_aged(f, retention_s, now) or (f.backing_store and f.end == last_end)]
    boundary = min(stay, default=None)
    aged: list[Fragment] = []
    kept: list[Fragment] = []
    for f in frags:
        gone = is_aged(f, retention_s, now) and (boundary is None or f.end <= boundary)
        (aged if gone else kept).append(f)
    return Plan(journal, aged, kept)


def remove(fragments: Iterable[Fragment]) -> None:
    """Delete each fragment's file from its store (blocking; one already gone is not an error),
    counted in the pruned metrics."""
    for f in fragments:
        store_for(f.backing_store).remove(f)
        _metrics.FRAGMENTS_PRUNED.inc()
        _metrics.FRAGMENT_PRUNED_BYTES.inc(f.content_length)
