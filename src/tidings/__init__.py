"""tidings: Gazette-style journal brokers, exactly-once messaging, LogPlayer and Spark, in Python."""
