"""The tidings sink on a real local Spark against real brokers: rows become committed messages that a
read committed yields once, a batch committed twice (Spark re-running it after a crash) acknowledged
once and rows of attempts that never commit never (DESIGN.md invariant 7); misuse fails in one line."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

from pyspark.sql import Row

from tests.spark._support import NDJSON, P1, cli_committed, error_message, line
from tests.support.cluster import create_local_journal
from tidings.client import Client
from tidings.message.uuid import OUTSIDE_TXN
from tidings.spark.sink import SinkOptions, TidingsStreamWriter, publish_rows

SHARE_CLUSTER = True  # one local cluster for the module's tests (conftest.local_cluster)

ROOT = Path(__file__).resolve().parents[2]


def test_batch_write_publishes_each_row_as_a_committed_message(spark, local_cluster) -> None:
    for j in ("spark/out-a", "spark/out-b"):
        asyncio.run(create_local_journal(local_cluster, j, 3, **NDJSON))
    ep = local_cluster.endpoints[0]
    df = spark.createDataFrame([(i, f"n{i}", "spark/out-a" if i % 3 else "spark/out-b") for i in range(1000)],
                               "id BIGINT, name STRING, journal STRING").repartition(3)  # fmt: skip
    df.write.format("tidings").option("broker", ep).mode("append").save()
    a, b = cli_committed(ep, "spark/out-a"), cli_committed(ep, "spark/out-b")
    assert sorted(m["id"] for m in a + b) == list(range(1000))
    assert all(m["id"] % 3 for m in a) and not any(m["id"] % 3 for m in b)
    assert set(a[0]) == {"id", "name", "uuid"}  # the routing column is not part of the message


def test_sink_unknown_journal_or_broker_fails_with_one_line_naming_it(spark, local_cluster) -> None:
    """An unknown journal or an unreachable broker fails the write in one line naming the option, as
    the source does on the driver: not in every task, deep in the Publisher (a 30-line traceback of
    client internals, hints for the CLI's --broker flag), after a retry cycle per task."""
    asyncio.run(create_local_journal(local_cluster, "spark/sink-out", 1, **NDJSON))
    df = spark.createDataFrame([(1, "a")], "id BIGINT, name STRING")

    def write(**opts: str) -> None:
        w = df.write.format("tidings").mode("append").option("broker", local_cluster.endpoints[0])
        for k, v in opts.items():
            w = w.option(k, v)
        w.save()

    for opts, names in (
        ({"journal": "spark/sink-nope"}, "spark/sink-nope"),
        ({"journal": "spark/sink-out", "broker": "127.0.0.1:9"}, "127.0.0.1:9"),
    ):
        msg = error_message(lambda opts=opts: write(**opts))
        assert names in msg
        assert msg.count('File "') <= 1, f"a traceback reaches the user:\n{msg[:1500]}"
        assert "option '" in msg, f"the error does not name the option to fix:\n{msg[:1500]}"


def test_overwrite_mode_is_refused_not_silently_appended(spark, local_cluster) -> None:
    """`mode("overwrite")` cannot truncate a journal: it is refused, as Kafka's sink refuses it, not
    taken for an append."""
    asyncio.run(create_local_journal(local_cluster, "spark/sink-ow", 1, **NDJSON))
    df = spark.createDataFrame([(1,)], "id BIGINT")
    w = df.write.format("tidings").option("broker", local_cluster.endpoints[0]).option("journal", "spark/sink-ow")
    msg = error_message(lambda: w.mode("overwrite").save())
    assert "overwrite" in msg.lower()


def test_a_batch_committed_again_acknowledges_the_first_commits_rows_only(local_cluster, tmp_path) -> None:
    """What Spark does after a crash between our commit and its commit log: the batch's tasks run
    again (new producers, the same rows published again) and commit(batchId) is called again."""
    journal = "spark/replayed"
    asyncio.run(create_local_journal(local_cluster, journal, 3, **NDJSON))
    ep = local_cluster.endpoints[0]
    opts = SinkOptions(ep, journal, str(tmp_path / "cp"))
    writer = TidingsStreamWriter(opts)
    rows = [Row(id=i) for i in range(50)]
    first = [publish_rows(opts, iter(rows[:25])), publish_rows(opts, iter(rows[25:]))]
    lost = publish_rows(opts, iter(rows[:10]))  # an attempt that failed: never in a commit
    writer.commit([*first, None], 7)
    again = [publish_rows(opts, iter(rows[:25])), publish_rows(opts, iter(rows[25:]))]
    writer.commit(again, 7)  # the re-run: its attempts' rows must not be acknowledged
    writer.commit(again, 7)  # (and again)
    assert sorted(m["id"] for m in cli_committed(ep, journal)) == list(range(50))
    assert lost.intents and again[0].intents != first[0].intents
    with Client(ep) as c:  # every attempt's rows are in the journal, uncommitted
        assert c.read_all(journal).count(b'"id":3,') == 3  # the first, the lost and the re-run attempt


def test_the_source_and_sink_on_separate_executor_processes(local_cluster, tmp_path) -> None:
    """Spark's local-cluster master: executors are JVMs of their own (as on a real cluster), with the
    package imported by their Python workers; a journal is read through the source and written
    through the sink there. The job runs in its own process group, stopped by PID however it ends."""
    ep = local_cluster.endpoints[0]
    for j in ("spark/lc-in", "spark/lc-out"):
        asyncio.run(create_local_journal(local_cluster, j, 3, **NDJSON))
    with Client(ep) as c:
        c.append("spark/lc-in", b"".join(line(P1, n, OUTSIDE_TXN, id=n) for n in range(1, 201)))
    cmd = [sys.executable, "-m", "tests.support.spark_cluster_job", "--broker", ep,
           "--source", "spark/lc-in", "--sink", "spark/lc-out"]  # fmt: skip
    job = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = job.communicate(timeout=300)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)  # (the driver, its JVM and the executors' JVMs)
        job.wait()
    assert job.returncode == 0, err.decode()[-3000:]
    report = json.loads(out.splitlines()[-1])
    assert report["rows"] == 200 and len(report["executor_pids"]) == 2
    assert sorted(m["id"] for m in cli_committed(ep, "spark/lc-out")) == list(range(1, 201))


def test_timestamps_are_written_as_the_instant_spark_meant(monkeypatch) -> None:
    """PySpark gives a worker TIMESTAMP values as naive local times; the sink writes them as UTC
    instants (the source reads naive times as UTC), so a round trip keeps the instant."""
    import datetime
    import time

    from tidings.spark.sink import _message

    monkeypatch.setenv("TZ", "Etc/GMT+5")  # (five hours west of UTC)
    time.tzset()
    try:
        msg = _message(Row(at=datetime.datetime(2026, 1, 1, 10, 0), n=1), ("at",))
    finally:
        monkeypatch.undo()
        time.tzset()
    assert msg == {"at": datetime.datetime(2026, 1, 1, 15, 0, tzinfo=datetime.UTC), "n": 1}


def test_intents_once_recorded_are_never_replaced(tmp_path) -> None:
    """Two commits of one batch racing (a driver thought dead and its successor): each writes ACKs
    of the intents the record holds, so the record is created once and never overwritten; the
    loser writes the winner's ACKs. No temporary file is left behind."""
    from tidings.spark.sink import record_intents

    checkpoint = str(tmp_path / "cp")
    first = [("j", b"first-ack\n")]
    assert record_intents(checkpoint, 3, first) == first
    assert record_intents(checkpoint, 3, [("j", b"second-ack\n")]) == first
    assert record_intents(checkpoint, 4, []) == []
    assert sorted(p.name for p in (tmp_path / "cp" / "tidings-sink").iterdir()) == ["3.json", "4.json"]


def test_a_commit_racing_between_the_existence_check_and_the_record_keeps_the_first(tmp_path, monkeypatch) -> None:
    """The race itself: a rival records its intents after our check found none."""
    import tidings.spark.sink as sink

    checkpoint = str(tmp_path / "cp")
    rival = [("j", b"rival-ack\n")]
    real = sink._create_once

    def rival_first(fs, root: str, path: str, data: bytes) -> None:
        real(fs, root, path, json.dumps([(j, c.hex()) for j, c in rival]).encode())
        real(fs, root, path, data)

    monkeypatch.setattr(sink, "_create_once", rival_first)
    assert sink.record_intents(checkpoint, 9, [("j", b"ours\n")]) == rival


def test_intents_are_recorded_where_the_filesystem_has_no_hard_links(tmp_path, monkeypatch) -> None:
    """A local path whose file system refuses hard links (FUSE mounts such as /dbfs or
    s3fs-fuse, SMB, exFAT) still records the intents (by rename, after a last existence check),
    instead of failing every commit; os.link fails here as on such a file system."""
    import errno

    import tidings.spark.sink as sink

    def no_links(src: str, dst: str, *args, **kwargs) -> None:
        raise OSError(errno.EPERM, "Operation not permitted", src, None, dst)

    monkeypatch.setattr(os, "link", no_links)
    mine = [("j", b"ack\n")]
    assert sink.record_intents(str(tmp_path / "cp"), 1, mine) == mine
    assert sink.record_intents(str(tmp_path / "cp"), 1, [("j", b"other\n")]) == mine
    assert [p.name for p in (tmp_path / "cp" / "tidings-sink").iterdir()] == ["1.json"]


def test_on_s3_a_commit_racing_past_the_existence_check_keeps_the_first(moto_s3, monkeypatch) -> None:
    """An object store has no link or rename that fails on an existing name: a rival's record that
    appears after our existence check must still win. S3's conditional write (If-None-Match, moto's
    server here) makes the creation itself refuse an existing record."""
    import fsspec

    from tidings.spark.sink import record_intents

    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto_s3.endpoint)
    checkpoint = f"s3://{moto_s3.bucket}/cp-{uuid.uuid4().hex[:8]}"
    rival = [("j", b"rival-ack\n")]
    assert record_intents(checkpoint, 5, rival) == rival
    fs, _ = fsspec.core.url_to_fs(checkpoint)
    monkeypatch.setattr(fs, "exists", lambda *args, **kwargs: False)  # (every check before the rival's record)
    assert record_intents(checkpoint, 5, [("j", b"ours\n")]) == rival
    assert fs.ls(f"{checkpoint.removeprefix('s3://')}/tidings-sink", detail=False) == [
        f"{checkpoint.removeprefix('s3://')}/tidings-sink/5.json"
    ]
