"""Journal specs through `tidings journals apply`, `edit` and `delete`, against a real cluster: what
`list --yaml` prints applies back unchanged (every field, label value and duration), and apply or edit
changes exactly what the file or the editor changed, says so per journal (warning when an omitted field
returns to its default; --dry-run changes nothing) and never deletes or creates what it was not asked
to. Deleting asks first, and a mistake (an absent journal, a quoted "false", a revision that is no
number, an editor that cannot run) is one line naming it, never a traceback."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import yaml

from tests.cli._support import run
from tidings.protocol import labels as lbl
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.specs import spec_from_dict


async def _replication(ep: str, name: str) -> int:
    r = await run("journals", "list", "--json", broker=ep)
    return next(json.loads(line)["replication"] for line in r.stdout.splitlines() if json.loads(line)["name"] == name)


async def test_list_yaml_applies_unchanged_and_updates_are_reported(cluster, spec_file: Path, tmp_path) -> None:
    ep = cluster.brokers[0].endpoint
    r = await run("journals", "apply", str(spec_file), broker=ep)
    assert r.returncode == 0 and r.stdout.decode().splitlines() == ["created cli/hello"], r
    listed = tmp_path / "listed.yaml"
    listed.write_bytes((await run("journals", "list", "--yaml", broker=ep)).stdout)
    r = await run("journals", "apply", str(listed), broker=ep)
    assert r.returncode == 0 and r.stdout.decode().splitlines() == ["unchanged cli/hello"], r

    changed = tmp_path / "r2.yaml"
    changed.write_text(listed.read_text().replace("replication: 3", "replication: 2"))
    r = await run("journals", "apply", str(changed), broker=ep)
    assert r.returncode == 0 and r.stdout.decode().splitlines() == ["updated cli/hello: replication 3 -> 2"], r
    assert b"warning" not in r.stderr
    r = await run("journals", "apply", str(listed), broker=ep)  # (its revision is stale now)
    assert r.returncode == 1 and b"changed concurrently" in r.stderr and b"Traceback" not in r.stderr
    assert await _replication(ep, "cli/hello") == 2


async def test_a_partial_spec_warns_and_dry_run_changes_nothing(cluster, spec_file: Path, tmp_path) -> None:
    ep = cluster.brokers[0].endpoint
    await run("journals", "apply", str(spec_file), broker=ep)
    partial = tmp_path / "partial.yaml"
    partial.write_text("name: cli/hello\nreplication: 2\n")
    r = await run("journals", "apply", str(partial), "--dry-run", broker=ep)
    out, err = r.stdout.decode().splitlines(), r.stderr.decode()
    assert (
        r.returncode == 0
        and out[0].startswith("updated cli/hello: replication 3 -> 2; labels")
        and out[-1] == ("dry run: nothing applied")
    ), r
    assert "omits labels, fragment.length, fragment.compression_codec" in err and err.count("\n") == 1, err
    assert await _replication(ep, "cli/hello") == 3


async def test_delete_asks_first_and_absent_journals_are_named(cluster, spec_file: Path, tmp_path) -> None:
    ep = cluster.brokers[0].endpoint
    await run("journals", "apply", str(spec_file), broker=ep)
    r = await run("journals", "delete", "cli/hello", broker=ep)  # (stdin is no terminal: no one can confirm)
    assert r.returncode == 2 and b"needs --yes" in r.stderr
    r = await run("journals", "delete", "cli/hello", "--yes", broker=ep)
    assert r.returncode == 0 and r.stdout == b"deleted cli/hello\n"
    assert (await run("journals", "list", "--json", broker=ep)).stdout == b""
    for args, says in (
        (("journals", "delete", "cli/hello", "--yes"), "journal 'cli/hello' does not exist"),
        (("journals", "apply", "{tmp}/gone.yaml"), "journal 'cli/gone' does not exist: there is nothing to delete"),
        (("journals", "apply", "{tmp}/rev.yaml"), "does not exist, but the file expects it at revision 7"),
    ):
        (tmp_path / "gone.yaml").write_text("name: cli/gone\ndelete: true\n")
        (tmp_path / "rev.yaml").write_text("name: cli/gone\nrevision: 7\n")
        r = await run(*(a.format(tmp=tmp_path) for a in args), broker=ep)
        lines = r.stderr.decode().splitlines()
        assert r.returncode == 1 and len(lines) == 1 and says in lines[0], r


async def test_edit_applies_what_the_editor_changed_at_the_revision_it_read(cluster, spec_file: Path, tmp_path) -> None:
    """gazctl's edit: the specs in $EDITOR, applied at their revisions; no change, no apply; an
    edit that does not apply is kept in a file, named, to apply again."""
    ep = cluster.brokers[0].endpoint
    await run("journals", "apply", str(spec_file), broker=ep)
    r = await run(
        "journals", "edit", "cli/hello", broker=ep, env={"EDITOR": "sed -i 's/replication: 3/replication: 2/'"}
    )
    assert r.returncode == 0 and r.stdout.decode().splitlines() == ["updated cli/hello: replication 3 -> 2"], r
    assert await _replication(ep, "cli/hello") == 2
    r = await run("journals", "edit", "--selector", "app=cli", broker=ep, env={"EDITOR": "true"})
    assert r.returncode == 0 and r.stdout == b"no changes\n", r
    broken = {"EDITOR": "sed -i 's/replication: 2/replication: [/'", "TMPDIR": str(tmp_path)}
    r = await run("journals", "edit", "cli/hello", broker=ep, env=broken)
    lines = r.stderr.decode().splitlines()
    assert r.returncode == 2 and "is not valid YAML" in lines[0] and lines[1].startswith("your edit is in "), r
    kept = Path(lines[1].split()[4].rstrip(":"))
    assert kept.parent == tmp_path and "replication: [" in await asyncio.to_thread(kept.read_text)
    r = await run("journals", "edit", "cli/hello", "--selector", "app=cli", broker=ep, env={"EDITOR": "true"})
    assert r.returncode == 2 and b"one of them" in r.stderr
    r = await run("journals", "edit", "cli/hello", broker=ep, env={"EDITOR": "no-such-editor", "VISUAL": ""})
    lines = r.stderr.decode().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "cannot run the editor 'no-such-editor'" in lines[0], r


async def _listed(ep: str, name: str) -> dict:
    r = await run("journals", "list", "--json", broker=ep)
    return next(row for row in map(json.loads, r.stdout.splitlines()) if row["name"] == name)


async def test_list_yaml_of_a_two_week_retention_applies_and_edits(cluster, tmp_path: Path) -> None:
    """A duration of 1e6 s (about 11.6 days) or more, here `retention: 336h`, is listed in a form apply
    parses (not `1.2096e+06s`, as `:g` would print it): what `list --yaml` prints applies unchanged,
    and `edit` of the journal applies the user's change."""
    ep = cluster.brokers[0].endpoint
    spec = tmp_path / "two-weeks.yaml"
    spec.write_text("name: specs/kept\nreplication: 1\nlabels: {app: r25}\nfragment: {retention: 336h}\n")
    r = await run("journals", "apply", str(spec), broker=ep)
    assert r.returncode == 0 and r.stdout == b"created specs/kept\n", r

    listed = tmp_path / "listed.yaml"
    listed.write_bytes((await run("journals", "list", "--yaml", "--selector", "app=r25", broker=ep)).stdout)
    r = await run("journals", "apply", str(listed), broker=ep)
    assert r.returncode == 0 and r.stdout.decode().splitlines() == ["unchanged specs/kept"], r

    edit = {"EDITOR": "sed -i 's/replication: 1/replication: 2/'", "TMPDIR": str(tmp_path)}
    r = await run("journals", "edit", "specs/kept", broker=ep, env=edit)
    assert r.returncode == 0 and r.stdout.decode().splitlines() == ["updated specs/kept: replication 1 -> 2"], r
    row = await _listed(ep, "specs/kept")
    assert row["replication"] == 2 and row["fragment"]["retention"] in ("336h", "1209600s"), row


async def test_a_quoted_false_delete_does_not_delete(cluster, tmp_path: Path) -> None:
    """`delete: "false"` (quoted, as a template or `yq` writes it) is a non-empty string, truthy in
    Python: apply refuses it (delete takes true or false) or takes it as false; it never deletes."""
    ep = cluster.brokers[0].endpoint
    await cluster.create_journal("specs/keep", 1, labels={"app": "r25"})
    f = tmp_path / "quoted.yaml"
    f.write_text('name: specs/keep\nreplication: 1\nlabels: {app: r25}\ndelete: "false"\n')
    f.write_text(f.read_text() + f"fragment: {{length: 1MiB, stores: ['{cluster.store_url}'], refresh_interval: 1s}}\n")
    r = await run("journals", "apply", str(f), broker=ep)
    listed = (await run("journals", "list", "--json", broker=ep)).stdout
    assert b'"specs/keep"' in listed, (r, "the journal was deleted")
    assert b"deleted" not in r.stdout, r


async def test_a_revision_that_is_no_number_is_one_line(cluster, tmp_path: Path) -> None:
    """`revision: abc`, `revision:` (null) or a list is refused in one line naming the revision (exit 2),
    not a ValueError or TypeError traceback from int()."""
    ep = cluster.brokers[0].endpoint
    await cluster.create_journal("specs/rev", 1)
    for value in ("abc", "", "[5]"):
        f = tmp_path / "rev.yaml"
        f.write_text(f"name: specs/rev\nreplication: 1\nrevision: {value}\n")
        r = await run("journals", "apply", str(f), broker=ep)
        err = r.stderr.decode()
        lines = err.splitlines()
        assert "Traceback" not in err and r.returncode == 2, (value, err)
        assert len(lines) == 1 and "revision" in lines[0], (value, err)


async def test_edit_with_an_editor_that_cannot_run_is_one_line(cluster, tmp_path: Path) -> None:
    """$EDITOR naming no program, $EDITOR with an unbalanced quote, and neither $VISUAL nor $EDITOR
    set where there is no `vi`: each is one `error: ` line naming EDITOR, not a FileNotFoundError or
    ValueError traceback (with a temp file left behind, unnamed)."""
    ep = cluster.brokers[0].endpoint
    await cluster.create_journal("specs/ed", 1)
    no_vi = tmp_path / "bin"
    no_vi.mkdir()
    base = {"VISUAL": "", "EDITOR": "", "TMPDIR": str(tmp_path)}  # (empty: unset, as the command reads them)
    for env in (
        base | {"EDITOR": "/nonexistent/editor"},
        base | {"EDITOR": "'unbalanced"},
        base | {"PATH": str(no_vi)},
    ):
        r = await run("journals", "edit", "specs/ed", broker=ep, env=env)
        err = r.stderr.decode()
        lines = err.splitlines()
        assert "Traceback" not in err and r.returncode in (1, 2), (env.get("EDITOR"), err)
        assert len(lines) == 1 and lines[0].startswith("error: ") and "EDITOR" in lines[0], (env.get("EDITOR"), err)


async def test_edit_of_a_journal_deleted_meanwhile(cluster, tmp_path: Path) -> None:
    """The journal is deleted while the editor is open: the edit (at the revision it read) is refused
    naming the journal as absent, nothing is created, and the edit is kept in a file."""
    import shlex
    import sys

    ep = cluster.brokers[0].endpoint
    await cluster.create_journal("specs/went", 1)
    delete = f"{shlex.quote(sys.executable)} -m tidings.cli journals delete specs/went --yes --broker {ep} >/dev/null"
    script = delete + " && sed -i 's/replication: 1/replication: 2/' \"$0\""
    editor = "sh -c " + shlex.quote(script)
    r = await run("journals", "edit", "specs/went", broker=ep, env={"EDITOR": editor, "TMPDIR": str(tmp_path)})
    lines = r.stderr.decode().splitlines()
    assert r.returncode == 1 and "Traceback" not in r.stderr.decode(), r
    assert any("journal 'specs/went' does not exist" in line for line in lines), r  # (after "your edit is in")
    assert any(line.startswith("your edit is in ") for line in lines) and len(lines) == 2, r
    assert b"specs/went" not in (await run("journals", "list", "--json", broker=ep)).stdout


async def test_list_yaml_edit_apply_keeps_a_multi_valued_label(cluster, tmp_path: Path) -> None:
    """A LabelSet may hold several values per name (labels.py; Gazette's too): tag=blue and tag=red.
    An edit of replication alone in what `list --yaml` prints, applied, keeps both values in etcd (a
    listing of labels as a mapping would keep one, and apply would drop the other unreported)."""
    ep = cluster.brokers[0].endpoint
    spec = spec_from_dict({"name": "shapes/tags", "replication": 1, "fragment": {"stores": [cluster.store_url]}})
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
        now = next(j.spec for j in (await c.list()).journals if j.spec.name == "shapes/tags")
    assert now.replication == 2
    assert lbl.pairs(now.labels) == [("app", "r26"), ("tag", "blue"), ("tag", "red")], (
        f"labels changed by an edit of replication: {lbl.pairs(now.labels)}; apply said {r.stdout!r}"
    )


async def test_list_yaml_apply_round_trip_is_unchanged_for_odd_durations(cluster, tmp_path: Path) -> None:
    """Ms-precise, minute and hour durations, a suspend, read-only flags and label values YAML would
    read as other types list and apply back as `unchanged`."""
    ep = cluster.brokers[0].endpoint
    f = tmp_path / "j.yaml"
    f.write_text(
        "name: shapes/odd\nreplication: 1\nflags: read-only\nmax_append_rate: 1KiB\n"
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
    assert r.returncode == 0 and b"unchanged shapes/odd" in r.stdout, (r.stdout, r.stderr)
    async with cluster.client(0) as c:
        s = next(j.spec for j in (await c.list()).journals if j.spec.name == "shapes/odd")
    assert (s.fragment.refresh_interval_ms, s.fragment.flush_interval_ms, s.fragment.retention_ms) == (
        1001,
        5_400_000,
        1500,
    )
    assert dict(lbl.pairs(s.labels))["v"] == "yes" and s.max_append_rate == 1024
