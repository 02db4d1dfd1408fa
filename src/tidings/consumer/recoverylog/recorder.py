"""The Recorder (Gazette's recorder.go): the file operations of a store's directory, recorded in order
to the shard's recovery log as they happen, each sequenced and checksummed by the recorder's FSM.

A recorder records only what already happened to its files; an operation that makes no sense (an
unlink of a path it never saw) is a bug of its caller, raised as RecorderError (crash-only: the
shard fails rather than record a history no player could follow). Paths are relative to the
store's directory, so a log plays back wherever its replica lives.

Operations are framed into a buffer and appended in batches of whole operations (an append the fence
refuses never leaves half an operation) through the recorder's own AppendService, which checks the
log's `author` register on every append: once a newer primary's handoff moved the register, every
append of this recorder is refused (REGISTER_MISMATCH) and `barrier()` raises RecorderFencedError,
so a zombie lands nothing after the handoff (DESIGN.md invariant 10). A retried append may land an
operation twice; players skip the duplicate (its sequence number is behind the FSM's).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Iterator

from tidings.client import AppendResult, AppendService, EarlierAppendFailedError
from tidings.consumer.recoverylog import _metrics as metrics
from tidings.consumer.recoverylog.fsm import FSM, FSMError
from tidings.consumer.recoverylog.ops import MAX_WRITE_OP, fence, frame
from tidings.consumer.store import FenceError
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.status import RegisterMismatchError

__all__ = ["APPEND_BYTES", "Recorder", "RecorderError", "RecorderFencedError", "RecorderStatistics"]

APPEND_BYTES = 1 << 20  # recorded bytes buffered before they are handed to the AppendService


class RecorderError(Exception):
    """An operation the recorder cannot record (its caller's bug): the shard must fail."""


class RecorderFencedError(FenceError):
    """A newer primary took the recovery log over: this recorder (and its shard's primary) must stop."""


@dataclasses.dataclass(frozen=True, slots=True)
class RecorderStatistics:
    ops: int
    bytes: int
    write_head: int  # a lower bound of where the next operation lands in the log


class Recorder:
    """Records operations to `log` as `author`, continuing `fsm` (the FSM a player built, after the
    handoff that gave `author` the log, whose commit ended at `write_head`)."""

    def __init__(self, service: AppendService, log: str, fsm: FSM, author: int, write_head: int) -> None:
        self.log, self.author, self.fsm = log, author, fsm
        self.write_head = write_head
        self._service = service
        service.expect(log, pb.LabelSelector(include=fence(author)))
        self._pending = bytearray()
        self._last: asyncio.Future[AppendResult] | None = None
        self._ops = self._bytes = 0
        self._recorded_ops, self._recorded_bytes = metrics.RECORDED_OPS.labels(log), metrics.RECORDED_BYTES.labels(log)
        self.hints_due = asyncio.Event()  # set when the log's live part moved on (a rollover): hints are due
        self._depth = 0  # nesting of operations that must land in one append (a rename's three ops)

    # -- operations ----------------------------------------------------------------------------

    def fnode(self, path: str) -> int | None:
        """The fnode `path` is a link of, if any."""
        return self.fsm.links.get(path)

    @contextlib.contextmanager
    def together(self) -> Iterator[None]:
        """The ops recorded inside go to the log in one append (the buffer is handed over only after
        the outermost call): a log cut between them, a crash or a fence, never splits a rename (or what
        a caller groups)."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if not self._depth and len(self._pending) >= APPEND_BYTES:
                self._flush()

    def create(self, path: str) -> int:
        """Record a new file at `path` (an existing one there is unlinked first, in the same append, as
        O_TRUNC makes a file new); its fnode."""
        with self.together():
            if path in self.fsm.links:
                self.unlink(path)
            self._record(pb.RecordedOp(create=pb.RecordedOp.Create(path=path)))
            return self.fsm.links[path]

    def write_at(self, fnode: int, data: bytes | memoryview, offset: int) -> None:
        """Record `data` written to `fnode` at `offset` (split into operations of MAX_WRITE_OP bytes, which
        may go in several appends: a write cut short is one a crash could have cut too)."""
        view = memoryview(data)
        for i in range(0, max(len(view), 1), MAX_WRITE_OP):
            with self.together():
                part = view[i : i + MAX_WRITE_OP]
                write = pb.RecordedOp.Write(fnode=fnode, offset=offset + i, length=len(part))
                self._record(pb.RecordedOp(write=write), part)

    def truncate(self, fnode: int, size: int) -> None:
        with self.together():
            self._record(pb.RecordedOp(truncate=pb.RecordedOp.Truncate(fnode=fnode, size=size)))

    def link(self, fnode: int, path: str) -> None:
        with self.together():
            self._record(pb.RecordedOp(link=pb.RecordedOp.Link(fnode=fnode, path=path)))

    def unlink(self, path: str) -> None:
        fnode = self.fsm.links.get(path)
        if fnode is None:
            raise RecorderError(f"recovery log {self.log}: unlink of {path!r}, which the recorder never saw")
        with self.together():
            self._record(pb.RecordedOp(unlink=pb.RecordedOp.Link(fnode=fnode, path=path)))

    def rename(self, src: str, dst: str) -> None:
        """Record `src` renamed to `dst`, replacing a file there: unlink dst, link, unlink src, in one append."""
        fnode = self.fsm.links.get(src)
        if fnode is None:
            raise RecorderError(f"recovery log {self.log}: rename of {src!r}, which the recorder never saw")
        with self.together():
            if dst in self.fsm.links:
                self.unlink(dst)
            self.link(fnode, dst)
            self.unlink(src)

    def _record(self, op: pb.RecordedOp, data: bytes | memoryview = b"") -> None:
        fsm = self.fsm
        kind = op.WhichOneof("op")
        fnode = getattr(op, kind).fnode if kind not in (None, "create") else None
        if fnode is not None and fnode not in fsm.nodes:  # (the FSM would step over it: refuse first)
            raise RecorderError(f"recovery log {self.log}: cannot record a {kind} of fnode {fnode}, which is not live")
        op.seq_no, op.checksum, op.author = fsm.next_seq_no, fsm.next_checksum, self.author
        payload = op.SerializeToString()
        try:
            fsm.apply(op, payload, data, first_offset=self.write_head, log=self.log)
        except FSMError as exc:  # (nothing changed: only FnodeNotTrackedError steps, and it is refused above)
            raise RecorderError(f"recovery log {self.log}: cannot record op {op.seq_no}: {exc}") from None
        framed = frame(payload, data)  # (the message serialized once, for the checksum and the frame)
        self._pending += framed
        self._ops += 1
        self._bytes += len(framed)
        self._recorded_ops.inc()
        self._recorded_bytes.inc(len(framed))

    def _flush(self) -> None:
        if not self._pending:
            return
        fut = self._service.append_nowait(self.log, bytes(self._pending))
        self._pending.clear()
        fut.add_done_callback(self._appended)
        self._last = fut

    def _appended(self, fut: asyncio.Future[AppendResult]) -> None:
        if not fut.cancelled() and fut.exception() is None:
            self.write_head = max(self.write_head, fut.result().end)

    # -- barriers ------------------------------------------------------------------------------

    async def barrier(self) -> None:
        """Wait until every operation recorded so far is committed to the log; RecorderFencedError if
        a newer author holds the log, the append's error if it failed otherwise."""
        self._flush()
        last = self._last
        if last is None:
            return
        try:
            await asyncio.shield(last)
        except (RegisterMismatchError, EarlierAppendFailedError) as exc:
            cause = exc.__cause__ if isinstance(exc, EarlierAppendFailedError) else exc
            if isinstance(cause, RegisterMismatchError):
                raise RecorderFencedError(
                    f"recovery log {self.log}: its author register is no longer {self.author:08x}: a newer "
                    "primary took the log over, so this primary must stop"
                ) from exc
            raise

    async def build_hints(self) -> pb.FSMHints:
        """Hints of the recorded files, returned once every operation they describe is committed."""
        hints = self.fsm.build_hints(self.log)
        await self.barrier()
        return hints

    async def aclose(self) -> None:
        """Stop recording: appends not yet committed are abandoned (a store's commits waited for theirs)."""
        self._pending.clear()
        await self._service.abort()

    def statistics(self) -> RecorderStatistics:
        return RecorderStatistics(self._ops, self._bytes, self.write_head)
