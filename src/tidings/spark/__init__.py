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

`session()` starts a local SparkSession whose Python workers run this interpreter (Spark's own
default runs the PATH's `python3`, which may not have tidings: the lookup of `format("tidings")`
then fails with DATA_SOURCE_NOT_FOUND). `register(spark)` registers the source with a session
explicitly (one whose workers cannot find `pyspark_tidings` on their own, e.g. `--py-files`); with a
local master it first checks that the workers' Python can import tidings, and says how if not.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from typing import Any

try:
    import pyspark  # noqa: F401
except ModuleNotFoundError:
    raise ImportError("tidings.spark needs PySpark: pip install 'tidings[spark]'") from None

from tidings.protocol.status import UsageError
from tidings.spark.datasource import TidingsDataSource
from tidings.spark.local import local_session as session
from tidings.spark.source import TidingsBatchReader

__all__ = ["TidingsBatchReader", "TidingsDataSource", "register", "session"]


def register(spark: Any) -> None:
    """Register the `tidings` format with a SparkSession."""
    if spark.sparkContext.master.startswith("local"):
        check_worker_python(spark)
    spark.dataSource.register(TidingsDataSource)


def check_worker_python(spark: Any) -> None:
    """Raise UsageError (one line) if a local session's Python workers cannot import tidings."""
    sc = spark.sparkContext
    worker = sc.getConf().get("spark.pyspark.python") or sc.pythonExec or "python3"  # (the conf wins, as in Spark)
    path = shutil.which(worker) or worker
    if os.path.realpath(path) == os.path.realpath(sys.executable):
        return
    try:
        ok = subprocess.run([path, "-c", "import tidings.spark"], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    if not ok:
        raise UsageError(
            f"Spark's Python workers run {worker!r} ({path}), which cannot import tidings: start the session with "
            f"tidings.spark.session(), or set PYSPARK_PYTHON={sys.executable} before creating it"
        )
