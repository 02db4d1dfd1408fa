"""The Player (Gazette's playback.go): plays a recovery log into an empty directory, from hints.

It reads only the log segments the hints name (seeking over dead stretches of SEEK_MIN_GAP or more;
a nearer segment is read up to), applies each
operation to its FSM and, when the FSM takes it, re-enacts it on disk: files are staged as
`.fnodes/<fnode>` and linked to their paths only when playback completes (`_make_live`). Once it
reaches the log's write head it sets `tailing` and follows the log (a hot standby) until asked to
finish:

* `finish_at_write_head()` - read to the head and stop (`tidings shards recover`);
* `inject_handoff(author)` - read to the head, append a no-op sequenced after the last operation
  with the log's `author` register set to `author` (the fence: a recorder of the old author can land
  nothing after it), read it back, and stop; if another writer's op landed first (our no-op is
  out of sequence), read on and inject again. The new primary then records as `author`.

States (one `_on_<state>` each): BACKFILL (reading what the log held at start) -> TAIL (following the
head) -> EXIT_AT_HEAD or INJECT_HANDOFF_AT_HEAD -> READ_HANDOFF_BARRIER -> COMPLETE. Reads up to a
head known to be written (a log's head when playback began, our handoff's end) block; only past it
does a read that ends mean the write head was reached. A hinted segment
past the log's write head, or an offset jump over a hinted segment, is data loss: playback fails
rather than build a store from a history with a hole. A cancelled or failed playback removes the
directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from tidings.client import AsyncClient, ReadChunk, Reader
from tidings.consumer.recoverylog import _metrics as metrics
from tidings.consumer.recoverylog.fsm import (
    FSM,
    FnodeNotTrackedError,
    FSMError,
    NotHintedAuthorError,
    WrongSeqNoError,
)
from tidings.consumer.recoverylog.ops import Decoded, Garbage, OpReader, encode, fence
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.status import TidingsError
from tidings.tasks import to_the_end

__all__ = ["STAGING", "PlaybackError", "Played", "Player", "PlayerState", "PlayerStatistics"]

log = logging.getLogger(__name__)

STAGING = ".fnodes"  # files are played here, named by fnode, and linked to their paths at the end
# A hinted segment nearer than this is read up to (the ops between are skipped), not sought: a seek
# drops what the open read has fetched ahead (measured: ~150 KiB a seek) and starts another.
SEEK_MIN_GAP = 256 << 10


class PlaybackError(TidingsError):
    """The log cannot be played into a consistent directory (a hole where hints need content)."""


class PlayerState(enum.Enum):
    BACKFILL = "backfill"
    TAIL = "tail"
    EXIT_AT_HEAD = "exit at head"
    INJECT_HANDOFF_AT_HEAD = "inject handoff at head"
    READ_HANDOFF_BARRIER = "read handoff barrier"
    COMPLETE = "complete"


@dataclasses.dataclass(frozen=True, slots=True)
class Played:
    """What a completed playback leaves: the FSM (to record on with), the directory, and the log's write
    head after the last operation read (the handoff's end, when one was injected)."""

    log: str
    fsm: FSM
    dir: Path
    write_head: int


@dataclasses.dataclass(slots=True)
class PlayerStatistics:
    bytes_read: int = 0  # log bytes read (within the segments read, skipped or not)
    applied: int = 0  # operations applied (and re-enacted)
    skipped: int = 0  # operations not applied: duplicates, dead branches, files gone by the hints' time
    garbage_bytes: int = 0
    seeks: int = 0


S = PlayerState


class Player:
    """Plays `hints` (their log) into `dir` through `client` (see the module docstring)."""

    def __init__(self, client: AsyncClient, hints: pb.FSMHints, dir: Path) -> None:
        self.client, self.hints, self.dir = client, hints, Path(dir)
        self.tailing = asyncio.Event()  # set once playback first reached the log's write head
        self.state = S.BACKFILL
        self.stats = PlayerStatistics()
        self._requested = asyncio.Event()
        self._handoff = 0  # 0: finish at the write head; else the author to hand the log off to
        self._fsm: FSM | None = None
        self._files: dict[int, int] = {}  # fnode -> descriptor of its staged file
        self._log = ""  # the log being read
        self._reader: OpReader | None = None
        self._read_through = 0  # read at least to here (a hinted log's head, or our handoff's end)
        self._heads: dict[str, int] = {}
        self._played_bytes = metrics.PLAYED_BYTES.labels(hints.log)

    @property
    def offset(self) -> int:
        """The log offset played through (the end of the last whole operation read)."""
        return self._reader.offset if self._reader is not None else 0

    # -- requests ------------------------------------------------------------------------------

    def finish_at_write_head(self) -> None:
        self._request(0)

    def inject_handoff(self, author: int) -> None:
        if not 0 < author <= 0xFFFFFFFF:
            raise ValueError(f"author must be a non-zero 32-bit id, not {author}")
        self._request(author)

    def _request(self, author: int) -> None:
        if self._requested.is_set():
            raise RuntimeError("playback was already asked to finish")
        self._handoff = author
        self._requested.set()

    # -- playback ------------------------------------------------------------------------------

    async def play(self) -> Played:
        """Play until completion (as requested): what was played. On failure or cancellation the
        directory is removed."""
        try:
            await to_the_end(asyncio.to_thread(_prepare, self.dir))
            self._fsm = fsm = FSM(self.hints)
            await self._read_heads(fsm)
            handlers = {
                S.BACKFILL: self._on_backfill,
                S.TAIL: self._on_tail,
                S.EXIT_AT_HEAD: self._on_read_to_head,
                S.INJECT_HANDOFF_AT_HEAD: self._on_read_to_head,
                S.READ_HANDOFF_BARRIER: self._on_read_handoff_barrier,
            }
            while self.state is not S.COMPLETE:
                self.state = await handlers[self.state]()
            await to_the_end(asyncio.to_thread(_make_live, self.dir, fsm, self._files))
            log.info(
                "recovery log %s: played into %s (%d ops applied, %d skipped, %d bytes read)",
                self.hints.log, self.dir, self.stats.applied, self.stats.skipped, self.stats.bytes_read,
            )  # fmt: skip
            return Played(self.hints.log, fsm, self.dir, self._read_through)
        except BaseException:
            await to_the_end(asyncio.to_thread(_abort, self.dir, self._files))
            raise

    async def _read_heads(self, fsm: FSM) -> None:
        """The transactional write head of every log the hints name (zero-byte appends), checked
        against the hinted segments: one past its log's head means lost content."""
        logs = {self.hints.log, *(s.log for s in fsm.hinted_segments)}
        for name in sorted(logs):
            self._heads[name] = (await self.client.append(name, b"")).end
        for s in fsm.hinted_segments:
            head = self._heads[s.log]
            if s.first_offset >= head or s.last_offset > head:
                raise PlaybackError(
                    f"recovery log {s.log}: its write head is {head}, but the hints need ops {s.first_seq_no}-"
                    f"{s.last_seq_no} at offsets {s.first_offset}-{s.last_offset or '?'}: possible data loss"
                )

    def _position(self) -> None:
        """Point the op reader where the FSM needs the log next: the next hinted segment (a seek),
        else on through the hints' log from wherever reading is (its start, the first time)."""
        fsm = self._fsm
        assert fsm is not None
        seg = fsm.next_hinted_segment
        r = self._reader
        if seg is not None:
            if r is None or self._log != seg.log or r.offset + SEEK_MIN_GAP < seg.first_offset:
                self._log, self._reader = seg.log, OpReader(seg.first_offset)
                self._read_through = self._heads[seg.log]
                self.stats.seeks += 1
            elif r.offset >= self._read_through:
                raise PlaybackError(
                    f"recovery log {self._log}: read to its head {self._read_through} with hinted ops "
                    f"{seg.first_seq_no}-{seg.last_seq_no} never found: possible data loss"
                )
        elif r is None:
            self._log, self._reader = self.hints.log, OpReader(0)
            self._read_through = self._heads[self.hints.log]
        elif self._log != self.hints.log:
            raise PlaybackError(f"recovery log: read {self._log} after the hints, expected {self.hints.log}")

    async def _on_backfill(self) -> PlayerState:
        """Read what the log held when playback began -> TAIL (tailing set) once at its head, or at once
        EXIT_AT_HEAD / INJECT_HANDOFF_AT_HEAD if finishing was asked for."""
        await self._read(block=False)
        self._at_head()
        if self._requested.is_set():
            return S.INJECT_HANDOFF_AT_HEAD if self._handoff else S.EXIT_AT_HEAD
        return S.TAIL

    async def _on_tail(self) -> PlayerState:
        """Follow the log as it is written (a hot standby) until finishing is asked for -> EXIT_AT_HEAD or
        INJECT_HANDOFF_AT_HEAD (a partial op read so far is read again from its start)."""
        await self._read(block=True, until=self._requested)
        return S.INJECT_HANDOFF_AT_HEAD if self._handoff else S.EXIT_AT_HEAD

    async def _on_read_to_head(self) -> PlayerState:
        """Read to the write head; then -> COMPLETE (EXIT_AT_HEAD), or inject the handoff no-op there ->
        READ_HANDOFF_BARRIER."""
        await self._read(block=False)
        self._at_head()
        if self.state is S.EXIT_AT_HEAD:
            assert self._reader is not None
            self._read_through = self._reader.offset
            return S.COMPLETE
        fsm = self._fsm
        assert fsm is not None
        noop = pb.RecordedOp(seq_no=fsm.next_seq_no, checksum=fsm.next_checksum, author=self._handoff)
        result = await self.client.append(self.hints.log, encode(noop), union_registers=fence(self._handoff))
        self._read_through = result.end
        return S.READ_HANDOFF_BARRIER

    async def _on_read_handoff_barrier(self) -> PlayerState:
        """Read through our no-op: applied -> COMPLETE; out of sequence (another op landed first) ->
        INJECT_HANDOFF_AT_HEAD again."""
        found = await self._read(block=True, until_author=self._handoff)
        return S.COMPLETE if found else S.INJECT_HANDOFF_AT_HEAD

    def _at_head(self) -> None:
        """Reached the log's write head: every hinted op must have been read by now (else content the
        hints need is gone), and `tailing` is set (in any state: a standby is caught up)."""
        fsm = self._fsm
        assert fsm is not None
        seg = fsm.next_hinted_segment
        if seg is not None:
            raise PlaybackError(
                f"recovery log {seg.log}: read to its write head with hinted ops {seg.first_seq_no}-"
                f"{seg.last_seq_no} never found: possible data loss"
            )
        self.tailing.set()

    # -- reading -------------------------------------------------------------------------------

    async def _read(self, block: bool, until: asyncio.Event | None = None, until_author: int = 0) -> bool:
        """Read and play ops from where the FSM needs them. Non-blocking: to the log's write head.
        Blocking: until `until` is set, or until an op of `until_author` (True if it applied).
        Hinted segments make it seek (a new read) as the FSM moves on."""
        while True:
            self._position()
            r = self._reader
            assert r is not None
            at = r.offset + r.pending
            end, blk = (self._read_through, True) if until_author else (0, block)
            if not blk and at < self._read_through:
                # A non-blocking read ends where a replica has nothing more (a hole in its index, say),
                # not only at the head: up to the head known to be written, read blocking (Gazette's).
                end, blk = self._read_through, True
            reader = self.client.reader(self._log, at, block=blk, end_offset=end)
            try:
                outcome = await self._read_from(reader, r, until, until_author)
            finally:
                await reader.aclose()
            if outcome == "seek":
                continue
            if outcome == "handoff":
                return True
            if outcome == "missed":
                return False
            if until_author:  # (the barrier's end was reached without our op: it was not ours to see)
                return False
            if not block and end and (until is None or not until.is_set()):
                continue  # (read to the known head: now on to the head, non-blocking)
            return True

    async def _read_from(self, reader: Reader, r: OpReader, until: asyncio.Event | None, until_author: int) -> str:
        """Play chunks of `reader`; "seek" when the FSM needs another part of the log, "handoff" /
        "missed" when `until_author`'s op applied or not, "end" at the reader's end or once `until` is set."""
        it = reader.__aiter__()
        waiting = asyncio.ensure_future(until.wait()) if until is not None else None
        nxt: asyncio.Future[ReadChunk] | None = None
        try:
            while True:
                nxt = asyncio.ensure_future(it.__anext__())
                if waiting is not None:
                    await asyncio.wait({nxt, waiting}, return_when=asyncio.FIRST_COMPLETED)
                    if not nxt.done():
                        return "end"  # (asked to finish: the read in flight is dropped below)
                try:
                    chunk = await nxt
                except StopAsyncIteration:
                    return "end"
                expected = r.offset + r.pending
                if chunk.offset != expected:  # an offset jump: content is gone
                    self._jumped(r, expected, chunk.offset)
                    assert self._reader is not None
                    r = self._reader
                self.stats.bytes_read += len(chunk.content)
                self._played_bytes.inc(len(chunk.content))
                outcome = await self._play(r, chunk.content, until_author)
                if outcome is not None:
                    return outcome
        finally:
            if waiting is not None:
                waiting.cancel()
            if nxt is not None and not nxt.done():  # (the generator must stop before the reader closes)
                nxt.cancel()
                with contextlib.suppress(BaseException):
                    await nxt

    def _jumped(self, r: OpReader, frm: int, to: int) -> None:
        fsm = self._fsm
        assert fsm is not None
        seg = fsm.next_hinted_segment
        if seg is not None and seg.last_offset != 0 and seg.last_offset < to:
            raise PlaybackError(
                f"recovery log {self._log}: its content jumps from offset {frm} to {to}, over hinted ops "
                f"{seg.first_seq_no}-{seg.last_seq_no} at {seg.first_offset}-{seg.last_offset}: possible data loss"
            )
        log.warning("recovery log %s: content jumps from offset %d to %d (removed); playing on", self._log, frm, to)
        self._reader = OpReader(to)

    async def _play(self, r: OpReader, content: bytes, until_author: int) -> str | None:
        """Apply the whole ops in `content` (and what was pending), re-enact them on disk in a worker
        thread; stop early (a return value) when the FSM needs a seek or `until_author`'s op was read."""
        fsm = self._fsm
        assert fsm is not None
        actions: list[_Action] = []
        outcome: str | None = None
        gen = r.feed(content)
        with contextlib.closing(gen):
            for item in gen:
                if isinstance(item, Garbage):
                    self.stats.garbage_bytes += item.last_offset - item.first_offset
                    log.warning(
                        "recovery log %s: bytes %d-%d are no operation (%s); skipped",
                        self._log, item.first_offset, item.last_offset, item.reason,
                    )  # fmt: skip
                    continue
                applied = self._apply(fsm, item)
                if applied:
                    actions.append(_action(fsm, item))
                if until_author and item.op.author == until_author:
                    outcome = "handoff" if applied else "missed"
                    break
                seg = fsm.next_hinted_segment
                if seg is not None and (self._log != seg.log or item.last_offset + SEEK_MIN_GAP < seg.first_offset):
                    outcome = "seek"
                    break
        if actions:
            await to_the_end(asyncio.to_thread(_reenact, self.dir, self._files, actions))
        return outcome

    def _apply(self, fsm: FSM, d: Decoded) -> bool:
        try:
            fsm.apply(d.op, d.payload, d.data, d.first_offset, d.last_offset, self._log)
        except FnodeNotTrackedError:
            self.stats.skipped += 1  # (a file gone by the hints' time: the FSM stepped, nothing to write)
            return False
        except NotHintedAuthorError:
            self.stats.skipped += 1  # (a dead branch of the log: e.g. a zombie's op after a handoff)
            return False
        except WrongSeqNoError:
            self.stats.skipped += 1
            if d.op.seq_no > fsm.next_seq_no and not fsm.has_remaining_hints:
                # Past the hints (or with none), the log is read op after op: a later op means the ones
                # between are gone (fragments removed, say). Playing on would build a store without them.
                raise PlaybackError(
                    f"recovery log {self._log}: op {d.op.seq_no} at offset {d.first_offset} where op "
                    f"{fsm.next_seq_no} was expected: operations are missing (content removed?): possible data loss"
                ) from None
            return False  # (below the next: a duplicate, or read from a lower-bound offset)
        except FSMError as exc:
            self.stats.skipped += 1
            log.info("recovery log %s: op %d at %d not applied: %s", self._log, d.op.seq_no, d.first_offset, exc)
            return False
        self.stats.applied += 1
        return True

    def statistics(self) -> PlayerStatistics:
        return dataclasses.replace(self.stats)


# -- the directory (worker threads) ------------------------------------------------------------


def _staged(dir: Path, fnode: int) -> Path:
    return dir / STAGING / str(fnode)


def _prepare(dir: Path) -> None:
    shutil.rmtree(dir, ignore_errors=True)
    (dir / STAGING).mkdir(parents=True)


@dataclasses.dataclass(frozen=True, slots=True)
class _Action:
    """What an applied op does to the staged files (decided when it applied: liveness changes later)."""

    kind: str  # create, write, truncate, remove
    fnode: int
    at: int = 0  # a write's offset, a truncate's size
    data: bytes = b""


def _action(fsm: FSM, d: Decoded) -> _Action:
    op = d.op
    kind = op.WhichOneof("op")
    if kind == "create":
        return _Action("create", op.seq_no)
    if kind == "write":
        return _Action("write", op.write.fnode, op.write.offset, d.data)
    if kind == "truncate":
        return _Action("truncate", op.truncate.fnode, op.truncate.size)
    if kind == "unlink" and op.unlink.fnode not in fsm.nodes:  # (its last link: the file is gone)
        return _Action("remove", op.unlink.fnode)
    return _Action("none", 0)  # (a link, a no-op: nothing on disk until _make_live)


def _reenact(dir: Path, files: dict[int, int], actions: list[_Action]) -> None:
    """Apply applied ops to the staged files (Gazette's reenactOperation)."""
    for a in actions:
        if a.kind == "create":
            files[a.fnode] = os.open(_staged(dir, a.fnode), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        elif a.kind == "write":
            os.pwrite(files[a.fnode], a.data, a.at)
        elif a.kind == "truncate":
            os.ftruncate(files[a.fnode], a.at)
        elif a.kind == "remove":
            os.close(files.pop(a.fnode))
            os.unlink(_staged(dir, a.fnode))


def _live(fsm: FSM) -> Iterator[tuple[int, str]]:
    for fnode, node in fsm.nodes.items():
        for path in node.links:
            yield fnode, path


def _make_live(dir: Path, fsm: FSM, files: dict[int, int]) -> None:
    """Link every staged file to its paths, then drop the staging folder (Gazette's makeLive)."""
    if fsm.has_remaining_hints:
        raise PlaybackError(f"playback into {dir} ended with hinted operations never read")
    if set(files) != set(fsm.nodes):
        raise PlaybackError(f"playback into {dir}: staged files {sorted(files)} are not the live {sorted(fsm.nodes)}")
    for fnode, path in _live(fsm):
        target = dir / path
        target.parent.mkdir(parents=True, exist_ok=True)
        os.link(_staged(dir, fnode), target)
    for fnode in list(files):
        os.close(files.pop(fnode))
    shutil.rmtree(dir / STAGING)


def _abort(dir: Path, files: dict[int, int]) -> None:
    for fd in files.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    files.clear()
    shutil.rmtree(dir, ignore_errors=True)
