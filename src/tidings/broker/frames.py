"""The data port's framing, shared by replication (`transport.py`), clients' calls on the broker side
(`transport_rpc.py`) and on the client side (`tidings.client._wire`).

A frame is ``!IIB`` (payload length, stream id, kind), then the payload. Kinds: HELLO opens a
connection; REQUEST, RESPONSE, CLOSE_SEND, END and RESET carry a stream; PING and PONG keep a
connection alive; OPEN starts a client's call (`transport_rpc.py`).
"""

from __future__ import annotations

import struct

import grpc

HEADER = struct.Struct("!IIB")  # payload length, stream id, kind
MAX_FRAME = 65 * 1024 * 1024  # a ReplicateRequest carries at most one client message (64 MiB) and a proposal
HELLO, REQUEST, RESPONSE, CLOSE_SEND, END, RESET, PING, PONG, OPEN = range(9)
_END_STATUS = struct.Struct("!B")


class StreamError(Exception):
    """A stream failed (the other side went away, refused the stream, or the connection broke)."""


def end_payload(code: grpc.StatusCode, message: str) -> bytes:
    """An END's payload for a failure: the gRPC code, then the message."""
    return _END_STATUS.pack(code.value[0]) + message.encode()


def end_status(payload: bytes) -> tuple[grpc.StatusCode, str]:
    """(code, message) of an END's payload (empty: OK)."""
    if not payload:
        return grpc.StatusCode.OK, ""
    code = next((c for c in grpc.StatusCode if c.value[0] == payload[0]), grpc.StatusCode.UNKNOWN)
    return code, payload[1:].decode(errors="replace")
