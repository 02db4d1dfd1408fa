"""Sink task retries: a task that fails after publishing part of its rows, retried by real Spark
(local[2,3]: up to 3 attempts), batch and streaming, leaves the journal read committed holding each
row once and nothing of the failed attempt (DESIGN.md invariant 7). The job runs in a process of its
own (its own master), stopped by PID."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.spark._support import NDJSON, cli_committed
from tests.support.cluster import create_local_journal
from tidings.client import Client

ROOT = Path(__file__).resolve().parents[2]
ROWS = 6000


def test_rows_of_a_failed_task_attempt_are_never_read_committed(local_cluster, tmp_path) -> None:
    ep = local_cluster.endpoints[0]
    for j in ("spark/retry-batch", "spark/retry-stream"):
        asyncio.run(create_local_journal(local_cluster, j, 3, **NDJSON))
    cmd = [sys.executable, "-m", "tests.spark.test_task_retry", ep, str(tmp_path)]
    job = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        _out, err = job.communicate(timeout=300)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
        job.wait()
    assert job.returncode == 0, err.decode()[-3000:]
    assert len(list(tmp_path.glob("failed-*"))) == 4  # (two tasks each of the batch write and the stream failed once)
    for j in ("spark/retry-batch", "spark/retry-stream"):
        ids = sorted(m["id"] for m in cli_committed(ep, j))
        assert ids == list(range(ROWS)), (j, len(ids))
        with Client(ep) as c:  # the failed attempts' rows are in the journal, uncommitted
            assert c.read_all(j).count(b'"id":') >= ROWS + 2 * 2000


def _job(ep: str, marks: str) -> None:
    from pyspark import TaskContext

    from tidings.spark.datasource import TidingsDataSource
    from tidings.spark.local import local_session
    from tidings.spark.sink import SinkOptions, TidingsStreamWriter, TidingsWriter

    def failing(rows, tag: str):
        """Rows, except that a task's first attempt fails after 2500 of them (2000 are published)."""
        ctx = TaskContext.get()
        for n, r in enumerate(rows):
            if n == 2500 and ctx.attemptNumber() == 0:
                Path(marks, f"failed-{tag}-{ctx.partitionId()}").touch()
                raise RuntimeError("an attempt that dies after publishing")
            yield r

    class W(TidingsWriter):
        def write(self, iterator):  # type: ignore[no-untyped-def]
            return super().write(failing(iterator, "batch"))

    class SW(TidingsStreamWriter):
        def write(self, iterator):  # type: ignore[no-untyped-def]
            return super().write(failing(iterator, "stream"))

    class Source(TidingsDataSource):
        @classmethod
        def name(cls) -> str:
            return "tidings_retry"

        def writer(self, schema, overwrite):  # type: ignore[no-untyped-def]
            return W(SinkOptions.parse(self.options, schema, streaming=False))

        def streamWriter(self, schema, overwrite):  # type: ignore[no-untyped-def]
            return SW(SinkOptions.parse(self.options, schema, streaming=True))

    with local_session("retry", master="local[2,3]") as spark:
        spark.sparkContext.setLogLevel("ERROR")
        spark.dataSource.register(Source)
        df = spark.range(0, ROWS, numPartitions=2).selectExpr("id")
        df.write.format("tidings_retry").mode("append").option("broker", ep).option(
            "journal", "spark/retry-batch").save()  # fmt: skip
        src = Path(marks, "in")
        df.write.parquet(str(src))
        q = (
            spark.readStream.schema("id BIGINT").parquet(str(src)).repartition(2)
            .writeStream.format("tidings_retry").option("broker", ep).option("journal", "spark/retry-stream")
            .option("checkpointLocation", str(Path(marks, "cp"))).trigger(availableNow=True).start()
        )  # fmt: skip
        q.awaitTermination(200)
        assert q.exception() is None, q.exception()


if __name__ == "__main__":
    _job(sys.argv[1], sys.argv[2])
