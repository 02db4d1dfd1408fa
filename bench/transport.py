#!/usr/bin/env python3
"""Broker-to-broker replication transports: grpc.aio bidi streams against `tidings.broker.transport`.

One sender process replicates to two peer processes (this script with `--peer`), all on uvloop
and loopback. A peer answers every request with `acknowledge` set by a small
ReplicateResponse(status=OK), in order, as a broker's replica does. Requests carry the payload
in `content`. Prints one JSON line per measurement, then a table. MB = 10^6 payload bytes.

  pingpong             one peer, one 1 KiB request at a time: median / p99 latency
  replicate_sync       both peers, one 1 KiB request at a time (sent to both, both answers awaited):
                       median / p99
  replicate_pipelined  both peers, WINDOW requests in flight (16 for 1 MiB, as bench/append.py):
                       messages/s and MB/s for 1 KiB, 64 KiB and 1 MiB; median / p99 from a
                       request's write to its last answer
  client_call          a client's unary call at a time (ListFragments of the Journal service, answered
                       empty by a no-op servicer: no broker behind it): the floor every client call pays,
                       grpc.aio against the data port's framing (`transport_rpc.py`, `client/_wire.py`)
  pingpong_idle        tidings only: pingpong on a connection that also carries 1000 idle streams
                       (each opened and answered once), against the same connection without them;
                       also the time to open them and the peer's RSS growth

Every test but pingpong_idle also gives CPU per request: `sender_cpu_us` (process_time of the
sender, all its threads, over all peers) and `peer_cpu_us` (/proc utime+stime of each peer,
averaged; null when the run was too short for the clock ticks to tell). Sender and peers share
this machine's cores. How each side is used mirrors the broker: gRPC calls go through a channel
per peer with the broker's options, requests serialized by grpc (so once per peer); tidings
serializes a request once and `send`s the bytes to every peer's stream.

  bench/transport.py                      # both transports, ~1 minute
  bench/transport.py --quick              # smoke run, a few seconds
  bench/transport.py --transport tidings --seconds 5
  bench/transport.py --transport tls      # tidings plaintext beside tidings over mutual TLS

`tidings-tls` is the tidings transport over mutual TLS (`broker/transport_tls.py`): a CA and one
certificate made for the run (trustme), shared by the sender and its peers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import statistics
import sys
import time
from collections import deque
from collections.abc import Iterator
from typing import Protocol

import grpc
import uvloop
from _common import CLK_TCK, child_processes, cpu_seconds, emit, rss_kib, run

from tidings.broker.service import PEER_CHANNEL_OPTIONS, SERVER_OPTIONS
from tidings.broker.transport import Dialer, MuxReplicaStream, PeerStream, ReplicationServer, StreamError
from tidings.client._wire import WireChannel, WireStub
from tidings.protocol import protocol_pb2 as pb
from tidings.tls import TLS, load

KiB, MiB, MB = 1024, 1024 * 1024, 1_000_000
SERVICE, METHOD = "bench.Replication", "Replicate"
ACK = pb.ReplicateResponse(status=pb.OK)
MEASURE_TIMEOUT = 120.0  # seconds for one measurement: a stuck stream fails the run instead of hanging it


# -- the peers (child processes) ------------------------------------------------------------


async def grpc_replicate(_requests: object, context: grpc.aio.ServicerContext) -> None:
    """The peer's side of a gRPC stream, as the broker's Replicate servicer read and wrote it."""
    while (req := await context.read()) is not grpc.aio.EOF:
        if req.acknowledge:
            await context.write(ACK)


async def tidings_replicate(stream: PeerStream) -> None:
    while (req := await stream.recv()) is not None:
        if req.acknowledge:
            await stream.send(ACK)


class NoopJournal:
    """A Journal servicer with one no-op method: what a client call costs with no broker behind it."""

    async def ListFragments(self, request: pb.FragmentsRequest, context: object) -> pb.FragmentsResponse:
        return pb.FragmentsResponse(status=pb.OK)


async def peer_main(kind: str) -> None:
    """Serve on 127.0.0.1, print the endpoint, and run until SIGTERM or the parent closes our stdin."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)

    def stdin_readable() -> None:
        if not os.read(0, 4096):
            loop.remove_reader(0)
            stop.set()

    loop.add_reader(0, stdin_readable)
    if kind == "grpc":
        server = grpc.aio.server(options=SERVER_OPTIONS)
        handler = grpc.stream_stream_rpc_method_handler(
            grpc_replicate,
            request_deserializer=pb.ReplicateRequest.FromString,
            response_serializer=pb.ReplicateResponse.SerializeToString,
        )
        noop = grpc.unary_unary_rpc_method_handler(
            NoopJournal().ListFragments,
            request_deserializer=pb.FragmentsRequest.FromString,
            response_serializer=pb.FragmentsResponse.SerializeToString,
        )
        server.add_generic_rpc_handlers((
            grpc.method_handlers_generic_handler(SERVICE, {METHOD: handler}),
            grpc.method_handlers_generic_handler("tidings.protocol.Journal", {"ListFragments": noop}),
        ))  # fmt: skip
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            print(f"127.0.0.1:{port}", flush=True)
            await stop.wait()
        finally:
            await server.stop(0)
    else:
        tls = _tls() if kind == "tidings-tls" else None
        rs = await ReplicationServer(tidings_replicate, tls=tls, servicer=NoopJournal()).start("127.0.0.1:0")
        try:
            print(rs.endpoint, flush=True)
            await stop.wait()
        finally:
            await rs.aclose()


@contextlib.contextmanager
def peer_processes(kind: str, n: int) -> Iterator[list[tuple[str, int]]]:
    """`n` peer processes of `kind`; yield [(endpoint, pid)]; stopped by PID, whatever happens."""
    with child_processes([[os.path.abspath(__file__), "--peer", kind]] * n, f"{kind} peer") as peers:
        yield peers


def per_message_us(cpu: float, count: int) -> float | None:
    """CPU per message in µs; None when `cpu` is too few clock ticks to tell (a short --quick run)."""
    return round(cpu / count * 1e6, 1) if cpu * CLK_TCK >= 5 else None


# -- the sender's side: one replication to a set of peers, per transport -------------------


class Fanout(Protocol):
    """Streams to some peers: write a request to all of them, read each one's answers."""

    async def write(self, req: pb.ReplicateRequest) -> None: ...

    async def read(self, i: int) -> pb.ReplicateResponse | None:
        """Peer i's next answer (checked OK), or None at its end of stream."""

    async def close_send(self) -> None: ...


class Transport(Protocol):
    name: str

    def open(self, endpoints: list[str]) -> Fanout: ...

    async def aclose(self) -> None: ...


def checked(resp: pb.ReplicateResponse, endpoint: str) -> pb.ReplicateResponse:
    if resp.status != pb.OK:
        raise RuntimeError(f"peer {endpoint} answered {pb.Status.Name(resp.status)}")
    return resp


class GrpcFanout:
    def __init__(self, calls: list[grpc.aio.StreamStreamCall], endpoints: list[str]) -> None:
        self.calls = calls
        self.endpoints = endpoints

    async def write(self, req: pb.ReplicateRequest) -> None:
        for call in self.calls:
            await call.write(req)

    async def read(self, i: int) -> pb.ReplicateResponse | None:
        resp = await self.calls[i].read()
        return None if resp is grpc.aio.EOF else checked(resp, self.endpoints[i])

    async def close_send(self) -> None:
        for call in self.calls:
            await call.done_writing()


class GrpcTransport:
    name = "grpc"

    def __init__(self) -> None:
        self.channels: dict[str, grpc.aio.Channel] = {}

    def open(self, endpoints: list[str]) -> GrpcFanout:
        calls = []
        for ep in endpoints:
            if ep not in self.channels:
                self.channels[ep] = grpc.aio.insecure_channel(ep, options=PEER_CHANNEL_OPTIONS)
            method = self.channels[ep].stream_stream(
                f"/{SERVICE}/{METHOD}",
                request_serializer=pb.ReplicateRequest.SerializeToString,
                response_deserializer=pb.ReplicateResponse.FromString,
            )
            calls.append(method())
        return GrpcFanout(calls, endpoints)

    async def aclose(self) -> None:
        for ch in self.channels.values():
            await ch.close()


class TidingsFanout:
    def __init__(self, streams: list[MuxReplicaStream]) -> None:
        self.streams = streams

    async def write(self, req: pb.ReplicateRequest) -> None:
        data = req.SerializeToString()  # once, for every peer (as the pipeline does)
        for s in self.streams:
            s.send(data)
        for s in self.streams:
            await s.drain()

    async def read(self, i: int) -> pb.ReplicateResponse | None:
        resp = await self.streams[i].recv()
        return None if resp is None else checked(resp, self.streams[i].endpoint)

    async def close_send(self) -> None:
        for s in self.streams:
            s.close_send()


def _tls() -> TLS:
    """The run's certificate and CA (made by `main` into TIDINGS_BENCH_CERTS)."""
    d = os.environ["TIDINGS_BENCH_CERTS"]
    tls = load(f"{d}/cert.pem", f"{d}/key.pem", f"{d}/ca.pem", "bench", server=True)
    assert tls is not None
    return tls


def make_certs(d: str) -> None:
    import trustme

    ca = trustme.CA()
    ca.cert_pem.write_to_path(f"{d}/ca.pem")
    cert = ca.issue_cert("127.0.0.1")
    cert.cert_chain_pems[0].write_to_path(f"{d}/cert.pem")
    cert.private_key_pem.write_to_path(f"{d}/key.pem")


class TidingsTransport:
    name = "tidings"

    def __init__(self, tls: TLS | None = None) -> None:
        self.dialer = Dialer(tls)

    def open(self, endpoints: list[str]) -> TidingsFanout:
        return TidingsFanout([self.dialer.open(ep) for ep in endpoints])

    async def aclose(self) -> None:
        await self.dialer.aclose()


async def finish(f: Fanout, n: int) -> None:
    """End the streams cleanly: close our side, then every peer must end its side with nothing more."""
    await f.close_send()
    for i in range(n):
        if (extra := await f.read(i)) is not None:
            raise RuntimeError(f"peer {i} answered a request it was not sent: {extra}")


# -- measurements ------------------------------------------------------------------------------


def quantiles(lat: list[float]) -> dict:
    lat = sorted(lat)
    return {
        "median_us": round(statistics.median(lat) * 1e6, 1),
        "p99_us": round(lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e6, 1),
    }


def request(size: int) -> pb.ReplicateRequest:
    return pb.ReplicateRequest(content=os.urandom(size), acknowledge=True)


async def round_trips(f: Fanout, n: int, req: pb.ReplicateRequest, count: int) -> list[float]:
    """`count` requests one at a time, each written to the n peers and answered by all of them."""
    lat = []
    for _ in range(count):
        t = time.perf_counter()
        await f.write(req)
        for i in range(n):
            if await f.read(i) is None:
                raise RuntimeError(f"peer {i} ended its stream early")
        lat.append(time.perf_counter() - t)
    return lat


async def sequential(t: Transport, peers: list[tuple[str, int]], size: int, count: int, warmup: int) -> dict:
    """One request at a time to every peer in `peers` (pingpong with one, replicate_sync with two)."""
    f = t.open([ep for ep, _ in peers])
    req = request(size)
    await round_trips(f, len(peers), req, warmup)
    cpu, peer_cpu = time.process_time(), sum(cpu_seconds(pid) for _, pid in peers)
    lat = await round_trips(f, len(peers), req, count)
    cpu, peer_cpu = time.process_time() - cpu, sum(cpu_seconds(pid) for _, pid in peers) - peer_cpu
    await finish(f, len(peers))
    return {
        "test": "pingpong" if len(peers) == 1 else "replicate_sync",
        "peers": len(peers),
        "payload_bytes": size,
        **quantiles(lat),
        "msgs_per_s": round(count / sum(lat)),
        "sender_cpu_us": round(cpu / count * 1e6, 1),
        "peer_cpu_us": per_message_us(peer_cpu / len(peers), count),
        "count": count,
    }


async def pipelined(t: Transport, peers: list[tuple[str, int]], size: int, seconds: float, window: int) -> dict:
    """Up to `window` requests in flight to every peer for `seconds`; a request is done when all answered."""
    n = len(peers)
    f = t.open([ep for ep, _ in peers])
    req = request(size)
    await round_trips(f, n, req, 10)  # connected, and the peers' handlers running
    room = asyncio.Semaphore(window)
    acked = [0] * n
    started: deque[float] = deque()
    lat: list[float] = []

    failed: list[Exception] = []
    closing = False

    async def reader(i: int) -> None:
        try:
            while await f.read(i) is not None:
                acked[i] += 1
                if all(acked[i] <= acked[j] for j in range(n) if j != i):  # the last peer to answer this one
                    lat.append(time.perf_counter() - started.popleft())
                    room.release()
            if not closing:
                raise RuntimeError(f"peer {i} ended its stream early")
        except Exception as exc:
            failed.append(exc)
            room.release()  # wakes the sender, which then raises it
            raise

    async def take() -> None:
        await room.acquire()
        if failed:
            raise failed[0]

    readers = [asyncio.ensure_future(reader(i)) for i in range(n)]
    try:
        cpu, peer_cpu = time.process_time(), sum(cpu_seconds(pid) for _, pid in peers)
        t0 = time.perf_counter()
        deadline = t0 + seconds
        sent = 0
        while time.perf_counter() < deadline:
            await take()
            started.append(time.perf_counter())
            await f.write(req)
            sent += 1
        for _ in range(window):  # every request answered by every peer
            await take()
        elapsed = time.perf_counter() - t0
        cpu, peer_cpu = time.process_time() - cpu, sum(cpu_seconds(pid) for _, pid in peers) - peer_cpu
        closing = True
        await f.close_send()
        await asyncio.gather(*readers)
    finally:
        for r in readers:
            r.cancel()
    if acked != [sent] * n:
        raise RuntimeError(f"sent {sent} requests, the peers answered {acked}")
    return {
        "test": "replicate_pipelined",
        "peers": n,
        "payload_bytes": size,
        **quantiles(lat),
        "msgs_per_s": round(sent / elapsed),
        "mb_per_s": round(sent * size / elapsed / MB, 1),
        "sender_cpu_us": round(cpu / sent * 1e6, 1),
        "peer_cpu_us": per_message_us(peer_cpu / n, sent),
        "window": window,
        "count": sent,
    }


async def client_call(kind: str, peer: tuple[str, int], count: int, warmup: int) -> dict:
    """Unary no-op calls one at a time from a client: a grpc.aio channel, or the data port's WireChannel."""
    endpoint, pid = peer
    req = pb.FragmentsRequest(journal="bench/noop")
    if kind == "grpc":
        channel = grpc.aio.insecure_channel(endpoint)
        call = channel.unary_unary(
            "/tidings.protocol.Journal/ListFragments",
            request_serializer=pb.FragmentsRequest.SerializeToString,
            response_deserializer=pb.FragmentsResponse.FromString,
        )
        close = channel.close
    else:
        wire = WireChannel(endpoint, _tls() if kind == "tidings-tls" else None)
        call, close = WireStub(wire).ListFragments, wire.close

    async def calls(n: int) -> list[float]:
        lat = []
        for _ in range(n):
            t = time.perf_counter()
            if (await call(req)).status != pb.OK:
                raise RuntimeError("the no-op servicer answered an error")
            lat.append(time.perf_counter() - t)
        return lat

    try:
        await calls(warmup)
        cpu, peer_cpu = time.process_time(), cpu_seconds(pid)
        lat = await calls(count)
        cpu, peer_cpu = time.process_time() - cpu, cpu_seconds(pid) - peer_cpu
    finally:
        await close()
    return {
        "test": "client_call",
        "peers": 1,
        "payload_bytes": 0,
        **quantiles(lat),
        "msgs_per_s": round(count / sum(lat)),
        "sender_cpu_us": round(cpu / count * 1e6, 1),
        "peer_cpu_us": per_message_us(peer_cpu, count),
        "count": count,
    }


async def pingpong_idle(t: TidingsTransport, peer: tuple[str, int], idle: int, count: int, warmup: int) -> dict:
    """Pingpong on one connection, then again with `idle` more streams open on it (each answered once)."""
    endpoint, pid = peer
    base = t.open([endpoint])
    req = request(KiB)
    await round_trips(base, 1, req, warmup)
    before = await round_trips(base, 1, req, count)
    rss = rss_kib(pid)
    t0 = time.perf_counter()
    others = [t.open([endpoint]) for _ in range(idle)]
    small = pb.ReplicateRequest(acknowledge=True)
    for o in others:
        await o.write(small)
    for o in others:
        if await o.read(0) is None:
            raise RuntimeError("an idle stream was ended by its peer")
    opened = time.perf_counter() - t0
    rss_growth = rss_kib(pid) - rss
    # No public way to ask which connection a stream uses; the point of the test is that it is one.
    connections = len({id(o.streams[0]._conn) for o in [base, *others]})
    if connections != 1:
        raise RuntimeError(f"{idle + 1} streams to one peer use {connections} connections, expected 1")
    await round_trips(base, 1, req, warmup)
    after = await round_trips(base, 1, req, count)
    for o in others:
        await finish(o, 1)
    await finish(base, 1)
    q0, q1 = quantiles(before), quantiles(after)
    return {
        "test": "pingpong_idle",
        "peers": 1,
        "payload_bytes": KiB,
        "idle_streams": idle,
        **q1,
        "baseline_median_us": q0["median_us"],
        "baseline_p99_us": q0["p99_us"],
        "open_idle_ms": round(opened * 1e3, 1),
        "peer_rss_growth_kib": rss_growth,
        "count": count,
    }


async def bench(kind: str, peers: list[tuple[str, int]], args: argparse.Namespace, recs: list[dict]) -> None:
    t: Transport = GrpcTransport() if kind == "grpc" else TidingsTransport(_tls() if kind == "tidings-tls" else None)

    def out(rec: dict) -> None:
        recs.append(emit(rec, transport=kind))

    try:
        async with asyncio.timeout(MEASURE_TIMEOUT):
            out(await sequential(t, peers[:1], KiB, args.count, args.warmup))
        async with asyncio.timeout(MEASURE_TIMEOUT):
            out(await sequential(t, peers, KiB, args.count, args.warmup))
        async with asyncio.timeout(MEASURE_TIMEOUT):
            out(await client_call(kind, peers[0], args.count, args.warmup))
        for size in (KiB, 64 * KiB, MiB):
            async with asyncio.timeout(MEASURE_TIMEOUT):
                out(await pipelined(t, peers, size, args.seconds, args.window if size < MiB else min(args.window, 16)))
        if isinstance(t, TidingsTransport):
            async with asyncio.timeout(MEASURE_TIMEOUT):
                out(await pingpong_idle(t, peers[0], args.idle_streams, args.count, args.warmup))
    finally:
        await t.aclose()


def cell(rec: dict, key: str) -> str:
    return "" if rec.get(key) is None else str(rec[key])


def table(recs: list[dict]) -> None:
    print(
        f"\n{'transport':<9} {'test':<20} {'peers':>5} {'payload':>8} {'median_us':>10} {'p99_us':>8} "
        f"{'msg/s':>8} {'MB/s':>7} {'cpu_us':>7} {'peer_cpu_us':>11}"
    )
    for x in recs:
        print(
            f"{x['transport']:<9} {x['test']:<20} {x['peers']:>5} {x['payload_bytes']:>8} {x['median_us']:>10} "
            f"{x['p99_us']:>8} {cell(x, 'msgs_per_s'):>8} {cell(x, 'mb_per_s'):>7} "
            f"{cell(x, 'sender_cpu_us'):>7} {cell(x, 'peer_cpu_us'):>11}"
        )
        if x["test"] == "pingpong_idle":
            print(
                f"{'':<9} {'  without them':<20} {x['peers']:>5} {x['payload_bytes']:>8} "
                f"{x['baseline_median_us']:>10} {x['baseline_p99_us']:>8}"
            )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--transport", choices=("grpc", "tidings", "tidings-tls", "both", "tls"), default="both")
    p.add_argument("--quick", action="store_true", help="small counts: a smoke run of a few seconds")
    p.add_argument("--count", type=int, default=5000, help="requests timed in each sequential test")
    p.add_argument("--warmup", type=int, default=500, help="untimed requests before each sequential test")
    p.add_argument("--seconds", type=float, default=5.0, help="per pipelined measurement")
    p.add_argument("--window", type=int, default=64, help="requests in flight when pipelined (1 MiB: at most 16)")
    p.add_argument("--idle-streams", type=int, default=1000, help="idle streams beside the pingpong (tidings)")
    p.add_argument(
        "--peer", choices=("grpc", "tidings", "tidings-tls"), help=argparse.SUPPRESS
    )  # a child process of this script
    args = p.parse_args()
    if args.peer:
        uvloop.run(peer_main(args.peer))
        return 0
    if args.quick:
        args.count, args.warmup, args.seconds = 300, 50, 0.3
    if min(args.count, args.window, args.idle_streams) < 1 or args.warmup < 0 or args.seconds <= 0:
        p.error("--count, --window and --idle-streams must be at least 1, --warmup at least 0, --seconds over 0")
    recs: list[dict] = []
    kinds = {"both": ("grpc", "tidings"), "tls": ("tidings", "tidings-tls")}.get(args.transport, (args.transport,))
    if "tidings-tls" in kinds and "TIDINGS_BENCH_CERTS" not in os.environ:
        import tempfile

        os.environ["TIDINGS_BENCH_CERTS"] = tempfile.mkdtemp(prefix="tidings-bench-certs-")
        make_certs(os.environ["TIDINGS_BENCH_CERTS"])
    for kind in kinds:
        try:
            with peer_processes(kind, 2) as peers:
                run(bench(kind, peers, args, recs))
        except (StreamError, grpc.RpcError, RuntimeError) as exc:  # a peer died, or answered wrongly
            why = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError) else exc
            print(f"transport.py: {kind}: {why}", file=sys.stderr)
            return 1
        except TimeoutError:
            print(f"transport.py: {kind}: a measurement took over {MEASURE_TIMEOUT:.0f}s (stuck?)", file=sys.stderr)
            return 1
    table(recs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
