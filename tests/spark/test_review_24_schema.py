"""Review 24: option('schema') now goes inside struct<...>; Spark's own DDL of a struct type (what
`df.schema.simpleString()` prints, and what `.schema()` and `StructType.fromDDL` accept) is refused
with a parse error pointing into the source's metadata columns."""

from __future__ import annotations

from tests.spark.test_source import P1, line, ndjson_journal
from tidings.message.uuid import OUTSIDE_TXN

SHARE_CLUSTER = True  # one local cluster for the module's tests (conftest.local_cluster)


def test_option_schema_takes_spark_struct_ddl_as_schema_does(spark, local_cluster) -> None:
    journal = "spark/r24-struct-ddl"
    ndjson_journal(local_cluster, journal, line(P1, 1, OUTSIDE_TXN, id=1, name="one"))
    ddl = "struct<id:bigint,name:string>"
    assert spark.createDataFrame([], ddl).schema.simpleString() == ddl  # (what Spark prints and takes)
    r = spark.read.format("tidings").option("broker", local_cluster.endpoints[0]).option("journal", journal)
    rows = r.option("schema", ddl).load().select("id", "name").collect()
    assert [(row.id, row.name) for row in rows] == [(1, "one")]
