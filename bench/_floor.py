#!/usr/bin/env python3
"""A no-op Journal server: the floor under tidings appends, which is grpc.aio itself.

`python bench/_floor.py --listen 127.0.0.1:0` serves, on uvloop with the broker's SERVER_OPTIONS,
a JournalServicer that implements only `Append`: it reads the request stream to its end, as the
broker's append_api does (`context.read()` until EOF), and answers status OK with a Header whose
Route names this server as the journal's primary and a commit Fragment that advances a per-journal
write head by the content's size. Its sum is a fixed 20-byte value (the broker sends the content's
SHA1): the size of the answer is the broker's, the hashing is not done. Nothing is stored or checked.
The client (`AsyncClient.append`) needs no List: it sends to its configured broker until a response
Header gives it a Route, and this one names the same endpoint.

It prints its endpoint on one line and runs until SIGTERM or until its stdin is closed.
`floor_server()` starts one as a child process and stops it by PID, whatever happens.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Iterator

import grpc
import uvloop
from _common import child_processes

from tidings.broker.service import SERVER_OPTIONS
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol import protocol_pb2_grpc as pb_grpc

FAKE_SUM = bytes(range(20))  # a SHA1's size


class NoopJournal(pb_grpc.JournalServicer):
    """Append only: read to end-of-stream, answer OK with a plausible commit. The rest is UNIMPLEMENTED."""

    def __init__(self, endpoint: str) -> None:
        self.header = pb.Header(
            process_id=pb.ProcessId(zone="floor", suffix="floor-0"),
            route=pb.Route(members=[pb.ProcessId(zone="floor", suffix="floor-0")], primary=0, endpoints=[endpoint]),
            etcd=pb.Header.Etcd(cluster_id=1, member_id=1, revision=1, raft_term=1),
        )
        self.heads: dict[str, int] = {}

    async def Append(self, request_iterator, context: grpc.aio.ServicerContext) -> pb.AppendResponse:
        first = await context.read()
        if first is grpc.aio.EOF:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "append: empty stream; send the journal first")
        journal = first.journal
        size = len(first.content)
        while (msg := await context.read()) is not grpc.aio.EOF:
            size += len(msg.content)
        begin = self.heads.get(journal, 0)
        self.heads[journal] = end = begin + size
        return pb.AppendResponse(
            status=pb.OK,
            header=self.header,
            commit=pb.Fragment(journal=journal, begin=begin, end=end, sum=FAKE_SUM, compression_codec=pb.NONE),
        )


async def serve(listen: str) -> None:
    """Serve until SIGTERM or until the parent closes our stdin."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)

    def stdin_readable() -> None:
        if not os.read(0, 4096):
            loop.remove_reader(0)
            stop.set()

    loop.add_reader(0, stdin_readable)
    server = grpc.aio.server(options=SERVER_OPTIONS)
    host = listen.rsplit(":", 1)[0]
    port = server.add_insecure_port(listen)
    endpoint = f"{host}:{port}"
    pb_grpc.add_JournalServicer_to_server(NoopJournal(endpoint), server)
    await server.start()
    try:
        print(endpoint, flush=True)
        await stop.wait()
    finally:
        await server.stop(0)


@contextlib.contextmanager
def floor_server() -> Iterator[tuple[str, int]]:
    """Start the no-op server as a child process; yield (endpoint, pid); stop it by PID, whatever happens."""
    with child_processes([[os.path.abspath(__file__), "--listen", "127.0.0.1:0"]], "floor server") as started:
        yield started[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--listen", default="127.0.0.1:0", help="host:port to serve on (port 0: any free one)")
    uvloop.run(serve(p.parse_args().listen))


if __name__ == "__main__":
    sys.exit(main())
