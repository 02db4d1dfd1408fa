"""Spool: a replica's transactional memory of its journal (gazette-transactional-appends.txt, *Components*).

A Spool holds the Fragment currently being built (in a local file), the journal's registers,
and `delta`: bytes received beyond the committed end that are not yet committed. It is a
small state machine driven by ReplicateRequests, and every replica runs it independently:

- **content**: a chunk (alone, or ahead of a proposal in the same request) whose
  `content_delta` equals `delta` is written after the committed end and folded into a running
  SHA1 (`delta` grows). Any other delta is an invalid transition.
- **commit**: a proposal that extends the current Fragment by exactly `delta` bytes, with the
  SHA1 of all content so far, is adopted (the end moves; registers are replaced).
- **rollback**: a proposal equal to the current Fragment discards the uncommitted `delta`
  (the running SHA1 goes back to its committed state: hashlib objects copy cheaply).
- **roll**: an empty proposal at or beyond the current end completes the current Fragment
  (handed to the observer for persisting) and starts a new, empty one there.
- anything else is a **mismatch**: PROPOSAL_MISMATCH, answered with this spool's own view
  (Fragment and registers) so the primary can re-synchronize.

Readers never see uncommitted bytes: the observer hears of a Fragment only once it commits, and
committed bytes of a spool file are never rewritten. Spool files are not fsynced: durability
comes from replication to R brokers (as in Gazette) and from persisting completed fragments.

Ownership: exactly one Append or Replicate RPC owns a Spool at a time (a token in the
replica's `spool_slot`); nothing here is safe to call without holding it.
"""

from __future__ import annotations

import enum
import hashlib
import os
import time
import uuid
from pathlib import Path
from typing import Protocol

from tidings.fragment.fragment import EMPTY_SUM, Fragment
from tidings.protocol import labels
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.status import ValidationError


class SpoolObserver(Protocol):
    """Told of every commit (readers wake up), every completed Fragment (to persist), and every gap."""

    def spool_commit(self, fragment: Fragment, path: str) -> None: ...

    def spool_complete(self, fragment: Fragment, path: str) -> None: ...

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
    * `directory` - where spool files are created (one file per Fragment).
    * `observer` - told of commits and completed fragments.
    """

    def __init__(self, journal: str, directory: str | Path, observer: SpoolObserver | None = None) -> None:
        self.journal = journal
        self.directory = Path(directory)
        self.observer = observer
        self.fragment = Fragment(journal=journal, begin=0, end=0, sum=EMPTY_SUM, codec=pb.NONE)
        self.registers = pb.LabelSet()
        self.delta = 0
        self.path: str | None = None
        self.created_at = time.time()  # when the current Fragment began (for the flush interval)
        self._fd: int | None = None
        self._sum = hashlib.sha1()  # SHA1 of committed content of the current Fragment
        self._pending: hashlib._Hash | None = None  # SHA1 including the uncommitted delta

    # -- queries ---------------------------------------------------------------------------

    @property
    def end(self) -> int:
        """The committed end offset: where the next append lands."""
        return self.fragment.end

    def next_fragment(self) -> Fragment:
        """The Fragment that committing the current `delta` would produce."""
        pending = self._pending or self._sum
        return Fragment(
            journal=self.journal,
            begin=self.fragment.begin,
            end=self.fragment.end + self.delta,
            sum=pending.digest() if self.delta else self.fragment.sum,
            codec=self.fragment.codec,
        )

    def mismatch_response(self) -> pb.ReplicateResponse:
        return pb.ReplicateResponse(
            status=pb.PROPOSAL_MISMATCH, fragment=self.fragment.to_proto(), registers=self.registers
        )

    # -- transitions -----------------------------------------------------------------------

    def apply(self, req: pb.ReplicateRequest) -> pb.ReplicateResponse:
        """Apply one validated ReplicateRequest: its content chunk, then its proposal (a request
        may carry both: an append's last chunk travels with its commit). Raises ValidationError
        on a bad content delta, which aborts the stream; a refused proposal is a
        PROPOSAL_MISMATCH response instead."""
        if req.content:
            self.apply_content(req.content, req.content_delta)
        if req.HasField("proposal"):
            return self.apply_proposal(Fragment.from_proto(req.proposal), req.registers)
        return pb.ReplicateResponse(status=pb.OK)

    def apply_content(self, content: bytes | memoryview, content_delta: int) -> None:
        """Write a chunk after the committed end plus `delta`, folding it into the running SHA1."""
        if content_delta != self.delta:
            raise ValidationError(
                "replicate.content_delta", f"expected delta {self.delta}, got {content_delta}: the stream diverged"
            )
        if not content:
            return
        fd = self._ensure_file()
        os.pwrite(fd, content, self.fragment.content_length + self.delta)
        if self._pending is None:
            self._pending = self._sum.copy()
        self._pending.update(content)
        self.delta += len(content)

    def classify(self, proposal: Fragment) -> Transition:
        """Which transition `proposal` asks for, given this spool's state."""
        cur = self.fragment
        if proposal.journal != self.journal:
            return Transition.MISMATCH
        if proposal == cur:
            return Transition.ROLLBACK
        if (
            proposal.begin == cur.begin
            and proposal.end == cur.end + self.delta
            and proposal.codec == cur.codec
            and self.delta > 0
        ):
            return Transition.COMMIT if proposal.sum == self.next_fragment().sum else Transition.MISMATCH
        if proposal.begin == proposal.end and proposal.begin >= cur.end and proposal.sum == EMPTY_SUM:
            return Transition.ROLL
        return Transition.MISMATCH

    def apply_proposal(self, proposal: Fragment, registers: pb.LabelSet) -> pb.ReplicateResponse:
        transition = self.classify(proposal)
        if transition is Transition.MISMATCH:
            return self.mismatch_response()
        if transition is Transition.COMMIT:
            self._commit(proposal)
        elif transition is Transition.ROLLBACK:
            self.rollback()
        else:
            self._roll(proposal)
        self.registers = registers
        return pb.ReplicateResponse(status=pb.OK)

    def rollback(self) -> None:
        """Discard uncommitted content (its bytes in the file are overwritten later)."""
        self.delta = 0
        self._pending = None

    def _commit(self, proposal: Fragment) -> None:
        assert self._pending is not None
        self._sum, self._pending = self._pending, None
        self.delta = 0
        self.fragment = proposal
        if self.observer is not None and self.path is not None:
            self.observer.spool_commit(proposal, self.path)

    def _roll(self, proposal: Fragment) -> None:
        """Complete the current Fragment (if it holds content) and begin an empty one at `proposal`."""
        self.rollback()
        self._complete()
        gap = (self.fragment.end, proposal.begin)
        self.fragment = proposal
        self._sum = hashlib.sha1()
        self.created_at = time.time()
        if gap[1] > gap[0] and gap[0] > 0 and self.observer is not None:
            self.observer.spool_gap(*gap)

    def roll_to(self, offset: int, codec: int) -> Fragment:
        """Primary side: roll locally to an empty Fragment at `offset`; returns the proposal to send."""
        proposal = Fragment(journal=self.journal, begin=offset, end=offset, sum=EMPTY_SUM, codec=codec)
        self._roll(proposal)
        return proposal

    def _complete(self) -> None:
        fd, path = self._fd, self.path
        self._fd, self.path = None, None
        if fd is not None:
            os.close(fd)
        if path is None:
            return
        if self.fragment.content_length and self.observer is not None:
            os.truncate(path, self.fragment.content_length)
            self.observer.spool_complete(self.fragment, path)
        elif not self.fragment.content_length:
            os.unlink(path)

    def _ensure_file(self) -> int:
        if self._fd is None:
            self.directory.mkdir(parents=True, exist_ok=True)
            name = f"spool-{self.fragment.begin:016x}-{uuid.uuid4().hex[:8]}"
            self.path = str(self.directory / name)
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        return self._fd

    def close(self) -> None:
        """Complete the current Fragment (hand it to the observer to persist) and close the file."""
        self.rollback()
        self._complete()


def apply_registers(current: pb.LabelSet, union: pb.LabelSet, subtract: pb.LabelSet) -> pb.LabelSet:
    """Registers after an append: `union` then `subtract` (Gazette's order)."""
    return labels.subtract(labels.union(current, union), subtract)
