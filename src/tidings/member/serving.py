"""What every tidings server process shares: its gRPC server bound to --listen (the address checked
first, so a taken port is one line), Prometheus /metrics, and RPCs counted by outcome."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import socketserver
import ssl
import threading
from collections.abc import Iterator
from typing import Any
from wsgiref.simple_server import ServerHandler, WSGIRequestHandler, WSGIServer

import grpc
from prometheus_client import Counter

from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.status import UsageError
from tidings.tls import TLS, RefusalLog, canonical_endpoint, server_port, why_refused

__all__ = [
    "advertised",
    "check_listen",
    "counted",
    "host_of",
    "listen_grpc",
    "metrics_tls",
    "serve_metrics",
    "stop_metrics",
]

log = logging.getLogger(__name__)

WILDCARDS = {"", "0.0.0.0", "::", "[::]"}  # (hosts a server may listen on but nobody can dial)


def check_listen(listen: str) -> None:
    """Raise OSError if ``HOST:PORT`` cannot be bound (port taken, address not this host's)."""
    host, _, port = listen.rpartition(":")
    host = host.strip("[]")
    if not port.isdigit():
        raise OSError(f"{port!r} is not a port number")
    for family, kind, proto, _name, addr in socket.getaddrinfo(host or None, int(port), type=socket.SOCK_STREAM):
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC does: TIME_WAIT is no conflict
            s.bind(addr)


def listen_grpc(server: grpc.aio.Server, listen: str, who: str, tls: TLS | None = None) -> str:
    """Bind `server` to `listen` (HOST:PORT, port 0: any free one; with `tls`, serving TLS) and return
    the endpoint it serves on; an address this process cannot take is a UsageError naming `who` and --listen."""
    try:
        check_listen(listen)  # gRPC would fail too, but first print its own error line
        port = server_port(server, listen, tls)
    except (OSError, RuntimeError) as err:
        raise UsageError(f"{who} cannot listen on {listen} ({err}); pass another --listen") from None
    return f"{listen.rsplit(':', 1)[0]}:{port}"


def advertised(bound: str, advertise: str, who: str, flag: str = "--advertise") -> str:
    """The endpoint other hosts dial for a service bound at `bound` (HOST:PORT): `advertise` (HOST or
    HOST:PORT; an IPv6 literal in brackets, announced in its shortest form) with the bound port unless it
    gives one, else `bound` itself; a wildcard `bound` host without `advertise` is a UsageError (nobody
    could dial it)."""
    port = bound.rpartition(":")[2]
    if advertise:
        host, given = _host_port(advertise, who, flag)
        host = host_of(canonical_endpoint(f"{host}:"))
        if host.strip("[]") in WILDCARDS or given == "0":
            raise UsageError(
                f"{who}: {flag} {advertise} is not an address others can dial: give this host's name or address"
                " (and the port they reach it at, if not the one it listens on)"
            )
        return f"{host}:{given or port}"
    bound = canonical_endpoint(bound)
    if host_of(bound) in WILDCARDS:
        raise UsageError(
            f"{who} listens on {bound} but would announce an address nobody can dial: pass {flag} HOST[:PORT] "
            "(the address other hosts reach it at)"
        )
    return bound


def _port_or_none(port: str) -> bool:
    """Whether `port` is empty or a TCP port number (ASCII digits, at most 65535)."""
    return port == "" or (port.isascii() and port.isdigit() and int(port) <= 65535)


def _ipv6(literal: str) -> bool:
    try:
        ipaddress.IPv6Address(literal)
    except ValueError:
        return False
    return True


def _host_port(text: str, who: str, flag: str) -> tuple[str, str]:
    """(HOST, PORT or "") of HOST, HOST:PORT, [IPv6] or [IPv6]:PORT."""
    if text.startswith("["):
        literal, closed, rest = text[1:].partition("]")
        if (
            closed
            and _ipv6(literal)
            and (rest == "" or (rest.startswith(":") and rest[1:] and _port_or_none(rest[1:])))
        ):
            return f"[{literal}]", rest[1:]
    elif text.count(":") <= 1:
        host, _, port = text.partition(":")
        if host and _port_or_none(port) and not text.endswith(":"):
            return host, port
    raise UsageError(f"{who}: {flag} {text!r} is not HOST, HOST:PORT or [IPv6]:PORT (an IPv6 literal in brackets)")


def host_of(endpoint: str) -> str:
    """HOST of HOST:PORT (an IPv6 literal keeps its brackets)."""
    return endpoint.rpartition(":")[0]


def metrics_tls(on: bool, tls: TLS | None, who: str) -> TLS | None:
    """The TLS /metrics serves with when `on` (--metrics-tls): the process's own certificate; a UsageError
    of one line when it has none."""
    if not on:
        return None
    if tls is None or tls.cert is None or tls.key is None:
        raise UsageError(
            f"{who}: --metrics-tls serves /metrics with this process's certificate: give --tls-cert and --tls-key"
        )
    return tls


def serve_metrics(listen: str, host: str, port: int, who: str, tls: TLS | None = None) -> tuple[Any, str]:
    """Serve /metrics on `listen` (HOST:PORT), or with "auto" on the gRPC `port` + 1000 of `host` (any
    free port if that one is taken); over TLS with `tls`'s certificate (--metrics-tls); the server and
    the endpoint it serves on."""
    from prometheus_client import start_http_server

    tries = [listen.rsplit(":", 1)]
    if listen == "auto":
        tries = [[host, str(port + 1000 if 0 < port <= 64535 else 0)], [host, "0"]]
    for i, (mhost, mport) in enumerate(tries):
        try:
            if tls is None:
                server, _thread = start_http_server(int(mport), addr=mhost.strip("[]"))  # (an IPv6 literal: bare)
            else:
                server = _serve_metrics_tls(mhost.strip("[]"), int(mport), tls.server_context(), who)
        except OSError as err:
            if i + 1 < len(tries):
                continue
            raise UsageError(f"{who} cannot serve metrics on {mhost}:{mport} ({err}): pass another --metrics") from None
        return server, f"{mhost}:{server.server_port}"
    raise AssertionError("unreachable")


METRICS_HANDSHAKE_TIMEOUT = 5.0  # seconds a scraper has to finish its TLS handshake
METRICS_DEADLINE = 30.0  # and a connection to be done, all in all (a scraper trickling bytes is cut then)
METRICS_CONNECTIONS = 64  # connections served at once; more are closed at once (a scraper needs a few)


class _Answer(ServerHandler):
    def log_exception(self, exc_info: Any) -> None:
        if not isinstance(exc_info[1], OSError):  # (a scraper gone mid-answer, a timeout: nothing to tell)
            log.warning("/metrics: %s", exc_info[1] or type(exc_info[1]).__name__)  # (one line, not a traceback)


class _Quiet(WSGIRequestHandler):
    """The stdlib's handler, but quiet: no line per scrape, and no traceback on stderr when a scraper
    hangs up mid-answer (TLS reports it as errors the stdlib does not expect)."""

    def log_message(self, format: str, *args: Any) -> None:  # (the stdlib's name)
        pass

    def handle(self) -> None:  # (the stdlib's, with _Answer)
        self.raw_requestline = self.rfile.readline(65537)
        if len(self.raw_requestline) > 65536:
            self.requestline, self.request_version, self.command = "", "", ""
            self.send_error(414)
            return
        if not self.parse_request():
            return
        answer = _Answer(self.rfile, self.wfile, self.get_stderr(), self.get_environ(), multithread=False)  # type: ignore[arg-type]  # (a socket file)
        answer.request_handler = self  # type: ignore[attr-defined]  # (the stdlib's back-pointer for logging)
        answer.run(self.server.get_app())  # type: ignore[attr-defined]  # (a WSGIServer's)


class _MetricsTLSServer(socketserver.ThreadingMixIn, WSGIServer):
    """/metrics over TLS. prometheus_client's own TLS wraps the listening socket, so the handshake runs in
    the accepting thread, unbounded: one client that connects and says nothing stalls every scrape. Here
    each connection shakes hands in its own thread within METRICS_HANDSHAKE_TIMEOUT, is cut after
    METRICS_DEADLINE whatever it does, and at most METRICS_CONNECTIONS are served at once."""

    daemon_threads = True
    context: ssl.SSLContext
    refusals: RefusalLog
    slots: threading.BoundedSemaphore

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            self.refusals.note(client_address, f"{METRICS_CONNECTIONS} connections already open")
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)  # (a thread of its own)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            cut = request.dup()  # (ours: shutting it down ends the connection, TLS-wrapped or not)
        except OSError:  # (out of descriptors: this connection is not served, its slot given back)
            self.shutdown_request(request)
            self.slots.release()
            return
        deadline = threading.Timer(METRICS_DEADLINE, _shut, (cut,))
        deadline.daemon = True
        try:
            deadline.start()
            super().process_request_thread(request, client_address)
        finally:
            deadline.cancel()
            if deadline.is_alive():
                deadline.join()  # (a cut under way finishes first: `cut`'s descriptor is not reused under it)
            cut.close()
            self.slots.release()

    def finish_request(self, request: Any, client_address: Any) -> None:
        request.settimeout(METRICS_HANDSHAKE_TIMEOUT)
        try:
            conn = self.context.wrap_socket(request, server_side=True)
        except (OSError, ValueError) as exc:  # (ssl.SSLError is an OSError; a timeout too)
            self.refusals.note(client_address, why_refused(exc, METRICS_HANDSHAKE_TIMEOUT))
            return
        with conn:
            conn.settimeout(METRICS_DEADLINE)
            self.RequestHandlerClass(conn, client_address, self)  # type: ignore[arg-type]  # (stdlib stubs' Self)

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # (a scraper that went away mid-answer, or was cut: nothing to tell)


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):  # (already closed: the connection ended by itself)
        sock.shutdown(socket.SHUT_RDWR)


def _serve_metrics_tls(addr: str, port: int, context: ssl.SSLContext, who: str) -> _MetricsTLSServer:
    from prometheus_client import make_wsgi_app

    family = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    server_class: type[_MetricsTLSServer] = type("_MetricsTLSServer", (_MetricsTLSServer,), {"address_family": family})
    server = server_class((addr, port), _Quiet)
    server.context, server.refusals = context, RefusalLog(f"{who}: /metrics", logger=log)
    server.slots = threading.BoundedSemaphore(METRICS_CONNECTIONS)
    server.set_app(make_wsgi_app())
    threading.Thread(target=server.serve_forever, name="metrics-tls", daemon=True).start()
    return server


def stop_metrics(server: Any) -> None:
    if server is not None:
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def counted(counter: Counter, rpc: str, context: grpc.aio.ServicerContext) -> Iterator[list[int]]:
    """Count one RPC in `counter` (labels rpc, status) by its outcome: the Status the body appends to
    the list yielded, else the gRPC code it aborted with (CANCELLED when the client went away,
    UNKNOWN for a surprise)."""
    outcome: list[int] = []
    try:
        yield outcome
    except grpc.aio.AbortError:
        code = context.code()
        counter.labels(rpc, code.name if isinstance(code, grpc.StatusCode) else "ABORTED").inc()
        raise
    except asyncio.CancelledError:
        counter.labels(rpc, "CANCELLED").inc()
        raise
    except Exception:
        counter.labels(rpc, "UNKNOWN").inc()
        raise
    else:
        counter.labels(rpc, pb.Status.Name(outcome[-1]) if outcome else "OK").inc()
