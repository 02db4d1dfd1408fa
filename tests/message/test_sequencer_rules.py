"""Every path of the Sequencer against the reference rules (tidings.message.sequencer.rules), and its
fast paths against its per-message path (DESIGN.md invariant 7).

The rules exist once as a reference and four times for speed: the ring path (queue, replay, step, as
feed drives them), the batch path (sequence), and advance's scalar and numpy folds. The first property
test draws journals as writers fill them -- producers interleaved over two journals, transactions
committed, partly committed and rolled back, ACKs below the last one, at-least-once resends, unknown
flags, messages without (v1) UUIDs, clocks up to 2**64 - 1 -- and runs every path over them: tiny
rings (replays from the same journals), chunk boundaries anywhere, a crash and restore (also between
two steps of a commit) from either the resume offset or the read-through offset. Each path must
deliver what the reference delivers, in its order (per journal after a restore), and end with the
producer states it ends with.

The differential tests after it compare the fast paths with the per-message path on what the
reference does not model: queue outcome counters, the producer horizon, arbitrary restored states.
"""

from __future__ import annotations

import itertools
import os
import uuid

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidings.message import ACK_TXN, CONTINUE_TXN, OUTSIDE_TXN, Checkpoint, Envelope, Sequencer, build_uuid
from tidings.message.sequencer import JournalCheckpoint, ProducerState, advance_numpy, rules

# --- Every path against the reference ----------------------------------------------------------------------------

TOP = (1 << 64) - 1
JOURNALS = ("a", "b")
PIDS = [bytes([1, 0, 0, 0, 0, p + 1]) for p in range(3)]


@st.composite
def journals(draw) -> list[Envelope]:
    """Envelopes in read order over JOURNALS, as producers with their own clocks append them."""
    base = draw(st.sampled_from([0, 1 << 40, (1 << 63) - 100, TOP - 250]))
    written: list[tuple[str, str, int, int, int]] = []  # (journal, kind of UUID, producer, clock, flags)
    top: dict[int, int] = {}  # each producer's largest clock so far
    acked: dict[tuple[str, int], int] = {}  # the clock of each producer's last ACK_TXN in a journal
    for _ in range(draw(st.integers(0, 50))):
        how = draw(st.sampled_from(["next"] * 6 + ["same", "below", "rollback", "resend"]))
        if how == "resend" and written:  # at-least-once: an earlier append lands again
            written.append(draw(st.sampled_from(written)))
            continue
        journal = draw(st.sampled_from(JOURNALS))
        kind = draw(st.sampled_from(["v1"] * 12 + ["none", "nil", "v4", "zero"]))
        producer = draw(st.integers(0, len(PIDS) - 1))
        flags = draw(st.sampled_from([CONTINUE_TXN] * 4 + [ACK_TXN] * 2 + [OUTSIDE_TXN] * 2 + [0x5]))
        last = top.get(producer, 0)
        if how == "rollback" and (journal, producer) in acked:  # an ACK at the last ACK's clock
            clock, flags = acked[(journal, producer)], ACK_TXN
        elif how == "same" and last:  # the largest clock again: a duplicate, or an ACK of all pending
            clock = last
        elif how == "below" and last:  # duplicates, partial ACKs, ACKs below the last one
            clock = draw(st.integers(1, last))
        else:
            clock = top[producer] = last + draw(st.integers(1, 3))
        if flags == ACK_TXN:
            acked[(journal, producer)] = clock
        written.append((journal, kind, producer, base + clock, flags))
    envs: list[Envelope] = []
    end = dict.fromkeys(JOURNALS, 0)
    for n, (journal, kind, producer, clock, flags) in enumerate(written):
        u: uuid.UUID | None = None
        if kind == "v1":
            u = build_uuid(PIDS[producer], clock, flags)
        elif kind == "zero":
            u = build_uuid(PIDS[producer], 0, flags)
        elif kind == "v4":
            u = uuid.UUID(int=(clock * 0x9E3779B97F4A7C15 + producer) % (1 << 128), version=4)
        elif kind == "nil":
            u = uuid.UUID(int=0)
        envs.append(Envelope(journal, end[journal], end[journal] + 2 + n % 4, u, n))
        end[journal] = envs[-1].end
    return envs


def _reference(envs: list[Envelope]) -> tuple[list[Envelope], dict[tuple[str, int], rules.State]]:
    delivered, states = rules.sequence(rules.message_of(e.journal, e.begin, e.uuid, e) for e in envs)
    return [m.ref for m in delivered], states


def _states(cp: Checkpoint) -> dict[tuple[str, int], rules.State]:
    """A checkpoint's producer states as the reference gives them (newest: -1 in a checkpoint when last_ack)."""
    return {
        (journal, int(hex_id, 16)): rules.State(s.last_ack, s.begin, s.last_ack if s.newest == -1 else s.newest)
        for journal, jc in cp.journals.items()
        for hex_id, s in jc.producers.items()
    }


def _chunks(envs: list[Envelope], cuts: list[int]) -> list[list[Envelope]]:
    cuts = sorted(min(c, len(envs)) for c in cuts)
    return [envs[lo:hi] for lo, hi in zip([0, *cuts], [*cuts, len(envs)], strict=True)]


def _reread(logs: dict[str, list[Envelope]]):
    return lambda r: [e for e in logs[r.journal] if r.begin <= e.begin < r.end]


def _run_ring(seq: Sequencer, envs: list[Envelope], logs: dict[str, list[Envelope]], steps: int | None = None) -> list:
    """feed() every envelope and drain what it commits (after the last, only `steps` of them, if given)."""
    out: list[Envelope] = []
    reread = _reread(logs)
    for i, env in enumerate(envs):
        committed = seq.feed(env, reread)
        out.extend(committed if steps is None or i < len(envs) - 1 else itertools.islice(committed, steps))
    return out


def _run_batch(seq: Sequencer, envs: list[Envelope], logs: dict[str, list[Envelope]], cuts: list[int]) -> list:
    """sequence() over `envs` in chunks, satisfying replays from `logs`."""
    out: list[Envelope] = []
    reread = _reread(logs)
    for part in _chunks(envs, cuts):
        at = 0
        while at < len(part):
            at = seq.sequence(part, at, out)
            if seq.pending_replay is not None:
                seq.replay(reread(seq.pending_replay))
                out.extend(seq.dequeue())
    return out


def _run_advance(seq: Sequencer, envs: list[Envelope], cuts: list[int], packed: bool) -> list:
    """advance() over each journal's envelopes in chunks, UUIDs as ints (None: none) or packed in an array."""
    for journal in JOURNALS:
        for part in _chunks([e for e in envs if e.journal == journal], cuts):
            ints = [None if e.uuid is None else e.uuid.int for e in part]
            uuids = np.array([(x >> 64, x & TOP) for x in (i or 0 for i in ints)], dtype=np.uint64).reshape(-1, 2)
            seq.advance(journal, [e.begin for e in part], [e.end for e in part], uuids if packed else ints)
    return []  # (advance delivers nothing)


@settings(max_examples=int(os.environ.get("TIDINGS_SEQUENCER_EXAMPLES", "600")), deadline=None)
@given(
    envs=journals(),
    ring=st.sampled_from([1, 2, 3, 64]),
    cuts=st.lists(st.integers(0, 50), max_size=4),
    crash=st.none() | st.tuples(st.integers(0, 50), st.booleans(), st.none() | st.integers(0, 3)),
    many=st.sampled_from([0, advance_numpy.MANY_PRODUCERS]),
)
def test_every_path_delivers_and_checkpoints_what_the_rules_say(envs, ring, cuts, crash, many) -> None:
    """The ring, batch, scalar-fold and numpy-fold paths against the reference (see the module docstring).
    `crash`: after how many envelopes, whether to re-read from the read-through offset (else from the
    resume offset), and for the ring path how many committed messages of the last one it steps first."""
    logs = {j: [e for e in envs if e.journal == j] for j in JOURNALS}
    want, want_states = _reference(envs)
    paths = {
        "ring": lambda seq, part, last: _run_ring(seq, part, logs, None if crash is None or not last else crash[2]),
        "batch": lambda seq, part, last: _run_batch(seq, part, logs, cuts),
        "scalar fold": lambda seq, part, last: _run_advance(seq, part, cuts, packed=False),
        "numpy fold": lambda seq, part, last: _run_advance(seq, part, cuts, packed=True),
    }
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(advance_numpy, "MANY_PRODUCERS", many)  # (0: the fold, however many producers a chunk has)
        for name, run in paths.items():
            seq = Sequencer(ring, producer_horizon=None)
            before = 0  # (delivered before a crash: not counted by the restored Sequencer)
            if crash is None:
                got = run(seq, envs, False)
            else:
                cut, from_read_through, _ = crash
                got = run(seq, envs[:cut], True)
                cp = Checkpoint.from_json(seq.checkpoint().to_json())
                seq = Sequencer(max(1, ring - 1), producer_horizon=None, checkpoint=cp)
                again = []
                for journal in JOURNALS:
                    jc = cp.journals.get(journal)
                    start = jc.read_through if from_read_through and jc is not None else cp.resume_offset(journal)
                    again += [e for e in logs[journal] if start <= e.begin and e.message < cut]
                before = len(got)
                got += run(seq, again + envs[cut:], False)
            cp = seq.checkpoint()
            states = _states(cp)
            assert not seq.dequeuing and seq.pending_replay is None, name
            for journal, log in logs.items():
                assert not log or cp.journals[journal].read_through == log[-1].end, (name, journal)
            if crash is None:
                assert states == want_states, name
            else:  # (a restored `newest` also remembers what the checkpoint knew: only for the horizon)
                assert {k: s[:2] for k, s in states.items()} == {k: s[:2] for k, s in want_states.items()}, name
            if name in ("ring", "batch"):
                assert seq.statistics().delivered == len(got) - before, name
                if crash is None:
                    assert [e.message for e in got] == [e.message for e in want], name
                else:  # (after a restore the re-read envelopes come journal by journal)
                    for journal in JOURNALS:
                        mine = [e.message for e in got if e.journal == journal]
                        assert mine == [e.message for e in want if e.journal == journal], (name, journal)


# --- The fast paths against the per-message path ---------------------------------------------------------------

PRODUCERS = [b"\x01\x00\x00\x00\x00\x01", b"\x01\x00\x00\x00\x00\x02"]
BASE = 0x01EE_0000_0000_0000


def _uuid(kind: str, producer: int, clock: int, flags: int) -> uuid.UUID | None:
    if kind == "none":
        return None
    if kind == "nil":
        return uuid.UUID(int=0)
    if kind == "v4":
        return uuid.UUID(int=(clock * 0x9E3779B97F4A7C15 + producer) % (1 << 128), version=4)
    if kind == "zero":
        return build_uuid(PRODUCERS[producer], 0, flags)
    return build_uuid(PRODUCERS[producer], BASE + clock, flags)


messages = st.lists(
    st.tuples(
        st.sampled_from(["a", "b"]),
        st.sampled_from(["v1"] * 8 + ["none", "nil", "v4", "zero"]),
        st.integers(0, 1),
        st.integers(1, 12),
        st.sampled_from([OUTSIDE_TXN] * 4 + [CONTINUE_TXN] * 2 + [ACK_TXN, 0x5]),
    ),
    max_size=40,
)


def _envelopes(spec: list[tuple[str, str, int, int, int]]) -> tuple[list[Envelope], dict[str, list[Envelope]]]:
    logs: dict[str, list[Envelope]] = {"a": [], "b": []}
    envs = []
    for n, (journal, kind, producer, clock, flags) in enumerate(spec):
        log = logs[journal]
        begin = log[-1].end if log else 0
        env = Envelope(journal, begin, begin + 3 + n % 5, _uuid(kind, producer, clock, flags), f"m{n}")
        log.append(env)
        envs.append(env)
    return envs, logs


def _read(logs: dict[str, list[Envelope]], journal: str, begin: int, end: int) -> list[Envelope]:
    return [e for e in logs[journal] if begin <= e.begin < end]


def _one_by_one(seq: Sequencer, envs: list[Envelope], logs: dict[str, list[Envelope]]) -> list[Envelope]:
    out = []
    for env in envs:
        replay = seq.queue(env)
        if replay is not None:
            seq.replay(_read(logs, replay.journal, replay.begin, replay.end))
        out.extend(seq.dequeue())
    return out


def _batched(seq: Sequencer, envs: list[Envelope], logs: dict[str, list[Envelope]], cuts: list[int]) -> list:
    out: list[Envelope] = []
    for lo, hi in zip([0, *cuts], [*cuts, len(envs)], strict=True):
        part = envs[lo:hi]
        at = 0
        while at < len(part):
            at = seq.sequence(part, at, out)
            replay = seq.pending_replay
            if replay is not None:
                seq.replay(_read(logs, replay.journal, replay.begin, replay.end))
                out.extend(seq.dequeue())
    return out


def _checkpoint_after(envs: list[Envelope], logs: dict[str, list[Envelope]], ring: int) -> Checkpoint:
    """A checkpoint after reading `envs` committed, as a restart would load it."""
    warm = Sequencer(ring, producer_horizon=None)
    _one_by_one(warm, envs, logs)
    return Checkpoint.from_json(warm.checkpoint().to_json())


@settings(max_examples=1500, deadline=None)
@given(
    prefix=messages,
    spec=messages,
    ring=st.sampled_from([1, 2, 64]),
    restore=st.booleans(),
    cuts=st.lists(st.integers(0, 40), max_size=4),
)
def test_sequence_equals_queue_then_step(prefix, spec, ring, restore, cuts) -> None:
    envs, logs = _envelopes(prefix + spec)
    first, rest = envs[: len(prefix)], envs[len(prefix) :]
    cp = _checkpoint_after(first, logs, ring) if restore else None

    def make() -> Sequencer:
        return Sequencer(ring, producer_horizon=None, checkpoint=cp)

    a, b = make(), make()
    if not restore:
        rest = envs
    cuts = sorted(min(c, len(rest)) for c in cuts)
    want = _one_by_one(a, rest, logs)
    got = _batched(b, rest, logs, cuts)
    assert [e.message for e in got] == [e.message for e in want]
    assert b.checkpoint().to_json() == a.checkpoint().to_json()
    sa, sb = a.statistics(), b.statistics()
    assert sb.delivered == sa.delivered
    assert dict(sb.outcomes) == dict(sa.outcomes)


@settings(max_examples=1500, deadline=None)
@given(
    prefix=messages,
    spec=messages,
    ring=st.sampled_from([1, 2, 64]),
    restore=st.booleans(),
    reread=st.integers(0, 6),
    cuts=st.lists(st.integers(0, 40), max_size=4),
    horizon=st.sampled_from([None, 1e-6, 3e-6]),
    packed=st.booleans(),
)
def test_advance_ends_at_the_checkpoint_queue_then_step_reach(
    prefix, spec, ring, restore, reread, cuts, horizon, packed
) -> None:
    """What a Spark driver's scan relies on: advance() over each journal's messages (in runs, journal
    by journal) leaves the checkpoint reading them committed would, whatever the UUIDs, duplicates,
    rollbacks, ring size, restored state (and messages re-read before its read-through) and horizon;
    with the UUIDs as ints (message by message) or packed in a numpy array (folded per producer,
    however few messages each has: MANY_PRODUCERS is 0 here)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(advance_numpy, "MANY_PRODUCERS", 0)
        _advance_case(prefix, spec, ring, restore, reread, cuts, horizon, packed)


def _advance_case(prefix, spec, ring, restore, reread, cuts, horizon, packed) -> None:
    envs, logs = _envelopes(prefix + spec)
    cp = _checkpoint_after(envs[: len(prefix)], logs, ring) if restore else None
    rest = envs[max(0, len(prefix) - reread) :] if restore else envs  # (some before the read-through, re-read)
    want = Sequencer(ring, producer_horizon=horizon, checkpoint=cp)
    _one_by_one(want, rest, logs)
    got = Sequencer(ring, producer_horizon=horizon, checkpoint=cp)
    for journal in ("a", "b"):
        mine = [e for e in rest if e.journal == journal]
        cuts = sorted(min(c, len(mine)) for c in cuts)
        for lo, hi in zip([0, *cuts], [*cuts, len(mine)], strict=True):
            part = mine[lo:hi]
            ints = [0 if e.uuid is None else e.uuid.int for e in part]
            uuids = np.array([(x >> 64, x & (1 << 64) - 1) for x in ints], dtype=np.uint64).reshape(-1, 2)
            got.advance(journal, [e.begin for e in part], [e.end for e in part], uuids if packed else ints)
    assert msgspec.to_builtins(got.checkpoint()) == msgspec.to_builtins(want.checkpoint())  # (any journal order)


clock_bases = st.sampled_from([1, 1 << 40, (1 << 63) - 8, 1 << 63, TOP - 40])


@st.composite
def cases(draw):
    base = draw(clock_bases)
    nprod = draw(st.sampled_from([1, 2, 3, 40]))
    n = draw(st.integers(0, 120))
    msgs = []
    for _ in range(n):
        p = draw(st.integers(0, nprod - 1))
        kind = draw(st.sampled_from(["v1"] * 10 + ["none"]))
        clock = min(TOP, base + draw(st.integers(0, 30)))
        flags = draw(st.sampled_from([OUTSIDE_TXN] * 3 + [CONTINUE_TXN] * 3 + [ACK_TXN] * 2 + [0x7]))
        msgs.append((p, kind, clock, flags))
    restored = {}
    for p in draw(st.lists(st.integers(0, nprod - 1), max_size=4, unique=True)):
        last_ack = min(TOP, base + draw(st.integers(0, 30)))
        begin = draw(st.sampled_from([-1, 0, 5]))
        restored[p] = (last_ack, begin, draw(st.sampled_from([-1, min(TOP, last_ack + 3)])))
    cuts = sorted(draw(st.lists(st.integers(0, n), max_size=4)))
    return msgs, restored, cuts


def _pid(p: int) -> bytes:
    return bytes([1, 0, 0, 0, 0, p + 1])


@settings(max_examples=400, deadline=None)
@given(case=cases(), horizon=st.sampled_from([None, 1e-6]))
def test_advance_checkpoint_equals_read_committed(case, horizon) -> None:
    """advance() against queue-then-step on what the property test above does not draw: many producers
    (the MANY_PRODUCERS fallback and the fold side by side), clocks across the whole 64 bits (above
    2**63), arbitrary restored producer states (pending `begin`s, `newest`), and chunk cuts anywhere."""
    msgs, restored, cuts = case
    read_through = 10
    envs, at = [], read_through
    for n, (p, kind, clock, flags) in enumerate(msgs):
        u = None if kind == "none" else build_uuid(_pid(p), clock, flags)
        envs.append(Envelope("j", at, at + 2 + n % 3, u, n))
        at = envs[-1].end
    cp = None
    if restored:
        producers = {_pid(p).hex(): ProducerState(la, -1 if b < 0 else b, nw) for p, (la, b, nw) in restored.items()}
        cp = Checkpoint({"j": JournalCheckpoint(read_through, producers)})
    logs = {"j": envs}
    want = Sequencer(64, producer_horizon=horizon, checkpoint=cp)
    _one_by_one(want, envs, logs)
    for packed in (False, True):
        got = Sequencer(64, producer_horizon=horizon, checkpoint=cp)
        for lo, hi in zip([0, *cuts], [*cuts, len(envs)], strict=True):
            part = envs[lo:hi]
            if not part:
                continue
            ints = [0 if e.uuid is None else e.uuid.int for e in part]
            arr = np.array([(x >> 64, x & TOP) for x in ints], dtype=np.uint64).reshape(-1, 2)
            got.advance("j", [e.begin for e in part], [e.end for e in part], arr if packed else ints)
        assert msgspec.to_builtins(got.checkpoint()) == msgspec.to_builtins(want.checkpoint()), packed
