"""A batch job on Spark's local-cluster master (`python -m tests.support.spark_cluster_job`): two
executor JVMs, each with its own Python workers, read a journal through the tidings source and
write it to another through the sink. Prints the executors' process ids seen by the tasks and the
rows moved, as JSON."""

from __future__ import annotations

import argparse
import json
import os

import pyspark

from tidings.spark.local import local_session


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--broker", required=True)
    p.add_argument("--source", required=True)
    p.add_argument("--sink", required=True)
    args = p.parse_args()
    os.environ["SPARK_HOME"] = os.path.dirname(pyspark.__file__)  # (local-cluster launches executors from it)
    with local_session("tidings-local-cluster", master="local-cluster[2,1,1024]") as spark:
        spark.sparkContext.setLogLevel("ERROR")
        df = (
            spark.read.format("tidings")
            .option("broker", args.broker)
            .option("journal", args.source)
            .option("schema", "id BIGINT")
            .load()
        )
        rows = df.select("id").repartition(4)
        rows.write.format("tidings").option("broker", args.broker).option("journal", args.sink).mode("append").save()
        pids = spark.sparkContext.parallelize(range(8), 8).map(lambda _: os.getppid()).distinct().collect()
        print(json.dumps({"rows": rows.count(), "executor_pids": sorted(pids)}), flush=True)


if __name__ == "__main__":
    main()
