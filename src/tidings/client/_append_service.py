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
transient statuses, broker restarts and Route changes. Only a definite refusal (JOURNAL_NOT_FOUND,
NOT_ALLOWED, ...) or an invalid request fails its futures. A transport failure leaves the outcome
unknown (the primary may have died after its peers committed), so before retrying, the service
takes the journal's write head through a zero-byte barrier and looks for the batch between the end
of its previous batch and that head: found, it resolves there; not found, it is retried. The
journal thus holds each batch once for a single writer, or for content carrying message UUIDs
(beyond `dedup_scan_bytes` of other writers' content the scan is skipped and the retry may write
it twice: appends stay at-least-once, and message UUIDs de-duplicate).

Cancelling a future does not withdraw its content: once `append()` returns, the content will be
written. `aclose()` waits until everything queued has committed; a task that dies unexpectedly
fails every pending future with its error.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import os
import tempfile
from collections.abc import AsyncIterator
from typing import BinaryIO

import grpc

from tidings.client._async import ATTEMPT_TIMEOUT, AsyncClient
from tidings.client._base import CHUNK, AppendResult, first_append_request
from tidings.protocol.status import StatusError, TidingsError, TransportError, UsageError

__all__ = ["AppendService", "AppendServiceStatistics"]

log = logging.getLogger(__name__)

# Transport failures that no retry can mend: the request itself is at fault.
_DEFINITE_CODES = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
    }
)


@dataclasses.dataclass(frozen=True)
class AppendServiceStatistics:
    """Counters since the service started (for the CLI and benchmarks)."""

    appends: int
    batches: int
    bytes: int
    retries: int
    spilled_batches: int
    buffered_bytes: int


class _Batch:
    """Content of consecutive appends to one journal, in memory or spilled to a temporary file."""

    __slots__ = ("buf", "file", "size", "waiters")

    def __init__(self) -> None:
        self.buf = bytearray()
        self.file: BinaryIO | None = None
        self.size = 0
        self.waiters: list[tuple[asyncio.Future[AppendResult], int, int]] = []

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

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
        self.buf = bytearray()


class _JournalQueue:
    __slots__ = ("head", "journal", "open", "ready", "task")

    def __init__(self, journal: str) -> None:
        self.journal = journal
        self.head: int | None = None  # no batch of ours can begin before this offset
        self.open: _Batch | None = None
        self.ready: collections.deque[_Batch] = collections.deque()
        self.task: asyncio.Task[None] | None = None


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
        self.dedup_wait = 60.0  # seconds to wait for a range to become readable while looking
        self._queues: dict[str, _JournalQueue] = {}
        self._buffered = 0
        self._room = asyncio.Event()
        self._closed = False
        self._appends = self._batches = self._bytes = self._retries = self._spilled = 0

    # -- public ----------------------------------------------------------------------------

    async def append(self, journal: str, content: bytes | bytearray | memoryview) -> asyncio.Future[AppendResult]:
        """Queue `content` for `journal`; returns a future of its committed span.

        Waits only for room in the buffer (back-pressure). Appends to one journal commit in the
        order of their `append()` calls.
        """
        if self._closed:
            raise UsageError("the AppendService is closed; make a new one")
        size = len(content)
        while self._buffered and self._buffered + size > self.buffer_bytes:
            self._room.clear()
            await self._room.wait()
        return self.append_nowait(journal, content)

    def append_nowait(self, journal: str, content: bytes | bytearray | memoryview) -> asyncio.Future[AppendResult]:
        """Like `append()`, without waiting for room in the buffer (use when the caller bounds itself)."""
        if self._closed:
            raise UsageError("the AppendService is closed; make a new one")
        q = self._queues.get(journal)
        if q is None:
            q = self._queues[journal] = _JournalQueue(journal)
        size = len(content)
        batch = q.open
        if batch is None or (batch.size and batch.size + size > self.batch_bytes):
            if batch is not None:
                q.ready.append(batch)
            batch = q.open = _Batch()
        start = batch.size
        if batch.add(content, self.spill_bytes, self.spill_dir):
            self._spilled += 1
        fut: asyncio.Future[AppendResult] = asyncio.get_running_loop().create_future()
        batch.waiters.append((fut, start, start + size))
        self._buffered += size
        self._appends += 1
        if q.task is None:
            q.task = asyncio.create_task(self._append_loop(q), name=f"append-service:{journal}")
        return fut

    async def flush(self) -> None:
        """Wait until everything appended so far has committed (or failed)."""
        while tasks := [q.task for q in self._queues.values() if q.task is not None]:
            await asyncio.wait(tasks)

    async def aclose(self) -> None:
        """Refuse new appends, then wait until everything queued has committed (or failed)."""
        self._closed = True
        await self.flush()

    def statistics(self) -> AppendServiceStatistics:
        return AppendServiceStatistics(
            self._appends, self._batches, self._bytes, self._retries, self._spilled, self._buffered
        )

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
                try:
                    result = await self._commit(q, batch)
                except TidingsError as exc:
                    log.warning("journal %s: %d appends failed: %s", q.journal, len(batch.waiters), exc)
                    _fail(batch, exc)
                else:
                    for fut, begin, end in batch.waiters:
                        if not fut.done():
                            fut.set_result(AppendResult(q.journal, result.begin + begin, result.begin + end,
                                                        result.registers))  # fmt: skip
                self._release(batch)
                batch = None
        except BaseException as exc:  # dying: no future may be left waiting
            err = exc if isinstance(exc, Exception) else UsageError("the AppendService stopped")
            for pending in ([batch] if batch else []) + list(q.ready) + ([q.open] if q.open else []):
                _fail(pending, err)
                self._release(pending)
            q.ready.clear()
            q.open = None
            raise
        finally:
            q.task = None

    async def _commit(self, q: _JournalQueue, batch: _Batch) -> AppendResult:
        """Append the batch, retrying everything but a definite refusal or an invalid request.

        A refusal Status means nothing was written. A transport failure does not say whether the
        append committed, so before the retry `_find_committed` looks for the batch in the journal.
        """
        client, journal = self.client, q.journal
        first = first_append_request(journal)
        if q.head is None:
            with contextlib.suppress(TidingsError):  # (unknown: a later scan starts at offset 0)
                q.head = await client.write_head(journal)  # a lower bound of where this batch lands
        attempt = 0
        ambiguous = False
        while True:
            if ambiguous:
                try:
                    found = await self._find_committed(q, batch)
                except StatusError as exc:
                    if exc.retriable:
                        await client.backoff(min(attempt, 10))
                        attempt += 1
                        continue
                    log.warning("journal %s: cannot look for a failed append (%s); retrying it", journal, exc)
                    found = None
                except TransportError as exc:
                    log.info("journal %s: looking for a failed append: %s", journal, exc)
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
                if exc.code in _DEFINITE_CODES:
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
            self._retries += 1
            log.info("journal %s: append of %d bytes failed (%s); retrying", journal, batch.size, err)
            await client.backoff(min(attempt, 10))
            attempt += 1

    async def _find_committed(self, q: _JournalQueue, batch: _Batch) -> AppendResult | None:
        """Did a failed attempt commit after all? Look for the batch between where it could begin
        (`q.head`) and the journal's authoritative write head (a zero-byte barrier through the
        primary's synchronized pipeline). The first exact match is taken as ours: exact for a single
        writer or for content carrying message UUIDs; identical bytes of another writer in that
        window would be mistaken for ours."""
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
        # Read through `high` even where the replica we read from has a hole that another replica
        # committed (a primary died between peers): that range arrives once it is persisted.
        parts: list[bytes] = []
        try:
            async with asyncio.timeout(self.dedup_wait):
                async with contextlib.aclosing(client.reader(journal, low, block=True, end_offset=high)) as reader:
                    async for chunk in reader:
                        parts.append(chunk.content)
        except TimeoutError:
            log.warning("journal %s: [%d, %d) is not readable after %.0fs; retrying a failed append (it may now "
                        "appear twice)", journal, low + sum(map(len, parts)), high, self.dedup_wait)  # fmt: skip
        written = b"".join(parts)
        content = batch.content()
        if not isinstance(content, bytes):
            content = b"".join([part async for part in content])
        at = written.find(content)
        if at < 0:
            q.head = high
            return None
        begin = low + at
        q.head = begin + batch.size
        self._batches += 1
        self._bytes += batch.size
        log.info("journal %s: a failed append of %d bytes had committed at %d", journal, batch.size, begin)
        return AppendResult(journal, begin, begin + batch.size, barrier.registers)

    def _release(self, batch: _Batch) -> None:
        self._buffered -= batch.size
        batch.close()
        self._room.set()


def _fail(batch: _Batch, exc: BaseException) -> None:
    for fut, _b, _e in batch.waiters:
        if not fut.done():
            fut.set_exception(exc)
            with contextlib.suppress(BaseException):
                fut.exception()  # mark it retrieved: the service has logged the failure
