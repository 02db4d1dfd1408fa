"""The Sequencer's fast paths against its per-message path (queue() then step()): sequence(), the readers'
batch path, delivers the same envelopes, and advance(), the Spark driver's scan, reaches the same
checkpoint, so either reads committed exactly as the per-message path does (DESIGN.md invariant 7).

Differential property tests: random envelopes over two journals (interleaved in one batch), odd UUIDs
(nil, v4, v1 with clock 0, unknown flags), duplicates and clocks going backwards, optionally after a
restore; the paths must end with the same checkpoint (and, for sequence(), the same deliveries and
statistics). For advance() also what those do not draw: many producers, clocks across the whole 64 bits,
arbitrary restored producer states and chunk cuts anywhere.
"""

from __future__ import annotations

import uuid

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidings.message import ACK_TXN, CONTINUE_TXN, OUTSIDE_TXN, Checkpoint, Envelope, Sequencer, _advance, build_uuid
from tidings.message.sequencer import JournalCheckpoint, ProducerState

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
        mp.setattr(_advance, "MANY_PRODUCERS", 0)
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


TOP = (1 << 64) - 1
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
