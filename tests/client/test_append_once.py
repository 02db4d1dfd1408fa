"""`AsyncClient.append_once` appends its content once (DESIGN.md invariant 2 as a lone writer sees it),
even when an attempt whose answer was lost is delivered to the primary late: after the client gave
up on it, probed the write head and tried again. The late attempt must not land a second copy, and
an attempt that lands before the retry must be found, not appended again.

The lost attempt is played by the broker's Append hook: it takes the attempt's messages and never
answers (the client times the attempt out), and the test delivers those same messages later, as a
network that held them would, against real in-process brokers."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

import tidings.broker.service as service
from tidings.broker.append_api import serve_append
from tidings.client import AsyncClient
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol import protocol_pb2_grpc as pb_grpc
from tidings.protocol.status import WrongAppendOffsetError

CONTENT = b"".join(b"line %d\n" % i for i in range(200))


class _Replayed:
    """A servicer context whose messages were already read (by the hook): they are read again, then EOF."""

    def __init__(self, context: grpc.aio.ServicerContext, messages: list[pb.AppendRequest]) -> None:
        self._context, self._messages = context, list(messages)

    async def read(self) -> Any:
        return self._messages.pop(0) if self._messages else grpc.aio.EOF

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


class _LateDelivery:
    """The brokers' Append hook: the first attempt carrying content is held and never answered (the
    client times it out); a probe (zero-byte append) after it is answered only once `release` is
    done (so a late delivery can land between the probe and the retry); the rest is served."""

    def __init__(self) -> None:
        self.held: list[pb.AppendRequest] = []
        self.probed = asyncio.Event()
        self.release: asyncio.Future[None] | None = None

    async def __call__(self, broker: Any, context: grpc.aio.ServicerContext, claims: Any) -> pb.AppendResponse:
        messages = []
        while (msg := await context.read()) is not grpc.aio.EOF:
            messages.append(msg)
        carries = any(m.content for m in messages)
        if carries and not self.held:
            self.held = messages
            await asyncio.Event().wait()  # the answer is lost
        resp = await serve_append(broker, _Replayed(context, messages), claims)
        if self.held and not carries:
            self.probed.set()
            if self.release is not None:
                await self.release
        return resp


async def _deliver(endpoint: str, messages: list[pb.AppendRequest]) -> pb.AppendResponse | grpc.aio.AioRpcError:
    """Send the held attempt's messages as they were, to the journal's brokers (the late delivery)."""
    async with grpc.aio.insecure_channel(endpoint) as channel:
        stub = pb_grpc.JournalStub(channel)  # type: ignore[no-untyped-call]
        try:
            return await stub.Append(iter(messages))
        except grpc.aio.AioRpcError as exc:
            return exc


@pytest.mark.parametrize("late", ["after the retry", "before the retry"])
async def test_a_late_delivered_attempt_never_lands_a_second_copy(cluster, monkeypatch, late: str) -> None:
    journal = "once/late"
    await cluster.create_journal(journal, 3)
    await cluster.wait_consistent(journal, 3)
    hook = _LateDelivery()
    monkeypatch.setattr(service, "serve_append", hook)
    primary = cluster.brokers[0].endpoint

    async with AsyncClient(primary) as c:
        late_task = None
        if late == "before the retry":
            delivered: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            hook.release = delivered

            async def deliver_when_probed() -> pb.AppendResponse | grpc.aio.AioRpcError:
                await hook.probed.wait()
                try:
                    return await _deliver(primary, hook.held)
                finally:
                    delivered.set_result(None)

            late_task = asyncio.ensure_future(deliver_when_probed())
        result = await c.append_once(journal, lambda: CONTENT, len(CONTENT), timeout=1.0)
        late_answer = await (late_task if late_task is not None else _deliver(primary, hook.held))
        assert hook.held and hook.probed.is_set(), "the lost attempt and a probe after it happened"
        if late == "after the retry":
            assert isinstance(late_answer, pb.AppendResponse), late_answer
            assert late_answer.status == pb.WRONG_APPEND_OFFSET, late_answer
        else:
            assert isinstance(late_answer, pb.AppendResponse) and late_answer.status == pb.OK, late_answer
        content = await c.read_all(journal)
    assert content == CONTENT, f"the journal holds {len(content)} bytes, the content is {len(CONTENT)}"
    assert (result.begin, result.end) == (0, len(CONTENT))


async def test_an_offset_the_writer_gave_that_is_not_the_head_is_its_mistake(cluster) -> None:
    """--offset the caller gave (not a lost answer): WrongAppendOffsetError, nothing appended."""
    journal = "once/offset"
    await cluster.create_journal(journal, 3)
    async with AsyncClient(cluster.brokers[0].endpoint) as c:
        await c.append(journal, b"first\n")
        with pytest.raises(WrongAppendOffsetError):
            await c.append_once(journal, lambda: CONTENT, len(CONTENT), offset=3)
        assert await c.read_all(journal) == b"first\n"
        span = await c.append_once(journal, lambda: CONTENT, len(CONTENT), offset=6)
        assert (span.begin, span.end) == (6, 6 + len(CONTENT))


async def test_a_stale_offset_after_a_lost_answer_fails_within_the_retry_policy(cluster, monkeypatch) -> None:
    """The writer's --offset is not the head, and its first attempt's answer is lost: the refusals that
    follow are definite (nothing of it can land), so it fails, not retries for ever."""
    journal = "once/stale"
    await cluster.create_journal(journal, 3)
    lost = []

    async def lose_the_first(broker: Any, context: grpc.aio.ServicerContext, claims: Any) -> pb.AppendResponse:
        messages = []
        while (msg := await context.read()) is not grpc.aio.EOF:
            messages.append(msg)
        if any(m.content for m in messages) and messages[0].HasField("offset") and not lost:
            lost.append(messages)
            await asyncio.Event().wait()  # the answer is lost
        return await serve_append(broker, _Replayed(context, messages), claims)

    monkeypatch.setattr(service, "serve_append", lose_the_first)
    async with AsyncClient(cluster.brokers[0].endpoint, retries=3) as c:
        await c.append(journal, b"first\n")
        with pytest.raises(WrongAppendOffsetError):
            await asyncio.wait_for(c.append_once(journal, lambda: CONTENT, len(CONTENT), offset=3, timeout=1.0), 60)
        assert lost and await c.read_all(journal) == b"first\n"


async def test_another_writer_moving_the_head_is_no_failure(cluster) -> None:
    """Without --offset, appends of other writers between the probe and the attempt only make it try
    again at the new head (each try is still at most once)."""
    journal = "once/busy"
    await cluster.create_journal(journal, 3)
    async with AsyncClient(cluster.brokers[0].endpoint) as c, AsyncClient(cluster.brokers[1].endpoint) as other:
        stop = asyncio.Event()

        async def busy() -> int:
            n = 0
            while not stop.is_set():
                await other.append(journal, b"other\n")
                n += 1
            return n

        writer = asyncio.ensure_future(busy())
        spans = [await c.append_once(journal, lambda: CONTENT, len(CONTENT)) for _ in range(20)]
        stop.set()
        others = await writer
        content = await c.read_all(journal)
    assert content.count(CONTENT) == 20 and content.count(b"other\n") == others > 0
    assert all(content[s.begin : s.end] == CONTENT for s in spans)
