"""Member processes: what a broker and a consumer process share (Gazette's `mainboilerplate` and the
allocator's member), so that each keeps only its own wiring.

* :mod:`~tidings.member.process` - :class:`MemberProcess`: the life of a member of an allocator's
  cluster (etcd, KeySpace, gRPC server, /metrics, leased announcement, Allocator; a graceful stop
  that hands the member's items off first; every step undone if a later one fails).
* :mod:`~tidings.member.serving` - a gRPC server bound to --listen, /metrics, RPCs counted by outcome
  (the LogPlayer's target serves with them too).
"""

from __future__ import annotations

from tidings.member.process import MemberProcess
from tidings.member.serving import check_listen, counted, listen_grpc, serve_metrics, stop_metrics

__all__ = ["MemberProcess", "check_listen", "counted", "listen_grpc", "serve_metrics", "stop_metrics"]
