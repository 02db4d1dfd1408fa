"""What the examples' applications check (tests/test_readme.py runs the examples themselves, as the
README shows them, against `tidings cluster up`): the stream-sum check is not vacuous (a chunk
published twice fails its shard, with a reason naming the stream), a WordCount shard whose spec
lacks a label it needs fails at its start naming the label, the recorded word count (stores in
recovery logs, hot standbys, a consumer per data dir) counts exactly through the loss of a consumer,
and a run never consumes an earlier run's journals (its prefix is new, or it refuses to start)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid
from pathlib import Path

from tests.support.waiting import wait_until
from tidings.client import AppendService
from tidings.consumer.client import ShardClient
from tidings.message import Publisher
from tidings.protocol import protocol_pb2 as pb

REPO = Path(__file__).resolve().parent.parent


async def test_a_wordcount_shard_lacking_a_label_fails_naming_it(cluster, consumers) -> None:
    """docs/shards.md's spec without `prefix`: the shard fails at its start naming the label, not on
    a journal "/counts" named from the missing one."""
    from examples.wordcount import WordCount

    from tidings.protocol.specs import shard_from_dict

    await cluster.create_journal("wc/words/part-0", 3)
    c = await consumers.add("zone-a", app=WordCount())
    spec = shard_from_dict({"id": "wc/count/0", "sources": ["wc/words/part-0"], "labels": {"stage": "count"}})
    async with ShardClient(c.endpoint) as sc:
        await sc.apply([pb.ShardApplyRequest.Change(upsert=spec)])
    await wait_until(lambda: consumers.statuses("wc/count/0") == {"zone-a/c0": pb.ReplicaStatus.FAILED}, 60)
    async with ShardClient(c.endpoint) as sc:
        (listed,) = (await sc.list()).shards
    reason = listed.status[0].errors[0]
    assert "WordCount needs the label 'prefix'" in reason and "lacks it" in reason, reason


async def test_a_chunk_seen_twice_fails_the_stream_sum_shard(cluster, consumers) -> None:
    """What the example's verifier relies on: a duplicate chunk (exactly-once broken) is not summed."""
    from examples.stream_sum import Summer, journal_specs, shard_specs

    for spec in journal_specs("ss", 1, 3):
        await cluster.create_journal(spec.name, 3)
    c = await consumers.add("zone-a", app=Summer())
    async with ShardClient(c.endpoint) as sc:
        await sc.apply([pb.ShardApplyRequest.Change(upsert=s) for s in shard_specs("ss", 1)])
    chunk = {"stream": "s1", "seq": 0, "numbers": [1, 2], "last": False}
    async with cluster.client() as client:
        publisher = Publisher(AppendService(client))
        # (two messages: the same one twice would carry one UUID, which read-committed delivers once)
        await (await publisher.publish_committed("ss/chunks/part-0", chunk, dict(chunk)))
        await publisher.service.aclose()
    await wait_until(lambda: consumers.statuses("ss/sum/0") == {"zone-a/c0": pb.ReplicaStatus.FAILED}, 60)
    async with ShardClient(c.endpoint) as sc:
        (listed,) = (await sc.list()).shards
    reason = listed.status[0].errors[0]
    assert "stream s1: chunk 0 at ss/chunks/part-0:" in reason and "expected 1: not exactly once" in reason, reason


async def test_the_recorded_wordcount_counts_exactly_through_a_killed_consumer(cluster, tmp_path) -> None:
    prefix = f"wcr-{uuid.uuid4().hex[:8]}"  # (the consumers' root in the session's etcd is named for it)
    cmd = [sys.executable, "-m", "examples.wordcount", "--etcd", cluster.etcd_endpoint,
           "--broker", cluster.brokers[0].endpoint, "--recorded", "--lines", "600", "--prefix", prefix]  # fmt: skip
    r = await asyncio.to_thread(subprocess.run, cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    assert "killed a consumer (kill -9)" in r.stdout and "counted exactly once" in r.stdout, r.stdout


async def test_a_run_refuses_a_prefix_whose_journals_exist(cluster) -> None:
    """Journals left by an earlier run (the same --prefix) would be consumed again and fail the verifier:
    the example refuses them in one line instead, and the default prefix differs from run to run."""
    from examples._consumers import arguments

    prefix = f"taken-{uuid.uuid4().hex[:8]}"
    await cluster.create_journal(f"{prefix}/chunks/part-1", 1)
    cmd = [sys.executable, "-m", "examples.stream_sum", "--etcd", cluster.etcd_endpoint,
           "--broker", cluster.brokers[0].endpoint, "--prefix", prefix]  # fmt: skip
    r = await asyncio.to_thread(subprocess.run, cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert f"journal {prefix}/chunks/part-1 exists already (an earlier run's): give a new --prefix" in r.stderr
    assert "producers published" not in r.stdout
    defaults = {arguments("", "sum").parse_args([]).prefix for _ in range(20)}
    assert len(defaults) == 20
