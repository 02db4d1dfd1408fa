"""The append state machine (gazette-transactional-appends.txt, *Append State Machine*).

Every Append RPC, and every pulse, traverses these states; each has one `_on_<state>` method
that returns the next state, and only the driver (`run_to`) assigns `self.state`. The
transitions follow Gazette's `append_fsm.go` edge for edge; where tidings differs it says so.

Terminal states: ERROR, PROXY, FINISHED. STREAM_CONTENT is semi-terminal: it is driven once per
client message by `on_stream_content` until the commit (or roll-back) proposal is sent.

Expected refusals set `self.status` (REGISTER_MISMATCH, WRONG_APPEND_OFFSET, ...); surprises set
`self.error` with the gRPC code the client should see (`error_code`). Only `append_api.py` turns
the end state into a response.

Fragment store health (Gazette's FRAGMENT_STORE_UNHEALTHY). tidings runs no health check of its own:
a replica's store listings are the check (its refresh loop lists every refresh interval, and after a
failure again soon, backing off from 0.25 s to 5 s). The primary appends only once the journal's
stores were listed once (it must know the journal's furthest extent), then refuses appends with
FRAGMENT_STORE_UNHEALTHY while the latest listing of the journal's primary store (the spec's first,
where fragments persist) failed: an append accepted then might never be persisted. The refusal
lasts only until a listing succeeds again, with no operator step. Clients retry it in place
(`protocol.status.RETRIABLE_IN_PLACE`). Unlike Gazette, which waits for up to five further health
checks before it refuses, an append does not wait for the next listing: it would hold the pipeline,
and every append queued behind it, for up to the backoff. Once the first listing is done, a failed
listing of a further store (read from, never persisted to) refuses nothing, as in Gazette.

Cancellation (a client that goes away, a deadline, the pulse's timeout, a broker stopping) may
arrive at any await. It never leaves a token behind and never lets another append read this
one's acknowledgements: acknowledgements are read by the pipeline's own task (`pipeline.py`);
a cancelled append that had streamed content rolls it back from a replica task, keeping the
pipeline; one cancelled after its commit proposal went out (while it drains, or while awaiting
the acknowledgements) undoes nothing: the proposal is with every peer, so it commits as they
acknowledge it, and counts as a commit (`tidings_commits_total`) once they all did, never as a
roll-back; one cancelled anywhere else the pipeline's state is uncertain shuts the pipeline down
(its spool returns at once) so the next append builds a new one.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, ClassVar

import grpc

from tidings.allocator import keys
from tidings.allocator.converge import advertise_route
from tidings.broker import _metrics as metrics
from tidings.broker.flow import throttle
from tidings.broker.pipeline import Acknowledgements, Pipeline
from tidings.broker.replica import Replica, acquire
from tidings.broker.resolver import Resolution
from tidings.fragment.fragment import EMPTY_SUM, Fragment
from tidings.fragment.spool import Spool, apply_registers, maybe_roll
from tidings.keyspace import mod_revision_is, put_op
from tidings.protocol import labels
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.claims import Claims
from tidings.protocol.route import routes_equivalent
from tidings.protocol.specs import desired_replication
from tidings.protocol.status import TidingsError, ValidationError
from tidings.tasks import cancelled_under_us

if TYPE_CHECKING:
    from tidings.broker.host import Host

log = logging.getLogger(__name__)

NONE, PARTIAL, FULL = pb.JournalSpec.Suspend.NONE, pb.JournalSpec.Suspend.PARTIAL, pb.JournalSpec.Suspend.FULL
RESUME_WAIT = 30.0  # seconds an append that resumed a journal waits for its replicas before failing
IDLE_WITHOUT_FLUSH_INTERVAL = 24 * 3600.0  # seconds since its last fragment persisted: idle (Gazette's default)


class AppendState(enum.Enum):
    RESOLVE = "resolve"
    ACQUIRE_PIPELINE = "acquire_pipeline"
    START_PIPELINE = "start_pipeline"
    SEND_PIPELINE_SYNC = "send_pipeline_sync"
    RECV_PIPELINE_SYNC = "recv_pipeline_sync"
    UPDATE_ASSIGNMENTS = "update_assignments"
    AWAIT_DESIRED_REPLICAS = "await_desired_replicas"
    VALIDATE_PRECONDITIONS = "validate_preconditions"
    UPDATE_SUSPEND = "update_suspend"
    STREAM_CONTENT = "stream_content"  # semi-terminal
    READ_ACKNOWLEDGEMENTS = "read_acknowledgements"
    ERROR = "error"  # terminal
    PROXY = "proxy"  # terminal
    FINISHED = "finished"  # terminal


S = AppendState
TERMINAL = frozenset({S.ERROR, S.PROXY, S.FINISHED})


class ClientStreamError(Exception):
    """The client's stream broke under us (not a cancellation of this append's task)."""


class AppendFSM:
    """Drives one AppendRequest (the first message of an Append RPC) through the states, for the holder of
    `claims` (a journal outside their selector resolves as missing; None: the broker's own appends)."""

    _handlers: ClassVar[dict[AppendState, Callable[[AppendFSM], Awaitable[AppendState]]]]

    def __init__(self, broker: Host, req: pb.AppendRequest, pulse: bool = False, claims: Claims | None = None) -> None:
        self.broker = broker
        self.req = req
        self.claims = claims
        self.pulse = pulse  # the replica's own keep-alive, not a client's append
        self._born = time.monotonic()
        self.next_suspend: pb.JournalSpec.Suspend | None = None  # what UPDATE_SUSPEND writes (None: clear it)
        self.suspended = False  # a suspend request found the journal suspended: answer SUSPENDED once committed
        self._resuming_until = 0.0  # (loop time) this append resumed the journal: wait this long for its replicas
        self.journal = req.journal
        self.state = S.RESOLVE
        self.status = pb.OK
        self.error: str | None = None
        self.error_code = grpc.StatusCode.UNAVAILABLE  # how a surprise reaches the client
        self.client_error: Exception | None = None  # why the client's stream failed, if it did
        self.resolved: Resolution | None = None
        self.read_through_rev = req.header.etcd.revision if req.HasField("header") else 0
        self.pipeline: Pipeline | None = None
        self.owns_pipeline = False
        self._owner: Replica | None = None  # the replica whose pipeline slot we hold
        self.roll_to_offset = 0
        self.registers = pb.LabelSet()  # the journal's effective registers
        self.commit: pb.Fragment | None = None  # this append's span, with the SHA1 of its content
        self._invalidated = asyncio.Event()
        self.throttled = 0.0  # seconds this append waited for its journal's rate (not the client's time)
        self._pln_header = False  # the next sync is a new pipeline's first: it carries the Header
        self._started = False
        self._sent = False  # this append has sent something through the pipeline's send side
        self._begin = 0  # where this append's content starts
        self._length = 0
        self._summer = hashlib.sha1()
        self._commit_requested = False
        self._rolled_back = False
        self._final_sent = False  # our commit (or roll-back) proposal is out to every peer
        self._held: bytes | None = None  # the latest chunk, forwarded with the next message
        self._acks: asyncio.Future[Acknowledgements] | None = None

    # -- driver ----------------------------------------------------------------------------

    async def run_to(self, *stop_at: AppendState) -> AppendState:
        """Run until a state in `stop_at` or a terminal state; release the pipeline on terminal."""
        stops = TERMINAL.union(stop_at)
        try:
            while self.state not in stops:
                before = self.state
                self.state = await self._handlers[self.state](self)
                log.debug("append %s: %s -> %s", self.journal, before.value, self.state.value)
        except BaseException:
            self.abort()
            raise
        if self.state in TERMINAL:
            self._release_pipeline()
        return self.state

    async def run(self, next_message: Callable[[], Awaitable[pb.AppendRequest | None]]) -> AppendState:
        """Run a whole append: to STREAM_CONTENT, feed client messages, read acknowledgements.

        `next_message` returns the next client message or None at end-of-stream, and raises if
        the client fails or stalls (which rolls the append back).
        """
        if await self.run_to(S.STREAM_CONTENT) is not S.STREAM_CONTENT:
            return self.state
        try:
            if self.req.content or self.req.commit:  # the first message may carry content, and commit
                await self._on_client_message(self.req)
            while self.state is S.STREAM_CONTENT:
                try:
                    msg: pb.AppendRequest | BaseException | None = await next_message()
                except asyncio.CancelledError:
                    if not cancelled_under_us():
                        raise
                    self.client_error = msg = ClientStreamError("the client's stream was cancelled")
                except Exception as exc:
                    self.client_error = msg = exc
                await self._on_client_message(msg)
        except BaseException:  # cancelled (client gone, server stopping): see abort()
            self.abort()
            raise
        return await self.run_to()

    async def _on_client_message(self, msg: pb.AppendRequest | BaseException | None) -> None:
        """A client message is its content chunk (once the journal's rate lets it go: broker/flow.py),
        then (with `commit`) the empty chunk that commits."""
        if isinstance(msg, pb.AppendRequest) and msg.content and not self._invalidated.is_set():
            self.throttled += await throttle(
                self.broker, self.replica, len(msg.content), self._invalidated, self.throttled
            )
        if isinstance(msg, pb.AppendRequest) and msg.commit:
            if msg.content:
                await self.on_stream_content(pb.AppendRequest(content=msg.content))
            if self.state is S.STREAM_CONTENT:
                await self.on_stream_content(pb.AppendRequest())
        else:
            await self.on_stream_content(msg)

    def abort(self) -> None:
        """Interrupted while owning the pipeline: give it back in a state the next owner can use."""
        if not self.owns_pipeline:
            return
        pln, replica = self.pipeline, self._owner
        assert replica is not None
        self.owns_pipeline, self.pipeline = False, None
        if pln is None:
            replica.pipeline_slot.put_nowait(None)
        elif self.state is S.STREAM_CONTENT and self._final_sent:
            # Cancelled while our final proposal drained: it is out to every peer, nothing is undone.
            # The pipeline reads its acknowledgements (a commit counts once they are OK), and goes on.
            self._count_when_acknowledged()
            if pln.usable:
                replica.pipeline_slot.put_nowait(pln)
            else:
                pln.shutdown()
                replica.pipeline_slot.put_nowait(None)
        elif self.state is S.STREAM_CONTENT and pln.usable:
            if self._sent:  # peers hold partial content: roll it back, keeping the pipeline
                replica.roll_back_abandoned(pln)
            else:
                replica.pipeline_slot.put_nowait(pln)
        elif pln.usable and self.state not in (S.STREAM_CONTENT, S.SEND_PIPELINE_SYNC, S.RECV_PIPELINE_SYNC):
            replica.pipeline_slot.put_nowait(pln)
        else:
            pln.shutdown()
            replica.pipeline_slot.put_nowait(None)

    def _release_pipeline(self) -> None:
        if self.owns_pipeline:
            assert self._owner is not None
            self.owns_pipeline = False
            self._owner.pipeline_slot.put_nowait(self.pipeline)

    def _shut_down_pipeline(self) -> None:
        """Shut our pipeline down (its spool goes back at once); we keep the slot, holding nothing."""
        if self.pipeline is not None:
            self.pipeline.shutdown()
            self.pipeline = None

    @property
    def replica(self) -> Replica:
        assert self.resolved is not None and self.resolved.replica is not None
        return self.resolved.replica

    @property
    def spool(self) -> Spool:
        assert self.pipeline is not None
        return self.pipeline.spool

    def _fail(self, status: pb.Status, error: str | None = None, code: grpc.StatusCode | None = None) -> AppendState:
        self.status = status
        self.error = error
        if code is not None:
            self.error_code = code
        return S.ERROR

    # -- states ----------------------------------------------------------------------------

    async def _on_resolve(self) -> AppendState:
        """Resolve (or re-resolve) the journal, first reading through any later etcd revision.

        -> AWAIT_DESIRED_REPLICAS if not primary; START_PIPELINE if the pipeline is already
        owned; else ACQUIRE_PIPELINE.
        """
        rev, self.read_through_rev = self.read_through_rev, 0
        res = await self.broker.resolver.resolve(self.journal, rev, self.claims)
        if not res.is_primary or res.replica is not self._owner:
            if self.owns_pipeline:  # no longer primary (or another incarnation of the replica): give it back
                self._shut_down_pipeline()
                self._release_pipeline()
        self.resolved = res
        if res.status == pb.SUSPENDED and self.req.suspend == pb.AppendRequest.SUSPEND_RESUME:
            assert res.spec is not None  # fully suspended: resume it where it stopped (its replicas come back)
            self.next_suspend = pb.JournalSpec.Suspend(level=NONE, offset=res.spec.suspend.offset)
            return S.UPDATE_SUSPEND
        if res.status != pb.OK:
            return self._fail(res.status)
        if not res.is_primary:
            return S.AWAIT_DESIRED_REPLICAS
        if res.replica is None:
            return self._fail(pb.NO_JOURNAL_PRIMARY_BROKER, "primary replica is not yet started")
        self._invalidated = res.replica.route_changed
        return S.START_PIPELINE if self.owns_pipeline else S.ACQUIRE_PIPELINE

    async def _on_acquire_pipeline(self) -> AppendState:
        """Block for the replica's exclusively-owned pipeline.

        -> RESOLVE if the resolution is invalidated while waiting; else START_PIPELINE.
        """
        replica = self.replica
        ok, token = await acquire(replica.pipeline_slot, self._invalidated, replica.closed)
        if not ok:
            return S.RESOLVE
        self.pipeline = token
        self.owns_pipeline = True
        self._owner = replica
        return S.START_PIPELINE

    async def _on_start_pipeline(self) -> AppendState:
        """Build the pipeline unless it is synchronized at the resolved Route.

        -> UPDATE_ASSIGNMENTS when the pipeline is current (the common case); RESOLVE if the
        route is invalidated while awaiting the Spool; ERROR if a peer has no endpoint (its
        member is gone); else SEND_PIPELINE_SYNC.
        """
        assert self.resolved is not None
        route = self.resolved.route
        pln = self.pipeline
        if pln is not None and pln.usable and pln.serves(route):
            self.registers = pln.spool.registers  # (shared, not copied: neither side changes a LabelSet in place)
            return S.UPDATE_ASSIGNMENTS
        self._shut_down_pipeline()
        missing = [
            f"{m.zone}/{m.suffix}" for i, m in enumerate(route.members) if i != route.primary and not route.endpoints[i]
        ]
        if missing:
            return self._fail(
                pb.INSUFFICIENT_JOURNAL_BROKERS, f"peer {', '.join(missing)} has no endpoint (its broker is gone)"
            )
        replica = self.replica
        ok, spool = await acquire(replica.spool_slot, self._invalidated, replica.closed)
        if not ok:
            return S.RESOLVE
        try:
            assert isinstance(spool, Spool)
            self.registers = pb.LabelSet()
            self.registers.CopyFrom(spool.registers)
            streams = self.broker.open_streams(route)
            self.pipeline = Pipeline(self.resolved.header, spool, streams, replica.return_spool, replica.spawn)
        except BaseException:
            replica.return_spool(spool)
            raise
        self._pln_header = True
        metrics.PIPELINE_STARTS.inc()
        return S.SEND_PIPELINE_SYNC

    async def _on_send_pipeline_sync(self) -> AppendState:
        """Propose the current (or rolled) Fragment, Route and registers to every peer.

        -> RECV_PIPELINE_SYNC.
        """
        assert self.resolved is not None and self.resolved.spec is not None and self.pipeline is not None
        pln = self.pipeline
        pln.synchronized = False
        proposal = maybe_roll(pln.spool, self.roll_to_offset, self.resolved.spec.fragment)
        req = pb.ReplicateRequest(proposal=proposal.to_proto(), registers=self.registers, acknowledge=True)
        if self._pln_header:
            req.header.CopyFrom(self.resolved.header)
            self._pln_header = False
        self._acks = await pln.scatter(req)
        return S.RECV_PIPELINE_SYNC

    async def _on_recv_pipeline_sync(self) -> AppendState:
        """Read each peer's answer to the sync proposal (Gazette's `gatherSync`).

        -> RESOLVE if a peer knows a non-equivalent Route at a later revision; SEND_PIPELINE_SYNC
        (rolling forward) if a peer is ahead of us, or at our end with an empty Fragment (it
        cannot extend ours); UPDATE_ASSIGNMENTS when all agree; ERROR on any other answer or a
        failed stream.
        """
        assert self.pipeline is not None and self._acks is not None
        pln = self.pipeline
        closed = asyncio.ensure_future(self.replica.closed.wait())
        waited: list[asyncio.Future[Any]] = [self._acks, closed]
        try:  # a peer that never answers must not hold up the replica's close (Gazette: the replica's context)
            await asyncio.wait(waited, return_when=asyncio.FIRST_COMPLETED)
        finally:
            closed.cancel()
        if not self._acks.done():
            self._shut_down_pipeline()
            return self._fail(pb.OK, "the journal's replica closed while synchronizing")
        acks = self._acks.result()
        end = pln.spool.end
        roll_to, roll_registers, read_through = 0, None, 0
        problems: list[str] = []
        for i, resp in enumerate(acks.responses):
            if resp is None:
                continue
            endpoint = pln.streams[i].endpoint
            if resp.status == pb.OK:
                continue
            if resp.status == pb.WRONG_ROUTE:
                if not routes_equivalent(resp.header.route, pln.route) and (
                    resp.header.etcd.revision > pln.header.etcd.revision
                ):
                    read_through = max(read_through, resp.header.etcd.revision)
                else:
                    problems.append(f"peer {endpoint} answered WRONG_ROUTE at revision {resp.header.etcd.revision}")
            elif resp.status == pb.PROPOSAL_MISMATCH:
                peer_end = resp.fragment.end
                if peer_end > end:  # the peer knows a larger offset: roll forward, taking its registers
                    if peer_end > roll_to:
                        roll_to, roll_registers = peer_end, resp.registers
                elif peer_end == end and resp.fragment.begin == resp.fragment.end:
                    roll_to = max(roll_to, peer_end)  # it rolled to our end: it cannot extend our fragment
                else:
                    problems.append(f"peer {endpoint} is behind: its fragment ends at {peer_end}, ours at {end}")
            else:
                problems.append(f"peer {endpoint} answered {pb.Status.Name(resp.status)}")
        error = acks.error or (problems[0] if problems else None)
        if error is not None:
            self._shut_down_pipeline()
            return self._fail(pb.OK, f"synchronizing replicas failed: {error}")
        if roll_to:
            self.roll_to_offset = roll_to
            if roll_registers is not None:
                self.registers = roll_registers
            metrics.PIPELINE_RESYNCS.inc()
            return S.SEND_PIPELINE_SYNC
        if read_through:
            self._shut_down_pipeline()
            self.read_through_rev = read_through
            return S.RESOLVE
        self.roll_to_offset = 0
        pln.synchronized = True
        self.replica.synchronized.set()  # every member is at our end: recovered content can be checked
        return S.UPDATE_ASSIGNMENTS

    async def _on_update_assignments(self) -> AppendState:
        """Advertise in etcd that the synchronized Route is consistent.

        The write is guarded by the assignments the Route was resolved from (Gazette's
        updateAssignments with `resolved.assignments`), not by the KeySpace's view now: a primary
        whose resolution went stale (the journal moved, and a newer primary may have advertised its
        own Route since) writes nothing, and re-resolves.

        -> AWAIT_DESIRED_REPLICAS if the resolved assignments already carry the Route; else write
        them and -> RESOLVE at etcd's revision of that transaction, applied or not.
        """
        assert self.resolved is not None
        route = self.resolved.route
        assigned = self.resolved.assignments
        if self.resolved.advertised:
            return S.AWAIT_DESIRED_REPLICAS
        try:
            _ok, revision = await advertise_route(self.broker.etcd, assigned, route)
        except TidingsError as exc:
            return self._fail(pb.OK, f"advertising the synchronized route in etcd failed: {exc}")
        # (a transaction that did not apply answers a revision that includes the change that failed it)
        self.read_through_rev = revision
        return S.RESOLVE

    async def _on_await_desired_replicas(self) -> AppendState:
        """Check the Route has exactly the desired replication.

        -> RESOLVE (at the next revision) if over-subscribed: the allocator is about to remove
        a member; ERROR (INSUFFICIENT_JOURNAL_BROKERS) if too few; PROXY if not primary; else
        VALIDATE_PRECONDITIONS.
        """
        assert self.resolved is not None and self.resolved.spec is not None
        members = len(self.resolved.route.members)
        desired = desired_replication(self.resolved.spec)
        if members > desired:
            self.read_through_rev = self.resolved.header.etcd.revision + 1
            return S.RESOLVE
        if members < desired:
            if asyncio.get_running_loop().time() < self._resuming_until:
                # This append resumed the journal: its replicas are on their way (the allocator adds them).
                self.read_through_rev = self.resolved.header.etcd.revision + 1
                return S.RESOLVE
            if members == 0 or self.resolved.route.primary < 0:
                return self._fail(pb.NO_JOURNAL_PRIMARY_BROKER)
            return self._fail(pb.INSUFFICIENT_JOURNAL_BROKERS)
        if not self.resolved.is_primary:
            if self.resolved.route.primary < 0:
                return self._fail(pb.NO_JOURNAL_PRIMARY_BROKER)
            return S.PROXY
        return S.VALIDATE_PRECONDITIONS

    async def _on_validate_preconditions(self) -> AppendState:
        """Check the fragment store, registers and the append offset against the request.

        Appends always land at the furthest known journal extent: usually the synchronized spool's
        end. If the fragment index knows a larger offset, journal consistency was lost (brokers
        partitioned from etcd may hold unpersisted fragments there); rather than risk writing an
        offset twice we refuse with INDEX_HAS_GREATER_OFFSET until an operator names the new
        offset (reset-head), which re-synchronizes the pipeline there. A journal that is not
        writable may still take zero-byte transaction barriers. When the spool holds the journal's
        first known write it is rolled at this append, so that fragment is persisted promptly and
        a recovering broker sees a dirty index instead of mistaking the journal for a new one.

        A spool behind the journal's recorded resume offset (`spec.suspend.offset`, written by the
        journal's last brokers when they stopped with everything persisted) rolls forward to it; the
        offset is cleared before the first append that may go past it (not by a pulse at exactly it).

        Stores (see the module docstring): wait for the journal's first store listing; after it, refuse
        while the latest listing of the primary store failed.

        -> RESOLVE if the route changes while awaiting the first store listing; ERROR on a failed
        check (FRAGMENT_STORE_UNHEALTHY, REGISTER_MISMATCH, WRONG_APPEND_OFFSET,
        INDEX_HAS_GREATER_OFFSET); SEND_PIPELINE_SYNC to re-sync at a resume or reset-head offset;
        else STREAM_CONTENT.
        """
        assert self.resolved is not None and self.resolved.spec is not None
        replica = self.replica
        store_error: str | None = None
        if not replica.index.first_refresh:  # the first listing (of every store): the journal's extent
            ready = asyncio.ensure_future(replica.wait_ready())
            inval = asyncio.ensure_future(self._invalidated.wait())
            try:
                done, _ = await asyncio.wait([ready, inval], return_when=asyncio.FIRST_COMPLETED)
            finally:
                inval.cancel()
                ready.cancel()  # no-op once done
            if ready not in done:
                return S.RESOLVE
            store_error = ready.result()
        else:  # then the health of the primary store, where what we accept must persist
            store_error = replica.primary_store_error()
        if store_error is not None:
            # (the store whose listing failed: the spec may have changed the journal's stores since)
            where = replica.failed_store or "the journal's stores"  # (a listing since may have cleared it)
            return self._fail(pb.FRAGMENT_STORE_UNHEALTHY, f"listing {where}: {store_error}")
        spool = self.spool
        req = self.req
        if req.check_registers.include.labels or req.check_registers.exclude.labels:
            if not labels.registers_match(req.check_registers, self.registers):
                return self._fail(pb.REGISTER_MISMATCH)
        suspend = self.resolved.spec.suspend
        resume, level = suspend.offset, suspend.level
        if spool.end < resume:
            self.roll_to_offset = resume  # where the last holders left the journal
            return S.SEND_PIPELINE_SYNC
        if level == NONE and resume and (spool.end > resume or not self.pulse):
            # Resumed: the offset has served, and a stale one must not linger (every replica lost before the
            # next append, a new primary would roll to it and write over what was appended there). A pulse
            # at exactly the offset leaves it: brokers stopping together record it while the primary pulses.
            self.next_suspend = None
            return S.UPDATE_SUSPEND
        index_min, index_max = replica.index.begin_offset, replica.index.end_offset
        max_offset = max(spool.end, index_max)
        writable = self.resolved.spec.flags != pb.JournalSpec.O_RDONLY
        expected = req.offset != 0 or req.HasField("offset")  # (an explicit 0: the journal must be empty)
        if spool.end != max_offset and not expected and writable:
            return self._fail(
                pb.INDEX_HAS_GREATER_OFFSET,
                f"the fragment index ends at {index_max}, past the synchronized write head {spool.end}",
            )
        if expected and req.offset != max_offset:
            return self._fail(pb.WRONG_APPEND_OFFSET, f"the write head is {max_offset}, not {req.offset}")
        if expected and spool.end != max_offset:
            self.roll_to_offset = max_offset  # the operator's explicit reset-head
            return S.SEND_PIPELINE_SYNC
        suspending = self._suspension(level, index_min == index_max)
        if suspending is not None:
            return suspending
        if spool.fragment.begin == index_min and spool.end:
            self.roll_to_offset = spool.end
        return S.STREAM_CONTENT

    def _suspension(self, level: int, empty: bool) -> AppendState | None:
        """The request's suspension control against the journal's level (Gazette's), once the pipeline
        is synchronized and the offsets check out; None to go on and commit (a zero-byte suspend
        request that found the journal already partially suspended answers SUSPENDED once committed).

        A RESUME (every client append) of a suspended journal clears its suspension (the spool is at
        its offset already) and its replicas come back; NO_RESUME (the pulse) fails SUSPENDED.
        IF_FLUSHED and NOW suspend: fully when the journal holds nothing (no replicas, no pipeline, no
        pulse), else partially (one replica, which rolls its spool now so the last fragment persists),
        for IF_FLUSHED only when every fragment is persisted and the last is older than the journal's
        flush interval (24 hours without one), the sign of an idle journal.
        """
        mode = self.req.suspend
        if level != NONE and mode == pb.AppendRequest.SUSPEND_RESUME:
            self.next_suspend = None
            return S.UPDATE_SUSPEND
        if level != NONE and mode == pb.AppendRequest.SUSPEND_NO_RESUME:
            return self._fail(pb.SUSPENDED)
        if mode not in (pb.AppendRequest.SUSPEND_IF_FLUSHED, pb.AppendRequest.SUSPEND_NOW):
            return None
        assert self.resolved is not None and self.resolved.spec is not None
        spool = self.spool
        # Fully only when it surely holds nothing: no content in its index or spool, no recovered content
        # still being checked (not yet in the index), and no write head but the one its spec records.
        if (
            level != FULL
            and empty
            and not spool.fragment.content_length
            and not self.replica.unverified
            and spool.end in (0, self.resolved.spec.suspend.offset)
        ):
            self.next_suspend = pb.JournalSpec.Suspend(level=FULL, offset=spool.end)
            return S.UPDATE_SUSPEND
        if level == NONE:
            flush = self.resolved.spec.fragment.flush_interval_ms / 1000 or IDLE_WITHOUT_FLUSH_INTERVAL
            last = self.replica.index.last_mod_time
            idle = last > 0 and last <= time.time() - flush
            if idle or mode == pb.AppendRequest.SUSPEND_NOW:
                self.next_suspend = pb.JournalSpec.Suspend(level=PARTIAL, offset=spool.end)
                self.roll_to_offset = spool.end  # the next commit completes the spool's fragment: it persists
                return S.UPDATE_SUSPEND
        self.suspended = level == PARTIAL
        return None

    async def _on_update_suspend(self) -> AppendState:
        """Write the journal's suspension (`next_suspend`, None clears it) into its spec, guarded by the
        spec's revision (Gazette's stateUpdateSuspend). Clearing: a resume offset is cleared once the
        spool has reached it, as left in place it would roll a later primary forward to a stale offset
        after every replica of the journal was lost.

        -> RESOLVE at the revision of the write (or the next one, if it lost a race).
        """
        assert self.resolved is not None and self.resolved.spec is not None
        item = self.broker.resolver.state.items.get(self.journal)
        if item is None:
            return S.RESOLVE
        spec = pb.JournalSpec()
        spec.CopyFrom(item.spec)
        if self.next_suspend is None or self.next_suspend == pb.JournalSpec.Suspend():
            spec.ClearField("suspend")
        else:
            spec.suspend.CopyFrom(self.next_suspend)
        if item.spec.suspend.level != NONE and spec.suspend.level == NONE:
            self._resuming_until = asyncio.get_running_loop().time() + RESUME_WAIT
        if self.next_suspend is not None and self.next_suspend.level != NONE:
            log.info("journal %s: suspension %s at offset %d", self.journal,
                     pb.JournalSpec.Suspend.Level.Name(self.next_suspend.level), self.next_suspend.offset)  # fmt: skip
        key = keys.item_key(self.broker.config.root, self.journal)
        try:
            ok, revision = await self.broker.etcd.txn(
                [mod_revision_is(key, item.mod_revision)], [put_op(key, spec.SerializeToString())]
            )
        except TidingsError as exc:
            return self._fail(pb.OK, f"updating the journal's suspension in etcd failed: {exc}")
        self.read_through_rev = revision if ok else self.broker.keyspace.revision + 1
        return S.RESOLVE

    async def on_stream_content(self, msg: pb.AppendRequest | BaseException | None) -> None:
        """Handle one client message: forward content; on end-of-stream commit, else roll back.

        The first call may roll to a new Fragment (see `maybe_roll`). Each chunk is held until
        the next message arrives, so the last one travels to the peers in the same
        ReplicateRequest as the commit proposal: one message and one acknowledgement per peer
        for a small append. A failed send to any peer sends the roll-back at once (never a commit
        on a subset). -> STREAM_CONTENT after content; READ_ACKNOWLEDGEMENTS once the commit or
        roll-back proposal is out.
        """
        assert self.state is S.STREAM_CONTENT and self.pipeline is not None and self.resolved is not None
        assert self.resolved.spec is not None
        pln = self.pipeline
        spool = pln.spool
        if not self._started:
            self._started = True
            proposal = maybe_roll(spool, self.roll_to_offset, self.resolved.spec.fragment)
            if proposal != spool.fragment:
                self._sent = True
                await pln.scatter(pb.ReplicateRequest(proposal=proposal.to_proto(), registers=self.registers))
            self._begin = spool.end
        if isinstance(msg, BaseException) or (msg is None and not self._commit_requested):
            reason = str(msg) if isinstance(msg, BaseException) else "client closed the stream without committing"
            await self._send_rollback(reason)
        elif msg is None:
            await self._send_commit()
        elif self._commit_requested:
            await self._send_rollback("content after the commit chunk", grpc.StatusCode.INVALID_ARGUMENT)
        elif not msg.content:
            self._commit_requested = True
        elif self.resolved.spec.flags == pb.JournalSpec.O_RDONLY:
            self.status = pb.NOT_ALLOWED
            await self._send_rollback("journal is read-only")
        elif self.req.suspend != pb.AppendRequest.SUSPEND_RESUME:
            self.client_error = ValidationError("append.suspend", "an append controlling suspension carries no content")
            await self._send_rollback(str(self.client_error), grpc.StatusCode.INVALID_ARGUMENT)
        else:
            if self._held is not None:
                self._sent = True
                await pln.scatter(self._forward_held())
                if pln.send_error() is not None:
                    await self._send_rollback(f"replication failed: {pln.send_error()}")
                    return
            self._held = msg.content

    def _forward_held(self) -> pb.ReplicateRequest:
        """The held chunk as a ReplicateRequest (the pipeline applies it to our spool too)."""
        content, self._held = self._held, None
        assert content is not None
        req = pb.ReplicateRequest(content=content, content_delta=self._length)
        self._summer.update(content)
        self._length += len(content)
        return req

    async def _send_commit(self) -> None:
        final = self._forward_held() if self._held is not None else pb.ReplicateRequest()
        if self._length == 0 and (self.req.union_registers.labels or self.req.subtract_registers.labels):
            reason = "a register change needs at least one appended byte"
            await self._send_rollback(reason, grpc.StatusCode.INVALID_ARGUMENT)
            return
        assert self.pipeline is not None
        spool = self.spool
        if self.pipeline.send_error() is not None:
            await self._send_rollback(f"replication failed: {self.pipeline.send_error()}")
            return
        if self._length:
            self.registers = apply_registers(self.registers, self.req.union_registers, self.req.subtract_registers)
        proposal = spool.next_fragment(final.content)  # the held chunk is applied first, in the same request
        self.commit = pb.Fragment(
            journal=self.journal,
            begin=self._begin,
            end=self._begin + self._length,
            sum=self._summer.digest() if self._length else EMPTY_SUM,
            compression_codec=proposal.codec,
        )
        await self._send_final(final, proposal)

    async def _send_rollback(self, reason: str, code: grpc.StatusCode | None = None) -> None:
        self._held = None  # never forwarded: the peers do not have it
        self._rolled_back = True
        if self.status == pb.OK:
            self.error = reason
            invalid = isinstance(self.client_error, ValidationError)
            self.error_code = code or (grpc.StatusCode.INVALID_ARGUMENT if invalid else grpc.StatusCode.ABORTED)
        spool = self.spool
        await self._send_final(pb.ReplicateRequest(), spool.fragment, rollback=True)

    async def _send_final(self, req: pb.ReplicateRequest, proposal: Fragment, rollback: bool = False) -> None:
        """Send the acknowledged proposal, then give up the send side (Gazette's
        stateReadAcknowledgements): a pipeline with a failed send is shut down instead."""
        assert self.pipeline is not None
        pln = self.pipeline
        req.proposal.CopyFrom(proposal.to_proto())
        req.registers.CopyFrom(self.registers)
        req.acknowledge = True
        self._sent = True
        self._acks = pln.send_nowait(req, require_ok=True)
        self._final_sent = True  # (out to every peer: a cancellation of the drain changes nothing)
        if rollback:
            metrics.ROLLBACKS.inc()  # (counted once sent, before the drain: a cancellation there ends no other way)
        await pln.drain()
        if pln.send_error() is not None:
            self._shut_down_pipeline()
        self._release_pipeline()
        self.state = S.READ_ACKNOWLEDGEMENTS

    async def _on_read_acknowledgements(self) -> AppendState:
        """Wait for every peer's acknowledgement of our proposal (read for us, in order, by the pipeline).

        -> FINISHED once all peers acknowledge; ERROR if this append was rolled back or a peer
        failed (a failed pipeline is rebuilt by its next owner). Cancelled while waiting, the append
        still counts as a commit once they all acknowledge it.
        """
        assert self._acks is not None
        try:  # (shielded: the pipeline still reads them for us if we are cancelled)
            acks = await asyncio.shield(self._acks)
        except asyncio.CancelledError:
            self._count_when_acknowledged()  # our proposal is out to every peer: it commits or not all the same
            raise
        if self._rolled_back:
            return S.ERROR
        if acks.error is not None:
            self.commit = None
            return self._fail(pb.OK, f"replication failed: {acks.error}")
        self._count_commit()
        return S.FINISHED

    def _count_commit(self) -> None:
        """Count this append (or pulse) committed: every peer acknowledged its commit proposal."""
        if self.pulse:
            metrics.PULSES.inc()
            return
        metrics.COMMITS.inc()
        metrics.APPENDED_BYTES.inc(self._length)
        metrics.APPEND_SECONDS.observe(time.monotonic() - self._born)
        if self.broker.config.metrics_journals:
            metrics.JOURNAL_COMMITS.labels(self.journal).inc()
            metrics.JOURNAL_APPENDED_BYTES.labels(self.journal).inc(self._length)

    def _count_when_acknowledged(self) -> None:
        """A commit proposal abandoned once it was out (cancelled while it drained, or while awaiting
        its acknowledgements) still commits if every peer acknowledges it: count it then, as
        READ_ACKNOWLEDGEMENTS would have (a roll-back was counted when sent)."""
        acks = self._acks
        if self._rolled_back or acks is None:
            return

        def counted(fut: asyncio.Future[Acknowledgements]) -> None:
            if not fut.cancelled() and fut.result().error is None:
                self._count_commit()

        acks.add_done_callback(counted)


# One method per state: the driver's table, built once rather than per append (a test may give an
# instance a table of its own).
AppendFSM._handlers = {
    S.RESOLVE: AppendFSM._on_resolve,
    S.ACQUIRE_PIPELINE: AppendFSM._on_acquire_pipeline,
    S.START_PIPELINE: AppendFSM._on_start_pipeline,
    S.SEND_PIPELINE_SYNC: AppendFSM._on_send_pipeline_sync,
    S.RECV_PIPELINE_SYNC: AppendFSM._on_recv_pipeline_sync,
    S.UPDATE_ASSIGNMENTS: AppendFSM._on_update_assignments,
    S.AWAIT_DESIRED_REPLICAS: AppendFSM._on_await_desired_replicas,
    S.VALIDATE_PRECONDITIONS: AppendFSM._on_validate_preconditions,
    S.UPDATE_SUSPEND: AppendFSM._on_update_suspend,
    S.READ_ACKNOWLEDGEMENTS: AppendFSM._on_read_acknowledgements,
}
