"""A streaming job for the Spark kill -9 test (`python -m tests.support.spark_job`): the messages of
the journals matching --selector, read committed, written to the --sink journal exactly once.

Each output message carries the input's fields and where it came from (`source`, `offset`), so a
duplicate shows. Runs until killed; prints STARTED once its query runs.
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

from pyspark.sql.datasource import DataSourceStreamWriter

from tidings.spark import TidingsDataSource
from tidings.spark.local import local_session
from tidings.spark.sink import SinkOptions, TidingsStreamWriter


class DyingWriter(TidingsStreamWriter):
    """The sink, except that after writing the ACKs of a batch named in TIDINGS_TEST_DIE_AFTER_ACKS
    (once each) it SIGKILLs the whole job, driver and JVM: a crash between our commit and Spark's
    commit log, the window where Spark re-runs a batch whose ACKs are written."""

    def commit(self, messages, batchId: int) -> None:  # type: ignore[no-untyped-def]
        super().commit(messages, batchId)
        plan = {int(b) for b in os.environ.get("TIDINGS_TEST_DIE_AFTER_ACKS", "").split(",") if b}
        assert self.options.checkpoint is not None
        marker = Path(self.options.checkpoint) / f"died-after-acks-{batchId}"
        if batchId in plan and not marker.exists():
            marker.touch()
            os.killpg(int(os.environ["TIDINGS_TEST_JOB_PGID"]), signal.SIGKILL)  # (this worker has a group of its own)


class DyingSource(TidingsDataSource):
    @classmethod
    def name(cls) -> str:
        return "tidings_dying"

    def streamWriter(self, schema, overwrite: bool) -> DataSourceStreamWriter:  # type: ignore[no-untyped-def]
        return DyingWriter(SinkOptions.parse(self.options, schema, streaming=True))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--broker", required=True)
    p.add_argument("--selector", required=True)
    p.add_argument("--sink", required=True)
    p.add_argument("--checkpoint", required=True)
    args = p.parse_args()
    os.environ["TIDINGS_TEST_JOB_PGID"] = str(os.getpgid(0))  # the driver's and its JVM's, for DyingWriter
    with local_session("tidings-kill-test") as spark:
        run(spark, args)


def run(spark, args: argparse.Namespace) -> None:  # type: ignore[no-untyped-def]
    spark.sparkContext.setLogLevel("ERROR")
    spark.dataSource.register(DyingSource)
    query = (
        spark.readStream.format("tidings")
        .option("broker", args.broker)
        .option("selector", args.selector)
        .option("schema", "p BIGINT, txn BIGINT, i BIGINT, attempt BIGINT")
        .option("maxBytesPerTrigger", "4096")  # many small batches: more places to be killed at
        .load()
        .selectExpr("p", "txn", "i", "attempt", "journal AS source", "offset")
        .writeStream.format("tidings_dying")
        .option("broker", args.broker)
        .option("journal", args.sink)
        .option("checkpointLocation", args.checkpoint)
        .trigger(processingTime="100 milliseconds")
        .start()
    )
    print("STARTED", flush=True)
    query.awaitTermination()


if __name__ == "__main__":
    main()
