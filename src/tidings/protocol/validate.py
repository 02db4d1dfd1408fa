"""Validation of every message a broker accepts (Gazette's Validate(), as functions).

Each function raises ValidationError naming a dotted context (``spec.fragment.length``) and
what to do. Handlers validate once at the edge and never check shapes again.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.status import ValidationError

MAX_JOURNAL_NAME = 512
MAX_REPLICATION = 5
MAX_CHUNK = 4 * 1024 * 1024  # largest content chunk a broker accepts in one message
MAX_OFFSET = 1 << 62
MIN_FRAGMENT_LENGTH = 1024
MAX_FRAGMENT_LENGTH = 1 << 34
MAX_HINT_BACKUPS = 16  # (a shard's delete removes every hint slot in one etcd transaction: 128 ops at most)

_NAME_CHARS = re.compile(r"^[A-Za-z0-9_\-+.=%/]+$")
_TOKEN = re.compile(r"^[A-Za-z0-9_\-+.=%]+$")
_LABEL_NAME = re.compile(r"^[a-z0-9][a-z0-9_\-./]*$")
_STORE_SCHEME = re.compile(r"^[a-z][a-z0-9+.\-]*://")
# Object stores whose URL host is the bucket (container): it must be there.
BUCKET_SCHEMES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl"})
_VALID_FLAGS = {pb.JournalSpec.NOT_SPECIFIED, pb.JournalSpec.O_RDONLY, pb.JournalSpec.O_WRONLY, pb.JournalSpec.O_RDWR}


def journal_name(name: str, ctx: str = "journal") -> None:
    """Names are slash-separated segments of [A-Za-z0-9_-+.=%], without empty, '.' or '..' segments."""
    _path_name(name, ctx, "journal name", "examples/foo")


def shard_id(name: str, ctx: str = "shard") -> None:
    """Shard ids are named as journals are."""
    _path_name(name, ctx, "shard id", "word-count/part-000")


def _path_name(name: str, ctx: str, what: str, example: str) -> None:
    if not name:
        raise ValidationError(ctx, f"{what} is empty; give one such as `{example}`")
    if len(name) > MAX_JOURNAL_NAME:
        raise ValidationError(ctx, f"{what} is {len(name)} characters; at most {MAX_JOURNAL_NAME}")
    if not _NAME_CHARS.match(name):
        raise ValidationError(ctx, f"{what} {name!r} has characters outside [A-Za-z0-9_-+.=%/]")
    for seg in name.split("/"):
        if seg == "":
            raise ValidationError(ctx, f"{what} {name!r} has an empty segment (leading, trailing or '//')")
        if seg in (".", ".."):
            raise ValidationError(ctx, f"{what} {name!r} has a {seg!r} segment")


def token(value: str, ctx: str) -> None:
    if not value or not _TOKEN.match(value) or len(value) > 128:
        raise ValidationError(ctx, f"{value!r} must be 1-128 characters of [A-Za-z0-9_-+.=%]")


def process_id(pid: pb.ProcessId, ctx: str = "process_id") -> None:
    token(pid.zone, f"{ctx}.zone")
    token(pid.suffix, f"{ctx}.suffix")


def label_set(ls: pb.LabelSet, ctx: str = "labels", prefix_ok: bool = False) -> None:
    """Names and values, sorted and unique; `prefix_ok`: a selector's, whose names may end in `:prefix`."""
    prev: tuple[str, str] | None = None
    for i, lb in enumerate(ls.labels):
        name = lb.name.removesuffix(":prefix") if prefix_ok else lb.name
        if not _LABEL_NAME.match(name) or len(name) > 64:
            raise ValidationError(f"{ctx}[{i}].name", f"label name {lb.name!r} must match [a-z0-9][a-z0-9_-./]*")
        if len(lb.value) > 1024:
            raise ValidationError(f"{ctx}[{i}].value", "label value longer than 1024 characters")
        cur = (lb.name, lb.value)
        if prev is not None and cur <= prev:
            raise ValidationError(f"{ctx}[{i}]", "labels must be sorted and unique (build them with label_set())")
        prev = cur


def selector(sel: pb.LabelSelector, ctx: str = "selector") -> None:
    label_set(sel.include, f"{ctx}.include", prefix_ok=True)
    label_set(sel.exclude, f"{ctx}.exclude", prefix_ok=True)


def store_url(url: str, ctx: str = "store") -> None:
    """A fragment store URL's shape (Gazette's FragmentStore.Validate): scheme://, a bucket for object
    stores, an absolute path for file://, a path ending in '/'; a query may follow (the store's options).

    Whether this process can load the scheme's fsspec backend is checked a layer up
    (`tidings.fragment.store.check_store_url`).
    """
    what = f"fragment store {url!r}"
    if not _STORE_SCHEME.match(url):
        raise ValidationError(ctx, f"{what}: not a URL; write one like file:///abs/path/ or s3://bucket/prefix/")
    parts = urlsplit(url)
    if parts.scheme == "file" and parts.netloc:
        raise ValidationError(
            ctx, f"{what}: not an absolute path; write file:///absolute/path/ (three slashes, no host)"
        )
    if parts.scheme in BUCKET_SCHEMES and not parts.netloc:
        raise ValidationError(ctx, f"{what}: names no bucket; write {parts.scheme}://bucket/prefix/")
    if not (parts.netloc + parts.path).endswith("/") or parts.fragment:
        raise ValidationError(ctx, f"{what}: the path must end in '/' (a folder), e.g. {parts.scheme}://bucket/prefix/")


def fragment_spec(fs: pb.JournalSpec.FragmentSpec, ctx: str = "spec.fragment") -> None:
    if not MIN_FRAGMENT_LENGTH <= fs.length <= MAX_FRAGMENT_LENGTH:
        raise ValidationError(
            f"{ctx}.length", f"{fs.length} is outside [{MIN_FRAGMENT_LENGTH}, {MAX_FRAGMENT_LENGTH}] bytes"
        )
    if fs.compression_codec == pb.INVALID or fs.compression_codec not in pb.CompressionCodec.values():
        raise ValidationError(f"{ctx}.compression_codec", "must be one of none, gzip, zstd")
    for i, store in enumerate(fs.stores):
        store_url(store, f"{ctx}.stores[{i}]")
    if fs.refresh_interval_ms < 1000 or fs.refresh_interval_ms > 24 * 3600 * 1000:
        raise ValidationError(f"{ctx}.refresh_interval", "must be between 1s and 24h")
    if fs.flush_interval_ms < 0:
        raise ValidationError(f"{ctx}.flush_interval", "must not be negative")
    if fs.retention_ms < 0:
        raise ValidationError(f"{ctx}.retention", "must not be negative")


def journal_spec(spec: pb.JournalSpec, ctx: str = "spec") -> None:
    journal_name(spec.name, f"{ctx}.name")
    if not 1 <= spec.replication <= MAX_REPLICATION:
        raise ValidationError(f"{ctx}.replication", f"{spec.replication} is outside 1..{MAX_REPLICATION}")
    label_set(spec.labels, f"{ctx}.labels")
    fragment_spec(spec.fragment, f"{ctx}.fragment")
    if spec.flags not in _VALID_FLAGS:
        raise ValidationError(f"{ctx}.flags", "must be one of read-write, read-only, write-only")
    if spec.max_append_rate < 0:
        raise ValidationError(f"{ctx}.max_append_rate", "must not be negative")


MAX_HOT_STANDBYS = 8


def shard_spec(spec: pb.ShardSpec, ctx: str = "shard") -> None:
    """A shard's spec as Gazette checks it: its sources (each once), durations, standbys and labels."""
    shard_id(spec.id, f"{ctx}.id")
    if not spec.sources:
        raise ValidationError(f"{ctx}.sources", "a shard reads at least one journal; list its sources")
    seen: set[str] = set()
    for i, src in enumerate(spec.sources):
        journal_name(src.journal, f"{ctx}.sources[{i}].journal")
        if src.journal in seen:
            raise ValidationError(f"{ctx}.sources[{i}].journal", f"{src.journal!r} is listed twice")
        seen.add(src.journal)
        if not 0 <= src.min_offset <= MAX_OFFSET:
            raise ValidationError(f"{ctx}.sources[{i}].min_offset", f"{src.min_offset} is not an offset")
    if spec.recovery_log_prefix:
        journal_name(spec.recovery_log_prefix, f"{ctx}.recovery_log_prefix")
    if spec.hint_prefix and not spec.hint_prefix.startswith("/"):
        raise ValidationError(f"{ctx}.hint_prefix", f"{spec.hint_prefix!r} must be an etcd key prefix, from '/'")
    if not 0 <= spec.hint_backups <= MAX_HINT_BACKUPS:
        raise ValidationError(f"{ctx}.hint_backups", f"must be 0 to {MAX_HINT_BACKUPS}")
    if spec.max_txn_duration_ms <= 0:
        raise ValidationError(f"{ctx}.max_txn_duration", "must be more than 0 (e.g. 1s)")
    if not 0 <= spec.min_txn_duration_ms <= spec.max_txn_duration_ms:
        raise ValidationError(f"{ctx}.min_txn_duration", "must be 0 or more, and at most max_txn_duration")
    if not 0 <= spec.hot_standbys <= MAX_HOT_STANDBYS:
        raise ValidationError(f"{ctx}.hot_standbys", f"{spec.hot_standbys} is outside 0..{MAX_HOT_STANDBYS}")
    if spec.hot_standbys and not spec.recovery_log_prefix:
        raise ValidationError(f"{ctx}.hot_standbys", "standbys tail the recovery log: set recovery_log_prefix too")
    label_set(spec.labels, f"{ctx}.labels")
    if any(lb.name == "id" for lb in spec.labels.labels):
        raise ValidationError(f"{ctx}.labels", "the label 'id' is the shard's own; use another name")
    if spec.ring_buffer_size < 0 or spec.read_channel_size < 0:
        raise ValidationError(ctx, "ring_buffer_size and read_channel_size must not be negative")


def consumer_spec(spec: pb.ConsumerSpec, ctx: str = "consumer") -> None:
    process_id(spec.id, f"{ctx}.id")
    if spec.shard_limit < 0:
        raise ValidationError(f"{ctx}.shard_limit", "must not be negative")


def route(rt: pb.Route, ctx: str = "route") -> None:
    ids = [(m.zone, m.suffix) for m in rt.members]
    for i, m in enumerate(rt.members):
        process_id(m, f"{ctx}.members[{i}]")
    if ids != sorted(set(ids)):
        raise ValidationError(f"{ctx}.members", "must be sorted and unique")
    if not -1 <= rt.primary < len(rt.members):
        raise ValidationError(f"{ctx}.primary", f"{rt.primary} is not a member index")
    if rt.endpoints and len(rt.endpoints) != len(rt.members):
        raise ValidationError(f"{ctx}.endpoints", "must be empty or one per member")


def header(h: pb.Header, ctx: str = "header") -> None:
    if h.HasField("process_id") and (h.process_id.zone or h.process_id.suffix):
        process_id(h.process_id, f"{ctx}.process_id")
    route(h.route, f"{ctx}.route")
    if h.etcd.revision < 0:
        raise ValidationError(f"{ctx}.etcd.revision", "must not be negative")


def fragment(f: pb.Fragment, ctx: str = "fragment") -> None:
    journal_name(f.journal, f"{ctx}.journal")
    if not 0 <= f.begin <= f.end <= MAX_OFFSET:
        raise ValidationError(f"{ctx}", f"invalid span [{f.begin}, {f.end})")
    if len(f.sum) not in (0, 20):
        raise ValidationError(f"{ctx}.sum", "must be a 20-byte SHA1")
    if f.compression_codec not in pb.CompressionCodec.values() or f.compression_codec == pb.INVALID:
        raise ValidationError(f"{ctx}.compression_codec", "invalid codec")


def read_request(r: pb.ReadRequest, ctx: str = "read") -> None:
    if r.HasField("header"):
        header(r.header, f"{ctx}.header")
    journal_name(r.journal, f"{ctx}.journal")
    if r.offset < -1 or r.offset > MAX_OFFSET:
        raise ValidationError(f"{ctx}.offset", f"{r.offset} is invalid; use -1 for the write head or 0..2^62")
    if r.end_offset < 0 or r.end_offset > MAX_OFFSET or (r.end_offset and 0 <= r.offset and r.end_offset < r.offset):
        raise ValidationError(f"{ctx}.end_offset", f"{r.end_offset} is invalid (must be 0 or >= offset)")


def append_request_first(r: pb.AppendRequest, ctx: str = "append") -> None:
    if r.HasField("header"):
        header(r.header, f"{ctx}.header")
    journal_name(r.journal, f"{ctx}.journal")
    if r.offset < 0 or r.offset > MAX_OFFSET:
        raise ValidationError(f"{ctx}.offset", f"{r.offset} is invalid; expected offsets are 0..2^62")
    if len(r.content) > MAX_CHUNK:
        raise ValidationError(
            f"{ctx}.content", f"chunk of {len(r.content)} bytes exceeds {MAX_CHUNK}; send smaller chunks"
        )
    selector(r.check_registers, f"{ctx}.check_registers")
    label_set(r.union_registers, f"{ctx}.union_registers")
    label_set(r.subtract_registers, f"{ctx}.subtract_registers")
    if r.suspend not in pb.AppendRequest.Suspend.values():
        raise ValidationError(f"{ctx}.suspend", f"{r.suspend} is not a suspension control")
    if r.suspend != pb.AppendRequest.SUSPEND_RESUME and r.content:
        raise ValidationError(f"{ctx}.suspend", "an append that controls suspension carries no content")


def append_content(r: pb.AppendRequest, ctx: str = "append") -> None:
    if r.journal or r.HasField("header") or r.offset or r.HasField("check_registers") or r.suspend:
        raise ValidationError(ctx, "only the first message may carry metadata; later ones carry content only")
    if len(r.content) > MAX_CHUNK:
        raise ValidationError(
            f"{ctx}.content", f"chunk of {len(r.content)} bytes exceeds {MAX_CHUNK}; send smaller chunks"
        )


def replicate_request(r: pb.ReplicateRequest, ctx: str = "replicate") -> None:
    if r.HasField("header"):
        header(r.header, f"{ctx}.header")
    if not r.content and not r.HasField("proposal"):
        raise ValidationError(ctx, "expected a proposal, content, or content then a proposal")
    if r.HasField("proposal"):
        fragment(r.proposal, f"{ctx}.proposal")
        label_set(r.registers, f"{ctx}.registers")
    if r.content:
        if len(r.content) > MAX_CHUNK:
            raise ValidationError(f"{ctx}.content", f"chunk of {len(r.content)} bytes exceeds {MAX_CHUNK}")
        if r.content_delta < 0:
            raise ValidationError(f"{ctx}.content_delta", "must not be negative")


def segment(s: pb.Segment, ctx: str = "segment", implied_log: str = "") -> None:
    """A recovery-log Segment (Gazette's Segment.Validate); `implied_log` stands for an empty `log`."""
    if s.author == 0:
        raise ValidationError(f"{ctx}.author", "is zero; recorders' authors are non-zero")
    if s.first_seq_no <= 0:
        raise ValidationError(f"{ctx}.first_seq_no", f"{s.first_seq_no} is invalid; sequence numbers start at 1")
    if s.first_offset < 0:
        raise ValidationError(f"{ctx}.first_offset", f"{s.first_offset} is negative")
    if s.last_seq_no < s.first_seq_no:
        raise ValidationError(f"{ctx}.last_seq_no", f"{s.last_seq_no} is before first_seq_no {s.first_seq_no}")
    if s.last_offset != 0 and s.last_offset <= s.first_offset:
        raise ValidationError(f"{ctx}.last_offset", f"{s.last_offset} is not after first_offset {s.first_offset}")
    journal_name(s.log or implied_log, f"{ctx}.log")


def fsm_hints(h: pb.FSMHints, ctx: str = "hints") -> None:
    """Recovery-log hints (Gazette's FSMHints.Validate): a log, and segments that name another log or none."""
    journal_name(h.log, f"{ctx}.log")
    for i, node in enumerate(h.live_nodes):
        for j, s in enumerate(node.segments):
            where = f"{ctx}.live_nodes[{i}].segments[{j}]"
            if s.log == h.log:
                raise ValidationError(f"{where}.log", f"repeats the hints' log {h.log!r}; leave it empty")
            segment(s, where, h.log)
