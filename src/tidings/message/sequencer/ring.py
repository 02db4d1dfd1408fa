"""The :class:`Sequencer` itself: its state, the ring path (:meth:`~Sequencer.queue`, :meth:`~Sequencer.replay`,
:meth:`~Sequencer.step`, :meth:`~Sequencer.dequeue`, :meth:`~Sequencer.feed`), checkpoints and the producer horizon.

Pending CONTINUE_TXN envelopes wait in a ring of ``ring_size`` slots, linked per producer; a committed
transaction no longer wholly in the ring is replayed from the journal. The batch path
(:meth:`~Sequencer.sequence`, :mod:`.batch`) and the checkpoint-only scan (:meth:`~Sequencer.advance`,
:mod:`.advance`) are mixed in; all three follow the rules of the package docstring (:mod:`.rules`).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable, Iterator

from tidings.message.sequencer.advance import _AdvancePath
from tidings.message.sequencer.batch import _BatchPath
from tidings.message.sequencer.checkpoint import Checkpoint, JournalCheckpoint, ProducerState
from tidings.message.sequencer.partial import _Partial
from tidings.message.sequencer.records import (
    _OUTSIDE_COMMIT,
    DEFAULT_PRODUCER_HORIZON,
    DEFAULT_RING_SIZE,
    Envelope,
    QueueOutcome,
    Replay,
    ReplayRequiredError,
    SequencerStatistics,
)
from tidings.message.uuid import ACK_TXN, CONTINUE_TXN, OUTSIDE_TXN, uuid_fields
from tidings.protocol.status import UsageError, ValidationError

log = logging.getLogger("tidings.message.sequencer")  # (the package's name, as before it was one)

_Candidate = tuple[Envelope, int]  # an envelope and its clock


class Sequencer(_BatchPath, _AdvancePath):
    """Sequences read-uncommitted envelopes into read-committed ones; see the package docstring.

    **Parameters:**

    * **ring_size** - how many pending envelopes to keep; a transaction longer than the ring is replayed.
    * **producer_horizon** - seconds of producer clock time before a quiet producer is forgotten; None: never.
    * **checkpoint** - resume from this checkpoint (same as :meth:`restore`).
    """

    def __init__(
        self,
        ring_size: int = DEFAULT_RING_SIZE,
        *,
        producer_horizon: float | None = DEFAULT_PRODUCER_HORIZON,
        checkpoint: Checkpoint | None = None,
    ) -> None:
        if ring_size < 1:
            raise ValueError(f"ring_size must be at least 1, got {ring_size}")
        if producer_horizon is not None and producer_horizon <= 0:
            raise ValueError(f"producer_horizon must be positive seconds or None, got {producer_horizon}")
        self.ring_size = ring_size
        self.producer_horizon = producer_horizon
        self._ring: list[tuple[Envelope, _Partial, int] | None] = [None] * ring_size
        self._next: list[int] = [-1] * ring_size
        self._head = 0
        self._partials: dict[tuple[str, int], _Partial] = {}
        self._offsets: dict[str, int] = {}  # read-through offset per journal
        self._reread: dict[str, int] = {}  # restored read-through offsets not yet passed
        # Sequences begun or extended since clear_pending (Gazette's), by the generation they last were.
        self._pending: dict[tuple[str, int], int] = {}
        self.generation = 0  # the caller's count of its reads, if it keeps one (see pending_generation)
        # Dequeue state: the partial being emitted, the end offset of its committing envelope, the largest clock
        # considered so far, the next candidate, and the replay (requested range, supplied iterator).
        self._emit: _Partial | None = None
        self._emit_end = 0
        self._seen_max = 0
        self._lookahead: _Candidate | None = None
        self._fast: _Candidate | None = None  # an OUTSIDE_TXN envelope queued on the fast path
        self._need_replay: Replay | None = None
        self._replay_range: Replay | None = None
        self._replay_it: Iterator[Envelope] | None = None
        self.last_outcome: QueueOutcome | None = None
        self._outcomes: Counter[QueueOutcome] = Counter()
        self._delivered = 0
        self._replays = 0
        self._replayed = 0
        if checkpoint is not None:
            self._restore(checkpoint)

    @classmethod
    def restore(
        cls,
        checkpoint: Checkpoint,
        ring_size: int = DEFAULT_RING_SIZE,
        *,
        producer_horizon: float | None = DEFAULT_PRODUCER_HORIZON,
    ) -> Sequencer:
        """A Sequencer resuming from `checkpoint`; re-read each journal from ``checkpoint.resume_offset(journal)``."""
        return cls(ring_size, producer_horizon=producer_horizon, checkpoint=checkpoint)

    def _restore(self, checkpoint: Checkpoint) -> None:
        for journal, jc in checkpoint.journals.items():
            self._offsets[journal] = jc.read_through
            self._reread[journal] = jc.read_through
            for hex_id, state in jc.producers.items():
                try:
                    producer = int(hex_id, 16)
                except ValueError:
                    producer = -1
                if len(hex_id) != 12 or producer < 0:
                    raise ValidationError(f"journals.{journal}.producers", f"{hex_id!r} is not a 12-digit hex id")
                self._partials[(journal, producer)] = _Partial(
                    journal, producer, state.last_ack, state.begin, state.newest
                )

    # --- Queueing ----------------------------------------------------------------------------------------------

    @property
    def dequeuing(self) -> bool:
        """True while committed messages remain to dequeue (and :meth:`queue` must wait)."""
        return self._emit is not None

    @property
    def has_pending(self) -> bool:
        """A transaction begun or extended since :meth:`clear_pending` awaits its ACK (Gazette's HasPending):
        assuming a live producer, more is coming, and a consumer transaction may wait for it."""
        return bool(self._pending)

    def clear_pending(self) -> None:
        """Forget the pending transactions seen so far (a consumer transaction closed without their ACKs:
        the next one need not wait for them either)."""
        self._pending.clear()

    def pending_generation(self) -> int:
        """The newest `generation` in which a transaction still awaiting its ACK was begun or extended
        (-1: none). A caller that reads ahead of what it consumes numbers its reads in `generation`:
        a consumer transaction that began after read G then waits for an ACK only if this is above G
        (has_pending and clear_pending are the same question for a caller that does not read ahead)."""
        return max(self._pending.values(), default=-1)

    @property
    def pending_replay(self) -> Replay | None:
        """The range that must be passed to :meth:`replay` before dequeuing, if any."""
        return self._need_replay

    def queue(self, env: Envelope) -> Replay | None:
        """Apply the next read-uncommitted envelope; return the range to replay if its commit needs one.

        Raises UsageError while committed messages remain to dequeue.
        """
        if self._emit is not None:
            raise UsageError("committed messages remain to dequeue: drain dequeue() before queueing more")
        u = env.uuid
        return self._queue(env, None if u is None else uuid_fields(u.int))

    def _queue(self, env: Envelope, fields: tuple[int, int, int] | None) -> Replay | None:  # noqa: C901  (the per-message hot path, inlined: the rules are in rules.py)
        """`queue` of an envelope whose UUID fields (or None) are already unpacked."""
        journal = env.journal
        offsets = self._offsets
        if journal not in offsets:
            offsets[journal] = env.begin  # nothing before the first envelope read was queued
        u = env.uuid
        if self._reread:
            read_through = self._reread.get(journal)
            if read_through is not None:
                if env.end <= read_through:
                    self._queue_reread(env, fields)
                    return None
                del self._reread[journal]
        if fields is None or fields[1] == 0:
            if u is not None and u.int:
                log.debug("journal %s offset %d: not a v1 UUID (%s); delivering at-least-once", journal, env.begin, u)
            transient = _Partial(journal, -1, 0)
            transient.max_clock = 1
            return self._commit(QueueOutcome.NO_UUID_COMMIT, transient, env, (env, 1))
        producer, clock, flags = fields
        key = (journal, producer)
        p = self._partials.get(key)
        if p is None:
            p = self._partials[key] = _Partial(journal, producer, clock - 1)

        if flags == CONTINUE_TXN:
            if clock <= p.min_clock:
                outcome = QueueOutcome.CONTINUE_ALREADY_ACKED
            elif clock <= p.max_clock:
                outcome = QueueOutcome.CONTINUE_TXN_CLOCK_LARGER
            else:
                if p.begin == -1:
                    p.begin = env.begin
                    outcome = QueueOutcome.CONTINUE_BEGIN_SPAN
                else:
                    outcome = QueueOutcome.CONTINUE_EXTEND_SPAN
                self._add_at_head(env, p, clock)
                p.max_clock = clock
                self._pending[key] = self.generation
        elif flags == ACK_TXN:
            self._pending.pop(key, None)
            if clock <= p.min_clock:
                if clock < p.min_clock:
                    log.warning(
                        "journal %s offset %d: ACK_TXN of producer %012x has clock %d below its last ACK %d: "
                        "an upstream checkpoint went backwards (loss of exactly-once)",
                        journal, env.begin, producer, clock, p.min_clock,
                    )  # fmt: skip
                p.reset(clock)
                outcome = QueueOutcome.ACK_ROLLBACK
            elif p.begin == -1:
                p.reset(clock)
                outcome = QueueOutcome.ACK_EMPTY
            else:
                p.max_clock = clock
                oldest = None if p.ring_start == -1 else self._ring[p.ring_start]
                assert oldest is not None or p.ring_start == -1  # (a partial's ring indices point at filled slots)
                first = -1 if oldest is None else oldest[0].begin
                if first == p.begin:
                    return self._commit(QueueOutcome.ACK_COMMIT_RING, p, env, None)
                replay = Replay(journal, p.begin, env.begin if first == -1 else first)
                return self._commit(QueueOutcome.ACK_COMMIT_REPLAY, p, env, None, replay)
        else:
            if flags != OUTSIDE_TXN:
                log.warning("journal %s offset %d: unexpected UUID flags %#x; handled as OUTSIDE_TXN", journal,
                            env.begin, flags)  # fmt: skip
            if clock <= p.min_clock:
                outcome = QueueOutcome.OUTSIDE_ALREADY_ACKED
            elif p.begin == -1 and self._replay_it is None:
                # The common case, on a fast path: a message that commits itself, nothing pending.
                self._emit = p
                self._emit_end = env.end
                self._fast = (env, clock)
                self._outcomes[_OUTSIDE_COMMIT] += 1
                self.last_outcome = _OUTSIDE_COMMIT
                return None
            else:
                if p.begin != -1:
                    log.warning(
                        "journal %s offset %d: OUTSIDE_TXN of producer %012x after its pending CONTINUE_TXN messages "
                        "(mixed committed and transactional publishing?); the pending messages are dropped",
                        journal, env.begin, producer,
                    )  # fmt: skip
                p.max_clock = clock
                p.ring_start = p.ring_stop = -1
                self._pending.pop(key, None)
                return self._commit(QueueOutcome.OUTSIDE_COMMIT, p, env, (env, clock))
        offsets[journal] = env.end
        self._outcomes[outcome] += 1
        self.last_outcome = outcome
        return None

    def _queue_reread(self, env: Envelope, fields: tuple[int, int, int] | None) -> None:
        """An envelope before the restored read-through offset: only rebuild pending transactions from it."""
        outcome = QueueOutcome.REREAD_IGNORED
        if fields is not None and fields[2] == CONTINUE_TXN:
            producer, clock, _ = fields
            p = self._partials.get((env.journal, producer))
            if p is not None and p.begin != -1 and env.begin >= p.begin and clock > p.max_clock:
                self._add_at_head(env, p, clock)
                p.max_clock = clock
                outcome = QueueOutcome.REREAD_PENDING
        self._outcomes[outcome] += 1
        self.last_outcome = outcome

    def _commit(
        self,
        outcome: QueueOutcome,
        p: _Partial,
        env: Envelope,
        first: _Candidate | None,
        replay: Replay | None = None,
    ) -> Replay | None:
        """Start dequeuing `p`'s committed messages (through p.max_clock), committed by `env`."""
        self._emit = p
        self._emit_end = env.end
        self._seen_max = p.min_clock
        self._lookahead = first
        self._need_replay = self._replay_range = replay
        if replay is not None:
            self._replays += 1
        self._outcomes[outcome] += 1
        self.last_outcome = outcome
        return replay

    def _add_at_head(self, env: Envelope, p: _Partial, clock: int) -> None:
        """Store a pending envelope at the ring's head, evicting the oldest one there."""
        ring, nxt, head = self._ring, self._next, self._head
        old = ring[head]
        if old is not None:
            owner = old[1]
            if owner.ring_start == head:  # evicting the owner's oldest pending envelope
                if owner.ring_start == owner.ring_stop:
                    owner.ring_start = owner.ring_stop = -1
                else:
                    owner.ring_start = nxt[head]
        ring[head] = (env, p, clock)
        nxt[head] = -1
        if p.ring_stop == -1:
            p.ring_start = head
        else:
            nxt[p.ring_stop] = head
        p.ring_stop = head
        self._head = head + 1 if head + 1 < self.ring_size else 0

    # --- Dequeueing --------------------------------------------------------------------------------------------

    def replay(self, envelopes: Iterable[Envelope]) -> None:
        """Supply the envelopes of the range :meth:`queue` returned, read again from the journal, in order.

        They are consumed lazily by :meth:`step`; reading stops at the range's end, so a longer iterable is fine.
        May be called again (with a fresh read of the range) if the previous iterable failed.
        """
        if self._emit is None or self._replay_range is None:
            raise UsageError("no replay was requested: call replay() only after queue() returned a Replay")
        self._replay_it = iter(envelopes)
        self._need_replay = None

    def step(self) -> Envelope | None:
        """The next committed envelope (delivered from now on), or None when the committed sequence is done."""
        p = self._emit
        if p is None:
            return None
        fast = self._fast
        if fast is not None:  # an OUTSIDE_TXN message (see queue)
            env, clock = fast
            self._fast = None
            self._emit = None
            self._deliver_outside(p, env, clock)
            return env
        if self._need_replay is not None:
            raise ReplayRequiredError(self._need_replay)
        cur = self._lookahead
        if cur is None:
            cur = self._next_candidate(p)
            if cur is None:
                self._finish(p)
                return None
        nxt = self._next_candidate(p)
        self._lookahead = nxt
        if nxt is None:
            self._finish(p)
        else:
            # A checkpoint taken now resumes after `cur`, at the next committed message of the sequence.
            p.min_clock = cur[1]
            p.begin = nxt[0].begin
        self._delivered += 1
        return cur[0]

    def dequeue(self) -> Iterator[Envelope]:
        """Yield every committed envelope made ready by the last :meth:`queue`; exhaust it before queueing again."""
        step = self.step
        while (env := step()) is not None:
            yield env

    def _deliver_outside(self, p: _Partial, env: Envelope, clock: int) -> None:
        """An OUTSIDE_TXN message is delivered: its clock is its producer's last ACK, and the
        read-through offset passes it."""
        p.min_clock = p.max_clock = clock
        if self._offsets.get(env.journal, -1) < env.end:
            self._offsets[env.journal] = env.end
        self._delivered += 1

    def feed(self, env: Envelope, reread: Callable[[Replay], Iterable[Envelope]]) -> Iterator[Envelope]:
        """Queue `env`, satisfy a replay with ``reread(range)``, and return :meth:`dequeue` (exhaust it)."""
        replay = self.queue(env)
        if replay is not None:
            self.replay(reread(replay))
        return self.dequeue()

    def _next_candidate(self, p: _Partial) -> _Candidate | None:
        """The next envelope of `p`'s committed sequence: from the replay first, then from the ring."""
        while True:
            it = self._replay_it
            if it is not None:
                env = next(it, None)
                if env is None:
                    self._replay_it = None
                    continue
                expect = self._replay_range
                assert expect is not None
                if env.journal != expect.journal or env.begin < expect.begin:
                    raise UsageError(
                        f"replay read journal {env.journal} at offset {env.begin}, but the requested range is "
                        f"journal {expect.journal} [{expect.begin}, {expect.end})"
                    )
                if env.begin >= expect.end:
                    self._replay_it = None
                    continue
                self._replayed += 1
                u = env.uuid
                fields = None if u is None else uuid_fields(u.int)
                if fields is None or fields[0] != p.producer or fields[2] != CONTINUE_TXN:
                    continue  # another producer's message, or not part of a transaction
                clock = fields[1]
            else:
                head = p.ring_start
                if head == -1:
                    return None
                entry = self._ring[head]
                assert entry is not None  # (a partial's ring indices point at filled slots)
                env, _, clock = entry
                p.ring_start = self._next[head]
            # Mirror live queueing: a CONTINUE_TXN counts only if its clock is above every earlier one.
            if clock <= self._seen_max:
                continue
            self._seen_max = clock
            if clock > p.max_clock:
                continue  # rolled back: beyond the ACK's clock
            return env, clock

    def _finish(self, p: _Partial) -> None:
        """The committed sequence is delivered: the ACK's clock becomes last_ack and the read-through offset moves."""
        p.reset(p.max_clock)
        journal = p.journal
        if self._offsets.get(journal, -1) < self._emit_end:
            self._offsets[journal] = self._emit_end
        self._emit = None
        self._lookahead = None
        self._need_replay = self._replay_range = None
        self._replay_it = None

    # --- Checkpoints -------------------------------------------------------------------------------------------

    def checkpoint(self) -> Checkpoint:
        """Prune quiet producers, then snapshot read-through offsets and producer states (see the package docstring).

        May be taken at any time, also between two :meth:`step` calls.
        """
        self.prune()
        journals = {journal: JournalCheckpoint(offset, {}) for journal, offset in self._offsets.items()}
        for (journal, producer), p in self._partials.items():
            jc = journals.setdefault(journal, JournalCheckpoint(0, {}))  # (every queued journal has an offset)
            newest = p.newest  # (recorded only when it says more than last_ack)
            jc.producers[f"{producer:012x}"] = ProducerState(
                p.min_clock, p.begin, -1 if newest == p.min_clock else newest
            )
        return Checkpoint(journals)

    def prune(self) -> int:
        """Forget producers quiet for longer than ``producer_horizon`` (in clock time); return how many."""
        if self.producer_horizon is None or not self._partials:
            return 0
        horizon = int(self.producer_horizon * 10_000_000) << 4  # seconds -> 100 ns units -> clock units
        newest: dict[str, int] = {}
        for p in self._partials.values():
            if p.min_clock > newest.get(p.journal, 0):
                newest[p.journal] = p.min_clock
        stale = [
            key
            for key, p in self._partials.items()
            if p is not self._emit and p.newest < newest.get(p.journal, 0) - horizon
        ]
        for key in stale:
            del self._partials[key]
            self._pending.pop(key, None)  # (forgotten: nothing to wait for)
        return len(stale)

    def statistics(self) -> SequencerStatistics:
        """Counters for metrics and the CLI: queue outcomes, deliveries, replays, tracked producers."""
        return SequencerStatistics(
            outcomes={o.name: n for o, n in self._outcomes.items()},
            delivered=self._delivered,
            replays=self._replays,
            replayed_envelopes=self._replayed,
            producers=len(self._partials),
            ring_size=self.ring_size,
        )
