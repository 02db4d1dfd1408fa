"""tidings: Gazette-style journal brokers, exactly-once messaging, LogPlayer and Spark, in Python."""

__version__ = "0.1.0"
