"""Append flow control (Gazette's append_flow_control.go): a journal's appends take at most its rate.

Each replica keeps a token bucket, used while it is the journal's primary: the rate is the smaller
non-zero of the spec's `max_append_rate` and the broker's `--max-append-rate` (0 and 0: unlimited;
unlike Gazette, the broker's flag caps journals whose spec says unlimited too). The bucket starts
with one second of rate and banks unused credit up to BANK seconds of it; it lives as long as the
replica, so a new Append RPC cannot burst by reconnecting.

A content chunk is charged before it goes to the peers and waits while the balance is below zero:
an append is slowed, never failed for being fast (an append waits MAX_WAIT at most; the debt of a
larger one stays with the journal; a rolled-back append gives back what it did not wait for). The
wait holds only that journal's pipeline (its later appends queue behind it, which is the quota) and
sleeps on the event loop: other journals' appends go on. When the append's route changes mid-wait
the wait ends and the rest of that append is not limited (appends are how a new route becomes
consistent: Gazette's rule). The time spent waiting, or queued before it, is the broker's, not the
client's: the stream's minimum-rate check starts at its first read and leaves waits out, and a
proxying broker does not police it (the primary does).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from tidings.broker import _metrics as metrics

if TYPE_CHECKING:
    from tidings.broker.host import Host
    from tidings.broker.replica import Replica

__all__ = ["BANK", "MAX_WAIT", "AppendFlow", "effective_rate", "throttle"]

BANK = 10.0  # seconds of rate a quiet journal may bank (Gazette's flowControlBankFactor)
# Seconds one append waits at most, all its chunks together: well inside a client's attempt timeout
# (30 s), so a throttled append is never given up and retried while it waits. A larger append goes
# on after that long and its debt stays with the journal: its next appends pay it.
MAX_WAIT = 15.0


def effective_rate(spec_rate: int, broker_rate: int) -> int:
    """Bytes/s a journal may take: the smaller non-zero of its spec's and the broker's (0: unlimited)."""
    rates = [r for r in (spec_rate, broker_rate) if r > 0]
    return min(rates) if rates else 0


class AppendFlow:
    """One journal's token bucket (see the module docstring)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._rate = 0
        self._balance = 0.0
        self._at = clock()

    def _refill(self, rate: int) -> None:
        now = self._clock()
        if rate != self._rate:  # (a new limit: start afresh with a second of it, as a new bucket would)
            self._rate, self._balance = rate, float(rate)
        else:
            self._balance = min(self._balance + (now - self._at) * rate, BANK * rate)
        self._at = now

    def charge(self, n: int, rate: int) -> float:
        """Debit `n` bytes at `rate`; the seconds to wait before they may go (0: at once)."""
        if rate <= 0:
            self._rate = 0
            return 0.0
        self._refill(rate)
        self._balance -= n
        return max(0.0, -self._balance / rate)

    async def take(
        self, n: int, rate: int, invalidated: asyncio.Event | None = None, budget: float = MAX_WAIT
    ) -> float:
        """Charge `n` bytes and wait until the balance covers them (at most `budget` seconds), or until
        `invalidated` is set (the route changed). Returns the seconds waited. Cancelled meanwhile (the
        append rolled back), the part of the charge not yet waited for is given back."""
        wait = min(self.charge(n, rate), max(0.0, budget))
        if wait <= 0:
            return 0.0
        started = self._clock()
        try:
            if invalidated is None:
                await asyncio.sleep(wait)
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(invalidated.wait(), wait)
        except asyncio.CancelledError:
            self._balance += max(0.0, wait - (self._clock() - started)) * rate
            raise
        return self._clock() - started


async def throttle(broker: Host, replica: Replica, n: int, invalidated: asyncio.Event, waited_before: float) -> float:
    """Charge an append's chunk of `n` bytes to `replica`'s journal and wait while it is over its
    rate (until `invalidated`: the route changed; at most what is left of the append's MAX_WAIT after
    `waited_before`); the seconds waited, counted in the metrics."""
    cfg = broker.config
    rate = effective_rate(replica.spec.max_append_rate, cfg.max_append_rate)
    waited = await replica.flow.take(n, rate, invalidated, MAX_WAIT - waited_before)
    if waited > 0:
        metrics.THROTTLED_SECONDS.inc(waited)
        metrics.THROTTLED_CHUNKS.inc()
        if cfg.metrics_journals:
            metrics.JOURNAL_THROTTLED_SECONDS.labels(replica.journal).inc(waited)
    return waited
