"""`tidings shards hints | recover | prune`: the operator's side of recovery logs (Gazette's gazctl shards
prune / recover; docs/design/recovery-logs.md §3.10). Registered onto the `shards` group.

* `hints` prints what a player of the shard's log would read: the primary's hints and each backup's,
  as etcd holds them (any consumer process answers GetHints).
* `recover` plays the log into a local directory without touching the shard (it never appends: a
  player's heads come from zero-byte appends, which write nothing), then makes the SQLite database a
  single file the stdlib `sqlite3` (or the `sqlite3` shell) opens.
* `prune` removes the persisted fragments of recovery logs that no hint set of any shard using them
  needs (and the logs whose hints are incomplete are left alone, said why).
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from tidings.cli._common import DEFAULT_BROKER, BrokerOpt, broker_client, err, out, run_async, usage
from tidings.cli.shards import DEFAULT_CONSUMER, ConsumerOpt, _shard_client, shards
from tidings.protocol import labels, validate
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.status import TidingsError, ValidationError

if TYPE_CHECKING:  # (annotations only: commands import the client, consumer and fragment packages when they run)
    from tidings.client import AsyncClient
    from tidings.consumer.recoverylog.segment import Segment
    from tidings.fragment.fragment import Fragment

_SLOT = re.compile(r"primary|backup\.(0|[1-9][0-9]{0,8})")


def _shard_arg(value: str) -> str:
    try:
        validate.shard_id(value, "ID")
    except ValidationError as exc:
        usage(str(exc))
    return value


ShardArg = Annotated[str, typer.Argument(help="The shard's id.", callback=_shard_arg)]


async def _get_hints(consumer: str, shard: str) -> pb.GetHintsResponse:
    async with _shard_client(consumer) as sc:
        return await sc.get_hints(shard)


def _slots(resp: pb.GetHintsResponse) -> list[tuple[str, pb.GetHintsResponse.ResponseHints]]:
    """Every hint slot of a GetHints answer by name, in a player's order of preference."""
    return [("primary", resp.primary_hints), *((f"backup.{i}", r) for i, r in enumerate(resp.backup_hints))]


def _held(r: pb.GetHintsResponse.ResponseHints) -> pb.FSMHints | None:
    return r.hints if r.HasField("hints") else None


# -- hints ---------------------------------------------------------------------------------------


def _segment_dict(s: pb.Segment) -> dict[str, Any]:
    return {
        "author": s.author,
        "first_seq_no": s.first_seq_no,
        "first_offset": s.first_offset,
        "first_checksum": s.first_checksum,
        "last_seq_no": s.last_seq_no,
        "last_offset": s.last_offset,
        "log": s.log,
    }


def _hints_dict(h: pb.FSMHints) -> dict[str, Any]:
    """`h` with its proto field names and plain integers (json_format.ParseDict reads it back)."""
    nodes = [{"fnode": n.fnode, "segments": [_segment_dict(s) for s in n.segments]} for n in h.live_nodes]
    return {"log": h.log, "live_nodes": nodes}


def _reads_from(h: pb.FSMHints) -> int | None:
    """The first log offset a player of `h` reads (None: no live files, it reads the log from 0)."""
    return min((s.first_offset for n in h.live_nodes for s in n.segments), default=None)


def _slot_dict(r: pb.GetHintsResponse.ResponseHints) -> dict[str, Any]:
    h = _held(r)
    return {
        "key": r.key,
        "hints": _hints_dict(h) if h is not None else None,
        "error": r.error or None,
        "live_files": len(h.live_nodes) if h is not None else 0,
        "segments": sum(len(n.segments) for n in h.live_nodes) if h is not None else 0,
        "reads_from": _reads_from(h) if h is not None else None,
    }


def _segment_line(s: pb.Segment) -> str:
    where = f"{s.first_offset}-{s.last_offset} ({s.last_offset - s.first_offset} bytes)" if s.last_offset else (
        f"{s.first_offset}- (open: the recorder's, its end unknown)"
    )  # fmt: skip
    other = f" of log {s.log}" if s.log else ""
    return f"ops {s.first_seq_no}-{s.last_seq_no} by {s.author:08x}{other} at {where}"


def _print_slot(name: str, r: pb.GetHintsResponse.ResponseHints) -> None:
    h = _held(r)
    if r.error:
        out.print(f"{name} ({r.key}): unusable: {r.error}", highlight=False)
        return
    if h is None:
        out.print(f"{name} ({r.key}): none", highlight=False)
        return
    if not h.live_nodes:
        out.print(f"{name} ({r.key}): no live files: a player reads the whole log, from offset 0", highlight=False)
        return
    segments = sum(len(n.segments) for n in h.live_nodes)
    out.print(
        f"{name} ({r.key}): {len(h.live_nodes)} live files, {segments} segments; a player reads from offset "
        f"{_reads_from(h)}",
        highlight=False,
    )
    for n in h.live_nodes:
        out.print(f"  fnode {n.fnode}: " + "; ".join(_segment_line(s) for s in n.segments), highlight=False)


@shards.command("hints")
def shards_hints(
    id: ShardArg, consumer: ConsumerOpt = DEFAULT_CONSUMER, as_json: Annotated[bool, typer.Option("--json")] = False
) -> None:
    """Print the shard's recovery hints as etcd holds them (any consumer process reads them): the
    primary's, then each backup's (newest first); per live file (fnode), the log segments holding its
    operations, which are all a player reads of the log before its last segment."""
    resp = run_async(_get_hints(consumer, id))
    if as_json:
        row: dict[str, Any] = {"shard": id, "log": resp.log, "primary": _slot_dict(resp.primary_hints)}
        row["backups"] = [_slot_dict(r) for r in resp.backup_hints]
        print(json.dumps(row))
        return
    out.print(f"shard {id}: recovery log {resp.log}", highlight=False)
    for name, r in _slots(resp):
        _print_slot(name, r)


# -- recover -------------------------------------------------------------------------------------


def _check_slot(value: str) -> str:
    if value and not _SLOT.fullmatch(value):
        usage(f"--hints {value!r} is not primary or backup.N (N a backup slot, from 0)")
    return value


def _check_dir(value: Path) -> Path:
    """--dir must be new or empty: a played directory holds the log's files only (and playback starts
    by wiping it)."""
    if value.exists() or value.is_symlink():
        if not value.is_dir():
            usage(f"--dir {value} is not a directory: give an empty or new one")
        if any(value.iterdir()):
            usage(f"--dir {value} is not empty: give an empty or new directory (recover plays the log's files there)")
    return value


def _choose(shard: str, resp: pb.GetHintsResponse, wanted: str) -> tuple[str, pb.FSMHints]:
    """The hints to play, and what they are: `wanted`'s, else the first usable set in a player's order
    (hints.pick_first's rule: unusable sets are warned about and passed over; none at all plays the
    log from its start; only unusable ones are an error: the log's start may be gone)."""
    slots = _slots(resp)
    if wanted:
        named = dict(slots)
        if wanted not in named:
            raise TidingsError(f"shard {shard!r} has no {wanted} hint slot: it keeps {len(resp.backup_hints)} "
                               "backups (its hint_backups)")  # fmt: skip
        r = named[wanted]
        h = _held(r)
        if r.error:
            raise TidingsError(f"shard {shard!r}: its {wanted} hints are unusable: {r.error}")
        if h is None:
            raise TidingsError(f"shard {shard!r}: there are no {wanted} hints ({r.key} holds none)")
        return f"the {wanted} hints", h
    errors = []
    for name, r in slots:
        h = _held(r)
        if h is not None:
            return f"the {name} hints", h
        if r.error:
            err.print(f"warning: {name} hints are unusable ({r.error}); trying the next set", highlight=False)
            errors.append(r.error)
    if errors:
        raise TidingsError(f"shard {shard!r} has no usable hints (the log's start may be gone): {errors[0]}")
    return "no hints (the whole log)", pb.FSMHints(log=resp.log)


@dataclasses.dataclass(frozen=True, slots=True)
class _Recovered:
    source: str  # which hints were played
    log: str
    last_seq_no: int
    bytes_read: int
    applied: int
    skipped: int
    write_head: int


async def _recover(consumer: str, broker: str, shard: str, dir: Path, wanted: str) -> _Recovered:
    from tidings.consumer.recovery import check_log
    from tidings.consumer.recoverylog.fsm import HintsError
    from tidings.consumer.recoverylog.player import Player

    resp = await _get_hints(consumer, shard)
    source, hints = _choose(shard, resp, wanted)
    async with broker_client(broker) as c:
        await check_log(c, shard, resp.log)
        player = Player(c, hints, dir)
        player.finish_at_write_head()
        try:
            played = await player.play()
        except HintsError as exc:
            raise TidingsError(f"{source} cannot be played: {exc}") from None
        except OSError as exc:
            raise TidingsError(f"cannot play into --dir {dir}: {exc}") from None
    stats = player.statistics()
    return _Recovered(
        source, resp.log, played.fsm.next_seq_no - 1, stats.bytes_read, stats.applied, stats.skipped, played.write_head
    )


def _single_file(db: Path) -> str:
    """Checkpoint the played WAL into the database and leave rollback journaling on (the recorded store
    runs WAL with exclusive locking): one file, which any SQLite opens. Its journal mode."""
    import sqlite3

    try:
        conn = sqlite3.connect(db)
        try:
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            mode: str = conn.execute("PRAGMA journal_mode=DELETE").fetchone()[0]
        finally:
            conn.close()
    except sqlite3.Error as exc:
        raise TidingsError(
            f"{db} was played, but SQLite cannot open it ({exc}); --raw keeps the files as played"
        ) from None
    return mode


@shards.command("recover")
def shards_recover(
    id: ShardArg,
    dir: Annotated[
        Path,
        typer.Option("--dir", help="An empty or new directory to play the shard's store into.", callback=_check_dir),
    ],
    consumer: ConsumerOpt = DEFAULT_CONSUMER,
    broker: BrokerOpt = DEFAULT_BROKER,
    hints: Annotated[
        str,
        typer.Option(
            "--hints",
            help="Play from these hints: primary or backup.N (default: the first usable set, primary first).",
            callback=_check_slot,
        ),
    ] = "",
    raw: Annotated[
        bool, typer.Option("--raw", help="Leave the files as played (a SQLite WAL beside the database).")
    ] = False,
) -> None:
    """Play the shard's recovery log to its write head into --dir (Gazette's shards recover): the
    store as the log holds it, for inspection or a restore; the shard and its log are not touched.
    A SQLite store's database is then made a single file (`sqlite3 DIR/store.db` opens it) unless --raw.
    Prints the files, their sizes, the last operation played and the log bytes read."""
    from tidings.consumer.store_recorded import DATABASE

    done = run_async(_recover(consumer, broker, id, dir, hints))
    db = dir / DATABASE
    mode = _single_file(db) if not raw and db.is_file() else ""
    out.print(
        f"played recovery log {done.log} into {dir} from {done.source}: last op {done.last_seq_no}, "
        f"{done.applied} ops applied, {done.skipped} skipped, {done.bytes_read} log bytes read (write head "
        f"{done.write_head})",
        highlight=False,
    )
    for path in sorted(p for p in dir.rglob("*") if p.is_file()):
        out.print(f"  {path.relative_to(dir)}  {path.stat().st_size} bytes", highlight=False)
    if mode:
        out.print(f"{DATABASE}: WAL checkpointed, journal_mode {mode}: open it with `sqlite3 {db}`", highlight=False)


# -- prune ---------------------------------------------------------------------------------------


@dataclasses.dataclass(slots=True)
class _Log:
    """One recovery log's prune: what the shards using it need, and what it holds."""

    name: str
    shards: list[str] = dataclasses.field(default_factory=list)
    needed: list[Segment] = dataclasses.field(default_factory=list)
    skipped: str = ""  # why nothing of it is removed
    fragments: int = 0
    bytes: int = 0
    pruned: int = 0
    pruned_bytes: int = 0
    failed: list[str] = dataclasses.field(default_factory=list)

    def row(self, dry_run: bool) -> dict[str, Any]:
        return {
            "log": self.name,
            "shards": self.shards,
            "skipped": self.skipped or None,
            "fragments": self.fragments,
            "bytes": self.bytes,
            "pruned": self.pruned,
            "pruned_bytes": self.pruned_bytes,
            "failed": self.failed,
            "dry_run": dry_run,
        }


def _needed_segments(shard: str, resp: pb.GetHintsResponse) -> tuple[list[Segment], str]:
    """The log segments every hint set of `shard` needs, each set's last one open-ended (a player reads
    on from it to the write head); or why the shard's hints do not allow pruning (every slot must hold
    usable hints with live files: a set missing may be one a player still falls back on)."""
    from tidings.consumer.recoverylog.fsm import FSM, HintsError

    needed: list[Segment] = []
    primary, *backups = _slots(resp)
    for name, r in [*backups, primary]:  # (Gazette's order)
        h = _held(r)
        if r.error:
            return needed, f"shard {shard}: its {name} hints are unusable ({r.error})"
        if h is None:
            return needed, f"shard {shard} has no {name} hints yet ({r.key})"
        if not h.live_nodes:
            return needed, f"shard {shard}: its {name} hints have no live files"
        try:
            segments = [dataclasses.replace(s) for s in FSM(h).hinted_segments]
        except HintsError as exc:
            return needed, f"shard {shard}: its {name} hints are unusable ({exc})"
        segments[-1].last_offset = 0
        needed.extend(segments)
    return needed, ""


def _overlaps(segments: list[Segment], f: Fragment) -> bool:
    """Whether a player of any hint set may read `f` (Gazette's overlapsAnySegment: a last offset of 0
    is open-ended)."""
    return any(s.first_offset < f.end and (s.last_offset == 0 or s.last_offset > f.begin) for s in segments)


def _remove_each(fragments: list[Fragment]) -> list[tuple[Fragment, str]]:
    """Remove each fragment from its store (blocking); the ones that failed, with why."""
    from tidings.fragment import retention

    failed = []
    for f in fragments:
        try:
            retention.remove([f])
        except Exception as exc:  # (a store's own errors: counted and reported, the others still go)
            failed.append((f, f"[{f.begin}, {f.end}) in {f.backing_store}: {exc}"))
    return failed


async def _prune_log(c: AsyncClient, log: _Log, dry_run: bool) -> None:
    """List the log's fragments and remove the persisted ones no needed segment overlaps; none at all
    if an unpersisted one overlaps none (the hints are not all known: a shard left out?)."""
    import asyncio

    from tidings.fragment.fragment import Fragment
    from tidings.protocol.status import JournalNotFoundError, SuspendedError

    try:
        listed = await c.fragments(log.name)
    except JournalNotFoundError:
        log.skipped = "the journal does not exist"
        return
    except SuspendedError:
        log.skipped = "the journal is suspended"
        return
    gone: list[Fragment] = []
    for e in listed.fragments:
        f = Fragment.from_proto(e.spec)
        log.fragments += 1
        log.bytes += f.content_length
        if f.begin == f.end or _overlaps(log.needed, f):
            continue
        if not f.backing_store or f.mod_time <= 0:
            log.skipped = (
                f"its fragment [{f.begin}, {f.end}) is not persisted yet and no hint set needs it: is a shard "
                "using this log outside --selector? (or its store lags: prune again later)"
            )
            return
        gone.append(f)
    failed = [] if dry_run else await asyncio.to_thread(_remove_each, gone)
    kept = {id(f) for f, _why in failed}
    log.failed = [why for _f, why in failed]
    log.pruned = sum(1 for f in gone if id(f) not in kept)
    log.pruned_bytes = sum(f.content_length for f in gone if id(f) not in kept)


async def _prune(consumer: str, broker: str, selector: str, dry_run: bool) -> tuple[list[_Log], int]:
    """Each recovery log of the shards `selector` matches, pruned (or not, and why); the shards matched."""
    from tidings.consumer.recovery import recovery_log

    logs: dict[str, _Log] = {}
    async with _shard_client(consumer) as sc:
        listed = await sc.list(labels.parse_selector(selector) if selector else None)
        if not listed.shards:
            raise TidingsError(f"no shard matches --selector {selector!r} (see `tidings shards list`)")
        for s in listed.shards:
            if not s.spec.recovery_log_prefix:
                continue
            name = recovery_log(s.spec)
            log = logs.setdefault(name, _Log(name))
            log.shards.append(s.spec.id)
            needed, why = _needed_segments(s.spec.id, await sc.get_hints(s.spec.id))
            for seg_log in {name, *(x.log for x in needed)}:  # (a log the hints name is used by this shard too)
                other = logs.setdefault(seg_log, _Log(seg_log))
                if why:
                    other.skipped = other.skipped or why
            for x in needed if not why else []:
                logs[x.log].needed.append(x)
    async with broker_client(broker) as c:
        for log in sorted(logs.values(), key=lambda lg: lg.name):
            if not log.skipped:
                await _prune_log(c, log, dry_run)
    return sorted(logs.values(), key=lambda lg: lg.name), len(listed.shards)


def _prune_line(log: _Log, dry_run: bool) -> str:
    who = f"{log.name} (shard{'s' if len(log.shards) != 1 else ''} {', '.join(log.shards) or '-'})"
    if log.skipped:
        return f"{who}: skipped: {log.skipped}"
    verb = "would remove" if dry_run else "removed"
    kept = log.fragments - log.pruned
    line = (f"{who}: {verb} {log.pruned} of {log.fragments} fragments ({log.pruned_bytes} of {log.bytes} bytes); "
            f"kept {kept}")  # fmt: skip
    if log.failed:
        line += f"; {len(log.failed)} could not be removed: {'; '.join(log.failed)}"
    return line


@shards.command("prune")
def shards_prune(
    consumer: ConsumerOpt = DEFAULT_CONSUMER,
    broker: BrokerOpt = DEFAULT_BROKER,
    selector: Annotated[
        str, typer.Option(help="Prune the recovery logs of the shards it matches (default: all).")
    ] = "",
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Say what would go; remove nothing.")] = False,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Remove the persisted fragments of the shards' recovery logs that no hint set needs (Gazette's
    shards prune): for each log, the primary and every backup hints of each shard using it are read;
    a fragment overlapping none of their segments (each set's last segment open-ended: a player reads
    on from there) goes from its store. A log any of whose shards lacks a full set of hints is
    skipped, and said why. Every shard using a log must match --selector (a fragment of theirs
    would look unneeded). Exit code 1 if a removal failed."""
    logs, matched = run_async(_prune(consumer, broker, selector, dry_run))
    for log in logs:
        print(json.dumps(log.row(dry_run)) if as_json else _prune_line(log, dry_run), flush=True)
    if not logs and not as_json:
        print(f"none of the {matched} shards matched has a recovery log: nothing to prune")
    failed = sum(len(log.failed) for log in logs)
    if failed:
        raise TidingsError(f"{failed} fragments could not be removed from their stores (see above); prune again")
