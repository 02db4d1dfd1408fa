#!/usr/bin/env python3
"""The ceiling of PySpark's Python Data Source API here: a source that decodes nothing, yielding one
prebuilt Arrow batch (the tidings columns of 8192 rows) over and over, 1M rows in 2 partitions."""

import json
import os
import sys
import time

import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from spark import SCHEMA
from tidings.spark.local import local_session

N, ROWS = 1_000_000, 8192
DDL = (
    "journal STRING NOT NULL, offset BIGINT NOT NULL, uuid STRING, producer STRING, clock BIGINT, "
    + SCHEMA
    + ", _corrupt STRING"
)


class R(DataSourceReader):
    def __init__(self, schema):
        self.schema = schema

    def partitions(self):
        return [InputPartition(0), InputPartition(1)]

    def read(self, partition):
        from pyspark.sql.pandas.types import to_arrow_schema

        schema = to_arrow_schema(self.schema)
        n = ROWS
        cols = {
            "journal": ["bench/spark"] * n,
            "offset": list(range(n)),
            "uuid": ["0a1b2c3d-0000-1000-8000-010203040506"] * n,
            "producer": ["010203040506"] * n,
            "clock": list(range(n)),
            "id": list(range(n)),
            "user": [f"user-{i % 100}" for i in range(n)],
            "amount": [1.5] * n,
            "note": ["x" * 120] * n,
            "_corrupt": [None] * n,
        }
        batch = pa.RecordBatch.from_pydict(cols, schema=schema)
        left = N // 2
        while left > 0:
            k = min(left, n)
            yield batch.slice(0, k)
            left -= k


class S(DataSource):
    @classmethod
    def name(cls):
        return "ceiling"

    def schema(self):
        return DDL

    def reader(self, schema):
        return R(schema)


with local_session("ceiling") as spark:
    spark.dataSource.register(S)
    from pyspark.sql import functions as F

    for r in range(4):
        t = time.perf_counter()
        row = (
            spark.read.format("ceiling")
            .load()
            .agg(F.count("*").alias("n"), F.sum("amount"), F.max("id"), F.max("user"), F.max("note"))
            .collect()[0]
        )
        s = time.perf_counter() - t
        print(
            json.dumps(
                {
                    "reader": "python_source_prebuilt_arrow",
                    "round": r,
                    "rows": row["n"],
                    "seconds": round(s, 3),
                    "rows_per_s": round(row["n"] / s),
                }
            ),
            flush=True,
        )
