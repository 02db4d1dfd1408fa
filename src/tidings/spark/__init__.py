"""tidings journals in Apache Spark (PySpark's Python Data Source API).

    import tidings.spark            # or nothing: Spark finds `pyspark_tidings` on its own
    df = (spark.read.format("tidings")
          .option("broker", "127.0.0.1:8080")
          .option("journal", "shop/orders")        # or a comma list, or .option("selector", "topic=orders")
          .schema("id BIGINT, amount DOUBLE")       # the messages' fields (format json)
          .load())

Options (Kafka's names where they mean the same): `broker` (any broker; default 127.0.0.1:8080),
`journal` or `selector`, `startingOffsets` / `endingOffsets` (`earliest`, `latest`, or JSON
`{"journal": byte offset}` with -2 / -1 for those; defaults earliest / latest), `readCommitted`
(default true: each committed message once, rolled-back ones never), `format` (`json` with a
schema, default; or `raw`: `journal`, `offset`, `value` per message as written, read uncommitted),
`schema` (the messages' fields as DDL, instead of `.schema()`), `bytesPerPartition` and
`minPartitions` (batch reads: a journal splits at fragment boundaries into partitions of at most
about 128 MiB by default, and at least this many; see `tidings.spark.source`),
and for `readStream`
`maxBytesPerTrigger` and `producerHorizon` (see `tidings.spark.stream`). Columns: see `tidings.spark.schema`.

Writing (`df.write` / `df.writeStream` `.format("tidings")`): options `broker`, `journal` (or a
`journal` column per row) and, for streams, `checkpointLocation`; exactly once, see
`tidings.spark.sink`.

`register(spark)` registers the source with a session explicitly (a session whose Python workers
cannot import `pyspark_tidings` needs it).
"""

from __future__ import annotations

from typing import Any

from tidings.spark.source import TidingsBatchReader, TidingsDataSource

__all__ = ["TidingsBatchReader", "TidingsDataSource", "register"]


def register(spark: Any) -> None:
    """Register the `tidings` format with a SparkSession."""
    spark.dataSource.register(TidingsDataSource)
