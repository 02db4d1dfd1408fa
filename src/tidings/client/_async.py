"""AsyncClient: grpc.aio calls to any broker, with retries on transient statuses."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections.abc import AsyncIterable, AsyncIterator, Iterable

import grpc

from tidings.protocol import labels
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.protocol_pb2_grpc import JournalStub
from tidings.protocol.status import TransportError, for_status, map_grpc_error

CHUNK = 256 * 1024
GRPC_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]


@dataclasses.dataclass(frozen=True, slots=True)
class AppendResult:
    """The committed span of an append, and the journal's registers after it."""

    journal: str
    begin: int
    end: int
    registers: dict[str, list[str]]

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True, slots=True)
class ReadChunk:
    offset: int
    content: bytes
    write_head: int


def _registers(ls: pb.LabelSet) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for k, v in labels.pairs(ls):
        out.setdefault(k, []).append(v)
    return out


class AsyncClient:
    """A client of one broker endpoint ("host:port"); any broker of the cluster will do.

    Appends go to whichever broker is addressed and are proxied to the primary; the client
    retries statuses marked retriable and transport unavailability, never definite refusals.
    """

    def __init__(self, endpoint: str, retries: int = 20) -> None:
        self.endpoint = endpoint
        self.retries = retries
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _stub(self, endpoint: str | None = None) -> JournalStub:
        ep = endpoint or self.endpoint
        ch = self._channels.get(ep)
        if ch is None:
            ch = self._channels[ep] = grpc.aio.insecure_channel(ep, options=GRPC_OPTIONS)
        return JournalStub(ch)

    async def aclose(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _backoff(self, attempt: int) -> None:
        await asyncio.sleep(min(1.0, 0.02 * (2**attempt)) * (0.5 + random.random()))

    async def append(
        self,
        journal: str,
        content: bytes | Iterable[bytes] | AsyncIterable[bytes] = b"",
        *,
        offset: int = 0,
        check_registers: pb.LabelSelector | None = None,
        union_registers: pb.LabelSet | None = None,
        subtract_registers: pb.LabelSet | None = None,
    ) -> AppendResult:
        """Append `content` atomically; returns the committed span. Retried only when `content`
        is bytes (a stream cannot be replayed) and the failure happened before any commit."""
        first = pb.AppendRequest(journal=journal, offset=offset)
        if check_registers is not None:
            first.check_registers.CopyFrom(check_registers)
        if union_registers is not None:
            first.union_registers.CopyFrom(union_registers)
        if subtract_registers is not None:
            first.subtract_registers.CopyFrom(subtract_registers)
        replayable = isinstance(content, bytes | bytearray | memoryview)
        attempt = 0
        while True:
            try:
                resp = await self._append_once(first, content)
            except grpc.RpcError as exc:
                err = map_grpc_error(exc, self.endpoint)
                if not (replayable and err.retriable and attempt < self.retries):
                    raise err from None
            else:
                if resp.status == pb.OK:
                    return AppendResult(journal, resp.commit.begin, resp.commit.end, _registers(resp.registers))
                cls = for_status(resp.status)
                if not (replayable and cls.retriable and attempt < self.retries):
                    raise cls(journal, header=resp.header)
            await self._backoff(attempt)
            attempt += 1

    async def _append_once(self, first: pb.AppendRequest, content) -> pb.AppendResponse:
        """One Append RPC. Messages are handed to grpc as an iterator (about half the cost of
        awaiting each write); the empty chunk before end-of-stream commits."""

        async def messages():
            yield first
            async for chunk in _chunks(content):
                yield pb.AppendRequest(content=chunk)
            yield pb.AppendRequest()

        call = self._stub().Append(messages())
        try:
            return await call
        except BaseException:
            call.cancel()
            raise

    async def read(
        self, journal: str, offset: int = 0, *, block: bool = False, end_offset: int = 0
    ) -> AsyncIterator[ReadChunk]:
        """Yield committed content from `offset` (-1: the write head). Non-blocking reads stop at
        the write head; blocking reads tail until `end_offset` (0: forever)."""
        attempt = 0
        while True:
            req = pb.ReadRequest(journal=journal, offset=offset, block=block, end_offset=end_offset)
            try:
                async for resp in self._stub().Read(req):
                    if resp.status == pb.OFFSET_NOT_YET_AVAILABLE:
                        return
                    if resp.status != pb.OK:
                        cls = for_status(resp.status)
                        if cls.retriable and attempt < self.retries:
                            raise _Retry
                        raise cls(journal, header=resp.header)
                    if resp.content:
                        yield ReadChunk(resp.offset, resp.content, resp.write_head)
                        offset = resp.offset + len(resp.content)
                        attempt = 0
                    elif resp.HasField("fragment"):
                        offset = max(offset, resp.offset)
                if not block or (end_offset and offset >= end_offset):
                    return
            except _Retry:
                pass
            except grpc.RpcError as exc:
                err = map_grpc_error(exc, self.endpoint)
                if not (err.retriable and attempt < self.retries):
                    raise err from None
            await self._backoff(attempt)
            attempt += 1

    async def read_all(self, journal: str, offset: int = 0, end_offset: int = 0) -> bytes:
        parts = [c.content async for c in self.read(journal, offset, end_offset=end_offset)]
        return b"".join(parts)

    async def list(self, selector: pb.LabelSelector | None = None) -> pb.ListResponse:
        try:
            async for resp in self._stub().List(pb.ListRequest(selector=selector)):
                return resp
        except grpc.RpcError as exc:
            raise map_grpc_error(exc, self.endpoint) from None
        raise TransportError(f"List from {self.endpoint} returned no response")

    async def apply(self, changes: list[pb.ApplyRequest.Change]) -> pb.ApplyResponse:
        try:
            resp = await self._stub().Apply(pb.ApplyRequest(changes=changes))
        except grpc.RpcError as exc:
            raise map_grpc_error(exc, self.endpoint) from None
        if resp.status != pb.OK:
            raise for_status(resp.status)(", ".join(c.upsert.name or c.delete for c in changes))
        return resp

    async def fragments(self, journal: str) -> pb.FragmentsResponse:
        try:
            resp = await self._stub().ListFragments(pb.FragmentsRequest(journal=journal))
        except grpc.RpcError as exc:
            raise map_grpc_error(exc, self.endpoint) from None
        if resp.status != pb.OK:
            raise for_status(resp.status)(journal, header=resp.header)
        return resp

    async def write_head(self, journal: str) -> int:
        """The journal's current write head (from a metadata-only read at -1)."""
        req = pb.ReadRequest(journal=journal, offset=-1, metadata_only=True)
        try:
            async for resp in self._stub().Read(req):
                if resp.status not in (pb.OK, pb.OFFSET_NOT_YET_AVAILABLE):
                    raise for_status(resp.status)(journal, header=resp.header)
                return resp.write_head
        except grpc.RpcError as exc:
            raise map_grpc_error(exc, self.endpoint) from None
        return 0


class _Retry(Exception):
    pass


async def _chunks(content: bytes | Iterable[bytes] | AsyncIterable[bytes]) -> AsyncIterator[bytes]:
    if isinstance(content, bytes | bytearray | memoryview):
        view = memoryview(content)
        for i in range(0, len(view), CHUNK):
            yield bytes(view[i : i + CHUNK])
    elif isinstance(content, AsyncIterable):
        async for part in content:
            for i in range(0, len(part), CHUNK):
                yield part[i : i + CHUNK]
    else:
        for part in content:
            for i in range(0, len(part), CHUNK):
                yield part[i : i + CHUNK]
