"""Review 24: Sequencer.advance (the Spark driver's scan) against queue-then-step, on what the
batch-path property test does not draw: many producers (the MANY_PRODUCERS fallback and the fold
side by side), clocks across the whole 64 bits (above 2**63), arbitrary restored producer states
(pending `begin`s, `newest`), and chunk cuts anywhere."""

from __future__ import annotations

import msgspec
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.message.test_sequencer_batch_path import _one_by_one
from tidings.message import ACK_TXN, CONTINUE_TXN, OUTSIDE_TXN, Checkpoint, Envelope, Sequencer, build_uuid
from tidings.message.sequencer import JournalCheckpoint, ProducerState

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
