"""Routes: which brokers hold a journal and which of them is its primary (Gazette's protocol.Route)."""

from __future__ import annotations

from tidings.protocol import protocol_pb2 as pb

__all__ = ["routes_equivalent"]


def routes_equivalent(a: pb.Route, b: pb.Route) -> bool:
    """Same members and same primary; endpoints are ignored (they change with restarts, not topology)."""
    if a.primary != b.primary or len(a.members) != len(b.members):
        return False
    return all(x.zone == y.zone and x.suffix == y.suffix for x, y in zip(a.members, b.members, strict=True))
