"""Dispatcher: puts each WAL entry's parts on its targets' queues (logplayer-paper.txt, section 2.3,
Algorithm 3; dummy entries from section 2.6, Algorithm 5).

A WAL entry is a transaction at `index` (its message's offset in the WAL journal) with parts for
some targets. The main fetcher dispatches every entry (`normal`); a target's recovery fetcher
dispatches the entries that target missed, to it only, in the term it was started for. An entry
a target has already acknowledged (`last_acks[target] >= index`) is not queued again: after a
LogPlayer restart the main stream starts at the lowest acknowledgement of all targets, and every
target skips what it applied.

`current_index` is the last index the main stream dispatched: a returning target missed at most
the entries up to it, everything later reaches it through the main stream.

Dummy entries: a target that receives no entry for a long time keeps a low acknowledgement,
which would make a LogPlayer restart (or its own return) start reading far back. Every
`dummy_every` main-stream entries, each target that got nothing queued during the previous
`dummy_every` entries gets an empty entry at `current_index`, which it applies by storing that
index. (The paper compares indices; ours are byte offsets, so tidings counts entries.)

`wake(target)` is called when a target's queue got something to send (Algorithm 3's sendNext):
tidings' stream writer then sends the next batch once its previous write is done.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from tidings.logplayer.target_queue import Entry, QueueState, TargetQueue

__all__ = ["NOTHING", "Dispatcher"]

NOTHING = -1  # the last acknowledgement of a target that applied no entry (index 0 is an entry)


class Dispatcher:
    """The target queues, their acknowledgements and `current_index`; see the module docstring."""

    def __init__(
        self,
        targets: Iterable[str],
        wake: Callable[[str], None],
        *,
        dummy_every: int = 0,
        last_acks: Mapping[str, int] | None = None,
        suspended: bool = False,
    ) -> None:
        state = QueueState.SUSPENDED if suspended else QueueState.NORMAL  # (suspended: until each connects)
        self.queues = {t: TargetQueue(t, state) for t in targets}
        self.wake = wake
        self.dummy_every = dummy_every
        self.last_acks = {t: (last_acks or {}).get(t, NOTHING) for t in self.queues}
        self.current_index = NOTHING
        self._last_queued = dict(self.last_acks)  # the last index pushed on each normal queue
        self._since_dummies = 0
        self._previous_round = NOTHING  # current_index at the last round of dummy entries

    def start_index(self) -> int:
        """Where the main stream starts (Algorithm 5, LogPlayer restart): the lowest last
        acknowledgement; the entry there is re-read and skipped (its end is where the next one
        begins), NOTHING when some target applied nothing."""
        return min(self.last_acks.values(), default=NOTHING)

    def dispatch(
        self,
        index: int,
        parts: Mapping[str, tuple[Any, ...]],
        *,
        normal: bool = True,
        term: int = 0,
        committed_ns: int = 0,
        dispatched_ns: int = 0,
        size: int = 0,
    ) -> None:
        """Queue each target's part of the entry at `index`: all of `parts` for the main stream,
        or (a recovery stream) the parts of the targets named, in `term`. A target not among
        the queues' is refused before anything is queued: every part is built before the first
        push, and targets are woken after the last (a retry would otherwise queue some twice)."""
        try:
            entries = [
                (t, Entry(index, tuple(m), committed_ns, dispatched_ns, size))
                for t, m in parts.items()
                if self.last_acks[t] < index
            ]
        except KeyError as e:
            raise KeyError(f"entry {index} names unknown target {e.args[0]!r}") from None
        pushed = [t for t, entry in entries if self.queues[t].push(entry, normal, term)]
        for target in pushed:
            if normal:
                self._last_queued[target] = index
            self.wake(target)
        if normal:
            self.current_index = index
            self._dummies()

    def dispatch_recovery(
        self, target: str, index: int, mutations: tuple[Any, ...], term: int, committed_ns: int = 0,
        dispatched_ns: int = 0, size: int = 0,
    ) -> None:  # fmt: skip
        """Queue `target`'s part of the entry at `index` for its recovery stream of `term`."""
        self.dispatch(index, {target: mutations}, normal=False, term=term, committed_ns=committed_ns,
                      dispatched_ns=dispatched_ns, size=size)  # fmt: skip

    def acknowledged(self, target: str, index: int) -> None:
        """`target` applied every entry up to `index` (its acknowledgement, or what it reported
        on connecting)."""
        self.last_acks[target] = index
        self._last_queued[target] = max(self._last_queued[target], index)

    def _dummies(self) -> None:
        if self.dummy_every <= 0:
            return
        self._since_dummies += 1
        if self._since_dummies < self.dummy_every:
            return
        self._since_dummies = 0
        index, previous, self._previous_round = self.current_index, self._previous_round, self.current_index
        for target, queue in self.queues.items():
            # Nothing queued for it during the last round: a dummy entry at the current index.
            if queue.state is not QueueState.SUSPENDED and self._last_queued[target] <= previous:
                if queue.push(Entry(index), True):
                    self._last_queued[target] = index
                    self.wake(target)
