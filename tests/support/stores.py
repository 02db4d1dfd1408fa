"""What the consumer store tests (SQLite and PostgreSQL) commit and check alike."""

from __future__ import annotations

from tidings.protocol import protocol_pb2 as pb


def checkpoint(offset: int) -> pb.Checkpoint:
    """A shard's checkpoint reading `words/in` through `offset`, with one ACK intent."""
    cp = pb.Checkpoint()
    cp.sources["words/in"].read_through = offset
    cp.ack_intents["words/out"] = b'{"ack": 1}\n'
    return cp
