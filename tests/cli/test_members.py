"""`tidings members list`, `tidings status` and /metrics, against brokers run as child processes: each
broker's metrics address is where it says, client appends are counted apart from pulses, every RPC has a
series; a broker that joins receives journals; after a restart, primaries spread over the brokers again;
status names what is unhealthy."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections import Counter

from tests.cli._support import tidings
from tests.support.cluster import create_local_journal
from tests.support.waiting import wait_until_sync


def _members(ep: str) -> list[dict]:
    r = tidings("members", "list", "--json", broker=ep)
    assert r.returncode == 0, r
    return [json.loads(line) for line in r.stdout.splitlines()]


def _status(ep: str) -> dict:
    r = tidings("status", "--json", broker=ep)
    assert r.returncode == 0, r
    return json.loads(r.stdout)


def _scrape(url: str) -> dict[str, float]:
    """The samples of a /metrics page, by their full name with labels."""
    body = urllib.request.urlopen(url, timeout=10).read().decode()
    samples = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def test_members_list_status_and_metrics(local_cluster) -> None:
    ep = local_cluster.endpoints[0]
    for name, r in (("ops/a", 3), ("ops/b", 2), ("ops/c", 1)):
        asyncio.run(create_local_journal(local_cluster, name, r))

    def settled() -> list[dict] | None:
        rows = _members(ep)
        return rows if sum(m["journals"] for m in rows) == 6 and sum(m["primaries"] for m in rows) == 3 else None

    rows = wait_until_sync(settled, 30)
    assert [(m["zone"], m["id"]) for m in rows] == sorted((b.zone, b.suffix) for b in local_cluster.brokers)
    by_id = {b.suffix: b for b in local_cluster.brokers}
    for m in rows:
        assert m["endpoint"] == by_id[m["id"]].endpoint and not m["exiting"]
        assert m["metrics"] == f"http://{by_id[m['id']].metrics_endpoint}/metrics"
    table = tidings("members", "list", broker=ep).stdout.decode()
    assert all(m["metrics"] in table for m in rows)

    r = tidings("journals", "append", "ops/a", broker=ep, stdin=b"x" * 100)
    assert r.returncode == 0, r
    r = tidings("journals", "append", "ops/a", broker=ep, stdin=b"y" * 50)
    assert r.returncode == 0, r
    assert tidings("journals", "read", "ops/a", broker=ep).stdout == b"x" * 100 + b"y" * 50

    status = _status(ep)
    assert status["problems"] == [], status
    a = next(j for j in status["journals"] if j["name"] == "ops/a")
    assert (a["head"], a["size"], a["consistent"], len(a["replicas"])) == (150, 150, True, 3), a
    assert "healthy" in tidings("status", broker=ep).stdout.decode()

    pages = [_scrape(m["metrics"]) for m in rows]
    # The two appends, each after its zero-byte barrier (`journals append` learns where it lands), not the pulses.
    assert sum(p.get("tidings_commits_total", 0) for p in pages) == 4
    assert sum(p.get("tidings_appended_bytes_total", 0) for p in pages) == 150
    assert sum(p.get("tidings_pulses_total", 0) for p in pages) > 0
    assert sum(p.get("tidings_append_seconds_count", 0) for p in pages) == 4

    def gauges() -> bool:  # (set every 2 s by each broker)
        pages = [_scrape(m["metrics"]) for m in rows]
        held, led, pipelines = (sum(p.get(g, 0) for p in pages) for g in ("tidings_journals", "tidings_primaries",
                                                                         "tidings_pipelines"))  # fmt: skip
        return held == 6 and led == 3 and pipelines >= 2  # (ops/a and ops/b replicate)

    wait_until_sync(gauges, 30)
    everything = set().union(*pages)
    for rpc in ("append", "read", "list", "apply", "list_fragments", "list_members"):
        assert any(f'rpc="{rpc}"' in name for name in everything), f"no series for {rpc}"
    assert not any(name.endswith("_created") for name in everything)


def test_status_names_what_is_unhealthy(local_cluster) -> None:
    ep = local_cluster.endpoints[0]
    asyncio.run(create_local_journal(local_cluster, "ops/wide", 5))  # five replicas wanted, four brokers
    status = wait_until_sync(lambda: (s := _status(ep))["problems"] and s, 30)
    assert status["problems"] == ["journal ops/wide: under-replicated: 4 of 5 replicas"], status
    r = tidings("status", broker=ep)
    assert r.returncode == 0 and "1 problem:" in r.stdout.decode() and "under-replicated" in r.stdout.decode()


def test_a_broker_that_joins_receives_journals_and_primaries_spread_after_a_restart(local_cluster) -> None:
    ep = local_cluster.endpoints[0]
    for i in range(8):
        asyncio.run(create_local_journal(local_cluster, f"ops/j{i}", 1))
    joined = local_cluster.add_broker()

    def receives() -> bool:
        return any(m["id"] == joined.suffix and m["journals"] > 0 for m in _members(ep))

    wait_until_sync(receives, 60)

    # A rolling restart of one broker: its primaries move away, then spread back once it returns.
    def spread() -> bool:
        counts = [m["primaries"] for m in _members(ep)]
        return len(counts) == len(local_cluster.brokers) and max(counts) - min(counts) <= 1

    wait_until_sync(spread, 60)
    first = local_cluster.brokers[0]
    first.terminate()
    wait_until_sync(lambda: all(m["id"] != first.suffix for m in _members(local_cluster.endpoints[0])), 30)
    first.start()
    wait_until_sync(spread, 90)
    led = Counter({m["id"]: m["primaries"] for m in _members(ep)})
    assert led[first.suffix] >= 1, led
