"""Recovery hints in etcd (Gazette's consumer hints): what a player needs to play only the live part
of a shard's recovery log.

Keys: `{hint_prefix}/{shard}.primary`, written by the shard's primary as it records (guarded by its
assignment: a primary that lost the shard writes nothing), and `{hint_prefix}/{shard}.backup.{i}`
for i < hint_backups, rotated by each new primary once its playback completed and its store
restored (the hints it played to, newest first): if the latest primary hints are ever unusable, an
older set still plays the log. A player takes the first set present: the primary, else the backups in
order, else none (the whole log, from its start). Hints a process cannot use (another log's, or
describing no history) are an error naming their key, never silently skipped.

Values are `FSMHints` as JSON (readable with `etcdctl get`); binary protobuf is read too (a value
not starting with `{`).
"""

from __future__ import annotations

import dataclasses
import logging

from google.protobuf import json_format
from google.protobuf.message import DecodeError

from tidings.consumer.recoverylog import _metrics as metrics
from tidings.consumer.recoverylog.fsm import FSM, HintsError
from tidings.keyspace.etcd import Compare, Etcd, mod_revision_is, put_op
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol import validate
from tidings.protocol.status import ValidationError

__all__ = ["HintKeys", "Hints", "decode", "encode", "fetch", "pick_first", "store_recorded", "store_recovered"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class HintKeys:
    prefix: str  # the spec's hint_prefix
    shard: str
    backups: int  # the spec's hint_backups

    @property
    def primary(self) -> str:
        return f"{self.prefix}/{self.shard}.primary"

    def backup(self, i: int) -> str:
        return f"{self.prefix}/{self.shard}.backup.{i}"

    @property
    def all(self) -> list[str]:
        return [self.primary, *(self.backup(i) for i in range(self.backups))]

    def is_slot(self, key: str) -> bool:
        """Whether `key` is one of this shard's hint slots (whatever its number of backups)."""
        rest = key.removeprefix(f"{self.prefix}/{self.shard}.")
        return rest != key and (rest == "primary" or (rest.startswith("backup.") and rest[7:].isdigit()))


@dataclasses.dataclass(frozen=True, slots=True)
class Hints:
    """The hints at each key (None where there are none), with the keys' mod revisions."""

    keys: HintKeys
    values: dict[str, pb.FSMHints | None]
    revisions: dict[str, int]  # 0: no such key
    errors: dict[str, HintsError] = dataclasses.field(default_factory=dict)  # keys whose hints are unusable

    @property
    def primary(self) -> pb.FSMHints | None:
        return self.values[self.keys.primary]

    @property
    def backups(self) -> list[pb.FSMHints | None]:
        return [self.values[self.keys.backup(i)] for i in range(self.keys.backups)]


def encode(hints: pb.FSMHints) -> bytes:
    return json_format.MessageToJson(hints, indent=None).encode()


def decode(raw: bytes, key: str, log: str) -> pb.FSMHints:
    """Hints stored at `key`, checked for the shard's `log` and for describing a possible history."""
    hints = pb.FSMHints()
    try:
        if raw.lstrip().startswith(b"{"):
            json_format.Parse(raw, hints)
        else:
            hints.ParseFromString(raw)
        validate.fsm_hints(hints)
        FSM(hints)
    except (json_format.ParseError, DecodeError, ValueError, ValidationError, HintsError) as exc:
        raise HintsError(f"hints at {key} are unusable: {exc}") from None
    if hints.log != log:
        raise HintsError(f"hints at {key} are of recovery log {hints.log!r}, not the shard's {log!r}")
    return hints


async def fetch(etcd: Etcd, keys: HintKeys, log: str) -> Hints:
    """Every hint key of the shard, read at one revision."""
    values: dict[str, pb.FSMHints | None] = {}
    revisions: dict[str, int] = {}
    errors: dict[str, HintsError] = {}
    for key, (revision, raw) in (await fetch_raw(etcd, keys)).items():
        values[key], revisions[key] = None, revision
        if raw is not None:
            try:
                values[key] = decode(raw, key, log)
            except HintsError as exc:
                errors[key] = exc
    return Hints(keys, values, revisions, errors)


def pick_first(hints: Hints, journal: str) -> pb.FSMHints:
    """The primary hints, else the first usable backup (with a warning for each unusable set before
    it); none at all: play the log from its start. Only unusable sets: HintsError (the log's start may
    be gone: playing from it could build an empty store)."""
    for key in hints.keys.all:
        h = hints.values[key]
        if h is not None:
            return h
        if key in hints.errors:
            log.warning("%s; trying the next set of hints", hints.errors[key])
    if hints.errors:
        raise next(iter(hints.errors.values()))
    return pb.FSMHints(log=journal)


async def store_recorded(etcd: Etcd, keys: HintKeys, hints: pb.FSMHints, guard: Compare) -> bool:
    """Write the primary's hints if `guard` (its assignment still being the one it had) holds."""
    ok, _ = await etcd.txn([guard], [put_op(keys.primary, encode(hints))])
    if not ok:
        log.info("shard %s: its hints were not written: it is no longer its primary", keys.shard)
    else:
        metrics.HINTS_WRITTEN.labels("recorded").inc()
    return ok


async def store_recovered(etcd: Etcd, keys: HintKeys, hints: pb.FSMHints, guard: Compare) -> bool:
    """Rotate `hints` (those playback completed with) into the backups, newest first, and make them the
    primary hints too (they are valid from now on); guarded by `guard` and by every key's revision as
    read (a concurrent rotation makes this one fail: False)."""
    current = await fetch_raw(etcd, keys)
    compares = [guard, *(mod_revision_is(k, rev) for k, (rev, _) in current.items())]
    raw = encode(hints)
    ops = [put_op(keys.primary, raw)]
    chain = [raw, *(current[keys.backup(i)][1] for i in range(keys.backups))]
    for i in range(keys.backups):
        value = chain[i]
        if value is not None:
            ops.append(put_op(keys.backup(i), value))
    ok, _ = await etcd.txn(compares, ops)
    if ok:
        metrics.HINTS_WRITTEN.labels("recovered").inc()
    return ok


async def fetch_raw(etcd: Etcd, keys: HintKeys) -> dict[str, tuple[int, bytes | None]]:
    """Each hint key's (mod revision, value), read at one revision ((0, None): no such key)."""
    found, _ = await etcd.get_prefix(f"{keys.prefix}/{keys.shard}.")
    by_key = {kv.key: kv for kv in found}
    out: dict[str, tuple[int, bytes | None]] = {}
    for key in keys.all:
        kv = by_key.get(key)
        out[key] = (kv.mod_revision, kv.value) if kv is not None else (0, None)
    return out
