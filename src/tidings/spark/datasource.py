"""`format("tidings")`: the DataSource Spark looks up by name (and pickles to its Python workers).

It hands a query to the batch reader (`tidings.spark.source`), the stream reader
(`tidings.spark.stream`) or the sink's writers (`tidings.spark.sink`); options and columns: see
the package docstring.
"""

from __future__ import annotations

import re

from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    DataSourceStreamWriter,
    DataSourceWriter,
)
from pyspark.sql.types import StructType

from tidings.protocol.status import UsageError
from tidings.spark._read import _one_line
from tidings.spark.options import SourceOptions
from tidings.spark.schema import CORRUPT, METADATA_DDL, RAW_DDL
from tidings.spark.sink import SinkOptions, TidingsStreamWriter, TidingsWriter, check_target
from tidings.spark.source import TidingsBatchReader
from tidings.spark.stream import TidingsStreamReader


class TidingsDataSource(DataSource):
    """`spark.read.format("tidings")`: see the package docstring for the options and columns."""

    @classmethod
    def name(cls) -> str:
        return "tidings"

    @_one_line
    def schema(self) -> str:
        opts = SourceOptions.parse(self.options)
        if opts.format == "raw":
            return RAW_DDL
        if opts.schema is None:
            raise UsageError(
                "tidings source: format json needs the messages' fields: give them with "
                ".schema('id BIGINT, name STRING') (columns journal, offset, uuid, producer, clock and _corrupt "
                "are filled by name) or .option('schema', 'id BIGINT, name STRING')"
            )
        fields = opts.schema.strip()
        if whole := re.fullmatch(r"struct\s*<(.*)>", fields, re.IGNORECASE | re.DOTALL):
            fields = whole[1]  # (Spark's own form of a struct, as df.schema.simpleString() prints it)
        return f"struct<{METADATA_DDL}, {fields}, {CORRUPT} STRING>"  # (a typo is then shown where it is)

    @_one_line
    def reader(self, schema: StructType) -> DataSourceReader:
        return TidingsBatchReader(SourceOptions.parse(self.options), schema)

    @_one_line
    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return TidingsStreamReader(self.options, schema)  # (its options are parsed there: see _usable)

    @_one_line
    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        if overwrite:
            raise UsageError(
                "tidings sink: a journal is append-only, so mode('overwrite') cannot replace what it holds; "
                "use mode('append')"
            )
        opts = SinkOptions.parse(self.options, schema, streaming=False)
        check_target(opts)
        return TidingsWriter(opts)

    @_one_line
    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        opts = SinkOptions.parse(self.options, schema, streaming=True)
        check_target(opts)
        return TidingsStreamWriter(opts)
