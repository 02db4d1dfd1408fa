"""A local Spark session for tidings' own jobs (the demo, tests, benchmarks): on loopback, its
Python workers on this interpreter, its JVM a child process stopped by PID."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from pyspark import SparkContext
from pyspark.sql import SparkSession


@contextmanager
def local_session(app: str, master: str = "local[2]", **conf: str) -> Iterator[Any]:
    """A SparkSession bound to 127.0.0.1 (no UI, no console progress bar); stopped on exit, and its
    JVM killed by PID whatever happens (PySpark's own stop leaves it to exit on its own)."""
    os.environ["PYSPARK_PYTHON"] = sys.executable  # (workers otherwise run the PATH's python3)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    builder = (
        SparkSession.builder.master(master)
        .appName(app)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.sql.shuffle.partitions", "2")
    )
    for key, value in conf.items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    gateway = SparkContext._gateway
    assert gateway is not None
    jvm = gateway.proc
    try:
        yield session
    finally:
        try:
            session.stop()
            gateway.shutdown()
        finally:
            jvm.kill()
            jvm.wait(30)
            SparkContext._gateway = None  # a later session starts a new JVM
            SparkContext._jvm = None
