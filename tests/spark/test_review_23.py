"""Review 23: the stream's torn-head guard and producerHorizon, on a real local Spark and real brokers."""

from __future__ import annotations

import json

import pytest

from tests.spark.test_review_22 import split_across_appends
from tests.spark.test_source import P1, P2, line, ndjson_journal
from tests.spark.test_stream import run_available_now
from tidings.client import Client
from tidings.message.uuid import ACK_TXN, CONTINUE_TXN

SHARE_CLUSTER = True  # one local cluster for the module's tests (conftest.local_cluster)

MINUTE = 60 * 10_000_000 << 4  # a minute of UUID clock: 100 ns ticks, 4 sequence bits


@pytest.mark.parametrize("horizon", ["1h", None])
def test_a_horizon_longer_than_a_sink_batch_keeps_its_early_tasks_rows(spark, local_cluster, tmp_path, horizon) -> None:
    """A sink task's producer has its transaction open from its first rows until the driver's commit
    writes its ACK; a micro-batch boundary in between must not forget it, or its ACK commits nothing
    (as in Gazette). Review 23 found stream.py advising 10m, shorter than a batch whose last task
    starts 11 minutes after its first (skew, a retry, a driver re-running a commit): the docs now say
    the horizon must exceed the longest batch. Here one that does (1h), and the 24 h default."""
    journal = f"spark/r23-horizon-{horizon}"
    early, late = 1, 1 + 11 * MINUTE
    ndjson_journal(
        local_cluster,
        journal,
        line(P1, early, CONTINUE_TXN, id=1) + line(P2, late, CONTINUE_TXN, id=2),  # two tasks' rows, uncommitted
    )
    cp = str(tmp_path / "cp")
    options = {"producerHorizon": horizon} if horizon else {}
    assert run_available_now(spark, local_cluster, journal, cp, **options) == []  # (nothing committed yet)
    with Client(local_cluster.endpoints[0]) as c:  # the driver's commit: both tasks' ACKs
        c.append(journal, line(P1, early, ACK_TXN) + line(P2, late, ACK_TXN))
    again = run_available_now(spark, local_cluster, journal, cp, **options)
    assert sorted(i for _, i in again) == [1, 2]


def test_a_raw_stream_waits_at_a_torn_head_of_an_ndjson_journal_with_a_charset(spark, local_cluster, tmp_path) -> None:
    """framing_for reads 'application/x-ndjson; charset=utf-8' as ndjson (parameters ignored), but
    the guard compared the label to NDJSON exactly: it was off and a line split by a raw append
    that ended mid-line becomes two rows. (Today it fails earlier: _read_raw and scan make the same
    exact comparison, so a raw read of such a journal dies in a TypeError traceback.)"""
    labels = {"content-type": "application/x-ndjson; charset=utf-8"}
    got = split_across_appends(
        spark, local_cluster, "spark/r23-charset", tmp_path, labels, format="raw", readCommitted="false"
    )
    values = [v for _, v in got]
    assert [json.loads(v)["id"] for v in values] == [1, 2, 3], values


def test_a_raw_stream_waits_at_a_torn_head_of_a_protobuf_journal(spark, local_cluster, tmp_path) -> None:
    """The guard covered ndjson journals only: a raw append that ended inside a fixed protobuf frame
    (a frame written by two appends) ends a micro-batch mid-frame; the first half is skipped as
    garbage, the second half (no magic at its start) too, and the payload is never delivered.
    Gazette's fixed-framing reader waits for the rest of the frame, as its ndjson one does."""
    import asyncio

    from tests.support.cluster import create_local_journal

    journal = "spark/r23-torn-frames"
    labels = {"content-type": "application/x-protobuf-fixed"}
    asyncio.run(create_local_journal(local_cluster, journal, 1, labels=labels))
    payloads = [bytes([i]) * (10 + i) for i in range(1, 4)]
    frames = b"".join(b"\x66\x33\x93\x36" + len(p).to_bytes(4, "little") + p for p in payloads)
    cut = len(frames) - 5  # inside the last frame's payload
    cp = str(tmp_path / "cp")
    opts = {"format": "raw", "readCommitted": "false"}
    with Client(local_cluster.endpoints[0]) as c:
        c.append(journal, frames[:cut])
    first = run_available_now(spark, local_cluster, journal, cp, raw=True, **opts)
    with Client(local_cluster.endpoints[0]) as c:
        c.append(journal, frames[cut:])
    again = run_available_now(spark, local_cluster, journal, cp, raw=True, **opts)
    assert [v for _, v in first + again] == payloads
