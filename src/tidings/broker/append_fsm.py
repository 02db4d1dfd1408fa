"""The append state machine (gazette-transactional-appends.txt, *Append State Machine*).

Every Append RPC, and every pulse, traverses these states; each has one `_on_<state>` method
that returns the next state, and only the driver (`run_to`) assigns `self.state`.

Terminal states: ERROR, PROXY, FINISHED. STREAM_CONTENT is semi-terminal: it is driven once per
client message by `on_stream_content` until the commit (or roll-back) proposal is sent.

Expected refusals set `self.status` (REGISTER_MISMATCH, WRONG_APPEND_OFFSET, ...); surprises set
`self.error`. Only `append_api.py` turns the end state into a response.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from tidings.allocator.converge import advertise_consistency
from tidings.allocator.state import routes_equivalent
from tidings.broker import _metrics as metrics
from tidings.broker.pipeline import Pipeline, PipelineError
from tidings.broker.replica import Replica, acquire, cancel_and_wait
from tidings.broker.resolver import Resolution
from tidings.fragment.fragment import Fragment
from tidings.fragment.spool import Spool, apply_registers
from tidings.protocol import labels
from tidings.protocol import protocol_pb2 as pb

if TYPE_CHECKING:
    from tidings.broker.service import Broker

log = logging.getLogger(__name__)


class AppendState(enum.Enum):
    RESOLVE = "resolve"
    ACQUIRE_PIPELINE = "acquire_pipeline"
    START_PIPELINE = "start_pipeline"
    SEND_PIPELINE_SYNC = "send_pipeline_sync"
    RECV_PIPELINE_SYNC = "recv_pipeline_sync"
    UPDATE_ASSIGNMENTS = "update_assignments"
    AWAIT_DESIRED_REPLICAS = "await_desired_replicas"
    VALIDATE_PRECONDITIONS = "validate_preconditions"
    STREAM_CONTENT = "stream_content"  # semi-terminal
    READ_ACKNOWLEDGEMENTS = "read_acknowledgements"
    ERROR = "error"  # terminal
    PROXY = "proxy"  # terminal
    FINISHED = "finished"  # terminal


S = AppendState
TERMINAL = frozenset({S.ERROR, S.PROXY, S.FINISHED})


class AppendFSM:
    """Drives one AppendRequest (the first message of an Append RPC) through the states."""

    def __init__(self, broker: Broker, req: pb.AppendRequest) -> None:
        self.broker = broker
        self.req = req
        self.journal = req.journal
        self.state = S.RESOLVE
        self.status = pb.OK
        self.error: str | None = None
        self.client_error: Exception | None = None  # why the client's stream failed, if it did
        self.resolved: Resolution | None = None
        self.read_through_rev = req.header.etcd.revision if req.HasField("header") else 0
        self.pipeline: Pipeline | None = None
        self.owns_pipeline = False
        self.roll_to_offset = 0
        self.commit: pb.Fragment | None = None  # this append's span
        self.registers = pb.LabelSet()
        self._begin = 0  # where this append's content starts
        self._started = False
        self._commit_requested = False
        self._rolled_back = False
        self._held: bytes | None = None  # the latest chunk, forwarded with the next message
        self._close_after: asyncio.Future[None] | None = None
        self._wait_for: asyncio.Future[None] | None = None
        self._handlers: dict[AppendState, Callable[[], Awaitable[AppendState]]] = {
            S.RESOLVE: self._on_resolve,
            S.ACQUIRE_PIPELINE: self._on_acquire_pipeline,
            S.START_PIPELINE: self._on_start_pipeline,
            S.SEND_PIPELINE_SYNC: self._on_send_pipeline_sync,
            S.RECV_PIPELINE_SYNC: self._on_recv_pipeline_sync,
            S.UPDATE_ASSIGNMENTS: self._on_update_assignments,
            S.AWAIT_DESIRED_REPLICAS: self._on_await_desired_replicas,
            S.VALIDATE_PRECONDITIONS: self._on_validate_preconditions,
            S.READ_ACKNOWLEDGEMENTS: self._on_read_acknowledgements,
        }

    # -- driver ----------------------------------------------------------------------------

    async def run_to(self, *stop_at: AppendState) -> AppendState:
        """Run until a state in `stop_at` or a terminal state; release the pipeline on terminal."""
        stops = TERMINAL.union(stop_at)
        try:
            while self.state not in stops:
                before = self.state
                self.state = await self._handlers[self.state]()
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
                    raise
                except Exception as exc:
                    self.client_error = msg = exc
                await self._on_client_message(msg)
        except BaseException:  # cancelled (client gone, server stopping): give the pipeline back
            self.abort()
            raise
        return await self.run_to()

    async def _on_client_message(self, msg: pb.AppendRequest | BaseException | None) -> None:
        """A client message is its content chunk, then (with `commit`) the empty chunk that commits."""
        if isinstance(msg, pb.AppendRequest) and msg.commit:
            if msg.content:
                await self.on_stream_content(pb.AppendRequest(content=msg.content))
            if self.state is S.STREAM_CONTENT:
                await self.on_stream_content(pb.AppendRequest())
        else:
            await self.on_stream_content(msg)

    def abort(self) -> None:
        """Cancelled mid-flight: the pipeline may hold partial content, so mark it for rebuild."""
        if self.owns_pipeline and self.pipeline is not None and self.state is S.STREAM_CONTENT:
            self.pipeline.broken = "append aborted mid-stream"
        if self._close_after is not None and not self._close_after.done():
            self._close_after.set_result(None)
        self._release_pipeline()

    def _release_pipeline(self) -> None:
        if self.owns_pipeline and self.resolved is not None and self.resolved.replica is not None:
            self.owns_pipeline = False
            self.resolved.replica.pipeline_slot.put_nowait(self.pipeline)

    @property
    def replica(self) -> Replica:
        assert self.resolved is not None and self.resolved.replica is not None
        return self.resolved.replica

    @property
    def spool(self) -> Spool:
        assert self.pipeline is not None
        return self.pipeline.spool

    def _fail(self, status: int, error: str | None = None) -> AppendState:
        self.status = status
        self.error = error
        return S.ERROR

    # -- states ----------------------------------------------------------------------------

    async def _on_resolve(self) -> AppendState:
        """Resolve (or re-resolve) the journal, first reading through any later etcd revision.

        -> AWAIT_DESIRED_REPLICAS if not primary; START_PIPELINE if the pipeline is already
        owned; else ACQUIRE_PIPELINE.
        """
        rev, self.read_through_rev = self.read_through_rev, 0
        res = self.resolved = await self.broker.resolver.resolve(self.journal, rev)
        if res.status != pb.OK:
            return self._fail(res.status)
        if not res.is_primary:
            if self.owns_pipeline:
                self._release_pipeline()
                self.pipeline = None
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
        return S.START_PIPELINE

    async def _on_start_pipeline(self) -> AppendState:
        """Build the pipeline unless it already matches the resolved Route.

        -> UPDATE_ASSIGNMENTS when the pipeline is current (the common case); RESOLVE if the
        route is invalidated while awaiting the Spool; else SEND_PIPELINE_SYNC.
        """
        assert self.resolved is not None
        route = self.resolved.route
        pln = self.pipeline
        if pln is not None and not pln.broken and routes_equivalent(pln.route, route):
            return S.UPDATE_ASSIGNMENTS
        replica = self.replica
        if pln is not None:
            replica.spool_slot.put_nowait(await pln.close())
            self.pipeline = None
        ok, spool = await acquire(replica.spool_slot, self._invalidated, replica.closed)
        if not ok:
            return S.RESOLVE
        try:
            await self._wait_or_invalidated(replica.index.wait_first_refresh())
        except BaseException:
            replica.spool_slot.put_nowait(spool)
            raise
        if self._invalidated.is_set():
            replica.spool_slot.put_nowait(spool)
            return S.RESOLVE
        assert isinstance(spool, Spool)
        end = replica.index.end_offset
        if end > spool.end and spool.delta == 0:
            # The index knows of a later offset (e.g. a new replica over a populated store).
            spool.roll_to(end, self.resolved.spec.fragment.compression_codec)
        self.pipeline = Pipeline(self.resolved.header, spool, self.broker.channels_for(route))
        metrics.PIPELINE_STARTS.inc()
        return S.SEND_PIPELINE_SYNC

    async def _on_send_pipeline_sync(self) -> AppendState:
        """Propose the current Fragment, Route and registers to every peer. -> RECV_PIPELINE_SYNC."""
        assert self.resolved is not None
        spool = self.spool
        await self.pipeline.scatter(  # type: ignore[union-attr]
            pb.ReplicateRequest(
                header=self.resolved.header,
                proposal=spool.fragment.to_proto(),
                registers=spool.registers,
                acknowledge=True,
            )
        )
        return S.RECV_PIPELINE_SYNC

    async def _on_recv_pipeline_sync(self) -> AppendState:
        """Read each peer's answer to the sync proposal.

        -> RESOLVE if a peer knows a later Route; SEND_PIPELINE_SYNC (after rolling to a new
        Fragment at the largest known end) if a peer is ahead or cannot continue our Fragment;
        UPDATE_ASSIGNMENTS when all agree.
        """
        assert self.resolved is not None and self.pipeline is not None
        try:
            responses = await self.pipeline.gather()
        except PipelineError as exc:
            return self._fail(pb.OK, f"pipeline sync failed: {exc}")
        later = [r.header.etcd.revision for r in responses if r.status == pb.WRONG_ROUTE]
        if later:
            self.pipeline.broken = "a peer disagrees on the route"
            self.read_through_rev = max(max(later), self.resolved.header.etcd.revision + 1)
            return S.RESOLVE
        mismatched = [r for r in responses if r.status == pb.PROPOSAL_MISMATCH]
        if any(r.status not in (pb.OK, pb.PROPOSAL_MISMATCH, pb.WRONG_ROUTE) for r in responses):
            self.pipeline.broken = "unexpected sync response"
            return self._fail(pb.OK, "unexpected pipeline sync response")
        if not mismatched:
            return S.UPDATE_ASSIGNMENTS
        spool = self.spool
        ahead = max(mismatched, key=lambda r: r.fragment.end)
        end = max(spool.end, ahead.fragment.end)
        registers = ahead.registers if ahead.fragment.end > spool.end else spool.registers
        spool.roll_to(end, self.resolved.spec.fragment.compression_codec)
        spool.registers = registers
        metrics.PIPELINE_RESYNCS.inc()
        return S.SEND_PIPELINE_SYNC

    async def _on_update_assignments(self) -> AppendState:
        """Advertise in etcd that the synchronized Route is consistent.

        -> AWAIT_DESIRED_REPLICAS if assignments already carry the Route; else write them and
        -> RESOLVE at the revision of that write.
        """
        assert self.resolved is not None
        state = self.broker.resolver.state
        route = self.resolved.route
        current = state.assignments.get(self.journal, [])
        if current and all(routes_equivalent(a.value, route) for a in current):
            return S.AWAIT_DESIRED_REPLICAS
        ok, revision = await advertise_consistency(self.broker.etcd, state, self.journal, route)
        self.read_through_rev = revision if ok else self.broker.keyspace.revision + 1
        return S.RESOLVE

    async def _on_await_desired_replicas(self) -> AppendState:
        """Check the Route has exactly the desired replication.

        -> RESOLVE (at the next revision) if over-subscribed: the allocator is about to remove
        a member; ERROR (INSUFFICIENT_JOURNAL_BROKERS) if too few; PROXY if not primary; else
        VALIDATE_PRECONDITIONS.
        """
        assert self.resolved is not None and self.resolved.spec is not None
        members = len(self.resolved.route.members)
        desired = self.resolved.spec.replication
        if members > desired:
            self.read_through_rev = self.resolved.header.etcd.revision + 1
            return S.RESOLVE
        if members < desired:
            if members == 0 or self.resolved.route.primary < 0:
                return self._fail(pb.NO_JOURNAL_PRIMARY_BROKER)
            return self._fail(pb.INSUFFICIENT_JOURNAL_BROKERS)
        if not self.resolved.is_primary:
            if self.resolved.route.primary < 0:
                return self._fail(pb.NO_JOURNAL_PRIMARY_BROKER)
            return S.PROXY
        return S.VALIDATE_PRECONDITIONS

    async def _on_validate_preconditions(self) -> AppendState:
        """Check registers and the append offset against the request's expectations.

        Appends always land at the furthest known journal extent. If the fragment index knows a
        larger offset than the pipeline's spool, journal consistency was lost (other brokers may
        hold unpersisted fragments there); rather than risk writing an offset twice we refuse
        with INDEX_HAS_GREATER_OFFSET until an operator names the new offset (reset-head).
        A journal that is not writable may still take zero-byte transaction barriers.

        -> RESOLVE if the route changes while awaiting the index; ERROR on a failed check;
        else STREAM_CONTENT.
        """
        assert self.resolved is not None and self.resolved.spec is not None
        replica = self.replica
        if not replica.index.first_refresh:
            await self._wait_or_invalidated(replica.index.wait_first_refresh())
        if self._invalidated.is_set():
            return S.RESOLVE
        spool = self.spool
        req = self.req
        if req.check_registers.include.labels or req.check_registers.exclude.labels:
            if not labels.registers_match(req.check_registers, spool.registers):
                self.registers = spool.registers
                return self._fail(pb.REGISTER_MISMATCH)
        index_end = replica.index.end_offset
        writable = self.resolved.spec.flags != pb.JournalSpec.O_RDONLY
        if req.offset and req.offset != spool.end:
            if req.offset == index_end and index_end > spool.end:
                self.roll_to_offset = index_end  # the operator's explicit reset-head
            else:
                return self._fail(pb.WRONG_APPEND_OFFSET, f"write head is {spool.end}, not {req.offset}")
        elif index_end > spool.end and writable:
            return self._fail(pb.INDEX_HAS_GREATER_OFFSET, f"index end {index_end} > write head {spool.end}")
        return S.STREAM_CONTENT

    async def on_stream_content(self, msg: pb.AppendRequest | BaseException | None) -> None:
        """Handle one client message: forward content; on end-of-stream commit, else roll back.

        The first call may roll to a new Fragment (target length reached, codec changed, flush
        interval elapsed, or an explicit reset-head offset). Each chunk is held until the next
        message arrives, so the last one travels to the peers in the same ReplicateRequest as
        the commit proposal: one message and one acknowledgement per peer for a small append.
        -> STREAM_CONTENT after content; READ_ACKNOWLEDGEMENTS once the commit or roll-back
        proposal is out.
        """
        assert self.state is S.STREAM_CONTENT and self.pipeline is not None and self.resolved is not None
        spool = self.spool
        if not self._started:
            self._started = True
            await self._maybe_roll(spool)
            self._begin = spool.end
        if isinstance(msg, BaseException) or (msg is None and not self._commit_requested):
            reason = str(msg) if isinstance(msg, BaseException) else "client closed the stream without committing"
            await self._send_rollback(spool, reason)
            return
        if msg is None:
            await self._send_commit(spool)
            return
        if not msg.content:
            self._commit_requested = True
            return
        if self._commit_requested:
            await self._send_rollback(spool, "content after the commit chunk")
            return
        if self.resolved.spec.flags == pb.JournalSpec.O_RDONLY:
            self.status = pb.NOT_ALLOWED
            await self._send_rollback(spool, "journal is read-only")
            return
        if self._held is not None:
            await self.pipeline.scatter(self._forward_held(spool))
        self._held = msg.content

    def _forward_held(self, spool: Spool) -> pb.ReplicateRequest:
        """The held chunk as a ReplicateRequest, applied to our own spool too."""
        content, self._held = self._held, None
        req = pb.ReplicateRequest(content=content, content_delta=spool.delta)
        spool.apply_content(content, spool.delta)  # type: ignore[arg-type]
        return req

    async def _maybe_roll(self, spool: Spool) -> None:
        assert self.resolved is not None and self.resolved.spec is not None and self.pipeline is not None
        fspec = self.resolved.spec.fragment
        target = self.roll_to_offset or spool.end
        frag = spool.fragment
        flush_due = (
            fspec.flush_interval_ms > 0
            and frag.content_length > 0
            and (time.time() - spool.created_at) * 1000 >= fspec.flush_interval_ms
        )
        if (
            self.roll_to_offset
            or frag.content_length >= fspec.length
            or (frag.codec != fspec.compression_codec)
            or flush_due
        ):
            proposal = spool.roll_to(target, fspec.compression_codec)
            await self.pipeline.scatter(
                pb.ReplicateRequest(proposal=proposal.to_proto(), registers=spool.registers, acknowledge=False)
            )

    async def _send_commit(self, spool: Spool) -> None:
        final = self._forward_held(spool) if self._held is not None else pb.ReplicateRequest()
        if spool.delta:
            registers = apply_registers(spool.registers, self.req.union_registers, self.req.subtract_registers)
            proposal = spool.next_fragment()
        else:  # a zero-byte transaction barrier: registers only change with appended bytes
            registers = spool.registers
            proposal = spool.fragment
        appended = spool.delta
        resp = spool.apply_proposal(proposal, registers)
        assert resp.status == pb.OK, "the primary's own commit must apply"
        self.commit = pb.Fragment(journal=self.journal, begin=self._begin, end=self._begin + appended)
        self.registers = registers
        await self._send_final(final, proposal, registers)
        metrics.APPENDED_BYTES.inc(appended)

    async def _send_rollback(self, spool: Spool, reason: str) -> None:
        self._held = None  # never forwarded: the peers do not have it
        spool.rollback()
        self._rolled_back = True
        self.error = None if self.status != pb.OK else reason
        await self._send_final(pb.ReplicateRequest(), spool.fragment, spool.registers)
        metrics.ROLLBACKS.inc()

    async def _send_final(self, req: pb.ReplicateRequest, proposal: Fragment, registers: pb.LabelSet) -> None:
        """Send the acknowledged proposal, take our place in the barrier, give up the send side."""
        assert self.pipeline is not None
        req.proposal.CopyFrom(proposal.to_proto())
        req.registers.CopyFrom(registers)
        req.acknowledge = True
        await self.pipeline.scatter(req)
        self._wait_for, self._close_after = self.pipeline.barrier()
        self._release_pipeline()
        self.state = S.READ_ACKNOWLEDGEMENTS

    async def _on_read_acknowledgements(self) -> AppendState:
        """Upon our turn in the barrier, read one acknowledgement from every peer.

        -> FINISHED once all peers acknowledge (ERROR if this append was rolled back or a
        peer failed; a failed pipeline is rebuilt by its next owner).
        """
        assert self.pipeline is not None and self._wait_for is not None and self._close_after is not None
        try:
            await asyncio.shield(self._wait_for)
            await self.pipeline.gather_ok()
        except PipelineError as exc:
            self.commit = None
            return self._fail(self.status, f"replication failed: {exc}")
        finally:
            if not self._close_after.done():
                self._close_after.set_result(None)
        if self._rolled_back:
            return S.ERROR
        metrics.COMMITS.inc()
        return S.FINISHED

    # -- helpers ---------------------------------------------------------------------------

    async def _wait_or_invalidated(self, aw: Awaitable[None]) -> None:
        task = asyncio.ensure_future(aw)
        inval = asyncio.ensure_future(self._invalidated.wait())
        try:
            await asyncio.wait([task, inval], return_when=asyncio.FIRST_COMPLETED)
        finally:
            await cancel_and_wait(task, inval)
