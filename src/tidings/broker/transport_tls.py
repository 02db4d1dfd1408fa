"""TLS for the replication transport: OpenSSL over memory BIOs on the loop's own TCP transport, under
the same `asyncio.Protocol`s as plaintext (`transport.py`).

Why not `loop.create_connection(ssl=...)`: asyncio's SSLProtocol (uvloop's too) spends its time in
Python machinery around each record, measured at +142 µs per replicated 1 KiB round trip (29 -> 171
µs, docs/design/production.md §2.2). Why not a non-blocking `SSLSocket`: without read-ahead OpenSSL
reads each record in two system calls (header, then body), and every call goes through Python; it
measured +35-50 µs a round trip here. `_TLSLayer` keeps the loop's C transport for the socket (one
read per readiness, writes and flow control in C) and does only the cryptography in Python:

- **Reads**: what the socket gave goes into the incoming BIO, then `SSLObject.read` is called while
  the BIO or OpenSSL holds bytes (a partial record ends it with one `SSLWantReadError`).
- **Writes**: `SSLObject.write` into the outgoing BIO (a memory BIO never blocks), whose bytes go to
  the TCP transport at once, in slices of `WRITE_SLICE` (a 64 MiB frame is not encrypted whole).
  The TCP transport's flow control (`pause_writing`/`resume_writing`, its buffer limits) is the
  connection's.
- **Handshakes** are bounded (`HANDSHAKE_TIMEOUT`: a silent client cannot hold a slot); a server
  logs one line per refused handshake, at most one per source address per `REFUSAL_LOG_EVERY`.
- **Close** aborts or closes the TCP transport (no close_notify round trip: every stream ends by a
  frame of its own).

A CA given means mutual TLS: the server requires a client certificate signed by it, and clients
verify the server's certificate for the host they dial. ALPN `tidings-replicate/1` on both ends, so
a gRPC client (ALPN h2) at this port fails its handshake with a named alert.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable, Iterable
from typing import Any, cast

from tidings.tls import TLS, RefusalLog, why_refused

__all__ = ["HANDSHAKE_TIMEOUT", "TLSListener", "contexts", "dial"]

log = logging.getLogger(__name__)

ALPN = "tidings-replicate/1"
HANDSHAKE_TIMEOUT = 5.0
READ_SIZE = 256 * 1024  # bytes decrypted before the connection parses them
RECORD_DATA = 16 * 1024  # a TLS record's plaintext at most
RECORD = RECORD_DATA + 256  # (and some)
SMALL = 1024  # a part this small is sent in one record with the start of the next
WRITE_SLICE = 256 * 1024  # bytes encrypted at a time (a 64 MiB frame is not encrypted whole)
REFUSAL_LOG_EVERY = 10.0


def contexts(tls: TLS, alpn: list[str] | None = None) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """(server, client) contexts for the data port: TLS 1.2+, ALPN (`alpn`, else replication's), mutual
    when a CA is given. (A client needs no certificate of its own unless the port asks for one.)"""
    protocols = alpn or [ALPN]
    client = tls.client_context()  # (our CA, else the system's; our certificate for the peers that ask)
    client.set_alpn_protocols(protocols)
    if tls.cert is None or tls.key is None:
        return client, client  # (a client's: it serves nothing)
    return tls.server_context(protocols), client


class _NotReplication(OSError):
    """The other side's TLS named no `tidings-replicate/1` (ALPN): another service's client or port."""


async def dial(
    host: str,
    port: int,
    ctx: ssl.SSLContext,
    protocol: Callable[[], asyncio.Protocol],
    timeout: float,
    alpn: tuple[str, ...] = (ALPN,),
) -> asyncio.Protocol:
    """Connect to `host:port`, handshake (verifying its certificate for `host`), and run `protocol()`
    over the connection, all within `timeout`; OSError naming the step and cause if any fails."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[asyncio.Protocol] = loop.create_future()
    layer: _TLSLayer | None = None
    deadline = loop.time() + timeout
    try:
        try:
            async with asyncio.timeout_at(deadline):
                made = lambda: _TLSLayer(ctx, protocol, done, host, alpn=alpn)  # noqa: E731
                _, layer = await loop.create_connection(made, host, port)
        except TimeoutError:
            raise OSError(f"not reachable within {timeout:g}s") from None
        async with asyncio.timeout_at(deadline):
            return await done
    except BaseException as exc:
        if layer is not None:
            layer.abort()
        if isinstance(exc, ssl.SSLError | TimeoutError):
            raise OSError(why_refused(exc, timeout)) from None
        raise


class TLSListener:
    """A TLS replication port: accepts, handshakes (bounded), then runs `protocol()` per connection."""

    def __init__(
        self, ctx: ssl.SSLContext, protocol: Callable[[], asyncio.Protocol], alpn: tuple[str, ...] = (ALPN,)
    ) -> None:
        self.ctx, self.protocol, self.alpn = ctx, protocol, alpn
        self._server: asyncio.Server | None = None
        self._refusals = RefusalLog("replication", REFUSAL_LOG_EVERY, log)
        self._handshaking: set[_TLSLayer] = set()  # (aborted at close: none may serve after it)
        self._closed = False

    async def start(self, host: str, port: int) -> int:
        """Listen on `host:port` (0: any free port); the port bound."""
        self._server = await asyncio.get_running_loop().create_server(self._layer, host, port, reuse_address=True)
        bound: int = self._server.sockets[0].getsockname()[1]
        return bound

    def _layer(self) -> _TLSLayer:
        layer = _TLSLayer(self.ctx, self._upper, None, refused=self._refusals.note, alpn=self.alpn)
        self._handshaking.add(layer)
        layer.settled = self._handshaking.discard
        return layer

    def _upper(self) -> asyncio.Protocol:
        if self._closed:
            raise ConnectionAbortedError("the replication port is closing")
        return self.protocol()

    def close(self) -> None:
        self._closed = True
        if self._server is not None:
            self._server.close()
        for layer in list(self._handshaking):
            layer.abort()


class _TLSLayer(asyncio.Protocol):
    """TLS between the loop's TCP transport (below) and a connection's protocol (above, through the
    `_TLSTransport` it is given once the handshake is done)."""

    def __init__(
        self,
        ctx: ssl.SSLContext,
        protocol: Callable[[], asyncio.Protocol],
        done: asyncio.Future[asyncio.Protocol] | None,  # a dialer's: the handshake's outcome
        host: str | None = None,  # a dialer's: the name the peer's certificate must carry
        refused: Callable[[Any, str], None] | None = None,  # a server's: log a refused handshake
        alpn: tuple[str, ...] = (ALPN,),  # the protocols this end speaks
    ) -> None:
        self._alpn = alpn
        self._incoming, self._outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._ssl = ctx.wrap_bio(self._incoming, self._outgoing, server_side=done is None, server_hostname=host)
        self._make, self._done, self._refused = protocol, done, refused
        self._raw: asyncio.Transport | None = None
        self._upper: asyncio.Protocol | None = None  # once the handshake is done
        self._timer: asyncio.TimerHandle | None = None
        self._lost = False
        self._error: Exception | None = None  # why the connection ended, if TLS said
        self._buf: bytearray | None = None  # (made once the handshake is done: a stranger's costs nothing)
        self.settled: Callable[[_TLSLayer], None] | None = None  # told once the handshake ended, either way

    # -- below: the TCP transport ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._raw = cast(asyncio.Transport, transport)  # (uvloop's are no asyncio.Transport subclass)
        if self._done is None:
            self._timer = asyncio.get_running_loop().call_later(HANDSHAKE_TIMEOUT, self._handshake_late)
        self._handshake()

    def data_received(self, data: bytes) -> None:
        self._incoming.write(data)
        if self._upper is None:
            self._handshake()
        else:
            self._read()

    def eof_received(self) -> bool | None:
        return False  # (close: a TLS connection cannot half-close)

    def pause_writing(self) -> None:
        if self._upper is not None:
            self._upper.pause_writing()

    def resume_writing(self) -> None:
        if self._upper is not None:
            self._upper.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self._settle()
        if self._timer is not None:
            self._timer.cancel()
        if self._upper is not None:
            self._upper.connection_lost(exc or self._error)
        elif self._done is not None and not self._done.done():
            self._done.set_exception(OSError(f"connection closed during the TLS handshake ({exc or 'by the peer'})"))

    # -- the handshake -----------------------------------------------------------------------

    def _handshake(self) -> None:
        try:
            self._ssl.do_handshake()
        except ssl.SSLWantReadError:
            self._flush()
            return
        except ssl.SSLError as exc:
            self._flush()  # (the alert tells the other side why)
            self._fail(exc)
            return
        self._flush()
        if self._timer is not None:
            self._timer.cancel()
        if self._ssl.selected_alpn_protocol() not in self._alpn:  # (OpenSSL goes on without one in common)
            spoken, wanted = self._ssl.selected_alpn_protocol() or "no", " or ".join(self._alpn)
            self._fail(_NotReplication(f"the other side speaks {spoken} ALPN, not {wanted} (another service?)"))
            return
        assert self._raw is not None
        self._settle()
        try:
            self._upper = self._make()
        except ConnectionAbortedError:  # (the port closed while this one was shaking hands)
            self.abort()
            return
        self._buf = bytearray(READ_SIZE)
        self._upper.connection_made(_TLSTransport(self, self._raw))
        if self._done is not None and not self._done.done():
            self._done.set_result(self._upper)
        if not self._lost:
            self._read()  # (application data that came with the handshake's last flight)

    def _handshake_late(self) -> None:
        if self._upper is None:
            self._fail(TimeoutError())

    def _settle(self) -> None:
        if self.settled is not None:
            self.settled(self)
            self.settled = None

    def _fail(self, exc: BaseException) -> None:
        if self._done is not None:
            if not self._done.done():
                self._done.set_exception(exc)
        elif self._refused is not None and self._raw is not None:
            self._refused(self._raw.get_extra_info("peername"), why_refused(exc, HANDSHAKE_TIMEOUT))
        self.abort()

    # -- the data ----------------------------------------------------------------------------

    def _read(self) -> None:
        """Decrypt every record that came into one reused buffer (a fresh `read(n)` allocates n bytes each
        call: 37 µs a record at 256 KiB), then hand the connection what they held at once (a 64 KiB frame
        is four records: one call to parse it, not four); the connection copies what it keeps."""
        upper, buf = self._upper, self._buf
        assert upper is not None and buf is not None
        filled = 0
        with memoryview(buf) as view:
            while not self._lost and (self._incoming.pending or self._ssl.pending()):
                if filled > len(buf) - RECORD:  # (no room for another record: hand over what is there)
                    upper.data_received(view[:filled])  # type: ignore[arg-type]  # (it takes any buffer)
                    filled = 0
                try:
                    n = cast(int, self._ssl.read(len(buf) - filled, view[filled:]))  # (the bytes read into it)
                except ssl.SSLWantReadError:  # (a partial record: the rest comes with the next read)
                    break
                except (ssl.SSLEOFError, ssl.SSLZeroReturnError):
                    self.abort()
                    break
                except ssl.SSLError as exc:  # (an alert: TLS 1.3 refuses a client's certificate only now)
                    self._error = exc
                    if self._refused is not None and self._raw is not None:  # (garbage on the port: one line)
                        why = f"TLS: {getattr(exc, 'reason', None) or exc}"
                        self._refused(self._raw.get_extra_info("peername"), why)
                    self.abort()
                    break
                if n == 0:  # (after the other side's close_notify every read is 0 and consumes nothing)
                    self.abort()
                    break
                filled += n
            if filled and not self._lost:
                upper.data_received(view[:filled])  # type: ignore[arg-type]

    def write(self, parts: Iterable[bytes | bytearray | memoryview]) -> None:
        """Encrypt `parts` and hand them to the TCP transport in one write (one per `WRITE_SLICE`).

        A small part (a frame's header) rides in the same record as the start of the part after it
        (a copy of at most one record), not in a record of its own: a record costs an encryption
        call, 22 bytes and a decryption call on the other side."""
        if self._lost or self._raw is None or self._raw.is_closing():
            return
        raw, encrypt, outgoing, head = self._raw, self._ssl.write, self._outgoing, bytearray()
        for part in parts:
            if len(part) < SMALL:
                head += part
                if len(head) >= RECORD_DATA:  # (small parts enough for a record: so `head` stays < one)
                    encrypt(head)
                    head.clear()
                continue
            view = memoryview(part)
            if head:
                cut = RECORD_DATA - len(head)
                head += view[:cut]
                encrypt(head)
                head.clear()
                view = view[cut:]
            for at in range(0, len(view), WRITE_SLICE):
                encrypt(view[at : at + WRITE_SLICE])
                if outgoing.pending >= WRITE_SLICE:
                    raw.write(outgoing.read())
                    if raw.is_closing():  # (the socket failed under a big frame: encrypt no more of it)
                        return
        if head:
            encrypt(head)
        if outgoing.pending:
            raw.write(outgoing.read())

    def _flush(self) -> None:
        if self._outgoing.pending and self._raw is not None and not self._raw.is_closing():
            self._raw.write(self._outgoing.read())

    def abort(self) -> None:
        if self._raw is not None:
            self._raw.abort()


class _TLSTransport(asyncio.Transport):
    """What `transport._Connection` uses of an asyncio.Transport: writes are encrypted, the rest is the
    TCP transport's."""

    def __init__(self, layer: _TLSLayer, raw: asyncio.Transport) -> None:
        super().__init__()
        self._layer, self._raw = layer, raw

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "ssl_object":
            return self._layer._ssl
        return self._raw.get_extra_info(name, default)

    def is_closing(self) -> bool:
        return self._raw.is_closing()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._raw.set_write_buffer_limits(high, low)

    def get_write_buffer_size(self) -> int:
        return self._raw.get_write_buffer_size()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._layer.write((data,))

    def writelines(self, list_of_data: Any) -> None:
        self._layer.write(list_of_data)

    def pause_reading(self) -> None:
        self._raw.pause_reading()

    def resume_reading(self) -> None:
        self._raw.resume_reading()

    def is_reading(self) -> bool:
        return self._raw.is_reading()

    def close(self) -> None:
        self._raw.close()

    def abort(self) -> None:
        self._raw.abort()
