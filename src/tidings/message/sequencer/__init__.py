"""Sequencer: turns read-uncommitted messages into read-committed ones (gazette-exactly-once.txt, *Message UUIDs*).

A journal holds duplicates (appends are at-least-once), messages of transactions still pending, and messages of
transactions rolled back. The Sequencer is fed the :class:`Envelope` of every message in journal read order and
hands back each committed message exactly once, in journal order per producer, never a rolled-back one
(DESIGN.md invariant 7). It is pure and synchronous (no I/O, no clock, no threads; not thread-safe): the caller
reads journals.

Rules, per (journal, producer), as in Gazette's ``message/sequencer.go``. The state is ``last_ack`` (the clock of
the producer's last acknowledgement) and ``begin`` (offset of its first pending CONTINUE_TXN message, or -1); a
producer's first message in a journal finds ``last_ack`` one below its own clock (it is never a duplicate):

* A message with a clock <= ``last_ack`` is a duplicate and is dropped (ACK_TXN: see below).
* OUTSIDE_TXN commits itself: it is delivered at once and becomes the new ``last_ack``. Pending CONTINUE_TXN
  messages of the same producer are dropped (Gazette's treatment of mixing the two; logged).
* CONTINUE_TXN is pending. One whose clock is not above the producer's largest pending clock is a duplicate.
* ACK_TXN with a clock above ``last_ack`` commits the pending messages with clocks <= its own, in journal order,
  and rolls back those with larger clocks (an aborted transaction). An ACK_TXN with clock == ``last_ack`` rolls back
  every pending message; one below ``last_ack`` does too and resets ``last_ack`` to its clock: an upstream
  checkpoint went backwards, so exactly-once weakens to at-least-once until the producer catches up (logged).
  ACK_TXN messages themselves are never delivered: they carry no application data.
* A message without a v1 UUID (absent, nil, another version, or a zero clock) is delivered at once:
  at-least-once, as for types that opt out of UUIDs.

Committed messages are dequeued as soon as their ACK is read, even when other producers' transactions are still
pending: no head-of-line blocking. Pending messages live in a ring buffer of ``ring_size`` envelopes. When a
committed transaction is no longer wholly in the ring, :meth:`Sequencer.queue` returns a :class:`Replay` naming the
journal range to re-read: [the first pending message, the first one still in the ring) -- at most the ACK's offset.
The caller reads that range and passes the envelopes to :meth:`Sequencer.replay`; only then does it dequeue::

    for env in read_uncommitted(journal):
        replay = seq.queue(env)
        if replay is not None:
            seq.replay(read_uncommitted(replay.journal, replay.begin, replay.end))
        for committed in seq.dequeue():
            handle(committed)

(:meth:`Sequencer.feed` does the first three steps.) A message returned by :meth:`Sequencer.step` (or yielded by
:meth:`Sequencer.dequeue`) counts as delivered from then on, including for a checkpoint taken before the next step.

**Checkpoints.** :meth:`Sequencer.checkpoint` returns a :class:`Checkpoint` (a msgspec Struct; ``to_json()``) with,
per journal, the read-through offset (every message before it was queued and is accounted for; a transaction still
being dequeued keeps its ACK beyond it, so a restore reads that ACK again) and each producer's ``{last_ack, begin}``.
:meth:`Sequencer.restore` resumes from it: re-read each journal from :meth:`Checkpoint.resume_offset` =
min(read-through, producers' ``begin``) and exactly the messages not yet delivered come out. Messages before the
read-through offset only rebuild pending transactions (they were queued before), so old ACKs and duplicates there
change nothing. Re-reading from the read-through offset alone also works, as in Gazette: pending transactions that
began earlier are then replayed on demand.

**Producer horizon.** Every producer ever seen costs a little state, so a checkpoint (or :meth:`Sequencer.prune`)
forgets producers that went quiet, as Gazette does: a producer is dropped when its newest clock is older than the
newest ``last_ack`` of any producer in the same journal minus ``producer_horizon`` seconds. The horizon is measured
in producer clock time (the UUID timestamps), not in wall time or offsets, so it is deterministic for a journal.
Dropping a producer forgets its pending transaction (which also stops it pinning the resume offset); a duplicate of
its messages read later would be delivered again, so pick a horizon well beyond the longest retry or transaction.

**Layout.** The rules above exist once as a reference and four times for speed; a property test
(tests/message/test_sequencer_rules.py) runs every fast path against the reference:

* :mod:`.rules` - the reference: the rules as a table, per (journal, producer), over a list of messages (no
  ring, no replays, no speed tricks); what every path below must deliver and the states it must reach.
* :mod:`.ring` - the :class:`Sequencer`: its state, the ring path (``queue``, ``replay``, ``step``, ``dequeue``,
  ``feed``), checkpoints and the producer horizon.
* :mod:`.batch` - :meth:`Sequencer.sequence`, the readers' batch path (OUTSIDE_TXN messages delivered inline).
* :mod:`.advance` - :meth:`Sequencer.advance`, the checkpoint-only scan (a scalar fold, message by message), and
  :mod:`.advance_numpy`, its fold per producer over UUIDs in a numpy array (numpy is imported only there).
* :mod:`.records` (:class:`Envelope`, :class:`Replay`, :class:`QueueOutcome`, statistics, errors, defaults),
  :mod:`.checkpoint` (:class:`Checkpoint` and its parts) and :mod:`.partial` (a producer's state in a journal).
"""

from __future__ import annotations

from tidings.message.sequencer.checkpoint import Checkpoint, JournalCheckpoint, ProducerState
from tidings.message.sequencer.records import (
    DEFAULT_PRODUCER_HORIZON,
    DEFAULT_RING_SIZE,
    Envelope,
    QueueOutcome,
    Replay,
    ReplayRequiredError,
    SequencerStatistics,
)
from tidings.message.sequencer.ring import Sequencer

__all__ = [
    "Checkpoint",
    "DEFAULT_PRODUCER_HORIZON",
    "DEFAULT_RING_SIZE",
    "Envelope",
    "JournalCheckpoint",
    "ProducerState",
    "QueueOutcome",
    "Replay",
    "ReplayRequiredError",
    "Sequencer",
    "SequencerStatistics",
]
