"""Append flow control (broker/flow.py): a journal's appends take at most its rate, never fail for being
fast, and a journal under its limit (or unlimited) is never held back by another's.

The bucket's arithmetic on a clock the test moves (a burst of one second of rate, credit banked up to
BANK seconds, a changed limit starting afresh, an unlimited journal never charged, an append's wait
bounded by its budget with the debt kept, a cancelled wait's charge given back); then real brokers:
a limited journal's appends wait (its chunks counted as throttled, its content intact), its
neighbour's never do, and the wait is the broker's, not the client's: neither an append's own wait,
nor another's it queued behind, nor a primary's throttling seen through a proxying broker cuts a
client off for being slow."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import REGISTRY

from tests.support.waiting import wait_until
from tidings.broker.flow import BANK, AppendFlow, effective_rate
from tidings.client import AsyncClient


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(
    ("spec", "broker", "rate"),
    [(0, 0, 0), (1000, 0, 1000), (0, 500, 500), (1000, 500, 500), (300, 500, 300)],
)
def test_a_journals_rate_is_the_smaller_non_zero_limit(spec: int, broker: int, rate: int) -> None:
    assert effective_rate(spec, broker) == rate


def test_a_second_of_rate_goes_at_once_and_the_rest_waits_its_time() -> None:
    clock = Clock()
    flow = AppendFlow(clock)
    assert flow.charge(1000, 1000) == 0  # (the burst: one second of rate)
    assert flow.charge(500, 1000) == pytest.approx(0.5)
    clock.now += 0.5
    assert flow.charge(0, 1000) == 0  # (paid off)
    assert flow.charge(2500, 1000) == pytest.approx(2.5)  # (a chunk larger than the balance: waits, whole)


def test_a_quiet_journal_banks_at_most_bank_seconds_of_rate() -> None:
    clock = Clock()
    flow = AppendFlow(clock)
    flow.charge(0, 1000)
    clock.now += 1000  # (idle for long)
    assert flow.charge(int(BANK * 1000), 1000) == 0
    assert flow.charge(1000, 1000) == pytest.approx(1.0)


def test_a_changed_limit_starts_afresh_and_an_unlimited_journal_is_never_charged() -> None:
    clock = Clock()
    flow = AppendFlow(clock)
    assert flow.charge(10**9, 0) == 0
    flow.charge(5000, 1000)  # (deep in debt at 1,000 B/s)
    assert flow.charge(2000, 2000) == 0  # (a new limit: a second of it, the old debt forgotten)


async def test_an_appends_wait_is_bounded_and_its_debt_kept() -> None:
    clock = Clock()
    flow = AppendFlow(clock)
    assert await flow.take(1000, 1000) == 0
    assert await asyncio.wait_for(flow.take(10**6, 1000, budget=0.0), 5) == 0  # (no budget left: goes on)
    assert flow.charge(0, 1000) == pytest.approx(1000.0)  # (its debt stays with the journal)


async def test_a_cancelled_wait_gives_back_what_it_did_not_wait_for() -> None:
    clock = Clock()
    flow = AppendFlow(clock)
    flow.charge(1000, 1000)  # (the burst, spent)
    waiting = asyncio.ensure_future(flow.take(5000, 1000))
    await wait_until(lambda: flow.charge(0, 1000) > 0, 5)  # (it charged, and waits: cancelled mid-wait)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert flow.charge(0, 1000) == 0  # (the clock did not move: all of it came back)


async def test_a_route_change_ends_the_wait() -> None:
    flow = AppendFlow()
    invalidated = asyncio.Event()
    invalidated.set()
    waited = await asyncio.wait_for(flow.take(10**6, 1000, invalidated), 5)  # (1,000 s owed: ended at once)
    assert waited < 5


async def test_a_limited_journal_waits_and_its_neighbour_does_not(brokers) -> None:
    # A client must average 256 KiB/s after a second: the limited journal's 64 KiB/s would cut it off
    # if the broker counted its own wait against the client.
    tc = await brokers(metrics_journals=True, stall_timeout=1.0, min_append_rate=256 << 10)
    await tc.add_broker("zone-a")
    await tc.create_journal("quota/limited", 1, max_append_rate=64 << 10)
    await tc.create_journal("quota/free", 1)
    chunk = bytes(range(256)) * 256  # 64 KiB
    limited, free = chunk * 3, chunk * 16

    def throttled(journal: str) -> float:
        return REGISTRY.get_sample_value("tidings_journal_append_throttled_seconds_total", {"journal": journal}) or 0

    before = throttled("quota/limited"), throttled("quota/free")
    async with tc.client() as c:
        slow = asyncio.ensure_future(c.append("quota/limited", [chunk] * 3))  # (a stream: its chunks one by one)
        queued = asyncio.ensure_future(c.append("quota/limited", [chunk] * 2))  # (waits for the pipeline first)
        for _ in range(4):
            await c.append("quota/free", chunk * 4)
        a, q = await slow, await queued
        assert (a.end - a.begin, q.end - q.begin) == (len(limited), 2 * len(chunk))
        assert await c.write_head("quota/free") == len(free)
        got = b"".join([ch.content async for ch in c.reader("quota/limited", 0, block=False)])
        assert got == limited + chunk * 2 or got == chunk * 2 + limited
    assert throttled("quota/limited") > before[0]  # it waited for its rate
    assert throttled("quota/free") == before[1]  # its neighbour never did


async def test_an_append_through_another_broker_is_not_cut_off_for_the_primarys_throttling(brokers) -> None:
    tc = await brokers(stall_timeout=1.0, min_append_rate=256 << 10)
    for zone in ("zone-a", "zone-b"):
        await tc.add_broker(zone)
    await tc.create_journal("quota/limited", 1, max_append_rate=64 << 10)
    route = tc.route("quota/limited")
    proxy = next(b for b in tc.brokers if b.endpoint != route.endpoints[route.primary])
    chunk = bytes(range(256)) * 256
    async with AsyncClient(proxy.endpoint) as c:  # (a new client: its first append goes through `proxy`)
        result = await c.append("quota/limited", [chunk] * 4)  # (~3 s at the primary's rate)
    assert result.end - result.begin == 4 * len(chunk)
