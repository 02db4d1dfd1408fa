"""Fetchers: the main stream and the recovery streams over the WAL (logplayer-paper.txt, sections
2.1 and 2.5).

Both read the WAL journal *read committed*: a transaction manager's retried append (the same
UUID again) reaches no target twice. A read-committed reader started in the middle of the WAL
knows nothing of the producers before it, so every stream starts from a Sequencer checkpoint the
main stream took (`Checkpoints`): the newest at or before the entry it needs, or the WAL's start.

`MainFetcher` reads from the LogPlayer's start checkpoint on, for ever, and dispatches every entry
(`normal`); it takes a checkpoint every `checkpoint_every` entries. `recover` reads one target's
missed range (last_ack, until] in the term its return began, then calls `fetching_completed`;
it stops early once the target failed again (its term is over) and waits while the target's
catch-up queue is full (a recovery never holds more than `high_water` entries in memory).

Both skip, by the same rule, an entry whose index does not exceed the one before (only a writer
other than WalWriters makes one: a transaction committed late), and both stop at WAL bytes that
retention removed before they were delivered (`WalGapError`: their entries are lost to the
targets that miss them, which the LogPlayer says rather than skips).

A WAL entry naming a target targets.yaml does not declare stops the LogPlayer (`UnknownTargetError`):
delivering the rest would lose that part, and skipping it silently would too; the user adds the
target and restarts, and nothing is lost. Undecodable WAL bytes are reported with their offsets
and skipped (the message layer's garbage handling).
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import Counter

from tidings.client import AsyncClient
from tidings.logplayer.dispatcher import NOTHING, Dispatcher
from tidings.logplayer.target_queue import QueueState, TargetQueue
from tidings.logplayer.wal import WalEntry, WalMutation
from tidings.message.framing import Garbage
from tidings.message.iterators import ReadCommitted
from tidings.message.sequencer import Checkpoint
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.status import TidingsError, UsageError

__all__ = ["Checkpoints", "MainFetcher", "UnknownTargetError", "mutations_of", "recover"]

log = logging.getLogger(__name__)

GARBAGE = Counter("tidings_logplayer_undecodable_total", "Undecodable WAL byte ranges skipped", ["wal"])
DISPATCHED = Counter("tidings_logplayer_entries_dispatched_total", "WAL entries dispatched by the main stream", ["wal"])


class UnknownTargetError(UsageError):
    """A WAL entry names a target that targets.yaml does not declare."""


def mutations_of(part: list[WalMutation]) -> tuple[pb.Mutation, ...]:
    return tuple(pb.Mutation(key=m.key, value=bytes(m.value), delete=m.delete) for m in part)


class Checkpoints:
    """Sequencer checkpoints of the main stream by the last index each one covers (`position`),
    oldest first; `base` is where the LogPlayer started (None: the WAL's start)."""

    def __init__(self, position: int = NOTHING, base: Checkpoint | None = None) -> None:
        self.positions = [position]
        self.checkpoints: list[Checkpoint | None] = [base]

    def add(self, position: int, checkpoint: Checkpoint) -> None:
        if position > self.positions[-1]:
            self.positions.append(position)
            self.checkpoints.append(checkpoint)

    def at_or_before(self, index: int) -> tuple[int, Checkpoint | None]:
        """The newest checkpoint covering no entry after `index` (the WAL's start if none does)."""
        i = bisect.bisect_right(self.positions, index) - 1
        return (self.positions[i], self.checkpoints[i]) if i >= 0 else (NOTHING, None)

    def prune(self, floor: int) -> tuple[int, Checkpoint | None]:
        """Forget the checkpoints before the newest at or before `floor` (no target needs them);
        returns that one, what a restart resumes from."""
        i = max(bisect.bisect_right(self.positions, floor) - 1, 0)
        del self.positions[:i], self.checkpoints[:i]
        return self.positions[0], self.checkpoints[0]


def _garbage_reporter(wal: str) -> Callable[[str, Garbage], None]:
    def report(journal: str, garbage: Garbage) -> None:
        GARBAGE.labels(wal).inc()
        log.error("WAL %s: skipped undecodable entry bytes [%d, %d): %s", journal, garbage.begin, garbage.end,
                  garbage.error)  # fmt: skip

    return report


class WalGapError(TidingsError):
    """WAL bytes a stream needs are gone (retention): their entries cannot be delivered any more."""


def _gap(journal: str, begin: int, end: int) -> None:
    raise WalGapError(
        f"WAL {journal}: bytes [{begin}, {end}) are gone (retention?) before the LogPlayer delivered them: their "
        "entries cannot reach the targets that miss them; keep the WAL's fragments longer"
    )


def _reader(
    client: AsyncClient, wal: str, checkpoint: Checkpoint | None, quiet: bool = False, **kw: Any
) -> ReadCommitted:
    on_garbage = (lambda _j, _g: None) if quiet else _garbage_reporter(wal)  # (a recovery re-reads: reported once)
    return ReadCommitted(
        client, wal, checkpoint=checkpoint, message_type=WalEntry, on_garbage=on_garbage, on_jump=_gap, **kw
    )


class MainFetcher:
    """The main stream: every committed WAL entry, dispatched to every target named in it."""

    def __init__(
        self,
        client: AsyncClient,
        wal: str,
        dispatcher: Dispatcher,
        checkpoints: Checkpoints,
        *,
        checkpoint_every: int = 1000,
    ) -> None:
        self.client = client
        self.wal = wal
        self.dispatcher = dispatcher
        self.checkpoints = checkpoints
        self.checkpoint_every = checkpoint_every
        # Where the main reader has read to: a recovery up to current_index reads that far (a
        # transaction's entry is delivered at its ACK, past the entry's own end).
        self.current_end = 0

    async def run(self) -> None:
        reader = _reader(self.client, self.wal, self.checkpoints.checkpoints[-1], empty_batches=True)
        dispatch, since = self.dispatcher.dispatch, 0
        # The last index dispatched, or covered by the start checkpoint: a later entry only follows it.
        current = max(self.dispatcher.current_index, self.checkpoints.positions[-1])
        counter = DISPATCHED.labels(self.wal)
        async for batch in reader.batches():
            for env in batch:
                entry: WalEntry = env.message
                if env.begin <= current:  # (a transaction of another producer, committed late, say)
                    log.error("WAL %s: the entry at offset %d comes after entry %d: skipped (a LogPlayer WAL is "
                              "written by WalWriters only)", self.wal, env.begin, current)  # fmt: skip
                    GARBAGE.labels(self.wal).inc()
                    continue
                parts = {t: mutations_of(m) for t, m in entry.parts.items() if m}
                if not parts:  # (no mutation: not a WalWriter's transaction)
                    log.error("WAL %s: the entry at offset %d has no mutations: skipped", self.wal, env.begin)
                    GARBAGE.labels(self.wal).inc()
                try:
                    dispatch(env.begin, parts, committed_ns=entry.committed_ns, dispatched_ns=time.time_ns(),
                             size=env.end - env.begin)  # fmt: skip
                except KeyError as exc:  # (the dispatcher refuses it whole: nothing was queued)
                    raise UnknownTargetError(
                        f"WAL {self.wal}: {exc.args[0]}, which targets.yaml does not declare: add it (id and "
                        "endpoint) and restart the LogPlayer"
                    ) from None
                current = env.begin
            self.current_end = reader.offsets[self.wal]  # (no await since the batch's dispatches)
            since += len(batch)
            counter.inc(len(batch))
            if since >= self.checkpoint_every:
                since = 0
                self.checkpoints.add(self.dispatcher.current_index, reader.checkpoint())


async def recover(
    client: AsyncClient,
    wal: str,
    dispatcher: Dispatcher,
    checkpoints: Checkpoints,
    target: str,
    term: int,
    last_ack: int,
    until: tuple[int, int],
    room: asyncio.Event,
    *,
    high_water: int = 10_000,
) -> bool:
    """The recovery stream of `target` for `term`: its parts of the entries in (last_ack, until[0]]
    (until[1]: where that entry ends). True when it fetched them all (False: the term went stale)."""
    queue: TargetQueue = dispatcher.queues[target]
    last, end = until
    seen, checkpoint = checkpoints.at_or_before(last_ack)
    reader = _reader(client, wal, checkpoint, quiet=True, end_offsets={wal: end})
    log.info("target %s: recovering entries (%d, %d] (term %d)", target, last_ack, last, term)
    async for batch in reader.batches():
        for env in batch:
            if env.begin > last:
                return _completed(dispatcher, queue, target, term)
            if env.begin <= seen:  # (an entry that does not follow the one before: the main stream skipped it)
                continue
            seen = env.begin
            part = env.message.parts.get(target) if env.begin > last_ack else None
            if part:
                dispatcher.dispatch_recovery(target, env.begin, mutations_of(part), term, env.message.committed_ns,
                                             time.time_ns(), env.end - env.begin)  # fmt: skip
        if queue.term != term or queue.state is QueueState.SUSPENDED:  # (failed again: this term is over)
            return False
        while (
            queue.state is not QueueState.SUSPENDED  # type: ignore[comparison-overlap]  # (it changes while we wait)
            and queue.term == term
            and len(queue.catchup) >= high_water
        ):
            room.clear()
            await room.wait()
    return _completed(dispatcher, queue, target, term)


def _completed(dispatcher: Dispatcher, queue: TargetQueue, target: str, term: int) -> bool:
    if queue.term != term:
        return False
    if queue.fetching_completed(term):
        dispatcher.wake(target)
    return True
