"""Announcement: a broker's leased member key, which is how the allocator knows it is alive.

``announce()`` creates ``{root}/members/{zone}#{suffix}`` under a fresh lease, refused if the key
exists (another live broker has that id), and keeps the lease alive over one stream. When the
process stops, ``aclose()`` revokes the lease so the key goes at once; when it dies, etcd expires
the lease after ``ttl`` seconds. Either way the member's assignments, which the allocator puts
under the same lease, go with the key in the same etcd revision. Marking the broker ``exiting``
(``update``) instead asks the allocator to move its journals away first.
"""

from __future__ import annotations

import asyncio
import logging

from tidings.allocator.keys import member_key
from tidings.keyspace import Etcd, LeaseLostError, create_revision_is, put_op
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol import validate
from tidings.protocol.status import TidingsError, UsageError

__all__ = ["Announcement", "MemberConflictError", "announce"]

log = logging.getLogger(__name__)


class MemberConflictError(UsageError):
    """Another live broker already announced this (zone, suffix)."""


class Announcement:
    """A live member key; ``lost`` is set if the lease is lost (the key is gone)."""

    def __init__(
        self, etcd: Etcd, key: str, spec: pb.BrokerSpec, lease_id: int, ttl: int, create_revision: int
    ) -> None:
        self._etcd = etcd
        self.key = key
        self.spec = spec
        self.lease_id = lease_id
        self.ttl = ttl
        self.create_revision = create_revision
        self.lost = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    def _start(self) -> None:
        name = f"announce:{self.spec.id.zone}#{self.spec.id.suffix}"
        self._task = asyncio.create_task(self._keep_alive(), name=name)

    async def _keep_alive(self) -> None:
        try:
            await self._etcd.keep_alive(self.lease_id, self.ttl)
        except LeaseLostError as err:
            log.error("member %s lost its lease: %s; the allocator will reassign its journals", self.key, err)
            self.lost.set()
        except Exception:
            log.exception("member %s keep-alive failed; treating the lease as lost", self.key)
            self.lost.set()

    async def update(self, spec: pb.BrokerSpec) -> None:
        """Rewrite the member's spec under the same lease (e.g. ``exiting=True``).

        Raises LeaseLostError (and sets ``lost``) if the key is no longer ours.
        """
        if (spec.id.zone, spec.id.suffix) != (self.spec.id.zone, self.spec.id.suffix):
            raise UsageError(f"member {self.key}: update() cannot change the id; announce a new member instead")
        ok, _ = await self._etcd.txn(
            [create_revision_is(self.key, self.create_revision)],
            [put_op(self.key, spec.SerializeToString(), lease=self.lease_id)],
        )
        if not ok:
            self.lost.set()
            raise LeaseLostError(self.lease_id, f"member key {self.key} is gone")
        self.spec = spec

    async def aclose(self) -> None:
        """Stop the keep-alive and revoke the lease, removing the key. Idempotent."""
        if self._closed:
            return
        self._closed = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.wait([task])
        try:
            await self._etcd.revoke_lease(self.lease_id)
        except TidingsError as err:
            log.warning("member %s: could not revoke lease (it expires in %ds): %s", self.key, self.ttl, err)


async def announce(etcd: Etcd, root: str, spec: pb.BrokerSpec, ttl: int = 5) -> Announcement:
    """Create the member key of ``spec.id`` under a new ``ttl``-second lease and keep it alive."""
    validate.process_id(spec.id, "spec.id")
    if spec.journal_limit < 0:
        raise UsageError(f"journal_limit {spec.journal_limit} must not be negative")
    key = member_key(root, spec.id.zone, spec.id.suffix)
    lease = await etcd.grant_lease(ttl)
    try:
        ok, revision = await etcd.txn(
            [create_revision_is(key, 0)], [put_op(key, spec.SerializeToString(), lease=lease)]
        )
    except BaseException:
        await etcd.revoke_lease(lease)
        raise
    if not ok:
        await etcd.revoke_lease(lease)
        raise MemberConflictError(
            f"member {spec.id.zone}#{spec.id.suffix} is already announced at {key}: another broker with this id "
            f"is alive; give this one another --suffix, or wait up to {ttl}s for a dead one's lease to expire"
        )
    announcement = Announcement(etcd, key, spec, lease, ttl, revision)
    announcement._start()
    return announcement
