"""A LogPlayer target: a storage shard that applies its part of every WAL entry, in order, once
(logplayer-paper.txt, section 2: "a target must make sure consuming an entry happens atomically
together with durably storing the index of the entry").

`TargetStore` keeps the target's state in one SQLite file (apsw, WAL mode, synchronous=FULL): the
last applied index, the newest LogPlayer epoch it accepted, the data (a key-value table by
default) and, optionally, an apply log (one row per applied entry, for tests and benchmarks).
A batch is applied in one SQLite transaction together with its last index, so a crash leaves the
target either before or after the whole batch. The apply function is the user's: called with the
connection (inside the transaction) and each `pb.TargetEntry`; `apply_key_values` by default.

`TargetService` serves the Target gRPC service (protocol.proto):

* `Deliver` (bidi): the first request opens the stream for a LogPlayer (target id, epoch, nonce).
  An (epoch, nonce) older than the newest the target accepted is refused (TARGET_FENCED), so two
  LogPlayers started by mistake cannot both deliver; an equal or newer one takes the target over
  (an older stream's next batch is refused; one of the same LogPlayer's is aborted, so that it
  reconnects), once the apply in progress ended (even one whose stream was cancelled), and is answered with
  the last applied index: the LogPlayer's `last_ack` for the stream. Each later request is a
  batch; it must follow what the target applied (`prev_index`) with increasing indices, else
  WRONG_TARGET_INDEX (the LogPlayer reconnects and recovers the target: a target is never asked
  to trust a gap or a repeat). Each applied batch is answered with its last index.
* `GetLastAck`: the last applied index and the newest epoch (a LogPlayer's start, `targets status`),
  and the target's data port.

Both are served over gRPC on `listen` and over tidings' own framing on a data port (the same host, any
free port: `broker/transport_rpc.py`'s TARGET service, the same `TargetService` methods, TLS and
tokens), which GetLastAck answers name and a LogPlayer delivers over by default (`stream.py`).

Statuses come back in responses; a non-OK one ends the stream. A user's apply function that
raises rolls its batch back and ends the stream with gRPC INTERNAL (logged with the entry's
index): the LogPlayer retries, as a Kafka consumer stays on a message it cannot process.

With `auth_keys` (`--auth-keys`) both RPCs first check the caller's token: APPEND for Deliver, READ for
GetLastAck, over the target's meta-label `target=<id>`. A token whose selector does not cover this
target gets the answer a wrong target id gets (TARGET_NOT_FOUND, naming nothing it may not see); a
Deliver stream outliving its token has its next batch refused (UNAUTHENTICATED, nothing applied), and
the LogPlayer reconnects with a fresh token (its keys sign one) and recovers the target.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import apsw
import grpc
from prometheus_client import Counter, Gauge

from tidings.auth import AuthError, KeySet, NoVerifier, Verifier, expires_at, verifier_of
from tidings.broker.transport import ReplicationServer
from tidings.broker.transport_rpc import TARGET
from tidings.logplayer.dispatcher import NOTHING
from tidings.logplayer.stream import MESSAGE_OPTIONS
from tidings.member.serving import listen_grpc, metrics_tls, serve_metrics, stop_metrics
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol import protocol_pb2_grpc as pb_grpc
from tidings.protocol.claims import Capability, Claims, covers
from tidings.protocol.labels import target_labels
from tidings.protocol.status import UsageError
from tidings.tasks import to_the_end
from tidings.tls import TLS

__all__ = ["ApplyFn", "TargetServer", "TargetService", "TargetStore", "WrongIndex", "apply_key_values"]

log = logging.getLogger(__name__)

ApplyFn = Callable[[apsw.Connection, pb.TargetEntry], None]

ENTRIES = Counter("tidings_target_entries_applied_total", "WAL entries applied (dummy ones included)", ["target"])
BATCHES = Counter("tidings_target_batches_total", "Deliver batches by outcome", ["target", "status"])
LAST_APPLIED = Gauge("tidings_target_last_applied", "The index of the last applied WAL entry", ["target"])

KV_TABLE = "CREATE TABLE IF NOT EXISTS kv (key TEXT PRIMARY KEY NOT NULL, value BLOB NOT NULL)"
APPLIED_TABLE = (  # the apply log (--log-applied): what bench/logplayer.py measures
    "CREATE TABLE IF NOT EXISTS applied (seq INTEGER PRIMARY KEY, idx INTEGER NOT NULL, "
    "mutations INTEGER NOT NULL, committed_ns INTEGER NOT NULL, dispatched_ns INTEGER NOT NULL, "
    "received_ns INTEGER NOT NULL)"
)
_SCHEMA = ("CREATE TABLE IF NOT EXISTS target_meta (name TEXT PRIMARY KEY NOT NULL, value NOT NULL)", KV_TABLE,
           APPLIED_TABLE)  # fmt: skip


class WrongIndex(ValueError):
    """A batch that does not follow what the target applied: said back as WRONG_TARGET_INDEX."""


def apply_key_values(db: apsw.Connection, entry: pb.TargetEntry) -> None:
    """The default apply: each mutation sets (or deletes) its key in the `kv` table."""
    for m in entry.mutations:
        if m.delete:
            db.execute("DELETE FROM kv WHERE key = ?", (m.key,))
        else:
            db.execute("INSERT OR REPLACE INTO kv (key, value) VALUES (?, ?)", (m.key, m.value))


class TargetStore:
    """A target's SQLite file; see the module docstring. Calls block: run them off the event loop."""

    def __init__(self, path: str | Path, apply: ApplyFn | None = None, *, log_applied: bool = False) -> None:
        self.path = Path(path)
        self.apply_fn = apply or apply_key_values
        self.log_applied = log_applied
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # One process per file: a second one would interleave applies with the first's.
        self._lock = open(f"{self.path}.lock", "a+b")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise UsageError(
                f"another process serves the target file {self.path}; stop it or pass another --db"
            ) from None
        self.db = apsw.Connection(str(self.path))
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        for statement in _SCHEMA:
            self.db.execute(statement)
        self.last_applied: int = self._meta("last_applied", NOTHING)
        self.fence: tuple[int, int] = (self._meta("epoch", 0), self._meta("nonce", 0))
        self.wal: str = self._meta("wal", "")

    def _meta(self, name: str, default: Any) -> Any:
        row = self.db.execute("SELECT value FROM target_meta WHERE name = ?", (name,)).fetchone()
        return default if row is None else row[0]

    def _set(self, name: str, value: int | str) -> None:
        self.db.execute("INSERT OR REPLACE INTO target_meta (name, value) VALUES (?, ?)", (name, value))

    def accept(self, epoch: int, nonce: int, wal: str) -> None:
        """Remember (epoch, nonce) as the newest LogPlayer's, and the WAL (durably: a restarted target
        still fences, and still refuses another WAL)."""
        nonce &= 0x7FFF_FFFF_FFFF_FFFF  # (SQLite integers are signed)
        with self.db:
            self._set("epoch", epoch)
            self._set("nonce", nonce)
            self._set("wal", wal)
        self.fence, self.wal = (epoch, nonce), wal

    def apply(self, prev_index: int, entries: Any, received_ns: int) -> int:
        """Apply a batch and store its last index, in one transaction; the new last applied index.
        Raises WrongIndex for a batch that does not follow the last applied index in order."""
        if prev_index != self.last_applied:
            raise WrongIndex(f"the batch follows index {prev_index}, the target applied {self.last_applied} last")
        last = prev_index
        for entry in entries:
            if entry.index <= last:
                raise WrongIndex(f"entry index {entry.index} does not follow {last}")
            last = entry.index
        if last == prev_index:
            return last
        with self.db:  # one transaction: the entries and the index, or nothing
            for entry in entries:
                if entry.mutations:
                    self.apply_fn(self.db, entry)
                    if self.log_applied:
                        self.db.execute(
                            "INSERT INTO applied (idx, mutations, committed_ns, dispatched_ns, received_ns) "
                            "VALUES (?, ?, ?, ?, ?)",
                            (entry.index, len(entry.mutations), entry.committed_ns, entry.dispatched_ns, received_ns),
                        )
            self._set("last_applied", last)
        self.last_applied = last
        return last

    def applied_log(self) -> list[tuple[int, int, int, int, int]]:
        """The apply log: (index, mutations, committed_ns, dispatched_ns, received_ns) in apply order."""
        return [tuple(r) for r in self.db.execute(
            "SELECT idx, mutations, committed_ns, dispatched_ns, received_ns FROM applied ORDER BY seq"
        )]  # fmt: skip

    def close(self) -> None:
        self.db.close()
        self._lock.close()


# Each RPC's capability (docs/design/production.md §3.7), as ints.
_APPEND, _READ = int(Capability.APPEND), int(Capability.READ)


class TargetService(pb_grpc.TargetServicer):
    """The Target gRPC service of one target; see the module docstring. `verifier` checks each RPC's token
    (NoVerifier: auth off)."""

    def __init__(self, target: str, store: TargetStore, verifier: Verifier | NoVerifier | None = None) -> None:
        self.target = target
        self.store = store
        self.data_port = 0  # (GetLastAck names it: TargetServer sets it once its data port listens)
        self.verifier: Verifier | NoVerifier = verifier if verifier is not None else NoVerifier()
        self._labels = target_labels(target)
        self._applying = asyncio.Lock()  # one apply at a time; an Open waits for the one in progress
        self._holder: tuple[object, tuple[int, int]] | None = None  # the stream that may apply, its (epoch, nonce)
        # (each batch counts: the metric children bound once, not looked up per batch)
        self._entries, self._batches_ok = ENTRIES.labels(target), BATCHES.labels(target, "OK")
        self._last_applied = LAST_APPLIED.labels(target)
        self._last_applied.set(store.last_applied)

    def _refuse(self, status: pb.Status, detail: str) -> pb.DeliverResponse:
        log.warning("target %s: %s: %s", self.target, pb.Status.Name(status), detail)
        BATCHES.labels(self.target, pb.Status.Name(status)).inc()
        return pb.DeliverResponse(status=status, last_applied=self.store.last_applied, detail=detail)

    def _not_found(self, asked: str, claims: Claims, this: tuple[str, ...] = ()) -> str | None:
        """Why a call naming target `asked` (or one of `this`: other names of this target) is
        TARGET_NOT_FOUND here, or None when it is served: a wrong id, or this target outside the token's
        selector (hidden: logged, counted). The reason names this target only to a token that may see it,
        so a hidden target answers as a missing one."""
        mine = covers(claims, self._labels)
        named = asked == self.target or asked in this
        if named and mine:
            return None
        if named:
            self.verifier.hid(f"target {self.target}", "TARGET_NOT_FOUND")
        if not mine:
            return f"this process serves no target {asked!r}"
        return f"this process serves target {self.target!r}, not {asked!r}"

    async def Deliver(
        self, requests: AsyncIterator[pb.DeliverRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.DeliverResponse]:
        claims = await self.verifier.verify(context, _APPEND, "Deliver")
        expires = expires_at(claims)
        first = await anext(aiter(requests), None)
        if first is None:
            return
        if not first.HasField("open"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a Deliver stream begins with an Open request")
        opened = first.open
        if (missing := self._not_found(opened.target, claims)) is not None:
            yield self._refuse(pb.TARGET_NOT_FOUND, missing)
            return
        token = object()
        mine = (opened.epoch, opened.nonce & 0x7FFF_FFFF_FFFF_FFFF)
        async with self._applying:  # (the WAL check too: two first Opens of different WALs race otherwise)
            wal, newest = self.store.wal, self.store.fence
            other_wal = bool(wal) and opened.wal != wal
            if not other_wal and mine >= newest:
                if mine > newest or not self.store.wal:
                    await to_the_end(asyncio.to_thread(self.store.accept, opened.epoch, opened.nonce, opened.wal))
                self._holder = (token, mine)
            last = self.store.last_applied
        if other_wal:
            yield self._refuse(pb.TARGET_NOT_FOUND, f"target {self.target!r} applies WAL {wal!r}, not {opened.wal!r}")
            return
        if mine < newest:
            yield self._refuse(pb.TARGET_FENCED, f"LogPlayer {opened.player!r} (epoch {opened.epoch}) is older than "
                               f"the one of epoch {newest[0]} that holds the target")  # fmt: skip
            return
        log.info("target %s: LogPlayer %s (epoch %d) opened a stream at index %d", self.target, opened.player,
                 opened.epoch, last)  # fmt: skip
        yield pb.DeliverResponse(status=pb.OK, last_applied=last)
        async for req in requests:
            received = time.time_ns()
            if received / 1e9 > expires:  # (before anything of the batch is applied)
                exc = AuthError("UNAUTHENTICATED", "the token expired during the stream: reconnect with a current one")
                await self.verifier.refuse(context, exc, "Deliver")
            refusal: tuple[pb.Status, str] | None = None
            async with self._applying:
                holder, key = self._holder or (None, mine)
                if holder is not token:
                    if key == mine:  # a newer stream of the same LogPlayer (it reconnected): not a fence
                        await context.abort(
                            grpc.StatusCode.ABORTED, "a newer stream of this LogPlayer holds the target"
                        )
                    refusal = (pb.TARGET_FENCED, f"a newer LogPlayer (epoch {key[0]}) holds the target")
                else:
                    try:
                        last = await to_the_end(
                            asyncio.to_thread(self.store.apply, req.prev_index, req.entries, received)
                        )
                    except WrongIndex as exc:
                        refusal = (pb.WRONG_TARGET_INDEX, str(exc))
                    except Exception as exc:  # the user's apply function failed: nothing of the batch applied
                        log.exception("target %s: applying the batch after index %d failed", self.target,
                                      req.prev_index)  # fmt: skip
                        await context.abort(grpc.StatusCode.INTERNAL, f"target {self.target}: apply failed: {exc}")
            if refusal is not None:
                yield self._refuse(*refusal)
                return
            self._entries.inc(len(req.entries))
            self._batches_ok.inc()
            self._last_applied.set(last)
            yield pb.DeliverResponse(status=pb.OK, last_applied=last)

    async def GetLastAck(self, request: pb.LastAckRequest, context: grpc.aio.ServicerContext) -> pb.LastAckResponse:
        claims = await self.verifier.verify(context, _READ, "GetLastAck")
        if (missing := self._not_found(request.target, claims, this=("",))) is not None:  # ('': whichever it serves)
            return pb.LastAckResponse(status=pb.TARGET_NOT_FOUND, detail=missing)
        return pb.LastAckResponse(
            status=pb.OK, last_applied=self.store.last_applied, epoch=self.store.fence[0], data_port=self.data_port
        )


def load_apply(ref: str) -> ApplyFn:
    """The apply function named `module:function` (UsageError naming what is wrong)."""
    import importlib

    module, _, name = ref.partition(":")
    if not module or not name:
        raise UsageError(f"--apply {ref!r} is not module:function")
    try:
        fn: ApplyFn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise UsageError(f"--apply {ref!r}: {exc}") from None
    if not callable(fn):
        raise UsageError(f"--apply {ref!r} is not a function")
    return fn


class TargetServer:
    """A target process: its store and its Target service on `listen` (and /metrics); with `auth_keys`
    every call needs a token they verify (`tidings target serve --auth-keys`)."""

    def __init__(
        self,
        target: str,
        db: str | Path,
        listen: str,
        *,
        apply: ApplyFn | None = None,
        log_applied: bool = False,
        metrics_listen: str | None = None,
        metrics_tls: bool = False,
        tls: TLS | None = None,
        auth_keys: KeySet | None = None,
        data_listen: str = "",
    ) -> None:
        self.tls = tls
        self.data_listen = data_listen  # (HOST:PORT of the data port; "": `listen`'s host, any free port)
        self.verifier = verifier_of(auth_keys, "target")
        self.target = target
        self.db = db
        self.listen = listen
        self.apply = apply
        self.log_applied = log_applied
        self.metrics_listen = metrics_listen
        self.metrics_tls = metrics_tls
        self.metrics_scheme = "https" if metrics_tls else "http"
        self.endpoint = ""
        self.metrics_endpoint = ""
        self.store: TargetStore | None = None
        self.data_endpoint = ""  # the Target service over tidings' framing (the same host as `endpoint`)
        self._data: ReplicationServer | None = None
        self._server: grpc.aio.Server | None = None
        self._metrics: Any = None

    async def start(self) -> TargetServer:
        async with contextlib.AsyncExitStack() as undo:
            self.store = await asyncio.to_thread(TargetStore, self.db, self.apply, log_applied=self.log_applied)
            undo.callback(self.store.close)
            self._server = grpc.aio.server(options=MESSAGE_OPTIONS)  # (a batch of one 64 MiB entry fits)
            service = TargetService(self.target, self.store, self.verifier)
            pb_grpc.add_TargetServicer_to_server(service, self._server)  # type: ignore[no-untyped-call]  # generated gRPC code, untyped
            self.endpoint = listen_grpc(self._server, self.listen, f"target {self.target}", self.tls)
            host, port = self.endpoint.rsplit(":", 1)
            await self._server.start()
            undo.push_async_callback(self._server.stop, 0)
            self._data = ReplicationServer(None, self.target, self.tls, servicer=service, service=TARGET)
            data_listen = self.data_listen or f"{host}:0"
            try:
                await self._data.start(data_listen)
            except OSError as err:
                raise UsageError(
                    f"target {self.target} cannot listen on {data_listen} for its data port ({err}); "
                    "pass another --data-listen"
                ) from None
            undo.push_async_callback(self._data.aclose)
            service.data_port = int(self._data.endpoint.rsplit(":", 1)[1])
            self.data_endpoint = f"{host}:{service.data_port}"
            if self.metrics_listen:
                who = f"target {self.target}"
                self._metrics, self.metrics_endpoint = serve_metrics(
                    self.metrics_listen, host, int(port), who, metrics_tls(self.metrics_tls, self.tls, who)
                )
            undo.pop_all()
        log.info("target %s serving on %s (%s, last applied %d)", self.target, self.endpoint, self.db,
                 self.store.last_applied)  # fmt: skip
        return self

    async def stop(self, graceful: bool = True) -> None:
        grace = 1.0 if graceful else 0
        stopping = [self._server.stop(grace)] if self._server is not None else []
        if self._data is not None:
            stopping.append(self._data.drain_calls(grace))
        await asyncio.gather(*stopping)
        if self._data is not None:
            await self._data.aclose()
        stop_metrics(self._metrics)
        if self.store is not None:
            self.store.close()
