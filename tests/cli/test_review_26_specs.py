"""Review 26: a journal spec's round trip through `journals list --yaml` and `journals apply` (the
`journals edit` path): an edit of one field must not change another field's value."""

from __future__ import annotations

from pathlib import Path

import yaml

from tests.cli.test_cli import run
from tidings.protocol import labels as lbl
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.specs import spec_from_dict


async def test_review_26_list_yaml_edit_apply_keeps_a_multi_valued_label(cluster, tmp_path: Path) -> None:
    """A LabelSet may hold several values per name (labels.py; Gazette's too): tag=blue and tag=red.
    `list --yaml` prints labels as a mapping, so one value is gone from the listing; raising
    replication there and applying it drops tag=blue from etcd, and apply's report names only
    replication."""
    ep = cluster.brokers[0].endpoint
    spec = spec_from_dict({"name": "r26/tags", "replication": 1, "fragment": {"stores": [cluster.store_url]}})
    spec.labels.CopyFrom(lbl.label_set([("app", "r26"), ("tag", "blue"), ("tag", "red")]))
    async with cluster.client(0) as c:
        await c.apply([pb.ApplyRequest.Change(upsert=spec)])
    r = await run("journals", "list", "--yaml", "--selector", "app=r26", broker=ep)
    assert r.returncode == 0, r.stderr
    doc = yaml.safe_load(r.stdout)
    doc["journals"][0]["replication"] = 2  # the user's edit: nothing else
    f = tmp_path / "edited.yaml"
    f.write_text(yaml.safe_dump(doc, sort_keys=False))
    r = await run("journals", "apply", str(f), broker=ep)
    assert r.returncode == 0, r.stderr
    async with cluster.client(0) as c:
        now = next(j.spec for j in (await c.list()).journals if j.spec.name == "r26/tags")
    assert now.replication == 2
    assert lbl.pairs(now.labels) == [("app", "r26"), ("tag", "blue"), ("tag", "red")], (
        f"labels changed by an edit of replication: {lbl.pairs(now.labels)}; apply said {r.stdout!r}"
    )


async def test_review_26_list_yaml_apply_round_trip_is_unchanged_for_odd_durations(cluster, tmp_path: Path) -> None:
    """Held up (if it passes): ms-precise, minute and hour durations, a suspend, read-only flags and
    label values YAML would read as other types list and apply back as `unchanged`."""
    ep = cluster.brokers[0].endpoint
    f = tmp_path / "j.yaml"
    f.write_text(
        "name: r26/odd\nreplication: 1\nflags: read-only\nmax_append_rate: 1KiB\n"
        "labels: {app: r26odd, v: 'yes', n: '1.0', e: '', z: '0x10'}\n"
        "fragment: {length: 1048577, compression_codec: zstd, refresh_interval: 1001ms,"
        f" flush_interval: 90m, retention: 1.5s, stores: ['{cluster.store_url}']}}\n"
    )
    r = await run("journals", "apply", str(f), broker=ep)
    assert r.returncode == 0, r.stderr
    r = await run("journals", "list", "--yaml", "--selector", "app=r26odd", broker=ep)
    listed = tmp_path / "listed.yaml"
    listed.write_bytes(r.stdout)
    r = await run("journals", "apply", str(listed), broker=ep)
    assert r.returncode == 0 and b"unchanged r26/odd" in r.stdout, (r.stdout, r.stderr)
    async with cluster.client(0) as c:
        s = next(j.spec for j in (await c.list()).journals if j.spec.name == "r26/odd")
    assert (s.fragment.refresh_interval_ms, s.fragment.flush_interval_ms, s.fragment.retention_ms) == (
        1001,
        5_400_000,
        1500,
    )
    assert dict(lbl.pairs(s.labels))["v"] == "yes" and s.max_append_rate == 1024
