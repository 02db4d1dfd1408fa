"""keyspace: a local, watched mirror of an etcd prefix (Gazette's KeySpace).

Every broker mirrors its cluster root so that routing and allocation are local reads at a known
etcd revision; a party that learns of a later revision from a peer waits for its mirror to reach
it (``KeySpace.wait_for_revision``) before deciding (gazette-transactional-appends.txt,
*Components*). Observers see each watch batch applied atomically, together with the new revision;
see ``keyspace.py`` for the exact guarantees.

Main types
- ``Etcd``: a thin async etcd client (KV, txn with header revision, watch with progress
  notifications, leases with one keep-alive stream) and its compare/op builders.
- ``KeySpace`` and ``KeyValue``: the mirror.
- ``decoder(root)``: typed values for the tidings layout (members, items, assignments).
"""

from tidings.keyspace.decode import decoder
from tidings.keyspace.etcd import (
    KV,
    CompactedError,
    Compare,
    Etcd,
    Event,
    LeaseLostError,
    RequestOp,
    Watch,
    WatchBatch,
    create_revision_is,
    delete_op,
    mod_revision_is,
    put_op,
    value_is,
)
from tidings.keyspace.keyspace import KeySpace, KeyValue

__all__ = [
    "KV",
    "CompactedError",
    "Compare",
    "Etcd",
    "Event",
    "KeySpace",
    "KeyValue",
    "LeaseLostError",
    "RequestOp",
    "Watch",
    "WatchBatch",
    "create_revision_is",
    "decoder",
    "delete_op",
    "mod_revision_is",
    "put_op",
    "value_is",
]
