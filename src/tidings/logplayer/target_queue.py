"""TargetQueue: the entries waiting for one target (logplayer-paper.txt, section 2.2, Algorithms 1-2).

A target queue holds two FIFO queues: the *normal* queue, fed by the main stream, and the
*catch-up* queue, fed by a recovery stream while a returning target catches up on what it missed.
Its state says which one the target reads:

    NORMAL (N)               the target is up, nothing to catch up: front = normal queue
    RECOVERY_FETCHING (RF)   up, a recovery stream is still fetching: front = catch-up queue
    FETCHING_COMPLETED (FC)  up, recovery fetched everything: front = catch-up queue until it
                             empties, then NORMAL
    SUSPENDED (S)            down or disconnected: nothing is queued, pushes are dropped

Transitions (`_TRANSITIONS`, checked by `_transition_to`): N -> S (`suspend`); S -> RF
(`begin_recovery`: the target is back, term + 1); RF -> N (nothing missed, or the catch-up queue
already drained when fetching completes); RF -> FC (`fetching_completed` with entries left);
FC -> N (the catch-up queue drained); RF, FC -> S.

The *term* counts the target's returns. A recovery stream pushes with the term it was started
in; once the target fails and returns again, that term is stale and its pushes are dropped. The
paper's model checker found duplicate deliveries without terms (models/README.md shows spin
finding them in our model too).

Batches (Algorithm 2): `next_batch` pops up to `max_size` entries from the front; `pop_batch`
files the batch being written in `popped` under its last index, and the target's acknowledgement
of that index `erase`s it. An acknowledgement that names no popped batch is not to be trusted
(see `erase`).

Everything here is synchronous: on tidings' single event loop an operation runs alone, which is
the model's coarse granularity (`-DCOARSE`); the paper's locks are not needed.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import logging
from typing import Any

__all__ = ["Entry", "QueueState", "TargetQueue", "TransitionError"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class Entry:
    """A target's part of one WAL entry: its index, and this target's mutations (none for a
    dummy entry, which only advances the target's last applied index)."""

    index: int
    mutations: tuple[Any, ...] = ()
    committed_ns: int = 0  # when the transaction manager appended the entry (unix ns; for apply delay)
    dispatched_ns: int = 0  # when the LogPlayer dispatched it (unix ns; for LogPlayer delay)
    size: int = 0  # the WAL entry's bytes, at least this part's: what bounds a batch's bytes

    @property
    def dummy(self) -> bool:
        return not self.mutations


class QueueState(enum.Enum):
    NORMAL = "N"
    RECOVERY_FETCHING = "RF"
    FETCHING_COMPLETED = "FC"
    SUSPENDED = "S"


N, RF, FC, S = QueueState.NORMAL, QueueState.RECOVERY_FETCHING, QueueState.FETCHING_COMPLETED, QueueState.SUSPENDED

_TRANSITIONS: dict[QueueState, frozenset[QueueState]] = {
    N: frozenset({S}),
    RF: frozenset({N, FC, S}),
    FC: frozenset({N, S}),
    S: frozenset({RF}),
}


class TransitionError(RuntimeError):
    """A transition the paper's state diagram (Figure 2) does not have: a bug, not bad input."""


class TargetQueue:
    """The queues, state, term and popped batches of one target; see the module docstring."""

    def __init__(self, target: str, state: QueueState = N) -> None:
        self.target = target
        self.state = state
        self.term = 1
        self.normal: collections.deque[Entry] = collections.deque()
        self.catchup: collections.deque[Entry] = collections.deque()
        self.current_batch: list[Entry] = []
        self.popped: dict[int, list[Entry]] = {}

    def __repr__(self) -> str:
        return (
            f"TargetQueue({self.target!r}, {self.state.value}, term={self.term}, "
            f"normal={len(self.normal)}, catchup={len(self.catchup)}, popped={len(self.popped)})"
        )

    def _transition_to(self, state: QueueState) -> None:
        if state is self.state:
            return
        if state not in _TRANSITIONS[self.state]:
            raise TransitionError(f"target {self.target}: no transition {self.state.value} -> {state.value}")
        log.debug("target %s: queue %s -> %s", self.target, self.state.value, state.value)
        self.state = state

    @property
    def catching_up(self) -> bool:
        return self.state is RF or self.state is FC

    # ---- Algorithm 1 ----

    def push(self, entry: Entry, normal: bool, term: int = 0) -> bool:
        """Queue `entry` from the main stream (`normal`) or from a recovery stream started in
        `term`; False when it was dropped (suspended, or a stale recovery term)."""
        if self.state is S or not (normal or term == self.term):
            return False
        (self.normal if normal else self.catchup).append(entry)
        return True

    def front(self) -> Entry | None:
        """The entry to send next, or None when there is none to send yet."""
        if self.catching_up and self.catchup:
            return self.catchup[0]
        if self.state is FC:  # the catch-up queue drained: back to the main stream
            self._transition_to(N)
        if self.state is N and self.normal:
            return self.normal[0]
        return None

    def pop(self) -> None:
        """Remove the entry `front` returned."""
        if self.catching_up and self.catchup:
            self.catchup.popleft()
            if self.state is FC and not self.catchup:
                self._transition_to(N)
        elif self.state is N and self.normal:
            self.normal.popleft()

    def suspend(self) -> None:
        """The target is down or disconnected: drop everything queued, sent or being sent."""
        self._transition_to(S)
        self.normal.clear()
        self.catchup.clear()
        self.popped.clear()
        self.current_batch = []

    def begin_recovery(self) -> int:
        """The target is back (Algorithm 5, "upon target restart"): a new term, in which a
        recovery stream may catch it up; returns the term."""
        self._transition_to(RF)
        self.term += 1
        return self.term

    def fetching_completed(self, term: int) -> bool:
        """The recovery stream of `term` pushed every entry the target missed; True when the
        queue went back to NORMAL (the caller then sends what the main stream queued meanwhile)."""
        if self.state is not RF or term != self.term:
            return False
        if not self.catchup:
            self._transition_to(N)
            return True
        self._transition_to(FC)
        return False

    def nothing_missed(self) -> None:
        """The returning target missed no entry: straight back to NORMAL, no recovery stream."""
        self._transition_to(N)

    # ---- Algorithm 2 ----

    def next_batch(self, max_size: int, max_bytes: int = 1 << 62) -> list[Entry]:
        """Pop up to `max_size` entries, of at most `max_bytes` together unless one alone is larger,
        from the front into the current batch (empty when there is nothing to send)."""
        batch: list[Entry] = []
        size = 0
        entry = self.front()
        while entry is not None and len(batch) < max_size and (not batch or size + entry.size <= max_bytes):
            batch.append(entry)
            size += entry.size
            self.pop()
            entry = self.front()
        self.current_batch = batch
        return batch

    def pop_batch(self) -> None:
        """The current batch is being written: keep it until the target acknowledges it. (The
        paper files it when the write completes; on one event loop the acknowledgement may be
        read before the writer resumes from its write, so tidings files it as the write starts.)"""
        if self.current_batch:
            self.popped[self.current_batch[-1].index] = self.current_batch
            self.current_batch = []

    def erase(self, index: int) -> bool:
        """The target acknowledged `index`: forget the batches up to it (a target may acknowledge
        several batches at once, with the last one's index). False when `index` ends no batch
        written and not yet acknowledged: the target answered something it was not sent, and the
        caller disconnects and recovers it rather than trust it."""
        if index not in self.popped:
            return False
        for last in list(self.popped):
            del self.popped[last]
            if last == index:
                break
        return True
