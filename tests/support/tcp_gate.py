"""A TCP forwarder on a loopback port of its own that a test can shut (every connection cut, new ones
refused) and open again on the same port: a real outage of the server behind it, for one client. With
`silent`, it accepts that many connections first and never answers them: a lost SYN, or a handshake
stalled by a loaded or still-settling host."""

from __future__ import annotations

import asyncio
import contextlib


class TcpGate:
    def __init__(self, target: str = "", silent: int = 0) -> None:
        self._target = ("", 0)
        self.silent = silent  # connections still to accept and leave unanswered
        if target:
            self.aim(target)
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.port = 0
        self.connections = 0  # forwarded so far

    def aim(self, target: str) -> None:
        """Forward the connections accepted from now on to `target` (one known only after the gate's
        port was: a server announcing the gate's address)."""
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def open(self) -> TcpGate:
        self._server = await asyncio.start_server(self._forward, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def shut(self) -> None:
        """Refuse new connections and cut the open ones."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for w in list(self._writers):
            w.transport.abort()
        self._writers.clear()

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.silent > 0:
            self.silent -= 1
            self._writers.add(writer)  # (cut by `shut`, answered never)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._target)
        except OSError:
            writer.transport.abort()
            return
        self._writers.update((writer, up_writer))
        self.connections += 1
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        self._writers.difference_update((writer, up_writer))


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError, ConnectionError):
        while chunk := await reader.read(65536):
            writer.write(chunk)
            await writer.drain()
    writer.transport.abort()
