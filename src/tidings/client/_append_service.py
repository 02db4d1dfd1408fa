"""AppendService: asynchronous, batched appends with a future per append (Gazette's AppendService).

Each journal has an ordered queue. `append()` adds content to the journal's open batch and
returns a future; one task per journal takes the open batch whenever its previous append RPC
has finished, so appends made while an RPC is in flight ride together in the next one (many
small appends become few large ones, as gazette-transactional-appends.txt advises). Batches are
committed in the order their appends were made, and each future resolves with the span its own
content got inside the batch's committed span.

A batch stays in memory up to `spill_bytes`, then moves to a temporary file under `spill_dir`
(the seed's "buffer to local disk"). When `buffer_bytes` of content wait in memory and on disk,
`append()` waits for room (back-pressure). A batch is retried until it commits: through
transient statuses, broker restarts and Route changes.

**A definite failure stops the journal.** A refusal (JOURNAL_NOT_FOUND, NOT_ALLOWED,
REGISTER_MISMATCH, INDEX_HAS_GREATER_OFFSET, ...), an invalid request, a spill file that cannot be
read back, a failed dependency, or an outcome that cannot be established (below) fails the batch's
futures with that error. Every append to the journal queued behind it then fails with
`EarlierAppendFailedError` (naming the failed batch and its error) without being written, so no
content ever commits after a hole in the order the caller made its appends. The failure is
sticky: appends made to that journal afterwards fail the same way, because a caller that
publishes without awaiting each future cannot have seen the error yet. Once it has, and has dealt
with it, `resume(journal)` lets appends through again; `failure(journal)` says whether a journal
is stopped. (Gazette keeps such an error for the AppendService's lifetime, as its `errs`; we add
the explicit resume.) Other journals are not affected.

**Dependencies.** `append(journal, content, dependencies=[...])` holds the batch holding this
append until every dependency (a future of this service's `append()`, or any asyncio future, e.g.
a checkpoint's commit) has finished; a dependency that failed or was cancelled fails the append
with `DependencyFailedError`, unwritten (Gazette's `StartAppend(req, dependencies)`). An append
with dependencies starts a new batch; appends without any made after it may join that batch, as
they are ordered after it anyway. A dependency on an earlier append to the same journal is
already met by the journal's order and is dropped. Each wait points at an append made earlier,
and a batch waits only for its own journal's earlier batches and its first append's dependencies,
so waits cannot form a cycle; a waiting batch holds its own journal only. A dependency on one of
this service's futures follows the batch's outcome, so a caller cancelling that future (e.g. a
cancelled `gather`) neither fails nor releases its dependants early.

**An unknown outcome.** A transport failure leaves the outcome unknown (the primary may have died
after its peers committed), so before retrying, the service takes the journal's write head
through a zero-byte barrier and looks for the batch between the end of its previous batch and
that head: found, it resolves there; not found, it is retried. The search matches only within
spans read contiguously, at their true offsets. Where the read jumps (content removed, a head
reset past never-written offsets, a replica's hole) the skipped span is read again until it is
readable or `dedup_wait` seconds have passed; a window that cannot be read in full is not taken
as "not written": the batch fails with `AppendOutcomeUnknownError` (and the journal stops, as
above) rather than risk writing it twice. The journal thus holds each batch once for a single
writer, or for content carrying message UUIDs (beyond `dedup_scan_bytes` of other writers'
content the scan is skipped and the retry may write it twice: appends stay at-least-once, and
message UUIDs de-duplicate).

Cancelling a future does not withdraw its content: once `append()` returns, the content will be
written. `aclose()` waits until everything queued has committed; a task that dies unexpectedly
fails every pending future with its error, and stops its journal.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import os
import tempfile
import time
import weakref
from collections.abc import AsyncIterator, Iterable
from typing import Any, BinaryIO

from tidings.client._async import ATTEMPT_TIMEOUT, AsyncClient
from tidings.client._base import CHUNK, DEFINITE_CODES, AppendResult, first_append_request
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.status import StatusError, TidingsError, TransportError, UsageError

__all__ = [
    "AppendOutcomeUnknownError",
    "AppendService",
    "AppendServiceStatistics",
    "DependencyFailedError",
    "EarlierAppendFailedError",
]

log = logging.getLogger(__name__)


class EarlierAppendFailedError(TidingsError):
    """Not written: an earlier batch of the same journal failed, and appends keep their order.

    `journal`, `batch` (which batch failed) and `cause` (its error, also `__cause__`)."""

    def __init__(self, journal: str, batch: str, cause: BaseException) -> None:
        super().__init__(
            f"journal {journal!r}: not written, because {batch}, made before this append, failed: {cause}; "
            f"appends to {journal!r} fail until AppendService.resume({journal!r})"
        )
        self.journal = journal
        self.batch = batch
        self.cause = cause
        self.__cause__ = cause


class DependencyFailedError(TidingsError):
    """Not written: a dependency of the append failed (or was cancelled).

    `journal`, `batch` (the dependant batch), `dependency` (its journal, when it was an append of this
    service) and `cause`."""

    def __init__(self, journal: str, batch: str, dependency: str, cause: BaseException) -> None:
        what = f"an append to {dependency!r}" if dependency else "a dependency"
        reason = "was cancelled" if isinstance(cause, asyncio.CancelledError) else f"failed: {cause}"
        super().__init__(f"journal {journal!r}: {batch} not written, because it depends on {what}, which {reason}")
        self.journal = journal
        self.batch = batch
        self.dependency = dependency
        self.cause = cause
        self.__cause__ = cause


class AppendOutcomeUnknownError(TidingsError):
    """An attempt's answer was lost and the journal cannot show whether the batch committed.

    The span where it would be could not be read in full (`unread`: offset ranges skipped by the
    read, e.g. removed content or a reset head), so the batch is neither taken as written nor
    written again."""

    def __init__(self, journal: str, batch: str, low: int, high: int, unread: list[tuple[int, int]]) -> None:
        spans = ", ".join(f"[{a}, {b})" for a, b in unread)
        super().__init__(
            f"journal {journal!r}: {batch} may have committed, but [{low}, {high}) cannot be read in full "
            f"(unreadable: {spans}); read the journal to check, then AppendService.resume({journal!r})"
        )
        self.journal = journal
        self.batch = batch
        self.low = low
        self.high = high
        self.unread = unread


@dataclasses.dataclass(frozen=True)
class AppendServiceStatistics:
    """Counters since the service started (for the CLI and benchmarks)."""

    appends: int
    batches: int
    bytes: int
    retries: int
    spilled_batches: int
    buffered_bytes: int
    failed_batches: int  # batches whose appends failed: a definite failure, and those queued behind it


class _Batch:
    """Content of consecutive appends to one journal, in memory or spilled to a temporary file.

    `done` is the service's own record of the outcome (None or the error), which dependants
    follow: the futures handed to callers may be cancelled by them."""

    __slots__ = ("buf", "deps", "done", "file", "journal", "seq", "size", "waiters")

    def __init__(self, journal: str = "", seq: int = 0, deps: list[asyncio.Future[Any]] | None = None) -> None:
        self.journal = journal
        self.seq = seq
        self.deps = deps
        self.done: asyncio.Future[BaseException | None] | None = None  # made when a dependant first asks
        self.buf = bytearray()
        self.file: BinaryIO | None = None
        self.size = 0
        self.waiters: list[tuple[asyncio.Future[AppendResult], int, int]] = []

    def describe(self) -> str:
        n = len(self.waiters)
        return f"batch #{self.seq} ({n} append{'' if n == 1 else 's'}, {self.size} bytes)"

    def add(self, content: bytes | bytearray | memoryview, spill_bytes: int, spill_dir: str | None) -> bool:
        """Add content; returns True when this call moved the batch to disk."""
        spilled = False
        if self.file is None and self.size + len(content) > spill_bytes:
            self.file = tempfile.TemporaryFile(prefix="tidings-append-", dir=spill_dir)
            self.file.write(self.buf)
            self.buf = bytearray()
            spilled = True
        if self.file is not None:
            self.file.write(content)
        else:
            self.buf += content
        self.size += len(content)
        return spilled

    def content(self) -> bytes | AsyncIterator[bytes]:
        """The batch's bytes: in memory, one `bytes` (a batch of up to a chunk is then a single Append
        message); spilled, chunks read back from disk in a thread."""
        return bytes(self.buf) if self.file is None else self._spilled()

    async def _spilled(self) -> AsyncIterator[bytes]:
        assert self.file is not None
        self.file.flush()
        fd, offset = self.file.fileno(), 0
        while offset < self.size:
            data = await asyncio.to_thread(os.pread, fd, min(4 * CHUNK, self.size - offset), offset)
            if not data:
                raise OSError(f"spill file ended at {offset} of {self.size} bytes")
            offset += len(data)
            yield data

    async def all_content(self) -> bytes:
        content = self.content()
        return content if isinstance(content, bytes) else b"".join([part async for part in content])

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
        self.buf = bytearray()


class _JournalQueue:
    __slots__ = ("batches", "failed", "flight", "head", "journal", "open", "ready", "task")

    def __init__(self, journal: str) -> None:
        self.journal = journal
        self.head: int | None = None  # no batch of ours can begin before this offset
        self.open: _Batch | None = None
        self.ready: collections.deque[_Batch] = collections.deque()
        self.flight: _Batch | None = None  # the batch being committed (or waiting for its dependencies)
        self.task: asyncio.Task[None] | None = None
        self.batches = 0  # batches made so far (numbers them in errors)
        self.failed: EarlierAppendFailedError | None = None  # set by a definite failure, until resume()


class AppendService:
    """Batched, ordered, retried appends; `await service.append(j, data)` returns a future of the span.

    **Parameters:**
    * `client` - the AsyncClient appends go through.
    * `batch_bytes` - the most content one append RPC carries (a larger single append goes alone).
    * `spill_bytes` - a batch larger than this moves to a temporary file.
    * `buffer_bytes` - content waiting (memory + disk) beyond which `append()` waits for room.
    * `spill_dir` - where spill files go (default: the system's temporary directory).
    * `dedup_scan_bytes` - after a failure that may have committed, scan at most this much of the
      journal for the batch before retrying it.
    * `attempt_timeout` - seconds (plus one per MiB of the batch) an append RPC may take before it
      is abandoned as failed with an unknown outcome. Appends normally take milliseconds; this
      bounds what a lost answer (seen with grpc.aio when a peer broker dies) would otherwise hang.

    Usage::

        service = AppendService(client)
        done = await service.append("shop/orders", b'{"id": 1}\\n')
        span = await done            # AppendResult: the committed [begin, end) of this content
        ack = await service.append("shop/acks", b"ack\\n", dependencies=[done])  # held until `done` commits
        await service.aclose()
    """

    def __init__(
        self,
        client: AsyncClient,
        *,
        batch_bytes: int = 8 << 20,
        spill_bytes: int = 2 << 20,
        buffer_bytes: int = 1 << 30,
        spill_dir: str | None = None,
        dedup_scan_bytes: int = 64 << 20,
        attempt_timeout: float = ATTEMPT_TIMEOUT,
    ) -> None:
        if min(batch_bytes, spill_bytes, buffer_bytes) <= 0:
            raise ValueError("batch_bytes, spill_bytes and buffer_bytes must be positive")
        self.client = client
        self.batch_bytes = batch_bytes
        self.spill_bytes = spill_bytes
        self.buffer_bytes = buffer_bytes
        self.spill_dir = spill_dir
        self.dedup_scan_bytes = dedup_scan_bytes
        self.attempt_timeout = attempt_timeout
        self.dedup_wait = 60.0  # seconds a span may stay unreadable while looking for a batch
        self._queues: dict[str, _JournalQueue] = {}
        self._expect: dict[str, pb.LabelSelector] = {}  # journal -> the registers its appends check
        self._pending: dict[asyncio.Future[AppendResult], _Batch] = {}  # each unsettled future's batch
        # Outcomes of futures their caller cancelled before the batch settled (for later dependants).
        self._cancelled: weakref.WeakKeyDictionary[asyncio.Future[AppendResult], BaseException | None] = (
            weakref.WeakKeyDictionary()
        )
        self._buffered = 0
        self._room = asyncio.Event()
        self._closed = False
        self._appends = self._batches = self._bytes = self._retries = self._spilled = self._failed = 0

    # -- public ----------------------------------------------------------------------------

    async def append(
        self,
        journal: str,
        content: bytes | bytearray | memoryview,
        *,
        dependencies: Iterable[asyncio.Future[Any]] = (),
    ) -> asyncio.Future[AppendResult]:
        """Queue `content` for `journal`; returns a future of its committed span.

        Waits only for room in the buffer (back-pressure). Appends to one journal commit in the
        order of their `append()` calls. The append is not sent before every future of
        `dependencies` has finished, and fails unwritten (`DependencyFailedError`) if one failed
        (a dependency that never finishes holds this journal, and `aclose()`, for good). After a
        definite failure of the journal the future fails at once (see `resume()`).
        """
        if self._closed:
            raise UsageError("the AppendService is closed; make a new one")
        size = len(content)
        while self._buffered and self._buffered + size > self.buffer_bytes:
            self._room.clear()
            await self._room.wait()
        return self.append_nowait(journal, content, dependencies=dependencies)

    def append_nowait(
        self,
        journal: str,
        content: bytes | bytearray | memoryview,
        *,
        dependencies: Iterable[asyncio.Future[Any]] = (),
    ) -> asyncio.Future[AppendResult]:
        """Like `append()`, without waiting for room in the buffer (use when the caller bounds itself)."""
        if self._closed:
            raise UsageError("the AppendService is closed; make a new one")
        q = self._queues.get(journal)
        if q is None:
            q = self._queues[journal] = _JournalQueue(journal)
        deps = self._open_dependencies(journal, dependencies) if dependencies else None
        fut: asyncio.Future[AppendResult] = asyncio.get_running_loop().create_future()
        if q.failed is not None:
            fut.set_exception(q.failed)
            fut.exception()  # retrieved: the failure was logged once, when it happened
            return fut
        size = len(content)
        batch = q.open
        if batch is None or deps or (batch.size and batch.size + size > self.batch_bytes):
            if batch is not None:
                q.ready.append(batch)
            q.batches += 1
            batch = q.open = _Batch(journal, q.batches, deps)
        start = batch.size
        if batch.add(content, self.spill_bytes, self.spill_dir):
            self._spilled += 1
        batch.waiters.append((fut, start, start + size))
        self._pending[fut] = batch
        self._buffered += size
        self._appends += 1
        if q.task is None:
            q.task = asyncio.create_task(self._append_loop(q), name=f"append-service:{journal}")
        return fut

    def expect(self, journal: str, check_registers: pb.LabelSelector) -> None:
        """Make every later batch appended to `journal` check its registers (Gazette's register fence,
        as a recovery log's recorder uses it): a batch whose check fails is refused with
        REGISTER_MISMATCH, writes nothing, and, a definite failure, stops the journal."""
        self._expect[journal] = check_registers

    def pending(self, except_journal: str = "") -> dict[str, asyncio.Future[None]]:
        """Everything appended so far, as a barrier (Gazette's PendingExcept): per journal (but
        `except_journal`) with appends not yet settled, a future done once the last of them is,
        failing with its error (an earlier one's failure fails it too: appends keep their order);
        per journal stopped by a definite failure (until `resume()`), a future failed with it.

        A consumer shard's store commit waits on this: nothing its transaction appended, through
        whichever API, can be overtaken by the commit, and a definite failure of any of it fails the
        commit. Appends made after the call are not waited for."""
        loop = asyncio.get_running_loop()
        out: dict[str, asyncio.Future[None]] = {}
        for journal, q in self._queues.items():
            if journal == except_journal:
                continue
            if q.failed is not None:
                fut: asyncio.Future[None] = loop.create_future()
                fut.set_exception(q.failed)
                fut.exception()  # (retrieved: a barrier that is not awaited logs nothing more)
                out[journal] = fut
                continue
            last = q.open or (q.ready[-1] if q.ready else q.flight)
            if last is not None:
                out[journal] = self._settled(last)
        return out

    def _settled(self, batch: _Batch) -> asyncio.Future[None]:
        """A future of the batch's outcome: None, or failed with its error."""
        loop = asyncio.get_running_loop()
        if batch.done is None:
            batch.done = loop.create_future()
        fut: asyncio.Future[None] = loop.create_future()

        def settle(done: asyncio.Future[BaseException | None]) -> None:
            if fut.done():
                return
            err = done.result()
            if err is None:
                fut.set_result(None)
            else:
                fut.set_exception(err)
                fut.exception()  # (retrieved: a barrier that is not awaited logs nothing more)

        batch.done.add_done_callback(settle)
        return fut

    def failure(self, journal: str) -> BaseException | None:
        """The error that stopped `journal` (appends to it fail until `resume()`), or None."""
        q = self._queues.get(journal)
        return None if q is None or q.failed is None else q.failed.cause

    def resume(self, journal: str) -> BaseException | None:
        """Let appends to `journal` through again after a definite failure; returns the error it clears.

        Call it once the failure has been dealt with: content appended from now on is written after
        whatever committed before the failed batch (the failed batch and those behind it are not)."""
        q = self._queues.get(journal)
        if q is None or q.failed is None:
            return None
        cause, q.failed = q.failed.cause, None
        log.info("journal %s: appends resume after %s", journal, cause)
        return cause

    async def flush(self) -> None:
        """Wait until everything appended so far has committed (or failed)."""
        while tasks := [q.task for q in self._queues.values() if q.task is not None]:
            await asyncio.wait(tasks)

    async def aclose(self) -> None:
        """Refuse new appends, then wait until everything queued has committed (or failed)."""
        self._closed = True
        await self.flush()

    async def abort(self) -> None:
        """Refuse new appends and stop at once: every append not yet settled fails ("the AppendService
        stopped"), without waiting for the brokers (one whose RPC was under way may have committed).
        For an owner that is going away: a consumer shard's primary that was cancelled, say, whose
        appends would otherwise retry for as long as their journal refuses them."""
        self._closed = True
        tasks = [q.task for q in self._queues.values() if q.task is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        stopped = UsageError("the AppendService stopped")
        for q in self._queues.values():  # (a task cancelled before it ever ran settled nothing)
            for batch in [*([q.flight] if q.flight else []), *q.ready, *([q.open] if q.open else [])]:
                self._settle(batch, stopped)
                self._release(batch)
            q.ready.clear()
            q.open = q.flight = q.task = None

    def statistics(self) -> AppendServiceStatistics:
        return AppendServiceStatistics(
            self._appends, self._batches, self._bytes, self._retries, self._spilled, self._buffered, self._failed
        )

    # -- dependencies ----------------------------------------------------------------------

    def _open_dependencies(
        self, journal: str, dependencies: Iterable[asyncio.Future[Any]]
    ) -> list[asyncio.Future[Any]] | None:
        """The dependencies that still need waiting for: not finished well, not ordered before us anyway."""
        deps = []
        for dep in dependencies:
            if not asyncio.isfuture(dep):
                raise UsageError(
                    f"journal {journal!r}: dependencies must be futures (from AppendService.append, or asyncio "
                    f"futures and tasks), not {type(dep).__name__}"
                )
            batch = self._pending.get(dep)
            if batch is not None:
                if batch.journal != journal:  # (an earlier append to this journal is met by the order)
                    deps.append(dep)
            elif not dep.done() or self._outcome(dep) is not None:
                deps.append(dep)
        return deps or None

    def _outcome(self, dep: asyncio.Future[Any]) -> BaseException | None:
        """How a finished dependency ended: None when well, else its error."""
        if dep.cancelled():
            with contextlib.suppress(TypeError):  # (TypeError: a future-like that takes no weak reference)
                if dep in self._cancelled:  # one of ours, cancelled by its caller: the batch's outcome counts
                    return self._cancelled[dep]
            return asyncio.CancelledError()
        return dep.exception()

    async def _wait_for_dependencies(self, batch: _Batch) -> None:
        """Return once every dependency of the batch finished well; raise DependencyFailedError if one did not."""
        for dep in batch.deps or ():
            owner = self._pending.get(dep)
            if owner is not None:  # follow the batch, not the caller's future (which may be cancelled)
                if owner.done is None:
                    owner.done = asyncio.get_running_loop().create_future()
                await asyncio.wait([owner.done])  # (never cancels what it waits for)
                err = owner.done.result()
            else:
                if not dep.done():
                    await asyncio.wait([dep])
                err = self._outcome(dep)
            if err is not None:
                source = owner.journal if owner is not None else getattr(err, "journal", "")
                raise DependencyFailedError(batch.journal, batch.describe(), source, err)

    # -- the per-journal loop --------------------------------------------------------------

    async def _append_loop(self, q: _JournalQueue) -> None:
        """Commit the journal's batches in order; exits when the queue is empty."""
        batch: _Batch | None = None
        try:
            while True:
                if q.ready:
                    batch = q.ready.popleft()
                elif q.open is not None:
                    batch, q.open = q.open, None
                else:
                    return
                q.flight = batch
                try:
                    if batch.deps:
                        await self._wait_for_dependencies(batch)
                    result = await self._commit(q, batch)
                except TidingsError as exc:
                    self._stop_journal(q, batch, exc)
                else:
                    self._settle(batch, result)
                self._release(batch)
                batch = q.flight = None
        except BaseException as exc:  # dying: no future may be left waiting
            err = exc if isinstance(exc, Exception) else UsageError("the AppendService stopped")
            if batch is not None:
                self._stop_journal(q, batch, err)
                self._release(batch)
            else:
                for pending in [*q.ready, *([q.open] if q.open else [])]:
                    self._settle(pending, err)
                    self._release(pending)
                q.ready.clear()
                q.open = None
            raise
        finally:
            q.task = q.flight = None

    def _stop_journal(self, q: _JournalQueue, batch: _Batch, exc: BaseException) -> None:
        """Fail the batch, and every append to its journal queued behind it or made until resume()."""
        behind = [*q.ready, *([q.open] if q.open else [])]
        log.warning("journal %s: %s failed (%d more queued behind it fail too; resume() lets appends through "
                    "again): %s", q.journal, batch.describe(), sum(len(b.waiters) for b in behind), exc)  # fmt: skip
        self._failed += 1 + len(behind)
        self._settle(batch, exc)
        later = q.failed = EarlierAppendFailedError(q.journal, batch.describe(), exc)
        for b in behind:
            self._settle(b, later)
            self._release(b)
        q.ready.clear()
        q.open = None

    def _settle(self, batch: _Batch, outcome: AppendResult | BaseException) -> None:
        """Resolve the batch's futures (each with its own span) and its record for dependants."""
        pending = self._pending
        error = outcome if isinstance(outcome, BaseException) else None
        for fut, begin, end in batch.waiters:
            pending.pop(fut, None)
            if fut.cancelled():
                self._cancelled[fut] = error
            elif isinstance(outcome, BaseException):
                fut.set_exception(outcome)
                fut.exception()  # mark it retrieved: the service has logged the failure
            else:
                fut.set_result(
                    AppendResult(outcome.journal, outcome.begin + begin, outcome.begin + end, outcome.registers)
                )
        if batch.done is not None and not batch.done.done():
            batch.done.set_result(error)

    async def _commit(self, q: _JournalQueue, batch: _Batch) -> AppendResult:
        """Append the batch, retrying everything but a definite refusal or an invalid request.

        A refusal Status means nothing was written. A transport failure does not say whether the
        append committed, so before the retry `_find_committed` looks for the batch in the journal.
        """
        client, journal = self.client, q.journal
        first = first_append_request(journal, check_registers=self._expect.get(journal))
        if q.head is None:
            with contextlib.suppress(TidingsError):  # (unknown: a later scan starts at offset 0)
                q.head = await client.write_head(journal)  # a lower bound of where this batch lands
        attempt = 0
        ambiguous = False
        failing_since = 0.0  # with the client's retry deadline, retries stop that long after the first failure
        while True:
            if ambiguous:
                try:
                    found = await self._find_committed(q, batch)
                except StatusError as exc:
                    if exc.retriable:
                        if client.retry.expired(failing_since):
                            raise
                        await client.backoff(min(attempt, 10))
                        attempt += 1
                        continue
                    log.warning("journal %s: cannot look for a failed append (%s); retrying it", journal, exc)
                    found = None
                except TransportError as exc:
                    log.info("journal %s: looking for a failed append: %s", journal, exc)
                    if client.retry.expired(failing_since):
                        raise
                    await client.backoff(min(attempt, 10))
                    attempt += 1
                    continue
                if found is not None:
                    return found
                ambiguous = False
            endpoint = client._append_endpoint(journal)
            log.debug("journal %s: appending %d bytes through %s (attempt %d)", journal, batch.size, endpoint, attempt)
            try:
                timeout = self.attempt_timeout + batch.size / (1 << 20)  # (and a second per MiB)
                result = await client._append_once(endpoint, first, batch.content(), timeout)
            except StatusError as exc:
                client._failed(journal, endpoint, exc)
                if not exc.retriable:
                    raise
                err: TidingsError = exc
                ambiguous = False
            except TransportError as exc:
                client._failed(journal, endpoint, exc)
                if exc.code in DEFINITE_CODES:
                    raise
                err = exc
                ambiguous = True
            except OSError as exc:  # the spill file failed us: nothing to retry
                raise UsageError(f"journal {journal!r}: reading the spilled batch failed: {exc}") from exc
            else:
                self._batches += 1
                self._bytes += batch.size
                q.head = result.end
                return result
            failing_since = failing_since or time.monotonic()
            if client.retry.expired(failing_since) and not ambiguous:
                raise err  # (an ambiguous failure is first looked for: the deadline ends the search)
            self._retries += 1
            log.info("journal %s: append of %d bytes failed (%s); retrying", journal, batch.size, err)
            await client.backoff(min(attempt, 10))
            attempt += 1

    async def _find_committed(self, q: _JournalQueue, batch: _Batch) -> AppendResult | None:
        """Did a failed attempt commit after all? Look for the batch between where it could begin
        (`q.head`) and the journal's authoritative write head (a zero-byte barrier through the
        primary's synchronized pipeline). The first exact match is taken as ours: exact for a single
        writer or for content carrying message UUIDs; identical bytes of another writer in that
        window would be mistaken for ours.

        Only bytes read contiguously are matched, at the offsets the broker gave them. A span the
        read jumped over (the Reader's `jumps`: removed content, a head reset past it, a replica's
        hole) is read again until `dedup_wait` runs out; if the window is still not whole and the
        batch was not found, AppendOutcomeUnknownError: "not found" would be a guess."""
        client, journal = self.client, q.journal
        barrier = await client.append(journal, b"")
        low, high = q.head or 0, barrier.end
        if high - low < batch.size:
            q.head = high
            return None
        if high - low > self.dedup_scan_bytes:
            log.warning("journal %s: %d bytes to scan for a failed append; retrying it (it may now appear twice)",
                        journal, high - low)  # fmt: skip
            q.head = high
            return None
        content = await batch.all_content()
        pieces: list[tuple[int, bytes | bytearray]] = []  # (offset, bytes read there)
        unread = [(low, high)]
        deadline = asyncio.get_running_loop().time() + self.dedup_wait
        attempt = 0
        while True:
            for begin, end in unread:
                await self._read_span(journal, begin, end, deadline, pieces)
            runs = _coalesce(pieces)  # begin -> bytes read contiguously from there
            pieces = list(runs.items())
            for begin in sorted(runs):
                at = runs[begin].find(content)
                if at >= 0:
                    found = begin + at
                    q.head = found + batch.size
                    self._batches += 1
                    self._bytes += batch.size
                    log.info("journal %s: a failed append of %d bytes had committed at %d", journal, batch.size, found)
                    return AppendResult(journal, found, found + batch.size, barrier.registers)
            unread = _uncovered(low, high, runs)
            if not unread:
                q.head = high
                return None
            if asyncio.get_running_loop().time() >= deadline:
                raise AppendOutcomeUnknownError(journal, batch.describe(), low, high, unread)
            log.info("journal %s: looking for a failed append, %s of [%d, %d) is not readable yet", journal,
                     ", ".join(f"[{a}, {b})" for a, b in unread), low, high)  # fmt: skip
            await client.backoff(min(attempt, 6))
            attempt += 1

    async def _read_span(
        self, journal: str, begin: int, end: int, deadline: float, pieces: list[tuple[int, bytes | bytearray]]
    ) -> None:
        """Add the committed content of [begin, end) to `pieces`, each chunk at its own offset, until
        `deadline`; what the read jumps over (logged from the Reader's `jumps`) or does not reach in
        time is simply missing."""
        reader = self.client.reader(journal, begin, block=True, end_offset=end)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout_at(deadline), contextlib.aclosing(reader):
                async for chunk in reader:
                    pieces.append((chunk.offset, chunk.content))
        if reader.jumps:
            log.info("journal %s: reading [%d, %d) jumped over %s", journal, begin, end,
                     ", ".join(f"[{a}, {b})" for a, b in reader.jumps))  # fmt: skip

    def _release(self, batch: _Batch) -> None:
        self._buffered -= batch.size
        batch.close()
        self._room.set()


def _coalesce(pieces: list[tuple[int, bytes | bytearray]]) -> dict[int, bytearray]:
    """Merge pieces of content that touch or overlap into runs, by offset (committed bytes at an offset
    are the same on every read, so an overlap only extends a run)."""
    runs: dict[int, bytearray] = {}
    last = -1
    for begin, data in sorted(pieces, key=lambda p: p[0]):
        if not data:
            continue
        if last >= 0 and begin <= last + len(runs[last]):
            run = runs[last]
            overlap = last + len(run) - begin
            if overlap < len(data):
                run += data[overlap:]
        else:
            runs[begin] = bytearray(data)
            last = begin
    return runs


def _uncovered(low: int, high: int, runs: dict[int, bytearray]) -> list[tuple[int, int]]:
    """The parts of [low, high) no run covers (runs are coalesced: sorted and disjoint)."""
    gaps, at = [], low
    for begin in sorted(runs):
        end = begin + len(runs[begin])
        if begin > at:
            gaps.append((at, min(begin, high)))
        at = max(at, end)
        if at >= high:
            break
    if at < high:
        gaps.append((at, high))
    return [(a, b) for a, b in gaps if a < b]
