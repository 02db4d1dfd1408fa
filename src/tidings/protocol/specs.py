"""Journal specs as YAML (for `tidings journals apply` and `list --format yaml`).

A file holds one journal mapping, a list of them, or ``{journals: [...]}``. Fields::

    name: examples/orders          # required
    replication: 3                 # 1..5, default 1
    labels: {app: shop}            # content-type here selects message framing; [a, b]: several values
    flags: read-write              # read-write | read-only | write-only
    max_append_rate: 0             # bytes/s, 0 = unlimited
    fragment:
      length: 64MiB                # target fragment size
      compression_codec: zstd      # none | gzip | zstd
      stores: [file:///var/tidings/fragments/]
      refresh_interval: 30s
      flush_interval: 0s           # 0 = roll on size only
      retention: 0s                # 0 = keep forever
    suspend: {offset: 4096}        # set by brokers: where appends resume (see JournalSpec.Suspend)
    revision: 1234                 # optional: expected mod revision (0 = must not exist)
    delete: true                   # optional: delete the journal

Without `revision`, apply behaves as an upsert at the journal's current revision. A spec replaces
the journal's whole spec (as gazctl's apply does): a field the file omits takes its default, and
`apply` warns naming each field an update would so return to its default. `primary` and
`replicas` (what `journals list --yaml` prints beside a spec) are ignored, so that output applies
unchanged.
"""

from __future__ import annotations

import math
import re
from typing import Any, cast

from tidings.protocol import labels as lbl
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol import validate
from tidings.protocol.status import ValidationError

CODECS = {"none": pb.NONE, "gzip": pb.GZIP, "zstd": pb.ZSTANDARD, "zstandard": pb.ZSTANDARD}
CODEC_NAMES = {pb.NONE: "none", pb.GZIP: "gzip", pb.ZSTANDARD: "zstd"}
FLAGS: dict[str, int] = {  # JournalSpec.flags is a uint32 bit set, not the Flag enum
    "read-write": pb.JournalSpec.O_RDWR,
    "read-only": pb.JournalSpec.O_RDONLY,
    "write-only": pb.JournalSpec.O_WRONLY,
    "": pb.JournalSpec.NOT_SPECIFIED,
}
FLAG_NAMES: dict[int, str] = {v: k for k, v in FLAGS.items() if k} | {pb.JournalSpec.NOT_SPECIFIED: "read-write"}
_SIZE = re.compile(r"^\s*(\d+)\s*([KMGT]i?B?|B)?\s*$", re.I)
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_DUR_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "": 1000}


INT32, INT64 = 2**31 - 1, 2**63 - 1


def _count(value: Any, ctx: str, most: int = INT64) -> int:
    """A whole number given as one (YAML's 3), not text ("three", "3") or a fraction, at most `most`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValidationError(ctx, f"{value!r} is not a whole number: give one, e.g. 3")
    if value > most:
        raise ValidationError(ctx, f"{value} is more than {most}")
    return value


def parse_size(value: Any, ctx: str) -> int:
    if isinstance(value, int):
        return value
    m = _SIZE.match(str(value))
    if not m:
        raise ValidationError(ctx, f"{value!r} is not a size like 64MiB or 1048576")
    return int(m.group(1)) * _UNITS[(m.group(2) or "")[:1].lower()]


def parse_duration_ms(value: Any, ctx: str) -> int:
    if isinstance(value, bool) or (isinstance(value, float) and not math.isfinite(value)):
        raise ValidationError(ctx, f"{value!r} is not a duration like 30s, 500ms, 5m or 1h")
    if isinstance(value, int | float):
        return round(value * 1000)
    m = _DURATION.match(str(value))
    if not m:
        raise ValidationError(ctx, f"{value!r} is not a duration like 30s, 500ms, 5m or 1h")
    return round(float(m.group(1)) * _DUR_MS[m.group(2) or ""])


def format_duration(ms: int) -> str:
    """A duration exactly, in the largest unit that divides it (336h, 90s, 1500ms): what
    `parse_duration_ms` reads back to the same milliseconds."""
    if ms == 0:
        return "0s"
    for unit, size in (("h", 3_600_000), ("m", 60_000), ("s", 1000)):
        if ms % size == 0:
            return f"{ms // size}{unit}"
    return f"{ms}ms"


def _mapping(value: Any, ctx: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValidationError(ctx, f"{value!r} is not a mapping: give `key: value` pairs under it")
    return value


DEFAULT_FRAGMENT = {"length": "64MiB", "compression_codec": "none", "refresh_interval": "30s"}
STATUS_FIELDS = frozenset({"primary", "replicas"})  # what `journals list --yaml` adds; apply ignores them


def spec_from_dict(d: dict[str, Any], ctx: str = "journal") -> pb.JournalSpec:
    """Build and validate a JournalSpec from a YAML mapping; errors name the field."""
    if not isinstance(d, dict):
        raise ValidationError(ctx, "expected a mapping with at least `name`")
    known = {"name", "replication", "labels", "flags", "max_append_rate", "fragment", "suspend", "revision", "delete"}
    unknown = set(d) - known - STATUS_FIELDS
    if unknown:
        raise ValidationError(ctx, f"unknown field(s) {sorted(unknown)}; known: {sorted(known)}")
    frag = {**DEFAULT_FRAGMENT, **_mapping(d.get("fragment"), f"{ctx}.fragment")}
    if not isinstance(d.get("delete", False), bool):
        raise ValidationError(f"{ctx}.delete", f"{d['delete']!r}: give true or false (unquoted)")
    if "revision" in d and (_count(d["revision"], f"{ctx}.revision") < 0):
        raise ValidationError(f"{ctx}.revision", f"{d['revision']} must be 0 or more")
    codec = str(frag.get("compression_codec", "none")).lower()
    if codec not in CODECS:
        raise ValidationError(f"{ctx}.fragment.compression_codec", f"{codec!r}: use none, gzip or zstd")
    flags = str(d.get("flags", "read-write"))
    if flags not in FLAGS:
        raise ValidationError(f"{ctx}.flags", f"{flags!r}: use read-write, read-only or write-only")
    stores = frag.get("stores") or []
    if isinstance(stores, str):
        stores = [stores]
    spec = pb.JournalSpec(
        name=str(d.get("name", "")),
        replication=_count(d.get("replication", 1), f"{ctx}.replication"),
        labels=lbl.label_set(
            (str(k), str(one))
            for k, v in _mapping(d.get("labels"), f"{ctx}.labels").items()
            for one in (v if isinstance(v, list) else [v])  # (a name may have several values: a list)
        ),
        flags=FLAGS[flags],
        max_append_rate=parse_size(d.get("max_append_rate", 0), f"{ctx}.max_append_rate"),
        fragment=pb.JournalSpec.FragmentSpec(
            length=parse_size(frag["length"], f"{ctx}.fragment.length"),
            compression_codec=CODECS[codec],
            stores=[str(s) for s in stores],
            refresh_interval_ms=parse_duration_ms(frag["refresh_interval"], f"{ctx}.fragment.refresh_interval"),
            flush_interval_ms=parse_duration_ms(frag.get("flush_interval", 0), f"{ctx}.fragment.flush_interval"),
            retention_ms=parse_duration_ms(frag.get("retention", 0), f"{ctx}.fragment.retention"),
        ),
    )
    suspend = d.get("suspend") or {}
    if not isinstance(suspend, dict) or set(suspend) - {"offset", "level"}:
        raise ValidationError(f"{ctx}.suspend", "expected {offset: N} (brokers set it; leave it as listed)")
    level = str(suspend.get("level", "none")).upper()
    if level not in pb.JournalSpec.Suspend.Level.keys():
        raise ValidationError(f"{ctx}.suspend.level", f"{level.lower()!r}: use none, partial or full")
    offset = suspend.get("offset", 0)
    if not isinstance(offset, int) or offset < 0:
        raise ValidationError(f"{ctx}.suspend.offset", f"{offset!r} must be a non-negative offset")
    if suspend:
        spec.suspend.level = cast(pb.JournalSpec.Suspend.Level, pb.JournalSpec.Suspend.Level.Value(level))
        spec.suspend.offset = offset
    validate.journal_spec(spec, ctx)
    return spec


def desired_replication(spec: pb.JournalSpec) -> int:
    """How many replicas the journal wants now: its replication, one when partially suspended (its
    primary serves reads and persists), none when fully suspended (Gazette's suspension levels)."""
    level = spec.suspend.level
    if level == pb.JournalSpec.Suspend.FULL:
        return 0
    if level == pb.JournalSpec.Suspend.PARTIAL:
        return min(1, spec.replication)
    return spec.replication


def spec_to_dict(spec: pb.JournalSpec) -> dict[str, Any]:
    f = spec.fragment
    return {
        "name": spec.name,
        "replication": spec.replication,
        "labels": _labels_dict(spec.labels),
        "flags": FLAG_NAMES.get(spec.flags, "read-write"),
        "max_append_rate": spec.max_append_rate,
        "fragment": {
            "length": f.length,
            "compression_codec": CODEC_NAMES.get(f.compression_codec, "none"),
            "stores": list(f.stores),
            "refresh_interval": format_duration(f.refresh_interval_ms),
            "flush_interval": format_duration(f.flush_interval_ms),
            "retention": format_duration(f.retention_ms),
        },
    } | _suspend_dict(spec)


def _labels_dict(labels: pb.LabelSet) -> dict[str, str | list[str]]:
    """Labels as YAML shows them: name: value, or name: [values] for a name with several (as Gazette
    allows), so that listed specs apply back without dropping any."""
    values: dict[str, list[str]] = {}
    for name, value in lbl.pairs(labels):
        values.setdefault(name, []).append(value)
    return {k: v[0] if len(v) == 1 else v for k, v in values.items()}


def _suspend_dict(spec: pb.JournalSpec) -> dict[str, Any]:
    if not spec.HasField("suspend"):
        return {}
    level = pb.JournalSpec.Suspend.Level.Name(spec.suspend.level).lower()
    return {"suspend": {"level": level, "offset": spec.suspend.offset}}


def documents(loaded: Any, what: str = "journal") -> list[dict[str, Any]]:
    """The spec mappings of a loaded YAML document: one, a list, or ``{journals: [...]}`` (``shards``)."""
    if isinstance(loaded, dict) and f"{what}s" in loaded:
        loaded = loaded[f"{what}s"]
    if isinstance(loaded, dict):
        return [loaded]
    if isinstance(loaded, list):
        return loaded
    raise ValidationError("file", f"expected a {what} mapping, a list of them, or {{{what}s: [...]}}")


def spec_changes(old: pb.JournalSpec, new: pb.JournalSpec) -> dict[str, tuple[Any, Any]]:
    """The fields `new` changes, by dotted path (``fragment.length``), with their old and new values
    (as `spec_to_dict` shows them, which is exact: durations in ms-precise units)."""
    return _diff(spec_to_dict(old), spec_to_dict(new), "")


def _diff(a: dict[str, Any], b: dict[str, Any], at: str) -> dict[str, tuple[Any, Any]]:
    out: dict[str, tuple[Any, Any]] = {}
    for key in [*a, *(k for k in b if k not in a)]:
        x, y = a.get(key), b.get(key)
        if key == "fragment" and isinstance(x, dict) and isinstance(y, dict):
            out.update(_diff(x, y, "fragment."))
        elif x != y:
            out[at + key] = (x, y)
    return out


def given(d: dict[str, Any], path: str) -> bool:
    """Whether a spec mapping gives the field at dotted `path` itself (not left to its default)."""
    head, _, rest = path.partition(".")
    if head not in d:
        return False
    return not rest or (isinstance(d[head], dict) and rest in d[head])


# -- shard specs (`tidings shards apply`, `shards list --yaml`; docs/shards.md) ------------------------

SHARD_FIELDS = {
    "id", "sources", "max_txn_duration", "min_txn_duration", "hot_standbys", "disable", "disable_wait_for_ack",
    "labels", "recovery_log_prefix", "hint_prefix", "hint_backups", "ring_buffer_size", "read_channel_size",
    "revision", "delete",
}  # fmt: skip
SHARD_STATUS_FIELDS = frozenset({"primary", "status", "read_through", "lag"})  # what `shards list --yaml` adds


def _flag(d: dict[str, Any], name: str, ctx: str) -> bool:
    value = d.get(name, False)
    if not isinstance(value, bool):
        raise ValidationError(f"{ctx}.{name}", f"{value!r}: give true or false (unquoted)")
    return value


def shard_from_dict(d: dict[str, Any], ctx: str = "shard") -> pb.ShardSpec:
    """Build and validate a ShardSpec from a YAML mapping; errors name the field. A source is a
    journal name or ``{journal: NAME, min_offset: N}``."""
    if not isinstance(d, dict):
        raise ValidationError(ctx, "expected a mapping with at least `id` and `sources`")
    unknown = set(d) - SHARD_FIELDS - SHARD_STATUS_FIELDS
    if unknown:
        raise ValidationError(ctx, f"unknown field(s) {sorted(unknown)}; known: {sorted(SHARD_FIELDS)}")
    if "revision" in d and (_count(d["revision"], f"{ctx}.revision") < 0):
        raise ValidationError(f"{ctx}.revision", f"{d['revision']} must be 0 or more")
    if _flag(d, "delete", ctx):  # (only the id matters)
        validate.shard_id(str(d.get("id", "")), f"{ctx}.id")
        return pb.ShardSpec(id=str(d["id"]))
    sources = d.get("sources") or []
    if not isinstance(sources, list):
        sources = [sources]
    spec = pb.ShardSpec(
        id=str(d.get("id", "")),
        max_txn_duration_ms=_count(
            parse_duration_ms(d.get("max_txn_duration", "1s"), f"{ctx}.max_txn_duration"), f"{ctx}.max_txn_duration"
        ),
        min_txn_duration_ms=_count(
            parse_duration_ms(d.get("min_txn_duration", 0), f"{ctx}.min_txn_duration"), f"{ctx}.min_txn_duration"
        ),
        hot_standbys=_count(d.get("hot_standbys", 0), f"{ctx}.hot_standbys", INT32),
        disable=_flag(d, "disable", ctx),
        disable_wait_for_ack=_flag(d, "disable_wait_for_ack", ctx),
        labels=lbl.label_set(
            (str(k), str(one))
            for k, v in _mapping(d.get("labels"), f"{ctx}.labels").items()
            for one in (v if isinstance(v, list) else ["" if v is None else v])
        ),
        recovery_log_prefix=str(d.get("recovery_log_prefix") or ""),
        hint_prefix=str(d.get("hint_prefix") or ""),
        hint_backups=_count(d.get("hint_backups", 0), f"{ctx}.hint_backups", INT32),
        ring_buffer_size=_count(d.get("ring_buffer_size", 0), f"{ctx}.ring_buffer_size", INT32),
        read_channel_size=_count(d.get("read_channel_size", 0), f"{ctx}.read_channel_size", INT32),
    )
    for i, src in enumerate(sources):
        at = f"{ctx}.sources[{i}]"
        if isinstance(src, str):
            src = {"journal": src}
        src = _mapping(src, at)
        if set(src) - {"journal", "min_offset"}:
            raise ValidationError(at, f"unknown field(s) {sorted(set(src) - {'journal', 'min_offset'})}")
        spec.sources.add(
            journal=str(src.get("journal") or ""), min_offset=_count(src.get("min_offset", 0), f"{at}.min_offset")
        )
    validate.shard_spec(spec, ctx)
    return spec


def shard_to_dict(spec: pb.ShardSpec) -> dict[str, Any]:
    return {
        "id": spec.id,
        "sources": [
            s.journal if not s.min_offset else {"journal": s.journal, "min_offset": s.min_offset} for s in spec.sources
        ],
        "max_txn_duration": format_duration(spec.max_txn_duration_ms),
        "min_txn_duration": format_duration(spec.min_txn_duration_ms),
        "hot_standbys": spec.hot_standbys,
        "disable": spec.disable,
        "disable_wait_for_ack": spec.disable_wait_for_ack,
        "labels": _labels_dict(spec.labels),
        "recovery_log_prefix": spec.recovery_log_prefix,
        "hint_prefix": spec.hint_prefix,
        "hint_backups": spec.hint_backups,
        "ring_buffer_size": spec.ring_buffer_size,
        "read_channel_size": spec.read_channel_size,
    }
