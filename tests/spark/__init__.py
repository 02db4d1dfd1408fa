"""The Spark source, streaming source and sink on a real local Spark."""
