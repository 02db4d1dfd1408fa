"""Client: the synchronous facade of AsyncClient, for scripts and Spark executors.

Each Client owns a private event loop on a daemon thread and runs the AsyncClient's coroutines
there: the methods and their arguments are the same, minus `await`. Async iterators become
iterators; the Appender and Reader have sync twins. grpc.aio and sync gRPC streams differ too
much for a generated or hand-written mirror (STYLE.md, "Sync and async").
"""

from __future__ import annotations

import asyncio
import builtins
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Iterator
from typing import Any, TypeVar

import uvloop

from tidings.auth.authorizer import Authorizer
from tidings.client._async import Appender, AsyncClient, Reader
from tidings.client._base import AppendResult, Content, ReadChunk
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.status import UsageError
from tidings.tls import TLS

__all__ = ["Client", "SyncAppender", "SyncReader"]

T = TypeVar("T")


class LoopThread:
    """An event loop running forever on a daemon thread; `run()` waits for a coroutine's result."""

    def __init__(self, name: str = "tidings-client") -> None:
        self.loop = uvloop.new_event_loop()  # as every tidings process: its transports cost less per message
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Awaitable[T]) -> T:
        if threading.current_thread() is self._thread:
            raise UsageError("a sync tidings Client was called from its own event loop; use AsyncClient there")
        if self.loop.is_closed():
            raise UsageError("this Client is closed; make a new one")
        return asyncio.run_coroutine_threadsafe(_awaited(coro), self.loop).result()

    def iterate(self, make: Callable[[], AsyncIterator[T]]) -> Generator[T, None, None]:
        """Drive the async iterator `make()` (created on the loop) from this thread."""
        ait = self.run(_call(make))
        try:
            while True:
                try:
                    yield self.run(ait.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            aclose = getattr(ait, "aclose", None)
            if aclose is not None and not self.loop.is_closed():
                self.run(aclose())

    def close(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


async def _awaited(aw: Awaitable[T]) -> T:
    return await aw


async def _call(fn: Callable[[], T]) -> T:
    return fn()


class Client:
    """A synchronous client of a tidings cluster; see AsyncClient for the parameters and semantics.

    Usage::

        with Client("127.0.0.1:8080") as c:
            span = c.append("shop/orders", b"hello\\n")
            for chunk in c.read("shop/orders"):
                ...
    """

    def __init__(
        self,
        endpoint: str,
        retries: int | None = 20,
        *,
        zone: str | None = None,
        tls: TLS | None = None,
        auth: Authorizer | None = None,
        transport: str | None = None,
    ) -> None:
        self.endpoint = endpoint
        self._loop = LoopThread()
        self.aio = AsyncClient(endpoint, retries, zone=zone, tls=tls, auth=auth, transport=transport)

    def run(self, coro: Awaitable[T]) -> T:
        """Run a coroutine of `self.aio` (or anything else) on the client's loop and return its result."""
        return self._loop.run(coro)

    def iterate(self, make: Callable[[], AsyncIterator[T]]) -> Generator[T, None, None]:
        """Iterate an async iterator made by `make()` on the client's loop (e.g. a message reader)."""
        return self._loop.iterate(make)

    def close(self) -> None:
        """Close the channels and stop the loop thread."""
        if not self._loop.loop.is_closed():
            self._loop.run(self.aio.aclose())
        self._loop.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- mirrored AsyncClient methods ------------------------------------------------------

    def append(self, journal: str, content: Content = b"", **expect: Any) -> AppendResult:
        return self.run(self.aio.append(journal, content, **expect))

    def append_once(self, journal: str, content: Callable[[], Content], size: int, **options: Any) -> AppendResult:
        return self.run(self.aio.append_once(journal, content, size, **options))

    def appender(self, journal: str, **expect: Any) -> SyncAppender:
        return SyncAppender(self, self.aio.appender(journal, **expect))

    def reader(self, journal: str, offset: int = 0, **options: Any) -> SyncReader:
        return SyncReader(self, self.aio.reader(journal, offset, **options))

    def read(self, journal: str, offset: int = 0, *, block: bool = False, end_offset: int = 0) -> SyncReader:
        return SyncReader(self, self.aio.read(journal, offset, block=block, end_offset=end_offset))

    def read_all(self, journal: str, offset: int = 0, end_offset: int = 0) -> bytes:
        return self.run(self.aio.read_all(journal, offset, end_offset))

    def write_head(self, journal: str) -> int:
        return self.run(self.aio.write_head(journal))

    def probe(self, journal: str, offset: int) -> pb.ReadResponse:
        return self.run(self.aio.probe(journal, offset))

    def list(self, selector: pb.LabelSelector | None = None) -> pb.ListResponse:
        return self.run(self.aio.list(selector))

    def describe(self, journal: str) -> pb.ListResponse.Journal | None:
        return self.run(self.aio.describe(journal))

    def spec(self, journal: str) -> pb.JournalSpec:
        return self.run(self.aio.spec(journal))

    def watch(self, selector: pb.LabelSelector | None = None) -> Iterator[pb.ListResponse]:
        return self.iterate(lambda: self.aio.watch(selector))

    def apply(self, changes: builtins.list[pb.ApplyRequest.Change]) -> pb.ApplyResponse:
        return self.run(self.aio.apply(changes))

    def fragments(self, journal: str) -> pb.FragmentsResponse:
        return self.run(self.aio.fragments(journal))

    def members(self) -> pb.MembersResponse:
        return self.run(self.aio.members())

    def suspend(self, journal: str, force: bool = False) -> bool:
        return self.run(self.aio.suspend(journal, force))


class SyncAppender:
    """The sync twin of Appender: `with client.appender(j) as a: a.write(...)` commits on success."""

    def __init__(self, client: Client, inner: Appender) -> None:
        self._client = client
        self._inner = inner
        self.journal = inner.journal

    @property
    def result(self) -> AppendResult | None:
        return self._inner.result

    def __enter__(self) -> SyncAppender:
        self.open()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()

    def open(self) -> None:
        self._client.run(self._inner.open())

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._client.run(self._inner.write(data))

    def commit(self) -> AppendResult:
        return self._client.run(self._inner.commit())

    def abort(self) -> None:
        self._client._loop.loop.call_soon_threadsafe(self._inner.abort)


class SyncReader:
    """The sync twin of Reader: an iterator of ReadChunk with the same `offset`, `jumps`, `write_head`."""

    def __init__(self, client: Client, inner: Reader) -> None:
        self._inner = inner
        self._it = client.iterate(lambda: inner)

    def __iter__(self) -> SyncReader:
        return self

    def __next__(self) -> ReadChunk:
        return next(self._it)

    def close(self) -> None:
        self._it.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)
