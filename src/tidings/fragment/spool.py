"""Spool: a replica's transactional memory of its journal (gazette-transactional-appends.txt, *Components*).

A Spool holds the Fragment currently being built (in a local `SpoolFile`), the journal's
registers, and `delta`: bytes received beyond the committed end that are not yet committed. It
is a small state machine driven by ReplicateRequests, and every replica runs it independently
(Gazette's `Spool.applyCommit`, edge for edge):

- **content**: a chunk (alone, or ahead of a proposal in the same request) whose
  `content_delta` equals `delta` is written after the committed end and folded into a running
  SHA1 (`delta` grows). Any other delta is an invalid transition that aborts the stream.
- **roll**: a proposal ending beyond everything this spool holds (`end > fragment.end + delta`),
  or an empty proposal at exactly the committed end, first completes the current Fragment
  (handed to the observer for persisting) and starts an empty one at the proposal's end (taking
  the proposal's registers when it is strictly ahead). Then the two cases below are checked.
- **rollback**: a proposal equal to the current Fragment *and* registers equal to ours discards
  the uncommitted `delta`.
- **commit**: a proposal that extends the current Fragment by exactly `delta` bytes, with the
  SHA1 of all content so far, is adopted (the end moves; registers are replaced).
- anything else is a **mismatch**: PROPOSAL_MISMATCH, answered with this spool's own view
  (Fragment and registers) so the primary can re-synchronize.

Readers never see uncommitted bytes: the observer hears of a Fragment only once it commits, and
committed bytes of a spool file are never rewritten.

Files and recovery. Each Fragment's content lives in ``spool-{begin:016x}`` under the spool's
directory, read by everyone (readers, the persister) through the `SpoolFile`'s open descriptor,
so removing the name never breaks a reader (Gazette's spool files are anonymous for that
reason). A completed fragment's file is renamed ``{content name}.spool`` and keeps its name until
a store listing covers it (then it is unlinked).

Each spool records its committed end and the registers there in ``HEAD`` (a `SpoolHead` behind
a CRC) before anyone relies on the commit: a peer before it answers the commit, the primary before
a client hears OK (`flush_head`, by the pipeline). A broker restarted on its data dir (`recover()`)
recovers its files up to that end and resumes there, so no offset it may have committed is handed
out again and no acknowledged append is lost with the other replicas. A commit is not yet a
promise, though: the primary applies it before its peers have it, and a peer may hold a commit the
others never got, which the journal's surviving replicas may have rolled past and written again.
So what `recover()` finds is held back until verified against the journal's other replicas and
stores (`tidings.broker.recovery`), never served or persisted before. Spool files are not fsynced:
durability comes from replication to R brokers (as in Gazette) and from persisting completed
fragments; a kill -9 leaves the page cache intact, a power loss may not.

Ownership: exactly one Append or Replicate RPC owns a Spool at a time (a token in the
replica's `spool_slot`); nothing here is safe to call without holding it.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import logging
import os
import struct
import time
import weakref
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Protocol

from tidings.fragment.fragment import EMPTY_SUM, Fragment, parse_content_name
from tidings.protocol import labels
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.status import ValidationError

log = logging.getLogger(__name__)

HEAD = "HEAD"
_HEAD_PREFIX = struct.Struct("<II")  # crc32, payload length
COMPLETED_SUFFIX = ".spool"


class SpoolFile:
    """A spool's local file, read and persisted through its open descriptor.

    The name on disk is what a restarted broker recovers from; the descriptor is what readers
    and the persister use. The name is removed once the fragment is *completed* (the spool moved
    past it) and *persisted* through its end (a store listing covers it); the descriptor closes
    when the last holder drops the object.
    """

    __slots__ = ("__weakref__", "_persisted_through", "completed_end", "fd", "path", "unlinked")

    def __init__(self, path: Path, create: bool = True) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o644)
        weakref.finalize(self, os.close, self.fd)
        self.completed_end: int | None = None  # the fragment's end once the spool moved past it
        self._persisted_through = 0
        self.unlinked = False

    def __repr__(self) -> str:
        return f"SpoolFile({str(self.path)!r})"

    def pread(self, n: int, offset: int) -> bytes:
        return os.pread(self.fd, n, offset)

    def reader(self) -> BinaryIO:
        """A file object of its own over the same content, from position 0 (for the persister)."""
        return os.fdopen(os.dup(self.fd), "rb")

    def complete(self, fragment: Fragment) -> None:
        """The spool moved past this file: cut uncommitted bytes and name it after its content."""
        os.ftruncate(self.fd, fragment.content_length)
        target = self.path.with_name(fragment.content_name() + COMPLETED_SUFFIX)
        with contextlib.suppress(FileNotFoundError):
            os.rename(self.path, target)
        self.path = target
        self.completed_end = fragment.end
        self._maybe_unlink()

    def persisted_through(self, end: int) -> bool:
        """Whether a store holds this file's content up to `end`."""
        return self._persisted_through >= end

    def mark_persisted(self, through: int) -> None:
        """A store holds this file's content through offset `through`."""
        self._persisted_through = max(self._persisted_through, through)
        self._maybe_unlink()

    def _maybe_unlink(self) -> None:
        if self.unlinked or self.completed_end is None or self._persisted_through < self.completed_end:
            return
        self.unlinked = True
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


class SpoolObserver(Protocol):
    """Told of every commit (readers wake up), every completed Fragment (to persist), and every gap."""

    def spool_commit(self, fragment: Fragment, file: SpoolFile) -> None: ...

    def spool_complete(self, fragment: Fragment, file: SpoolFile, primary: bool) -> None:
        """`primary`: persist it at once (the journal's primary completed it, or a replica while a new
        pipeline synchronizes); otherwise replicas wait, in case the primary does."""

    def spool_gap(self, begin: int, end: int) -> None:
        """The spool rolled past [begin, end), which another replica committed and this one never got."""


class Transition(enum.Enum):
    """What a proposal does to a Spool; the names of the state machine's edges."""

    COMMIT = "commit"
    ROLLBACK = "rollback"
    ROLL = "roll"
    MISMATCH = "mismatch"


class Spool:
    """The Fragment under construction, its file and running SHA1, and the registers.

    **Parameters:**
    * `journal` - the journal's name.
    * `directory` - where spool files and HEAD live.
    * `observer` - told of commits and completed fragments.
    """

    def __init__(self, journal: str, directory: str | Path, observer: SpoolObserver | None = None) -> None:
        self.journal = journal
        self.directory = Path(directory)
        self.observer = observer
        self.fragment = Fragment(journal=journal, begin=0, end=0, sum=EMPTY_SUM, codec=pb.NONE)
        self.registers = pb.LabelSet()
        self.delta = 0
        self.file: SpoolFile | None = None
        self.first_append_time = 0.0  # unix time of the current Fragment's first commit (flush intervals)
        self.journal_revision = 0  # the journal spec's create revision, recorded in HEAD
        self._sum = hashlib.sha1()  # SHA1 of committed content of the current Fragment
        self._pending: hashlib._Hash | None = None  # SHA1 including the uncommitted delta
        self._head_fd: int | None = None
        self._head_dirty = False
        # Closed: the replica gave the spool up, but its pipeline's teardown may still read acknowledgements
        # (HEAD is flushed, as before a client hears OK); the journal's next replica here recovers only after.
        self._closed = False

    def __repr__(self) -> str:
        f = self.fragment
        return f"Spool({self.journal!r}, [{f.begin}, {f.end}), delta={self.delta})"

    # -- queries ---------------------------------------------------------------------------

    @property
    def end(self) -> int:
        """The committed end offset: where the next append lands."""
        return self.fragment.end

    def next_fragment(self, then: bytes | memoryview = b"") -> Fragment:
        """The Fragment that committing the current `delta` would produce (after also applying the
        chunk `then`, which travels with the commit proposal in one request)."""
        if not self.delta and not then:
            return self.fragment
        pending = self._pending or self._sum
        if then:
            pending = pending.copy()
            pending.update(then)
        f = self.fragment
        end = f.end + self.delta + len(then)
        return Fragment(journal=self.journal, begin=f.begin, end=end, sum=pending.digest(), codec=f.codec)

    def mismatch_response(self) -> pb.ReplicateResponse:
        return pb.ReplicateResponse(
            status=pb.PROPOSAL_MISMATCH, fragment=self.fragment.to_proto(), registers=self.registers
        )

    # -- transitions -----------------------------------------------------------------------

    def apply(self, req: pb.ReplicateRequest, primary: bool = False) -> pb.ReplicateResponse:
        """Apply one validated ReplicateRequest: its content chunk, then its proposal (a request
        may carry both: an append's last chunk travels with its commit). Raises ValidationError
        on a bad content delta, which aborts the stream; a refused proposal is a
        PROPOSAL_MISMATCH response instead. `primary`: applied by the journal's primary."""
        if req.content:
            self.apply_content(req.content, req.content_delta)
        resp = pb.ReplicateResponse(status=pb.OK)
        if req.HasField("proposal"):
            resp = self.apply_proposal(Fragment.from_proto(req.proposal), req.registers, primary)
        return resp

    def apply_content(self, content: bytes | memoryview, content_delta: int) -> None:
        """Write a chunk after the committed end plus `delta`, folding it into the running SHA1."""
        if content_delta != self.delta:
            raise ValidationError(
                "replicate.content_delta", f"expected delta {self.delta}, got {content_delta}: the stream diverged"
            )
        if not content:
            return
        file = self._ensure_file()
        os.pwrite(file.fd, content, self.fragment.content_length + self.delta)
        if self._pending is None:
            self._pending = self._sum.copy()
        self._pending.update(content)
        self.delta += len(content)

    def classify(self, proposal: Fragment, registers: pb.LabelSet | None = None) -> Transition:
        """Which transition `proposal` (with `registers`) asks for, given this spool's state.

        ROLL is reported for any proposal that rolls the spool first, whether or not the rolled
        spool then adopts it (`apply_proposal` answers a mismatch in that case).
        """
        cur = self.fragment
        if proposal.journal != self.journal:
            return Transition.MISMATCH
        if proposal.end > cur.end + self.delta or (proposal.end == cur.end and proposal.content_length == 0):
            if proposal == cur and (registers is None or registers == self.registers):
                return Transition.ROLLBACK  # an empty fragment re-proposed as it is
            return Transition.ROLL
        if proposal == cur and (registers is None or registers == self.registers):
            return Transition.ROLLBACK
        if self.delta and proposal == self.next_fragment():
            return Transition.COMMIT
        return Transition.MISMATCH

    def apply_proposal(self, proposal: Fragment, registers: pb.LabelSet, primary: bool = False) -> pb.ReplicateResponse:
        transition = self.classify(proposal, registers)
        if transition is Transition.ROLL:
            self._roll(proposal, registers, primary)
            transition = self.classify(proposal, registers)
            if transition is Transition.ROLL:  # a non-empty proposal beyond us: we hold none of it
                transition = Transition.MISMATCH
        if transition is Transition.MISMATCH:
            return self.mismatch_response()
        if transition is Transition.COMMIT:
            self._commit(proposal, registers)
        else:
            self.rollback()
        return pb.ReplicateResponse(status=pb.OK)

    def rollback(self) -> None:
        """Discard uncommitted content (its bytes in the file are overwritten later)."""
        self.delta = 0
        self._pending = None

    def _commit(self, proposal: Fragment, registers: pb.LabelSet) -> None:
        assert self._pending is not None and self.file is not None
        self._sum, self._pending = self._pending, None
        self.delta = 0
        self.fragment = proposal
        self.registers = registers
        if not self.first_append_time:
            self.first_append_time = time.time()
        self._head_dirty = True
        if self.observer is not None:
            self.observer.spool_commit(proposal, self.file)

    def _roll(self, proposal: Fragment, registers: pb.LabelSet, primary: bool) -> None:
        """Complete the current Fragment (if it holds content) and begin an empty one at `proposal.end`."""
        self.rollback()
        old = self.fragment
        self._complete(primary)
        if proposal.end > old.end:
            self.registers = registers
            self._head_dirty = True
        self.fragment = Fragment(
            journal=self.journal, begin=proposal.end, end=proposal.end, sum=EMPTY_SUM, codec=proposal.codec
        )
        self._sum = hashlib.sha1()
        self.first_append_time = 0.0
        if proposal.end > old.end and old.end > 0 and self.observer is not None:
            # Offsets [old.end, proposal.end) were committed by others while we did not hold them.
            self.observer.spool_gap(old.end, proposal.end)

    def _complete(self, primary: bool) -> None:
        file, self.file = self.file, None
        if file is None:
            return
        if not self.fragment.content_length:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(file.path)
            file.unlinked = True
            return
        file.complete(self.fragment)
        if self.observer is not None:
            self.observer.spool_complete(self.fragment, file, primary)

    def _ensure_file(self) -> SpoolFile:
        if self.file is None:
            self.directory.mkdir(parents=True, exist_ok=True)
            path = self.directory / f"spool-{self.fragment.begin:016x}"
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # a leftover from before a crash holds nothing committed
            self.file = SpoolFile(path)
        return self.file

    def close(self, primary: bool = False) -> None:
        """Complete the current Fragment (hand it to the observer to persist) and close HEAD.

        HEAD keeps the spool's end and registers for a broker restarted on this data dir.
        """
        self.rollback()
        self._complete(primary)
        self.flush_head()
        self._closed = True
        self._close_head()

    def _close_head(self) -> None:
        if self._head_fd is not None:
            os.close(self._head_fd)
            self._head_fd = None

    # -- HEAD ------------------------------------------------------------------------------

    def flush_head(self) -> None:
        """Write HEAD if a commit or roll is not yet recorded there: a peer before it answers a request,
        the primary before a client hears OK."""
        if self._head_dirty:
            self._write_head()

    def _write_head(self) -> None:
        self._head_dirty = False
        head = pb.SpoolHead(
            compression_codec=self.fragment.codec,
            journal_revision=self.journal_revision,
            committed_end=self.fragment.end,
            committed_registers=self.registers,
        )
        if self._head_fd is None:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._head_fd = os.open(self.directory / HEAD, os.O_WRONLY | os.O_CREAT, 0o644)
        os.pwrite(self._head_fd, _encode_head(head), 0)
        if self._closed:
            self._close_head()  # read by a late acknowledgement: no descriptor outlives the spool's close

    def resume(self, end: int, registers: pb.LabelSet, codec: pb.CompressionCodec) -> None:
        """Start at an empty Fragment at `end` with `registers`: where `recover()` found this spool's
        committed end (what it holds there is verified separately)."""
        assert self.file is None and self.delta == 0
        self.fragment = Fragment(journal=self.journal, begin=end, end=end, sum=EMPTY_SUM, codec=codec)
        self.registers = registers
        self._sum = hashlib.sha1()
        self._write_head()


def apply_registers(current: pb.LabelSet, union: pb.LabelSet, subtract: pb.LabelSet) -> pb.LabelSet:
    """Registers after an append: `subtract` then `union` (Gazette's order and semantics)."""
    if not union.labels and not subtract.labels:
        return current  # (most appends change no register: rebuilding the set cost each one)
    return labels.union(labels.subtract(current, subtract), union)


# -- recovery -------------------------------------------------------------------------------


@dataclass
class Recovered:
    """What a spool directory held: committed fragments with their files (not yet verified against the
    journal), and where the spool stood."""

    fragments: list[tuple[Fragment, SpoolFile]] = field(default_factory=list)
    end: int = 0  # the committed end recorded in HEAD: where the spool resumes (0: nothing recorded)
    journal_revision: int = 0  # of the journal it was recovered for (one deleted and created again differs)
    registers: pb.LabelSet = field(default_factory=pb.LabelSet)
    codec: pb.CompressionCodec = pb.NONE


def _encode_head(head: pb.SpoolHead) -> bytes:
    payload = head.SerializeToString()
    return _HEAD_PREFIX.pack(zlib.crc32(payload), len(payload)) + payload


def lower_head(directory: Path, journal: str, end: int) -> None:
    """Record that this replica holds nothing committed from `end` on: recovered content there was
    dropped (the journal holds other bytes), so a later recovery must not resume past it (the journal
    would roll over offsets nobody holds). Only for a directory no live spool owns."""
    head = _read_head(directory / HEAD, journal)
    if head is None or (head.committed_end or head.acknowledged_end) <= end:
        return
    head.committed_end = end
    head.acknowledged_end = min(head.acknowledged_end, end)
    fd = os.open(directory / HEAD, os.O_WRONLY)
    try:
        os.pwrite(fd, _encode_head(head), 0)
    finally:
        os.close(fd)


def _read_head(path: Path, journal: str) -> pb.SpoolHead | None:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    if len(raw) < _HEAD_PREFIX.size:
        return None
    crc, n = _HEAD_PREFIX.unpack_from(raw)
    payload = raw[_HEAD_PREFIX.size : _HEAD_PREFIX.size + n]
    if len(payload) != n or zlib.crc32(payload) != crc:
        log.warning("journal %s: %s is damaged; ignoring it", journal, path)
        return None
    try:
        return pb.SpoolHead.FromString(payload)
    except Exception as exc:  # a damaged record must not stop the broker
        log.warning("journal %s: %s does not parse (%s); ignoring it", journal, path, exc)
        return None


def _sha1_of(path: Path, length: int) -> bytes | None:
    """The SHA1 of the first `length` bytes of `path`, or None if it is shorter."""
    try:
        with open(path, "rb") as f:
            h = hashlib.sha1()
            left = length
            while left:
                chunk = f.read(min(left, 1 << 20))
                if not chunk:
                    return None
                h.update(chunk)
                left -= len(chunk)
    except OSError:
        return None
    return h.digest()


def recover(journal: str, directory: Path, journal_revision: int = 0) -> Recovered:
    """Find what a previous process left in `directory` that this replica committed (blocking:
    call in a thread).

    Completed files (``{content name}.spool``) and the current spool file are kept up to HEAD's
    committed end, checked (a completed file against the SHA1 in its name), cut there, and
    returned as completed fragments named after their content. Anything else (uncommitted content
    past that offset, temporaries, damaged files, everything when HEAD is missing or names another
    incarnation of the journal than `journal_revision`) is removed. A HEAD written before HEAD held
    the committed end counts its acknowledged end instead.
    """
    out = Recovered(journal_revision=journal_revision)
    if not directory.is_dir():
        return out
    head = _read_head(directory / HEAD, journal)
    if head is not None and journal_revision and head.journal_revision not in (0, journal_revision):
        log.info("journal %s: %s belongs to an earlier journal of that name; removing it", journal, directory)
        head = None
    end_at = (head.committed_end or head.acknowledged_end) if head is not None else 0
    for path in sorted(directory.iterdir()):
        name = path.name
        if name == HEAD:
            if head is None:
                path.unlink(missing_ok=True)
            continue
        begin, named = -1, None
        if name.endswith(COMPLETED_SUFFIX):
            with contextlib.suppress(ValidationError):
                named = parse_content_name(journal, name[: -len(COMPLETED_SUFFIX)])
                begin = named.begin
        elif name.startswith("spool-"):
            with contextlib.suppress(ValueError):
                begin = int(name[len("spool-") :], 16)
        codec = head.compression_codec if head is not None else pb.NONE
        try:
            frag = _committed_part(journal, path, begin, named, end_at, codec)
            if frag is None:
                with contextlib.suppress(OSError):
                    os.unlink(path)
                continue
            if frag.content_length < path.stat().st_size:
                path = _copy_prefix(path, frag)
            file = SpoolFile(path, create=False)
            file.complete(frag)
        except FileNotFoundError as exc:  # unlinked meanwhile: an earlier replica's upload finished
            log.info("journal %s: %s went away while it was recovered (%s); skipping it", journal, path, exc)
            continue
        except OSError as exc:  # kept on disk for the next recovery: it may hold acknowledged bytes
            log.error("journal %s: cannot recover %s (%s); leaving it in place", journal, path, exc)
            continue
        out.fragments.append((frag, file))
    if head is not None:
        out.end, out.codec = end_at, head.compression_codec or pb.NONE
        out.registers = head.committed_registers if head.committed_end else head.registers
    out.fragments.sort(key=lambda e: (e[0].begin, e[0].end))
    return out


def _copy_prefix(path: Path, frag: Fragment) -> Path:
    """Copy the first bytes of `path` (`frag`'s content) to a file named after that content, then
    unlink `path`; return the copy's path.

    Never cut the file in place: an earlier replica of the journal on this broker may still hold it
    open for a delayed upload of its whole content, which must go on matching its fragment. The copy
    is complete under its final name before the original goes, so a recovery killed at any point
    leaves the committed bytes in one file or the other.
    """
    final = path.with_name(frag.content_name() + COMPLETED_SUFFIX)
    target = path.with_name(f"recover-{frag.begin:016x}.tmp")
    with open(path, "rb") as src, open(target, "wb") as dst:
        left = frag.content_length
        while left:
            chunk = src.read(min(left, 1 << 20))
            if not chunk:
                raise OSError(f"{path} shrank while it was recovered")
            dst.write(chunk)
            left -= len(chunk)
    os.rename(target, final)
    os.unlink(path)
    return final


def _committed_part(
    journal: str, path: Path, begin: int, named: Fragment | None, end_at: int, current_codec: pb.CompressionCodec
) -> Fragment | None:
    """The committed part of a spool file (below `end_at`) as a Fragment (None: nothing there to keep)."""
    if begin < 0 or begin >= end_at:
        return None
    size = path.stat().st_size
    end = min(end_at, named.end if named is not None else begin + size)
    if end <= begin:
        return None
    digest = _sha1_of(path, end - begin)
    if digest is None:
        log.warning("journal %s: %s is shorter than its committed content; removing it", journal, path)
        return None
    if named is not None and end == named.end and digest != named.sum:
        log.warning("journal %s: %s does not match its name; removing it", journal, path)
        return None
    codec = named.codec if named is not None else (current_codec or pb.NONE)
    return Fragment(journal=journal, begin=begin, end=end, sum=digest, codec=codec)


def maybe_roll(spool: Spool, roll_to_offset: int, spec: pb.JournalSpec.FragmentSpec) -> Fragment:
    """The spool's current Fragment, or an empty one rolled to its end (or to `roll_to_offset`) under
    the spec's codec: when the fragment is empty, over its target length, past its flush interval, or
    a larger offset is asked for (Gazette's `maybeRollFragment`)."""
    cur = spool.fragment
    cl = cur.content_length
    flush = cl == 0 or cl > spec.length or (roll_to_offset != 0 and roll_to_offset != cur.begin)
    if spec.flush_interval_ms > 0 and spool.first_append_time:
        interval = spec.flush_interval_ms / 1000
        if int(spool.first_append_time / interval) != int(time.time() / interval):
            flush = True  # the fragment holds content of an earlier flush interval
    if not flush:
        return cur
    end = cur.end
    if roll_to_offset:
        if end > roll_to_offset:
            raise AssertionError(f"cannot roll a spool ending at {end} back to {roll_to_offset}")
        end = roll_to_offset
    return Fragment(journal=cur.journal, begin=end, end=end, sum=EMPTY_SUM, codec=spec.compression_codec)
