"""The read-committed Sequencer (DESIGN.md invariant 7): each committed message exactly once, in journal order per
producer, never a rolled-back one -- across duplicates, aborted transactions, ring overflows and restores.

Unit cases follow Gazette's sequencer_test.go; a hypothesis state machine then compares the Sequencer with the
reference rules (an obvious dictionary model) over random interleavings, tiny rings, replays and checkpoint/restore
at any step.
"""

from __future__ import annotations

import logging
import os
import uuid
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tidings.message import (
    ACK_TXN,
    CONTINUE_TXN,
    OUTSIDE_TXN,
    Checkpoint,
    Clock,
    Envelope,
    JournalCheckpoint,
    ProducerState,
    QueueOutcome,
    Replay,
    ReplayRequiredError,
    Sequencer,
    build_uuid,
    clock_from_unix_ns,
    unix_ns_from_clock,
)
from tidings.message.sequencer import rules
from tidings.message.uuid import uuid_fields
from tidings.protocol.status import UsageError, ValidationError

P1, P2, P3 = b"\x01\x00\x00\x00\x00\x01", b"\x01\x00\x00\x00\x00\x02", b"\x03\x00\x00\x00\x00\x03"
START = clock_from_unix_ns(1_700_000_000 * 10**9)  # 2023-11-14
SECOND = 10_000_000 << 4  # one second in clock units


@dataclass
class Journals:
    """Journals being written: envelopes with increasing offsets, and a clock per producer."""

    envs: dict[str, list[Envelope]] = field(default_factory=dict)
    clocks: dict[bytes, Clock] = field(default_factory=dict)
    serial: int = 0

    def write(
        self, journal: str, producer: bytes | None, flags: int = OUTSIDE_TXN, clock: int | None = None
    ) -> Envelope:
        if producer is not None and clock is None:
            # Producers follow one wall clock, 100 ns per write, as real publishers on synchronized hosts do.
            c = self.clocks.setdefault(producer, Clock())
            c.update(unix_ns_from_clock(START) + 100 * self.serial)
            clock = c.tick()
        u = None if producer is None else build_uuid(producer, clock or 0, flags)
        return self.put(journal, u, f"m{self.serial}")

    def put(self, journal: str, u: Any, message: Any) -> Envelope:
        log = self.envs.setdefault(journal, [])
        begin = log[-1].end if log else 0
        self.serial += 1
        env = Envelope(journal, begin, begin + 5 + self.serial % 7, u, message)
        log.append(env)
        return env

    def resend(self, env: Envelope) -> Envelope:
        """The same message appended again (an at-least-once retry)."""
        return self.put(env.journal, env.uuid, env.message)

    def read(self, journal: str, begin: int = 0, end: int | None = None) -> list[Envelope]:
        return [e for e in self.envs.get(journal, []) if e.begin >= begin and (end is None or e.begin < end)]


def run(seq: Sequencer, js: Journals, envs: list[Envelope]) -> list[Envelope]:
    """Feed envelopes, satisfying replays from `js`, and collect what is delivered."""
    out: list[Envelope] = []
    for env in envs:
        out.extend(seq.feed(env, lambda r: js.read(r.journal, r.begin, r.end)))
    return out


def msgs(envs: list[Envelope]) -> list[Any]:
    return [e.message for e in envs]


# --- Unit cases -------------------------------------------------------------------------------------------------


def test_outside_txn_is_delivered_at_once_and_its_duplicates_dropped() -> None:
    js, seq = Journals(), Sequencer(producer_horizon=None)
    a = js.write("j", P1)
    b = js.write("j", P1)
    assert seq.queue(a) is None and seq.last_outcome is QueueOutcome.OUTSIDE_COMMIT
    assert list(seq.dequeue()) == [a]
    assert run(seq, js, [b, js.resend(a), js.resend(b)]) == [b]  # b once; the duplicates are dropped
    assert seq.statistics().outcomes == {"OUTSIDE_COMMIT": 2, "OUTSIDE_ALREADY_ACKED": 2}


def test_continue_txn_waits_for_its_ack_and_commits_in_journal_order() -> None:
    js, seq = Journals(), Sequencer(producer_horizon=None)
    c1, c2 = js.write("j", P1, CONTINUE_TXN), js.write("j", P1, CONTINUE_TXN)
    dup = js.resend(c1)
    c3 = js.write("j", P1, CONTINUE_TXN)
    ack = js.write("j", P1, ACK_TXN)
    assert run(seq, js, [c1, c2, dup, c3]) == []
    assert seq.checkpoint().journals["j"].producers[P1.hex()].begin == c1.begin
    assert run(seq, js, [ack]) == [c1, c2, c3]
    assert seq.last_outcome is QueueOutcome.ACK_COMMIT_RING
    assert seq.statistics().outcomes["CONTINUE_TXN_CLOCK_LARGER"] == 1  # the duplicate never entered the ring
    assert run(seq, js, [js.resend(c2), js.resend(ack)]) == []  # all duplicates now
    assert seq.checkpoint().journals["j"].producers[P1.hex()] == ProducerState(_clock(ack), -1)


def test_ack_with_a_smaller_clock_commits_through_it_and_rolls_back_the_rest() -> None:
    js, seq = Journals(), Sequencer(producer_horizon=None)
    c1, c2, c3 = (js.write("j", P1, CONTINUE_TXN) for _ in range(3))
    partial_ack = js.write("j", P1, ACK_TXN, clock=_clock(c2))
    assert run(seq, js, [c1, c2, c3, partial_ack]) == [c1, c2]


def test_ack_at_last_ack_rolls_back_the_whole_transaction() -> None:
    js, seq = Journals(), Sequencer(producer_horizon=None)
    first = js.write("j", P1)
    aborted = [js.write("j", P1, CONTINUE_TXN) for _ in range(2)]
    rollback = js.write("j", P1, ACK_TXN, clock=_clock(first))
    c = js.write("j", P1, CONTINUE_TXN)
    ack = js.write("j", P1, ACK_TXN)
    assert run(seq, js, [first, *aborted, rollback, c, ack]) == [first, c]
    assert seq.statistics().outcomes["ACK_ROLLBACK"] == 1


def test_ack_below_last_ack_resets_it_and_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    """Gazette: an upstream checkpoint went backwards; exactly-once weakens to at-least-once, loudly."""
    js, seq = Journals(), Sequencer(producer_horizon=None)
    a, b = js.write("j", P1), js.write("j", P1)
    old_ack = js.write("j", P1, ACK_TXN, clock=_clock(a))
    with caplog.at_level(logging.WARNING, logger="tidings.message.sequencer"):
        assert run(seq, js, [a, b, old_ack]) == [a, b]
    assert "loss of exactly-once" in caplog.text
    dup = js.resend(b)
    assert run(seq, js, [dup]) == [dup]  # b's clock is above the reset last_ack again: delivered twice


def test_committed_messages_are_not_blocked_behind_another_producers_pending_ones() -> None:
    js, seq = Journals(), Sequencer(producer_horizon=None)
    p1 = js.write("j", P1, CONTINUE_TXN)
    p2 = js.write("j", P2, CONTINUE_TXN)
    p1b = js.write("j", P1, CONTINUE_TXN)
    out = js.write("j", P3)
    ack2 = js.write("j", P2, ACK_TXN)
    assert run(seq, js, [p1, p2, p1b, out]) == [out]
    assert run(seq, js, [ack2]) == [p2]
    assert run(seq, js, [js.write("j", P1, ACK_TXN)]) == [p1, p1b]


def test_one_producer_in_two_journals_is_sequenced_per_journal() -> None:
    js, seq = Journals(), Sequencer(producer_horizon=None)
    a1 = js.write("a", P1, CONTINUE_TXN)
    b1 = js.write("b", P1, CONTINUE_TXN)
    ack_a = js.write("a", P1, ACK_TXN)
    assert run(seq, js, [a1, b1, ack_a]) == [a1]
    assert run(seq, js, [js.write("b", P1, ACK_TXN)]) == [b1]


def test_transaction_longer_than_the_ring_is_replayed_from_the_journal() -> None:
    js, seq = Journals(), Sequencer(ring_size=2, producer_horizon=None)
    c = [js.write("j", P1, CONTINUE_TXN) for _ in range(5)]
    other = js.write("j", P2, CONTINUE_TXN)  # interleaved, and evicts c[3] from the ring as well
    ack = js.write("j", P1, ACK_TXN)
    for env in [*c, other]:
        assert seq.queue(env) is None
    replay = seq.queue(ack)
    assert seq.last_outcome is QueueOutcome.ACK_COMMIT_REPLAY
    assert replay == seq.pending_replay == Replay("j", c[0].begin, c[4].begin)  # c[4] is still in the ring
    with pytest.raises(ReplayRequiredError, match=r"re-read \[0, "):
        list(seq.dequeue())
    seq.replay(js.read("j", replay.begin))  # longer than the range: reading stops at its end
    assert list(seq.dequeue()) == c
    assert not seq.dequeuing and seq.statistics().replays == 1


def test_replay_of_the_wrong_range_is_refused() -> None:
    js, seq = Journals(), Sequencer(ring_size=1, producer_horizon=None)
    c1, c2 = js.write("j", P1, CONTINUE_TXN), js.write("j", P1, CONTINUE_TXN)
    stray = js.write("k", P1, CONTINUE_TXN)
    for env in (c1, c2):
        seq.queue(env)
    replay = seq.queue(js.write("j", P1, ACK_TXN))
    assert replay is not None
    seq.replay([stray])
    with pytest.raises(UsageError, match="replay read journal k"):
        seq.step()
    seq.replay(js.read("j", replay.begin, replay.end))  # a fresh read of the range recovers
    assert list(seq.dequeue()) == [c1, c2]
    with pytest.raises(UsageError, match="no replay was requested"):
        seq.replay([])


def test_queue_while_committed_messages_remain_is_refused() -> None:
    js, seq = Journals(), Sequencer(producer_horizon=None)
    seq.queue(js.write("j", P1))
    assert seq.dequeuing
    with pytest.raises(UsageError, match="drain dequeue"):
        seq.queue(js.write("j", P2))


def test_messages_without_uuid_are_delivered_every_time() -> None:
    js, seq = Journals(), Sequencer(producer_horizon=None)
    a = js.write("j", None)
    dup = js.resend(a)
    nil = js.put("j", build_uuid(P1, 0, OUTSIDE_TXN), "zero clock")
    v4 = js.put("j", uuid.uuid4(), "v4")
    assert run(seq, js, [a, dup, nil, v4]) == [a, dup, nil, v4]
    assert seq.statistics().outcomes == {"NO_UUID_COMMIT": 4}


def test_outside_txn_after_pending_continue_drops_them(caplog: pytest.LogCaptureFixture) -> None:
    js, seq = Journals(), Sequencer(producer_horizon=None)
    c = js.write("j", P1, CONTINUE_TXN)
    o = js.write("j", P1)
    with caplog.at_level(logging.WARNING, logger="tidings.message.sequencer"):
        assert run(seq, js, [c, o, js.write("j", P1, ACK_TXN)]) == [o]
    assert "pending messages are dropped" in caplog.text


def test_checkpoint_mid_transaction_restores_without_loss_or_duplicates() -> None:
    js, seq = Journals(), Sequencer(producer_horizon=None)
    before = [js.write("j", P1, CONTINUE_TXN), js.write("j", P2), js.write("j", P1, CONTINUE_TXN)]
    assert run(seq, js, before) == [before[1]]
    cp = Checkpoint.from_json(seq.checkpoint().to_json())
    assert cp.journals["j"].read_through == before[-1].end
    assert cp.resume_offset("j") == before[0].begin and cp.resume_offset("unknown") == 0
    after = [js.write("j", P1, CONTINUE_TXN), js.write("j", P1, ACK_TXN)]
    restored = Sequencer.restore(cp, ring_size=4, producer_horizon=None)
    assert run(restored, js, js.read("j", cp.resume_offset("j"))) == [before[0], before[2], after[0]]
    assert restored.statistics().outcomes["REREAD_PENDING"] == 2
    assert restored.statistics().replays == 0  # the re-read pending messages were in the ring


def test_rolled_back_messages_re_read_after_a_restore_stay_rolled_back() -> None:
    """Another producer's pending transaction makes the restore re-read a rolled-back one: it must not revive."""
    js, seq = Journals(), Sequencer(producer_horizon=None)
    q = js.write("j", P2, CONTINUE_TXN)
    first = js.write("j", P1)
    aborted = [js.write("j", P1, CONTINUE_TXN) for _ in range(2)]
    rollback = js.write("j", P1, ACK_TXN, clock=_clock(first))
    c = js.write("j", P1, CONTINUE_TXN)
    assert run(seq, js, [q, first, *aborted, rollback, c]) == [first]
    cp = seq.checkpoint()
    assert cp.resume_offset("j") == q.begin
    js.write("j", P1, ACK_TXN)
    restored = Sequencer.restore(cp, ring_size=8, producer_horizon=None)
    assert run(restored, js, js.read("j", q.begin)) == [c]
    assert restored.statistics().replays == 0


def test_checkpoint_between_steps_resumes_after_the_last_delivered_message() -> None:
    js, seq = Journals(), Sequencer(producer_horizon=None)
    c = [js.write("j", P1, CONTINUE_TXN) for _ in range(4)]
    seq_envs = [*c, js.write("j", P1, ACK_TXN), js.write("j", P2)]
    for env in seq_envs[:4]:
        seq.queue(env)
    seq.queue(seq_envs[4])
    assert [seq.step(), seq.step()] == c[:2]
    cp = seq.checkpoint()
    # (with the newest clock seen of P1, its committing ACK's, for the producer horizon)
    assert cp.journals["j"].producers[P1.hex()] == ProducerState(_clock(c[1]), c[2].begin, _clock(seq_envs[4]))
    for start in (cp.resume_offset("j"), cp.journals["j"].read_through):  # both resume points work
        restored = Sequencer.restore(cp, ring_size=2, producer_horizon=None)
        assert run(restored, js, js.read("j", start)) == [c[2], c[3], seq_envs[5]]


def test_restore_rejects_malformed_producer_ids() -> None:
    cp = Checkpoint({"j": JournalCheckpoint(0, {"xyz": ProducerState(1)})})
    with pytest.raises(ValidationError, match="12-digit hex"):
        Sequencer.restore(cp)


def test_quiet_producers_are_pruned_after_the_horizon() -> None:
    js, seq = Journals(), Sequencer(producer_horizon=60.0)
    old = js.write("j", P1, CONTINUE_TXN, clock=START)  # pending, and a minute and more older than P2
    recent = js.write("j", P2, clock=START + 30 * SECOND)
    newest = js.write("j", P3, clock=START + 61 * SECOND)
    run(seq, js, [old, recent, newest])
    cp = seq.checkpoint()
    assert set(cp.journals["j"].producers) == {P2.hex(), P3.hex()}
    assert cp.resume_offset("j") == newest.end  # the abandoned transaction no longer pins the resume offset
    assert seq.statistics().producers == 2
    assert Sequencer(producer_horizon=None).prune() == 0


def test_sequencer_rejects_bad_parameters() -> None:
    with pytest.raises(ValueError, match="ring_size"):
        Sequencer(0)
    with pytest.raises(ValueError, match="producer_horizon"):
        Sequencer(producer_horizon=0)


def _clock(env: Envelope) -> int:
    fields = uuid_fields(env.uuid.int) if env.uuid is not None else None
    assert fields is not None
    return fields[1]


# --- Reference model and state machine --------------------------------------------------------------------------


class Model:
    """The obvious O(n) read-committed reader: the reference rules (tidings.message.sequencer.rules), per
    (journal, producer) the last ACK clock and a pending list, fed one envelope at a time."""

    def __init__(self) -> None:
        self.rules = rules.Rules()

    def queue(self, env: Envelope) -> list[Envelope]:
        return [m.ref for m in self.rules.apply(rules.message_of(env.journal, env.begin, env.uuid, env))]


JOURNALS = ("a", "b")
PRODUCERS = (P1, P2, P3)
KINDS = ("continue", "outside", "commit", "rollback", "partial", "resend", "none")


class SequencerMachine(RuleBasedStateMachine):
    """Writers append to 1-2 journals; a reader feeds the Sequencer, stepping, checkpointing and restoring at will."""

    @initialize(
        ring_size=st.sampled_from([1, 2, 3, 4, 64]),
        journals=st.sampled_from([1, 2]),
        kinds=st.sets(st.sampled_from(KINDS), min_size=2),
        producers=st.integers(1, len(PRODUCERS)),
        straggler=st.booleans(),
    )
    def setup(self, ring_size: int, journals: int, kinds: set[str], producers: int, straggler: bool) -> None:
        # Swarm testing: each run uses only some kinds of writes and producers, so that rarer interleavings (say,
        # rollbacks amid long-pending transactions) come up far more often than with every kind at once. A
        # straggler producer never acknowledges (until teardown): it pins the resume offset far back, so restores
        # re-read much that other producers committed or rolled back meanwhile.
        self.kinds = sorted(kinds | {"continue", "commit"})
        self.producers = PRODUCERS[:producers]
        self.straggler = PRODUCERS[0] if straggler else None
        self.js = Journals()
        self.journals = JOURNALS[:journals]
        for j in self.journals:
            self.js.envs[j] = []
        self.last_ack: dict[tuple[bytes, str], int] = {}  # what each writer last acknowledged
        self.pending: dict[tuple[bytes, str], list[int]] = {}  # clocks written since
        self.last_batch: dict[tuple[bytes, str], list[Envelope]] = {}
        self.seq = Sequencer(ring_size, producer_horizon=None)
        self.model = Model()
        self.read_at = dict.fromkeys(self.journals, 0)  # next index the Sequencer reads
        self.modeled = dict.fromkeys(self.journals, 0)  # next index the model reads
        self.expected: dict[str, list[Envelope]] = {j: [] for j in self.journals}
        self.delivered: dict[str, list[Envelope]] = {j: [] for j in self.journals}

    # Writers --------------------------------------------------------------------------------------------------

    @rule(data=st.data(), n=st.integers(1, 6))
    def write(self, data: st.DataObject, n: int) -> None:
        """Producers append: CONTINUE_TXN batches, OUTSIDE_TXN, ACKs that commit or roll back, retries."""
        op = st.tuples(
            st.sampled_from(self.kinds),
            st.sampled_from(self.producers),
            st.sampled_from(self.journals),
            st.integers(0, 3),
        )
        ops = data.draw(st.lists(op, min_size=n, max_size=n))
        for kind, p, j, k in ops:
            if p == self.straggler:
                kind = "continue"
            key = (p, j)
            pending = self.pending.setdefault(key, [])
            if kind == "continue":
                batch = [self.js.write(j, p, CONTINUE_TXN) for _ in range(k + 1)]
                pending.extend(_clock(e) for e in batch)
            elif kind == "outside":
                batch = [self.js.write(j, p, OUTSIDE_TXN)]
            elif kind == "commit":  # a fresh clock: commits everything pending
                batch = [self.js.write(j, p, ACK_TXN)]
            elif kind == "rollback" and (key in self.last_ack or pending):  # the last ACK's clock again
                batch = [self.js.write(j, p, ACK_TXN, clock=self.last_ack.get(key, min(pending, default=0) - 1))]
            elif kind == "partial" and len(pending) >= 2:  # inside the transaction: commits up to it only
                batch = [self.js.write(j, p, ACK_TXN, clock=pending[k % (len(pending) - 1)])]
                event("partial ACK written")
            elif kind == "resend":  # an at-least-once retry: the producer's last append lands again
                for env in self.last_batch.get(key, []):
                    self.js.resend(env)
                continue
            elif kind == "none":
                self.js.write(j, None)
                continue
            else:
                continue
            if kind != "continue":
                self.last_ack[key] = _clock(batch[0])
                pending.clear()
            self.last_batch[key] = batch

    # Reader ---------------------------------------------------------------------------------------------------

    @precondition(lambda self: not self.seq.dequeuing)
    @rule(j=st.sampled_from(JOURNALS), n=st.integers(1, 12) | st.just(10_000))
    def read_some(self, j: str, n: int) -> None:
        """Read up to n envelopes, draining all but the last one's commit (left for step_one / a restore)."""
        j = self._journal(j)
        for k in range(min(n, len(self.js.envs[j]) - self.read_at[j])):
            if k:
                self.drain()
            self.read_one(j)

    def read_one(self, j: str) -> None:
        log, i = self.js.envs[j], self.read_at[j]
        if i == len(log):
            return
        env = log[i]
        self.read_at[j] = i + 1
        if i == self.modeled[j]:
            self.expected[j].extend(self.model.queue(env))
            self.modeled[j] += 1
        replay = self.seq.queue(env)
        event(f"outcome {self.seq.last_outcome.name if self.seq.last_outcome else None}")
        if replay is not None:
            assert replay.journal == j and 0 <= replay.begin < replay.end <= env.begin
            self.seq.replay(self.js.read(j, replay.begin, replay.end))

    @precondition(lambda self: not self.seq.dequeuing)
    @rule(j=st.sampled_from(JOURNALS), n=st.integers(1, 30))
    def read_batch(self, j: str, n: int) -> None:
        """Read up to n envelopes at once through Sequencer.sequence (the readers' batch path)."""
        j = self._journal(j)
        log, i = self.js.envs[j], self.read_at[j]
        envs = log[i : i + n]
        for k, env in enumerate(envs, start=i):
            if k == self.modeled[j]:
                self.expected[j].extend(self.model.queue(env))
                self.modeled[j] += 1
        self.read_at[j] = i + len(envs)
        out: list[Envelope] = []
        at = 0
        while at < len(envs):
            at = self.seq.sequence(envs, at, out)
            replay = self.seq.pending_replay
            if replay is not None:
                event("replay inside a batch")
                self.seq.replay(self.js.read(j, replay.begin, replay.end))
                out.extend(self.seq.dequeue())
        for env in out:
            self.delivered[env.journal].append(env)

    @precondition(lambda self: self.seq.dequeuing)
    @rule()
    def step_one(self) -> None:
        env = self.seq.step()
        if env is not None:
            self.delivered[env.journal].append(env)

    @rule()
    def drain(self) -> None:
        for env in self.seq.dequeue():
            self.delivered[env.journal].append(env)

    @rule(ring_size=st.sampled_from([1, 2, 4, 64]), from_read_through=st.booleans(), crash=st.integers(0, 3))
    def checkpoint_and_restore(self, ring_size: int, from_read_through: bool, crash: int) -> None:
        """Crash and recover: a fresh Sequencer from the (JSON) checkpoint re-reads from its resume offset.

        Only one call in four crashes, so that reading gets well ahead between crashes (a crash rewinds it).
        """
        cp = self.seq.checkpoint()  # taking one must change nothing
        if crash:
            return
        where = "read-through" if from_read_through else "resume offset"
        event(f"restore {'mid-dequeue' if self.seq.dequeuing else 'idle'} from {where}")
        again = Checkpoint.from_json(cp.to_json())
        assert again == cp
        self.seq = Sequencer.restore(again, ring_size, producer_horizon=None)
        for j in self.journals:
            jc = again.journals.get(j)
            if jc is None:
                assert self.read_at[j] == 0
                continue
            start = jc.read_through if from_read_through else jc.resume_offset()
            self.read_at[j] = next((i for i, e in enumerate(self.js.envs[j]) if e.begin >= start), len(self.js.envs[j]))
            assert self.read_at[j] <= self.modeled[j]

    def _journal(self, j: str) -> str:
        return j if j in self.journals else self.journals[0]

    # Checks ---------------------------------------------------------------------------------------------------

    @invariant()
    def delivered_is_a_prefix_of_the_model(self) -> None:
        for j in self.journals:
            got, want = self.delivered[j], self.expected[j]
            assert got == want[: len(got)], f"journal {j}: delivered diverges from the model"
            if not self.seq.dequeuing and self.read_at == self.modeled:
                assert got == want, f"journal {j}: caught up, yet committed messages are missing"

    @invariant()
    def exactly_once_and_never_an_ack(self) -> None:
        for j in self.journals:
            seen = set()
            for env in self.delivered[j]:
                if env.uuid is None:
                    continue
                assert uuid_fields(env.uuid.int)[2] != ACK_TXN  # type: ignore[index]
                assert env.uuid not in seen, f"journal {j}: {env.message} delivered twice"
                seen.add(env.uuid)

    def teardown(self) -> None:
        """Every producer finally commits, and the reader reads to the end: all committed came out exactly once."""
        if not hasattr(self, "seq"):
            return
        for (p, j), pending in self.pending.items():
            if pending:
                self.js.write(j, p, ACK_TXN)
        self.drain()
        for j in self.journals:
            while self.read_at[j] < len(self.js.envs[j]):
                self.read_one(j)
                self.drain()
        for j in self.journals:
            assert self.delivered[j] == self.expected[j] == self.model_of_whole_journal(j)

    def model_of_whole_journal(self, j: str) -> list[Envelope]:
        model, out = Model(), []
        for env in self.js.envs[j]:
            out.extend(model.queue(env))
        return out


# Bounded for the suite (a few seconds); set TIDINGS_SEQUENCER_EXAMPLES=5000 for a deeper run.
SequencerMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("TIDINGS_SEQUENCER_EXAMPLES", "200")), stateful_step_count=50, deadline=None
)
TestSequencerAgainstModel = SequencerMachine.TestCase


def test_a_pending_transaction_restored_at_read_through_is_not_pruned_by_its_old_ack() -> None:
    """Helper-18's scenario: P's last ACK is 25 h older than its pending transaction. A checkpoint
    restored at the read-through offset (the Spark source's way) never re-reads P's pending message;
    the horizon must judge P by its newest clock (the pending one), not by its old ACK, or P is
    forgotten and its transaction's ACK commits nothing."""
    from tidings.message.uuid import clock_from_unix_ns

    hour = 3600 * 10**9

    def clock(h: float, k: int = 0) -> int:
        return clock_from_unix_ns(int(h * hour)) + k

    p, q = b"\x01" * 6, b"\x03" * 6
    envs = []
    for prod, clk, flags, name in [
        (p, clock(0), OUTSIDE_TXN, "p0"),
        (q, clock(0, 1), OUTSIDE_TXN, "q0"),
        (p, clock(25), CONTINUE_TXN, "p1"),
        (q, clock(25, 1), OUTSIDE_TXN, "q1"),
        (p, clock(25, 2), ACK_TXN, "p-ack"),
    ]:
        b = len(envs) * 10
        envs.append(Envelope("j", b, b + 10, build_uuid(prod, clk, flags), name))

    def deliver(seq: Sequencer, part: list[Envelope]) -> list[str]:
        out = []
        for e in part:
            replay = seq.queue(e)
            if replay is not None:
                seq.replay([x for x in envs if replay.begin <= x.begin < replay.end])
            out += [x.message for x in seq.dequeue()]
        return out

    delivered: list[str] = []
    checkpoint = None
    for a, b in [(0, 3), (3, 4), (4, 5)]:  # each batch restored at its read-through offset
        seq = Sequencer(checkpoint=checkpoint) if checkpoint else Sequencer()
        delivered += deliver(seq, envs[a:b])
        checkpoint = Checkpoint.from_json(seq.checkpoint().to_json())
    assert delivered == ["p0", "q0", "q1", "p1"]


def test_pending_generation_is_the_newest_read_that_began_or_extended_an_open_transaction() -> None:
    """A reader that reads ahead numbers its reads (`generation`); a consumer transaction that began
    after read G waits for an ACK only if an open transaction was begun or extended after G, not for
    one the previous transaction already gave up on (Gazette's ClearPending, for a read-ahead)."""
    js, seq = Journals(), Sequencer()
    assert seq.pending_generation() == -1
    seq.generation = 0
    run(seq, js, [js.write("a", P1, CONTINUE_TXN)])  # P1 begins in read 0
    seq.generation = 1
    run(seq, js, [js.write("a", P2, OUTSIDE_TXN)])  # nothing of P1 in read 1
    assert seq.pending_generation() == 0  # a transaction that began at read 1 does not wait for P1
    seq.generation = 2
    run(seq, js, [js.write("a", P1, CONTINUE_TXN), js.write("b", P2, CONTINUE_TXN)])
    assert seq.pending_generation() == 2
    seq.generation = 3
    run(seq, js, [js.write("a", P1, ACK_TXN), js.write("b", P2, ACK_TXN)])
    assert seq.pending_generation() == -1 and not seq.has_pending


def test_a_restored_journal_not_read_or_not_yet_past_its_checkpoint_slows_no_other_journal() -> None:
    """The batch path delivers OUTSIDE_TXN messages of known producers inline. A restored checkpoint
    naming a journal the reader no longer reads (a source dropped from a shard's spec), or an idle one
    whose read-through offset is not passed yet, keeps that journal on the slow path only: another
    journal's messages are still delivered inline."""
    js, seq = Journals(), Sequencer()
    run(seq, js, [js.write("a", P1), js.write("b", P1), js.write("gone", P2)])
    restored = Sequencer(checkpoint=Checkpoint.from_json(seq.checkpoint().to_json()))
    slow: list[Envelope] = []
    queue = restored._queue

    def counted(env: Envelope, fields: Any) -> Any:
        slow.append(env)
        return queue(env, fields)

    restored._queue = counted  # type: ignore[method-assign]
    batch = [js.write("a", P1) for _ in range(5)]
    out: list[Envelope] = []
    assert restored.sequence(batch, 0, out) == len(batch)
    assert out == batch
    # "a" passes its read-through offset on its first message (the slow path), then goes inline.
    assert slow == batch[:1]
