"""A local Spark session finds the tidings format only if its Python workers can import tidings:
Spark runs the PATH's `python3` unless told otherwise. `tidings.spark.session()` runs them on this
interpreter (tests/test_readme.py runs the README's snippet with it); `register(spark)` on a
session whose workers cannot import tidings says so in one line and how to mend it; and
`import tidings.spark` without PySpark names the extra to install."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SYSTEM_PATH = "/usr/bin:/bin"  # (a newcomer's PATH: its python3 is not the project's)

SCRIPT = textwrap.dedent(
    """
    import os
    from pyspark.sql import SparkSession
    import tidings.spark
    from tidings.protocol.status import UsageError

    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    spark = (SparkSession.builder.master("local[1]").config("spark.ui.enabled", "false")
             .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
             .getOrCreate())
    try:
        tidings.spark.register(spark)
        print("REGISTERED")
    except UsageError as exc:
        print("REFUSED", exc)
    finally:
        spark.stop()
    """
)


def test_register_names_a_worker_python_that_cannot_import_tidings() -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYSPARK_PYTHON"} | {"PATH": SYSTEM_PATH}
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    (line,) = [ln for ln in r.stdout.splitlines() if ln.startswith(("REFUSED", "REGISTERED"))]
    assert line.startswith("REFUSED Spark's Python workers run 'python3'"), line
    assert "cannot import tidings: start the session with tidings.spark.session()" in line, line
    assert f"PYSPARK_PYTHON={sys.executable}" in line, line


def test_import_without_pyspark_names_the_extra() -> None:
    hide = "import sys; sys.modules['pyspark'] = None; import tidings.spark"
    r = subprocess.run([sys.executable, "-c", hide], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1] == "ImportError: tidings.spark needs PySpark: pip install 'tidings[spark]'"
