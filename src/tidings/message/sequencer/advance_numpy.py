"""`Sequencer.advance` over UUIDs given as a numpy array: per chunk a few array operations per
producer instead of a dozen Python operations per message (a Spark driver's scan of every byte).

The rules are the Sequencer's (see the package docstring), folded per producer: an ACK_TXN always
resets the state to its clock; an OUTSIDE_TXN (or unknown flags) resets it when its clock is above
the last ACK, so the last ACK then only grows (a running maximum since the last ACK_TXN); a
CONTINUE_TXN above the largest pending clock extends the pending span. So after a chunk, a
producer's state is set by its last reset (the last ACK_TXN, or after it the first OUTSIDE_TXN with
the largest clock, if above) and the CONTINUE_TXN messages after that reset. numpy is imported
only here, by callers that pass an array (the Spark extra installs it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tidings.message.uuid import ACK_TXN, CONTINUE_TXN, FLAGS_MASK

MANY_PRODUCERS = 32  # a chunk with more producers than 1 in this many messages goes message by message


def fold(
    journal: str,
    begins: Sequence[int],
    hilo: Any,
    partial_of: Callable[[int, int], Any],
) -> bool:
    """Apply a chunk's messages (UUIDs as rows (hi, lo) of uint64) to their producers' states, got from
    `partial_of(producer, clock - 1)` (made if new, with that last ACK). False, having changed nothing,
    when the chunk has too many producers for this to pay (the caller goes message by message)."""
    hi = hilo[:, 0]
    lo = hilo[:, 1]
    clock = (
        ((hi & 0xFFF) << 52) | (((hi >> 16) & 0xFFFF) << 36) | ((hi >> 32) << 4) | ((lo >> 58) & 0xF)
    )  # fmt: skip
    valid = (((hi >> 12) & 0xF) == 1) & ((lo >> 62) == 2) & (clock != 0)  # v1, RFC 4122, a clock
    at = np.flatnonzero(valid)
    if not at.size:
        return True
    producer = lo[at] & 0xFFFFFFFFFFFF
    producers, which = np.unique(producer, return_inverse=True)
    if producers.size > 1 and producers.size * MANY_PRODUCERS > at.size:
        return False
    flags = (lo[at] >> 48) & FLAGS_MASK
    clock = clock[at]
    for k, pid in enumerate(producers.tolist()):
        mine = np.flatnonzero(which == k) if producers.size > 1 else np.arange(at.size)
        _fold_one(partial_of(pid, int(clock[mine[0]]) - 1), begins, at[mine], flags[mine], clock[mine])
    return True


def _fold_one(p: Any, begins: Sequence[int], at: Any, flags: Any, clock: Any) -> None:
    """One producer's messages (positions `at` in the chunk, in order) applied to its state `p`."""
    is_ack = flags == ACK_TXN
    is_continue = flags == CONTINUE_TXN
    acks = np.flatnonzero(is_ack)
    last_ack = int(acks[-1]) if acks.size else -1
    reset, reset_clock = last_ack, (int(clock[last_ack]) if acks.size else p.min_clock)
    after = slice(last_ack + 1, None)
    outside = np.flatnonzero(~(is_ack | is_continue)[after]) + last_ack + 1
    if outside.size:
        top = int(clock[outside].max())
        if top > reset_clock:  # (the first OUTSIDE_TXN at the top clock; later equal ones are duplicates)
            reset, reset_clock = int(outside[np.argmax(clock[outside] == top)]), top
    if reset >= 0:
        p.min_clock = p.max_clock = reset_clock
        p.begin = -1
    rest = np.flatnonzero(is_continue[reset + 1 :]) + reset + 1
    if rest.size:
        above = np.flatnonzero(clock[rest] > max(p.max_clock, 0))  # (clocks are unsigned; valid ones > 0)
        if above.size:  # (the first above the largest pending clock begins the span, if none is pending)
            if p.begin == -1:
                p.begin = begins[int(at[rest[above[0]]])]
            p.max_clock = int(clock[rest].max())
