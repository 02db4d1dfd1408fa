"""Messages: framing, UUIDs, the Publisher and the read-committed Sequencer."""
