"""Found by PySpark's data source lookup (modules named `pyspark_*` with a `DefaultSource`), so
`spark.read.format("tidings")` works without registering anything."""

from tidings.spark import TidingsDataSource as DefaultSource

__all__ = ["DefaultSource"]
