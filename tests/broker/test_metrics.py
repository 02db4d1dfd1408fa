"""Each broker serves Prometheus metrics over HTTP."""

from __future__ import annotations

import asyncio
import urllib.request

from tidings.cluster import free_port


async def test_metrics_count_appends_reads_and_statuses(cluster) -> None:
    port = free_port()
    b = await cluster.add_broker("zone-a", metrics_listen=f"127.0.0.1:{port}")
    await cluster.create_journal("it/metrics", 3)
    async with cluster.client(0) as c:
        await c.append("it/metrics", b"x" * 1000)
        assert await c.read_all("it/metrics") == b"x" * 1000
    body = await asyncio.to_thread(lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode())
    for name in (
        "tidings_appended_bytes_total",
        "tidings_commits_total",
        "tidings_rollbacks_total",
        "tidings_pipeline_resyncs_total",
        "tidings_read_bytes_total",
        'tidings_rpc_status_total{rpc="append",status="OK"}',
        "tidings_fragments_persisted_total",
    ):
        assert name in body, f"{name} missing from /metrics"
    await b.stop(graceful=False)
