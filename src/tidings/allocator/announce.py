"""Announcement: a broker's leased member key, which is how the allocator knows it is alive.

``announce()`` creates ``{root}/members/{zone}#{suffix}`` under a fresh lease and keeps the lease
alive over one stream. When the process stops, ``aclose()`` revokes the lease so the key goes at
once; when it dies, etcd expires the lease after ``ttl`` seconds. Either way the member's
assignments, which the allocator puts under the same lease, go with the key in one revision.
Marking the broker ``exiting`` (``update``) instead asks the allocator to move its journals away
first.

A key that already exists under another lease (gazette's ``Announce``, allocator/announce.go):
usually the same broker's previous process, killed before it could revoke its lease, or a
lease that etcd restored when it restarted. ``announce()`` says so once and waits for the key to
go, as gazette does, instead of failing. Gazette waits forever; we wait until that lease must
have expired had its holder been dead when we first looked (its remaining TTL then, plus
``CONFLICT_MARGIN``), or for ``wait_timeout`` seconds if given. A key still there after that is
being kept alive: another live broker has this id, which is one clear error
(``MemberConflictError``). Our own lease is granted only once the key is gone, so a wait of any
length never puts our lease at risk, and a broker killed while it waits leaves nothing behind.

The keep-alive rides out etcd outages shorter than the lease (see ``Etcd.keep_alive``); the lease
is reported lost (``lost`` set, one error line) only when etcd says it is gone or its TTL passed
without an answered refresh.
"""

from __future__ import annotations

import asyncio
import logging
import time

from tidings.allocator.keys import member_key
from tidings.keyspace import Etcd, LeaseLostError, create_revision_is, put_op
from tidings.keyspace.etcd import RPC_TIMEOUT
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol import validate
from tidings.protocol.status import TidingsError, UsageError

__all__ = ["Announcement", "MemberConflictError", "announce"]

log = logging.getLogger(__name__)

CONFLICT_POLL = 0.25  # seconds between looks at a member key held by another lease
CONFLICT_MARGIN = 2.0  # seconds past the holder's remaining TTL before calling it alive


class MemberConflictError(UsageError):
    """Another live broker already announced this (zone, suffix)."""


class Announcement:
    """A live member key; ``lost`` is set if the lease is lost (the key is gone)."""

    def __init__(
        self,
        etcd: Etcd,
        key: str,
        spec: pb.BrokerSpec | pb.ConsumerSpec,
        lease_id: int,
        ttl: int,
        create_revision: int,
        granted_at: float | None = None,
    ) -> None:
        self._etcd = etcd
        self.key = key
        self.spec = spec
        self.lease_id = lease_id
        self.ttl = ttl
        self.create_revision = create_revision
        self.granted_at = time.monotonic() if granted_at is None else granted_at
        self.expires_at = self.granted_at + ttl  # monotonic; moved by each answered refresh
        self.lost = asyncio.Event()
        self.lost_reason = ""
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    def _start(self) -> None:
        name = f"announce:{self.spec.id.zone}#{self.spec.id.suffix}"
        self._task = asyncio.create_task(self._keep_alive(), name=name)

    def _refreshed(self, deadline: float) -> None:
        self.expires_at = deadline

    async def _keep_alive(self) -> None:
        try:
            await self._etcd.keep_alive(self.lease_id, self.ttl, since=self.granted_at, on_refresh=self._refreshed)
        except LeaseLostError as err:
            self._set_lost(str(err))
        except Exception as err:  # a bug, not an etcd outage: keep_alive retries those itself
            log.exception("member %s: keep-alive failed", self.key)
            self._set_lost(f"keep-alive failed: {err!r}")

    def _set_lost(self, reason: str) -> None:
        if not self.lost.is_set():
            self.lost_reason = reason
            log.error("member %s lost its lease: %s; the allocator will reassign its journals", self.key, reason)
            self.lost.set()

    async def update(self, spec: pb.BrokerSpec | pb.ConsumerSpec, timeout: float = RPC_TIMEOUT) -> None:
        """Rewrite the member's spec under the same lease (e.g. ``exiting=True``).

        Raises LeaseLostError (and sets ``lost``) if the key is no longer ours, and TransportError
        if etcd does not answer within ``timeout`` seconds.
        """
        if (spec.id.zone, spec.id.suffix) != (self.spec.id.zone, self.spec.id.suffix):
            raise UsageError(f"member {self.key}: update() cannot change the id; announce a new member instead")
        ok, _ = await self._etcd.txn(
            [create_revision_is(self.key, self.create_revision)],
            [put_op(self.key, spec.SerializeToString(), lease=self.lease_id)],
            timeout=timeout,
        )
        if not ok:
            self._set_lost(f"member key {self.key} is gone")
            raise LeaseLostError(self.lease_id, f"member key {self.key} is gone")
        self.spec = spec

    async def aclose(self, timeout: float = RPC_TIMEOUT) -> None:
        """Stop the keep-alive and revoke the lease, removing the key. Idempotent.

        If etcd does not answer within ``timeout`` seconds the key stays until the lease expires
        (logged, not raised): closing never waits longer than that.
        """
        if self._closed:
            return
        self._closed = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.wait([task])
        if self.lost.is_set():
            return
        try:
            await self._etcd.revoke_lease(self.lease_id, timeout=timeout)
        except TidingsError as err:
            left = max(0.0, self.expires_at - time.monotonic())
            log.warning(
                "member %s: could not revoke its lease (%s); the key goes when the lease expires, in %.0fs at most",
                self.key,
                err,
                left,
            )


async def announce(
    etcd: Etcd, root: str, spec: pb.BrokerSpec | pb.ConsumerSpec, ttl: int = 5, wait_timeout: float | None = None
) -> Announcement:
    """Create the member key of ``spec.id`` under a new ``ttl``-second lease and keep it alive.

    Waits while the key exists under another lease (see the module docstring); raises
    MemberConflictError if it outlives that wait (``wait_timeout`` seconds if given).
    Cancellation leaves nothing behind: no key, no lease.
    """
    validate.process_id(spec.id, "spec.id")
    limit = spec.shard_limit if isinstance(spec, pb.ConsumerSpec) else spec.journal_limit
    if limit < 0:
        raise UsageError(f"the member's limit {limit} must not be negative")
    member = f"{spec.id.zone}#{spec.id.suffix}"
    key = member_key(root, spec.id.zone, spec.id.suffix)
    value = spec.SerializeToString()
    waiting_since: float | None = None
    give_up_at = 0.0
    while True:
        kv, _ = await etcd.get(key)
        if kv is not None:
            now = time.monotonic()
            if kv.lease == 0:
                raise MemberConflictError(
                    f"member key {key} exists without a lease, so it never expires (written by hand?); "
                    f"delete it (etcdctl del {key}) or give this broker another --id"
                )
            if waiting_since is None:
                left, _granted = await etcd.lease_time_to_live(kv.lease)
                waiting_since = now
                give_up_at = now + (wait_timeout if wait_timeout is not None else max(left, 0) + CONFLICT_MARGIN)
                log.warning(
                    "member %s is still announced by a previous process (lease %x expires in %ds); waiting",
                    member,
                    kv.lease,
                    max(left, 0),
                )
            elif now >= give_up_at:
                raise MemberConflictError(
                    f"member {member} is still announced at {key} after waiting {now - waiting_since:.0f}s: "
                    "another live broker has this id (its lease keeps being refreshed); give this one another "
                    "--id, or stop the other one first"
                )
            await asyncio.sleep(CONFLICT_POLL)
            continue
        granted_at = time.monotonic()
        lease = await etcd.grant_lease(ttl)
        try:
            ok, revision = await etcd.txn([create_revision_is(key, 0)], [put_op(key, value, lease=lease)])
        except BaseException:
            await _revoke_quietly(etcd, lease)
            raise
        if ok:
            break
        await _revoke_quietly(etcd, lease)  # another process created it since we looked: wait for it too
    if waiting_since is not None:
        log.info(
            "member %s announced after waiting %.1fs for the previous one to expire",
            member,
            time.monotonic() - waiting_since,
        )
    announcement = Announcement(etcd, key, spec, lease, ttl, revision, granted_at)
    announcement._start()
    return announcement


async def _revoke_quietly(etcd: Etcd, lease: int) -> None:
    """Revoke a lease we no longer need; if etcd cannot be reached it simply expires."""
    try:
        await asyncio.shield(etcd.revoke_lease(lease, timeout=2.0))
    except TidingsError:
        pass
